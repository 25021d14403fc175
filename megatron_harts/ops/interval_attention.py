"""Tree attention with keys and values read in place, over block lists built from the intervals.

The ``interval`` backend of :func:`~megatron_harts.ops.tree_attention.tree_attention`.  A
visibility (:class:`~megatron_harts.layout.Visibility`: per key, its visible query intervals;
context keys first on the key axis) is cut into tiles of ``block_m`` query rows by ``block_n``
keys.  A tile is *full* when every key of it sees every query row of it (the kernel computes it
without a mask), *partial* when some key sees some row (the kernel masks it elementwise from the
per-key interval table), and skipped otherwise.  So every visible pair is computed once, inside
tiles that a causal kernel would also compute, and no key or value is gathered or copied: a
compaction trace's evicted keys simply drop out of the tiles, and a tree's keys outside a row's
path are tiles never visited.

:class:`IntervalBlocks` holds, for one microbatch (built once by :func:`build_interval_blocks` on
the host, in numpy, shared by all layers):

- per query block, the key blocks it visits, full ones first (``q_offsets``, ``q_num_full``,
  ``q_blocks``): what the forward and the dq kernel loop over;
- the transpose, per key block the query blocks that visit it (``k_offsets``, ``k_num_full``,
  ``k_blocks``): what the dk/dv kernel loops over, so that each program owns its key block's
  gradients (no atomics, no scatter);
- the padded per-key interval table ``starts``/``ends`` ``[K_pad, M]`` (int32; padding and keys
  past ``K`` hold empty ``[0, 0)`` intervals) that partial tiles read to build their masks.

:func:`interval_attention` runs three Triton kernels through an autograd Function: the forward
(online softmax per query block over its key blocks, saving the log-sum-exp), and the backward as
dq per query block and dk/dv per key block, both recomputing the probabilities from the saved
log-sum-exp, with ``delta = rowsum(dO * O)`` computed first.  q/k and v head dims may differ
(MLA: 192/128, 96/64); the q/k dim is processed as a power-of-two part and a remainder part, so 192
costs no padding to 256.  Inputs bf16, fp16 or fp32, accumulation in fp32 (fp32 inputs use IEEE
fp32 products, for the tests).  A row that sees no key gets output 0 and no gradient.

The plain definition is :func:`~megatron_harts.ops.tree_attention.tree_attention`'s ``reference``
backend (dense mask, explicit softmax), and :func:`blocks_reference` is the block lists' brute-force
definition from the dense mask; tests/test_interval_attention.py holds the kernels and the lists to
them.  The kernels run on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1`` set
before Triton is imported); elsewhere :func:`interval_attention` raises one error.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import torch

from ..layout import Visibility, host_to_device_many

try:  # Triton is optional: CPU CI has none, and only this backend needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

__all__ = ["IntervalBlocks", "build_interval_blocks", "blocks_reference", "interval_attention",
           "interval_available", "BLOCK_M", "BLOCK_N"]

#: default tile: query rows per block, keys per block
BLOCK_M = 64
BLOCK_N = 64


# ---------------------------------------------------------------------------
# host side: block lists from the intervals
# ---------------------------------------------------------------------------

@dataclass
class IntervalBlocks:
    """Tiles to visit for one microbatch (see the module docstring).

    Invariant: query block ``i`` visits key blocks ``q_blocks[q_offsets[i]:q_offsets[i+1]]``, the
    first ``q_num_full[i]`` of them full, the rest partial, each list ascending within its kind;
    key block ``j`` is visited by query blocks ``k_blocks[k_offsets[j]:k_offsets[j+1]]``, the
    first ``k_num_full[j]`` full; both describe the same set of tiles.  A tile is full iff it lies
    inside the key axis (``(j+1) * block_n <= num_keys``) and every key of it sees every query row
    ``[i * block_m, min((i+1) * block_m, num_queries))``; partial iff it is not full and some key of
    it sees some row.  ``starts``/``ends`` ``[num_key_blocks * block_n, M]``: key k sees query q iff
    ``starts[k, m] <= q < ends[k, m]`` for some m.  Tensors live on the compute device.
    """
    q_offsets: torch.Tensor      # int32 [nq+1]
    q_num_full: torch.Tensor     # int32 [nq]
    q_blocks: torch.Tensor       # int32 [tiles]
    k_offsets: torch.Tensor      # int32 [nk+1]
    k_num_full: torch.Tensor     # int32 [nk]
    k_blocks: torch.Tensor       # int32 [tiles]
    starts: torch.Tensor         # int32 [nk * block_n, M]
    ends: torch.Tensor           # int32 [nk * block_n, M]
    num_queries: int
    num_keys: int
    block_m: int
    block_n: int
    num_full: int
    num_partial: int
    pairs: int                   # visible (query, key) pairs

    @property
    def num_query_blocks(self) -> int:
        return int(self.q_num_full.shape[0])

    @property
    def num_key_blocks(self) -> int:
        return int(self.k_num_full.shape[0])

    @property
    def max_intervals(self) -> int:
        return int(self.starts.shape[1])

    def visible_fraction(self) -> float:
        """Visible pairs per computed pair (tiles times their size): 1 means no wasted work."""
        tiles = self.num_full + self.num_partial
        return self.pairs / (tiles * self.block_m * self.block_n) if tiles else 1.0


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.int64, copy=False)


def _interval_table(vis: Visibility, width: int, rows: int) -> Tuple[np.ndarray, np.ndarray]:
    """Per-key intervals padded to ``[rows, width]`` with empty ``[0, 0)`` ones."""
    off = _host(vis.offsets)
    counts = np.diff(off)
    keys = np.repeat(np.arange(vis.num_keys, dtype=np.int64), counts)
    slot = np.arange(off[-1], dtype=np.int64) - off[:-1][keys]
    starts = np.zeros((rows, width), dtype=np.int64)
    ends = np.zeros((rows, width), dtype=np.int64)
    starts[keys, slot] = _host(vis.start)
    ends[keys, slot] = _host(vis.end)
    return starts, ends


def key_axis(vis: Visibility, context_visibility: Optional[Visibility]) -> Tuple[int, int]:
    """(query rows, keys of the whole key axis: context keys first) of a visibility and its context's,
    checked."""
    if not isinstance(vis, Visibility):
        raise ValueError(f"visibility must be a Visibility, got {type(vis).__name__}")
    if context_visibility is None:
        return vis.num_queries, vis.num_keys
    if context_visibility.num_queries != vis.num_queries:
        raise ValueError(f"context_visibility covers {context_visibility.num_queries} query rows, "
                         f"visibility {vis.num_queries}")
    return vis.num_queries, vis.num_keys + context_visibility.num_keys


def key_axis_table(vis: Visibility, context_visibility: Optional[Visibility], rows: int
                   ) -> Tuple[np.ndarray, np.ndarray]:
    """The interval table of the whole key axis (context keys first) on the host, padded to ``rows``
    keys with empty intervals: int64 ``[rows, M]``, ``M`` the most intervals of a key (at least 1)."""
    parts = [vis] if context_visibility is None else [context_visibility, vis]
    width = max([int(np.diff(_host(p.offsets)).max(initial=0)) for p in parts] + [1])
    tables = [_interval_table(p, width, p.num_keys) for p in parts]
    pad = np.zeros((rows - sum(p.num_keys for p in parts), width), dtype=np.int64)
    return np.concatenate([t[0] for t in tables] + [pad]), np.concatenate([t[1] for t in tables] + [pad])


def _tile_kinds(starts: np.ndarray, ends: np.ndarray, K: int, R: int, bm: int, bn: int) -> np.ndarray:
    """int8 [nq, nk]: 2 full, 1 partial, 0 skipped; from the interval table by difference arrays."""
    nq, nk = -(-R // bm), -(-K // bn)
    s, e = starts.reshape(-1), ends.reshape(-1)
    kb = np.repeat(np.arange(starts.shape[0], dtype=np.int64) // bn, starts.shape[1])
    real = s < e
    s, e, kb = s[real], e[real], kb[real]
    width = nq + 1
    # query blocks an interval touches: [s // bm, (e - 1) // bm]
    touch = (np.bincount(kb * width + s // bm, minlength=nk * width)
             - np.bincount(kb * width + (e - 1) // bm + 1, minlength=nk * width))
    # query blocks it covers whole (the last block ends at R)
    lo = -(-s // bm)
    hi = np.where(e >= R, nq - 1, e // bm - 1)
    ok = lo <= hi
    cover = (np.bincount(kb[ok] * width + lo[ok], minlength=nk * width)
             - np.bincount(kb[ok] * width + hi[ok] + 1, minlength=nk * width))
    touch = touch.reshape(nk, width).cumsum(1)[:, :nq].T
    cover = cover.reshape(nk, width).cumsum(1)[:, :nq].T
    # one key covers a query block with at most one of its (disjoint) intervals
    inside = (np.arange(nk) + 1) * bn <= K
    full = (cover == bn) & inside[None, :]
    kinds = np.zeros((nq, nk), dtype=np.int8)
    kinds[touch > 0] = 1
    kinds[full] = 2
    return kinds


def _lists(kinds: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR of the nonzero columns of every row, full (2) before partial (1), ascending within each."""
    n, m = kinds.shape
    row, col = np.nonzero(kinds)
    order = np.lexsort((col, kinds[row, col] == 1, row))
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(row, minlength=n), out=offsets[1:])
    num_full = (kinds == 2).sum(1)
    return offsets, num_full, col[order]


