"""GPU backend for the KDA executor on fla-core 0.6.0 (``fla.ops.kda`` chunked kernels).

``kda_fla_varlen`` has ``kda_chunked_varlen``'s signature and semantics (ops/kda.py),
so ``tree_kda`` and expanded mode run it as backend ``"fla"`` (``register_fla_backend``;
``tree_kda`` and the KDA layer register it on first use).  One call of the plan is
one varlen launch sequence of fla's chunked KDA over the packed sequences (batch 1,
``cu_seqlens``), initial states fp32.  ``kda_fla`` is the padded form (``kda_chunked``'s
signature), for comparisons with the reference.

What fla lacks: differentiable intermediate states.  fla returns chunk states
only in inference mode, and its backward takes a gradient for the final state
only.  ``_ChunkKdaExport`` is the missing piece: an autograd Function that runs
fla's forward pieces (gate cumsum, intra-chunk WY solve, state recurrence, output),
keeps the chunk-boundary states the plan exports (fp32, also for bf16 inputs), and
whose backward is fla's chunked backward with the state-gradient recurrence
replaced by ours (``ops/kda_state_grad.py``), which adds the exported states'
gradients at their chunk boundaries.  Exported offsets:

- a multiple of 64, or the sequence's end: a chunk-boundary state of the Function;
- anything else (the ``--no-tree-replay`` ablation, producer exports after a row):
  the aligned state before it (or the initial state), then the partial chunk in
  torch (``kda_chunked`` on those < 64 tokens), so gradients still flow.

Model inputs are taken as they come: q, k already L2-normalized, g the log decay
(<= 0), beta already sigmoided (models/kda.py), so fla's in-kernel l2norm, gate and
beta-sigmoid options stay off (moving them in would have to change both modes).

Precision: fp32 inputs run fla in fp32, but Triton computes fp32 dot products in
tf32 unless ``TRITON_F32_DEFAULT=ieee`` is set before the first kernel compiles;
the 1e-4 agreement with the reference backend (tests/test_kda_fla.py) needs it.

Host cost: the first use installs ``ops/triton_launch.fast_autotuned_launches`` (a tuned kernel
launches with its chosen configuration without the two autotuners' key building; the same kernels,
bitwise the same results): 0.4-0.6 ms less host time per call, forward and backward, on the H200
(``benchmarks/bench_kda_backends.py --full-launch``).

fla's internals are pinned to fla-core 0.6.0 (``FLA_VERSION``); importing this
module never imports fla or Triton (CPU machines have neither).
"""
from __future__ import annotations

import functools
import os
from collections import OrderedDict
from dataclasses import dataclass
from types import SimpleNamespace
from typing import List, Optional, Tuple

import numpy as np
import torch

from ..layout import host_to_device_many
from .kda import _check_shapes, check_initial_state_index, check_varlen, kda_chunked

FLA_VERSION = "0.6.0"
CHUNK = 64
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fla_available() -> bool:
    """fla-core (pinned version) and Triton import, and a CUDA device is present."""
    try:
        _fla()
    except (ImportError, RuntimeError):
        return False
    return torch.cuda.is_available()


def register_fla_backend():
    """Add ``"fla"`` to ``tree_kda.KDA_BACKENDS`` and return the backend.

    Imports nothing from fla yet (that happens on the first call); refuses with a
    RuntimeError when fla-core is not installed.
    """
    import importlib.util
    if importlib.util.find_spec("fla") is None:
        raise RuntimeError(f"fla-core is not installed (the fla KDA backend needs fla-core=={FLA_VERSION} and a GPU)")
    from .tree_kda import KDA_BACKENDS
    KDA_BACKENDS["fla"] = kda_fla_varlen
    return kda_fla_varlen


