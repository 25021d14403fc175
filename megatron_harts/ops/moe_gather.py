"""Rows gathered and summed in groups: the MoE combine and the dispatch's backward as one Triton kernel.

With a fixed fan-out (every token routed to exactly ``topk`` experts, ``models.dispatcher``) both
directions of the MoE permutation are gathers, and two of the four sum each token's ``topk`` rows:
the combine (each token's expert outputs) and the dispatch's backward (each token's row gradients).
As eager torch that is an ``index_select`` writing ``tokens x topk`` rows, then a sum reading them
all again; :func:`gather_sum` does both in one kernel that reads each gathered row once and writes
each token's sum once, accumulating in fp32 and rounding once to the input's dtype (as torch's
reduction of 16-bit floats does).

:func:`gather_sum_reference` is the eager form, what the dispatcher computes without the kernel.
tests/test_moe_gather.py holds the two together on a GPU, to the rounding of the dtype.
Importing this module never fails without Triton; calling the kernel without it raises.
"""
from __future__ import annotations

import torch

try:  # Triton is optional: CPU machines have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

__all__ = ["gather_sum_reference", "gather_sum"]


def gather_sum_reference(x: torch.Tensor, rows: torch.Tensor, group: int) -> torch.Tensor:
    """``x[rows]`` ([len(rows), H]) summed over each ``group`` consecutive rows: [len(rows) / group, H]."""
    out = x.index_select(0, rows)
    return out if group == 1 else out.view(-1, group, x.shape[1]).sum(1)


if triton is not None:

    @triton.jit
    def _gather_sum(X_ptr, R_ptr, Y_ptr, N, H, GROUP: tl.constexpr, BN: tl.constexpr, BH: tl.constexpr):
        i = tl.program_id(0) * BN + tl.arange(0, BN)
        c = tl.program_id(1) * BH + tl.arange(0, BH)
        mi = i < N
        m = mi[:, None] & (c < H)[None, :]
        acc = tl.zeros((BN, BH), dtype=tl.float32)
        for j in tl.static_range(GROUP):
            r = tl.load(R_ptr + i.to(tl.int64) * GROUP + j, mask=mi, other=0)
            acc += tl.load(X_ptr + r[:, None] * H + c[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(Y_ptr + i.to(tl.int64)[:, None] * H + c[None, :], acc.to(Y_ptr.dtype.element_ty), mask=m)


def gather_sum(x: torch.Tensor, rows: torch.Tensor, group: int) -> torch.Tensor:
    """:func:`gather_sum_reference` as one Triton kernel (``group`` > 1; ``group`` 1 is one ``index_select``
    already).  ``x`` [M, H] on a CUDA device, ``rows`` int64 indices into it, a multiple of ``group`` of them."""
    if triton is None:
        raise RuntimeError("gather_sum: the fused MoE gather needs Triton (not installed)")
    if group == 1:
        return x.index_select(0, rows)
    if x.dim() != 2 or rows.dim() != 1 or rows.shape[0] % group:
        raise ValueError(f"gather_sum: x {tuple(x.shape)} must be [rows, features], and the {rows.shape[0]} "
                         f"indices a multiple of the group {group}")
    x = x.contiguous()
    rows = rows.contiguous().long()
    n, h = rows.shape[0] // group, x.shape[1]
    out = torch.empty(n, h, dtype=x.dtype, device=x.device)
    if n:
        BH = min(triton.next_power_of_2(h), 256)
        BN = max(1, 2048 // BH)
        _gather_sum[(triton.cdiv(n, BN), triton.cdiv(h, BH))](x, rows, out, n, h, group, BN, BH)
    return out
