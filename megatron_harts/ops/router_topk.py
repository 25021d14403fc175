"""Kimi-Linear's sigmoid top-k routing: the plain torch reference and one fused Triton kernel each way.

Routing of one token (DeepSeek-V3 style, transformers' ``KimiLinearTopkRouter``)::

    s = sigmoid(logits);  c = s + expert_bias (selection only)
    groups (num_groups, group_topk): a group scores the sum of its top group_score_topk values of c;
        experts outside the best group_topk groups are excluded
    experts = top-k of c;  w = s[experts], divided by their sum (+1e-20) when normalize, times scaling

Returns the routing probabilities ``[N, E]`` (w at the chosen experts, zeros elsewhere) and the routing
map ``[N, E]`` (bool).  The gradient reaches the logits only through ``s`` at the chosen experts.

:func:`sigmoid_topk_reference` is the eager form (about 20 kernels forward, most of them small
[N, E] ops, each a launch the host pays for).  :func:`sigmoid_topk` runs the whole chain as one
Triton kernel (each row's selection by ``top-k`` rounds of a row argmax, the first index winning a
tie) and its backward as one more; same dtype, same selection as the reference up to ties between
equal scores (which torch's top-k breaks in no documented order), probabilities to the rounding
of the dtype (tests/test_router_topk.py).  The router (``models.router``) takes the fused form where
``models.common.use_fused_kernels`` says so.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

try:  # Triton is optional: CPU machines have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

__all__ = ["sigmoid_topk_reference", "sigmoid_topk"]

_NORM_EPS = 1e-20


def sigmoid_topk_reference(logits: torch.Tensor, topk: int, *, num_groups: Optional[int] = None,
                           group_topk: Optional[int] = None, group_score_topk: int = 2,
                           scaling_factor: Optional[float] = None, expert_bias: Optional[torch.Tensor] = None,
                           normalize: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid top-k routing (module docstring) in plain torch: (probs [N, E], routing map [N, E] bool)."""
    N, E = logits.shape
    scores = torch.sigmoid(logits)
    choice = scores + expert_bias.to(scores.dtype) if expert_bias is not None else scores
    if group_topk and num_groups and num_groups > 1:
        per = E // num_groups
        group_scores = choice.view(N, num_groups, per).topk(min(group_score_topk, per), dim=-1)[0].sum(-1)
        group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        keep = group_mask.unsqueeze(-1).expand(N, num_groups, per).reshape(N, E).bool()
        choice = choice.masked_fill(~keep, float("-inf"))
    top_idx = torch.topk(choice, k=topk, dim=-1)[1]
    w = scores.gather(1, top_idx)
    if normalize:
        w = w / (w.sum(-1, keepdim=True) + _NORM_EPS)
    if scaling_factor:
        w = w * scaling_factor
    probs = torch.zeros_like(logits).scatter(1, top_idx, w)
    rmap = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_idx, True)
    return probs, rmap


