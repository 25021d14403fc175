"""How many configurations Triton's autotuners try (fla's KDA kernels and ours).

fla autotunes each of its kernels over ~150 configurations, per dtype and head shape, the first
time a process runs it: minutes of compilation before the first step of a run on a fresh machine.
Results do not depend on the configuration (only the time does), so runs that check numerics, and
short benchmarks whose compile time would dominate, can cap the search.

``limit_autotuning(n)`` makes every ``triton.runtime.autotuner.Autotuner`` keep at most ``n`` of its
configurations (those with the fewest pipeline stages first: they compile on every GPU and need the
least shared memory) when it first runs.  One limit holds per process; it returns a function that
restores full autotuning for autotuners that have not run yet.
"""
from typing import Callable

__all__ = ["limit_autotuning", "kept_configs"]

_ACTIVE = {"n": 0, "original": None}


def kept_configs(configs: list, n: int) -> list:
    """The at most ``n`` configurations an autotuner keeps (stable: fewest ``num_stages`` first)."""
    if n <= 0 or len(configs) <= n:
        return list(configs)
    return sorted(configs, key=lambda c: getattr(c, "num_stages", 0))[:n]


def limit_autotuning(n: int) -> Callable[[], None]:
    """Cap every Triton autotuner of this process at ``n`` configurations (``n`` >= 1); returns the undo.

    Raises ``ValueError`` for ``n`` < 1 and ``ImportError`` where Triton is not installed.
    """
    if int(n) < 1:
        raise ValueError(f"limit_autotuning: n must be >= 1, got {n}")
    from triton.runtime.autotuner import Autotuner

    if _ACTIVE["original"] is None:
        original = Autotuner.run

        def run(self, *args, **kwargs):
            limit = _ACTIVE["n"]
            if limit > 0 and len(self.configs) > limit:
                self.configs = kept_configs(self.configs, limit)
            return original(self, *args, **kwargs)

        _ACTIVE["original"] = original
        Autotuner.run = run
    _ACTIVE["n"] = int(n)

    def undo() -> None:
        if _ACTIVE["original"] is not None:
            Autotuner.run = _ACTIVE["original"]
        _ACTIVE.update(n=0, original=None)

    return undo
