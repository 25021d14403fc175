"""A verl training engine backed by megatron_harts: verl's PPO/GRPO workers train on prefix trees.

verl (https://github.com/volcengine/verl) selects a training backend by name through its
``EngineRegistry``; this module registers ``MegatronHartsEngine`` as ``backend="megatron_harts"`` for
``model_type="language_model"`` (CPU and CUDA).  A recipe switches to it by naming the strategy and
passing this package's flags (docs/verl.md).

What ``forward_backward_batch`` does with one verl batch (jagged ``input_ids``, ``loss_mask``,
optional ``uid``):

1. Every sample becomes a trajectory (its group: its ``uid``), all positions scored; the samples'
   shared prefixes merge into a forest (``tree_data.build_forest``) and the trainer's planner cuts it
   into microbatches (tree modes share prefixes; ``--tree-sharing off`` runs the same trajectories
   one by one: the expanded reference).
2. A forward-only pass of that plan gives every sample's log-probs (and entropies when verl asks,
   ``calculate_entropy``) over its full sequence, in verl's convention: ``log_probs[i][t] = log
   p(input_ids[i][t+1] | input_ids[i][:t+1])``, 0 at the last position (no next token).
3. Inference returns them (restored to the batch order); training applies verl's loss function to
   them, micro-batch by micro-batch exactly as verl's own engines cut the batch (``prepare_micro_batches``:
   same micro-batches, same ``batch_num_tokens`` over the data-parallel group, same ``dp_size``), so
   its loss modes, KL terms and rollout corrections run unchanged.  Autograd gives d loss / d log-prob
   (and d loss / d entropy) per token; a second pass of the same plan, with gradients, backpropagates
   ``sum(coefficient * log-prob)`` through the tree: the chain rule, so the parameter gradients equal
   those of verl's per-sample computation with the same loss function.

The trainer's own RL objective is not used (verl's is the loss); the MoE auxiliary load-balancing
loss is added as in a trainer step when ``--moe-aux-loss-coeff`` is set.  Data parallelism: every
rank plans its own samples (a one-replica plan).  verl's losses are scaled by ``dp_size`` for a
data-parallel reduce that averages; the trainer's DDP sums over ranks (per-token loss scaling), so
the engine backpropagates verl's loss divided by ``dp_size``: the reduced gradients are verl's, and
equal those of one process on the whole batch.  The MoE auxiliary loss is weighed by the tokens
routed on all ranks, as in a trainer step.  Tensor, pipeline, expert and context parallelism, parameter or
optimizer offload, LoRA and everything else verl could ask that this engine cannot honour is refused
by ``initialize`` with one line naming it (:class:`VerlEngineError`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Generator, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl.utils import tensordict_utils as tu
from verl.workers.config import ActorConfig, EngineConfig, OptimizerConfig
from verl.workers.engine.base import BaseEngine, BaseEngineCtx, EngineRegistry
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

BACKEND = "megatron_harts"
TESTED_VERL = "0.9.1"
SHARING = ("off", "within", "windows")


class VerlEngineError(ValueError):
    """A verl setting this engine cannot honour (one line naming it)."""


@dataclass
class MegatronHartsEngineConfig(EngineConfig):
    """verl engine config of the megatron_harts backend (``actor.strategy: megatron_harts``).

    ``load_weights``: the initial weights (a transformers Kimi-Linear directory, e.g. the recipe's
    ``actor_rollout_ref.model.path``, or a driver checkpoint); the model flags must describe that model.
    ``harts_args``: the trainer's model and run flags (the ``pretrain_tree.py`` flags: model shape,
    ``--fp64``/``--bf16``, ``--seed``, ``--load``, ...), without the optimizer flags, which come from
    verl's optimizer config.  ``tree_sharing``/``tree_microbatch_tokens``/``tree_planner``: how a batch
    is cut (``off`` is expanded training, the reference).
    """
    strategy: str = BACKEND
    harts_args: List[str] = field(default_factory=list)
    tree_sharing: str = "within"
    tree_microbatch_tokens: int = 8192
    tree_planner: Optional[str] = None     # None: ffd (off), l1 (within), l1l2 (windows)
    # initial weights: a transformers Kimi-Linear directory (the rollout model's path) or a driver checkpoint
    load_weights: Optional[str] = None
    dtype: str = "float32"
    use_dynamic_bsz: bool = False
    micro_batch_size_per_gpu: int = 1
    infer_micro_batch_size_per_gpu: int = 1

    def __post_init__(self):
        super().__post_init__()
        if self.strategy != BACKEND:
            raise VerlEngineError(f"engine strategy {self.strategy!r}: this config is the {BACKEND!r} backend's")
        if self.tree_sharing not in SHARING:
            raise VerlEngineError(f"engine tree_sharing {self.tree_sharing!r}: one of {SHARING}")


@dataclass
class MegatronHartsOptimizerConfig(OptimizerConfig):
    """verl optimizer config read by this engine: ``lr``, ``weight_decay``, ``betas``, ``clip_grad`` and
    ``total_training_steps`` map to the trainer's Adam(W) flags; a constant learning rate (no warmup)."""


