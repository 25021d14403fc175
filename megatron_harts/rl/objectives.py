"""RL and SFT objectives over tree targets, equal to expanded (trajectory-by-trajectory) training.

A training step's loss is defined on the step's whole global batch, expanded: every trajectory
on its own, with a loss mask over its positions (a target is a position ``j >= 1`` with
``loss_mask[j] == 1``, predicted from position ``j - 1``).  In tree mode the same targets are
spread over many microbatches and data-parallel ranks, and a shared row carries the targets of
every trajectory through it.  Each microbatch computes only the targets it owns.  This module
makes the sum of the microbatch losses equal the expanded global-batch loss:

1. :func:`forest_normalizer` (or :func:`batch_normalizer`) counts, once per step and over the
   whole step, the loss tokens of every trajectory.
2. :func:`target_scale` turns those counts into one coefficient per target, so that the global
   loss is ``sum_i scale_i * per_token_loss_i`` over all the step's targets.  With ``w_i`` the
   trajectory weight of target i (``CompactLayout.target_weight``, 1.0 when absent),
   ``n_t`` the loss tokens of trajectory t, ``N_tok = sum_t n_t`` and ``N_seq`` the number of
   trajectories with ``n_t >= 1``:

   - ``token-mean``:          ``scale_i = w_i / N_tok``
   - ``seq-mean-token-mean``: ``scale_i = w_i / (n_t(i) * N_seq)``
   - ``seq-mean-token-sum``:  ``scale_i = w_i / N_seq``
   - ``seq-mean-token-sum-norm`` (Dr.GRPO): ``scale_i = w_i / (N_seq * L)``, ``L`` the constant
     ``loss_norm_length``

3. :func:`objective_loss` returns ``sum_i scale_i * per_token_loss_i`` over the targets it is
   given.  The loss is linear in the per-target terms, so its value and gradient summed over
   any partition of the step's targets equal those of the global-batch loss.

The driver must therefore *sum* the microbatch losses (and gradients) over microbatches and
data-parallel ranks, never average them: megatron-core's DDP divides gradients by the
data-parallel size by default, which the driver has to undo or turn off.

Per-token losses (``logp`` = current log-prob of the target token, ``old`` = behaviour log-prob,
below, ``A`` = advantage from the data, scalar per trajectory broadcast or per token):

- ``sft``: ``-logp``; advantages and old log-probs are ignored.
- ``ppo``: ``ratio = exp(logp - old)``,
  ``-min(ratio * A, clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high) * A)``.  GRPO-style
  group-normalised advantages are the data's business; this module reads them as given.  With
  ``ratio_level`` "sequence" (GSPO) every target of trajectory t takes the ratio
  ``exp(logp - sg(logp) + sg(S_t))``, ``S_t`` the mean of ``logp - old`` over t's targets (value:
  the sequence ratio; gradient: it times ``grad logp``), clipped alike.  With ``tis_cap`` the
  clipped term is multiplied by a rollout-correction weight (:func:`tis_weights`: ``exp(old -
  rollout)`` per token or per trajectory, truncated at the cap or masked above it).
- either kind, ``kl_coef > 0``: ``+ kl_coef * KL`` with :func:`kl_penalty`'s estimator
  (``kl_estimator``: k1 ``d``, k2 ``d^2/2``, k3 ``exp(-d) + d - 1`` with ``d = logp - target``;
  k3, Schulman's low-variance estimator, is >= 0 and zero iff equal) against the reference
  log-probs (``kl_to`` "ref") or the old log-probs (``kl_to`` "old").
- either kind, ``entropy_coef != 0``: ``- entropy_coef * H`` with ``H`` the entropy of the
  distribution of the row that predicts the target (an entropy bonus).

``old`` comes from ``ObjectiveConfig.old_logprobs`` (``--rl-old-logprobs``):

- ``data`` (default): the data's ``old_logprobs``; a target without one is an error.
- ``current``: ``logp`` itself, detached (on-policy data, e.g. GRPO rollouts used for one update:
  the ratio is exactly 1 and its gradient is the policy gradient ``-A * grad logp``).  No extra
  forward: the log-probs of the same forward, so tree mode keeps its cost and equals expanded
  mode exactly as with ``data``.  A KL to the old log-probs would then be 0 in value and gradient,
  so ``current`` refuses ``kl_to`` "old" with ``kl_coef > 0``; it applies to ``ppo`` only.
- ``recompute``: the log-probs of a forward-only pass over the global batch before the update
  (``training.rl_update``), passed in as ``old_logprobs``.

Per-target values computed before a step (recomputed old log-probs, reference log-probs, rollout
weights, sequence log-ratios) are inputs of :func:`objective_loss`, so the loss stays linear in
the per-target terms and the microbatch partition invariant below holds for every flag.

:func:`objective_loss_reference` computes the same global-batch loss trajectory by trajectory
from expanded per-position arrays with padded [batch, length] masks; tests use it as the oracle.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import torch

from ..flags import check_group, flag, flag_fields, group_kwargs
from ..layout import CompactLayout
from ..tree_data.forest import Forest
from ..tree_data.trajectory import Trajectory

__all__ = [
    "OBJECTIVE_KINDS", "LOSS_AGG_MODES", "OLD_LOGPROBS_SOURCES", "ObjectiveConfig", "ObjectiveDataError",
    "KL_ESTIMATORS", "KL_TARGETS", "RATIO_LEVELS", "TIS_MODES", "kl_penalty", "sequence_log_ratio", "tis_weights",
    "BatchNormalizer", "batch_normalizer", "forest_normalizer", "target_scale", "layout_target_scale",
    "validate_targets", "objective_loss", "objective_loss_reference",
]

OBJECTIVE_KINDS = ("sft", "ppo")
#: where the PPO ratio's old log-probs come from (module docstring)
OLD_LOGPROBS_SOURCES = ("data", "current", "recompute")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
#: KL estimators of ``--kl-estimator`` (module docstring)
KL_ESTIMATORS = ("k1", "k2", "k3")
#: what the KL penalty is measured against (``--kl-to``)
KL_TARGETS = ("ref", "old")
#: importance-ratio levels (``--rl-ratio-level``) and rollout-correction levels (``--rl-tis-level``)
RATIO_LEVELS = ("token", "sequence")
#: what rollout correction does with a ratio above ``--rl-tis-cap``
TIS_MODES = ("truncate", "mask")


# ---------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ObjectiveConfig:
    """What the loss is (module docstring); every field is validated on construction.

    ``kind``: "sft" or "ppo".  ``clip_ratio_low`` in [0, 1) and ``clip_ratio_high`` >= 0 clip
    the PPO ratio to ``[1 - low, 1 + high]`` (asymmetric like DAPO's 0.2 / 0.28).  ``kl_coef``
    >= 0 weighs the KL penalty (``kl_estimator`` against ``kl_to``); ``entropy_coef`` >= 0 weighs
    the entropy bonus.  ``loss_agg_mode``: one of :data:`LOSS_AGG_MODES`.  ``old_logprobs``: one of
    :data:`OLD_LOGPROBS_SOURCES` ("current" needs ``kind`` "ppo" and no KL to the old log-probs).
    Every field is a typed flag (``megatron_harts.flags``): it declares the training driver's flag,
    its help and constraints, from which the driver's options are generated and its parsed values
    copied back by field name.  Errors name the driver's flag for the field (:meth:`flag`) and the
    field.
    """
    kind: str = flag(
        "ppo", "--rl-objective", "ppo (default: clipped importance-ratio policy gradient with the trajectories' "
        "advantages and old log-probs) or sft (log-likelihood of the trainable tokens)", choices=OBJECTIVE_KINDS)
    clip_ratio_low: float = flag(
        0.2, "--clip-ratio-low", "ppo: lower clip, ratio >= 1 - this (default 0.2)", minimum=0, exclusive_maximum=1,
        metavar="X", cli_default=None)
    clip_ratio_high: float = flag(
        0.2, "--clip-ratio-high", "ppo: upper clip, ratio <= 1 + this (default 0.2)", minimum=0, metavar="X",
        cli_default=None)
    kl_coef: float = flag(
        0.0, "--kl-coef", "weight of the KL penalty to the reference log-probs (default 0)", minimum=0, metavar="X")
    entropy_coef: float = flag(
        0.0, "--entropy-coef", "weight of the entropy bonus (default 0)", minimum=0, metavar="X")
    loss_agg_mode: str = flag(
        "token-mean", "--loss-agg-mode", "loss aggregation over the global batch (default token-mean)",
        choices=LOSS_AGG_MODES)
    old_logprobs: str = flag(
        "data", "--rl-old-logprobs", "ppo: the old log-probs of the importance ratio. data (default): the "
        "trajectories' old_logprobs (required); current: the policy's own log-probs from the same forward, detached "
        "(on-policy data without old_logprobs, e.g. GRPO: ratio 1, the gradient is the policy gradient; no extra "
        "forward, tree mode stays exact); recompute: one forward-only pass over the global batch with the weights "
        "before the update, fixed for all its mini-batches and epochs. current excludes --kl-to old with --kl-coef "
        "> 0 (that KL would be 0)", choices=OLD_LOGPROBS_SOURCES)
    kl_estimator: str = flag(
        "k3", "--kl-estimator", "estimator of the KL penalty per token, d = logp - target: k1 = d, k2 = d^2 / 2, "
        "k3 = exp(-d) + d - 1 (default k3)", choices=KL_ESTIMATORS)
    kl_to: str = flag(
        "ref", "--kl-to", "what --kl-coef's KL is measured against: ref (default: the reference model of --ref-load, "
        "or the data's ref_logprobs) or old (the old log-probs of the ratio)", choices=KL_TARGETS)
    ratio_level: str = flag(
        "token", "--rl-ratio-level", "ppo: token (default: one ratio per token) or sequence (GSPO: every token of a "
        "trajectory takes the ratio exp(mean over its targets of logp - old), clipped as one)", choices=RATIO_LEVELS)
    tis_cap: Optional[float] = flag(
        None, "--rl-tis-cap", "ppo: rollout correction; weigh each token's policy loss by the importance weight "
        "exp(old - rollout_logprobs) capped at this value (truncated importance sampling; default off)",
        exclusive_minimum=0.0)
    tis_level: str = flag(
        "token", "--rl-tis-level", "rollout correction per token (default) or per sequence (the product of the "
        "trajectory's token ratios over its targets)", choices=RATIO_LEVELS)
    tis_mode: str = flag(
        "truncate", "--rl-tis-mode", "a weight above --rl-tis-cap is set to the cap (truncate, default) or to 0 "
        "(mask: the token, or the whole sequence at sequence level, is left out of the policy loss)",
        choices=TIS_MODES)
    loss_norm_length: Optional[int] = flag(
        None, "--rl-loss-norm-length", "seq-mean-token-sum-norm: the constant token count each sequence's token sum "
        "is divided by (Dr.GRPO; the driver's default: --seq-length)", minimum=1)

    def __post_init__(self):
        check_group(self)
        if self.old_logprobs in ("current", "recompute") and self.kind != "ppo":
            raise ValueError(f"--rl-old-logprobs {self.old_logprobs} only applies to --rl-objective ppo, got "
                             f"--rl-objective {self.kind} (ObjectiveConfig.old_logprobs)")
        if self.old_logprobs == "current" and self.kl_coef > 0 and self.kl_to == "old":
            raise ValueError(f"--kl-coef {self.kl_coef} --kl-to old with --rl-old-logprobs current: the KL to the "
                             f"old log-probs would be 0 in value and gradient (old = the current log-probs, "
                             f"detached); use --kl-to ref, or `old_logprobs` in the data and --rl-old-logprobs "
                             f"data (ObjectiveConfig.old_logprobs)")
        if self.kind != "ppo":
            for name, off in (("ratio_level", "token"), ("tis_cap", None)):
                if getattr(self, name) != off:
                    raise ValueError(f"{self.flag(name)} only applies to --rl-objective ppo (ObjectiveConfig.{name})")
        if self.tis_cap is not None and self.old_logprobs == "current":
            raise ValueError("--rl-tis-cap with --rl-old-logprobs current: the rollout correction needs the trainer's "
                             "old log-probs before the update; use --rl-old-logprobs recompute "
                             "(ObjectiveConfig.tis_cap)")
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and self.loss_norm_length is None:
            raise ValueError("--loss-agg-mode seq-mean-token-sum-norm needs --rl-loss-norm-length "
                             "(ObjectiveConfig.loss_norm_length)")

    @staticmethod
    def flag(name: str) -> str:
        """The training driver's flag for field ``name`` (e.g. "kind" -> "--rl-objective")."""
        for spec in flag_fields(ObjectiveConfig):
            if spec.field == name:
                return spec.name
        raise ValueError(f"ObjectiveConfig has no field {name!r}")

    @classmethod
    def from_args(cls, args) -> "ObjectiveConfig":
        """From parsed driver arguments (``args.rl_objective``, ``args.clip_ratio_low``, ...);
        missing attributes (and None for a field that takes no None) keep their defaults."""
        return cls(**group_kwargs(cls, args))


class ObjectiveDataError(ValueError):
    """Targets lack data the objective needs.

    ``field`` is the data field ("advantage" or "old_logprobs"), ``count`` the number of targets
    lacking it, ``target_index`` the index of the first of them in the targets given, so that
    the caller can name its trajectory.
    """

    def __init__(self, message: str, field: str, count: int, target_index: int):
        super().__init__(message)
        self.field = field
        self.count = count
        self.target_index = target_index


# ---------------------------------------------------------------------------
# global-batch normalisation
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchNormalizer:
    """Loss-token statistics of a step's whole global batch (every microbatch, every rank).

    ``traj_tokens[t]``: loss tokens (targets) of trajectory t, t indexing the step's forest
    trajectories; ``num_tokens = traj_tokens.sum()``; ``num_sequences``: trajectories with at
    least one loss token.  Weights do not enter the counts.
    """
    traj_tokens: torch.Tensor   # int64 [N]
    num_tokens: int
    num_sequences: int

    @property
    def num_trajectories(self) -> int:
        return int(self.traj_tokens.shape[0])

    def to(self, device) -> "BatchNormalizer":
        return BatchNormalizer(self.traj_tokens.to(device), self.num_tokens, self.num_sequences)


def _from_counts(counts: np.ndarray) -> BatchNormalizer:
    counts = np.asarray(counts, dtype=np.int64)
    return BatchNormalizer(torch.from_numpy(counts.copy()), int(counts.sum()), int((counts > 0).sum()))


def batch_normalizer(target_traj, num_trajectories: int) -> BatchNormalizer:
    """Statistics from the trajectory index of every target of the whole step.

    ``target_traj`` must list each of the step's targets exactly once (e.g. the concatenation of
    ``layout.traj_forest[layout.target_traj]`` over all microbatches and ranks).
    """
    tt = target_traj.detach().cpu().numpy() if isinstance(target_traj, torch.Tensor) else np.asarray(target_traj)
    tt = tt.reshape(-1)
    if tt.size and tt.dtype.kind not in "iu":
        raise ValueError(f"target_traj must hold integer trajectory indices, got dtype {tt.dtype}")
    if tt.size and (tt.min() < 0 or tt.max() >= num_trajectories):
        bad = int(tt[(tt < 0) | (tt >= num_trajectories)][0])
        raise ValueError(f"target_traj: trajectory {bad} out of range [0, {num_trajectories})")
    return _from_counts(np.bincount(tt.astype(np.int64), minlength=num_trajectories))


def forest_normalizer(forest: Forest) -> BatchNormalizer:
    """Statistics of a step whose global batch is all of ``forest``'s trajectories.

    Reads the loss masks the forest stores (rows plus per-trajectory exceptions): trajectory t's
    count is the number of its positions ``j >= 1`` with ``loss_mask[j] == 1``, exactly what the
    layouts of all its microbatches hold as targets.  Linear in rows and segments, plus the path
    length of each trajectory with loss-mask exceptions.
    """
    if not isinstance(forest, Forest):
        raise ValueError(f"forest must be a Forest, got {type(forest).__name__}")
    N = forest.num_trajectories
    row_seg = np.repeat(np.arange(forest.num_segments, dtype=np.int64), forest.seg_length)
    row_pos = forest.seg_start[row_seg] + np.arange(forest.num_rows, dtype=np.int64) - forest.seg_row[row_seg]
    is_target = (forest.row_loss_mask == 1) & (row_pos >= 1)
    seg_count = np.bincount(row_seg, weights=is_target, minlength=forest.num_segments).astype(np.int64)
    # a trajectory holds every row of every segment on its path; those through s are [lo, hi)
    diff = np.zeros(N + 1, dtype=np.int64)
    np.add.at(diff, forest.seg_traj_lo, seg_count)
    np.add.at(diff, forest.seg_traj_hi, -seg_count)
    counts = np.cumsum(diff)[:N]
    exc = forest.exc_loss_mask
    for t in np.unique(exc.traj).tolist():
        a, b = np.searchsorted(exc.traj, [t, t + 1])
        pos, val = exc.pos[a:b], exc.value[a:b]
        row_val = forest.row_loss_mask[forest.trajectory_rows(t)[pos]]
        counts[t] += int(((val == 1) & (pos >= 1)).sum()) - int(((row_val == 1) & (pos >= 1)).sum())
    return _from_counts(counts)


def target_scale(normalizer: BatchNormalizer, target_traj: torch.Tensor, target_weight: torch.Tensor,
                 loss_agg_mode: str, norm_length: Optional[int] = None) -> torch.Tensor:
    """Per-target coefficient (float64) such that the global-batch loss is
    ``sum_i scale_i * per_token_loss_i`` over all the step's targets (formulas in the module
    docstring).

    ``target_traj`` indexes the normalizer's trajectories (the step's forest, not a layout's
    local trajectories: see :func:`layout_target_scale`).  A target of a trajectory that the
    normalizer counts no token for means the normalizer came from another batch: ValueError.
    ``norm_length``: the constant of ``seq-mean-token-sum-norm`` (required there, unused elsewhere).
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"--loss-agg-mode must be one of {', '.join(LOSS_AGG_MODES)}, got {loss_agg_mode!r}")
    if target_traj.dim() != 1 or target_weight.shape != target_traj.shape:
        raise ValueError(f"target_traj and target_weight must be 1-D of equal length, got "
                         f"{tuple(target_traj.shape)} and {tuple(target_weight.shape)}")
    w = target_weight.to(torch.float64)
    if target_traj.numel() == 0:
        return w.clone()
    tt = target_traj.to(torch.int64)
    n = normalizer.num_trajectories
    if int(tt.min()) < 0 or int(tt.max()) >= n:
        bad = int(tt[(tt < 0) | (tt >= n)][0])
        raise ValueError(f"target_traj: trajectory {bad} out of range [0, {n}) of the batch normalizer")
    counts = normalizer.traj_tokens.to(tt.device)[tt]
    if bool((counts == 0).any()):
        bad = int(tt[counts == 0][0])
        raise ValueError(f"target_traj: trajectory {bad} has targets here but no loss tokens in the batch "
                         f"normalizer (built from another step's data?)")
    if not bool(torch.isfinite(w).all()):
        i = int(torch.nonzero(~torch.isfinite(w))[0])
        raise ValueError(f"target_weight: target {i} has weight {float(w[i])}, weights must be finite")
    if loss_agg_mode == "token-mean":
        return w / normalizer.num_tokens
    if loss_agg_mode == "seq-mean-token-mean":
        return w / (counts.to(torch.float64) * normalizer.num_sequences)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if norm_length is None or norm_length < 1:
            raise ValueError(f"--loss-agg-mode seq-mean-token-sum-norm needs a positive norm length, got {norm_length!r}")
        return w / (normalizer.num_sequences * float(norm_length))
    return w / normalizer.num_sequences


def layout_target_scale(normalizer: BatchNormalizer, layout: CompactLayout, loss_agg_mode: str,
                        norm_length: Optional[int] = None) -> torch.Tensor:
    """:func:`target_scale` of a microbatch layout's targets (maps its trajectories to the forest's)."""
    traj_forest = torch.from_numpy(np.asarray(layout.traj_forest, dtype=np.int64)).to(layout.target_traj.device)
    return target_scale(normalizer, traj_forest[layout.target_traj], layout.target_weight, loss_agg_mode, norm_length)


# ---------------------------------------------------------------------------
# the loss
# ---------------------------------------------------------------------------

#: what to do about data without old log-probs (on-policy rollouts; not with a KL penalty)
_OLD_LOGPROBS_HINT = "; for on-policy data, --rl-old-logprobs current uses the policy's own log-probs, detached"


def _old_logprobs_hint(config: ObjectiveConfig) -> str:
    return _OLD_LOGPROBS_HINT if config.kind == "ppo" and config.kl_coef == 0 else ""


def _first_missing(values: torch.Tensor, field: str, why: str, hint: str = "") -> None:
    missing = torch.isnan(values)
    count = int(missing.sum())
    if count:
        i = int(torch.nonzero(missing)[0])
        raise ObjectiveDataError(
            f"{count} of {values.shape[0]} targets have no {field} (NaN, first: target {i}), but {why}: the "
            f"data lacks `{field}` for their trajectories{hint}", field, count, i)


def validate_targets(config: ObjectiveConfig, old_logprobs: torch.Tensor, advantage: torch.Tensor,
                     entropy: Optional[torch.Tensor] = None, ref_logprobs: Optional[torch.Tensor] = None) -> None:
    """Raise unless the targets carry what ``config`` needs.

    ``ppo`` needs an advantage and (``old_logprobs`` "data" or "recompute") an old log-prob per
    target, ``kl_coef > 0`` old log-probs (``kl_to`` "old") or reference log-probs (``kl_to`` "ref"),
    ``entropy_coef != 0`` per-target entropies.  Missing data raises :class:`ObjectiveDataError`
    with the index of the first offending target.
    """
    if config.kind == "ppo":
        _first_missing(advantage, "advantage", "--rl-objective ppo needs one per target")
        if config.old_logprobs != "current":
            _first_missing(old_logprobs, "old_logprobs", "--rl-objective ppo needs one per target",
                           _old_logprobs_hint(config))
    if config.kl_coef > 0 and config.kl_to == "old":
        _first_missing(old_logprobs, "old_logprobs", f"--kl-coef {config.kl_coef} --kl-to old needs one per target")
    if config.kl_coef > 0 and config.kl_to == "ref":
        if ref_logprobs is None:
            raise ValueError(f"--kl-coef {config.kl_coef} --kl-to ref needs reference log-probs (--ref-load, or "
                             f"`ref_logprobs` in the data)")
        _first_missing(ref_logprobs, "ref_logprobs", f"--kl-coef {config.kl_coef} --kl-to ref needs one per target",
                       "; give --ref-load DIR, or score the data with tools/score_logprobs.py --field ref_logprobs")
    if config.entropy_coef != 0 and entropy is None:
        raise ValueError(f"--entropy-coef {config.entropy_coef} needs per-target entropies (entropy=...)")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def kl_penalty(logp: torch.Tensor, target: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and ``target`` log-probs, ``d = logp - target``:
    ``k1 = d``, ``k2 = d^2 / 2``, ``k3 = exp(-d) + d - 1`` (Schulman's estimators of
    ``KL(pi_theta || pi_target)`` from tokens sampled by the policy; k3 is >= 0 and zero iff equal)."""
    d = logp - target
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(-d) + d - 1.0
    raise ValueError(f"--kl-estimator must be one of {', '.join(KL_ESTIMATORS)}, got {estimator!r}")


