"""KDA backward state-gradient recurrence with injected boundary-state gradients.

The chunked KDA backward (fla's, WY/UT form) runs one sequential loop per
sequence and head, from the last chunk to the first, carrying ``dS``, the
gradient of the loss with respect to the state at the end of the current chunk.
Per chunk ``c`` (tokens ``[cB, min(cB+B, L))``, ``B`` = chunk size):

    dS    += inj[c]                             # gradient of the exported state after chunk c
    dh[c]  = dS                                 # saved for the gradients of k, g (fla's wy_dqkg)
    dv2_c  = kg_c @ dS + dv_c                   # gradient of the chunk's pseudo-values v_new
    dS     = exp2(g_last)[:, None] * dS + scale * qg_c^T @ do_c - w_c^T @ dv2_c
    ...
    dh0    = dS                                 # gradient of the initial state

with fla's tensors: ``qg = q * exp2(G)``, ``kg = k * exp2(G_last - G)`` (``G`` the
in-chunk cumulative log2 decay, ``gk``), ``w`` the WY weights, ``dv`` the
intra-chunk part of the pseudo-value gradient.  This is the recurrence of
fla-core 0.6.0's ``chunk_gated_delta_rule_bwd_dhu`` (gated-key form, state [K, V]);
what it lacks, and what this module adds, is ``inj``: gradients of states that a
caller exported at chunk boundaries *inside* a sequence (the tree executor's
boundary states, consumed by later calls).  The final state's gradient is the
injection after the last chunk.

Two implementations with one interface (:func:`kda_state_grad`):

- ``reference``: plain torch, loops over sequences and chunks (readable; any device);
- ``triton``: one program per (value block, sequence, head) walking the chunks
  backwards, the [K, BV] block of ``dS`` in registers (GPU, or CPU under
  ``TRITON_INTERPRET=1``).  Written for this project, not a copy of fla's kernel.

Layout (fla's varlen layout, batch 1): ``q, k, w, gk`` [1, T, H, K]; ``do, dv``
[1, T, H, V]; ``cu_seqlens`` [N+1]; ``chunk_offsets`` [N+1] (first global chunk of
every sequence, and the total); ``inj`` [U, H, K, V] (fp32); ``inj_map`` int32
[NT]: for every global chunk the row of ``inj`` holding the gradient of the state
at that chunk's end, -1 for none.  Returns ``dh`` [1, NT, H, K, V] (``q``'s dtype),
``dh0`` [N, H, K, V] fp32 (or None) and ``dv2`` (``dv``'s shape and dtype).
"""
from __future__ import annotations

import inspect
import os
from typing import Optional, Tuple

import torch

try:  # Triton is optional: CPU CI has none, and only the "triton" implementation needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None


def _check(q, k, w, gk, do, dv, inj, inj_map, cu_seqlens, chunk_offsets, num_chunks):
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"q must be [1, T, H, K] (varlen, batch 1), got {tuple(q.shape)}")
    for name, x in (("k", k), ("w", w), ("gk", gk)):
        if x.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(x.shape)}")
    if do.shape != dv.shape or do.shape[:3] != q.shape[:3]:
        raise ValueError(f"do and dv must be [1, T, H, V] matching q; got {tuple(do.shape)}, {tuple(dv.shape)}")
    _, _, H, K = q.shape
    V = do.shape[-1]
    if inj.dim() != 4 or inj.shape[1:] != (H, K, V):
        raise ValueError(f"inj must be [U, {H}, {K}, {V}], got {tuple(inj.shape)}")
    if inj_map.shape != (num_chunks,):
        raise ValueError(f"inj_map must have one entry per chunk ({num_chunks}), got {tuple(inj_map.shape)}")
    if chunk_offsets.shape != cu_seqlens.shape:
        raise ValueError("chunk_offsets must have cu_seqlens' shape [N+1]")


