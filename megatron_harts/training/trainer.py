"""The trainer: everything one training run holds, built once from the parsed arguments.

``Trainer(args)`` (``args`` from ``training.arguments.parse_args``) sets up, in this order:

1. the process world and megatron's parallel state (torchrun's environment, or a world of
   one; NCCL on GPU, gloo on CPU, where megatron-core runs through
   ``testing.cpu_runtime.megatron_cpu_runtime``) and ``megatron_harts.patches``;
2. the hybrid model (``build_hybrid_model``), megatron-core's DDP, optimizer and
   ``OptimizerParamScheduler``;
3. the checkpoint to resume from (``--load``), which also restores the data position.

Then ``train()`` runs the loop of ``pretrain_tree_gpt.py`` (a loader of planned global batches,
``training.step.train_step`` per iteration, logging, checkpoints, exit conditions), and
``step(trajectories)`` runs one RL update on in-memory trajectories for RL loops that own their data
(recompute, reference, rollout correction, mini-batches and epochs: ``training.rl_update``), and
``logprobs(trajectories)`` returns the log-prob of every token, forward only.
``export_hf(path)`` writes the weights in transformers' Kimi-Linear format for rollout engines.

Invariants:

- Every rank of the world makes the same decisions (same plans, same iteration count, same
  exit step): exit conditions are agreed through one all-reduce per iteration.
- A non-finite loss stops the run before the weights change, names the iteration, and never
  saves; the last good checkpoint stays the latest (``latest_checkpointed_iteration.txt``).
- ``--exit-signal-handler``: SIGTERM (``--exit-signal``), delivered to the launcher, to every rank
  or to one rank, makes every rank finish the current iteration, save a checkpoint and stop with
  exit code 0; rank 0 prints one line naming the checkpoint (docs/faults.md).
- ``--load`` resumes from the checkpoint the tracker names (``--ckpt-step N``: that of iteration
  N) and says which; a run that loaded from its own ``--save`` directory does not save the loaded
  iteration again.
- ``close()`` releases the model, its gradient buffers and the optimizer state (once the caller's
  own references are gone, also when it keeps the closed ``Trainer``): a process may train several
  runs one after another (benchmarks/bench_throughput.py) without keeping closed runs' memory.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from typing import Any, Dict, Optional, Sequence

import torch
import torch.distributed as dist

from ..flags import shared_fields
from .fused_adam import use_fused_adam
from ..rl.objectives import ObjectiveDataError
from .rl_update import RLDataError
from .step import PIECE_STATS, NonFiniteLoss, SharingSettings, StepResult, plan_step

__all__ = ["Trainer", "TrainingError", "memory_budgets"]


class TrainingError(RuntimeError):
    """A run that cannot go on (non-finite loss, bad data at run time); the message says where."""


def _device_and_backend(args):
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))), args.distributed_backend
    if args.distributed_backend != "gloo":
        raise TrainingError(f"--distributed-backend {args.distributed_backend}: no CUDA device here; use "
                            "--distributed-backend gloo to train on the CPU")
    return torch.device("cpu"), "gloo"


def _init_world(backend: str, timeout_minutes: int) -> bool:
    """Join torchrun's world (or make a world of one); returns whether this call created it."""
    if dist.is_initialized():
        return False
    from datetime import timedelta
    if "RANK" not in os.environ or ("MASTER_ADDR" not in os.environ and os.environ.get("WORLD_SIZE", "1") == "1"):
        # no launcher: a world of one over an in-process store, no port to race for (and nothing
        # written into the host process's environment)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(minutes=timeout_minutes))
        return True
    dist.init_process_group(backend, timeout=timedelta(minutes=timeout_minutes))
    return True


def _alloc_retries(device) -> int:
    """The CUDA caching allocator's retries so far: each an allocation that found no free block, so the
    allocator released its cache (a device synchronization and ``cudaFree`` calls) and asked again."""
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def _drop_autograd_graphs(modules) -> None:
    """Detach the tensors that carry an autograd graph which ``modules``, or plain objects they hold,
    keep from their last forward (megatron's token dispatchers keep the last microbatch's routing
    probabilities: ``local_probs``, ``probs``).

    Such a graph holds the AccumulateGrad nodes of the parameters it reaches, and each of those
    holds (from C++, unseen by the garbage collector) DDP's gradient hook, a closure over the DDP
    module: the model, its gradient buffers and everything referring to them would stay alive
    after the run's last reference is gone.
    """
    for module in modules:
        owners = [module] + [v for v in vars(module).values()
                             if hasattr(v, "__dict__") and not isinstance(v, (torch.nn.Module, torch.Tensor, type))]
        for owner in owners:
            for name, value in list(vars(owner).items()):
                if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                    setattr(owner, name, value.detach())


