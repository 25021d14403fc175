"""The planner's compiled routines (megatron_harts._C, built from csrc/ by ``python setup.py build_ext --inplace``).

Every routine but L2's local search (``_C.l2_search``) has a pure-Python reference beside its caller,
and tests hold the two equal.  Without the extension the references run (slower; said once, with
one warning, the first time a routine is looked up) and ``l2.plan_l2`` returns L1's
plan (said once too).  An extension that is built but lacks a routine is out of date: looking the
routine up raises ``ImportError`` naming the rebuild command.  A compiled routine's errors are not
caught.
"""
import warnings
from typing import Any, List, Optional

__all__ = ["compiled", "CompiledCoreMissing"]

_SAID: List[bool] = []


class CompiledCoreMissing(RuntimeWarning):
    """megatron_harts._C is not built: the planner runs its Python references."""


def compiled(name: str) -> Optional[Any]:
    """The routine ``name`` of megatron_harts._C; None (with one warning per process) when the extension
    is not built; ``ImportError`` when it is built without that routine."""
    try:
        from megatron_harts import _C
    except ImportError:
        if not _SAID:
            _SAID.append(True)
            warnings.warn("megatron_harts._C is not built (python setup.py build_ext --inplace): the planner "
                          "runs its Python references, slower, and L2 returns L1's plans", CompiledCoreMissing,
                          stacklevel=2)
        return None
    routine = getattr(_C, name, None)
    if routine is None:
        raise ImportError(f"megatron_harts._C has no routine {name!r}: it is older than the sources; rebuild it "
                          f"with python setup.py build_ext --inplace")
    return routine
