"""Router gating without Transformer Engine: define ``moe_utils.te_general_gemm``.

megatron-core 0.16.1 imports ``te_general_gemm`` inside a ``try`` that fails
without Transformer Engine, and never binds the name in the ``except``
branch, yet ``RouterGatingLinearFunction.forward`` reads it unconditionally
(``if te_general_gemm is not None ...``): every MoE router forward raises
NameError.  The patch binds the name to ``None``, which selects the plain
``torch.mm``/``addmm`` branch already written upstream.  When TE is installed
the name exists and the patch is not needed (``apply`` then changes nothing).
"""
from __future__ import annotations

NAME = "router_gating_te_general_gemm"
TARGET = "megatron.core.transformer.moe.moe_utils.RouterGatingLinearFunction.forward"
TARGET_SHA256 = "dcba4f9f02b30a3662d27126739a667cbaf345a82443d1a0cff5792491b95580"

_MISSING = object()
_state = {"applied": False}


def _moe_utils():
    from megatron.core.transformer.moe import moe_utils
    return moe_utils


def target():
    return _moe_utils().RouterGatingLinearFunction.forward


def needed() -> bool:
    return not hasattr(_moe_utils(), "te_general_gemm")


def is_applied() -> bool:
    return _state["applied"]


def apply() -> None:
    if _state["applied"] or not needed():
        return
    _moe_utils().te_general_gemm = None
    _state["applied"] = True


def undo() -> None:
    if not _state["applied"]:
        return
    mod = _moe_utils()
    if getattr(mod, "te_general_gemm", _MISSING) is None:
        del mod.te_general_gemm
    _state["applied"] = False