@functools.lru_cache(maxsize=None)
def _fla():
    """fla-core's internal pieces this backend runs (their signatures are 0.6.0's)."""
    import fla
    if getattr(fla, "__version__", None) != FLA_VERSION:
        raise RuntimeError(f"the fla KDA backend is pinned to fla-core=={FLA_VERSION} (its internal kernels), "
                           f"found {getattr(fla, '__version__', 'unknown')}")
    import triton
    from fla.ops.common.chunk_delta_h import (chunk_gated_delta_rule_fwd_h,
                                              chunk_gated_delta_rule_fwd_kernel_h_blockdim64)
    from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_dAv, chunk_kda_bwd_wy_dqkg_fused
    from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra, chunk_kda_fwd_intra
    from fla.ops.kda.wy_fast import recompute_w_u_fwd
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    from .triton_launch import fast_autotuned_launches
    fast_autotuned_launches()      # fla's tuners and ours: a tuned key launches without the tuners' key work
    return SimpleNamespace(triton=triton, fwd_h=chunk_gated_delta_rule_fwd_h,
                           fwd_h_kernel=chunk_gated_delta_rule_fwd_kernel_h_blockdim64, fwd_o=chunk_gla_fwd_o_gk,
                           bwd_dAv=chunk_kda_bwd_dAv, bwd_wy=chunk_kda_bwd_wy_dqkg_fused, bwd_intra=chunk_kda_bwd_intra,
                           fwd_intra=chunk_kda_fwd_intra, recompute_w_u=recompute_w_u_fwd, cumsum=chunk_local_cumsum,
                           RCP_LN2=RCP_LN2)


class _Varlen:
    """fla's varlen metadata for sequence lengths ``lengths`` (host list), built on the host once.

    ``boundaries[u] = (n, j)``: the state after the first j chunks of sequence n (1 <= j <=
    its chunk count), row u of the Function's state output.  ``inj_map`` [NT] int32: for
    every global chunk, the row exported at its end, -1 for none.  Inner boundaries read
    the recurrence's chunk states (``h[chunk + 1]``: ``inner_rows``/``inner_src``), sequence
    ends the final states (``final_rows``/``final_src``).
    """

    def __init__(self, lengths: List[int], boundaries: List[Tuple[int, int]], device):
        L = np.asarray(lengths, dtype=np.int64)
        nch = (L + CHUNK - 1) // CHUNK
        cu = np.concatenate([[0], np.cumsum(L)])
        co = np.concatenate([[0], np.cumsum(nch)])
        self.num_seqs = int(L.size)
        self.num_tokens = int(cu[-1])
        self.num_chunks = int(co[-1])
        seg = np.repeat(np.arange(L.size), nch)
        idx = np.arange(self.num_chunks) - co[:-1][seg]
        self.cu_seqlens_cpu = torch.from_numpy(cu)
        self.num_exports = len(boundaries)
        inj = np.full(self.num_chunks, -1, dtype=np.int32)
        inner_rows, inner_src, final_rows, final_src = [], [], [], []
        for u, (n, j) in enumerate(boundaries):
            chunk = int(co[n]) + j - 1
            inj[chunk] = u
            if j < nch[n]:
                inner_rows.append(u)
                inner_src.append(chunk + 1)
            else:
                final_rows.append(u)
                final_src.append(n)
        t = lambda x: torch.as_tensor(np.asarray(x, dtype=np.int64))  # noqa: E731
        (self.cu_seqlens, self.chunk_indices, self.chunk_offsets, self.inj_map, self.inner_rows, self.inner_src,
         self.final_rows, self.final_src) = host_to_device_many(
            [self.cu_seqlens_cpu, torch.from_numpy(np.stack([seg, idx], 1)), torch.from_numpy(co),
             torch.from_numpy(inj), t(inner_rows), t(inner_src), t(final_rows), t(final_src)], device)
        self.has_inner, self.has_final = bool(inner_rows), bool(final_rows)


