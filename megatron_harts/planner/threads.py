"""Independent planner passes side by side: the compiled search releases the GIL while it runs, so passes
over one instance (L2's two search chains) use a machine's cores."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

__all__ = ["PLAN_THREADS", "plan_threads", "concurrently", "soon"]

#: threads of the passes a planner runs side by side (``concurrently``; None: the machine's cores)
PLAN_THREADS: Optional[int] = None


def plan_threads(tasks: int) -> int:
    """Threads for ``tasks`` independent passes: ``PLAN_THREADS``, else the machine's cores, at most ``tasks``."""
    return max(1, min(tasks, PLAN_THREADS or os.cpu_count() or 1))


def concurrently(fn, items) -> list:
    """``[fn(x) for x in items]``, on up to ``plan_threads`` threads.  Each result depends on its item only:
    the same list either way."""
    items = list(items)
    workers = plan_threads(len(items))
    if workers < 2:
        return [fn(x) for x in items]
    return list(_thread_pool(workers).map(fn, items))


def soon(fn, item):
    """``fn(item)`` begun now on a thread of ``concurrently``'s pool where ``plan_threads(2)`` allows two threads
    (else computed when asked), so that the caller's own work runs beside it: a callable returning the result
    (raising what ``fn`` raised).  The result depends on the item only: the same either way."""
    workers = plan_threads(2)
    if workers < 2:
        return lambda: fn(item)
    return _thread_pool(workers).submit(fn, item).result


#: the pools of ``concurrently``, by (process, threads): kept between plans (starting a pool's threads
#: cost Tree-Step 256 DP 8 about 2 ms a pass, 10 of its 60 ms), never shared with a forked child
_POOLS: dict = {}


def _thread_pool(workers: int) -> ThreadPoolExecutor:
    key = (os.getpid(), workers)
    pool = _POOLS.get(key)
    if pool is None:
        pool = _POOLS[key] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="plan")
    return pool