@dataclass
class MegatronHartsActorConfig(ActorConfig):
    """verl actor config with this backend's strategy (verl's Megatron and FSDP actor configs insist on
    their own); the loss settings (``loss_agg_mode``, ``policy_loss``, ``use_kl_loss``, ...) are verl's."""
    strategy: str = BACKEND
    rollout_n: int = 1
    ppo_micro_batch_size_per_gpu: Optional[int] = 1


# the flags this engine sets itself (from verl's configs and its own fields), or that it does not support
_OWN_FLAGS = ("--lr", "--weight-decay", "--adam-beta1", "--adam-beta2", "--clip-grad", "--train-iters",
              "--lr-decay-style", "--tree-sharing", "--tree-microbatch-tokens", "--tree-planner", "--micro-batch-size",
              "--global-batch-size", "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
              "--expert-model-parallel-size", "--context-parallel-size")


def _refusals(engine_config, optimizer_config, model_config) -> List[str]:
    """Every verl setting this engine cannot honour (empty: all honoured)."""
    out = []
    e = engine_config
    if not isinstance(e, MegatronHartsEngineConfig):
        out.append(f"engine config {type(e).__name__}: use {MegatronHartsEngineConfig.__name__} "
                   f"(strategy {BACKEND!r})")
        return out
    for name in ("param_offload", "optimizer_offload"):
        if getattr(e, name, False):
            out.append(f"engine {name}: offload is not supported by the {BACKEND} engine")
    if e.use_dynamic_bsz:
        out.append("engine use_dynamic_bsz: token-budget micro-batches are not supported; set "
                   "micro_batch_size_per_gpu (the tree planner cuts each micro-batch itself)")
    if getattr(e, "use_fused_kernels", False):
        out.append("engine use_fused_kernels: verl's fused kernels patch transformers models, not this engine")
    for flag in e.harts_args:
        if flag.split("=")[0] in _OWN_FLAGS:
            out.append(f"engine harts_args {flag}: set by the engine (from verl's configs, or not supported)")
    if optimizer_config is not None:
        o = optimizer_config
        if getattr(o, "optimizer", "adamw") not in ("adamw", "AdamW"):
            out.append(f"optim optimizer {o.optimizer!r}: only adamw")
        if (getattr(o, "lr_warmup_steps", -1) or -1) > 0 or (getattr(o, "lr_warmup_steps_ratio", 0.0) or 0.0) > 0:
            out.append("optim lr_warmup_steps / lr_warmup_steps_ratio: warmup is not supported (constant lr)")
        style = getattr(o, "lr_scheduler_type", "constant")
        if style not in (None, "constant"):
            out.append(f"optim lr_scheduler_type {style!r}: only constant")
        min_lr = getattr(o, "min_lr_ratio", None)
        if min_lr not in (None, 0.0, 1.0):
            out.append(f"optim min_lr_ratio {min_lr}: constant lr only")
    if model_config is not None:
        lora = getattr(model_config, "lora_rank", 0) or 0
        if lora > 0:
            out.append(f"model lora_rank {lora}: LoRA is not supported by the {BACKEND} engine")
    return out


