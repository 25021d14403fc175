"""One training step: a planned global batch -> this replica's microbatches -> schedule -> update.

The flow, top to bottom (``train_step``):

1. the step's forest and plan are the same on every rank (the loader plans identically
   everywhere); replica ``dp_rank`` takes its microbatches (:func:`replica_microbatches`);
2. the objective's normalizer is computed once from the whole step's forest, so the loss of
   a microbatch is its owned targets' share of the *global-batch* loss;
3. the sharing-window schedule runs the microbatches (windows, recomputed prefixes or
   expanded trajectories: one schedule), every backward inside DDP's ``no_sync`` (where the
   grouped experts add their weight gradients into ``main_grad`` outside autograd:
   ``expert_grad_hooks_off``); with pipeline size > 1 the pipeline schedule ``--tree-pp-schedule``
   of ``schedules/pipeline.py`` on this stage's model chunk (the loss and the objective's terms
   are known on the last stage and reduced so that every rank reports the same numbers);
4. ``finalize_model_grads`` reduces gradients over replicas, then the optimizer and the LR
   scheduler step.

Invariants:

- Over all microbatches of all replicas every target is computed exactly once, so the sum of
  the microbatch losses is the global-batch loss and the summed gradients are its gradients:
  the model config has ``calculate_per_token_loss`` (DDP scales by 1, i.e. sums over
  replicas) and ``finalize_model_grads`` gets no token count.
- tree mode (``within`` / ``windows``) and expanded mode (``off``) give the same loss and
  gradients for the same step (docs/design.md invariant 1), up to the MoE micro-batch aux
  losses, which megatron defines per microbatch and so depend on how a step is packed.  Under
  per-token loss scaling megatron's routers enter each microbatch's mean aux loss and z-loss
  times its token count; the step weighs them by ``aux_loss_scale(plan)`` = 1 / (tokens the
  step routes, all replicas), so the step's aux term is the token-weighted mean of its
  microbatches' aux losses, whatever the number and size of the microbatches.
- A non-finite global loss stops the step before the optimizer touches the weights
  (:class:`NonFiniteLoss`, naming the iteration).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ..layout import host_to_device
from ..models.experts import expert_grad_hooks_off
from ..planner.l1 import plan_l1
from ..planner.l2 import plan_harts
from ..planner.packing_baselines import plan_ffd, plan_ortools_ffd, plan_tree_ffd
from ..planner.memory import PIECE_KEEP
from ..planner.metrics import plan_metrics
from ..planner.microbatch import replica_windows
from ..rl.objectives import (BatchNormalizer, ObjectiveConfig, ObjectiveDataError, forest_normalizer, objective_loss,
                             target_scale)
from ..schedules.pipeline import SCHEDULES as PP_SCHEDULES, forward_backward_pipelining_windows
from ..schedules.simulator import step_from_plan
from ..planner.microbatch import MicrobatchPlan
from ..schedules.windows import (WindowedMicrobatch, expanded_microbatches, forward_backward_windows,
                                 piece_microbatches, windowed_microbatches)
from .tree_flags import PLANNERS, SHARING_MODES

__all__ = ["SharingSettings", "NonFiniteLoss", "plan_step", "step_forest", "executed_rows", "replica_microbatches",
           "aux_loss_scale", "megatron_aux_loss_scale_after", "microbatch_costs", "run_schedule", "train_step",
           "StepResult"]

#: the ``planner`` of the plan ``plan_step`` returns when it keeps L1's plan over L2's (``executed_rows``)
FALLBACK_PLANNER = "harts_l1l2->l1"


#: the schedules' ``window_stats`` about pieces of long paths that a step reduces over replicas (``StepResult``)
PIECE_STATS = ("piece_rows", "piece_extra_forward_rows", "read_pieces", "kept_pieces", "partly_kept_pieces")


class NonFiniteLoss(RuntimeError):
    """The step's loss is NaN or infinite; the weights were not updated."""


