"""The gradient L2 norm without Apex / Transformer Engine: computed on the device, no host round trips.

Without Apex or TE, megatron-core 0.16.1's ``clip_grads`` takes
``megatron.core.utils.local_multi_tensor_l2_norm`` as its ``l2_norm_impl``.  That function
builds a host tensor from the per-parameter norms (``torch.tensor(list of 0-d device
tensors)``), so every parameter's norm is read back to the host one at a time: a stream
synchronization per parameter tensor per step (916 for the 12-layer benchmark model), each
one draining the GPU queue.  The replacement computes the per-tensor norms with one
``torch._foreach_norm``, stacks them and takes the norm of the stack on the device, returning
the same ``(norm as a float32 tensor of shape [1], None)`` on the gradients' device.

Same value up to the summation order of the final reduction (a float32 norm of the per-tensor
norms either way; the per-tensor norms are those of ``torch.norm``).  ``clip_grads`` reads the
result back once (``.item()`` after the model-parallel all-reduce), as before.
"""
from __future__ import annotations

NAME = "grad_norm_on_device"
TARGET = "megatron.core.utils.local_multi_tensor_l2_norm"
TARGET_SHA256 = "01526c55444a73bd00bebbf536bc92f9ac80eadca0cbbbfbd3a1d8c99cb07548"

_state = {"original": None}


def _clip_grads():
    from megatron.core.optimizer import clip_grads
    return clip_grads


def target():
    from megatron.core import utils
    return utils.local_multi_tensor_l2_norm


def device_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``local_multi_tensor_l2_norm``'s contract (the L2 norm of all tensors of ``tensor_lists``
    as a float32 tensor of shape [1]; no per-tensor norms) without reading anything back."""
    import torch
    tensors = [t for group in tensor_lists for t in group]
    if not tensors:
        from megatron.core import utils
        return utils.local_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args)
    norms = torch._foreach_norm(tensors)
    dtype = torch.promote_types(torch.float32, norms[0].dtype)
    for n in norms[1:]:
        dtype = torch.promote_types(dtype, n.dtype)
    stacked = torch.stack([n if n.dtype == dtype else n.to(dtype) for n in norms])
    return torch.linalg.vector_norm(stacked).to(torch.float32).reshape(1), None


def needed() -> bool:
    from megatron.core import utils
    return _clip_grads().l2_norm_impl is utils.local_multi_tensor_l2_norm


def is_applied() -> bool:
    return _state["original"] is not None


def apply() -> None:
    if is_applied() or not needed():
        return
    cg = _clip_grads()
    _state["original"] = cg.l2_norm_impl
    cg.l2_norm_impl = device_multi_tensor_l2_norm


def undo() -> None:
    if not is_applied():
        return
    _clip_grads().l2_norm_impl = _state["original"]
    _state["original"] = None
