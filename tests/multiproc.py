"""Run a test worker on N spawned processes with a deadline (test helper only).

A gloo collective that waits forever must fail the test, never hang CI: every
worker gets ``timeout`` seconds, stragglers are killed, and the exit codes are
asserted.  Each rank runs torch on one thread: the ranks of a launch, and the
other test worker beside them, share the machine's cores (torch's default of a
thread per core would put several spinning threads on each).
"""
import multiprocessing


def _one_thread(target, rank: int, world: int, args: tuple) -> None:
    import torch
    torch.set_num_threads(1)
    target(rank, world, *args)


def run_ranks(target, world: int, args: tuple, timeout: float = 120.0) -> None:
    """Start ``target(rank, world, *args)`` for every rank; assert all exited 0 within ``timeout``."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_one_thread, args=(target, r, world, args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    assert all(c == 0 for c in codes), f"worker exit codes {codes} (a negative code is a signal: killed at the deadline or crashed)"