def _fwd_states(f, kg, w, u, g_cum, h0, vl: _Varlen, state_dtype):
    """fla's state recurrence (its own kernel), with the chunk states stored in ``state_dtype``.

    Same launch as ``chunk_gated_delta_rule_fwd_h`` except the dtype of the chunk-state
    buffer: fp32 keeps exported inner states exact for bf16 inputs (casting that buffer to
    bf16 gives the very values fla would have stored).  Returns (h, v_new, final states).
    """
    _, T, H, K = kg.shape
    V = u.shape[-1]
    N = vl.num_seqs
    h = kg.new_empty(1, vl.num_chunks, H, K, V, dtype=state_dtype)
    v_new = torch.empty_like(u)
    ht = kg.new_zeros(N, H, K, V, dtype=torch.float32) if vl.has_final else None

    def grid(meta):
        return (f.triton.cdiv(V, meta["BV"]) * N * H,)

    f.fwd_h_kernel[grid](k=kg, v=u, w=w, v_new=v_new, g=None, gk=g_cum, h=h, h0=h0, ht=ht,
                         cu_seqlens=vl.cu_seqlens, chunk_offsets=vl.chunk_offsets, T=T, H=H, HV=H, K=K, V=V,
                         BT=CHUNK, STATE_V_FIRST=False)
    return h, v_new, ht


