"""RL updates as RL frameworks run them: forward-only log-prob passes, a reference model, rollout
correction, PPO mini-batches and epochs, over the same planned trees as a training step.

One RL update of a global batch (:func:`rl_update`):

1. ``--rl-old-logprobs recompute``: one forward-only pass over the whole global batch with the
   weights before the update (:func:`forward_logprobs`); these old log-probs hold for every
   mini-batch and epoch of the update.
2. ``--kl-coef`` with ``--kl-to ref``: the reference log-probs of every target, from the frozen
   reference model (``--ref-load``; one forward-only pass) or, without one, the trajectories'
   ``ref_logprobs`` (with ``--ref-load`` the reference model's are used and the data's are not read).
3. ``--rl-tis-cap``: rollout-correction weights from the old log-probs and the trajectories'
   ``rollout_logprobs`` (token or sequence level, truncated or masked); the step metrics
   ``rollout/abs_diff_mean``, ``rollout/abs_diff_max`` and ``rollout/kl`` (k3 estimate of
   KL(rollout || trainer), tokens sampled by the rollout engine) over the trained tokens.
4. ``--rl-epochs E`` passes over ``--rl-mini-batches M`` mini-batches of whole groups (the
   trajectories of a tree or of a ``group`` are never split: :func:`minibatch_trees`), one
   optimizer step (``training.step.train_step``, planned by the microbatch planner) per
   mini-batch; each mini-batch's loss is normalised over that mini-batch.  With
   ``--rl-ratio-level sequence`` each mini-batch first runs a forward-only pass at the current
   weights for every trajectory's mean log-ratio (the GSPO ratio's value).

The trajectories' own per-token fields (``rollout_logprobs``, ``ref_logprobs``) come from the
forest (records, a dataset and ``Forest.select`` keep them); a trajectory with a trained target but
without a field the flags need is refused before any pass (:class:`RLDataError`, naming the
trajectory and the flag).  Per-position values (old, reference, rollout log-probs, rollout weights,
sequence log-ratios) travel as ``{name: {trajectory id: float64 array over positions}}``; a step looks them up per
target by (trajectory, position) (:class:`TargetTables`), so tree and expanded mode, microbatch
cuts and pieces read the same numbers.

Invariants: every forward-only pass runs through the step's own schedule (windows, pieces,
pipeline stages) under ``no_grad`` with the model in eval mode, each target's value computed once
over the data-parallel replicas and summed back to every rank; the loss and every gradient of
every optimizer step equal expanded mode's (``--tree-sharing off``) for the same flags.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Dict, Hashable, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ..flags import check_group, flag
from ..rl.objectives import ObjectiveConfig, tis_weights

__all__ = ["RLUpdateConfig", "REF_PLACEMENTS", "RLDataError", "TargetTables", "data_logprobs", "forward_logprobs",
           "minibatch_trees", "rl_update", "per_trajectory", "rollout_metrics", "RLUpdateResult"]

REF_PLACEMENTS = ("device", "offload")

PerTrajectory = Dict[Hashable, np.ndarray]


class RLDataError(ValueError):
    """The trajectories lack a per-token field the update's flags need (one line naming the
    trajectory, the field and the flag)."""


def data_logprobs(forest, name: str) -> PerTrajectory:
    """{trajectory id: float64 per position} of the per-token field ``name`` (``rollout_logprobs``,
    ``ref_logprobs``) for the trajectories of ``forest`` that carry it."""
    return {forest.traj_ids[t]: forest.trajectory_logprobs(name, t) for t in np.flatnonzero(forest.has_logprobs(name))}


@dataclass(frozen=True)
class RLUpdateConfig:
    """How one global batch becomes optimizer steps (a typed flag group: ``megatron_harts.flags``)."""
    mini_batches: int = flag(1, "--rl-mini-batches", "split the global batch into this many mini-batches of whole "
                             "groups, one optimizer step each (default 1)", minimum=1)
    epochs: int = flag(1, "--rl-epochs", "passes over the mini-batches per global batch; the old log-probs stay "
                       "those of the global batch (default 1)", minimum=1)
    ref_load: Optional[str] = flag(None, "--ref-load", "frozen reference model for --kl-to ref: a driver checkpoint "
                                   "directory (also a release converted by tools/convert_hf_checkpoint.py --format "
                                   "dist) or a transformers Kimi-Linear directory (TP = PP = EP = 1); with it the "
                                   "data's ref_logprobs are not read", metavar="DIR")
    ref_placement: str = flag("device", "--ref-placement", "where the reference weights live: device (default: on "
                              "the GPU, their parameter bytes, no gradients or optimizer state) or offload (in host "
                              "memory, copied to the GPU for each reference pass and back)", choices=REF_PLACEMENTS)

    def __post_init__(self):
        check_group(self)


# ---------------------------------------------------------------------------------------------
# per-target lookup of per-position values
# ---------------------------------------------------------------------------------------------

def _offsets(forest) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(forest.traj_length, dtype=np.int64))]).astype(np.int64)


class TargetTables:
    """Per-position values of a forest's trajectories (flat float64, NaN where absent), looked up
    per target of a microbatch layout or expanded batch by (forest trajectory, position)."""

    def __init__(self, forest, values: Dict[str, PerTrajectory]):
        self.offsets = _offsets(forest)
        self.flat: Dict[str, np.ndarray] = {}
        for name, per_id in values.items():
            flat = np.full(int(self.offsets[-1]), np.nan, dtype=np.float64)
            for t, tid in enumerate(forest.traj_ids):
                v = per_id.get(tid)
                if v is None:
                    continue
                n = int(forest.traj_length[t])
                if v.shape != (n,):
                    raise ValueError(f"trajectory {tid!r}: {name} has {v.shape[0]} entries, the trajectory {n} tokens")
                flat[self.offsets[t]:self.offsets[t + 1]] = v
            self.flat[name] = flat

    def index(self, batch) -> np.ndarray:
        """Flat index of every target of ``batch`` (a host layout or expanded batch)."""
        traj = np.asarray(batch.traj_forest, dtype=np.int64)[batch.target_traj.cpu().numpy()]
        return self.offsets[traj] + batch.target_position.cpu().numpy().astype(np.int64)

    def gather(self, batch) -> Dict[str, torch.Tensor]:
        idx = self.index(batch)
        return {name: torch.from_numpy(flat[idx]) for name, flat in self.flat.items()}


def per_trajectory(forest, flat: np.ndarray) -> PerTrajectory:
    """{trajectory id: its positions' values} of a flat per-position array of ``forest``."""
    off = _offsets(forest)
    return {tid: flat[off[t]:off[t + 1]].copy() for t, tid in enumerate(forest.traj_ids)}


# ---------------------------------------------------------------------------------------------
# forward-only log-probs
# ---------------------------------------------------------------------------------------------

def _logprob_step(captured: list, need_entropy: bool):
    from .step import _unwrap

    def forward_step(data_iterator, model):
        mb, psp = next(data_iterator)
        batch = mb.layout
        if not _unwrap(model).post_process:
            return model(batch.tokens[None], batch.position_ids[None], packed_seq_params=psp), None
        if getattr(psp, "preview", False):      # an exports-only forward, computed again later: no log-probs
            return model(batch.tokens[None], batch.position_ids[None], packed_seq_params=psp, return_hidden=True), None
        host = batch.host_copy if batch.host_copy is not None else batch
        out = model(batch.tokens[None], batch.position_ids[None], packed_seq_params=psp,
                    pair_row=host.pair_row, pair_token=host.pair_token, return_entropy=need_entropy)
        lp_pairs, ent_rows = out if need_entropy else (out, None)
        lp = lp_pairs.index_select(0, batch.target_pair)
        keep = np.ones(batch.num_targets, dtype=bool) if mb.owned is None else mb.owned.cpu().numpy().astype(bool)
        traj = np.asarray(host.traj_forest, dtype=np.int64)[host.target_traj.cpu().numpy()][keep]
        pos = host.target_position.cpu().numpy().astype(np.int64)[keep]
        ent = ent_rows.index_select(0, batch.target_row).detach().double().cpu().numpy()[keep] \
            if need_entropy else None
        captured.append((traj, pos, lp.detach().double().cpu().numpy()[keep], ent))

        def loss_func(output):
            return output.sum() * 0.0, {}
        return lp, loss_func
    return forward_step


def _sum_over_replicas(t: torch.Tensor, device) -> torch.Tensor:
    if not dist.is_initialized():
        return t
    from megatron.core import parallel_state
    t = t.to(device)
    dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(t, group=parallel_state.get_pipeline_model_parallel_group())
    return t.cpu()


def forward_logprobs(model, forest, plan, settings, *, entropy: bool = False
                     ) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """Log-probs (and entropies) of every target of a planned step, forward only (no autograd graph,
    the model in eval mode for the pass), through the step's own schedule; collective over the
    step's world.  Returns flat per-position arrays of ``step_forest(forest, plan)`` (NaN at
    positions that are no target): ``lp[offset[t] + j] = log p(token j | tokens before j)``."""
    from megatron.core import parallel_state

    from .step import replica_microbatches, run_forward_only, step_forest
    replica = parallel_state.get_data_parallel_rank()
    items = replica_microbatches(forest, plan, replica, settings,
                                 aligned=parallel_state.get_expert_model_parallel_world_size() > 1)
    sf = step_forest(forest, plan)
    off = _offsets(sf)
    captured: list = []
    chunk = model[0] if isinstance(model, (list, tuple)) else model
    run_forward_only(chunk, items, _logprob_step(captured, entropy), settings)
    total = int(off[-1])
    k = 3 if entropy else 2
    acc = torch.zeros(k, total, dtype=torch.float64)
    for traj, pos, lp, ent in captured:
        idx = torch.from_numpy(off[traj] + pos)
        acc[0].index_add_(0, idx, torch.from_numpy(lp))
        acc[1].index_add_(0, idx, torch.ones(idx.shape[0], dtype=torch.float64))
        if entropy:
            acc[2].index_add_(0, idx, torch.from_numpy(ent))
    device = next(chunk.parameters()).device
    acc = _sum_over_replicas(acc, device).numpy()
    have = acc[1] > 0
    if bool((acc[1] > 1).any()):
        raise RuntimeError("forward_logprobs: a target was computed by more than one microbatch")
    lp = np.where(have, acc[0], np.nan)
    ent = np.where(have, acc[2], np.nan) if entropy else None
    return lp, ent


# ---------------------------------------------------------------------------------------------
# mini-batches
# ---------------------------------------------------------------------------------------------

def minibatch_trees(forest, num: int) -> List[List[int]]:
    """The trees of each of ``num`` mini-batches: trees joined by a shared ``group`` stay together
    (a unit), units go to the mini-batch with the fewest trajectory tokens so far, largest first
    (ties: lower index); deterministic.  Fewer units than ``num``: ValueError."""
    T = forest.num_trees
    seg_tree = forest.seg_tree
    traj_tree = seg_tree[np.asarray(forest.traj_leaf, dtype=np.int64)]
    parent = list(range(T))

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x
    first_of_group: Dict[Any, int] = {}
    for t, g in enumerate(forest.traj_group):
        if g is None:
            continue
        tree = int(traj_tree[t])
        if g in first_of_group:
            a, b = find(first_of_group[g]), find(tree)
            if a != b:
                parent[max(a, b)] = min(a, b)
        else:
            first_of_group[g] = tree
    tokens = np.bincount(traj_tree, weights=np.asarray(forest.traj_length, dtype=np.float64), minlength=T)
    units: Dict[int, List[int]] = {}
    for tree in range(T):
        units.setdefault(find(tree), []).append(tree)
    if len(units) < num:
        raise ValueError(f"--rl-mini-batches {num}: the global batch has {len(units)} group(s) of trees; a group is "
                         "never split, so at most that many mini-batches")
    order = sorted(units.values(), key=lambda u: (-float(tokens[u].sum()), u[0]))
    load = [0.0] * num
    out: List[List[int]] = [[] for _ in range(num)]
    for u in order:
        i = min(range(num), key=lambda k: (load[k], k))
        out[i] += u
        load[i] += float(tokens[u].sum())
    return [sorted(trees) for trees in out]


# ---------------------------------------------------------------------------------------------
# rollout correction
# ---------------------------------------------------------------------------------------------

def _targets(forest) -> Dict[Hashable, np.ndarray]:
    """{trajectory id: bool per position, the trained targets (loss mask 1, position >= 1)}."""
    out = {}
    for tid in forest.traj_ids:
        tr = forest.expand(tid)
        m = np.asarray(tr.loss_mask) == 1
        m[0] = False
        out[tid] = m
    return out


def _tis_table(targets, old: PerTrajectory, rollout: PerTrajectory, objective: ObjectiveConfig) -> PerTrajectory:
    out = {}
    for tid, m in targets.items():
        if not m.any():
            continue
        o, r = old.get(tid), rollout.get(tid)
        if r is None or np.isnan(r[m]).any():
            raise RLDataError(f"trajectory {tid!r}: --rl-tis-cap {objective.tis_cap} needs `rollout_logprobs` at "
                              "every trained token")
        d = np.where(m, o - r, 0.0)
        if objective.tis_level == "sequence":
            d = np.where(m, d[m].sum(), 0.0)
        out[tid] = np.where(m, tis_weights(torch.from_numpy(d), objective.tis_cap, objective.tis_mode).numpy(), np.nan)
    return out


def rollout_metrics(targets, old: PerTrajectory, rollout: PerTrajectory) -> Dict[str, float]:
    """Mean and max |old - rollout| and the k3 estimate of KL(rollout || trainer) over trained tokens
    (tokens without a rollout log-prob are left out; none: no metrics)."""
    diffs = []
    for tid, m in targets.items():
        r = rollout.get(tid)
        if r is None or not m.any():
            continue
        d = (old[tid] - r)[m]
        diffs.append(d[~np.isnan(d)])
    d = np.concatenate(diffs) if diffs else np.zeros(0)
    if d.size == 0:
        return {}
    return {"rollout/abs_diff_mean": float(np.abs(d).mean()), "rollout/abs_diff_max": float(np.abs(d).max()),
            "rollout/kl": float((np.exp(d) - d - 1.0).mean())}


# ---------------------------------------------------------------------------------------------
# the update
# ---------------------------------------------------------------------------------------------

@dataclass
class RLUpdateResult:
    """The optimizer steps of one update (in order) and the update's extra metrics."""
    steps: list
    metrics: Dict[str, float]
    minibatch_trees: List[List[int]]


@contextlib.contextmanager
def _placed(module, device, placement: str):
    if placement == "offload":
        module.to(device)
    try:
        yield
    finally:
        if placement == "offload":
            module.to("cpu")


def rl_update(model: list, optimizer, scheduler, forest, plan, *, settings, objective: ObjectiveConfig,
              update: RLUpdateConfig, iteration: int, device, plan_fn, ref_model=None,
              plan_seconds: float = 0.0) -> RLUpdateResult:
    """One RL update of the global batch ``forest`` planned as ``plan`` (module docstring).

    The trajectories' ``rollout_logprobs`` and ``ref_logprobs`` are read from ``forest``;
    ``ref_model``: the frozen reference module (``--ref-load``) or None; ``plan_fn(forest)`` plans a
    mini-batch."""
    from .step import step_forest, train_step
    metrics: Dict[str, float] = {}
    sf = step_forest(forest, plan)
    tables: Dict[str, PerTrajectory] = {}
    rollout = data_logprobs(sf, "rollout_logprobs")
    data_ref = objective.kl_coef > 0 and objective.kl_to == "ref" and ref_model is None
    needs_targets = objective.tis_cap is not None or bool(rollout) or data_ref
    targets = _targets(sf) if needs_targets else None
    if data_ref:
        ref = data_logprobs(sf, "ref_logprobs")
        for tid, m in targets.items():
            if m.any() and tid not in ref:
                raise RLDataError(f"trajectory {tid!r}: --kl-coef {objective.kl_coef} --kl-to ref needs "
                                  "`ref_logprobs` (none given and no --ref-load): give --ref-load DIR, or score the "
                                  "data with tools/score_logprobs.py --field ref_logprobs")
        tables["ref"] = ref
    if objective.tis_cap is not None and not rollout:
        raise RLDataError(f"--rl-tis-cap {objective.tis_cap}: the trajectories carry no `rollout_logprobs`")
    if objective.old_logprobs == "recompute":
        lp, _ = forward_logprobs(model, forest, plan, settings)
        tables["old"] = per_trajectory(sf, lp)
    if objective.kl_coef > 0 and objective.kl_to == "ref" and ref_model is not None:
        with _placed(ref_model, device, update.ref_placement):
            lp, _ = forward_logprobs(ref_model, forest, plan, settings)
        tables["ref"] = per_trajectory(sf, lp)
    if rollout:
        if "old" in tables:
            old = tables["old"]
        elif objective.old_logprobs == "current":     # the trainer's old log-probs are this step's own
            old = {}
        else:
            old = {tid: sf.expand(tid).old_logprobs for tid in sf.traj_ids}
            old = {k: v for k, v in old.items() if v is not None}
        missing = [tid for tid, m in targets.items() if m.any() and tid not in old]
        if missing and objective.tis_cap is not None:
            raise RLDataError(f"trajectory {missing[0]!r}: rollout correction needs `old_logprobs` (or "
                              "--rl-old-logprobs recompute)")
        if not missing:     # the rollout/* metrics compare the engine with the trainer's old log-probs
            metrics.update(rollout_metrics(targets, old, rollout))
        if objective.tis_cap is not None:
            tables["tis"] = _tis_table(targets, old, rollout, objective)

    groups = minibatch_trees(forest, update.mini_batches) if update.mini_batches > 1 else None
    subsets = [(forest, plan)] if groups is None else None
    steps = []
    for epoch in range(update.epochs):
        if groups is not None and subsets is None:
            subsets = [(sub, plan_fn(sub)) for sub in (forest.select(trees) for trees in groups)]
        for sub, sub_plan in subsets:
            step_tables = dict(tables)
            if objective.kind == "ppo" and objective.ratio_level == "sequence" and objective.old_logprobs != "current":
                lp, _ = forward_logprobs(model, sub, sub_plan, settings)
                ssf = step_forest(sub, sub_plan)
                cur = per_trajectory(ssf, lp)
                old_src = tables.get("old")
                seq = {}
                for tid, v in cur.items():
                    m = ~np.isnan(v)
                    if not m.any():
                        continue
                    o = old_src[tid] if old_src is not None else ssf.expand(tid).old_logprobs
                    if o is None or np.isnan(o[m]).any():
                        raise ValueError(f"trajectory {tid!r}: --rl-ratio-level sequence needs `old_logprobs` at "
                                         "every trained token")
                    seq[tid] = np.where(m, (v[m] - o[m]).mean(), np.nan)
                step_tables["seq"] = seq
            steps.append(train_step(model, optimizer, scheduler, sub, sub_plan, settings=settings, objective=objective,
                                    iteration=iteration, device=device,
                                    plan_seconds=plan_seconds if not steps else 0.0, tables=step_tables))
    return RLUpdateResult(steps=steps, metrics=metrics, minibatch_trees=groups or [list(range(forest.num_trees))])
