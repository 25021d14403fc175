"""megatron-core's gradient-accumulation fusion without Apex: the weight gradient GEMM of a linear
accumulates straight into its fp32 ``main_grad``, through torch.

With ``gradient_accumulation_fusion`` megatron-core 0.16.1's linears
(``LinearWithGradAccumulationAndAsyncCommunication.backward``) hand their weight gradient to
Apex's ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(input, grad_output, main_grad)``:
one GEMM computing ``main_grad += grad_output^T @ input`` with fp32 accumulation, and a placeholder
``.grad`` that megatron DDP's hook then skips (``grad_added_to_main_grad``).  Without Apex the
flag is refused, so every linear instead computes its weight gradient as a bf16 tensor, which
autograd stores and DDP's hook adds into ``main_grad``: one more allocation, one more kernel and
one more rounding (the gradient to bf16) per weight per microbatch.

This patch gives ``megatron.core.tensor_parallel.layers`` a ``fused_weight_gradient_mlp_cuda``
whose two functions do the same accumulation with torch (:func:`accumulate`: on CUDA one
``addmm`` of the 16-bit operands into the fp32 ``main_grad`` with ``out_dtype=float32``, in place;
elsewhere the operands promoted to ``main_grad``'s dtype), and marks the fusion available.  The
driver turns ``gradient_accumulation_fusion`` on for CUDA runs (``--no-gradient-accumulation-fusion``
keeps it off).  Values: the weight gradients are the unfused ones without their rounding to
bf16 (fp32 products accumulated in fp32).  With Apex installed nothing is patched.
"""
from __future__ import annotations

NAME = "wgrad_accumulation"
TARGET = "megatron.core.tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication.backward"
TARGET_SHA256 = "b50b2ea4a1c9027040516475a8b40a0bd86ddf9e17fcb5c2c56feb3156c3ae3e"

_MISSING = object()
_state = {"saved": None}


def _module():
    from megatron.core.tensor_parallel import layers
    return layers


def target():
    return _module().LinearWithGradAccumulationAndAsyncCommunication.backward


def accumulate(main_grad, grad_output, total_input) -> None:
    """``main_grad += grad_output^T @ total_input`` (``grad_output`` [N, out], ``total_input`` [N, in],
    ``main_grad`` [out, in]), the product accumulated in ``main_grad``'s dtype."""
    import torch
    a, b = grad_output.t(), total_input
    if a.dtype == main_grad.dtype and b.dtype == main_grad.dtype:
        main_grad.addmm_(a, b)
    elif main_grad.is_cuda and main_grad.dtype == torch.float32 and a.dtype == b.dtype \
            and a.dtype in (torch.bfloat16, torch.float16):
        torch.addmm(main_grad, a, b, out_dtype=torch.float32, out=main_grad)
    else:
        main_grad.addmm_(a.to(main_grad.dtype), b.to(main_grad.dtype))


class TorchWgradAccumulation:
    """Apex's ``fused_weight_gradient_mlp_cuda`` interface (the two functions megatron calls)."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        accumulate(main_grad, grad_output, total_input)

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input, grad_output, main_grad):
        accumulate(main_grad, grad_output, total_input)


def available() -> bool:
    """torch has the 16-bit x 16-bit -> fp32 ``addmm`` the CUDA path runs (``aten::addmm.dtype_out``)."""
    import torch
    return hasattr(torch.ops.aten.addmm, "dtype_out")


def needed() -> bool:
    """Apex's extension is missing (megatron would refuse the fusion) and torch can stand in."""
    layers = _module()
    saved = _state["saved"]
    apex = saved[0] if saved is not None else layers._grad_accum_fusion_available
    return not apex and available()


def is_applied() -> bool:
    return _state["saved"] is not None


def apply() -> None:
    if is_applied() or not needed():
        return
    layers = _module()
    _state["saved"] = (layers._grad_accum_fusion_available, getattr(layers, "fused_weight_gradient_mlp_cuda",
                                                                      _MISSING))
    layers.fused_weight_gradient_mlp_cuda = TorchWgradAccumulation
    layers._grad_accum_fusion_available = True


def undo() -> None:
    if not is_applied():
        return
    layers = _module()
    flag, mod = _state["saved"]
    layers._grad_accum_fusion_available = flag
    if mod is _MISSING:
        del layers.fused_weight_gradient_mlp_cuda
    else:
        layers.fused_weight_gradient_mlp_cuda = mod
    _state["saved"] = None