class _ExitSignal:
    """Records ``--exit-signal`` (SIGTERM by default) under ``--exit-signal-handler``; the previous
    handler is restored on ``close``."""

    def __init__(self, sig=signal.SIGTERM):
        self.received = False
        self._saved = {sig: signal.signal(sig, self._handle)}

    def _handle(self, signum, frame):
        self.received = True

    def close(self):
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved = {}


def memory_budgets(args, shape, state_bytes: float, *, device_bytes: Optional[int] = None):
    """(default step budget, step budget, pieces' budget) in bytes of a run with flags ``args``, model shape
    ``shape`` (``planner.memory.ModelShape``) and ``state_bytes`` of parameter state on this rank.  The default
    step budget is what expanded training keeps for its largest microbatch (``--tree-microbatch-tokens``
    rows x saved bytes per row); the step budget, ``--tree-memory-budget`` GiB or that default, applies to
    ``--tree-sharing windows`` on pipeline size 1 without ``--tree-recompute-producers`` (elsewhere None:
    no per-window choice); the pieces' budget (``--tree-piece-keep auto``, else None) is
    ``--tree-piece-memory`` GiB, by default ``planner.memory.device_activation_budget`` of ``device_bytes``
    (a GPU's memory) and the state, without a GPU the default step budget.  One place for the rule: the
    trainer and sizing tools (``bench_compaction.py --plan-only``) call it."""
    from ..planner.memory import GIB, default_budget_bytes, device_activation_budget
    tree = args.tree
    default = default_budget_bytes(shape, tree.microbatch_tokens)
    step = None
    if tree.sharing == "windows" and args.pipeline_model_parallel_size == 1 and not tree.recompute_producers:
        step = max(1, int(tree.memory_budget_gib * GIB)) if tree.memory_budget_gib is not None else default
    if tree.piece_keep != "auto":
        piece = None
    elif tree.piece_memory_gib is not None:
        piece = max(1, int(tree.piece_memory_gib * GIB))
    elif device_bytes is not None:
        piece = device_activation_budget(int(device_bytes), state_bytes)
    else:
        piece = default
    return default, step, piece