def build_interval_blocks(vis: Visibility, context_visibility: Optional[Visibility] = None, *,
                          block_m: int = BLOCK_M, block_n: int = BLOCK_N, device=None) -> IntervalBlocks:
    """The tiles of ``vis`` (and of the context keys' ``context_visibility``, first on the key axis).

    Work is O(intervals + tiles of the grid) on the host; build once per microbatch and pass the
    result to every layer.  ``block_m``/``block_n`` are the kernels' tile (powers of two >= 16).
    """
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if not isinstance(b, int) or b < 16 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {b!r}")
    R, K = key_axis(vis, context_visibility)
    device = torch.device(device) if device is not None else vis.offsets.device
    nk = -(-K // block_n)
    starts, ends = key_axis_table(vis, context_visibility, nk * block_n)
    kinds = _tile_kinds(starts, ends, K, R, block_m, block_n)
    q_off, q_full, q_blocks = _lists(kinds)
    k_off, k_full, k_blocks = _lists(kinds.T)
    pairs = int((ends - starts).sum())
    i32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))
    tensors = host_to_device_many([i32(a) for a in (q_off, q_full, q_blocks, k_off, k_full, k_blocks,
                                                    starts, ends)], device)
    return IntervalBlocks(*tensors, num_queries=R, num_keys=K, block_m=block_m, block_n=block_n,
                          num_full=int((kinds == 2).sum()), num_partial=int((kinds == 1).sum()), pairs=pairs)


