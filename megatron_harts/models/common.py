"""Tensor-parallel plumbing and sequence helpers shared by the KDA and MLA modules.

Gradient convention inside a tensor-parallel attention module (one TP rank owns
a slice of the heads):

- the module input enters once through :func:`tp_input` (SP: all-gather of the
  rows, backward reduce-scatter; no SP: ``copy_to_tensor_model_parallel_region``,
  backward all-reduce), so every consumer inside may produce a *partial* input
  gradient and exactly one reduction sums them;
- weights replicated over TP ranks (low-rank down projections, per-head-dim
  norms) are read through :func:`tp_replicated`, whose backward all-reduces their
  gradient, so every rank holds the full gradient of its replicated copy.
- head-sharded linears are megatron's Column/RowParallelLinear; the column ones
  are built by :func:`local_column_linear` on already gathered inputs (no
  communication of their own).
"""
from __future__ import annotations

import copy
import warnings
from typing import List, Optional, Sequence, Tuple

import torch

from megatron.core import tensor_parallel

from ..layout import host_to_device
from ..ops.kda_elementwise import fusable, triton_available
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)


_SAID_NO_TRITON = []


def use_fused_kernels(config, t: torch.Tensor) -> bool:
    """Whether a module runs its fused kernels (``ops.kda_elementwise``, ``ops.router_topk``,
    ``ops.moe_gather``) on ``t``: the config asks for them (``fused_kernels``) and they take the tensor
    (CUDA, 16/32-bit floats).  The one place this is decided; asked for on a CUDA tensor without Triton,
    it says so once per process and the eager chains run."""
    if not getattr(config, "fused_kernels", False):
        return False
    if fusable(t):
        return True
    if t.is_cuda and not triton_available() and not _SAID_NO_TRITON:
        _SAID_NO_TRITON.append(True)
        warnings.warn("Triton is not installed: the KDA layers' elementwise chains, the router's top-k and the "
                      "MoE gathers run as eager torch ops, not as fused kernels (--no-tree-fused-kernels asks for "
                      "that and silences this warning)", RuntimeWarning, stacklevel=2)
    return False


def tp_size(group) -> int:
    return 1 if group is None else torch.distributed.get_world_size(group)


def tp_rank(group) -> int:
    return 0 if group is None else torch.distributed.get_rank(group)


def tp_input(x: torch.Tensor, config, tp_group) -> torch.Tensor:
    """The module input as seen by head-sharded consumers (see module docstring)."""
    if tp_size(tp_group) == 1:
        return x
    if config.sequence_parallel:
        return gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=tp_group)
    return copy_to_tensor_model_parallel_region(x, group=tp_group)


def tp_replicated(t: torch.Tensor, tp_group) -> torch.Tensor:
    """A TP-replicated tensor whose gradient is all-reduced over the TP group in backward."""
    if tp_size(tp_group) == 1:
        return t
    return copy_to_tensor_model_parallel_region(t, group=tp_group)


def local_column_linear(input_size, output_size, config, tp_group, init_method=None):
    """ColumnParallelLinear over already gathered inputs: no communication of its own."""
    cfg = copy.copy(config)
    cfg.sequence_parallel = False
    return tensor_parallel.ColumnParallelLinear(
        input_size, output_size, config=cfg, init_method=init_method or config.init_method, bias=False,
        gather_output=False, skip_bias_add=True, disable_grad_reduce=True, tp_group=tp_group)


def rows_linear(layer, x: torch.Tensor) -> torch.Tensor:
    """A megatron linear applied to rows [N, in] (megatron linears take [s, b, in] and return (out, bias))."""
    return layer(x.unsqueeze(1))[0].squeeze(1)


class _SharedInputLinears(torch.autograd.Function):
    """``x @ cat(weights).T``: the linears reading one input as one GEMM each way (see
    :func:`shared_input_linears`).  ``owners[i]``: the megatron linear owning ``weights[i]`` (its weight
    gradient then follows that linear's gradient-accumulation fusion), or None (a plain tensor)."""

    @staticmethod
    def forward(ctx, x, owners, *weights):
        # the weights themselves, as a linear keeps them: their concatenation is made again in the backward
        # rather than held with the graph
        ctx.save_for_backward(x, *weights)
        ctx.owners = owners
        return x.mm(_concatenated(weights).t())

    @staticmethod
    def backward(ctx, dy):
        x, *weights = ctx.saved_tensors
        dx = dy.mm(_concatenated(weights)) if ctx.needs_input_grad[0] else None
        grads, off = [], 0
        for i, w in enumerate(weights):
            n = int(w.shape[0])
            g, off = dy[:, off:off + n], off + n
            if not ctx.needs_input_grad[2 + i]:
                grads.append(None)
            elif ctx.owners[i] is not None and getattr(ctx.owners[i], "gradient_accumulation_fusion", False):
                grads.append(_accumulate_main_grad(ctx.owners[i].weight, g, x))
            else:
                grads.append(g.t().mm(x))
        return (dx, None, *grads)


def _concatenated(weights) -> torch.Tensor:
    return torch.cat(weights) if len(weights) > 1 else weights[0]


