"""Gradient clipping's scale without Apex / Transformer Engine: one multi-tensor multiply.

Without Apex or TE, megatron-core 0.16.1's ``clip_grads`` (and the fp16 optimizer's parameter
copy) take ``megatron.core.utils.local_multi_tensor_scale`` as ``multi_tensor_scale_impl``.
That function loops over the tensors in Python, ``dst.copy_(src * scale)``: two launches per
gradient tensor whenever the gradient norm is clipped (about 1800 for the 12-layer benchmark
model).  The replacement does the same arithmetic with ``torch._foreach_mul`` (in place when
the destination is the source, as in clipping) and ``torch._foreach_copy_``: the same products,
written to the same tensors.
"""
from __future__ import annotations

NAME = "foreach_multi_tensor_scale"
TARGET = "megatron.core.utils.local_multi_tensor_scale"
TARGET_SHA256 = "a271d86b61250d2f00bad84f72ecd194291f5be4a5e1c80a24703dafe25d9171"

_state = {"original": None}


def _users():
    from megatron.core.optimizer import clip_grads, optimizer
    return clip_grads, optimizer


def target():
    from megatron.core import utils
    return utils.local_multi_tensor_scale


def foreach_multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``local_multi_tensor_scale``'s contract: ``tensor_lists[1][i]`` gets ``tensor_lists[0][i] * scale``."""
    import torch
    src, dst = list(tensor_lists[0]), list(tensor_lists[1])
    if len(src) != len(dst):
        raise ValueError(f"scale of {len(src)} tensors into {len(dst)}")
    if not src:
        return
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def needed() -> bool:
    from megatron.core import utils
    return any(getattr(m, "multi_tensor_scale_impl", None) is utils.local_multi_tensor_scale for m in _users())


def is_applied() -> bool:
    return _state["original"] is not None


def apply() -> None:
    if is_applied() or not needed():
        return
    from megatron.core import utils
    _state["original"] = [(m, m.multi_tensor_scale_impl) for m in _users()
                          if m.multi_tensor_scale_impl is utils.local_multi_tensor_scale]
    for m, _ in _state["original"]:
        m.multi_tensor_scale_impl = foreach_multi_tensor_scale


def undo() -> None:
    if not is_applied():
        return
    for m, original in _state["original"]:
        m.multi_tensor_scale_impl = original
    _state["original"] = None