def _check_bytes(value, flag: str) -> None:
    """A byte budget of the settings: None or a positive int (ValueError naming ``flag``)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{flag} must be a positive number of bytes, got {value!r}")


@dataclass(frozen=True)
class SharingSettings:
    """How a step is cut into microbatches (the ``--tree-*`` flags)."""
    sharing: str = "within"            # off | within | windows
    microbatch_tokens: int = 8192      # row budget per microbatch
    planner: str = "l1l2"              # l1 | l1l2 | ffd | ortools (tree modes); off packs trajectories FFD
    replay: bool = True
    cost_model: Any = None             # planner.cost_model.CostModel or None (defaults)
    pp_schedule: str = "consumer-1f1b"  # pipeline size > 1: schedules/pipeline.py SCHEDULES
    recompute_producers: bool = False  # windows: producers' forwards run again at window close
    # windows, pipeline size 1: the step's activation budget (bytes) within which producers keep their
    # graphs (the others are recomputed at window close); None: every producer keeps its graph
    memory_budget_bytes: Optional[int] = None
    # pieces of paths longer than the row budget: which read pieces keep their graph until their backward
    # (one forward) rather than run their forward again with it: all | none | auto (within
    # piece_budget_bytes, the memory model's choice: planner.memory.plan_window_memory)
    piece_keep: str = "all"
    piece_budget_bytes: Optional[int] = None

    def __post_init__(self):
        if self.sharing not in SHARING_MODES:
            raise ValueError(f"--tree-sharing must be one of {SHARING_MODES}, got {self.sharing!r}")
        if self.planner not in PLANNERS:
            raise ValueError(f"--tree-planner must be one of {PLANNERS}, got {self.planner!r}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"--tree-pp-schedule must be one of {PP_SCHEDULES}, got {self.pp_schedule!r}")
        _check_bytes(self.memory_budget_bytes, "--tree-memory-budget")
        if self.piece_keep not in PIECE_KEEP:
            raise ValueError(f"--tree-piece-keep must be one of {PIECE_KEEP}, got {self.piece_keep!r}")
        _check_bytes(self.piece_budget_bytes, "--tree-piece-memory")
        if self.piece_keep == "auto" and self.piece_budget_bytes is None:
            raise ValueError("--tree-piece-keep auto needs the pieces' memory budget (--tree-piece-memory)")


def plan_step(forest, settings: SharingSettings, dp: int):
    """The plan of one step on ``dp`` replicas (deterministic: every rank computes the same).

    Trees holding a trajectory longer than ``--tree-microbatch-tokens`` are cut into pieces
    (``planner.pieces.plan_with_pieces``; ``plan.pieces``, whose ``forest`` is then the step's forest:
    :func:`step_forest`); the others are planned by ``--tree-planner``."""
    from ..planner.cost_model import CostModel
    from ..planner.pieces import plan_with_pieces
    cm = settings.cost_model
    mode = "expanded" if settings.sharing == "off" else "tree"

    def empty():
        return MicrobatchPlan(planner="pieces", mode=mode, num_replicas=int(dp), num_slots=0,
                              row_budget=int(settings.microbatch_tokens), chunk_size=(cm or CostModel()).chunk_size,
                              microbatches=[], slots=np.zeros((int(dp), 0), dtype=np.int64), windows=[],
                              expanded_tokens=0, plan_seconds=0.0, cost_model=cm or CostModel())
    return plan_with_pieces(forest, settings.microbatch_tokens, (cm or CostModel()).chunk_size, dp,
                            lambda f: _plan_fitting(f, settings, dp), mode=mode, empty_plan=empty)


def step_forest(forest, plan):
    """The forest a step's microbatches index: ``plan.pieces.forest`` where long trees were cut into
    pieces (the same trajectories, fitting trees first), else ``forest``."""
    pieces = getattr(plan, "pieces", None)
    return forest if pieces is None else pieces.forest


def _plan_fitting(forest, settings: SharingSettings, dp: int):
    M, cm = settings.microbatch_tokens, settings.cost_model
    if settings.sharing == "off":
        return plan_ffd(forest, dp, M, cost_model=cm)
    if settings.planner == "l1":
        return plan_l1(forest, dp, M, cost_model=cm)
    if settings.planner == "l1l2":
        l1, l2 = plan_harts(forest, dp, M, cost_model=cm)
        windows = settings.sharing == "windows"
        run_l2, peak_l2 = executed_rows(forest, l2, windows=windows)
        if peak_l2 > M or run_l2 > executed_rows(forest, l1, windows=windows)[0]:
            # L2's windows would not run as planned: L1's plan, named so that logs show the fallback
            l1.planner, l1.plan_seconds = FALLBACK_PLANNER, l2.plan_seconds
            return l1
        return l2
    if settings.planner == "ffd":
        return plan_tree_ffd(forest, dp, M, cost_model=cm)
    return plan_ortools_ffd(forest, dp, M, cost_model=cm)


def executed_rows(forest, plan, *, windows: bool) -> Tuple[int, int]:
    """(rows computed over all replicas, rows of the largest microbatch) when the step runs ``plan``:
    the window rule of ``planner.microbatch.replica_windows``, under which external context that no
    single earlier producer of the same replica holds is recomputed (``windows=False``: all of it).

    The L1+L2 plan's own accounting assumes every external context is read from its producer; where
    the schedule cannot (several producers, a producer on another replica, a consumer as producer)
    the step computes more than planned and can exceed the row budget, so ``plan_step`` keeps L1's
    plan whenever L2's would run more rows than L1's or a microbatch over the budget.
    """
    length = np.asarray(forest.seg_length, dtype=np.int64)
    total, peak = 0, 0
    for r in range(plan.num_replicas):
        for e in replica_windows(forest, plan, r, windows=windows):
            rows = int(length[e.computed].sum())
            total, peak = total + rows, max(peak, rows)
    return total, peak


def placeholder_microbatch() -> WindowedMicrobatch:
    """What a replica runs in an idle slot when it must take part in expert-parallel collectives:
    one token, one target it does not own (loss weight 0, so the backward runs through every layer
    and contributes exact zeros) and MoE weight 0 (no statistic counts it)."""
    from ..layout import ExpandedBatch
    i0, f0 = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.float64)
    batch = ExpandedBatch(tokens=i0, position_ids=i0, lengths=[1], traj_ids=["<idle slot>"],
                          traj_forest=np.zeros(1, dtype=np.int64), target_row=i0, target_traj=i0, target_token=i0,
                          target_position=i0 + 1, target_weight=f0, target_old_logprob=f0, target_advantage=f0)
    return WindowedMicrobatch(batch, owned=torch.zeros(1, dtype=torch.bool), counted=torch.zeros(1, dtype=torch.bool))


def replica_microbatches(forest, plan, replica: int, settings: SharingSettings, *,
                         aligned: bool = False) -> List[WindowedMicrobatch]:
    """Replica ``replica``'s microbatches of a planned step, in execution order.

    ``aligned`` (expert parallelism: the replicas of an expert-parallel group exchange tokens in every
    MoE layer of every microbatch): every replica runs ``plan.num_slots`` microbatches, idle slots
    filled by :func:`placeholder_microbatch` at the end.
    """
    if plan.pieces is not None:       # the base plan covers the fitting trees only
        forest = plan.pieces.fitting_forest() if plan.pieces.num_fit_trees else None
    if forest is None:
        items = []
    elif settings.sharing == "off":
        items = expanded_microbatches(forest, plan, replica)
    else:
        items = windowed_microbatches(forest, plan, replica, replay=settings.replay,
                                      windows=settings.sharing == "windows")
    # pieces of paths longer than the budget: after the planned microbatches (expanded chains replay as
    # expanded chunking does: every chunk from position 0)
    items += piece_microbatches(plan, replica, replay=settings.replay or settings.sharing == "off",
                                offset=len(items))
    if aligned and plan.pieces is not None:
        raise ValueError(f"expert parallelism runs replicas in lockstep: a trajectory longer than "
                         f"--tree-microbatch-tokens {settings.microbatch_tokens} ({_longest(plan)}) cannot be cut "
                         "into pieces with --expert-model-parallel-size > 1; raise the budget")
    if aligned:
        if any(mb.producer is not None for mb in items):
            raise ValueError("expert parallelism runs replicas in lockstep: sharing windows are not supported "
                             "with --expert-model-parallel-size > 1 (use --tree-sharing within)")
        items += [placeholder_microbatch() for _ in range(plan.num_slots - len(items))]
    return items


def _longest(plan) -> str:
    f = plan.pieces.forest
    t = int(np.argmax(np.asarray(f.traj_length)))
    return f"trajectory {f.traj_ids[t]!r}, {int(f.traj_length[t])} tokens"


@dataclass
class StepResult:
    """What one step measured, already reduced over data-parallel replicas."""
    loss: float
    terms: Dict[str, float]
    grad_norm: Optional[float]
    lr: float
    trajectories: int
    trajectory_tokens: int           # expanded tokens of the step
    target_tokens: int               # targets (trainable tokens) of the step
    computed_tokens: int             # rows computed over all microbatches (incl. recomputed prefixes)
    visible_pairs: int               # full-attention (query, key) pairs over all microbatches, evictions applied
    compaction_events: int           # compaction events of the step's trajectories
    replay_tokens: int
    kda_calls: int                   # KDA calls per KDA layer, summed over the step's microbatches
    microbatches: int
    plan_seconds: float
    step_seconds: float
    tokens_per_expert: Optional[torch.Tensor] = None   # [moe layers, experts], q-weighted, whole step
    window_stats: Dict[str, Any] = field(default_factory=dict)
    plan_metrics: Dict[str, float] = field(default_factory=dict)
    piece_rows: int = 0                  # rows of the pieces of long paths (each piece's forward once)
    piece_extra_forward_rows: int = 0    # rows of the read pieces' forwards run again with their backward (a
    #                                      partly kept piece: its rows x its recomputed share of the layers)
    read_pieces: int = 0                 # pieces later pieces read
    kept_pieces: int = 0                 # of those, the ones that kept their graph (one forward)
    partly_kept_pieces: int = 0          # of those, the ones whose first layers run their forward again


def visible_pairs(batch) -> int:
    """The (query, key) pairs full attention computes for one microbatch: a layout's visible pairs
    (context keys included), or an expanded batch's causal pairs per trajectory, evictions applied."""
    host = batch.host_copy if batch.host_copy is not None else batch
    vis = getattr(host, "visibility", None)
    if vis is None:        # expanded trajectories without compaction events: causal
        return sum(n * (n + 1) // 2 for n in host.lengths)
    pairs = int((vis.end - vis.start).sum())
    if getattr(host, "num_context_rows", 0):
        ctx = host.context_visibility
        pairs += int((ctx.end - ctx.start).sum())
    return pairs


def _moe_routers(model) -> list:
    module = model
    while hasattr(module, "module"):
        module = module.module
    decoder = getattr(module, "decoder", None)
    if decoder is None:
        return []
    return [l.mlp.router for l in decoder.layers if getattr(l, "is_moe_layer", False)]


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def _count_experts(model, counters) -> None:
    with torch.no_grad():
        tpe = [r.last_tokens_per_expert for r in _moe_routers(model)]
        if tpe and all(t is not None for t in tpe):
            stacked = torch.stack([t.double() for t in tpe])
            counters["tokens_per_expert"] = stacked if counters["tokens_per_expert"] is None \
                else counters["tokens_per_expert"] + stacked


def make_forward_step(objective: ObjectiveConfig, normalizer: BatchNormalizer, *,
                      aux_loss_scale: float, counters: Dict[str, Any], tables=None) -> Callable:
    """``forward_step_func(data_iterator, model)`` of the schedule for the driver's objective.

    The loss of a microbatch: the objective over the targets it owns, each scaled by its
    global-batch normalization (``normalizer``, on the host: the scales are computed there).  With
    ``objective.old_logprobs`` "current" the old log-probs are this forward's log-probs, detached
    (``objective_loss``): no extra forward, on the last pipeline stage like the rest of the loss.
    ``counters`` (pass ``{}``; its keys are filled here) accumulates the step's loss, objective
    terms, KDA calls, KDA replay tokens and q-weighted tokens per expert.  ``tables``
    (``training.rl_update.TargetTables`` of the step's forest, or None): per-target values an RL
    update computed before the step: "old" (recomputed old log-probs, replacing the data's), "ref"
    (reference log-probs), "tis" (rollout-correction weights), "seq" (sequence log-ratios); targets
    the microbatch does not own read 0 there (they weigh 0).
    """
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    need_entropy = objective.entropy_coef != 0.0
    for key, zero in (("loss", 0.0), ("terms", {}), ("kda_calls", 0), ("replay_tokens", 0), ("tokens_per_expert", None)):
        counters.setdefault(key, zero)

    def forward_step(data_iterator, model):
        mb, psp = next(data_iterator)
        batch = mb.layout
        dev = batch.tokens.device
        # a producer's exports-only forward (recomputed with its loss at window close) counts nothing
        counts = not getattr(psp, "preview", False)
        MoEAuxLossAutoScaler.set_loss_scale(host_to_device(torch.tensor(aux_loss_scale, dtype=torch.float32), dev))
        if not _unwrap(model).post_process:       # a pipeline stage before the last: hidden states out
            out = model(batch.tokens[None], batch.position_ids[None], packed_seq_params=psp)
            if counts:
                _count_experts(model, counters)
            return out, None
        if not counts:
            # an exports-only forward: the exports come from the layers, and the schedule reads none of
            # its outputs (the microbatch runs again with its loss), so the output layer and the
            # log-probs are left out
            return model(batch.tokens[None], batch.position_ids[None], packed_seq_params=psp, return_hidden=True), None
        host = batch.host_copy if batch.host_copy is not None else batch
        # the (row, token) pairs from the host copy: the log-prob op groups them there
        out = model(batch.tokens[None], batch.position_ids[None], packed_seq_params=psp,
                    pair_row=host.pair_row, pair_token=host.pair_token, return_entropy=need_entropy)
        lp_pairs, entropy_rows = out if need_entropy else (out, None)
        lp = lp_pairs.index_select(0, batch.target_pair)
        entropy = entropy_rows.index_select(0, batch.target_row) if need_entropy else None
        # the targets' loss scales, computed on the host (from the batch's host copy)
        traj = torch.as_tensor(host.traj_forest)[host.target_traj.cpu()]
        weight = host.target_weight.cpu()
        if mb.owned is None:
            scale = target_scale(normalizer, traj, weight, objective.loss_agg_mode, objective.loss_norm_length)
        else:       # targets another microbatch owns weigh 0 (and need not belong to this step's normalizer)
            owned = mb.owned.cpu()
            scale = torch.zeros(batch.num_targets, dtype=torch.float64)
            if bool(owned.any()):
                scale[owned] = target_scale(normalizer, traj[owned], weight[owned], objective.loss_agg_mode,
                                            objective.loss_norm_length)
        scale = host_to_device(scale, dev)
        extra: Dict[str, torch.Tensor] = {}
        old_logprob = batch.target_old_logprob
        if tables is not None:
            for name, values in tables.gather(host).items():
                if mb.owned is not None:
                    values = torch.where(mb.owned.cpu(), values, torch.zeros((), dtype=values.dtype))
                extra[name] = host_to_device(values, dev)
            old_logprob = extra.pop("old", old_logprob)
        kwargs = {key: extra[name] for name, key in (("ref", "ref_logprobs"), ("tis", "tis_weight"),
                                                     ("seq", "seq_log_ratio")) if name in extra}
        if counts:
            # KDA calls per KDA layer: the tree schedule's, or one varlen call for packed trajectories
            counters["kda_calls"] += len(psp.kda_schedule.calls) if psp.kda_schedule is not None else 1
            counters["replay_tokens"] += int(psp.kda_schedule.replay_tokens) if psp.kda_schedule is not None else 0
            _count_experts(model, counters)

        def loss_func(lp):
            try:
                loss, terms = objective_loss(lp, old_logprob.to(dev), batch.target_advantage.to(dev),
                                             scale, objective, entropy=entropy, **kwargs)
            except ObjectiveDataError as e:
                t = batch.traj_ids[int(batch.target_traj[e.target_index])]
                raise ObjectiveDataError(f"trajectory {t!r}: {e}", e.field, e.count, e.target_index) from None
            # summed on the device, read once per step (a read per microbatch would stall the host
            # between a microbatch's forward and its backward)
            for k, v in terms.items():
                counters["terms"][k] = counters["terms"].get(k, 0.0) + v.detach()
            counters["loss"] = counters["loss"] + loss.detach()
            return loss, {}
        return lp, loss_func
    return forward_step


@contextlib.contextmanager
def megatron_aux_loss_scale_after(device):
    """megatron's aux-loss gradient scale is a class attribute that ``make_forward_step``'s steps set
    to their step's (``aux_loss_scale``); after the block it is megatron's default again (1), so a
    later model in the process (a test, another run) does not inherit it."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    try:
        yield
    finally:
        MoEAuxLossAutoScaler.set_loss_scale(host_to_device(torch.tensor(1.0, dtype=torch.float32), device))


def aux_loss_scale(plan) -> float:
    """The MoE aux-loss gradient scale of a step (module docstring): 1 / the tokens its MoE layers
    route over all replicas, i.e. its trajectory tokens (a tree row counts its occurrences)."""
    return 1.0 / max(int(plan.expanded_tokens), 1)


def objective_term_names(objective: ObjectiveConfig) -> List[str]:
    """The keys of ``objective_loss``'s terms for this objective (the driver passes entropies when
    ``entropy_coef != 0``), sorted; known on every pipeline stage."""
    names = ["sft_loss"] if objective.kind == "sft" else ["pg_loss", "clip_fraction"]
    if objective.kl_coef > 0:
        names.append("kl")
    if objective.entropy_coef != 0.0:
        names.append("entropy")
    return sorted(names)


def _all_reduce_sum(values: List[float], device) -> List[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        from megatron.core import parallel_state
        dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
    return t.tolist()


def microbatch_costs(forest, plan, replica: int, num_items: int) -> List[Tuple[float, float]]:
    """(forward, backward) modelled cost of each of the replica's ``num_items`` microbatches, in execution
    order (the simulator's ``step_from_plan``: the plan's cost model, backward twice forward); the items
    after the planned microbatches (pieces of long paths, which the pipeline schedules order by their reads
    alone, or expert-parallel placeholders) cost almost nothing.  ``forest``: the step's forest
    (:func:`step_forest`); a plan with pieces is costed on its fitting trees.  The same on every rank of
    the replica."""
    if plan.pieces is not None:       # the base plan covers the fitting trees only
        forest = plan.pieces.fitting_forest() if plan.pieces.num_fit_trees else None
    costs = [] if forest is None and plan.mode == "tree" else \
        [(float(m.forward), float(m.backward)) for m in step_from_plan(plan, replica, forest=forest)]
    if len(costs) > num_items:
        raise ValueError(f"microbatch_costs: the plan gives replica {replica} {len(costs)} microbatches, the step "
                         f"runs {num_items}")
    tiny = 1e-6 * max((c[0] for c in costs), default=1.0)
    return costs + [(tiny, 2 * tiny)] * (num_items - len(costs))


def run_schedule(model, items: List[WindowedMicrobatch], forward_step_func: Callable, settings: SharingSettings, *,
                 forward_only: bool = False, window_stats: Optional[Dict[str, Any]] = None,
                 costs: Optional[List[Tuple[float, float]]] = None) -> List[Any]:
    """Run this replica's microbatches ``items`` on this rank's model chunk through the schedule of the
    run: the sharing-window schedule, or with pipeline size > 1 ``settings.pp_schedule`` (ordered with
    ``costs``, :func:`microbatch_costs`, where the schedule uses them)."""
    from megatron.core import parallel_state
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        return forward_backward_pipelining_windows(forward_step_func=forward_step_func, data_iterator=iter(items),
                                                   model=model, num_microbatches=len(items),
                                                   forward_only=forward_only, window_stats=window_stats,
                                                   schedule=settings.pp_schedule, microbatch_costs=costs,
                                                   piece_keep=settings.piece_keep,
                                                   piece_budget=settings.piece_budget_bytes)
    return forward_backward_windows(forward_step_func=forward_step_func, data_iterator=iter(items), model=model,
                                    num_microbatches=len(items), forward_only=forward_only,
                                    window_stats=window_stats, recompute_producers=settings.recompute_producers,
                                    memory_budget=None if settings.recompute_producers else settings.memory_budget_bytes,
                                    piece_keep=settings.piece_keep, piece_budget=settings.piece_budget_bytes)



def run_forward_only(chunk, items: List[WindowedMicrobatch], forward_step_func: Callable,
                     settings: SharingSettings) -> List[Any]:
    """:func:`run_schedule` forward only, with ``chunk`` in eval mode under ``no_grad`` (no autograd graph,
    dropout off), its training mode restored after."""
    was_training = chunk.training
    chunk.eval()
    try:
        with torch.no_grad():
            return run_schedule(chunk, items, forward_step_func, settings, forward_only=True)
    finally:
        chunk.train(was_training)

def train_step(model: list, optimizer, scheduler, forest, plan, *, settings: SharingSettings,
               objective: ObjectiveConfig, iteration: int, device, plan_seconds: float = 0.0,
               tables: Optional[Dict[str, Dict[Any, np.ndarray]]] = None) -> StepResult:
    """Run one optimizer step of the global batch ``forest`` planned as ``plan`` (module docstring).

    ``tables``: ``{name: {trajectory id: per-position values}}`` an RL update computed for the step
    (``training.rl_update``; :func:`make_forward_step` says which names)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads

    t0 = time.perf_counter()
    if len(model) != 1:
        raise ValueError("train_step: one model chunk expected (virtual pipeline stages are not supported)")
    ddp = model[0]
    replica = parallel_state.get_data_parallel_rank()
    items = replica_microbatches(forest, plan, replica, settings,
                                 aligned=parallel_state.get_expert_model_parallel_world_size() > 1)
    forest = step_forest(forest, plan)
    normalizer = forest_normalizer(forest)
    total_mbs = len(plan.microbatches) + (0 if plan.pieces is None else plan.pieces.num_microbatches)
    counters: Dict[str, Any] = {}
    if tables:
        from .rl_update import TargetTables
        target_tables = TargetTables(forest, tables)
    else:
        target_tables = None
    step_fn = make_forward_step(objective, normalizer, aux_loss_scale=aux_loss_scale(plan), counters=counters,
                                tables=target_tables)

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    window_stats: Dict[str, Any] = {}
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    last = parallel_state.is_pipeline_last_stage()
    costs = microbatch_costs(forest, plan, replica, len(items)) if pp > 1 else None
    with ddp.no_sync(), expert_grad_hooks_off(ddp), megatron_aux_loss_scale_after(device):
        run_schedule(ddp, items, step_fn, settings, window_stats=window_stats, costs=costs)
    # every rank reduces the same terms: the objective's, known also where no loss ran (stages
    # before the last, a replica without microbatches this step)
    term_names = objective_term_names(objective)
    unknown = sorted(set(counters["terms"]) - set(term_names))
    if unknown:
        raise RuntimeError(f"objective terms {unknown} are missing from objective_term_names")
    rows = sum(int(mb.layout.num_rows) for mb in items)
    pairs = sum(visible_pairs(mb.layout) for mb in items)
    piece_counts = [float(window_stats.get(k, 0)) for k in PIECE_STATS]
    local = [float(counters["loss"]), float(counters["kda_calls"]), float(rows), float(counters["replay_tokens"]),
             float(pairs)] + piece_counts + [float(counters["terms"].get(k, 0.0)) for k in term_names]
    if not last:
        local = [0.0] * len(local)
    reduced = _all_reduce_sum(local, device)
    if pp > 1:
        t = torch.tensor(reduced, dtype=torch.float64, device=device)
        dist.all_reduce(t, group=parallel_state.get_pipeline_model_parallel_group())
        reduced = t.tolist()
    loss, kda_calls, computed_rows, replay_tokens = reduced[0], int(reduced[1]), int(reduced[2]), int(reduced[3])
    computed_pairs = int(reduced[4])
    pieces = dict(zip(PIECE_STATS, (int(v) for v in reduced[5:5 + len(PIECE_STATS)])))
    terms = dict(zip(term_names, reduced[5 + len(PIECE_STATS):]))
    if not np.isfinite(loss):
        raise NonFiniteLoss(f"iteration {iteration}: the loss is {loss} (not finite); the weights were not "
                            "updated from this step")
    finalize_model_grads(model)
    update_ok, grad_norm, _ = optimizer.step()
    if update_ok:
        scheduler.step(increment=1)
    tpe = counters["tokens_per_expert"]
    routers = _moe_routers(ddp)
    if tpe is None and routers:      # a replica without microbatches this step still takes part below
        tpe = torch.zeros(len(routers), routers[0].config.num_moe_experts, dtype=torch.float64)
    if tpe is not None and dist.is_initialized():
        tpe = tpe.to(device)
        dist.all_reduce(tpe, group=parallel_state.get_data_parallel_group())
    if pp > 1:       # each stage counted its own MoE layers: stack them in layer order
        parts = [None] * pp
        dist.all_gather_object(parts, None if tpe is None else tpe.cpu(),
                               group=parallel_state.get_pipeline_model_parallel_group())
        parts = [x for x in parts if x is not None]
        tpe = torch.cat(parts) if parts else None
    pm = plan_metrics(plan)
    return StepResult(
        loss=loss, terms=terms, grad_norm=None if grad_norm is None else float(grad_norm),
        lr=float(optimizer.param_groups[0]["lr"]), trajectories=int(forest.num_trajectories),
        trajectory_tokens=int(plan.expanded_tokens), target_tokens=int(normalizer.num_tokens),
        computed_tokens=computed_rows, visible_pairs=computed_pairs, compaction_events=int(forest.traj_evt.shape[0]),
        replay_tokens=replay_tokens, kda_calls=kda_calls,
        microbatches=total_mbs, plan_seconds=plan_seconds, step_seconds=time.perf_counter() - t0,
        tokens_per_expert=None if tpe is None else tpe.cpu(), window_stats=window_stats, plan_metrics=pm, **pieces)