def _accumulate_main_grad(weight, grad_output, total_input):
    """A linear's weight gradient added into its ``main_grad`` inside the GEMM, as megatron-core's
    linears do under ``gradient_accumulation_fusion``; returns the placeholder gradient they return."""
    from megatron.core.tensor_parallel import layers
    fused = layers.fused_weight_gradient_mlp_cuda
    if weight.main_grad.dtype == torch.float32:
        fused.wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)
    elif weight.main_grad.dtype in (torch.float16, torch.bfloat16):
        fused.wgrad_gemm_accum_fp16(total_input, grad_output, weight.main_grad)
    else:
        raise RuntimeError(f"gradient accumulation fusion: main_grad of dtype {weight.main_grad.dtype} is not supported")
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    weight.grad_added_to_main_grad = True
    return make(weight.main_grad.shape, dtype=total_input.dtype, device=weight.main_grad.device)


def shared_input_linears(x: torch.Tensor, parts: Sequence) -> List[torch.Tensor]:
    """The outputs [N, out_i] of several linears without bias reading the same rows ``x`` [N, in]: one
    GEMM forward into [N, sum of out_i] (the outputs are its column blocks), one GEMM for the input's
    gradient (where each linear alone would run its own and autograd would sum them), and per weight
    its gradient GEMM as before.  ``parts``: per linear a megatron linear applied to rows already
    gathered (:func:`local_column_linear`: no communication; its weight gradient accumulates into
    ``main_grad`` where its gradient-accumulation fusion is on) or a weight tensor [out, in] (a plain
    or :func:`tp_replicated` weight).  The same values as :func:`rows_linear` / ``F.linear`` per part,
    to the GEMM's rounding."""
    owners = tuple(None if isinstance(p, torch.Tensor) else p for p in parts)
    weights = [p if isinstance(p, torch.Tensor) else p.weight for p in parts]
    y = _SharedInputLinears.apply(x, owners, *weights)
    return list(y.split([int(t.shape[0]) for t in weights], dim=1))


def check_divisible(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"{what} ({n}) must be divisible by --tensor-model-parallel-size ({tp})")
    return n // tp


def sequence_lengths(packed, s: int, b: int) -> List[int]:
    """Host lengths of the sequences the rows [s*b] hold: the b batch columns (``packed`` None),
    else the packed params' sequences (then b must be 1), read from their host copy
    (``TreePackedSeqParams.seq_lengths``) or, for megatron's own params, from ``cu_seqlens_q``."""
    if packed is None:
        return [s] * b
    if b != 1:
        raise ValueError(f"packed sequences need micro-batch size 1 in the [s, b] layout, got b={b}")
    lens = getattr(packed, "seq_lengths", None)
    if lens is None:
        cu = packed.cu_seqlens_q.cpu().long()
        lens = cu[1:] - cu[:-1]
    return [int(n) for n in lens.tolist()]


def to_sequence_order(x_rows: torch.Tensor, s: int, b: int) -> torch.Tensor:
    """Rows [s*b, ...] (s-major, as [s, b] flattens) with each sequence's rows back to back
    (batch column after batch column; packed rows, b == 1, already are)."""
    if b == 1:
        return x_rows
    return x_rows.view((s, b) + tuple(x_rows.shape[1:])).transpose(0, 1).reshape((s * b,) + tuple(x_rows.shape[1:]))


def from_sequence_order(y: torch.Tensor, s: int, b: int) -> torch.Tensor:
    """Inverse of :func:`to_sequence_order`."""
    if b == 1:
        return y
    return y.view((b, s) + tuple(y.shape[1:])).transpose(0, 1).reshape((s * b,) + tuple(y.shape[1:]))


def sequences_view(xs: Sequence[torch.Tensor], s: int, b: int,
                   packed) -> Tuple[List[torch.Tensor], Optional[torch.Tensor]]:
    """Rows [s*b, ...] of each tensor in ``xs`` as padded sequences [N, T, ...].

    ``packed`` None: the b batch columns are the sequences.  Expanded mode: the
    sequences of the packed params (then b must be 1), zero padded to the longest through one
    flat index of the valid positions, built once for all of ``xs``.  Returns (padded, flat index
    or None).
    """
    if packed is None:
        return [x.view((s, b) + tuple(x.shape[1:])).transpose(0, 1) for x in xs], None
    lengths = sequence_lengths(packed, s, b)
    N, T = len(lengths), max(lengths)
    flat = host_to_device(torch.cat([n * T + torch.arange(L) for n, L in enumerate(lengths)]), xs[0].device)
    return [x.new_zeros((N * T,) + tuple(x.shape[1:])).index_copy(0, flat, x).view((N, T) + tuple(x.shape[1:]))
            for x in xs], flat


def sequences_unview(y: torch.Tensor, flat: Optional[torch.Tensor]) -> torch.Tensor:
    """Back from :func:`sequences_view` to rows [s*b, ...]."""
    if flat is None:
        return y.transpose(0, 1).reshape((-1,) + tuple(y.shape[2:]))
    return y.reshape((-1,) + tuple(y.shape[2:])).index_select(0, flat)
