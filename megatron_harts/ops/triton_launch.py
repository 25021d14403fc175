"""Launching autotuned Triton kernels whose configuration is already chosen, without the tuner's key work.

Every launch of an autotuned kernel (``kernel[grid](**args)``) first goes through the autotuner:
Triton's ``Autotuner.run`` rebuilds the tuning key from the arguments (dict merges filtered by
list membership over ~30 argument names), and fla's ``CachedAutotuner.run`` builds the same key
once more (``AutotuneKey.build``) before calling it: about 65 us of the ~130 us a KDA launch costs
the H200's host under cProfile, 13 launches per fla KDA call (forward + backward).  Without them a
call takes 0.4-0.6 ms less host time (``benchmarks/bench_kda_backends.py --full-launch``); in a
host-bound step that is time the GPU waits.

``fast_autotuned_launches()`` replaces ``run`` of ``triton.runtime.autotuner.Autotuner`` (and of
fla's ``CachedAutotuner`` where fla is imported) by a wrapper that computes the same key in one
pass and, when the tuner already holds a configuration for it, launches the kernel with that
configuration directly (``self.fn.run(**args, **config.all_kwargs())``, what the full path ends
with).  A tuner of one configuration (``ops/triton_tuning.limit_autotuning(1)`` makes every tuner one)
launches it directly, as Triton's ``run`` does.  Everything else takes the full path unchanged:
the first launch of a key (benchmarking, fla's config files), positional arguments,
configurations with a ``pre_hook``, and fla's ``FLA_CACHE_MODE=ALWAYS`` (which re-reads its
files on every launch).

Invariant: the fast path launches the same compiled kernel with the same configuration as the
full path, so results are bitwise those of the full path (tests/test_kda_fla.py holds them equal
on the GPU; tests/test_triton_launch.py checks the key against Triton's on a stand-in tuner).
"""
from __future__ import annotations

import sys
from typing import Callable, Dict, Tuple

__all__ = ["fast_autotuned_launches", "tuning_key", "FAST_LAUNCH_STATS"]

#: class -> its original ``run`` while the fast path is installed
_PATCHED: Dict[type, Callable] = {}

#: launches that took the fast path (for tests and benchmarks)
FAST_LAUNCH_STATS = {"fast": 0}


def tuning_key(keys, arg_names: frozenset, kwargs: dict) -> Tuple:
    """The autotuner's cache key of a launch by keyword: the values of ``keys`` present, then the
    dtype (as a string) of every argument that has one, in the launch's argument order (Triton
    3.6's ``Autotuner.run`` and fla 0.6.0's ``AutotuneKey.build`` both compute this tuple)."""
    key = [kwargs[k] for k in keys if k in kwargs]
    key.extend(str(v.dtype) for k, v in kwargs.items() if k in arg_names and hasattr(v, "dtype"))
    return tuple(key)


def _fast_run(original: Callable) -> Callable:
    def run(self, *args, **kwargs):
        if args or not self.configs:
            return original(self, *args, **kwargs)
        if len(self.configs) == 1:             # Triton's run launches it whatever the cache holds
            config = self.configs[0]
        else:
            names = self.__dict__.get("_harts_arg_set")
            if names is None:
                names = self._harts_arg_set = frozenset(self.arg_names)
            config = self.cache.get(tuning_key(self.keys, names, kwargs))
        if config is None or config.pre_hook is not None:
            return original(self, *args, **kwargs)
        FAST_LAUNCH_STATS["fast"] += 1
        self.best_config = config
        return self.fn.run(**kwargs, **config.all_kwargs())

    run.__wrapped__ = original
    return run


def _classes():
    from triton.runtime.autotuner import Autotuner
    classes = [Autotuner]
    cache = sys.modules.get("fla.ops.utils.cache")
    if cache is not None and hasattr(cache, "CachedAutotuner"):
        mode = getattr(getattr(cache, "FLA_CACHE_MODE", None), "name", None)
        if mode != "ALWAYS":
            classes.append(cache.CachedAutotuner)
    return classes


def fast_autotuned_launches() -> Callable[[], None]:
    """Install the fast path (idempotent; call after importing fla to cover its tuners); returns the undo.

    Raises ``ImportError`` where Triton is not installed.
    """
    for cls in _classes():
        if cls in _PATCHED:
            continue
        original = cls.__dict__["run"]
        _PATCHED[cls] = original
        cls.run = _fast_run(original)

    def undo() -> None:
        for cls, original in list(_PATCHED.items()):
            cls.run = original
            del _PATCHED[cls]

    return undo