def tis_weights(log_ratio: torch.Tensor, cap: float, mode: str) -> torch.Tensor:
    """Rollout-correction weights from ``log_ratio = old - rollout`` (per token, or a trajectory's sum
    over its targets broadcast to them): ``exp(log_ratio)`` truncated at ``cap``, or with ``mode``
    "mask" set to 0 above ``cap``."""
    r = torch.exp(log_ratio.to(torch.float64))
    if mode == "truncate":
        return torch.clamp(r, max=float(cap))
    if mode == "mask":
        return torch.where(r > cap, torch.zeros_like(r), r)
    raise ValueError(f"--rl-tis-mode must be one of {', '.join(TIS_MODES)}, got {mode!r}")


def sequence_log_ratio(per_target: torch.Tensor, target_traj: torch.Tensor, num_trajectories: int,
                       mean: bool) -> torch.Tensor:
    """Per target, the sum (``mean``: the mean) over the targets of its trajectory of ``per_target``
    (every target of each trajectory present), float64."""
    tt = target_traj.to(torch.int64)
    v = per_target.to(torch.float64)
    sums = torch.zeros(num_trajectories, dtype=torch.float64, device=v.device).index_add_(0, tt, v)
    if mean:
        counts = torch.bincount(tt, minlength=num_trajectories).to(torch.float64).clamp_min(1.0)
        sums = sums / counts
    return sums[tt]