def _optimizer_flags(o) -> List[str]:
    if o is None:
        return ["--lr", "0.0", "--train-iters", "1000000000"]
    beta1, beta2 = (tuple(o.betas) + (0.9, 0.999))[:2] if o.betas is not None else (0.9, 0.999)
    steps = int(o.total_training_steps) if o.total_training_steps and o.total_training_steps > 0 else 1000000000
    return ["--lr", repr(float(o.lr)), "--weight-decay", repr(float(o.weight_decay)), "--adam-beta1", repr(float(beta1)),
            "--adam-beta2", repr(float(beta2)), "--clip-grad", repr(float(o.clip_grad or 0.0)),
            "--train-iters", str(steps)]


@EngineRegistry.register(model_type="language_model", backend=BACKEND, device=["cpu", "cuda"])
class MegatronHartsEngine(BaseEngine):
    """verl ``BaseEngine`` over the megatron_harts tree trainer (module docstring)."""

    def __init__(self, model_config=None, engine_config=None, optimizer_config=None, checkpoint_config=None,
                 **kwargs):
        super().__init__()
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config
        self.trainer = None
        self.mode = None
        self.last_batch_tokens: Optional[dict] = None
        self._forward_only = bool(getattr(engine_config, "forward_only", False))

    # ---- setup ------------------------------------------------------------------------------------
    def initialize(self):
        """Build the trainer (model, optimizer, scheduler) from the configs; refuse what cannot be honoured."""
        refused = _refusals(self.engine_config, self.optimizer_config, self.model_config)
        if refused:
            raise VerlEngineError(f"error: {BACKEND} engine: {refused[0]}")
        if self.trainer is not None:
            self.trainer.close()
            self.trainer = None
        from ..training.arguments import ArgumentsError
        from ..training.trainer import Trainer, TrainingError
        e = self.engine_config
        planner = e.tree_planner or {"off": "ffd", "within": "l1", "windows": "l1l2"}[e.tree_sharing]
        argv = list(e.harts_args) + _optimizer_flags(self.optimizer_config) + [
            "--lr-decay-style", "constant", "--global-batch-size", "1",
            "--tree-sharing", e.tree_sharing, "--tree-microbatch-tokens", str(int(e.tree_microbatch_tokens)),
            "--tree-planner", planner]
        try:
            self.trainer = Trainer.from_args(argv)
        except (ArgumentsError, TrainingError) as err:
            raise VerlEngineError(f"error: {BACKEND} engine: {err}") from None
        except SystemExit as err:      # an unknown flag: the parser printed its error line
            raise VerlEngineError(f"error: {BACKEND} engine: harts_args rejected (exit {err.code})") from None
        if e.load_weights:
            try:
                self.trainer.load_weights(e.load_weights)
            except TrainingError as err:
                self.trainer.close()
                self.trainer = None
                raise VerlEngineError(f"error: {BACKEND} engine: {err}") from None
        from megatron.core import parallel_state as ps
        sizes = {"tensor": ps.get_tensor_model_parallel_world_size(),
                 "pipeline": ps.get_pipeline_model_parallel_world_size(),
                 "expert": ps.get_expert_model_parallel_world_size(),
                 "context": ps.get_context_parallel_world_size()}
        for kind, size in sizes.items():
            if size > 1:
                self.trainer.close()
                self.trainer = None
                raise VerlEngineError(f"error: {BACKEND} engine: {kind} parallel size {size}: only data "
                                      "parallelism is supported")

    @property
    def model(self):
        return self.trainer.model[0]

    @property
    def is_param_offload_enabled(self) -> bool:
        return False

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return False

    def train_mode(self, **kwargs):
        return _Ctx(self, "train", **kwargs)

    def eval_mode(self, **kwargs):
        return _Ctx(self, "eval", **kwargs)

    # ---- optimizer ----------------------------------------------------------------------------------
    def optimizer_zero_grad(self):
        for chunk in self.trainer.model:
            chunk.zero_grad_buffer()
        self.trainer.optimizer.zero_grad()

    def optimizer_step(self):
        """Reduce the gradients over the data-parallel group, clip, step; returns the gradient norm
        (before clipping; None when the step was skipped for a non-finite gradient)."""
        from megatron.core.distributed import finalize_model_grads
        finalize_model_grads(self.trainer.model)
        ok, grad_norm, _ = self.trainer.optimizer.step()
        self.trainer.iteration += 1
        return None if grad_norm is None else float(grad_norm)

    def lr_scheduler_step(self):
        self.trainer.scheduler.step(increment=1)
        return float(self.trainer.optimizer.param_groups[0]["lr"])

    # ---- parallelism --------------------------------------------------------------------------------
    # before initialize (verl asks for the rank when it builds the worker) the data-parallel group is
    # the whole world: this engine runs data parallelism only
    def get_data_parallel_size(self):
        if self.trainer is None:
            return dist.get_world_size()
        from megatron.core import parallel_state as ps
        return ps.get_data_parallel_world_size()

    def get_data_parallel_rank(self):
        if self.trainer is None:
            return dist.get_rank()
        from megatron.core import parallel_state as ps
        return ps.get_data_parallel_rank()

    def get_data_parallel_group(self):
        if self.trainer is None:
            return dist.group.WORLD
        from megatron.core import parallel_state as ps
        return ps.get_data_parallel_group()

    def is_mp_src_rank_with_outputs(self):
        return True

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        super().to(device, model=model, optimizer=optimizer, grad=grad)
        here = self.trainer.device.type
        # verl's mode contexts call to("cpu", model=False, optimizer=False, grad=False) on exit: nothing moves
        if (model or optimizer or grad) and torch.device(device).type != here:
            raise VerlEngineError(f"error: {BACKEND} engine: to({device!r}): the model lives on {here} "
                                  "(offload is not supported)")

    # ---- weights and checkpoints ----------------------------------------------------------------------
    def get_per_tensor_param(self, **kwargs) -> Tuple[Generator[Tuple[str, torch.Tensor], None, None], Optional[dict]]:
        """The weights under transformers' Kimi-Linear names (``models.hf_convert``), one tensor at a
        time, for verl's weight sync to the rollout engine; no adapter config."""
        from ..models.hf_convert import megatron_to_hf
        from ..training.export import full_state_dict
        hf = megatron_to_hf(full_state_dict(self.model.module, self.trainer.config), self.trainer.config)

        def gen():
            for name in sorted(hf):
                yield name, hf[name]
        return gen(), None

    def save_checkpoint(self, local_path: str, hdfs_path: Optional[str] = None, global_step: int = 0,
                        max_ckpt_to_keep: Optional[int] = None, **kwargs) -> None:
        from ..training.checkpointing import save_checkpoint
        if hdfs_path is not None:
            raise VerlEngineError(f"error: {BACKEND} engine: save_checkpoint hdfs_path: not supported")
        t = self.trainer
        save_checkpoint(local_path, int(global_step), t.model, t.optimizer, t.scheduler,
                        extra_state={"iteration": int(global_step)}, save_optim=True, save_rng=True)

    def load_checkpoint(self, local_path: str, hdfs_path: Optional[str] = None, del_local_after_load: bool = True,
                        **kwargs) -> None:
        from ..training.checkpointing import load_checkpoint
        if hdfs_path is not None:
            raise VerlEngineError(f"error: {BACKEND} engine: load_checkpoint hdfs_path: not supported")
        t = self.trainer
        got = load_checkpoint(local_path, t.model, t.optimizer, t.scheduler, load_optim=True, load_rng=True,
                              finetune=False, step=None)
        if got is None:
            raise VerlEngineError(f"error: {BACKEND} engine: load_checkpoint {local_path}: no checkpoint there")
        t.iteration = int(got[0])

    # ---- the step ------------------------------------------------------------------------------------
    def forward_backward_batch(self, data: TensorDict, loss_function: Callable, forward_only=False) -> Any:
        if not forward_only and self._forward_only:
            raise VerlEngineError(f"error: {BACKEND} engine: a training pass on a forward_only engine")
        pad_mode = tu.get_non_tensor_data(data=data, key="pad_mode", default=None)
        if pad_mode is not None and str(getattr(pad_mode, "value", pad_mode)) != "no_padding":
            raise VerlEngineError(f"error: {BACKEND} engine: pad_mode {pad_mode}: only no_padding (jagged) batches")
        if not data["input_ids"].is_nested:
            raise VerlEngineError(f"error: {BACKEND} engine: input_ids must be jagged (remove-padding format)")
        temperature = tu.get_non_tensor_data(data=data, key="temperature", default=None)
        if temperature is not None and bool(torch.as_tensor(temperature, dtype=torch.float64).ne(1.0).any()):
            raise VerlEngineError(f"error: {BACKEND} engine: temperature {temperature}: log-probs are computed at "
                                  "temperature 1 only")
        tokens = data["input_ids"].values()
        vocab = int(self.trainer.vocab_size)
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
            bad = int(tokens.max()) if int(tokens.max()) >= vocab else int(tokens.min())
            raise VerlEngineError(f"error: {BACKEND} engine: input_ids: token {bad} is outside the model's "
                                  f"vocabulary (size {vocab})")
        group = self.get_data_parallel_group()
        # verl's normalisation: loss-mask tokens over the data-parallel group, and the group's size
        batch_num_tokens = data["loss_mask"].sum().to(self.trainer.device)
        dist.all_reduce(batch_num_tokens, op=dist.ReduceOp.SUM, group=group)
        tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item())
        tu.assign_non_tensor(data, dp_size=self.get_data_parallel_size())
        micro_batches, indices = prepare_micro_batches(data=data, dp_group=group, same_micro_num_in_dp=True)
        entropy = bool(tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False))

        seqs = [mb["input_ids"] for mb in micro_batches]
        uids = [_uids(mb) for mb in micro_batches]
        step = _TreeStep(self.trainer, [s for nt in seqs for s in nt.unbind()], [u for us in uids for u in us])
        lp, ent = step.logprobs(entropy)
        # what the log-prob pass computed against the batch's tokens (tree sharing: fewer)
        self.last_batch_tokens = {"computed": step.computed_tokens, "trajectory": step.trajectory_tokens}

        outputs, coef_lp, coef_ent = [], [], []
        first = 0
        for mb in micro_batches:
            n = len(mb)
            dev = mb["loss_mask"].device          # the loss runs where verl's batch lives
            mlp = [torch.from_numpy(x).to(dev) for x in lp[first:first + n]]
            ment = [torch.from_numpy(x).to(dev) for x in ent[first:first + n]] if entropy else None
            first += n
            if forward_only:
                model_output = {"log_probs": _nested(mlp)}
                if entropy:
                    model_output["entropy"] = _nested(ment)
                if loss_function is not None:
                    loss, metrics = loss_function(model_output=model_output, data=mb, dp_group=group)
                    loss = float(loss)
                else:
                    loss, metrics = 1.0, {}
                outputs.append({"model_output": model_output, "loss": loss, "metrics": metrics})
                continue
            leaves = [x.clone().requires_grad_(True) for x in mlp]
            ent_leaves = [x.clone().requires_grad_(True) for x in ment] if entropy else None
            model_output = {"log_probs": _nested(leaves)}
            if entropy:
                model_output["entropy"] = _nested(ent_leaves)
            loss, metrics = loss_function(model_output=model_output, data=mb, dp_group=group)
            loss.backward()
            coef_lp += [_grad(x) for x in leaves]
            coef_ent += [_grad(x) for x in ent_leaves] if entropy else []
            outputs.append({"loss": float(loss.detach()), "metrics": _detach(metrics)})
        if not forward_only:
            # verl scales its loss by dp_size for an averaging reduce; the trainer's DDP sums over ranks
            step.backward(coef_lp, coef_ent if entropy else None, scale=1.0 / self.get_data_parallel_size(),
                          group=group)
        return postprocess_batch_func(output_lst=outputs, indices=indices, data=data)


