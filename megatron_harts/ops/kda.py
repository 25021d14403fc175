"""Kimi Delta Attention (KDA) core on plain torch: a recurrent reference and a chunked form.

The recurrence (per head; ``S`` is a K x V state, ``q`` is pre-scaled):

    S_t = diag(exp(g_t)) S_{t-1}                      # per-channel decay, g_t <= 0
    S_t = S_t + beta_t k_t (v_t - k_t^T S_t)^T        # delta rule
    o_t = S_t^T q_t

``kda_recurrent`` runs it token by token (the readable reference).
``kda_chunked`` computes the same thing in chunks of ``chunk_size`` tokens
counted from each sequence's start (the WY/UT form fla uses): expanded
training chunks a trajectory at multiples of B from position 0, and the tree
executor (tree_kda.py) calls this very function on sequences that start at
multiples of B, so both perform the same floating-point operations on every
chunk (docs/design.md, invariant 2).  The chunk recurrence also returns the
state after any requested number of tokens of a sequence: at chunk boundaries
from the chunk update itself, inside a chunk (the ``--no-tree-replay``
ablation) from the partial-chunk form of the same update.

Shapes: q, k, g: [N, T, H, K]; v: [N, T, H, V]; beta: [N, T, H]; states
[N, H, K, V].  ``kda_chunked_varlen`` is the packed (varlen) form every KDA
backend implements: N sequences back to back, q, k, g [L, H, K], v [L, H, V],
beta [L, H], ``lengths`` [N] host integers summing to L.  Computation runs in float32 (float64 when the inputs are
float64, for exactness tests) and returns outputs in the input dtype.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check_shapes(q, k, v, g, beta, lead: str = "N, T"):
    """q, k, g [*lead, H, K], v [*lead, H, V], beta [*lead, H]: padded (``N, T``) or packed (``L``)."""
    d = lead.count(",") + 3
    if q.dim() != d or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"q, k and g must share the shape [{lead}, H, K]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(g.shape)}")
    if v.dim() != d or v.shape[:d - 1] != q.shape[:d - 1]:
        raise ValueError(f"v must be [{lead}, H, V] matching q's [{lead}, H]; got {tuple(v.shape)}")
    if beta.shape != q.shape[:d - 1]:
        raise ValueError(f"beta must be [{lead}, H]; got {tuple(beta.shape)}")


def kda_recurrent(q, k, v, g, beta, *, scale: Optional[float] = None,
                  initial_state: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token KDA: returns (outputs [N, T, H, V], final state [N, H, K, V])."""
    _check_shapes(q, k, v, g, beta)
    N, T, H, K = q.shape
    V = v.shape[-1]
    dt = _compute_dtype(q)
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    S = q.new_zeros(N, H, K, V) if initial_state is None else initial_state.to(dt)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)
        kt = k[:, t]
        pred = torch.einsum("nhk,nhkv->nhv", kt, S)
        delta = (v[:, t] - pred) * beta[:, t].unsqueeze(-1)
        S = S + kt.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append(torch.einsum("nhk,nhkv->nhv", q[:, t] * scale, S))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(N, 0, H, V).to(dt)
    return o.to(v.dtype), S


def _solve_unit_lower(a: torch.Tensor) -> torch.Tensor:
    """(I - A)^-1 for strictly lower-triangular ``a`` [..., B, B], by forward substitution.

    Row i of the result only reads rows < i, so padding after a sequence's end
    never changes the rows before it.
    """
    B = a.shape[-1]
    t = a.clone()
    for i in range(1, B):
        row = t[..., i, :i].clone()
        t[..., i, :i] = row + (row.unsqueeze(-1) * t[..., :i, :i].clone()).sum(-2)
    return t + torch.eye(B, dtype=a.dtype, device=a.device)


#: above this many elements of a [N, H, C, B, B, K] intra-chunk product, ``kda_chunked`` recomputes
#: the products in its backward instead of keeping them (the fp32 oracle of an 11k-token bf16
#: fidelity sample kept ~100 GiB of them over 9 KDA layers); outputs and gradients are the same bits
RECOMPUTE_INTRA_CHUNK_ELEMENTS = 1 << 26