def blocks_reference(mask: torch.Tensor, block_m: int, block_n: int) -> np.ndarray:
    """The tile kinds (int8 [nq, nk]: 2 full, 1 partial, 0 skipped) by brute force from a dense
    boolean ``[queries, keys]`` mask: the definition :class:`IntervalBlocks` is held to."""
    R, K = mask.shape
    nq, nk = -(-R // block_m), -(-K // block_n)
    m = mask.cpu().numpy()
    kinds = np.zeros((nq, nk), dtype=np.int8)
    for i in range(nq):
        for j in range(nk):
            tile = m[i * block_m:(i + 1) * block_m, j * block_n:(j + 1) * block_n]
            if tile.any():
                kinds[i, j] = 2 if tile.all() and (j + 1) * block_n <= K else 1
    return kinds


# ---------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------

def interval_available(device) -> Optional[str]:
    """None where the kernels can run on ``device``, else the reason they cannot."""
    if triton is None:
        return "Triton is not installed"
    device = torch.device(device)
    if device.type == "cuda":
        return None
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"the kernels run on CUDA (or on the CPU under TRITON_INTERPRET=1), not on {device.type}"


def _split_dim(d: int) -> Tuple[int, int]:
    """A q/k head dim as a power-of-two part and a remainder part padded to a power of two
    (192 -> 128 + 64, 96 -> 64 + 32; each >= 16, the smallest dot product)."""
    a = max(16, 1 << (d.bit_length() - 1))
    rest = d - a
    b = 0 if rest <= 0 else max(16, triton.next_power_of_2(rest))
    return a, b


if triton is not None:

    @triton.jit
    def _visible(starts, ends, offs_m, offs_n, M):
        """[BM, BN] mask: key offs_n sees query offs_m under some of its M intervals."""
        vis = (offs_m[:, None] < 0) & (offs_n[None, :] < 0)
        for j in range(M):
            s = tl.load(starts + offs_n * M + j)
            e = tl.load(ends + offs_n * M + j)
            vis = vis | ((s[None, :] <= offs_m[:, None]) & (offs_m[:, None] < e[None, :]))
        return vis

    @triton.jit
    def _visible_t(starts, ends, offs_n, offs_m, M):
        """The transposed mask, [BN, BM]."""
        vis = (offs_n[:, None] < 0) & (offs_m[None, :] < 0)
        for j in range(M):
            s = tl.load(starts + offs_n * M + j)
            e = tl.load(ends + offs_n * M + j)
            vis = vis | ((s[:, None] <= offs_m[None, :]) & (offs_m[None, :] < e[:, None]))
        return vis

    @triton.jit
    def _load_rows(ptr, offs, ok, stride, cols, width):
        """[len(offs), len(cols)] tile of a [rows, width] matrix (zeros outside)."""
        return tl.load(ptr + offs[:, None] * stride + cols[None, :], mask=ok[:, None] & (cols[None, :] < width),
                       other=0.0)

    @triton.jit
    def _load_cols(ptr, offs, ok, stride, cols, width):
        """The transposed tile: [len(cols), len(offs)]."""
        return tl.load(ptr + offs[None, :] * stride + cols[:, None], mask=ok[None, :] & (cols[:, None] < width),
                       other=0.0)

    @triton.jit
    def _fwd_tiles(acc, m_i, l_i, q_a, q_b, k_head, v_head, tiles, lo, hi, starts, ends, offs_m, K, M, DQK, DV,
                   qk_scale, stride_kn, stride_vn, d_a, d_b, d_v,
                   BN: tl.constexpr, DB: tl.constexpr, PREC: tl.constexpr, MASKED: tl.constexpr):
        for i in range(lo, hi):
            offs_n = tl.load(tiles + i) * BN + tl.arange(0, BN)
            key_ok = offs_n < K
            s = tl.dot(q_a, _load_cols(k_head, offs_n, key_ok, stride_kn, d_a, DQK), input_precision=PREC)
            if DB > 0:
                s += tl.dot(q_b, _load_cols(k_head, offs_n, key_ok, stride_kn, d_b, DQK), input_precision=PREC)
            s = s * qk_scale
            if MASKED:          # partial tile: mask from the intervals (keys past K see nothing)
                s = tl.where(_visible(starts, ends, offs_m, offs_n, M), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _load_rows(v_head, offs_n, key_ok, stride_vn, d_v, DV)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit
    def _fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, q_offsets, q_num_full, q_blocks, starts, ends,
                    R, K, M, DQK, DV, GROUP, qk_scale,
                    stride_qm, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_om, stride_oh,
                    BM: tl.constexpr, BN: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, DBP: tl.constexpr,
                    BDV: tl.constexpr, PREC: tl.constexpr):
        """One program per (query block, query head): online softmax over its tiles, full ones first."""
        qb = tl.program_id(0)
        h = tl.program_id(1)
        offs_m = qb * BM + tl.arange(0, BM)
        row_ok = offs_m < R
        d_a = tl.arange(0, DA)
        d_b = DA + tl.arange(0, DBP)
        d_v = tl.arange(0, BDV)
        q_a = _load_rows(q_ptr + h * stride_qh, offs_m, row_ok, stride_qm, d_a, DQK)
        q_b = _load_rows(q_ptr + h * stride_qh, offs_m, row_ok, stride_qm, d_b, DQK)
        k_head = k_ptr + (h // GROUP) * stride_kh
        v_head = v_ptr + (h // GROUP) * stride_vh
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, BDV], tl.float32)
        lo = tl.load(q_offsets + qb)
        mid = lo + tl.load(q_num_full + qb)
        hi = tl.load(q_offsets + qb + 1)
        acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q_a, q_b, k_head, v_head, q_blocks, lo, mid, starts, ends, offs_m,
                                   K, M, DQK, DV, qk_scale, stride_kn, stride_vn, d_a, d_b, d_v, BN, DB, PREC, False)
        acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q_a, q_b, k_head, v_head, q_blocks, mid, hi, starts, ends, offs_m,
                                   K, M, DQK, DV, qk_scale, stride_kn, stride_vn, d_a, d_b, d_v, BN, DB, PREC, True)
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        tl.store(o_ptr + offs_m[:, None] * stride_om + h * stride_oh + d_v[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (d_v[None, :] < DV))
        # log2-sum-exp of the scaled scores; +inf for a row that sees nothing (its p is 0 in the backward)
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("inf"))
        tl.store(lse_ptr + h * R + offs_m, lse, mask=row_ok)

    @triton.jit
    def _dq_tiles(dq_a, dq_b, q_a, q_b, do, lse, delta, k_head, v_head, tiles, lo, hi, starts, ends, offs_m,
                  K, M, DQK, DV, qk_scale, stride_kn, stride_vn, d_a, d_b, d_v,
                  BN: tl.constexpr, DB: tl.constexpr, PREC: tl.constexpr, MASKED: tl.constexpr):
        for i in range(lo, hi):
            offs_n = tl.load(tiles + i) * BN + tl.arange(0, BN)
            key_ok = offs_n < K
            k_a = _load_rows(k_head, offs_n, key_ok, stride_kn, d_a, DQK)
            s = tl.dot(q_a, tl.trans(k_a), input_precision=PREC)
            if DB > 0:
                k_b = _load_rows(k_head, offs_n, key_ok, stride_kn, d_b, DQK)
                s += tl.dot(q_b, tl.trans(k_b), input_precision=PREC)
            p = tl.exp2(s * qk_scale - lse[:, None])
            if MASKED:
                p = tl.where(_visible(starts, ends, offs_m, offs_n, M), p, 0.0)
            v = _load_rows(v_head, offs_n, key_ok, stride_vn, d_v, DV)
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            ds = (p * (dp - delta[:, None])).to(k_a.dtype)
            dq_a += tl.dot(ds, k_a, input_precision=PREC)
            if DB > 0:
                dq_b += tl.dot(ds, k_b, input_precision=PREC)
        return dq_a, dq_b

    @triton.jit
    def _dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, q_offsets, q_num_full, q_blocks,
                   starts, ends, R, K, M, DQK, DV, GROUP, qk_scale, scale,
                   stride_qm, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_om, stride_oh,
                   BM: tl.constexpr, BN: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, DBP: tl.constexpr,
                   BDV: tl.constexpr, PREC: tl.constexpr):
        """One program per (query block, query head): dq over its tiles (dq has q's strides)."""
        qb = tl.program_id(0)
        h = tl.program_id(1)
        offs_m = qb * BM + tl.arange(0, BM)
        row_ok = offs_m < R
        d_a = tl.arange(0, DA)
        d_b = DA + tl.arange(0, DBP)
        d_v = tl.arange(0, BDV)
        q_a = _load_rows(q_ptr + h * stride_qh, offs_m, row_ok, stride_qm, d_a, DQK)
        q_b = _load_rows(q_ptr + h * stride_qh, offs_m, row_ok, stride_qm, d_b, DQK)
        do = _load_rows(do_ptr + h * stride_oh, offs_m, row_ok, stride_om, d_v, DV)
        lse = tl.load(lse_ptr + h * R + offs_m, mask=row_ok, other=float("inf"))
        delta = tl.load(delta_ptr + h * R + offs_m, mask=row_ok, other=0.0)
        k_head = k_ptr + (h // GROUP) * stride_kh
        v_head = v_ptr + (h // GROUP) * stride_vh
        dq_a = tl.zeros([BM, DA], tl.float32)
        dq_b = tl.zeros([BM, DBP], tl.float32)
        lo = tl.load(q_offsets + qb)
        mid = lo + tl.load(q_num_full + qb)
        hi = tl.load(q_offsets + qb + 1)
        dq_a, dq_b = _dq_tiles(dq_a, dq_b, q_a, q_b, do, lse, delta, k_head, v_head, q_blocks, lo, mid, starts, ends,
                               offs_m, K, M, DQK, DV, qk_scale, stride_kn, stride_vn, d_a, d_b, d_v, BN, DB, PREC,
                               False)
        dq_a, dq_b = _dq_tiles(dq_a, dq_b, q_a, q_b, do, lse, delta, k_head, v_head, q_blocks, mid, hi, starts, ends,
                               offs_m, K, M, DQK, DV, qk_scale, stride_kn, stride_vn, d_a, d_b, d_v, BN, DB, PREC,
                               True)
        dq_base = dq_ptr + offs_m[:, None] * stride_qm + h * stride_qh
        tl.store(dq_base + d_a[None, :], (dq_a * scale).to(dq_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (d_a[None, :] < DQK))
        if DB > 0:
            tl.store(dq_base + d_b[None, :], (dq_b * scale).to(dq_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & (d_b[None, :] < DQK))

    @triton.jit
    def _dkdv_tiles(dk_a, dk_b, dv, k_a, k_b, v, q_head, do_head, lse_head, delta_head, tiles, lo, hi, starts, ends,
                    offs_n, R, M, DQK, DV, qk_scale, stride_qm, stride_om, d_a, d_b, d_v,
                    BM: tl.constexpr, DB: tl.constexpr, PREC: tl.constexpr, MASKED: tl.constexpr):
        """Transposed tiles: keys on rows, query rows on columns."""
        for i in range(lo, hi):
            offs_m = tl.load(tiles + i) * BM + tl.arange(0, BM)
            row_ok = offs_m < R
            qt_a = _load_cols(q_head, offs_m, row_ok, stride_qm, d_a, DQK)
            st = tl.dot(k_a, qt_a, input_precision=PREC)
            if DB > 0:
                qt_b = _load_cols(q_head, offs_m, row_ok, stride_qm, d_b, DQK)
                st += tl.dot(k_b, qt_b, input_precision=PREC)
            lse = tl.load(lse_head + offs_m, mask=row_ok, other=float("inf"))
            delta = tl.load(delta_head + offs_m, mask=row_ok, other=0.0)
            pt = tl.exp2(st * qk_scale - lse[None, :])
            if MASKED:
                pt = tl.where(_visible_t(starts, ends, offs_n, offs_m, M), pt, 0.0)
            do = _load_rows(do_head, offs_m, row_ok, stride_om, d_v, DV)
            dv += tl.dot(pt.to(do.dtype), do, input_precision=PREC)
            dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
            dst = (pt * (dpt - delta[None, :])).to(k_a.dtype)
            dk_a += tl.dot(dst, tl.trans(qt_a), input_precision=PREC)
            if DB > 0:
                dk_b += tl.dot(dst, tl.trans(qt_b), input_precision=PREC)
        return dk_a, dk_b, dv

    @triton.jit
    def _dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, k_offsets, k_num_full,
                     k_blocks, starts, ends, R, K, M, DQK, DV, GROUP, qk_scale, scale,
                     stride_qm, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_om, stride_oh,
                     BM: tl.constexpr, BN: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, DBP: tl.constexpr,
                     BDV: tl.constexpr, PREC: tl.constexpr):
        """One program per (key block, key head): its dk/dv over every query head of its group and
        every query block that visits it, in registers (no atomics; dk/dv have k's/v's strides)."""
        kb = tl.program_id(0)
        hk = tl.program_id(1)
        offs_n = kb * BN + tl.arange(0, BN)
        key_ok = offs_n < K
        d_a = tl.arange(0, DA)
        d_b = DA + tl.arange(0, DBP)
        d_v = tl.arange(0, BDV)
        k_a = _load_rows(k_ptr + hk * stride_kh, offs_n, key_ok, stride_kn, d_a, DQK)
        k_b = _load_rows(k_ptr + hk * stride_kh, offs_n, key_ok, stride_kn, d_b, DQK)
        v = _load_rows(v_ptr + hk * stride_vh, offs_n, key_ok, stride_vn, d_v, DV)
        dk_a = tl.zeros([BN, DA], tl.float32)
        dk_b = tl.zeros([BN, DBP], tl.float32)
        dv = tl.zeros([BN, BDV], tl.float32)
        lo = tl.load(k_offsets + kb)
        mid = lo + tl.load(k_num_full + kb)
        hi = tl.load(k_offsets + kb + 1)
        for g in range(GROUP):
            h = hk * GROUP + g
            q_head = q_ptr + h * stride_qh
            do_head = do_ptr + h * stride_oh
            dk_a, dk_b, dv = _dkdv_tiles(dk_a, dk_b, dv, k_a, k_b, v, q_head, do_head, lse_ptr + h * R,
                                         delta_ptr + h * R, k_blocks, lo, mid, starts, ends, offs_n, R, M, DQK, DV,
                                         qk_scale, stride_qm, stride_om, d_a, d_b, d_v, BM, DB, PREC, False)
            dk_a, dk_b, dv = _dkdv_tiles(dk_a, dk_b, dv, k_a, k_b, v, q_head, do_head, lse_ptr + h * R,
                                         delta_ptr + h * R, k_blocks, mid, hi, starts, ends, offs_n, R, M, DQK, DV,
                                         qk_scale, stride_qm, stride_om, d_a, d_b, d_v, BM, DB, PREC, True)
        dk_base = dk_ptr + offs_n[:, None] * stride_kn + hk * stride_kh
        tl.store(dk_base + d_a[None, :], (dk_a * scale).to(dk_ptr.dtype.element_ty),
                 mask=key_ok[:, None] & (d_a[None, :] < DQK))
        if DB > 0:
            tl.store(dk_base + d_b[None, :], (dk_b * scale).to(dk_ptr.dtype.element_ty),
                     mask=key_ok[:, None] & (d_b[None, :] < DQK))
        tl.store(dv_ptr + offs_n[:, None] * stride_vn + hk * stride_vh + d_v[None, :],
                 dv.to(dv_ptr.dtype.element_ty), mask=key_ok[:, None] & (d_v[None, :] < DV))


_LOG2E = 1.4426950408889634


def _launch_args(q, k, v, blocks: IntervalBlocks):
    """Sizes, compile-time constants, and the forward's and backward's launch options (warps,
    pipeline stages).  Measured on an H100 at MLA dims 192 / 128 (``benchmarks/tune_interval.py``):
    64 x 64 tiles run the backward fastest with 4 warps and no software pipelining (2.2x a causal
    pair against 3.3x with 8 warps and 2 stages: its tiles hold dk, dv and the recomputed
    probabilities, and deeper pipelines spill); larger tiles need 8 warps and 2 stages."""
    R, H, DQK = q.shape
    K, Hk, DV = v.shape
    da, db = _split_dim(DQK)
    meta = dict(BM=blocks.block_m, BN=blocks.block_n, DA=da, DB=db, DBP=db or 16,
                BDV=max(16, triton.next_power_of_2(DV)), PREC="ieee" if q.dtype == torch.float32 else "tf32")
    sizes = (R, K, blocks.max_intervals, DQK, DV, H // Hk)
    tile = max(blocks.block_m, blocks.block_n)
    fwd = dict(num_warps=4 if tile <= 64 else 8, num_stages=3 if DQK + DV <= 256 else 2)
    bwd = dict(num_warps=4, num_stages=1) if tile <= 64 else dict(num_warps=8, num_stages=2)
    return sizes, meta, fwd, bwd


class _IntervalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, blocks: IntervalBlocks, scale: float):
        R, H, _ = q.shape
        DV = v.shape[2]
        sizes, meta, launch, _ = _launch_args(q, k, v, blocks)
        o = torch.empty(R, H, DV, dtype=q.dtype, device=q.device)
        lse = torch.empty(H, R, dtype=torch.float32, device=q.device)
        grid = (blocks.num_query_blocks, H)
        _fwd_kernel[grid](q, k, v, o, lse, blocks.q_offsets, blocks.q_num_full, blocks.q_blocks,
                          blocks.starts, blocks.ends, *sizes, scale * _LOG2E,
                          q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                          o.stride(0), o.stride(1), **meta, **launch)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.blocks = blocks
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        blocks, scale = ctx.blocks, ctx.scale
        do = do.contiguous()
        R, H, _ = q.shape
        Hk = k.shape[1]
        delta = (do.float() * o.float()).sum(-1).transpose(0, 1).contiguous()      # [H, R]
        sizes, meta, _, launch = _launch_args(q, k, v, blocks)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                   do.stride(0), do.stride(1))
        _dq_kernel[(blocks.num_query_blocks, H)](
            q, k, v, do, lse, delta, dq, blocks.q_offsets, blocks.q_num_full, blocks.q_blocks,
            blocks.starts, blocks.ends, *sizes, scale * _LOG2E, scale, *strides, **meta, **launch)
        _dkdv_kernel[(blocks.num_key_blocks, Hk)](
            q, k, v, do, lse, delta, dk, dv, blocks.k_offsets, blocks.k_num_full, blocks.k_blocks,
            blocks.starts, blocks.ends, *sizes, scale * _LOG2E, scale, *strides, **meta, **launch)
        return dq, dk, dv, None, None


def interval_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: IntervalBlocks,
                       scale: Optional[float] = None) -> torch.Tensor:
    """Attention of q ``[R, H, Dqk]`` over k ``[K, Hk, Dqk]``, v ``[K, Hk, Dv]`` (the whole key axis,
    context keys first) on the tiles of ``blocks``; differentiable in q, k and v.  Raises ValueError
    where the kernels cannot run (no Triton, no CUDA and no interpreter) or the shapes do not match."""
    reason = interval_available(q.device)
    if reason is not None:
        raise ValueError(f"tree attention backend 'interval': {reason}; use backend 'varlen', 'flex' or 'sdpa'")
    if not isinstance(blocks, IntervalBlocks):
        raise ValueError(f"blocks must be IntervalBlocks, got {type(blocks).__name__}")
    if (blocks.num_queries, blocks.num_keys) != (q.shape[0], k.shape[0]):
        raise ValueError(f"interval blocks are for (queries, keys) = {(blocks.num_queries, blocks.num_keys)}, "
                         f"expected {(q.shape[0], k.shape[0])}")
    if blocks.q_offsets.device != q.device:
        raise ValueError(f"interval blocks live on {blocks.q_offsets.device}, the inputs on {q.device}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"backend 'interval' takes q, k, v of one dtype among fp16, bf16, fp32; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if q.shape[0] == 0 or k.shape[0] == 0:       # no tile: zeros (a row that sees nothing gets 0)
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[2]) + 0 * (q.sum() + k.sum() + v.sum())
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _IntervalAttention.apply(q, k, v, blocks, float(scale))
