"""The peer baseline of bench_throughput: transformers' Kimi-Linear trained trajectory by trajectory.

What HF/FSDP-based RL trainers run for this model, on the same batch and shapes as our modes:
``KimiLinearForCausalLM`` built from the preset (``hf_convert.kimi_linear_hf_config`` of the model
config the driver builds), in ``dtype``, one trajectory per forward and backward (gradients
accumulated over the global batch), then one optimizer step.  The loss is ours (``--rl-objective
sft``, token-mean over the global batch): ``-sum log p(target) / N`` with N the batch's target
tokens, the logits computed only on the rows that predict a target (``logits_to_keep``).

Given its best chance, and every choice recorded in the result (``implementation``):

- attention: ``sdpa``; experts: ``grouped_mm`` on CUDA (``eager`` on the CPU, where grouped GEMMs
  do not run);
- KDA: fla's chunked kernel where fla is importable (transformers picks it up itself); the short
  convolution: fla's Triton causal conv where fla is importable (transformers' own choice is the
  ``causal-conv1d`` package, not installed on our GPU node, else a channels-first torch conv);
- Triton autotuning capped as the driver's ``--tree-triton-max-configs`` caps ours
  (``triton_max_configs``), so that fla does not tune again for every new sequence length;
- parameters in ``dtype`` with a fused AdamW straight on them (no fp32 master copy: less work and
  memory than our mixed-precision optimizer), gradient-norm clipping at 1 as ours;
- activation checkpointing of every layer where the preset recomputes (``recompute``), as ours.

Reported: step times (median after warm-up), trajectory tokens per second, peak memory, loss.
"""
from __future__ import annotations

import statistics
import time
from typing import Optional

import numpy as np
import torch

__all__ = ["peer_config", "build_peer", "run_peer"]


def peer_config(model_config, vocab_size: int):
    """transformers' KimiLinearConfig of the driver's model config (the same architecture)."""
    from megatron_harts.models.hf_convert import kimi_linear_hf_config
    return kimi_linear_hf_config(model_config, vocab_size)


def _fla_short_conv(modeling) -> Optional[str]:
    """Make transformers' Kimi-Linear run fla's causal conv (channels-last Triton kernel) for its short
    convolution; returns what runs ("fla", or None where fla or the hook is missing)."""
    try:
        from fla.modules.causal_conv1d.ops import causal_conv1d
    except ImportError:
        return None
    if not hasattr(modeling, "causal_conv1d_fn"):
        return None

    def conv_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        # transformers passes [B, C, T] and a [C, K] weight; fla's kernel reads [B, T, C]
        y, _ = causal_conv1d(hidden_states.transpose(1, 2), weight, bias, activation=activation)
        return y.transpose(1, 2)

    modeling.causal_conv1d_fn = conv_fn
    return "fla"


def build_peer(model_config, vocab_size: int, device: str, dtype: torch.dtype, recompute: bool, seed: int = 1234):
    """(model, implementation): the peer model on ``device`` and the kernels it runs."""
    import transformers.models.kimi_linear.modeling_kimi_linear as modeling
    from transformers import KimiLinearForCausalLM

    cfg = peer_config(model_config, vocab_size)
    experts = "grouped_mm" if device == "cuda" else "eager"
    impl = {"attention": "sdpa", "experts": experts, "dtype": str(dtype).replace("torch.", ""),
            "short_conv": "torch", "kda": "torch", "activation_checkpointing": bool(recompute)}
    if device == "cuda":
        impl["short_conv"] = _fla_short_conv(modeling) or "torch"
        try:
            import fla  # noqa: F401
            impl["kda"] = "fla"
        except ImportError:
            pass
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM._from_config(cfg, attn_implementation="sdpa", experts_implementation=experts,
                                               dtype=dtype)
    model.to(device)
    if recompute:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model, impl


def _step(model, optimizer, batch, n_targets: int, device: str) -> float:
    """One optimizer step over ``batch`` (token ids, target-row indices, target ids), one trajectory a
    forward and backward; returns the loss."""
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for ids, rows, targets in batch:
        out = model(input_ids=ids, logits_to_keep=rows, use_cache=False)
        logits = out.logits[0]
        logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        loss = -logp.gather(1, targets[:, None]).sum() / n_targets
        loss.backward()
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return total


def run_peer(model_config, vocab_size: int, forest, iters: int, warmup: int, device: str,
             dtype: torch.dtype = torch.bfloat16, recompute: bool = False, triton_max_configs: Optional[int] = 1,
             lr: float = 1e-5, warm=None) -> dict:
    """Train ``forest``'s trajectories with the peer (module docstring); warm-up steps train ``warm``
    where given (as bench_throughput's modes do).  Returns step times, tokens/s, peak and loss."""
    undo = None
    if device == "cuda" and triton_max_configs:
        from megatron_harts.ops.triton_tuning import limit_autotuning
        undo = limit_autotuning(triton_max_configs)
    model, impl = build_peer(model_config, vocab_size, device, dtype, recompute)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=device == "cuda")

    def batch_of(f):
        out, n = [], 0
        for tid in f.traj_ids:
            t = f.expand(tid)
            mask = np.asarray(t.loss_mask, dtype=bool)
            mask[0] = False                         # position 0 has no row to predict it
            j = np.nonzero(mask)[0]
            if not len(j):
                continue
            out.append((torch.as_tensor(np.asarray(t.tokens, dtype=np.int64), device=device)[None],
                        torch.as_tensor(j - 1, device=device), torch.as_tensor(np.asarray(t.tokens)[j], device=device)))
            n += len(j)
        return out, n

    timed, n_timed = batch_of(forest)
    warm_batch = batch_of(warm) if warm is not None else (timed, n_timed)
    tokens = int(forest.traj_length.sum())
    times, losses = [], []
    try:
        for i in range(warmup + iters):
            batch, n = (timed, n_timed) if i >= warmup else warm_batch
            if device == "cuda":
                torch.cuda.synchronize()
                if i == warmup:
                    torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            losses.append(_step(model, optimizer, batch, n, device))
            if device == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() / 2 ** 30 if device == "cuda" else None
    finally:
        if undo is not None:
            undo()
        del model, optimizer
        if device == "cuda":
            torch.cuda.empty_cache()
    t = statistics.median(times)
    return {"implementation": impl, "step_seconds": t, "step_seconds_all": times,
            "trajectory_tokens_per_s": tokens / t, "rows_computed": tokens, "peak_memory_gib": peak,
            "loss_per_step": losses, "trajectories": len(timed)}
