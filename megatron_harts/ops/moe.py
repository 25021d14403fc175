"""MoE router statistics with occurrence counts (docs/design.md, glossary "occurrence count").

In expanded mode every trajectory carries its own copy of a shared prefix row,
so megatron-core's router counts that row once per trajectory through it.  In
tree mode the row exists once with its occurrence count ``q(r)``; since top-k
routing is a deterministic function of the row (no capacity dropping, no
batch-dependent routing, no noise), every copy routes identically and each
expanded statistic is the q-weighted compact statistic.

Invariant kept by every ``q_*`` function (docs/design.md invariant 1): its value, and
its gradient with respect to the per-row scores or logits, equal those of the
megatron-core 0.16.1 computation it names run on the expanded rows (every
trajectory's rows, in order, concatenated), with the gradient of all copies of a
row summed onto that row.  Each ``*_reference`` function computes exactly that
expansion and calls megatron-core's own functions; tests pin the equality.

Inputs are plain tensors, so the functions compose with any layout:

- ``scores`` [R, E]: per-row router scores as megatron feeds its aux losses
  (``compute_routing_scores_for_aux_loss``: softmax, or sigmoid normalized to
  sum 1, over all experts).
- ``routing``: which experts each row is routed to, either top-k indices
  [R, k] (integer, distinct per row) or a boolean routing map [R, E].
- ``q`` [R]: occurrence counts; rows with ``q == 0`` (padding) count nowhere.
- trajectory membership, for per-trajectory (sequence) statistics, in one of
  two forms: ``traj_row_offsets`` [N+1] with ``traj_rows`` (trajectory t's rows
  in path order are ``traj_rows[traj_row_offsets[t]:traj_row_offsets[t+1]]``,
  the expanded -> compact map), or ``row_traj_lo``/``row_traj_hi`` [R] with
  ``num_trajectories`` (the trajectories through row r are the contiguous range
  ``[row_traj_lo[r], row_traj_hi[r])``, true for a forest's DFS trajectory
  order, see ``Forest.seg_traj_lo``).

Token counts: megatron computes ``total_num_tokens = local_num_tokens *
reduce_group.size()`` (``get_tokens_per_expert_and_token_count`` without a
padding mask).  Here ``local_num_tokens`` defaults to ``q.sum()``, the number of
expanded tokens this rank holds; pass the expanded-equivalent local count
explicitly when the compact rows of one expanded microbatch are split unevenly
over the group (sequence parallelism slices rows, not expanded tokens).
"""
from __future__ import annotations

from typing import Mapping, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = [
    "routing_map_from_topk",
    "q_tokens_per_expert",
    "q_aux_loss",
    "q_seq_aux_loss",
    "QGlobalAuxLoss",
    "q_z_loss",
    "trajectory_row_sums",
    "validate_tree_moe_config",
    "tokens_per_expert_reference",
    "aux_loss_reference",
    "seq_aux_loss_reference",
    "GlobalAuxLossReference",
    "z_loss_reference",
]


# ---------------------------------------------------------------------------
# input handling
# ---------------------------------------------------------------------------

def _check_scores(scores, name="scores") -> Tuple[int, int]:
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or not scores.is_floating_point():
        raise ValueError(f"{name} must be a 2-D floating tensor [rows, num_experts]")
    return scores.shape[0], scores.shape[1]