class Trainer:
    """One training run (module docstring).  Use as a context manager, or call ``close()``."""

    def __init__(self, args):
        from .. import patches
        from ..models.model import build_hybrid_model
        from .arguments import (cost_model, data_parallel_size, ddp_config, hybrid_config, optimizer_config,
                                padded_vocab_size, scheduler_kwargs)

        self.args = args
        self._stack = contextlib.ExitStack()
        self.iteration = 0
        self.loader = None
        self.last_saved: Optional[int] = None
        self._tb = None
        self._signal = None
        self._probe_batch = None
        self._probed_at: Optional[int] = None
        self._run_peak = 0.0
        self._retries_at_start = 0
        self.model = self.optimizer = self.scheduler = None
        try:
            self.device, backend = _device_and_backend(args)
            if self.device.type == "cpu" and args.use_distributed_optimizer:
                raise TrainingError("--use-distributed-optimizer needs CUDA (megatron-core's distributed optimizer "
                                    "takes CUDA parameters only); drop it to train on the CPU")
            if self.device.type == "cpu" and args.bf16:
                raise TrainingError("--bf16 needs CUDA (megatron-core's mixed-precision optimizer takes CUDA "
                                    "parameters only); train in fp32 (no dtype flag) or --fp64 on the CPU, and use "
                                    "tools/verify_fidelity.py --dtype bfloat16 for bf16 numerics")
            created = _init_world(backend, args.distributed_timeout_minutes)
            if created:
                self._stack.callback(dist.destroy_process_group)
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            self._enter_parallel_state()
            patches.apply()
            self._stack.callback(patches.undo)

            self.config = hybrid_config(args, world_size=self.world, device=self.device.type)
            tree = args.tree        # the typed --tree-* flags (training.tree_flags.TreeFlags)
            if tree.triton_max_configs and self.config.kda_backend == "fla":
                from ..ops.triton_tuning import limit_autotuning
                self._stack.callback(limit_autotuning(tree.triton_max_configs))
            self.vocab_size = padded_vocab_size(args)
            if args.pipeline_model_parallel_size > 1:     # this stage's layers (schedules/pipeline.py)
                from ..schedules.pipeline import build_stage_model
                model = build_stage_model(self.config, self.vocab_size,
                                          share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)
            else:
                model = build_hybrid_model(self.config, self.vocab_size,
                                           share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)
            model.to(self.device)
            from megatron.core.distributed import DistributedDataParallel
            from megatron.core.optimizer import get_megatron_optimizer
            from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
            self.model = [DistributedDataParallel(
                self.config, ddp_config(args, data_parallel_size=data_parallel_size(args, self.world)), model)]
            self._stack.callback(self._release)
            self.optimizer = get_megatron_optimizer(optimizer_config(args), self.model)
            use_fused_adam(self.optimizer)             # CUDA: one pass per step (training/fused_adam.py)
            self.scheduler = OptimizerParamScheduler(self.optimizer, **scheduler_kwargs(args))
            self.objective = args.objective         # rl.objectives.ObjectiveConfig, from the RL flags
            self.update = args.rl_update            # rl_update.RLUpdateConfig
            self.last_update = None
            self.ref_model = None
            self._said_ref_rule = False
            self._memory_setup(args)
            self.settings = SharingSettings(**shared_fields(tree, SharingSettings), cost_model=cost_model(args),
                                            memory_budget_bytes=self.memory_budget_bytes,
                                            piece_budget_bytes=self.piece_budget_bytes)
            from megatron.core import parallel_state
            self.dp = parallel_state.get_data_parallel_world_size()
            self.data_state: Optional[dict] = None
            if args.load:
                self._load()
            if self.update.ref_load:
                self._build_reference(args)
            if args.exit_signal_handler:
                self._signal = _ExitSignal(args.exit_signal)
                self._stack.callback(self._signal.close)
        except BaseException:
            self._stack.close()
            raise

    # ---- setup ---------------------------------------------------------------------------
    def _memory_setup(self, args) -> None:
        """The memory model of the run (``planner.memory``): this rank's parameter state bytes and the
        step's budgets (:func:`memory_budgets`; on a GPU the pieces' default from its memory)."""
        from ..planner.memory import ModelShape, state_bytes_per_parameter
        from .arguments import data_parallel_size
        self.memory_shape = ModelShape.from_config(self.config)
        params = sum(p.numel() for p in self.model[0].module.parameters())
        shards = data_parallel_size(args, self.world) if args.use_distributed_optimizer else 1
        self._state_bytes = params * state_bytes_per_parameter(self.memory_shape.element_bytes, shards)
        total = torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else None
        self.default_memory_budget_bytes, self.memory_budget_bytes, self.piece_budget_bytes = memory_budgets(
            args, self.memory_shape, self._state_bytes, device_bytes=total)

    def predicted_peak_bytes(self, window_stats: Dict[str, Any]) -> Optional[float]:
        """This rank's predicted peak of a step (``planner.memory.step_peak_bytes``): parameter state
        beside the larger of the schedule's predicted live activations and the output layer's log-probs
        at the largest microbatch (None where the schedule predicts none: the pipeline schedules)."""
        act = window_stats.get("predicted_peak_bytes")
        if act is None:
            return None
        from ..ops.logprobs import default_chunk_rows
        from ..planner.memory import output_bytes, step_peak_bytes
        s = self.memory_shape
        chunk = self.config.logprob_chunk_rows or default_chunk_rows(self.vocab_size // s.tp, self.config.params_dtype)
        rows = int(window_stats.get("largest_microbatch_rows", 0))
        out = output_bytes(s.hidden, self.vocab_size // s.tp, s.element_bytes, min(chunk, rows), rows)
        return step_peak_bytes(s, state_bytes=self._state_bytes, activation_bytes=act, output=out, largest_rows=rows)

    def _enter_parallel_state(self) -> None:
        a = self.args
        tp, pp, ep = a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.expert_model_parallel_size
        if self.device.type == "cpu":
            from ..testing.cpu_runtime import megatron_cpu_runtime
            self._stack.enter_context(megatron_cpu_runtime(tp=tp, ep=ep, pp=pp, etp=a.expert_tensor_parallel_size,
                                                           seed=a.seed, init_world=False))
            return
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        torch.cuda.set_device(self.device)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 expert_model_parallel_size=ep,
                                                 expert_tensor_parallel_size=a.expert_tensor_parallel_size)
        self._stack.callback(parallel_state.destroy_model_parallel)
        model_parallel_cuda_manual_seed(a.seed)
        torch.manual_seed(a.seed)

    def _load(self) -> None:
        from .checkpointing import checkpoint_dir_name, complete_iterations, load_checkpoint
        a = self.args
        step = a.ckpt_step
        got = load_checkpoint(a.load, self.model, self.optimizer, self.scheduler, load_optim=not a.no_load_optim,
                              load_rng=not a.no_load_rng, finetune=a.finetune, step=step)
        if got is None:
            if a.exit_on_missing_checkpoint:
                raise TrainingError(f"--load {a.load}: no checkpoint there (--exit-on-missing-checkpoint)")
            self._log(f"--load {a.load}: no checkpoint yet, starting from scratch")
            return
        self.iteration, extra = got
        self.data_state = extra.get("data") if extra else None
        if a.finetune or (self.iteration == 0 and not extra):      # weights only (finetune, release)
            self._log(f"loaded the weights of {a.load} (iteration counter at 0)")
            return
        source = f"--ckpt-step {step}" if step is not None else "the newest in its tracker file"
        newer = [i for i in complete_iterations(a.load) if i > self.iteration] if step is None else []
        note = (f"; {checkpoint_dir_name(newer[-1])} is newer and complete but not the tracker file's (a save "
                f"interrupted before its tracker update, or a tracker set back): --ckpt-step {newer[-1]} loads it"
                if newer else "")
        where = os.path.join(a.load, checkpoint_dir_name(self.iteration))
        self._log(f"resuming from iteration {self.iteration}: {where} ({source}){note}")
        if a.save and os.path.realpath(a.save) == os.path.realpath(a.load):
            self.last_saved = self.iteration

    def _build_reference(self, args) -> None:
        """The frozen reference model of ``--ref-load`` (a driver checkpoint, or a transformers directory
        at TP = PP = EP = 1), on the device or, with ``--ref-placement offload``, in host memory."""
        from ..models.model import build_hybrid_model
        path = self.update.ref_load
        if not os.path.isdir(path):
            raise TrainingError(f"--ref-load {path}: no such directory")
        tied = not args.untie_embeddings_and_output_weights
        if args.pipeline_model_parallel_size > 1:
            from ..schedules.pipeline import build_stage_model
            ref = build_stage_model(self.config, self.vocab_size, share_embeddings_and_output_weights=tied)
        else:
            ref = build_hybrid_model(self.config, self.vocab_size, share_embeddings_and_output_weights=tied)
        ref.to(self.device)
        self._load_weights(ref, path, "--ref-load")
        ref.requires_grad_(False)
        ref.eval()
        if self.update.ref_placement == "offload":
            ref.to("cpu")
        self.ref_model = ref
        self.ref_model_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
        self._log(f"reference model from {path} ({self.ref_model_bytes / 2 ** 30:.3f} GiB of weights, "
                  f"--ref-placement {self.update.ref_placement})")

    def _load_weights(self, module, path: str, what: str) -> None:
        """Weights into ``module`` from a driver checkpoint directory (the newest in its tracker; a release
        converted by tools/convert_hf_checkpoint.py), or from a transformers Kimi-Linear directory (one
        process)."""
        from .checkpointing import TRACKER_FILENAME, load_checkpoint
        if not os.path.isdir(path):
            raise TrainingError(f"{what} {path}: no such directory")
        if not os.path.exists(os.path.join(path, TRACKER_FILENAME)) and os.path.isfile(os.path.join(path, "config.json")):
            if self.world > 1:
                raise TrainingError(f"{what} {path}: a transformers directory loads on one process only; convert "
                                    "it with tools/convert_hf_checkpoint.py --format dist for parallel runs")
            from ..models.hf_convert import hf_to_megatron, load_hf_checkpoint
            _, hf_state = load_hf_checkpoint(path, dtype=self.config.params_dtype)
            try:
                state = hf_to_megatron(hf_state, self.config)
            except KeyError as e:
                raise TrainingError(f"{what} {path}: not this model's checkpoint (missing {e})") from None
            own = dict(module.state_dict())
            params = {n for n, _ in module.named_parameters()}
            missing = sorted(params - set(state))
            if missing:
                raise TrainingError(f"{what} {path}: no tensor for parameter {missing[0]}")
            with torch.no_grad():
                for k, v in state.items():
                    if k in own:
                        if tuple(own[k].shape) != tuple(v.shape):
                            raise TrainingError(f"{what} {path}: {k} has shape {tuple(v.shape)}, the model "
                                                f"{tuple(own[k].shape)}")
                        own[k].copy_(v.to(own[k].dtype))
        elif load_checkpoint(path, [module], None, None, load_optim=False, load_rng=False, finetune=True) is None:
            raise TrainingError(f"{what} {path}: no checkpoint there (no {TRACKER_FILENAME})")

    def load_weights(self, path: str) -> None:
        """Replace the policy's weights by those of ``path`` (a driver checkpoint or a transformers
        directory, as ``--ref-load``); the optimizer's main parameters follow."""
        self._load_weights(self.model[0].module, path, "load_weights")
        self.optimizer.reload_model_params()

    # ---- the loop ---------------------------------------------------------------------------
    def _plan(self, forest):
        return plan_step(forest, self.settings, self.dp)

    def open_loader(self):
        """The loader of ``--data-path`` at the resumed position (every rank builds the same)."""
        from .data import TreeBatchLoader
        a = self.args
        if not a.data_path:
            raise TrainingError("--data-path is required to train from a dataset")
        loader = TreeBatchLoader(a.data_path, global_batch_size=a.global_batch_size, seed=a.seed,
                                 shuffle=a.tree.dataset_shuffle, plan_fn=self._plan, prefetch=1, start=self.data_state,
                                 vocab_size=a.vocab_size)
        self._stack.callback(loader.close)
        self._check_data_fields(loader.source_forest, loader.source_name)
        self.loader = loader
        return self.loader

    def _check_data_fields(self, forest, name: str) -> None:
        """Refuse, before the first step, a source none of whose trajectories carries a per-token field the
        flags need (a trajectory lacking it among others that carry it is refused at its step)."""
        o = self.objective
        need = []
        if o.tis_cap is not None:
            need.append(("rollout_logprobs", f"--rl-tis-cap {o.tis_cap}",
                         "an inference engine's log-probs of the sampled tokens (engine records' "
                         "completion_logprobs give them)"))
        if o.kl_coef > 0 and o.kl_to == "ref" and self.ref_model is None:
            need.append(("ref_logprobs", f"--kl-coef {o.kl_coef} --kl-to ref",
                         "give --ref-load DIR, or score the data with tools/score_logprobs.py --field ref_logprobs"))
        for field, flag, how in need:
            if not forest.has_logprobs(field).any():
                raise TrainingError(f"{name}: {flag} needs `{field}` per token and no trajectory of the data has "
                                    f"it ({how})")

    def train_iteration(self) -> Dict[str, Any]:
        """One iteration from the loader: next planned global batch, one optimizer step; its metrics."""
        loader = self.loader or self.open_loader()
        batch = next(loader)
        if self.args.tree.logit_probe and self._probe_batch is None:
            self._probe_batch = batch
            self.probe()
        try:
            result = self._run_step(batch.forest, batch.plan, batch.plan_seconds)
        except (RLDataError, ObjectiveDataError) as e:
            raise TrainingError(f"{loader.source_name}: {e}") from None
        self.iteration += 1
        self.data_state = loader.state_dict()
        metrics = self.metrics(result)
        self._report(metrics)
        return metrics

    def train(self) -> Dict[str, Any]:
        """Train until ``--train-iters`` (or an exit condition); returns the last step's metrics."""
        a = self.args
        started = time.time()
        last: Dict[str, Any] = {}
        while self.iteration < a.train_iters:
            last = self.train_iteration()
            reason = self._exit_reason(started)
            if reason:
                self._final_probe()
                if a.save:
                    path = self.save(announce=False)
                    self._log(f"exiting at iteration {self.iteration} ({reason}): checkpoint saved to {path}")
                else:
                    self._log(f"exiting at iteration {self.iteration} ({reason}): nothing saved (no --save)")
                return last
            if a.save and a.save_interval and self.iteration % a.save_interval == 0:
                self.save()
        self._final_probe()
        if a.save and self.last_saved != self.iteration:
            self.save()
        return last

    def probe(self) -> None:
        """Write the logit probe of the first global batch at the current iteration (``--tree-logit-probe``;
        collective; training/probe.py says what it holds); the first probe of a run also writes the
        upcast oracle's under ``--tree-logit-probe-oracle``."""
        from .probe import ORACLE_DIR, oracle_logits, probe_logits, write_probe
        b = self._probe_batch
        tree = self.args.tree
        captured = probe_logits(self.model, b.forest, b.plan, self.settings, max_tokens=tree.logit_probe_tokens)
        write_probe(tree.logit_probe, self.iteration, captured)
        if tree.logit_probe_oracle and self._probed_at is None:
            oracle = oracle_logits(self.model[0].module, self.config, b.forest, b.plan, self.settings,
                                   max_tokens=tree.logit_probe_tokens)
            write_probe(os.path.join(tree.logit_probe, ORACLE_DIR), self.iteration, oracle)
        dist.barrier()
        self._probed_at = self.iteration
        self._log(f"logit probe of iteration {self.iteration}: {self.args.tree.logit_probe}")

    def _final_probe(self) -> None:
        if self._probe_batch is not None and self._probed_at != self.iteration:
            self.probe()

    def _exit_reason(self, started: float) -> Optional[str]:
        a = self.args
        flags = [0.0, 0.0, 0.0]
        if self._signal is not None and self._signal.received:
            flags[0] = 1.0
        if a.exit_interval and self.iteration % a.exit_interval == 0:
            flags[1] = 1.0
        if a.exit_duration_in_mins and (time.time() - started) / 60.0 > a.exit_duration_in_mins:
            flags[2] = 1.0
        t = torch.tensor(flags, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        names = ["exit signal received", f"--exit-interval {a.exit_interval}",
                 f"--exit-duration-in-mins {a.exit_duration_in_mins}"]
        hit = [n for n, f in zip(names, t.tolist()) if f]
        return hit[0] if hit else None

    def _run_step(self, forest, plan, plan_seconds: float) -> StepResult:
        """One RL update of a planned global batch (``training.rl_update``): its last optimizer step's
        result, the loss averaged over the update's optimizer steps; ``self.last_update`` keeps all."""
        from .rl_update import rl_update
        if self.ref_model is not None and not self._said_ref_rule and forest.has_logprobs("ref_logprobs").any():
            self._said_ref_rule = True
            self._log("--ref-load is given: the reference log-probs come from the reference model; the data's "
                      "ref_logprobs are not read")
        if self.device.type == "cuda":      # measured_peak_gib: the allocator's peak over this step
            torch.cuda.reset_peak_memory_stats(self.device)
            self._retries_at_start = _alloc_retries(self.device)
        try:
            up = rl_update(self.model, self.optimizer, self.scheduler, forest, plan, settings=self.settings,
                           objective=self.objective, update=self.update, iteration=self.iteration + 1,
                           device=self.device, plan_fn=self._plan, ref_model=self.ref_model,
                           plan_seconds=plan_seconds)
        except NonFiniteLoss as e:
            where = f"; the last good checkpoint is iteration {self.last_saved} in {self.args.save}" \
                if self.last_saved is not None else ""
            raise TrainingError(f"{e}: stopping{where}") from None
        self.last_update = up
        last = up.steps[-1]
        if len(up.steps) == 1:
            return last
        import dataclasses
        n = len(up.steps)
        return dataclasses.replace(
            last, loss=sum(r.loss for r in up.steps) / n,
            terms={k: sum(r.terms[k] for r in up.steps) / n for k in last.terms},
            computed_tokens=sum(r.computed_tokens for r in up.steps),
            trajectory_tokens=sum(r.trajectory_tokens for r in up.steps),
            step_seconds=sum(r.step_seconds for r in up.steps), microbatches=sum(r.microbatches for r in up.steps),
            **{k: sum(getattr(r, k) for r in up.steps) for k in PIECE_STATS})

    def step(self, trajectories) -> Dict[str, Any]:
        """One optimizer step on in-memory trajectories (the RL-loop entry).

        ``trajectories``: a ``Forest``, or a sequence of ``Trajectory`` objects or records
        (dicts in the JSONL format of docs/data_format.md, with ``rollout_logprobs`` and
        ``ref_logprobs`` read as the dataset's are).  Every rank must pass the same trajectories
        (the whole global batch); each runs its replica's share.
        """
        from ..tree_data import Forest, build_forest, make_trajectory
        if isinstance(trajectories, Forest):
            forest = trajectories
        else:
            trajs = [t if not isinstance(t, dict) else make_trajectory(t, line=i + 1)
                     for i, t in enumerate(trajectories)]
            if not trajs:
                raise ValueError("step(): no trajectories")
            forest = build_forest(trajs)
        t0 = time.perf_counter()
        plan = self._plan(forest)
        result = self._run_step(forest, plan, time.perf_counter() - t0)
        self.iteration += 1
        metrics = self.metrics(result)
        self._report(metrics)
        return metrics

    def logprobs(self, trajectories, entropy: bool = False):
        """Forward only: the log-prob of every token of every trajectory given, in the order given.

        ``trajectories``: as for :meth:`step` (records, ``Trajectory`` objects or a ``Forest``, whose
        trajectories come in its order); loss masks, advantages and old log-probs are not read.  Runs
        the planned microbatches of the run's ``--tree-sharing`` mode (trees by default, expanded
        with ``off``) under ``no_grad``: no autograd graph, so no more memory than a training step.
        Returns a list of float64 arrays, one per trajectory, aligned with its tokens: ``lp[j] = log
        p(tokens[j] | tokens[:j])`` and ``lp[0]`` NaN (the data format of ``old_logprobs``); with
        ``entropy``, ``(logprobs, entropies)``, ``ent[j]`` the entropy of the distribution that
        predicts token j.  Collective: every rank passes the same trajectories.
        """
        from ..tree_data import Forest, build_forest, make_trajectory
        from .rl_update import forward_logprobs, per_trajectory
        from .step import step_forest
        if isinstance(trajectories, Forest):
            trajs = [trajectories.expand(tid) for tid in trajectories.traj_ids]
        else:
            trajs = [t if not isinstance(t, dict) else make_trajectory(t, line=i + 1)
                     for i, t in enumerate(trajectories)]
        if not trajs:
            raise ValueError("logprobs(): no trajectories")
        import dataclasses
        import numpy as np
        scored = []
        for t in trajs:
            mask = np.ones(len(t), dtype=np.uint8)
            mask[0] = 0
            scored.append(dataclasses.replace(t, loss_mask=mask, old_logprobs=None, advantage=None))
        forest = build_forest(scored)
        plan = self._plan(forest)
        lp, ent = forward_logprobs(self.model, forest, plan, self.settings, entropy=entropy)
        sf = step_forest(forest, plan)
        lps = per_trajectory(sf, lp)
        out = [lps[t.id] for t in trajs]
        if not entropy:
            return out
        ents = per_trajectory(sf, ent)
        return out, [ents[t.id] for t in trajs]

    # ---- metrics and logging ------------------------------------------------------------------
    def metrics(self, r: StepResult) -> Dict[str, Any]:
        """The logged figures of one step (one flat dict of numbers)."""
        secs = max(r.step_seconds, 1e-9)
        predicted = self.predicted_peak_bytes(r.window_stats)
        measured = torch.cuda.max_memory_allocated(self.device) / 2 ** 30 if self.device.type == "cuda" else None
        retries = _alloc_retries(self.device) - self._retries_at_start if self.device.type == "cuda" else None
        m: Dict[str, Any] = {
            "iteration": self.iteration, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm,
            "trajectories": r.trajectories, "trajectory_tokens": r.trajectory_tokens,
            "target_tokens": r.target_tokens, "computed_tokens": r.computed_tokens,
            "replay_tokens": r.replay_tokens, "compression": r.trajectory_tokens / max(r.computed_tokens, 1),
            "visible_pairs": r.visible_pairs, "compaction_events": r.compaction_events,
            "trajectory_tokens_per_s": r.trajectory_tokens / secs, "computed_tokens_per_s": r.computed_tokens / secs,
            "kda_calls": r.kda_calls, "microbatches": r.microbatches, "plan_seconds": r.plan_seconds,
            "step_seconds": r.step_seconds, "peak_memory_gib": self._peak_memory_gib(),
            "peak_export_bytes": r.window_stats.get("peak_export_bytes", 0),
            "windows": r.window_stats.get("windows", 0),
            "recomputed_windows": r.window_stats.get("recomputed_windows", 0),
            "piece_rows": r.piece_rows, "piece_extra_forward_rows": r.piece_extra_forward_rows,
            "read_pieces": r.read_pieces, "kept_pieces": r.kept_pieces, "partly_kept_pieces": r.partly_kept_pieces,
            "piece_memory_gib": None if self.piece_budget_bytes is None else self.piece_budget_bytes / 2 ** 30,
            "memory_budget_gib": None if self.memory_budget_bytes is None else self.memory_budget_bytes / 2 ** 30,
            "predicted_peak_gib": None if predicted is None else predicted / 2 ** 30,
            "measured_peak_gib": measured, "alloc_retries": retries,
        }
        for k, v in r.terms.items():
            m[f"objective/{k}"] = v
        up = self.last_update
        if up is not None:
            m["optimizer_steps"] = len(up.steps)
            m.update(up.metrics)
        if self.ref_model is not None:
            m["ref_model_gib"] = self.ref_model_bytes / 2 ** 30
        if r.tokens_per_expert is not None and r.tokens_per_expert.numel():
            tpe = r.tokens_per_expert.double()
            ratio = tpe.max(dim=1).values / tpe.mean(dim=1).clamp_min(1e-12)
            m["moe_load_max_over_mean"] = float(ratio.max())
        return m

    def _peak_memory_gib(self) -> float:
        """The run's peak so far (the allocator's peak is reset at every step: ``measured_peak_gib``)."""
        if self.device.type == "cuda":
            self._run_peak = max(self._run_peak, torch.cuda.max_memory_allocated(self.device) / 2 ** 30)
            return self._run_peak
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20   # KiB on Linux

    def _log(self, text: str) -> None:
        if self.rank == 0:
            print(f"[harts] {text}", flush=True)

    def _open_tensorboard(self) -> None:
        a = self.args
        if not a.tensorboard_dir or self.rank != 0 or self._tb is not None:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise TrainingError("--tensorboard-dir needs the tensorboard package (pip install tensorboard)") from None
        self._tb = SummaryWriter(log_dir=a.tensorboard_dir, max_queue=10)
        self._stack.callback(self._tb.close)

    def _report(self, m: Dict[str, Any]) -> None:
        a = self.args
        if self.rank != 0:
            return
        self._open_tensorboard()
        if a.tree.plan_report:
            with open(a.tree.plan_report, "a") as f:
                f.write(json.dumps({k: v for k, v in m.items()}, sort_keys=True) + "\n")
        if self._tb is not None and self.iteration % (a.tensorboard_log_interval or 1) == 0:
            for k, v in m.items():
                if isinstance(v, (int, float)) and k != "iteration" and v is not None:
                    self._tb.add_scalar(k, v, self.iteration)
            self._tb.flush()
        if a.log_interval and self.iteration % a.log_interval == 0:
            terms = " | ".join(f"{k.split('/', 1)[1]} {v:.4E}" for k, v in m.items() if k.startswith("objective/"))
            gn = "-" if m["grad_norm"] is None else f"{m['grad_norm']:.3E}"
            moe = f" | MoE load max/mean {m['moe_load_max_over_mean']:.2f}" if "moe_load_max_over_mean" in m else ""
            events = f" | compaction events {m['compaction_events']}" if m["compaction_events"] else ""
            pred = "-" if m["predicted_peak_gib"] is None else f"{m['predicted_peak_gib']:.2f}"
            meas = "" if m["measured_peak_gib"] is None else f", measured {m['measured_peak_gib']:.2f}"
            windows = f" | windows {m['windows']} ({m['recomputed_windows']} recomputed)" if m["windows"] else ""
            if m["read_pieces"]:
                windows += (f" | read pieces {m['read_pieces']} ({m['read_pieces'] - m['kept_pieces']} recomputed,"
                            f" {m['partly_kept_pieces']} in part, {m['piece_extra_forward_rows']} extra forward rows)")
            print(f" iteration {self.iteration:8d}/{a.train_iters:8d} | loss {m['loss']:.6E}"
                  f"{' | ' + terms if terms else ''} | lr {m['lr']:.3E} | grad norm {gn}"
                  f" | trajectories {m['trajectories']} | traj tok/s {m['trajectory_tokens_per_s']:.1f}"
                  f" | computed tok/s {m['computed_tokens_per_s']:.1f} | compression {m['compression']:.2f}x"
                  f" | KDA calls {m['kda_calls']} | attention pairs {m['visible_pairs']:.3E}{events}"
                  f" | plan {m['plan_seconds']:.3f}s | step {m['step_seconds']:.3f}s"
                  f" | peak mem {m['peak_memory_gib']:.2f} GiB | step peak predicted {pred}{meas} GiB{windows}{moe}",
                  flush=True)

    # ---- checkpoints and export -----------------------------------------------------------------
    def save(self, announce: bool = True) -> str:
        """Save model, optimizer, scheduler, RNG and data position at the current iteration; returns
        the checkpoint directory (``announce``: rank 0 prints it)."""
        from .checkpointing import save_checkpoint
        a = self.args
        if not a.save:
            raise TrainingError("save(): --save is not set")
        extra = {"data": self.data_state, "iteration": self.iteration}
        path = save_checkpoint(a.save, self.iteration, self.model, self.optimizer, self.scheduler,
                               extra_state=extra, save_optim=not a.no_save_optim, save_rng=not a.no_save_rng)
        self.last_saved = self.iteration
        if announce:
            self._log(f"saved checkpoint of iteration {self.iteration} to {path}")
        return path

    def export_hf(self, path: str) -> None:
        """Write the weights as a transformers Kimi-Linear checkpoint directory (collective).

        Tensor- and expert-parallel shards are gathered to rank 0, which writes ``path``.
        """
        from .export import export_hf_checkpoint
        export_hf_checkpoint(self.model[0].module, self.config, self.vocab_size, path)

    # ---- teardown ---------------------------------------------------------------------------------
    def _release(self) -> None:
        """Let the model and the optimizer go (``close``; module docstring): no autograd graph of a
        last forward left on the modules, no reference from this trainer."""
        for chunk in self.model or ():
            _drop_autograd_graphs(chunk.modules())
        self.model = self.optimizer = self.scheduler = None
        self.ref_model = None

    def close(self) -> None:
        """End the run: release the model and optimizer, undo the patches, leave megatron's parallel
        state and the world if this trainer made them.  The trainer is unusable afterwards."""
        self._stack.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @classmethod
    def from_args(cls, argv: Optional[Sequence[str]] = None, *, require_data: bool = False) -> "Trainer":
        """A trainer from a Megatron-style command line (``--data-path`` optional: ``step()`` feeds data)."""
        from .arguments import parse_args
        return cls(parse_args(list(argv) if argv is not None else sys.argv[1:], require_data=require_data))
