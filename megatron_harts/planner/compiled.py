"""The planner's compiled routines (megatron_harts._C, built from csrc/ when a compiler is there).

Every routine but L2's local search (``_C.l2_search``) has a pure-Python reference beside its caller,
and tests hold the two equal; without the extension the references run, and ``l2_search.plan_l2_search``
returns L1's plan with one warning.  A compiled routine's errors are not caught.
"""
from typing import Any, Optional

__all__ = ["compiled"]


def compiled(name: str) -> Optional[Any]:
    """The routine ``name`` of megatron_harts._C, or None when the extension (or that routine) is not built."""
    try:
        from megatron_harts import _C
    except ImportError:
        return None
    return getattr(_C, name, None)
