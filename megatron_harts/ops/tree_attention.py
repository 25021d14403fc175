"""Tree attention: every row's query against the keys of the rows visible to it.

Visibility is the layout's per-key list of visible query intervals
(:class:`~megatron_harts.layout.Visibility`); for whole subtrees in DFS order that is
``k <= q < end[k]`` (key k is an ancestor-or-self of query q).  Optionally, keys/values of
context rows that live outside the microbatch (a producer's rows, ancestors of this
layout's subtree roots) take part in the same softmax, each visible to its own query
intervals.

Invariant: for every query row q the output equals causal attention of the trajectory's
token sequence at q's position, for any trajectory through q (tests check it against
per-trajectory computation, forward and backward).

Backends, one interface:

- ``reference``: dense [R, K] mask, explicit softmax.  Plain and readable; small sizes.
- ``sdpa``: ``scaled_dot_product_attention`` over query blocks, each with a boolean mask built
  from the intervals (only keys up to the block's last row when visibility is causal).
- ``flex``: FlexAttention with a BlockMask built once per microbatch by
  :func:`build_tree_block_mask` (straight from the intervals, no dense mask) and shared by
  all layers.  On CPU, torch's FlexAttention runs forward only (no backward).
- ``varlen``: bottom-right causal attention over gathered key paths (:mod:`.key_paths`), with
  :class:`~megatron_harts.ops.key_paths.KeyPaths` built once per microbatch; on CUDA (fp16/bf16)
  flash-attn-4's Hopper kernels where installed, else torch's flash-attention varlen kernels,
  elsewhere the per-run plain-torch kernel.  Tree visibilities only: one interval per key, or a
  layout's (its ``prev`` gives the tree) whose compaction events cut holes in its keys' intervals.
- ``interval``: Triton kernels reading keys/values in place over the tiles that hold visible pairs
  (:mod:`.interval_attention`), with :class:`~megatron_harts.ops.interval_attention.IntervalBlocks`
  built once per microbatch; any visibility.  CUDA (or the CPU under ``TRITON_INTERPRET=1``) with
  Triton installed; elsewhere it raises.
- ``fa4``: flash-attn-4's block-sparse kernels over the same tiles, keys/values read in place, a
  mask on partial tiles from the interval table (:mod:`.fa4_blocks`), with
  :class:`~megatron_harts.ops.fa4_blocks.Fa4Blocks` built once per microbatch; any visibility.  A
  Hopper GPU with the pinned flash-attn-4, bf16/fp16; elsewhere it raises.

Context keys come first on the key axis: keys ``[0, Rc)`` are context rows, ``[Rc, Rc+R)``
the layout's rows.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

from ..layout import CompactLayout, Visibility, host_to_device
from .interval_attention import IntervalBlocks, build_interval_blocks, interval_attention
from .key_paths import KeyPaths, build_key_paths, default_kernel, path_attention

__all__ = ["tree_attention", "build_tree_block_mask", "set_flex_compile_mode", "BACKENDS"]

BACKENDS = ("reference", "sdpa", "flex", "varlen", "interval", "fa4")

VisibilityLike = Union[CompactLayout, Visibility]


def _as_visibility(visibility, name: str = "visibility") -> Visibility:
    if isinstance(visibility, CompactLayout):
        return visibility.visibility
    if isinstance(visibility, Visibility):
        return visibility
    raise ValueError(f"{name} must be a CompactLayout or a Visibility, got {type(visibility).__name__}")


def _resolve(visibility: VisibilityLike, context_visibility: Optional[Visibility], with_context: bool
             ) -> Tuple[Visibility, Optional[Visibility]]:
    vis = _as_visibility(visibility)
    if not with_context:
        if context_visibility is not None:
            raise ValueError("context_visibility given without context keys/values (context_kv)")
        if isinstance(visibility, CompactLayout) and visibility.num_context_rows:
            raise ValueError(f"context_kv: this layout's rows also see {visibility.num_context_rows} context "
                             f"rows (ancestors in the producer); pass their keys and values")
        return vis, None
    if context_visibility is None:
        if not isinstance(visibility, CompactLayout):
            raise ValueError("context_visibility is required with context_kv unless visibility is a CompactLayout")
        context_visibility = visibility.context_visibility
    if not isinstance(context_visibility, Visibility):
        raise ValueError(f"context_visibility must be a Visibility, got {type(context_visibility).__name__}")
    if context_visibility.num_queries != vis.num_queries:
        raise ValueError(f"context_visibility covers {context_visibility.num_queries} query rows, "
                         f"visibility {vis.num_queries}")
    return vis, context_visibility


def _padded_intervals(vis: Visibility, device, width: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-key interval table ``[K, M]`` (start, end), padded with empty ``[0, 0)`` intervals."""
    offsets = vis.offsets.to(device)
    counts = offsets[1:] - offsets[:-1]
    m = max(int(counts.max()) if counts.numel() else 0, 1)
    if width is not None:
        m = max(m, width)
    keys = vis.interval_keys().to(device)
    slot = torch.arange(vis.num_intervals, device=device) - offsets[:-1][keys]
    starts = torch.zeros(vis.num_keys, m, dtype=torch.int64, device=device)
    ends = torch.zeros(vis.num_keys, m, dtype=torch.int64, device=device)
    starts[keys, slot] = vis.start.to(device)
    ends[keys, slot] = vis.end.to(device)
    return starts, ends


