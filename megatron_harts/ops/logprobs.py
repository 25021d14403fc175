"""Multi-target log-probabilities over compact rows (docs/design.md, glossary "targets").

A row of the compact layout can carry several targets: one per trajectory
through it, and at a fork row several distinct next tokens.  The logits of a
row are computed once and every target reads its log-probability from them:

    logprob(r, v) = z[r, v] - logsumexp_u z[r, u],   z = hidden[r] @ weight.T

Only rows that carry at least one (row, token) pair get logits, and they are
computed ``chunk_rows`` rows at a time, so the [rows, vocab] logits never exist
whole (a 163840-token vocabulary times thousands of rows would not fit).  The
backward pass recomputes each chunk's logits instead of saving the softmax.

Invariant kept (docs/design.md invariant 1): for every (row, token) pair the value
equals ``log_softmax(hidden[row] @ weight.T)[token]``, i.e. the log-probability
that expanded mode computes at every (trajectory, position) whose row is
``row``; the gradient of any weighted sum of pair log-probabilities equals the
expanded gradient summed over the copies of each row.

Vocab-parallel form (``tp_group`` given): each rank holds the vocabulary shard
``[rank * V_local, (rank + 1) * V_local)`` of the output layer weight, as
megatron-core's ``VocabUtility.vocab_range_from_per_partition_vocab_size``
splits it.  Exactly three all-reduces run in the forward pass, however many
chunks there are: MAX of the row maxima, SUM of the (rescaled) exp-sums (the
entropy accumulator rides in the same tensor), SUM of the gathered target
logits (tokens outside a rank's shard contribute 0).  The result equals
``-megatron.core.tensor_parallel.vocab_parallel_cross_entropy(logits, target)``
on the expanded rows.  The backward pass all-reduces the hidden-state gradient
over ``tp_group`` (what ColumnParallelLinear's ``allreduce_dgrad`` does for the
output layer) unless ``reduce_hidden_grad=False``.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..layout import host_to_device_many

__all__ = [
    "multi_target_logprobs",
    "multi_target_logprobs_reference",
    "MultiTargetLogprobs",
    "default_chunk_rows",
]

#: default rows per logits chunk (``default_chunk_rows``): the GEMMs' M dimension, set for speed
_CHUNK_ROWS = 4096
#: ... unless one chunk's statistics-dtype logits would pass this many bytes (a very large vocabulary
#: shard, fp64 statistics): then the most rows that fit
_CHUNK_BYTES = 4 << 30


def default_chunk_rows(v_local: int, dtype: torch.dtype) -> int:
    """Rows per logits chunk when the caller names none (``--tree-logprob-chunk-rows`` unset):
    ``_CHUNK_ROWS`` (4096), fewer where one chunk's logits in the statistics dtype (fp32, or fp64
    for fp64 inputs) would pass ``_CHUNK_BYTES`` (4 GiB); at least 1.

    What the choice trades: a chunk's forward and backward hold [chunk, V_local] temporaries in the
    statistics dtype and in the inputs' dtype (the GEMM's output before its upcast, the gradient
    cast back for the GEMMs), of which one of each is alive at the peak: the peak above the inputs
    grows as chunk x V_local x (4 + 2) bytes for bf16 (``planner.memory.output_bytes``, held to the
    measurement below), plus what no chunk size changes: the fp32
    [V_local, H] weight-gradient accumulator and one [V_local, H] product per chunk, whose
    accumulation costs every chunk a pass over V_local x H.  Each chunk costs four GEMMs (one
    forward, three backward, the first recomputing the logits) whose M dimension is the chunk: too
    small a chunk under-fills them and repeats the accumulation.  At V = 163,840, hidden 2304, bf16
    on one H200 (``benchmarks/bench_logprobs.py``), forward + backward of 32,768 rows takes 290 ms
    in 4096-row chunks (6.7 GiB above the inputs), 276 ms in 8192-row chunks (10.8 GiB), 461 ms in
    409-row chunks (3.3 GiB) and 175 ms unchunked (59 GiB, the [rows, V] logits): 4096 rows is
    within 5% of the fastest chunking at 1.6x the fused form's time and a ninth of its memory.
    The values do not depend on the chunk.
    """
    itemsize = torch.finfo(_compute_dtype(dtype)).bits // 8
    return max(1, min(_CHUNK_ROWS, _CHUNK_BYTES // (max(1, int(v_local)) * itemsize)))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics are kept in fp64 for fp64 inputs, else in fp32 (as megatron's .float())."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _group_size_rank(group) -> Tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _chunk_bounds(num_rows: int, chunk_rows: int):
    for c0 in range(0, num_rows, chunk_rows):
        yield c0, min(num_rows, c0 + chunk_rows)


class MultiTargetLogprobs(torch.autograd.Function):
    """Log-probs of (row, token) pairs and optional per-row entropy, hand-written backward.

    Inputs: ``hidden`` [M, H] (only the rows that carry pairs), ``weight``
    [V_local, H], ``pair_lrow`` [P] (index into ``hidden``, sorted ascending),
    ``pair_token`` [P] (global token ids), then non-tensor settings, the last
    ``pair_bounds`` (host ints: the first pair of every ``chunk_rows`` chunk of rows, then P).
    Outputs: log-probs [P] and entropy [M] (an empty tensor when not requested).

    Backward, for incoming gradients g (per pair) and gH (per row):
        dL/dz[r, v] = sum_{p at r, token v} g_p - softmax[r, v] * sum_{p at r} g_p
                      - gH[r] * softmax[r, v] * (log softmax[r, v] + H[r])
    then dL/dhidden = dL/dz @ weight and dL/dweight = dL/dz.T @ hidden, chunk by chunk.
    The weight gradient accumulates over chunks in the statistics dtype (one
    fp32 [V_local, H] buffer for bf16 weights) and is cast to the weight's dtype once.
    Measured on one H200 (bf16, 8192 rows, 1.3 pairs per row, V = 163840, H = 2048,
    with entropy): forward + backward 72 ms at chunk_rows=1024, 3.6 GiB above the inputs.
    """

    @staticmethod
    def forward(ctx, hidden, weight, pair_lrow, pair_token, with_entropy, group, vocab_start,
                chunk_rows, reduce_hidden_grad, pair_bounds):
        cdt = _compute_dtype(hidden.dtype)
        num_rows = hidden.shape[0]
        v_local = weight.shape[0]
        local_max = torch.empty(num_rows, dtype=cdt, device=hidden.device)
        # column 0: sum exp(z - m_local); column 1: sum exp(z - m_local) * (z - m_local)
        local_sums = torch.zeros(num_rows, 2, dtype=cdt, device=hidden.device)
        target_logit = torch.zeros(pair_lrow.shape[0], dtype=cdt, device=hidden.device)
        in_shard = (pair_token >= vocab_start) & (pair_token < vocab_start + v_local)
        for i, (c0, c1) in enumerate(_chunk_bounds(num_rows, chunk_rows)):
            z = (hidden[c0:c1] @ weight.t()).to(cdt)
            p0, p1 = pair_bounds[i], pair_bounds[i + 1]
            if p1 > p0:
                ok = in_shard[p0:p1]
                col = torch.where(ok, pair_token[p0:p1] - vocab_start, torch.zeros_like(pair_token[p0:p1]))
                val = z[pair_lrow[p0:p1] - c0, col]
                target_logit[p0:p1] = torch.where(ok, val, torch.zeros_like(val))
            # two [chunk, V_local] temporaries at most: z (shifted in place) and its exp
            m = z.max(dim=1).values
            local_max[c0:c1] = m
            z.sub_(m[:, None])
            e = torch.exp(z)
            local_sums[c0:c1, 0] = e.sum(dim=1)
            if with_entropy:
                local_sums[c0:c1, 1] = e.mul_(z).sum(dim=1)
            del z, e
        row_max = local_max.clone()
        if group is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        # rescale each rank's sums from its local max to the global max
        scale = torch.exp(local_max - row_max)
        sums = torch.stack([local_sums[:, 0] * scale,
                            scale * (local_sums[:, 1] + (local_max - row_max) * local_sums[:, 0])], dim=1)
        if group is not None:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            dist.all_reduce(target_logit, op=dist.ReduceOp.SUM, group=group)
        log_s = torch.log(sums[:, 0])
        lse = row_max + log_s
        logprobs = (target_logit - row_max[pair_lrow]) - log_s[pair_lrow]
        if with_entropy:
            # H = log S - sum_v exp(z_v - m) (z_v - m) / S, both terms relative to the row max
            entropy = log_s - sums[:, 1] / sums[:, 0]
        else:
            entropy = torch.zeros(0, dtype=cdt, device=hidden.device)
        ctx.save_for_backward(hidden, weight, pair_lrow, pair_token, lse, entropy)
        ctx.settings = (with_entropy, group, vocab_start, chunk_rows, reduce_hidden_grad, pair_bounds)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, pair_lrow, pair_token, lse, entropy = ctx.saved_tensors
        with_entropy, group, vocab_start, chunk_rows, reduce_hidden_grad, pair_bounds = ctx.settings
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        cdt = lse.dtype
        num_rows = hidden.shape[0]
        v_local = weight.shape[0]
        grad_hidden = torch.zeros_like(hidden) if need_h else None
        grad_weight = torch.zeros(weight.shape, dtype=cdt, device=weight.device) if need_w else None
        if grad_logprobs is None:
            grad_logprobs = torch.zeros(pair_lrow.shape[0], dtype=cdt, device=hidden.device)
        g = grad_logprobs.to(cdt)
        # per-row total of the pair gradients: the softmax term's weight
        g_row = torch.zeros(num_rows, dtype=cdt, device=hidden.device).index_add_(0, pair_lrow, g)
        use_ent = with_entropy and grad_entropy is not None
        g_ent = grad_entropy.to(cdt) if use_ent else None
        in_shard = (pair_token >= vocab_start) & (pair_token < vocab_start + v_local)
        for i, (c0, c1) in enumerate(_chunk_bounds(num_rows, chunk_rows)):
            h = hidden[c0:c1]
            # in place: two [chunk, V_local] temporaries at most (log-softmax and softmax)
            logp = (h @ weight.t()).to(cdt).sub_(lse[c0:c1, None])
            p = torch.exp(logp)
            if use_ent:
                # -p * (G + gH * (log p + H))
                grad_z = (logp.add_(entropy[c0:c1, None]).mul_(g_ent[c0:c1, None])
                          .add_(g_row[c0:c1, None]).mul_(p).neg_())
            else:
                grad_z = p.mul_(g_row[c0:c1, None]).neg_()
            del logp, p
            p0, p1 = pair_bounds[i], pair_bounds[i + 1]
            if p1 > p0:
                # pairs of another rank's vocabulary shard add an exact zero (no data-dependent
                # selection: it would read its size back from the device)
                ok = in_shard[p0:p1]
                rows = pair_lrow[p0:p1] - c0
                cols = torch.where(ok, pair_token[p0:p1] - vocab_start, torch.zeros_like(pair_token[p0:p1]))
                grad_z.index_put_((rows, cols), torch.where(ok, g[p0:p1], torch.zeros_like(g[p0:p1])),
                                  accumulate=True)
            gz = grad_z.to(hidden.dtype)
            if need_h:
                grad_hidden[c0:c1] = gz @ weight
            if need_w:
                grad_weight += (gz.t() @ h).to(cdt)
            del grad_z, gz
        if need_h and group is not None and reduce_hidden_grad:
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=group)
        if need_w:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def _check_inputs(hidden, weight, pair_row, pair_token, chunk_rows, vocab_size):
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        raise ValueError(f"hidden must be a 2-D tensor [rows, hidden_size], got "
                         f"{tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError("weight must be a 2-D tensor [vocab (shard), hidden_size]")
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight has hidden size {weight.shape[1]} but hidden has {hidden.shape[1]}")
    if not hidden.is_floating_point() or weight.dtype != hidden.dtype:
        raise ValueError(f"hidden and weight must share one floating dtype, got {hidden.dtype} and {weight.dtype}")
    for name, t in (("pair_row", pair_row), ("pair_token", pair_token)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D integer tensor")
    if pair_row.shape != pair_token.shape:
        raise ValueError(f"pair_row has {pair_row.shape[0]} entries but pair_token has {pair_token.shape[0]}")
    if chunk_rows is not None and (not isinstance(chunk_rows, int) or isinstance(chunk_rows, bool)
                                   or chunk_rows < 1):
        raise ValueError(f"chunk_rows must be a positive integer or None, got {chunk_rows!r}")
    if pair_row.numel() and pair_row.device.type == "cpu":   # value checks where they cost no device read
        lo, hi = int(pair_row.min()), int(pair_row.max())
        if lo < 0 or hi >= hidden.shape[0]:
            bad = lo if lo < 0 else hi
            raise ValueError(f"pair_row holds row {bad}, outside [0, {hidden.shape[0]}) (rows of hidden)")
        lo, hi = int(pair_token.min()), int(pair_token.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"pair_token holds token {bad}, outside the vocabulary [0, {vocab_size})")


def multi_target_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    pair_row: torch.Tensor,
    pair_token: torch.Tensor,
    *,
    tp_group: Optional["dist.ProcessGroup"] = None,
    return_entropy: bool = False,
    chunk_rows: Optional[int] = None,
    reduce_hidden_grad: bool = True,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Log-probability of every (row, token) pair, logits computed once per row.

    Args:
        hidden: [R, H] per-row final hidden states (compact rows).
        weight: [V, H] output layer weight, or with ``tp_group`` this rank's
            vocabulary shard [V / tp, H] (shard ``rank`` covers token ids
            ``[rank * V/tp, (rank + 1) * V/tp)``).
        pair_row, pair_token: [P] the (row, target token) pairs, normally the
            unique pairs of a layout; duplicates are allowed and get the same
            value (their gradients add up).
        tp_group: tensor-parallel process group for the vocab-parallel form.
        return_entropy: also return the softmax entropy of each row ([R];
            differentiable; rows that carry no pair get 0, they are not computed).
        chunk_rows: rows per logits chunk; None: ``default_chunk_rows`` (4096 rows, fewer past 4 GiB of
            statistics-dtype logits).  Peak memory is O(chunk_rows x V_local), never
            O(rows x V_local).
        reduce_hidden_grad: all-reduce the hidden-state gradient over ``tp_group``
            (set False when the caller's hidden came through
            ``copy_to_tensor_model_parallel_region``, which already does it, or
            through ``gather_from_sequence_parallel_region`` under sequence
            parallelism, whose backward reduce-scatters it).

    Returns:
        logprobs [P] (and entropy [R] with ``return_entropy``) in fp32, or fp64
        for fp64 inputs: the logits are computed in the inputs' dtype and the
        softmax statistics upcast, as megatron's cross entropy does (``.float()``).

    Matches ``-vocab_parallel_cross_entropy(logits, target)`` of megatron-core
    0.16.1 (``megatron.core.tensor_parallel.cross_entropy``, no label smoothing)
    on the expanded rows, and ``torch.log_softmax`` on full logits
    (``multi_target_logprobs_reference``).
    """
    tp, rank = _group_size_rank(tp_group)
    v_local = weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() == 2 else 0
    _check_inputs(hidden, weight, pair_row, pair_token, chunk_rows, v_local * tp)
    # the pairs grouped by row, and by chunk of rows, where the indices live: given on the host
    # (a layout's host copy), this reads nothing back from the device
    pair_row = pair_row.long()
    pair_token = pair_token.long()
    rows, pair_lrow = torch.unique(pair_row, sorted=True, return_inverse=True)
    order = torch.argsort(pair_lrow, stable=True)
    lrow_sorted, token_sorted = pair_lrow[order], pair_token[order]
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(v_local, hidden.dtype)
    starts = torch.arange(0, rows.shape[0], chunk_rows, device=rows.device)
    pair_bounds = torch.searchsorted(lrow_sorted, starts).tolist() + [int(lrow_sorted.shape[0])]
    rows, lrow_sorted, token_sorted, order = host_to_device_many((rows, lrow_sorted, token_sorted, order),
                                                                 hidden.device)
    lp_sorted, ent_sel = MultiTargetLogprobs.apply(
        hidden.index_select(0, rows), weight, lrow_sorted, token_sorted,
        bool(return_entropy), tp_group, rank * v_local, int(chunk_rows), bool(reduce_hidden_grad), pair_bounds)
    logprobs = torch.empty_like(lp_sorted).index_copy(0, order, lp_sorted) if order.numel() else lp_sorted
    if not return_entropy:
        return logprobs
    entropy = ent_sel.new_zeros(hidden.shape[0]).index_copy(0, rows, ent_sel)
    return logprobs, entropy


def multi_target_logprobs_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    pair_row: torch.Tensor,
    pair_token: torch.Tensor,
    *,
    return_entropy: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Plain reference: full-vocabulary logits of every row, ``log_softmax``, gather.

    Same contract as ``multi_target_logprobs`` without tensor parallelism
    (``weight`` is the whole [V, H] matrix); autograd does the backward.
    Entropy is ``-sum softmax * log_softmax`` for rows that carry a pair, 0 elsewhere.
    """
    _check_inputs(hidden, weight, pair_row, pair_token, None, weight.shape[0])
    cdt = _compute_dtype(hidden.dtype)
    logp = torch.log_softmax((hidden @ weight.t()).to(cdt), dim=-1)
    out = logp[pair_row.long(), pair_token.long()]
    if not return_entropy:
        return out
    has_pair = torch.zeros(hidden.shape[0], dtype=torch.bool, device=hidden.device)
    has_pair[pair_row.long()] = True
    ent = -(logp.exp() * logp).sum(dim=-1)
    ent = torch.where(has_pair, ent, torch.zeros_like(ent))
    return out, ent