def objective_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantage: torch.Tensor,
                   scale: torch.Tensor, config: ObjectiveConfig,
                   entropy: Optional[torch.Tensor] = None, *, ref_logprobs: Optional[torch.Tensor] = None,
                   tis_weight: Optional[torch.Tensor] = None, seq_log_ratio: Optional[torch.Tensor] = None,
                   ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """``(loss, terms)`` of one microbatch's targets: ``loss = sum_i scale_i * per_token_loss_i``.

    ``logprobs`` [T]: differentiable current log-probs of the targets; ``old_logprobs`` and
    ``advantage`` [T]: from the layout (``target_old_logprob``, ``target_advantage``; NaN =
    absent) or, with ``old_logprobs`` "recompute", the recomputed ones; ``old_logprobs`` is not
    read when ``config.old_logprobs`` is "current": the old log-probs are then ``logprobs.detach()``;
    ``scale`` [T]: from :func:`target_scale`; ``entropy`` [T] (differentiable or not): entropy of
    each target's row distribution, required when ``entropy_coef != 0``.  ``ref_logprobs`` [T]:
    reference log-probs (``kl_to`` "ref" with ``kl_coef > 0``); ``tis_weight`` [T]: rollout-correction
    weights (:func:`tis_weights`, with ``tis_cap``); ``seq_log_ratio`` [T]: with ``ratio_level``
    "sequence", the mean of ``logp - old`` over each target's trajectory at the current weights
    (detached: computed by a forward before the step; zero for "current").

    Per token: ``ppo``'s ratio is ``exp(logp - old)``, or at sequence level (GSPO)
    ``exp(logp - sg(logp) + seq_log_ratio)`` (value: the trajectory's ratio; gradient: that ratio
    times ``grad logp``); the clipped policy loss is multiplied by ``tis_weight``; the KL is
    :func:`kl_penalty` to ``ref_logprobs`` or ``old``.

    Invariant: with ``scale`` from the whole step's normalizer, the sum of ``loss`` (and of its
    gradient) over any partition of the step's targets into microbatches equals the expanded
    global-batch loss (:func:`objective_loss_reference`), and so does the sum of every term.

    ``terms`` (detached scalars, scaled like the loss, so they sum over microbatches and ranks):
    "sft_loss" (sft) or "pg_loss" and "clip_fraction" (ppo: weight of targets whose clipped
    branch is the active one), "kl" (kl_coef > 0, before ``kl_coef``), "entropy" (when given,
    before ``entropy_coef``).  Computed in float64 for float64 log-probs, float32 otherwise.
    """
    if not isinstance(config, ObjectiveConfig):
        raise ValueError(f"config must be an ObjectiveConfig, got {type(config).__name__}")
    if not isinstance(logprobs, torch.Tensor) or logprobs.dim() != 1 or not logprobs.is_floating_point():
        raise ValueError("logprobs must be a 1-D floating tensor (one log-prob per target)")
    T = logprobs.shape[0]
    if config.kind == "ppo" and config.ratio_level == "sequence" and seq_log_ratio is None:
        if config.old_logprobs != "current":
            raise ValueError("--rl-ratio-level sequence needs seq_log_ratio (each trajectory's mean logp - old)")
        seq_log_ratio = torch.zeros_like(logprobs, dtype=torch.float64).detach()
    if config.tis_cap is not None and tis_weight is None:
        raise ValueError(f"--rl-tis-cap {config.tis_cap} needs tis_weight (rollout-correction weights per target)")
    named = {"old_logprobs": old_logprobs, "advantage": advantage, "scale": scale}
    for name, v in (("entropy", entropy), ("ref_logprobs", ref_logprobs), ("tis_weight", tis_weight),
                    ("seq_log_ratio", seq_log_ratio)):
        if v is not None:
            named[name] = v
    for name, v in named.items():
        if not isinstance(v, torch.Tensor) or v.shape != (T,):
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"{name} must be a tensor of shape ({T},) like logprobs, got {shape}")
    validate_targets(config, old_logprobs, advantage, entropy, ref_logprobs)

    dt = _compute_dtype(logprobs.dtype)
    logp = logprobs.to(dt)
    c = scale.to(device=logp.device, dtype=dt)
    terms: Dict[str, torch.Tensor] = {}
    old = logp.detach() if config.old_logprobs == "current" else old_logprobs.to(device=logp.device, dtype=dt)
    if config.kind == "sft":
        per_token = -logp
        terms["sft_loss"] = (c * per_token).sum()
    else:
        adv = advantage.to(device=logp.device, dtype=dt)
        if config.ratio_level == "sequence":
            ratio = torch.exp(logp - logp.detach() + seq_log_ratio.to(device=logp.device, dtype=dt))
        else:
            ratio = torch.exp(logp - old)
        unclipped = -ratio * adv
        clipped = -torch.clamp(ratio, 1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high) * adv
        per_token = torch.maximum(unclipped, clipped)
        if tis_weight is not None and config.tis_cap is not None:
            per_token = per_token * tis_weight.to(device=logp.device, dtype=dt)
        terms["pg_loss"] = (c * per_token).sum()
        terms["clip_fraction"] = (c * (clipped > unclipped).to(dt)).sum()
    if config.kl_coef > 0:
        target = old if config.kl_to == "old" else ref_logprobs.to(device=logp.device, dtype=dt)
        kl = kl_penalty(logp, target, config.kl_estimator)
        per_token = per_token + config.kl_coef * kl
        terms["kl"] = (c * kl).sum()
    if entropy is not None:
        ent = entropy.to(device=logp.device, dtype=dt)
        if config.entropy_coef != 0:
            per_token = per_token - config.entropy_coef * ent
        terms["entropy"] = (c * ent).sum()
    loss = (c * per_token).sum()
    return loss, {k: v.detach() for k, v in terms.items()}