def state_grad_reference(q, k, w, gk, do, dv, inj, inj_map, cu_seqlens, chunk_offsets, *, scale: float,
                         chunk_size: int = 64, num_chunks: Optional[int] = None, want_dh0: bool = True
                         ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Plain-torch state-gradient recurrence (see the module docstring); fp32 arithmetic."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    co = [int(x) for x in chunk_offsets.tolist()]
    NT = co[-1] if num_chunks is None else int(num_chunks)
    _check(q, k, w, gk, do, dv, inj, inj_map, cu_seqlens, chunk_offsets, NT)
    _, _, H, K = q.shape
    V = do.shape[-1]
    B = chunk_size
    f32 = torch.float32
    imap = [int(x) for x in inj_map.tolist()]
    dh = q.new_zeros(1, NT, H, K, V)
    dv2 = torch.zeros_like(dv)
    dh0 = q.new_zeros(len(cu) - 1, H, K, V, dtype=f32) if want_dh0 else None
    for n in range(len(cu) - 1):
        bos, eos = cu[n], cu[n + 1]
        dS = q.new_zeros(H, K, V, dtype=f32)
        for c in reversed(range(co[n + 1] - co[n])):
            gc = co[n] + c
            if imap[gc] >= 0:
                dS = dS + inj[imap[gc]].to(f32)
            dh[0, gc] = dS.to(dh.dtype)
            t0, t1 = bos + c * B, min(bos + c * B + B, eos)
            kc, qc, wc = (x[0, t0:t1].to(f32) for x in (k, q, w))          # [L, H, K]
            dvc = torch.einsum("lhk,hkv->lhv", kc, dS) + dv[0, t0:t1].to(f32)
            dv2[0, t0:t1] = dvc.to(dv2.dtype)
            g_last = gk[0, t1 - 1].to(f32)                                  # [H, K]
            dS = (dS * torch.exp2(g_last).unsqueeze(-1)
                  + scale * torch.einsum("lhk,lhv->hkv", qc, do[0, t0:t1].to(f32))
                  - torch.einsum("lhk,lhv->hkv", wc, dvc))
        if dh0 is not None:
            dh0[n] = dS
    return dh, dh0, dv2


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


if triton is not None:
    @triton.jit
    def _state_grad_step(q, k, w, gk, do, dv, inj, inj_map, dh, dv2, scale, grad, c, first, bos, seq_len, i_h,
                         rk, rv, ok_k, ok_v, ok_kv, in_state,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
        """Chunk c of one sequence: inject, save dh, dv2 of the chunk; returns dL/dS before the chunk."""
        chunk = first + c
        head_state = i_h * K * V
        row = tl.load(inj_map + chunk)
        row_ok = row >= 0
        row = tl.where(row_ok, row, 0).to(tl.int64)
        grad += tl.load(inj + row * H * K * V + head_state + in_state, mask=ok_kv & row_ok, other=0.0)
        tl.store(dh + chunk * H * K * V + head_state + in_state, grad.to(dh.dtype.element_ty), mask=ok_kv)

        pos = c * BT + tl.arange(0, BT)                      # positions inside the sequence
        ok_t = pos < seq_len
        tok = bos + pos
        at_tk = (tok[:, None] * H + i_h) * K + rk[None, :]   # [BT, BK] view of a [T, H, K] tensor
        at_kt = (tok[None, :] * H + i_h) * K + rk[:, None]   # [BK, BT] (transposed) view
        at_tv = (tok[:, None] * H + i_h) * V + rv[None, :]   # [BT, BV] view of a [T, H, V] tensor
        ok_tk = ok_t[:, None] & ok_k[None, :]
        ok_kt = ok_k[:, None] & ok_t[None, :]
        ok_tv = ok_t[:, None] & ok_v[None, :]

        keys = tl.load(k + at_tk, mask=ok_tk, other=0.0)
        dvals = tl.dot(keys, grad.to(keys.dtype))
        dvals += tl.load(dv + at_tv, mask=ok_tv, other=0.0).to(tl.float32)
        tl.store(dv2 + at_tv, dvals.to(dv2.dtype.element_ty), mask=ok_tv)

        last = bos + tl.minimum(c * BT + BT, seq_len) - 1
        decay = tl.exp2(tl.load(gk + (last * H + i_h) * K + rk, mask=ok_k, other=0.0).to(tl.float32))
        q_t = tl.load(q + at_kt, mask=ok_kt, other=0.0)
        w_t = tl.load(w + at_kt, mask=ok_kt, other=0.0)
        d_out = tl.load(do + at_tv, mask=ok_tv, other=0.0)
        grad = grad * decay[:, None]
        grad += tl.dot(q_t, d_out.to(q_t.dtype)) * scale
        grad -= tl.dot(w_t, dvals.to(w_t.dtype))
        return grad

    @triton.jit
    def _state_grad_kernel(q, k, w, gk, do, dv, inj, inj_map, dh, dh0, dv2, cu_seqlens, chunk_offsets, scale,
                           H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                           BK: tl.constexpr, BV: tl.constexpr, HAS_DH0: tl.constexpr, WHILE_LOOP: tl.constexpr):
        # one program: value block i_v of head i_h of sequence i_n, all its chunks, last to first
        i_v = tl.program_id(0)
        i_nh = tl.program_id(1)
        i_n = i_nh // H
        i_h = i_nh % H
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        seq_len = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        first = tl.load(chunk_offsets + i_n).to(tl.int64)
        n_chunks = tl.load(chunk_offsets + i_n + 1).to(tl.int64) - first

        rk = tl.arange(0, BK)
        rv = i_v * BV + tl.arange(0, BV)
        ok_k = rk < K
        ok_v = rv < V
        ok_kv = ok_k[:, None] & ok_v[None, :]
        in_state = rk[:, None] * V + rv[None, :]            # offsets inside one [K, V] state

        grad = tl.zeros([BK, BV], dtype=tl.float32)         # dL/dS at the end of the current chunk
        if WHILE_LOOP:   # Triton's interpreter cannot range() over a loaded scalar
            c = n_chunks - 1
            while c >= 0:
                grad = _state_grad_step(q, k, w, gk, do, dv, inj, inj_map, dh, dv2, scale, grad, c, first, bos,
                                        seq_len, i_h, rk, rv, ok_k, ok_v, ok_kv, in_state, H, K, V, BT)
                c -= 1
        else:            # a for loop, which Triton software-pipelines (num_stages)
            for c in range(n_chunks - 1, -1, -1):
                grad = _state_grad_step(q, k, w, gk, do, dv, inj, inj_map, dh, dv2, scale, grad, c, first, bos,
                                        seq_len, i_h, rk, rv, ok_k, ok_v, ok_kv, in_state, H, K, V, BT)
        if HAS_DH0:
            tl.store(dh0 + i_nh * K * V + in_state, grad, mask=ok_kv)

    # Shared memory on sm_90 (K = 128, compiled offline): bf16 46-82 KB for BV 16-64; fp32 with tf32
    # dots 229 KB at BV=16 (the only fit under 227 KB), with TRITON_F32_DEFAULT=ieee 127-147 KB at
    # BV 16-32.  Configs that do not fit are dropped by the autotuner (OutOfResources).
    _STATE_GRAD_CONFIGS = [triton.Config({"BV": bv}, num_warps=nw, num_stages=2)
                           for bv in (16, 32, 64) for nw in (4, 8)]
    _tune_kwargs = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
    # the interpreter cannot time configs (no driver): it runs one fixed block size instead
    _state_grad_tuned = triton.autotune(configs=_STATE_GRAD_CONFIGS, key=["H", "K", "V", "BT", "BK"],
                                        **_tune_kwargs)(_state_grad_kernel)


def state_grad_triton(q, k, w, gk, do, dv, inj, inj_map, cu_seqlens, chunk_offsets, *, scale: float,
                      chunk_size: int = 64, num_chunks: Optional[int] = None, want_dh0: bool = True
                      ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """The Triton kernel (see the module docstring); needs Triton (a GPU, or TRITON_INTERPRET=1)."""
    if triton is None:
        raise RuntimeError("kda_state_grad: the 'triton' implementation needs Triton installed")
    NT = int(chunk_offsets[-1]) if num_chunks is None else int(num_chunks)
    _check(q, k, w, gk, do, dv, inj, inj_map, cu_seqlens, chunk_offsets, NT)
    _, _, H, K = q.shape
    V = do.shape[-1]
    N = cu_seqlens.numel() - 1
    if K > 256:
        raise ValueError(f"kda_state_grad: head dim K={K} > 256 is not supported")
    BK = max(16, triton.next_power_of_2(K))
    q, k, w, gk, do, dv = (x.contiguous() for x in (q, k, w, gk, do, dv))
    inj = inj.to(torch.float32).contiguous()
    if inj.shape[0] == 0:   # keep a valid pointer; every map entry is -1
        inj = inj.new_zeros(1, H, K, V)
    inj_map = inj_map.to(device=q.device, dtype=torch.int32).contiguous()
    dh = q.new_empty(1, NT, H, K, V)
    dh0 = q.new_empty(N, H, K, V, dtype=torch.float32) if want_dh0 else None
    dv2 = torch.empty_like(dv)

    def grid(meta):
        return (triton.cdiv(V, meta["BV"]), N * H)

    args = (q, k, w, gk, do, dv, inj, inj_map, dh, dh0 if want_dh0 else dh, dv2, cu_seqlens, chunk_offsets, scale)
    consts = dict(H=H, K=K, V=V, BT=chunk_size, BK=BK, HAS_DH0=want_dh0)
    if _interpreting():
        _state_grad_kernel[grid](*args, BV=32, WHILE_LOOP=True, **consts)
    else:
        _state_grad_tuned[grid](*args, WHILE_LOOP=False, **consts)
    return dh, dh0, dv2


IMPLEMENTATIONS = {"reference": state_grad_reference, "triton": state_grad_triton}


def kda_state_grad(q, k, w, gk, do, dv, inj, inj_map, cu_seqlens, chunk_offsets, *, scale: float,
                   chunk_size: int = 64, num_chunks: Optional[int] = None, want_dh0: bool = True,
                   impl: str = "triton"):
    """State-gradient recurrence with injected boundary gradients: ``(dh, dh0, dv2)``."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl must be one of {sorted(IMPLEMENTATIONS)}, got {impl!r}")
    return IMPLEMENTATIONS[impl](q, k, w, gk, do, dv, inj, inj_map, cu_seqlens, chunk_offsets, scale=scale,
                                 chunk_size=chunk_size, num_chunks=num_chunks, want_dh0=want_dh0)