def _kv_intervals(vis: Visibility, ctx_vis: Optional[Visibility], device):
    """Interval table over the whole key axis (context keys first)."""
    if ctx_vis is None:
        return _padded_intervals(vis, device)
    cs, ce = _padded_intervals(ctx_vis, device)
    ls, le = _padded_intervals(vis, device, width=cs.shape[1])
    if cs.shape[1] < ls.shape[1]:
        cs, ce = _padded_intervals(ctx_vis, device, width=ls.shape[1])
    return torch.cat([cs, ls]), torch.cat([ce, le])


def _mask_from_table(starts: torch.Tensor, ends: torch.Tensor, q_idx: torch.Tensor) -> torch.Tensor:
    """Boolean [len(q_idx), K]: query q sees key k iff q lies in one of k's intervals."""
    qi = q_idx[:, None, None]
    return ((starts[None] <= qi) & (qi < ends[None])).any(-1)


# ---------------------------------------------------------------------------
# block mask for FlexAttention
# ---------------------------------------------------------------------------

def _interval_mask_mod(starts: torch.Tensor, ends: torch.Tensor):
    """mask_mod(b, h, q, kv): q lies in one of kv's intervals (columns of the padded table)."""
    cols = [(starts[:, j].contiguous(), ends[:, j].contiguous()) for j in range(starts.shape[1])]
    if len(cols) == 1:
        s0, e0 = cols[0]

        def mask_mod(b, h, q_idx, kv_idx):
            return (s0[kv_idx] <= q_idx) & (q_idx < e0[kv_idx])
        return mask_mod

    def mask_mod(b, h, q_idx, kv_idx):
        s, e = cols[0]
        vis = (s[kv_idx] <= q_idx) & (q_idx < e[kv_idx])
        for s, e in cols[1:]:
            vis = vis | ((s[kv_idx] <= q_idx) & (q_idx < e[kv_idx]))
        return vis
    return mask_mod