def routing_map_from_topk(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Boolean routing map [R, E] from top-k indices [R, k], as megatron's
    ``topk_routing_with_score_function`` scatters it.  Raises ValueError naming
    ``routing`` on out-of-range or repeated experts in a row."""
    if topk_idx.dim() != 2 or topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError("routing must be integer top-k indices [rows, k] or a boolean map [rows, num_experts]")
    if topk_idx.numel():
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"routing holds expert {lo if lo < 0 else hi}, outside [0, {num_experts})")
        srt = torch.sort(topk_idx, dim=1).values
        if bool((srt[:, 1:] == srt[:, :-1]).any()):
            r = int(torch.nonzero((srt[:, 1:] == srt[:, :-1]).any(dim=1))[0])
            raise ValueError(f"routing row {r} names one expert twice: top-k experts must be distinct")
    out = torch.zeros(topk_idx.shape[0], num_experts, dtype=torch.bool, device=topk_idx.device)
    return out.scatter_(1, topk_idx.long(), True)


def _routing_map(routing, num_rows: int, num_experts: int) -> torch.Tensor:
    if not isinstance(routing, torch.Tensor):
        raise ValueError("routing must be a tensor (top-k indices [rows, k] or a boolean map [rows, num_experts])")
    if routing.dtype == torch.bool:
        if routing.dim() != 2 or routing.shape != (num_rows, num_experts):
            raise ValueError(f"routing map has shape {tuple(routing.shape)}, expected ({num_rows}, {num_experts})")
        return routing
    if routing.dim() != 2 or routing.shape[0] != num_rows:
        raise ValueError(f"routing has shape {tuple(routing.shape)}, expected ({num_rows}, k)")
    return routing_map_from_topk(routing, num_experts)


def _check_q(q, num_rows: int) -> torch.Tensor:
    """``q``'s shape always; its values (integer counts >= 0) where reading them costs no device
    round trip, i.e. on the CPU: on a GPU they are the layout's occurrence counts, checked when
    the layout was built on the host, and reading them back would stall every MoE layer."""
    if not isinstance(q, torch.Tensor) or q.dim() != 1 or q.shape[0] != num_rows:
        raise ValueError(f"q must be a 1-D tensor with one occurrence count per row ({num_rows})")
    if q.dtype == torch.bool:
        raise ValueError("q must hold integer occurrence counts")
    if q.device.type != "cpu":
        return q
    if q.is_floating_point():
        if not bool(torch.all(q == torch.round(q))):
            raise ValueError("q must hold integer occurrence counts")
    if q.numel() and int(q.min()) < 0:
        raise ValueError(f"q holds {int(q.min())}: occurrence counts are >= 0")
    return q


def _check_topk_coeff(topk, coeff):
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be a positive integer, got {topk!r}")
    if isinstance(coeff, bool) or not isinstance(coeff, (int, float)):
        raise ValueError(f"coeff must be a number, got {coeff!r}")


def _group_size(group) -> int:
    return 1 if group is None else group.size()


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    """Sum over ``group`` (no autograd: used on counts only)."""
    if group is not None and group.size() > 1:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def _total_tokens(q, local_num_tokens, group):
    local = q.sum() if local_num_tokens is None else local_num_tokens
    if isinstance(local, torch.Tensor):
        local = local.item()
    if local <= 0:
        raise ValueError("local_num_tokens must be positive (q sums to 0: no expanded token to normalize by)")
    return local * _group_size(group)


# ---------------------------------------------------------------------------
# per-trajectory sums
# ---------------------------------------------------------------------------

def trajectory_row_sums(
    values: torch.Tensor,
    *,
    traj_row_offsets: Optional[torch.Tensor] = None,
    traj_rows: Optional[torch.Tensor] = None,
    row_traj_lo: Optional[torch.Tensor] = None,
    row_traj_hi: Optional[torch.Tensor] = None,
    num_trajectories: Optional[int] = None,
) -> torch.Tensor:
    """Sum of ``values`` [R, ...] over each trajectory's rows: [N, ...] (differentiable).

    Invariant: ``out[t] == values[rows of t].sum(0)``, the sum over trajectory
    t's expanded positions.  With ``traj_row_offsets``/``traj_rows`` this is a
    gather and a scatter-add over the expanded positions; with
    ``row_traj_lo``/``row_traj_hi`` it is a difference array over trajectories
    (add ``values[r]`` at ``lo[r]``, subtract at ``hi[r]``) and one prefix sum,
    O(rows + trajectories) per column, never touching expanded positions.
    """
    num_rows = values.shape[0]
    csr = traj_row_offsets is not None or traj_rows is not None
    rng = row_traj_lo is not None or row_traj_hi is not None
    if csr == rng:
        raise ValueError("give the trajectory membership either as traj_row_offsets and traj_rows, "
                         "or as row_traj_lo, row_traj_hi and num_trajectories (exactly one form)")
    if csr:
        if traj_row_offsets is None or traj_rows is None:
            raise ValueError("traj_row_offsets and traj_rows must be given together")
        off, rows = traj_row_offsets.long(), traj_rows.long()
        if off.dim() != 1 or off.numel() < 1 or int(off[0]) != 0 or int(off[-1]) != rows.numel():
            raise ValueError("traj_row_offsets must be 1-D, start at 0 and end at len(traj_rows)")
        lengths = off[1:] - off[:-1]
        if bool((lengths < 1).any()):
            t = int(torch.nonzero(lengths < 1)[0])
            raise ValueError(f"traj_row_offsets gives trajectory {t} no rows: every trajectory has >= 1")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= num_rows):
            raise ValueError(f"traj_rows holds a row outside [0, {num_rows})")
        owner = torch.repeat_interleave(torch.arange(lengths.numel(), device=values.device), lengths)
        out = values.new_zeros((lengths.numel(),) + tuple(values.shape[1:]))
        return out.index_add(0, owner, values.index_select(0, rows))
    if row_traj_lo is None or row_traj_hi is None or num_trajectories is None:
        raise ValueError("row_traj_lo, row_traj_hi and num_trajectories must be given together")
    lo, hi = row_traj_lo.long(), row_traj_hi.long()
    if lo.shape != (num_rows,) or hi.shape != (num_rows,):
        raise ValueError(f"row_traj_lo and row_traj_hi must have one entry per row ({num_rows})")
    if num_rows and (int(lo.min()) < 0 or bool((hi < lo).any()) or int(hi.max()) > num_trajectories):
        raise ValueError(f"row_traj_lo/row_traj_hi must satisfy 0 <= lo <= hi <= num_trajectories "
                         f"({num_trajectories})")
    diff = values.new_zeros((num_trajectories + 1,) + tuple(values.shape[1:]))
    diff = diff.index_add(0, lo, values).index_add(0, hi, -values)
    return torch.cumsum(diff[:num_trajectories], dim=0)


# ---------------------------------------------------------------------------
# q-weighted statistics (fast forms)
# ---------------------------------------------------------------------------

def q_tokens_per_expert(routing: torch.Tensor, q: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Expanded tokens routed to each expert: ``sum_r q(r) * routing_map[r]`` [E].

    Matches ``routing_map.sum(dim=0)`` on the expanded rows, which megatron-core
    0.16.1 uses as the local tokens per expert in
    ``moe_utils.get_tokens_per_expert_and_token_count`` (aux losses),
    ``TopKRouter._apply_expert_bias`` (``local_tokens_per_expert``, the input of
    ``get_updated_expert_bias``) and the dispatchers' load logging.  Exact
    integer counts in q's dtype (int64 for integer q).
    """
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive integer, got {num_experts!r}")
    if not isinstance(routing, torch.Tensor) or routing.dim() != 2:
        raise ValueError("routing must be top-k indices [rows, k] or a boolean map [rows, num_experts]")
    q = _check_q(q, routing.shape[0])
    rmap = _routing_map(routing, routing.shape[0], num_experts)
    qq = q if q.is_floating_point() else q.long()
    return (rmap.to(qq.dtype) * qq[:, None]).sum(dim=0)


def _switch_loss(scores: torch.Tensor, q: torch.Tensor, tokens_per_expert: torch.Tensor, total,
                 *, topk: int, coeff: float) -> torch.Tensor:
    """megatron's switch load-balancing formula on q-weighted rows:
    E * coeff / (topk * T^2) * sum_e (sum_r q_r scores[r, e]) * N_e."""
    num_experts = scores.shape[1]
    agg = q.to(scores.dtype) @ scores
    return (agg * tokens_per_expert.to(scores.dtype)).sum() * (num_experts * coeff / (topk * total * total))


def q_aux_loss(
    scores: torch.Tensor,
    routing: torch.Tensor,
    q: torch.Tensor,
    *,
    topk: int,
    coeff: float,
    group: Optional["dist.ProcessGroup"] = None,
    local_num_tokens: Optional[float] = None,
) -> torch.Tensor:
    """Micro-batch load-balancing loss (``moe_router_load_balancing_type="aux_loss"``).

    Matches megatron-core 0.16.1 ``TopKRouter._apply_aux_loss``, i.e.
    ``switch_load_balancing_loss_func(probs, tokens_per_expert, total_num_tokens,
    topk, num_experts, coeff)`` with ``tokens_per_expert`` and
    ``total_num_tokens`` from ``get_tokens_per_expert_and_token_count(routing_map,
    group, topk)`` (``group`` = megatron's tp_cp group), on the expanded rows:

        loss = E * coeff / (topk * T^2) * sum_e (sum_r q_r scores[r, e]) * N_e
        N_e = all-reduce over group of sum_r q_r routing_map[r, e],  T = local_num_tokens * |group|

    The gradient reaches ``scores`` only (counts are not differentiable), as in megatron.
    """
    num_rows, num_experts = _check_scores(scores)
    _check_topk_coeff(topk, coeff)
    rmap = _routing_map(routing, num_rows, num_experts)
    q = _check_q(q, num_rows)
    tpe = _all_reduce(q_tokens_per_expert(rmap, q, num_experts), group)
    total = _total_tokens(q, local_num_tokens, group)
    return _switch_loss(scores, q, tpe, total, topk=topk, coeff=coeff)


def q_seq_aux_loss(
    scores: torch.Tensor,
    routing: torch.Tensor,
    *,
    topk: int,
    coeff: float,
    traj_row_offsets: Optional[torch.Tensor] = None,
    traj_rows: Optional[torch.Tensor] = None,
    row_traj_lo: Optional[torch.Tensor] = None,
    row_traj_hi: Optional[torch.Tensor] = None,
    num_trajectories: Optional[int] = None,
    group: Optional["dist.ProcessGroup"] = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Sequence-level load-balancing loss, one sequence per trajectory (``"seq_aux_loss"``).

    Matches megatron-core 0.16.1 ``TopKRouter._apply_seq_aux_loss``: for the
    [seq_length, bsz] layout it reshapes scores and routing map to
    [seq_length, bsz * E] so that ``switch_load_balancing_loss_func`` sums the
    per-sequence losses, then divides by bsz.  Per trajectory t (length L_t):

        loss_t = E * coeff / (topk * L_t^2) * sum_e P[t, e] * C[t, e]
        P[t] = sum of scores over t's rows,  C[t] = sum of routing_map over t's rows

    with the path sums done by ``trajectory_row_sums`` (either membership form).
    ``reduction="mean"`` returns megatron's ``sum_t loss_t / bsz`` (bsz = number
    of trajectories), ``"sum"`` the sum, ``"none"`` the [N] vector.  megatron
    needs equal lengths in one batch; for unequal lengths this is the value of
    each trajectory as its own [L_t, 1] sequence, averaged.  With ``group``
    (megatron's tp_cp group) C and L_t are summed over the group and P stays
    local, as megatron does with sequence-split batches.
    """
    num_rows, num_experts = _check_scores(scores)
    _check_topk_coeff(topk, coeff)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    rmap = _routing_map(routing, num_rows, num_experts)
    member = dict(traj_row_offsets=traj_row_offsets, traj_rows=traj_rows, row_traj_lo=row_traj_lo,
                  row_traj_hi=row_traj_hi, num_trajectories=num_trajectories)
    # counts and lengths in one exact integer pass: [R, E + 1] with a ones column
    ones = torch.ones(num_rows, 1, dtype=torch.int64, device=scores.device)
    counts = trajectory_row_sums(torch.cat([rmap.long(), ones], dim=1), **member)
    counts = _all_reduce(counts, group).to(scores.dtype)
    probs = trajectory_row_sums(scores, **member)
    length = counts[:, -1]
    per_traj = (probs * counts[:, :-1]).sum(dim=1) * (num_experts * coeff / topk) / (length * length)
    if reduction == "none":
        return per_traj
    return per_traj.sum() if reduction == "sum" else per_traj.mean()


class QGlobalAuxLoss:
    """Global-batch load-balancing loss (``"global_aux_loss"``) with its running state.

    Mirrors megatron-core 0.16.1 ``TopKRouter._apply_global_aux_loss`` and its
    buffers ``global_tokens_per_expert`` and ``ga_steps``: every call adds this
    micro-batch's expanded tokens per expert (q-weighted, all-reduced over
    ``group``, megatron's tp_dp_cp group) to the running sum, counts one step,
    and returns

        switch_load_balancing_loss_func(scores, global_tokens_per_expert / ga_steps,
                                        T = local_num_tokens * |group|, topk, E, coeff)

    with the q-weighted score sum.  ``reset()`` is megatron's
    ``reset_global_aux_loss_tracker`` (called once per global batch).  The state
    is kept in ``dtype`` (megatron: float32).
    """

    def __init__(self, num_experts: int, *, dtype: torch.dtype = torch.float32, device=None):
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts must be a positive integer, got {num_experts!r}")
        self.num_experts = num_experts
        self.global_tokens_per_expert = torch.zeros(num_experts, dtype=dtype, device=device)
        self.ga_steps = torch.zeros((), dtype=dtype, device=device)

    def reset(self) -> None:
        self.global_tokens_per_expert.zero_()
        self.ga_steps.zero_()

    def __call__(self, scores, routing, q, *, topk: int, coeff: float, group=None,
                 local_num_tokens: Optional[float] = None) -> torch.Tensor:
        num_rows, num_experts = _check_scores(scores)
        if num_experts != self.num_experts:
            raise ValueError(f"scores has {num_experts} experts, this accumulator {self.num_experts}")
        _check_topk_coeff(topk, coeff)
        rmap = _routing_map(routing, num_rows, num_experts)
        q = _check_q(q, num_rows)
        tpe = _all_reduce(q_tokens_per_expert(rmap, q, num_experts), group)
        total = _total_tokens(q, local_num_tokens, group)
        self.global_tokens_per_expert += tpe.to(self.global_tokens_per_expert.dtype)
        self.ga_steps += 1
        return _switch_loss(scores, q, self.global_tokens_per_expert / self.ga_steps, total, topk=topk, coeff=coeff)


def q_z_loss(
    logits: torch.Tensor,
    q: torch.Tensor,
    coeff: float,
    *,
    local_num_tokens: Optional[float] = None,
) -> torch.Tensor:
    """Router z-loss: ``coeff * sum_r q_r logsumexp(logits[r])^2 / local_num_tokens``.

    Matches megatron-core 0.16.1 ``moe_utils.z_loss_func(logits, coeff)`` (no
    padding mask: the mean over tokens) on the expanded rows.  ``TopKRouter.
    apply_z_loss`` passes ``coeff = moe_z_loss_coeff / tp_cp_group.size()``; so
    should the caller.  ``local_num_tokens`` defaults to ``q.sum()``.
    """
    num_rows, _ = _check_scores(logits, "logits")
    q = _check_q(q, num_rows)
    if isinstance(coeff, bool) or not isinstance(coeff, (int, float)):
        raise ValueError(f"coeff must be a number, got {coeff!r}")
    total = _total_tokens(q, local_num_tokens, None)
    lse = torch.logsumexp(logits, dim=-1)
    return (q.to(lse.dtype) * lse * lse).sum() * (coeff / total)


# ---------------------------------------------------------------------------
# configuration check
# ---------------------------------------------------------------------------

_REFUSED = (
    # (attribute, is_refused(value), flag, reason)
    ("moe_expert_capacity_factor", lambda v: v is not None and v >= 0, "--moe-expert-capacity-factor",
     "capacity-factor token dropping depends on how many copies of a row share a batch, so tree "
     "mode cannot reproduce expanded mode; leave it unset (no token dropping)"),
    ("moe_pad_expert_input_to_capacity", lambda v: bool(v), "--moe-pad-expert-input-to-capacity",
     "padding expert inputs to capacity is part of capacity-factor token dropping, which tree mode "
     "does not support"),
    ("moe_token_drop_policy", lambda v: v not in (None, "probs"), "--moe-token-drop-policy",
     "a token drop policy only applies to capacity-factor token dropping, which tree mode does not "
     "support; leave it at its default"),
    ("moe_router_load_balancing_type",
     lambda v: v == "sinkhorn" or (isinstance(v, (list, tuple)) and "sinkhorn" in v),
     "--moe-router-load-balancing-type",
     "sinkhorn routing normalizes over all tokens of a batch, so a row's experts depend on how many "
     "copies of it the batch holds"),
    ("moe_input_jitter_eps", lambda v: v is not None, "--moe-input-jitter-eps",
     "input jitter draws noise per token: the copies of a shared row would not route identically"),
    ("moe_router_force_load_balancing", lambda v: bool(v), "--moe-router-force-load-balancing",
     "forced load balancing draws random logits per token: copies of a shared row would differ"),
)


def validate_tree_moe_config(config) -> None:
    """Refuse MoE settings under which tree mode cannot equal expanded mode.

    q-weighting is exact only for deterministic per-row top-k routing without
    token dropping.  ``config`` is a megatron ``TransformerConfig``, an argparse
    namespace with Megatron-LM's argument names, or a mapping; absent attributes
    count as megatron's defaults.  Raises ValueError naming the command-line flag.
    A negative capacity factor means "no dropping" (megatron turns it into None).
    """
    get = (lambda k: config.get(k)) if isinstance(config, Mapping) else (lambda k: getattr(config, k, None))
    for attr, refused, flag, reason in _REFUSED:
        value = get(attr)
        if refused(value):
            raise ValueError(f"{flag} {value!r} is not supported with tree sharing ({attr}): {reason}")


# ---------------------------------------------------------------------------
# expanded references: replicate rows through the trajectory row lists, then
# call megatron-core's own functions
# ---------------------------------------------------------------------------

def _expanded(traj_rows: torch.Tensor, *tensors):
    rows = traj_rows.long()
    return [t.index_select(0, rows) for t in tensors]


def _require_group(group):
    if group is None:
        raise ValueError("group must be a process group: megatron's "
                         "get_tokens_per_expert_and_token_count reduces over one (a gloo world of 1 will do)")
    return group


def tokens_per_expert_reference(routing, traj_rows, num_experts: int) -> torch.Tensor:
    """``routing_map.sum(dim=0)`` of the expanded rows (``traj_rows`` concatenated)."""
    num_rows = routing.shape[0]
    (rmap,) = _expanded(traj_rows, _routing_map(routing, num_rows, num_experts))
    return rmap.sum(dim=0)


def aux_loss_reference(scores, routing, traj_rows, *, topk, coeff, group) -> torch.Tensor:
    """megatron's aux_loss on the expanded micro-batch (every trajectory's rows concatenated):
    ``get_tokens_per_expert_and_token_count`` then ``switch_load_balancing_loss_func``."""
    from megatron.core.transformer.moe.moe_utils import (
        get_tokens_per_expert_and_token_count, switch_load_balancing_loss_func)
    num_rows, num_experts = _check_scores(scores)
    s, rmap = _expanded(traj_rows, scores, _routing_map(routing, num_rows, num_experts))
    tpe, _, total = get_tokens_per_expert_and_token_count(rmap, _require_group(group), topk=topk)
    return switch_load_balancing_loss_func(s, tpe.to(s.dtype), total, topk, num_experts, coeff)


def seq_aux_loss_reference(scores, routing, traj_row_offsets, traj_rows, *, topk, coeff, group,
                           reduction: str = "mean") -> torch.Tensor:
    """megatron's seq_aux_loss with each trajectory as one [L_t, 1] sequence, averaged
    (``"mean"``) or summed over trajectories; per trajectory exactly
    ``TopKRouter._apply_seq_aux_loss`` with bsz = 1."""
    from megatron.core.transformer.moe.moe_utils import (
        get_tokens_per_expert_and_token_count, switch_load_balancing_loss_func)
    num_rows, num_experts = _check_scores(scores)
    rmap_all = _routing_map(routing, num_rows, num_experts)
    off = traj_row_offsets.tolist()
    losses = []
    for t in range(len(off) - 1):
        s, rmap = _expanded(traj_rows[off[t]:off[t + 1]], scores, rmap_all)
        tpe, _, total = get_tokens_per_expert_and_token_count(rmap, _require_group(group), topk=topk)
        losses.append(switch_load_balancing_loss_func(s, tpe.to(s.dtype), total, topk, num_experts, coeff))
    losses = torch.stack(losses)
    if reduction == "none":
        return losses
    return losses.sum() if reduction == "sum" else losses.mean()


class GlobalAuxLossReference:
    """megatron's ``_apply_global_aux_loss`` on expanded micro-batches, with its own
    ``global_tokens_per_expert`` / ``ga_steps`` state (reset per global batch)."""

    def __init__(self, num_experts: int, *, dtype: torch.dtype = torch.float32, device=None):
        self.num_experts = num_experts
        self.global_tokens_per_expert = torch.zeros(num_experts, dtype=dtype, device=device)
        self.ga_steps = torch.zeros((), dtype=dtype, device=device)

    def reset(self) -> None:
        self.global_tokens_per_expert.zero_()
        self.ga_steps.zero_()

    def __call__(self, scores, routing, traj_rows, *, topk, coeff, group) -> torch.Tensor:
        from megatron.core.transformer.moe.moe_utils import (
            get_tokens_per_expert_and_token_count, switch_load_balancing_loss_func)
        num_rows, num_experts = _check_scores(scores)
        s, rmap = _expanded(traj_rows, scores, _routing_map(routing, num_rows, num_experts))
        tpe, _, total = get_tokens_per_expert_and_token_count(rmap, _require_group(group), topk=topk)
        self.global_tokens_per_expert += tpe
        self.ga_steps += 1
        averaged = self.global_tokens_per_expert / self.ga_steps
        return switch_load_balancing_loss_func(s, averaged.to(s.dtype), total, topk, num_experts, coeff)


def z_loss_reference(logits, traj_rows, coeff) -> torch.Tensor:
    """``megatron.core.transformer.moe.moe_utils.z_loss_func`` on the expanded rows."""
    from megatron.core.transformer.moe.moe_utils import z_loss_func
    (lg,) = _expanded(traj_rows, logits)
    return z_loss_func(lg, coeff)