class _ChunkKdaExport(torch.autograd.Function):
    """fla chunked KDA over packed sequences, exporting chunk-boundary states differentiably.

    Inputs (contiguous, batch 1): q, k, g [1, T, H, K], v [1, T, H, V], beta [1, T, H],
    h0 [N, H, K, V] fp32 or None, or with ``h0_index`` [N] (device int64) the distinct starting
    states [M, H, K, V], sequence n starting from ``h0[h0_index[n]]``: backward keeps only those M
    (the per-sequence states are gathered again when it runs).  Returns (o [1, T, H, V], states
    [U, H, K, V] fp32), U = ``vl.num_exports``.
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, vl: _Varlen, scale: float, h0_index: Optional[torch.Tensor]):
        f = _fla()
        cu, ci = vl.cu_seqlens, vl.chunk_indices
        g_cum = f.cumsum(g, chunk_size=CHUNK, scale=f.RCP_LN2, cu_seqlens=cu, chunk_indices=ci)
        w, u, _, kg, Aqk, Akk = f.fwd_intra(q=q, k=k, v=v, gk=g_cum, beta=beta, scale=scale, cu_seqlens=cu,
                                            chunk_size=CHUNK, chunk_indices=ci, safe_gate=False,
                                            disable_recompute=False)
        state_dtype = torch.float32 if vl.has_inner else kg.dtype
        h, v_new, ht = _fwd_states(f, kg, w, u, g_cum, _per_sequence(h0, h0_index), vl, state_dtype)
        states = q.new_empty(vl.num_exports, *h.shape[2:], dtype=torch.float32)
        if vl.has_inner:
            states[vl.inner_rows] = h[0, vl.inner_src]
        if vl.has_final:
            states[vl.final_rows] = ht[vl.final_src]
        if h.dtype != kg.dtype:
            h = h.to(kg.dtype)
        o = f.fwd_o(q=q, v=v_new, g=g_cum, A=Aqk, h=h, scale=scale, cu_seqlens=cu, chunk_size=CHUNK,
                    chunk_indices=ci)
        ctx.save_for_backward(q, k, v, g_cum, beta, Aqk, Akk, h0)
        ctx.vl, ctx.scale, ctx.g_dtype, ctx.h0_index = vl, scale, g.dtype, h0_index
        return o.to(q.dtype), states

    @staticmethod
    def backward(ctx, do, dstates):
        from .kda_state_grad import kda_state_grad
        f = _fla()
        q, k, v, g_cum, beta, Aqk, Akk, h0_distinct = ctx.saved_tensors
        vl, scale, h0_index = ctx.vl, ctx.scale, ctx.h0_index
        h0 = _per_sequence(h0_distinct, h0_index)
        cu, ci, co = vl.cu_seqlens, vl.chunk_indices, vl.chunk_offsets
        do = torch.zeros_like(v) if do is None else do.to(v.dtype).contiguous()
        H, K, V = q.shape[2], q.shape[3], v.shape[3]
        if dstates is None:
            dstates = q.new_zeros(vl.num_exports, H, K, V, dtype=torch.float32)
        # fla's chunk_kda_bwd (disable_recompute=False), its dhu step replaced by ours
        w, u, qg, kg = f.recompute_w_u(q=q, k=k, v=v, beta=beta, A=Akk, gk=g_cum, cu_seqlens=cu, chunk_indices=ci)
        h, v_new, _ = f.fwd_h(k=kg, w=w, u=u, gk=g_cum, initial_state=h0, output_final_state=False, cu_seqlens=cu,
                              cu_seqlens_cpu=vl.cu_seqlens_cpu, chunk_indices=ci, chunk_offsets=co, chunk_size=CHUNK)
        dAqk, dv = f.bwd_dAv(q=q, k=k, v=v_new, do=do, A=Aqk, scale=scale, cu_seqlens=cu, chunk_size=CHUNK,
                             chunk_indices=ci)
        dh, dh0, dv = kda_state_grad(qg, kg, w, g_cum, do, dv, dstates.float(), vl.inj_map, cu, co, scale=scale,
                                     chunk_size=CHUNK, num_chunks=vl.num_chunks, want_dh0=h0 is not None)
        dq, dk, dv, db, dg, dAkk = f.bwd_wy(q=q, k=k, v=v, v_new=v_new, g=g_cum, beta=beta, A=Akk, h=h, do=do,
                                            dh=dh, dv=dv, scale=scale, cu_seqlens=cu, chunk_size=CHUNK,
                                            chunk_indices=ci, chunk_offsets=co)
        dq, dk, db, dg = f.bwd_intra(q=q, k=k, g=g_cum, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db,
                                     dg=dg, cu_seqlens=cu, chunk_indices=ci, chunk_size=CHUNK, safe_gate=False)
        dg = f.cumsum(dg, chunk_size=CHUNK, reverse=True, cu_seqlens=cu, chunk_indices=ci)
        if dh0 is not None and h0_index is not None:
            dh0 = torch.zeros_like(h0_distinct).index_add_(0, h0_index, dh0)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(ctx.g_dtype), db.to(beta.dtype), dh0,
                None, None, None)


def _per_sequence(h0: Optional[torch.Tensor], h0_index: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """One starting state per sequence: ``h0`` itself, or its rows ``h0_index``."""
    return h0 if h0 is None or h0_index is None else h0.index_select(0, h0_index)


def _host_list(x) -> List[int]:
    if x is None:
        return []
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.reshape(-1).tolist()]
    return [int(v) for v in np.asarray(x).reshape(-1).tolist()]


def kda_fla_varlen(q, k, v, g, beta, lengths, *, chunk_size: int = 64, scale: Optional[float] = None,
                   initial_state: Optional[torch.Tensor] = None, state_index=None,
                   state_offset=None, initial_state_index=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``kda_chunked_varlen`` on fla's kernels, one varlen launch: (outputs [L, H, V], states [P, H, K, V] fp32).

    Inputs packed back to back (q, k, g [L, H, K], v [L, H, V], beta [L, H]); ``lengths``,
    ``state_index``, ``state_offset`` and ``initial_state_index`` are host integers (lists or CPU
    tensors), so a call never waits for the GPU.  With ``initial_state_index`` the launch keeps
    for backward only the distinct starting states ``initial_state`` [M, H, K, V].
    """
    lens = check_varlen(q, k, v, g, beta, lengths)
    if chunk_size != CHUNK:
        raise ValueError(f"the fla KDA backend runs fla's 64-token chunks; got chunk_size={chunk_size} "
                         "(use --tree-chunk-size 64, i.e. kda_chunk_size=64, with the fla backend)")
    if q.dtype not in _DTYPES or any(x.dtype != q.dtype for x in (k, v, g, beta)):
        raise ValueError(f"the fla KDA backend takes float32, bfloat16 or float16 inputs of one dtype; got "
                         f"{[str(x.dtype) for x in (q, k, v, g, beta)]}")
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise ValueError("the fla KDA backend needs CUDA tensors (fla's kernels are Triton GPU kernels; on CPU "
                         "only under TRITON_INTERPRET=1, for debugging)")
    N = len(lens)
    _, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    idx = _host_list(state_index)
    off = _host_list(state_offset)
    if len(idx) != len(off):
        raise ValueError("state_index and state_offset must have the same length")
    init_idx = check_initial_state_index(initial_state, initial_state_index, N)
    M = N if init_idx is None else initial_state.shape[0]    # an index comes with initial_state (checked)
    if initial_state is not None and tuple(initial_state.shape) != (M, H, K, V):
        raise ValueError(f"initial_state must be [{M}, {H}, {K}, {V}], got {tuple(initial_state.shape)}")
    for n, m in zip(idx, off):
        if not 0 <= n < N or not 1 <= m <= lens[n]:
            raise ValueError(f"export (sequence {n}, offset {m}): offsets must lie in [1, length of the sequence]")

    meta = _launch_meta(lens, idx, off, q.device, init_idx)
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    o, states_u = _ChunkKdaExport.apply(*(x.unsqueeze(0).contiguous() for x in (q, k, v, g, beta)), h0,
                                        meta.varlen, scale, meta.h0_index)
    o = o[0]
    P = len(idx)
    if P == 0:
        return o, q.new_zeros(0, H, K, V, dtype=torch.float32)
    parts = []
    if meta.num_direct:
        parts.append(states_u if meta.direct_rows is None else states_u.index_select(0, meta.direct_rows))
    if meta.partial:
        parts.append(_partial_states(q, k, v, g, beta, initial_state, states_u, meta, scale))
    stacked = torch.cat(parts) if len(parts) > 1 else parts[0]
    return o, stacked if meta.inverse is None else stacked.index_select(0, meta.inverse)