def build_tree_block_mask(visibility: VisibilityLike, *, context_visibility: Optional[Visibility] = None,
                          block_size: int = 128, device=None):
    """FlexAttention BlockMask for tree attention, built from the intervals in O(intervals + blocks).

    Build it once per microbatch and pass it to every layer's :func:`tree_attention`.  With
    ``context_visibility`` the key axis is ``[context rows; layout rows]``.  A block
    (query block, key block) is *full* iff every key of the key block sees every query of the
    query block (then the kernel skips mask_mod), *partial* iff some key sees some query, and
    skipped otherwise; tail blocks that run past the sequence are never full.
    """
    from torch.nn.attention.flex_attention import BlockMask

    vis = _as_visibility(visibility)
    if isinstance(visibility, CompactLayout) and context_visibility is None and visibility.num_context_rows:
        context_visibility = visibility.context_visibility
    if context_visibility is not None and not isinstance(context_visibility, Visibility):
        raise ValueError(f"context_visibility must be a Visibility, got {type(context_visibility).__name__}")
    if not isinstance(block_size, int) or block_size < 16 or block_size % 16:
        raise ValueError(f"block_size must be a positive multiple of 16, got {block_size!r}")
    device = torch.device(device) if device is not None else vis.offsets.device
    # computed where the intervals live (the host, for a layout from the planner) and moved once
    work = vis.offsets.device
    starts, ends = _kv_intervals(vis, context_visibility, work)
    R = vis.num_queries
    K = starts.shape[0]
    bs = block_size
    nq, nk = -(-R // bs), -(-K // bs)

    # interval -> (key block, range of touched / fully covered query blocks): difference arrays
    s, e = starts.reshape(-1), ends.reshape(-1)
    kb = (torch.arange(K, device=work) // bs).repeat_interleave(starts.shape[1])
    real = s < e
    s, e, kb = s[real], e[real], kb[real]
    width = nq + 1
    touch = torch.zeros(nk * width, dtype=torch.int64, device=work)
    full = torch.zeros(nk * width, dtype=torch.int64, device=work)
    one = torch.ones_like(s)
    touch.index_add_(0, kb * width + s // bs, one)
    touch.index_add_(0, kb * width + (e - 1) // bs + 1, -one)
    flo, fhi = (s + bs - 1) // bs, e // bs - 1
    ok = flo <= fhi
    full.index_add_(0, (kb * width + flo)[ok], one[ok])
    full.index_add_(0, (kb * width + fhi + 1)[ok], -one[ok])
    touch = touch.view(nk, width).cumsum(1)[:, :nq].T            # [nq, nk]
    full = full.view(nk, width).cumsum(1)[:, :nq].T
    is_full = full == bs                                          # every key of the block covers the query block
    is_partial = (touch > 0) & ~is_full

    def csr(m):
        num = m.sum(-1).to(torch.int32)
        idx = torch.argsort(m.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return num[None, None], idx[None, None].contiguous()

    kv_num, kv_idx = csr(is_partial)
    full_num, full_idx = csr(is_full)
    # the mask_mod may be called with padded indices up to the block grid's edge
    pad = nk * bs - K
    starts_p = torch.cat([starts, starts.new_zeros(pad, starts.shape[1])])
    ends_p = torch.cat([ends, ends.new_zeros(pad, ends.shape[1])])
    kv_num, kv_idx, full_num, full_idx, starts_p, ends_p = (host_to_device(t, device) for t in (
        kv_num, kv_idx, full_num, full_idx, starts_p, ends_p))
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=bs,
                                    mask_mod=_interval_mask_mod(starts_p, ends_p), seq_lengths=(R, K))


_COMPILED_FLEX = None
_FLEX_COMPILE_MODE = None


def set_flex_compile_mode(mode: Optional[str] = None) -> None:
    """torch.compile mode used for FlexAttention on GPU (None: torch's default;
    e.g. "max-autotune-no-cudagraphs" autotunes kernel configs at first use)."""
    global _COMPILED_FLEX, _FLEX_COMPILE_MODE
    _FLEX_COMPILE_MODE = mode
    _COMPILED_FLEX = None


def _flex(q, k, v, block_mask, scale, gqa: bool, kernel_options=None):
    from torch.nn.attention.flex_attention import flex_attention
    global _COMPILED_FLEX
    if q.device.type == "cpu":
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            raise ValueError("backend='flex': torch's FlexAttention has no backward on CPU; "
                         "use backend='sdpa' or 'reference' there")
        with warnings.catch_warnings():
            # eager CPU flex materializes the scores: expected here, CPU is for tests only
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_attention(q.detach(), k.detach(), v.detach(), block_mask=block_mask, scale=scale,
                                  enable_gqa=gqa, kernel_options=kernel_options)
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, mode=_FLEX_COMPILE_MODE)
    return _COMPILED_FLEX(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                          kernel_options=kernel_options)


# ---------------------------------------------------------------------------
# the operator
# ---------------------------------------------------------------------------

def _check_inputs(q, k, v, context_kv):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a [rows, heads, dim] tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    R, H, D = q.shape
    if k.shape[0] != R or v.shape[0] != R:
        raise ValueError(f"q, k and v must have the same number of rows, got {R}, {k.shape[0]}, {v.shape[0]}")
    if k.shape[2] != D:
        raise ValueError(f"k's head dim {k.shape[2]} differs from q's {D}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same number of heads, got {k.shape[1]} and {v.shape[1]}")
    if H % k.shape[1]:
        raise ValueError(f"q's heads ({H}) must be a multiple of k's heads ({k.shape[1]})")
    if context_kv is not None:
        if not isinstance(context_kv, (tuple, list)) or len(context_kv) != 2:
            raise ValueError("context_kv must be a pair (context_k, context_v)")
        ck, cv = context_kv
        for name, t, ref in (("context_kv[0]", ck, k), ("context_kv[1]", cv, v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[1:] != ref.shape[1:]:
                raise ValueError(f"{name} must be [context rows, {ref.shape[1]}, {ref.shape[2]}]")
        if ck.shape[0] != cv.shape[0]:
            raise ValueError("context_kv: keys and values must have the same number of rows")


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visibility: VisibilityLike,
                   scale: Optional[float] = None, *, backend: str = "sdpa",
                   context_kv: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                   context_visibility: Optional[Visibility] = None, block_mask=None,
                   key_paths: Optional[KeyPaths] = None, varlen_kernel: Optional[str] = None,
                   interval_blocks: Optional[IntervalBlocks] = None, fa4_blocks=None,
                   query_block: int = 1024, kernel_options: Optional[dict] = None) -> torch.Tensor:
    """Attention of every row's query over the keys visible to it.

    q ``[R, H, Dqk]``, k ``[R, Hk, Dqk]``, v ``[R, Hk, Dv]`` (``H`` a multiple of ``Hk``: GQA),
    ``visibility`` a CompactLayout or a Visibility over the R rows, ``scale`` defaults to
    ``Dqk ** -0.5``.  ``context_kv = (k_ctx [Rc, Hk, Dqk], v_ctx [Rc, Hk, Dv])`` adds keys of
    rows outside the microbatch, visible per ``context_visibility`` (default: the layout's).
    ``block_mask``: for ``backend="flex"``, the mask from :func:`build_tree_block_mask`
    (built here when omitted); ``kernel_options`` go to flex_attention unchanged.
    ``key_paths``: for ``backend="varlen"``, the runs from
    :func:`~megatron_harts.ops.key_paths.build_key_paths` (built here when omitted);
    ``varlen_kernel`` one of ``key_paths.KERNELS`` (default: ``key_paths.default_kernel``: fa4
    where flash-attn-4 runs, else torch's flash kernels on CUDA, else the plain-torch reference).
    ``interval_blocks``: for ``backend="interval"``, the tiles from
    :func:`~megatron_harts.ops.interval_attention.build_interval_blocks` (built here when omitted).
    ``fa4_blocks``: for ``backend="fa4"``, the tiles from
    :func:`~megatron_harts.ops.fa4_blocks.build_fa4_blocks` (built here when omitted).
    A layout with context rows requires ``context_kv``.  Causal visibility (every layout) lets
    every row see itself; with a custom visibility a row that sees no key gets NaN from
    ``reference``/``sdpa`` and 0 from ``flex`` and ``interval``.
    ``query_block``: rows per SDPA call (``backend="sdpa"``).  Returns ``[R, H, Dv]``; differentiable in q, k, v and context.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _check_inputs(q, k, v, context_kv)
    vis, ctx_vis = _resolve(visibility, context_visibility, context_kv is not None)
    R, H, D = q.shape
    Hk = k.shape[1]
    if vis.num_keys != R or vis.num_queries != R:
        raise ValueError(f"visibility is over {vis.num_keys} keys x {vis.num_queries} queries, but q has {R} rows")
    if ctx_vis is not None and ctx_vis.num_keys != context_kv[0].shape[0]:
        raise ValueError(f"context_visibility has {ctx_vis.num_keys} keys, context_kv {context_kv[0].shape[0]} rows")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if ctx_vis is not None:
        k_all = torch.cat([context_kv[0], k])
        v_all = torch.cat([context_kv[1], v])
        n_ctx = context_kv[0].shape[0]
    else:
        k_all, v_all, n_ctx = k, v, 0

    if backend == "reference":
        return _reference(q, k_all, v_all, vis, ctx_vis, scale)
    if backend == "sdpa":
        if not isinstance(query_block, int) or query_block < 1:
            raise ValueError(f"query_block must be a positive integer, got {query_block!r}")
        return _sdpa(q, k_all, v_all, vis, ctx_vis, n_ctx, scale, query_block)
    if backend == "varlen":
        if key_paths is None:
            prev = visibility.prev if isinstance(visibility, CompactLayout) and visibility.num_events else None
            key_paths = build_key_paths(vis, ctx_vis, prev=prev, device=q.device)
        if (key_paths.num_queries, key_paths.num_keys) != (R, R + n_ctx):
            raise ValueError(f"key_paths are for (queries, keys) = {(key_paths.num_queries, key_paths.num_keys)}, "
                             f"expected {(R, R + n_ctx)}")
        return path_attention(q, k_all, v_all, key_paths, scale,
                              kernel=varlen_kernel or default_kernel(q, v.shape[-1]))
    if backend == "interval":      # interval_attention says why where its kernels cannot run
        if interval_blocks is None:
            interval_blocks = build_interval_blocks(vis, ctx_vis, device=q.device)
        return interval_attention(q, k_all, v_all, interval_blocks, scale)
    if backend == "fa4":
        from .fa4_blocks import build_fa4_blocks, fa4_block_attention
        if fa4_blocks is None:
            fa4_blocks = build_fa4_blocks(vis, ctx_vis, dims=(D, v.shape[-1]), device=q.device)
        return fa4_block_attention(q, k_all, v_all, fa4_blocks, scale)
    if block_mask is None:
        block_mask = build_tree_block_mask(vis, context_visibility=ctx_vis, device=q.device)
    if tuple(block_mask.seq_lengths) != (R, R + n_ctx):
        raise ValueError(f"block_mask is for (queries, keys) = {tuple(block_mask.seq_lengths)}, "
                         f"expected {(R, R + n_ctx)}")
    out = _flex(q.transpose(0, 1)[None], k_all.transpose(0, 1)[None], v_all.transpose(0, 1)[None],
                block_mask, scale, H != Hk, kernel_options)
    return out[0].transpose(0, 1)


def _reference(q, k, v, vis, ctx_vis, scale):
    """Dense mask, explicit softmax (the readable definition)."""
    mask = vis.dense().to(q.device)
    if ctx_vis is not None:
        mask = torch.cat([ctx_vis.dense().to(q.device), mask], dim=1)      # [R, Rc + R]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def _sdpa(q, k, v, vis, ctx_vis, n_ctx, scale, query_block):
    """Dense masked SDPA over query blocks; the mask of a block is built from the intervals."""
    starts, ends = _kv_intervals(vis, ctx_vis, q.device)
    R = q.shape[0]
    gqa = q.shape[1] != k.shape[1]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    outs = []
    for q0 in range(0, R, query_block):
        q1 = min(R, q0 + query_block)
        # causal visibility: the block's queries see no layout row after q1 - 1
        kn = n_ctx + q1 if vis.causal else n_ctx + R
        mask = _mask_from_table(starts[:kn], ends[:kn], torch.arange(q0, q1, device=q.device))
        o = F.scaled_dot_product_attention(qh[None, :, q0:q1], kh[None, :, :kn], vh[None, :, :kn],
                                           attn_mask=mask, scale=scale, enable_gqa=gqa)
        outs.append(o[0])
    return torch.cat(outs, dim=1).transpose(0, 1)