# ---------------------------------------------------------------------------
# expanded reference
# ---------------------------------------------------------------------------

def _padded(rows: Sequence[torch.Tensor], length: int, dtype, device) -> torch.Tensor:
    """[B, length] with row b = rows[b] followed by zeros (differentiable)."""
    out = []
    for r in rows:
        r = r.to(device=device, dtype=dtype)
        out.append(torch.cat([r, torch.zeros(length - r.shape[0], dtype=dtype, device=device)]))
    return torch.stack(out)


def _per_position(values, n: int, what: str, tid) -> torch.Tensor:
    if values is None:
        return torch.full((n,), math.nan, dtype=torch.float64)
    v = torch.as_tensor(np.asarray(values, dtype=np.float64))
    if v.shape != (n,):
        raise ValueError(f"trajectory {tid!r}: {what} has {tuple(v.shape)} entries, the trajectory {n} tokens")
    return v


def objective_loss_reference(trajectories_logprobs: Sequence[torch.Tensor], trajectories: Sequence[Trajectory],
                             config: ObjectiveConfig,
                             trajectories_entropy: Optional[Sequence[torch.Tensor]] = None, *,
                             old_logprobs: Optional[Sequence] = None, ref_logprobs: Optional[Sequence] = None,
                             rollout_logprobs: Optional[Sequence] = None,
                             ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The expanded global-batch loss, trajectory by trajectory (plain reference of
    :func:`objective_loss` summed over the step's microbatches).

    ``trajectories``: every trajectory of the step, as given (e.g. ``Forest.expand``);
    ``trajectories_logprobs[b][j]``: current log-prob of token j of trajectory b (values at
    non-target positions are ignored, NaN allowed); ``trajectories_entropy[b][j]``: entropy of
    the distribution that predicts token j (ignored likewise).  ``old_logprobs`` (per trajectory,
    per position; default: the trajectories' own, e.g. recomputed ones for "recompute"),
    ``ref_logprobs`` and ``rollout_logprobs`` likewise (default: the trajectories' own fields).  Builds
    padded [batch, length] arrays and a loss mask (``loss_mask[j] == 1``, ``j >= 1``) and aggregates
    like ``loss_agg_mode`` says, weighting each trajectory by its ``weight`` (1.0 when absent); with
    ``old_logprobs`` "current" the old log-probs are the given log-probs, detached; the
    sequence-level ratio and the sequence-level rollout weights are computed here from the whole rows.  Returns
    ``(loss, terms)`` with the keys of :func:`objective_loss`.
    """
    B = len(trajectories)
    if len(trajectories_logprobs) != B or (trajectories_entropy is not None and len(trajectories_entropy) != B):
        raise ValueError("one log-prob (and entropy) array per trajectory is needed")
    for name, arr in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs),
                      ("rollout_logprobs", rollout_logprobs)):
        if arr is not None and len(arr) != B:
            raise ValueError(f"{name}: one array per trajectory is needed")
    if B == 0:
        raise ValueError("no trajectories")
    dt = _compute_dtype(trajectories_logprobs[0].dtype)
    dev = trajectories_logprobs[0].device
    L = max(len(tr) for tr in trajectories)
    mask_rows, old_rows, adv_rows, ref_rows, roll_rows, weights = [], [], [], [], [], []
    for b, tr in enumerate(trajectories):
        n = len(tr)
        m = torch.as_tensor(tr.loss_mask == 1, dtype=torch.bool)
        m[0] = False
        mask_rows.append(m)
        old = _per_position(tr.old_logprobs if old_logprobs is None else old_logprobs[b], n, "old_logprobs", tr.id)
        ref = _per_position(getattr(tr, "ref_logprobs", None) if ref_logprobs is None else ref_logprobs[b], n,
                            "ref_logprobs", tr.id)
        roll = _per_position(getattr(tr, "rollout_logprobs", None) if rollout_logprobs is None else rollout_logprobs[b],
                             n, "rollout_logprobs", tr.id)
        if isinstance(tr.advantage, np.ndarray):
            adv = torch.as_tensor(tr.advantage, dtype=torch.float64)
        else:
            adv = torch.full((n,), math.nan if tr.advantage is None else float(tr.advantage), dtype=torch.float64)
        needs = []
        if config.kind == "ppo":
            needs.append(("advantage", adv))
            if config.old_logprobs != "current":
                needs.append(("old_logprobs", old))
            if config.tis_cap is not None:
                needs.append(("rollout_logprobs", roll))
        if config.kl_coef > 0:
            needs.append(("old_logprobs", old) if config.kl_to == "old" else ("ref_logprobs", ref))
        for field, v in needs:
            if bool(torch.isnan(v[m]).any()):
                hint = _old_logprobs_hint(config) if field == "old_logprobs" else ""
                raise ValueError(f"trajectory {tr.id!r}: the data lacks `{field}` at a target{hint}")
        zero = torch.zeros(n, dtype=torch.float64)
        old_rows.append(torch.where(m, old, zero))
        adv_rows.append(torch.where(m, adv, zero))
        ref_rows.append(torch.where(m, ref, zero))
        roll_rows.append(torch.where(m, roll, zero))
        weights.append(1.0 if tr.weight is None else float(tr.weight))
    mask = torch.stack([torch.cat([m, torch.zeros(L - m.shape[0], dtype=torch.bool)]) for m in mask_rows]).to(dev)
    # non-target positions are replaced (not multiplied) by 0, so NaN there never reaches a gradient
    logp = _padded([torch.where(m.to(dev), lp.to(dt), torch.zeros((), dtype=dt, device=dev))
                    for m, lp in zip(mask_rows, trajectories_logprobs)], L, dt, dev)
    old = logp.detach() if config.old_logprobs == "current" else _padded(old_rows, L, dt, dev)
    adv = _padded(adv_rows, L, dt, dev)
    fmask = mask.to(dt)
    weight = torch.tensor(weights, dtype=dt, device=dev)
    tokens = fmask.sum(dim=1)
    has = tokens > 0

    def aggregate(values: torch.Tensor) -> torch.Tensor:
        if config.loss_agg_mode == "token-mean":
            return (weight[:, None] * values * fmask).sum() / fmask.sum()
        per_seq = (values * fmask).sum(dim=1)
        if config.loss_agg_mode == "seq-mean-token-mean":
            per_seq = torch.where(has, per_seq / torch.where(has, tokens, torch.ones_like(tokens)),
                                  torch.zeros_like(per_seq))
        out = (weight * per_seq)[has].sum() / has.sum()
        if config.loss_agg_mode == "seq-mean-token-sum-norm":
            out = out / float(config.loss_norm_length)
        return out

    terms: Dict[str, torch.Tensor] = {}
    if config.kind == "sft":
        loss_tok = -logp
        terms["sft_loss"] = aggregate(loss_tok)
    else:
        if config.ratio_level == "sequence":
            # GSPO: each row's mean log-ratio over its targets, its value detached, the gradient per token
            seq = ((logp - old).detach() * fmask).sum(dim=1) / tokens.clamp_min(1.0)
            ratio = torch.exp(logp - logp.detach() + seq[:, None])
        else:
            ratio = torch.exp(logp - old)
        lo, hi = 1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high
        bounded = torch.where(ratio < lo, torch.full_like(ratio, lo), torch.where(ratio > hi, torch.full_like(ratio, hi),
                                                                                  ratio))
        loss_tok = -torch.minimum(ratio * adv, bounded * adv)
        if config.tis_cap is not None:
            d = (old.detach() - _padded(roll_rows, L, dt, dev)) * fmask
            if config.tis_level == "sequence":
                d = d.sum(dim=1, keepdim=True).expand_as(d)
            r = torch.exp(d)
            w = torch.minimum(r, torch.full_like(r, config.tis_cap)) if config.tis_mode == "truncate" else \
                torch.where(r > config.tis_cap, torch.zeros_like(r), r)
            loss_tok = loss_tok * w
        terms["pg_loss"] = aggregate(loss_tok)
        terms["clip_fraction"] = aggregate((bounded * adv < ratio * adv).to(dt))
    if config.kl_coef > 0:
        target = old if config.kl_to == "old" else _padded(ref_rows, L, dt, dev)
        d = logp - target
        kl = {"k1": d, "k2": 0.5 * d * d, "k3": torch.exp(-d) + d - 1.0}[config.kl_estimator]
        loss_tok = loss_tok + config.kl_coef * kl
        terms["kl"] = aggregate(kl)
    if trajectories_entropy is not None:
        ent = _padded([torch.where(m.to(dev), e.to(dt), torch.zeros((), dtype=dt, device=dev))
                       for m, e in zip(mask_rows, trajectories_entropy)], L, dt, dev)
        loss_tok = loss_tok - config.entropy_coef * ent
        terms["entropy"] = aggregate(ent)
    elif config.entropy_coef != 0:
        raise ValueError(f"--entropy-coef {config.entropy_coef} needs per-position entropies")
    return aggregate(loss_tok), {k: v.detach() for k, v in terms.items()}