def _intra_chunk(qc, kc, kb, gc):
    """Within every chunk, ``a[i, j] = -sum_k kb[i] kc[j] exp(gc[i] - gc[j])`` for j < i (else 0) and
    ``qk[i, j] = sum_k qc[i] kc[j] exp(gc[i] - gc[j])`` for j <= i (else 0): [N, H, C, B, B] each."""
    B = gc.shape[-2]
    causal = torch.ones(B, B, dtype=torch.bool, device=gc.device).triu(1)   # j > i
    diag_up = torch.ones(B, B, dtype=torch.bool, device=gc.device).triu(0)  # j >= i
    # decay[i, j, :] = exp(gc[i] - gc[j]) for j <= i
    decay = (gc.unsqueeze(-2) - gc.unsqueeze(-3)).masked_fill(causal[..., None], float("-inf")).exp()
    a = -(kb.unsqueeze(-2) * kc.unsqueeze(-3) * decay).sum(-1).masked_fill(diag_up, 0)
    qk = (qc.unsqueeze(-2) * kc.unsqueeze(-3) * decay).sum(-1).masked_fill(causal, 0)
    return a, qk


def kda_chunked(q, k, v, g, beta, *, chunk_size: int = 64, scale: Optional[float] = None,
                initial_state: Optional[torch.Tensor] = None,
                state_index: Optional[torch.Tensor] = None,
                state_offset: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Chunked KDA over N independent sequences (chunks start at each sequence's position 0).

    Returns (outputs [N, T, H, V], states [P, H, K, V]) where states[p] is the
    state of sequence ``state_index[p]`` after its first ``state_offset[p]``
    tokens (0 < offset <= T).  Outputs at positions < T_n of a sequence padded
    with zeros to T are those of the unpadded sequence.
    """
    _check_shapes(q, k, v, g, beta)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    N, T, H, K = q.shape
    V = v.shape[-1]
    B = chunk_size
    dt = _compute_dtype(q)
    scale = K ** -0.5 if scale is None else scale
    pad = (-T) % B
    C = (T + pad) // B

    def chunks(x):  # [N, T, H, D] -> [N, H, C, B, D]
        x = x.to(dt).transpose(1, 2)
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
        return x.reshape(N, H, C, B, x.shape[-1])

    qc, kc, vc, gc = chunks(q) * scale, chunks(k), chunks(v), chunks(g)
    bc = chunks(beta.unsqueeze(-1))  # [N, H, C, B, 1]
    gc = gc.cumsum(dim=-2)           # cumulative log decay inside each chunk
    kb = kc * bc
    if torch.is_grad_enabled() and N * H * C * B * B * K > RECOMPUTE_INTRA_CHUNK_ELEMENTS:
        # the same operations, recomputed in the backward instead of saving the [.., B, B, K] products
        a, qk = torch.utils.checkpoint.checkpoint(_intra_chunk, qc, kc, kb, gc, use_reentrant=False,
                                                  preserve_rng_state=False)
    else:
        a, qk = _intra_chunk(qc, kc, kb, gc)
    t_inv = _solve_unit_lower(a)
    u = t_inv @ (vc * bc)                 # pseudo-values
    w = t_inv @ (kb * gc.exp())           # what the incoming state contributes to them

    S = q.new_zeros(N, H, K, V, dtype=dt) if initial_state is None else initial_state.to(dt)
    outs, states, vnews = [], [S], []
    for c in range(C):
        g_c = gc[:, :, c]
        v_new = u[:, :, c] - w[:, :, c] @ S
        outs.append((qc[:, :, c] * g_c.exp()) @ S + qk[:, :, c] @ v_new)
        vnews.append(v_new)
        g_last = g_c[:, :, -1:]            # [N, H, 1, K]
        S = S * g_last.transpose(-1, -2).exp() + (kc[:, :, c] * (g_last - g_c).exp()).transpose(-1, -2) @ v_new
        states.append(S)
    o = torch.stack(outs, dim=2).reshape(N, H, C * B, V)[:, :, :T].transpose(1, 2)

    if state_index is None:
        return o.to(v.dtype), q.new_zeros(0, H, K, V, dtype=dt)
    state_index = torch.as_tensor(state_index, dtype=torch.long, device=q.device)
    state_offset = torch.as_tensor(state_offset, dtype=torch.long, device=q.device)
    if state_index.numel() and (state_offset.min() < 1 or state_offset.max() > T):
        raise ValueError(f"state_offset must lie in [1, {T}]")
    out_states = []
    for n, m in zip(state_index.tolist(), state_offset.tolist()):
        c, r = divmod(m, B)
        if r == 0:
            out_states.append(states[c][n])
            continue
        # the state after r tokens of chunk c: the chunk update restricted to its first r tokens
        g_c = gc[n, :, c, :r]              # [H, r, K]
        g_last = g_c[:, -1:]
        part = (kc[n, :, c, :r] * (g_last - g_c).exp()).transpose(-1, -2) @ vnews[c][n, :, :r]
        out_states.append(states[c][n] * g_last.transpose(-1, -2).exp() + part)
    stacked = torch.stack(out_states) if out_states else q.new_zeros(0, H, K, V, dtype=dt)
    return o.to(v.dtype), stacked


def host_lengths(lengths) -> list:
    """Sequence lengths as a host list of ints (a CPU tensor, numpy array or sequence)."""
    if isinstance(lengths, torch.Tensor):
        if lengths.device.type != "cpu":
            raise ValueError("lengths must be on the host (a CPU tensor or a list): reading them from the GPU "
                             "would stall the host on every call")
        return [int(n) for n in lengths.reshape(-1).tolist()]
    return [int(n) for n in lengths]


def check_initial_state_index(initial_state, initial_state_index, num_seqs: int) -> Optional[list]:
    """``initial_state_index`` as a host list of ``num_seqs`` rows of ``initial_state`` (None: one state per
    sequence, in order)."""
    if initial_state_index is None:
        return None
    if initial_state is None:
        raise ValueError("initial_state_index needs initial_state (the distinct starting states)")
    idx = host_lengths(initial_state_index)
    M = initial_state.shape[0]
    if len(idx) != num_seqs or any(not 0 <= i < M for i in idx):
        raise ValueError(f"initial_state_index must name one of the {M} initial states for each of the "
                         f"{num_seqs} sequences, got {idx}")
    return idx


def expand_initial_state(initial_state, initial_state_index, num_seqs: int):
    """One starting state per sequence (``initial_state`` itself without an index)."""
    idx = check_initial_state_index(initial_state, initial_state_index, num_seqs)
    if idx is None:
        return initial_state
    return initial_state.index_select(0, torch.as_tensor(idx, dtype=torch.long, device=initial_state.device))


def check_varlen(q, k, v, g, beta, lengths) -> list:
    """Shapes of packed KDA inputs (q, k, g [L, H, K], v [L, H, V], beta [L, H]); the lengths as a list."""
    _check_shapes(q, k, v, g, beta, lead="L")
    lens = host_lengths(lengths)
    if not lens or any(n < 1 for n in lens) or sum(lens) != q.shape[0]:
        raise ValueError(f"lengths must be positive and sum to the {q.shape[0]} packed tokens, got {lens}")
    return lens


def kda_chunked_varlen(q, k, v, g, beta, lengths, *, chunk_size: int = 64, scale: Optional[float] = None,
                       initial_state: Optional[torch.Tensor] = None,
                       state_index: Optional[torch.Tensor] = None,
                       state_offset: Optional[torch.Tensor] = None,
                       initial_state_index=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``kda_chunked`` on N sequences packed back to back (the varlen form of every backend).

    Returns (outputs [L, H, V], states [P, H, K, V]); ``state_offset[p]`` lies in
    [1, lengths[state_index[p]]].  ``initial_state``: [N, H, K, V], one per sequence, or with
    ``initial_state_index`` (host ints, one per sequence) the M distinct starting states
    [M, H, K, V], sequence n starting from ``initial_state[initial_state_index[n]]`` (sequences
    forking from one state share its row, which a backend keeps for backward once).  The
    reference pads the sequences with zeros to the longest and runs :func:`kda_chunked`, which
    leaves every valid position as the unpadded sequence has it.
    """
    lens = check_varlen(q, k, v, g, beta, lengths)
    initial_state = expand_initial_state(initial_state, initial_state_index, len(lens))
    N, T, L = len(lens), max(lens), q.shape[0]
    dev = q.device
    starts = torch.tensor([0] + lens[:-1], dtype=torch.long).cumsum(0)
    t = torch.arange(T)
    valid = t[None, :] < torch.tensor(lens)[:, None]                           # [N, T]
    src = torch.where(valid, starts[:, None] + t[None, :], torch.full((N, T), L))  # L = a zero row
    src, flat = src.flatten().to(dev), torch.nonzero(valid.flatten()).flatten().to(dev)

    def pad(x):
        z = torch.cat([x, x.new_zeros((1,) + tuple(x.shape[1:]))])
        return z.index_select(0, src).view((N, T) + tuple(x.shape[1:]))

    if state_index is not None:
        for n, m in zip(host_lengths(state_index), host_lengths(state_offset)):
            if not 0 <= n < N or not 1 <= m <= lens[n]:
                raise ValueError(f"export (sequence {n}, offset {m}): offsets must lie in [1, length of the sequence]")
    o, states = kda_chunked(pad(q), pad(k), pad(v), pad(g), pad(beta), chunk_size=chunk_size, scale=scale,
                            initial_state=initial_state, state_index=state_index, state_offset=state_offset)
    return o.reshape((N * T,) + tuple(o.shape[2:])).index_select(0, flat), states