def kda_fla(q, k, v, g, beta, *, chunk_size: int = 64, scale: Optional[float] = None,
            initial_state: Optional[torch.Tensor] = None, state_index=None,
            state_offset=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``kda_chunked``'s padded form on fla's kernels: (outputs [N, T, H, V], states [P, H, K, V] fp32).

    Every sequence runs all T positions (zero padding leaves the outputs and states of the
    positions before it unchanged); :func:`kda_fla_varlen` is the form the model runs.
    """
    _check_shapes(q, k, v, g, beta)
    N, T = q.shape[:2]
    flat = lambda x: x.reshape((N * T,) + tuple(x.shape[2:]))  # noqa: E731
    o, states = kda_fla_varlen(flat(q), flat(k), flat(v), flat(g), flat(beta), [T] * N, chunk_size=chunk_size,
                               scale=scale, initial_state=initial_state, state_index=state_index,
                               state_offset=state_offset)
    return o.view(N, T, *o.shape[1:]), states


@dataclass
class _LaunchMeta:
    """What one ``kda_fla_varlen`` launch needs besides the inputs, all derived from host integers
    (lengths, exports): fla's varlen metadata, the state rows exported directly (aligned offsets
    and sequence ends), the exports recomputed from the aligned state before them (``partial``:
    (p, n, c, r, row or -1)), their tokens' packed positions (``partial_pos`` [P', r_max],
    clamped; ``partial_inside``: the mask of the real ones), the permutation putting the
    exports back in request order, and each sequence's row of the distinct initial states
    (``h0_rows`` host, ``h0_index`` device; None when there is one state per sequence).
    ``direct_rows`` None: the ``num_direct`` direct exports are the state rows in order;
    ``inverse`` None: the request order is the direct exports', then the partial ones'."""
    varlen: _Varlen
    num_direct: int
    direct_rows: Optional[torch.Tensor]
    partial: List[Tuple[int, int, int, int, int]]
    partial_pos: Optional[torch.Tensor]
    partial_inside: Optional[torch.Tensor]
    inverse: Optional[torch.Tensor]
    h0_rows: Optional[List[int]]
    h0_index: Optional[torch.Tensor]


#: launch metadata by (lengths, exports, device): every KDA layer of a microbatch runs the
#: same calls, so only the first layer builds (and copies to the device) what the others reuse
_META_CACHE: "OrderedDict[tuple, _LaunchMeta]" = OrderedDict()
_META_CACHE_SIZE = 256


def _launch_meta(lens: List[int], idx: List[int], off: List[int], device,
                 init_idx: Optional[List[int]] = None) -> _LaunchMeta:
    key = (tuple(lens), tuple(idx), tuple(off), str(device), None if init_idx is None else tuple(init_idx))
    meta = _META_CACHE.get(key)
    if meta is not None:
        _META_CACHE.move_to_end(key)
        return meta
    keys, key_row = [], {}

    def boundary(n, j):
        if (n, j) not in key_row:
            key_row[(n, j)] = len(keys)
            keys.append((n, j))
        return key_row[(n, j)]

    direct, partial = [], []     # (p, row) and (p, n, c, r, row or -1 for the initial state)
    for p, (n, m) in enumerate(zip(idx, off)):
        if m % CHUNK == 0 or m == lens[n]:
            direct.append((p, boundary(n, -(-m // CHUNK))))
        else:
            c, r = divmod(m, CHUNK)
            partial.append((p, n, c, r, boundary(n, c) if c > 0 else -1))
    vl = _Varlen(lens, keys, device)
    partial_pos = partial_inside = None
    if partial:
        cu = np.concatenate([[0], np.cumsum(lens)])
        r_max = max(r for *_, r, _ in partial)
        start = np.array([cu[n] + c * CHUNK for _, n, c, _, _ in partial], dtype=np.int64)
        pos = start[:, None] + np.arange(r_max)[None, :]
        inside = np.arange(r_max)[None, :] < np.array([r for *_, r, _ in partial])[:, None]
        partial_pos = torch.from_numpy(np.where(inside, pos, 0))
        partial_inside = torch.from_numpy(inside)
    rows = [r for _, r in direct]
    direct_rows = None if rows == list(range(vl.num_exports)) else torch.as_tensor(rows, dtype=torch.long)
    inverse = None
    order = [p for p, _ in direct] + [p for p, *_ in partial]
    if order != list(range(len(idx))):
        inverse = torch.empty(len(idx), dtype=torch.long)
        inverse[torch.as_tensor(order)] = torch.arange(len(idx))
    h0_index = None if init_idx is None else torch.as_tensor(init_idx, dtype=torch.long)
    partial_pos, partial_inside, direct_rows, inverse, h0_index = host_to_device_many(
        [partial_pos, partial_inside, direct_rows, inverse, h0_index], device)
    meta = _LaunchMeta(vl, len(direct), direct_rows, partial, partial_pos, partial_inside, inverse, init_idx, h0_index)
    _META_CACHE[key] = meta
    if len(_META_CACHE) > _META_CACHE_SIZE:
        _META_CACHE.popitem(last=False)
    return meta


def _partial_states(q, k, v, g, beta, initial_state, states_u, meta: _LaunchMeta, scale):
    """States after r < 64 tokens of chunk c: the chunk's first r tokens from the aligned state, in torch."""
    _, H, K = q.shape
    V = v.shape[-1]
    pos, inside = meta.partial_pos, meta.partial_inside

    def take(x):
        y = x[pos]                                   # [P', r_max, ...]
        m = inside.view(inside.shape + (1,) * (y.dim() - 2))
        return torch.where(m, y, torch.zeros((), dtype=y.dtype, device=y.device))

    zero = q.new_zeros(H, K, V, dtype=torch.float32)
    base = []
    for _, n, _, _, row in meta.partial:
        if row >= 0:
            base.append(states_u[row])
        elif initial_state is not None:
            base.append(initial_state[n if meta.h0_rows is None else meta.h0_rows[n]].to(torch.float32))
        else:
            base.append(zero)
    rs = torch.as_tensor([r for *_, r, _ in meta.partial])
    _, st = kda_chunked(take(q), take(k), take(v), take(g), take(beta), chunk_size=CHUNK, scale=scale,
                        initial_state=torch.stack(base), state_index=torch.arange(len(meta.partial)), state_offset=rs)
    return st