class _Ctx(BaseEngineCtx):
    """verl's mode context; also sets the model's train/eval mode."""
    def __enter__(self):
        super().__enter__()
        self.engine.model.train(self.mode == "train")


def _uids(mb: TensorDict) -> List[Any]:
    """Each sample's group (its ``uid``: samples of one prompt), or None."""
    n = len(mb)
    if "uid" not in mb.keys():
        return [None] * n
    u = mb["uid"]
    values = u.tolist() if hasattr(u, "tolist") else list(u)
    return [None if v is None else str(v) for v in values]


def _nested(parts: List[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(parts, layout=torch.jagged)


def _grad(x: torch.Tensor) -> np.ndarray:
    return np.zeros(x.shape[0]) if x.grad is None else x.grad.detach().double().cpu().numpy()


def _detach(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, dict):
        return {k: _detach(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detach(v) for v in obj)
    if hasattr(obj, "value") and isinstance(getattr(obj, "value"), torch.Tensor):
        obj.value = obj.value.detach()
    return obj


class _TreeStep:
    """One verl batch as a planned forest of the trainer: forward-only log-probs, then a backward of
    given per-token coefficients (module docstring)."""

    def __init__(self, trainer, sequences: List[torch.Tensor], groups: List[Any]):
        from ..tree_data import build_forest, make_trajectory
        from ..training.step import plan_step, step_forest
        self.trainer = trainer
        records = []
        for i, (seq, g) in enumerate(zip(sequences, groups)):
            tokens = seq.detach().cpu().to(torch.int64).tolist()
            mask = [0] + [1] * (len(tokens) - 1)
            rec = {"id": f"s{i}", "tokens": tokens, "loss_mask": mask}
            if g is not None:
                rec["group"] = g
            records.append(rec)
        self.lengths = [len(r["tokens"]) for r in records]
        self.forest = build_forest([make_trajectory(r, line=i + 1) for i, r in enumerate(records)])
        self.plan = plan_step(self.forest, trainer.settings, 1)      # this rank's samples: a one-replica plan
        sf = step_forest(self.forest, self.plan)
        order = {tid: t for t, tid in enumerate(sf.traj_ids)}
        self.step_index = np.array([order[f"s{i}"] for i in range(len(records))], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(np.asarray(sf.traj_length, dtype=np.int64))]).astype(np.int64)

    def _items(self):
        from ..training.step import replica_microbatches
        return replica_microbatches(self.forest, self.plan, 0, self.trainer.settings)

    def _targets(self, mb):
        host = mb.layout.host_copy if mb.layout.host_copy is not None else mb.layout
        traj = np.asarray(host.traj_forest, dtype=np.int64)[host.target_traj.cpu().numpy()]
        flat = self.offsets[traj] + host.target_position.cpu().numpy().astype(np.int64)
        keep = np.ones(flat.shape[0], dtype=bool) if mb.owned is None else mb.owned.cpu().numpy().astype(bool)
        return host, flat, keep

    def _per_sample(self, flat: np.ndarray) -> List[np.ndarray]:
        """verl's convention per sample: ``out[t]`` = value at position t+1, 0 at the last position."""
        out = []
        for i, L in enumerate(self.lengths):
            lo = self.offsets[self.step_index[i]]
            v = np.zeros(L, dtype=np.float64)
            v[:L - 1] = flat[lo + 1:lo + L]
            out.append(v)
        return out

    def _flat(self, per_sample: List[np.ndarray]) -> np.ndarray:
        flat = np.zeros(int(self.offsets[-1]), dtype=np.float64)
        for i, L in enumerate(self.lengths):
            lo = self.offsets[self.step_index[i]]
            flat[lo + 1:lo + L] = per_sample[i][:L - 1]
        return flat

    def logprobs(self, entropy: bool) -> Tuple[List[np.ndarray], Optional[List[np.ndarray]]]:
        from ..training.step import _unwrap, run_schedule
        total = int(self.offsets[-1])
        acc = np.zeros((3, total), dtype=np.float64)
        rows = [0]
        chunk = self.trainer.model[0]

        def forward_step(data_iterator, model):
            mb, psp = next(data_iterator)
            batch = mb.layout
            if getattr(psp, "preview", False):   # an exports-only forward, computed again later: no log-probs
                return model(batch.tokens[None], batch.position_ids[None], packed_seq_params=psp,
                             return_hidden=True), None
            host, flat, keep = self._targets(mb)
            out = model(batch.tokens[None], batch.position_ids[None], packed_seq_params=psp,
                        pair_row=host.pair_row, pair_token=host.pair_token, return_entropy=entropy)
            lp_pairs, ent_rows = out if entropy else (out, None)
            lp = lp_pairs.index_select(0, batch.target_pair)
            rows[0] += int(batch.num_rows)
            np.add.at(acc[0], flat[keep], lp.detach().double().cpu().numpy()[keep])
            np.add.at(acc[1], flat[keep], 1.0)
            if entropy:
                e = ent_rows.index_select(0, batch.target_row).detach().double().cpu().numpy()
                np.add.at(acc[2], flat[keep], e[keep])
            return lp, lambda output: (output.sum() * 0.0, {})

        if not _unwrap(chunk).post_process:
            raise RuntimeError("verl engine: the model has no output layer on this rank")
        with torch.no_grad():
            run_schedule(chunk, self._items(), forward_step, self.trainer.settings, forward_only=True)
        if bool((acc[1] > 1).any()):
            raise RuntimeError("verl engine: a target was computed by more than one microbatch")
        for i, L in enumerate(self.lengths):
            lo = self.offsets[self.step_index[i]]
            if not bool((acc[1, lo + 1:lo + L] == 1).all()):
                raise RuntimeError(f"verl engine: sample {i}: a position has no log-prob")
        self.computed_tokens, self.trajectory_tokens = rows[0], int(sum(self.lengths))
        lps = self._per_sample(acc[0])
        return lps, (self._per_sample(acc[2]) if entropy else None)

    def backward(self, coef_lp: List[np.ndarray], coef_ent: Optional[List[np.ndarray]], scale: float = 1.0,
                 group=None) -> None:
        """Gradients of ``scale * (sum(coef_lp * log_probs) + sum(coef_ent * entropy))`` into the model's grad
        buffers (the MoE aux loss weighed by the tokens routed over ``group``, the data-parallel ranks)."""
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        from ..training.step import megatron_aux_loss_scale_after, run_schedule
        from ..layout import host_to_device
        from ..models.experts import expert_grad_hooks_off
        clp = self._flat(coef_lp) * scale
        cent = self._flat(coef_ent) * scale if coef_ent is not None else None
        if cent is not None and not cent.any():       # the loss does not read the entropies
            cent = None
        need_entropy = cent is not None
        device = self.trainer.device
        routed = torch.tensor(int(self.plan.expanded_tokens), dtype=torch.int64, device=device)
        if group is not None and dist.get_world_size(group) > 1:      # every rank's routed tokens
            dist.all_reduce(routed, op=dist.ReduceOp.SUM, group=group)
        aux_scale = 1.0 / max(int(routed), 1)

        def forward_step(data_iterator, model):
            mb, psp = next(data_iterator)
            batch = mb.layout
            dev = batch.tokens.device
            MoEAuxLossAutoScaler.set_loss_scale(host_to_device(torch.tensor(aux_scale, dtype=torch.float32), dev))
            host, flat, keep = self._targets(mb)
            out = model(batch.tokens[None], batch.position_ids[None], packed_seq_params=psp,
                        pair_row=host.pair_row, pair_token=host.pair_token, return_entropy=need_entropy)
            lp_pairs, ent_rows = out if need_entropy else (out, None)
            lp = lp_pairs.index_select(0, batch.target_pair)
            w = np.where(keep, clp[flat], 0.0)
            wt = host_to_device(torch.from_numpy(w), dev)
            we = None
            if need_entropy:
                ent = ent_rows.index_select(0, batch.target_row)
                we = host_to_device(torch.from_numpy(np.where(keep, cent[flat], 0.0)), dev)

            def loss_func(lp):
                loss = (lp * wt.to(lp.dtype)).sum()
                if we is not None:
                    loss = loss + (ent * we.to(ent.dtype)).sum()
                return loss, {}
            return lp, loss_func

        ddp = self.trainer.model[0]
        with ddp.no_sync(), expert_grad_hooks_off(ddp), megatron_aux_loss_scale_after(device):
            run_schedule(ddp, self._items(), forward_step, self.trainer.settings)


def registered() -> type:
    """The engine class verl's registry returns for this backend (the plugin entry point's target)."""
    return EngineRegistry.get_engine_cls("language_model", BACKEND)