if triton is not None:

    @triton.jit
    def _route_fwd(X_ptr, B_ptr, P_ptr, M_ptr, N, E, scale, K: tl.constexpr, G: tl.constexpr, PER: tl.constexpr,
                   GK: tl.constexpr, GS: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
                   BN: tl.constexpr, BE: tl.constexpr):
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        cols = tl.arange(0, BE)
        cm = cols < E
        m = (rows < N)[:, None] & cm[None, :]
        off = rows.to(tl.int64)[:, None] * E + cols[None, :]
        x = tl.load(X_ptr + off, mask=m, other=0.0).to(tl.float32)
        s = tl.sigmoid(x)
        c = s
        if HAS_BIAS:
            c = c + tl.load(B_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        ninf = float("-inf")
        c = tl.where(cm[None, :], c, ninf)
        col2 = cols[None, :] + tl.zeros([BN, BE], dtype=tl.int32)
        if G > 1:
            gid = col2 // PER
            gscore = tl.full([BN, BE], ninf, tl.float32)      # each column: its group's score
            for g in tl.static_range(G):
                cg = tl.where(gid == g, c, ninf)
                total = tl.zeros([BN], dtype=tl.float32)
                for j in tl.static_range(GS):
                    total += tl.max(cg, axis=1)
                    cg = tl.where(col2 == tl.argmax(cg, axis=1, tie_break_left=True)[:, None], ninf, cg)
                gscore = tl.where(gid == g, total[:, None], gscore)
            gscore = tl.where(cm[None, :], gscore, ninf)
            keep = tl.zeros([BN, BE], dtype=tl.int1)
            for j in tl.static_range(GK):
                best = tl.argmax(gscore, axis=1, tie_break_left=True) // PER
                chosen = gid == best[:, None]
                keep = keep | chosen
                gscore = tl.where(chosen, ninf, gscore)
            c = tl.where(keep, c, ninf)
        sel = tl.zeros([BN, BE], dtype=tl.int1)
        for j in tl.static_range(K):
            hit = col2 == tl.argmax(c, axis=1, tie_break_left=True)[:, None]
            sel = sel | hit
            c = tl.where(hit, ninf, c)
        w = tl.where(sel, s, 0.0)
        if NORMALIZE:
            w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
        w = w * scale
        tl.store(P_ptr + off, w.to(P_ptr.dtype.element_ty), mask=m)
        tl.store(M_ptr + off, sel.to(tl.int8), mask=m)

    @triton.jit
    def _route_bwd(X_ptr, M_ptr, DP_ptr, DX_ptr, N, E, scale, NORMALIZE: tl.constexpr, BN: tl.constexpr,
                   BE: tl.constexpr):
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        cols = tl.arange(0, BE)
        m = (rows < N)[:, None] & (cols < E)[None, :]
        off = rows.to(tl.int64)[:, None] * E + cols[None, :]
        x = tl.load(X_ptr + off, mask=m, other=0.0).to(tl.float32)
        sel = tl.load(M_ptr + off, mask=m, other=0) != 0
        dp = tl.where(sel, tl.load(DP_ptr + off, mask=m, other=0.0).to(tl.float32), 0.0)
        s = tl.sigmoid(x)
        if NORMALIZE:
            total = tl.sum(tl.where(sel, s, 0.0), axis=1)[:, None] + 1e-20
            ds = scale * (dp / total - tl.sum(dp * tl.where(sel, s, 0.0), axis=1)[:, None] / (total * total))
        else:
            ds = scale * dp
        dx = tl.where(sel, ds * s * (1.0 - s), 0.0)
        tl.store(DX_ptr + off, dx.to(DX_ptr.dtype.element_ty), mask=m)


def _tiles(E: int):
    BE = max(16, triton.next_power_of_2(E))
    return max(1, 2048 // BE), BE


class _SigmoidTopk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, expert_bias, topk, groups, group_topk, group_score_topk, scale, normalize):
        N, E = logits.shape
        x = logits.contiguous()
        probs = torch.empty_like(x)
        rmap = torch.empty(N, E, dtype=torch.int8, device=x.device)
        BN, BE = _tiles(E)
        has_bias = expert_bias is not None
        bias = expert_bias.contiguous() if has_bias else x
        _route_fwd[(triton.cdiv(N, BN),)](x, bias, probs, rmap, N, E, scale, topk, groups,
                                         E // groups, group_topk, group_score_topk, has_bias, normalize, BN, BE)
        rmap = rmap.view(torch.bool)
        ctx.save_for_backward(x, rmap)
        ctx.scale, ctx.normalize = scale, normalize
        ctx.mark_non_differentiable(rmap)
        return probs, rmap

    @staticmethod
    def backward(ctx, dprobs, _drmap):
        x, rmap = ctx.saved_tensors
        N, E = x.shape
        dx = torch.empty_like(x)
        BN, BE = _tiles(E)
        _route_bwd[(triton.cdiv(N, BN),)](x, rmap.view(torch.int8), dprobs.contiguous(), dx, N, E, ctx.scale,
                                         ctx.normalize, BN, BE)
        return dx, None, None, None, None, None, None, None


def sigmoid_topk(logits: torch.Tensor, topk: int, *, num_groups: Optional[int] = None,
                 group_topk: Optional[int] = None, group_score_topk: int = 2, scaling_factor: Optional[float] = None,
                 expert_bias: Optional[torch.Tensor] = None,
                 normalize: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`sigmoid_topk_reference` as one Triton kernel forward and one backward (module docstring)."""
    if triton is None:
        raise RuntimeError("sigmoid_topk: the fused router kernel needs Triton (not installed)")
    N, E = logits.shape
    grouped = bool(group_topk and num_groups and num_groups > 1)
    groups = num_groups if grouped else 1
    if E % groups or not 0 < topk <= E or (grouped and not 0 < group_topk <= groups):
        raise ValueError(f"sigmoid_topk: {E} experts in {groups} groups, top-{topk}, {group_topk} groups kept")
    per = E // groups
    if grouped and topk > group_topk * per:
        raise ValueError(f"sigmoid_topk: top-{topk} from {group_topk} groups of {per} experts")
    gs = min(group_score_topk, per) if grouped else 1
    if expert_bias is not None:
        expert_bias = expert_bias.to(logits.dtype)
    return _SigmoidTopk.apply(logits, expert_bias, int(topk), groups, int(group_topk or 1), gs,
                              float(scaling_factor) if scaling_factor else 1.0, bool(normalize))
