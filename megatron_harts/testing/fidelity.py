"""Tree mode vs expanded mode on the same weights: the numbers of docs/design.md invariant 1, and their verdict.

Used by tools/verify_fidelity.py.  Pieces:

- :func:`pg_loss`: the RL loss both modes compute from per-target log-probs (same formula).
  Per target i with weight w_i, advantage A_i (1.0 where the trajectory has none) and log-prob
  l_i: without an old log-prob the term is ``-w_i * A_i * l_i``; with one (``o_i``) it is PPO-clip,
  ``-w_i * min(r_i * A_i, clip(r_i, 1 - eps, 1 + eps) * A_i)`` with ``r_i = exp(l_i - o_i)``.
  The loss is the sum of the terms divided by the number of targets.
- :func:`run_tree` / :func:`run_expanded`: one forward+backward of the loss (MoE aux losses attach
  themselves in megatron's router), then a no-grad forward for the logits; a :class:`ModeRun`.
  Expanded mode runs every trajectory as its own sequence (THD-packed, nothing shared); its
  targets are read in the layout's target order, so the two runs line up entry by entry.
- :func:`run_bf16`: for a bf16 model, tree and expanded mode in bf16 plus the fp32 oracle:
  expanded mode on an fp32 copy of the same weights (:func:`upcast_model`).
- :func:`layer_errors`: where a bf16 run's rounding grows, layer by layer (errors against the
  fp32 oracle, MoE routing flips), for both modes.
- :func:`fidelity_report`: differences and the verdict.  Relative differences are relative to
  the reference's scale: log-probs and each gradient tensor to their largest magnitude, the loss
  to ``loss_scale`` (sum of |term| / number of targets: a loss near 0 from cancelling advantages
  is not a small scale), aux losses to their largest value.  Verdict (docs/design.md invariant 1): fp64
  every relative difference <= 1e-10, fp32 <= 1e-5, and tokens per expert equal; bf16: the
  rule below.  The oracle (transformers, invariant 4) computes parts of its layers in fp32
  whatever the model dtype (measured: ~1.5e-6 relative in "fp64" on the tiny preset), so its
  tolerance is fp32's 1e-5 for fp64 and fp32 alike (reported only in bf16).
- :func:`oracle_logprobs`: that oracle, transformers' KimiLinearForCausalLM on the same weights,
  in fp64 through transformers' plain torch code, on the CPU by default
  (:func:`kimi_linear_torch_path`: with fla installed transformers would otherwise run fla's
  kernels: fp32/TF32 on CUDA, measured 4e-3 nats off on the tiny preset; no fp64; on CPU tensors
  not at all); :func:`hf_logprobs` runs one
  trajectory, its compaction events evicting keys in the MLA layers (:func:`eviction_mask`).

The bf16 rule.  Invariant 1 asks that tree mode's bf16 logits be no worse than expanded mode's
own variation.  Comparing against an expanded *rerun* measures nothing: on one device the kernels
are deterministic and the rerun is bitwise equal (cosine 1.0), so no tree run could pass.  The
variation that matters is bf16 rounding, and its size is measured against an fp32 oracle: expanded
mode on the same weights upcast to fp32 (exact), through the plain path (reference KDA; fla's
Triton dots may round fp32 through TF32) with TF32 off.  Tree bf16 and expanded bf16 are two
different bf16 evaluations of the same function (different reduction orders, chunk boundaries
met by replay, tree attention over compact rows, MoE batches of other sizes, routing flips), so
each has its own rounding error against the oracle, and tree mode passes when its error is of
the same size as expanded mode's:

    1 - cos(tree, fp32)      <= 1.5 * (1 - cos(expanded, fp32)) + 1e-6     (logits, mean over positions)
    mean|lp_tree - lp_fp32|  <= 2.0 * mean|lp_expanded - lp_fp32| + 1e-5    (per-target log-probs)

The slack is measured, not guessed: over 40 seeds each of the tiny and small presets (the tool's
synthetic data, megatron initialization, CPU) the ratio tree/expanded of the cosine deficit was
1.07 (tiny) / 1.10 (small) on average, at most 1.19 / 1.30 (sd 0.07 / 0.11), and of the mean
log-prob difference 1.04 / 1.08 on average, at most 1.36 / 1.56 (fewer samples: ~80 targets,
and a bf16 routing flip moves one target's log-prob a lot); no seed fails the rule.  A 10%
relative slack fails honest runs (3 seeds in 8 on the small preset); an absolute floor of 1e-4
in cosine is as large as the whole bf16 deficit there (~1.3e-4; tiny ~5e-5), so it would decide
alone, whatever the model.  The floors used here (a cosine deficit of 1e-6 is a relative logit
error ~1.4e-3, below bf16's unit roundoff 2^-9; 1e-5 nats) matter only when expanded mode is
exact to well below bf16 rounding.  What the rule catches: one wrong short-conv context row
among ~200 multiplies the cosine deficit by 60-570 (small preset, 2 seeds).  An error confined
to one target (a log-prob read from the wrong row: mean log-prob difference x1.7-2.1) is at the
edge: the fp32/fp64 rules are the test for those.  The max log-prob difference, the RL loss and
the gradients against the oracle are reported, not judged (a max, or one sum of cancelling
terms, is dominated by a single routing flip; bf16 gradients of some tensors are off by tens of
percent in either mode).

Weights matter.  :func:`randomize_parameters` draws matrices N(0, 0.2^2), i.e. a gain of about
0.2 * sqrt(hidden) (1.6 on the small preset) per projection: a chaotic network that amplifies
bf16 rounding into a cosine deficit of 1-7% against fp32 (max |log-prob difference| up to 3.4
nats; tree vs expanded bf16 0.97-0.99 on CPU, 0.980 measured on an H200), with a tree/expanded
ratio of 0.7-1.7 from seed to seed (1 run in 16 fails the rule by chance), so an error of the
size of bf16's own disappears in it.  Megatron's initialization (init_method_std 0.02, fla's KDA
init: the model as built) gives a deficit ~1.3e-4 (small) / ~5e-5 (tiny) with a stable ratio:
:data:`DEFAULT_INIT` uses it for bf16.  fp64/fp32 keep the random weights: their tolerances are
absolute, and large weights make them stronger (every path far from linear) while fp64/fp32
rounding stays far below the tolerance.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np
import torch
import torch.nn.functional as F

TOLERANCE = {"float64": 1e-10, "float32": 1e-5}
ORACLE_TOLERANCE = {"float64": 1e-5, "float32": 1e-5}
# bf16 rule (module docstring): tree's deviation from the fp32 oracle <= FACTOR * expanded's + FLOOR
BF16_COSINE_FACTOR, BF16_COSINE_FLOOR = 1.5, 1e-6
BF16_LOGPROB_FACTOR, BF16_LOGPROB_FLOOR = 2.0, 1e-5
INITS = ("megatron", "random")
DEFAULT_INIT = {"float64": "random", "float32": "random", "bfloat16": "megatron"}
PPO_CLIP = 0.2

PRESETS = {
    # 4 layers KDA, MLA, KDA, MLA; dense first MLP then MoE (8 experts, top-2, groups, shared expert)
    "tiny": dict(vocab_size=32, num_layers=4, hidden_size=32, num_attention_heads=2, ffn_hidden_size=48,
                 linear_num_heads=2, linear_head_dim=8, kda_chunk_size=4, kv_lora_rank=16, qk_nope_head_dim=8,
                 qk_rope_head_dim=4, v_head_dim=8, kda_mla_ratio=1, num_moe_experts=8, moe_router_topk=2,
                 moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16, moe_router_num_groups=4,
                 moe_router_group_topk=2),
    # Kimi-Linear's 3:1 pattern at a small size
    "small": dict(vocab_size=256, num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                  linear_num_heads=4, linear_head_dim=16, kda_chunk_size=16, kv_lora_rank=32, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=16, kda_mla_ratio=3, num_moe_experts=8, moe_router_topk=2,
                  moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32, moe_router_num_groups=4,
                  moe_router_group_topk=2),
    # benchmarks/bench_throughput.py's h200 model (hidden 1024, 12 layers, 32 experts top-8, no routing
    # groups): where its bf16 logit cosine comes from (--per-layer); ~15 GB and minutes on a CPU
    "h200": dict(vocab_size=32000, num_layers=12, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096,
                 linear_num_heads=16, linear_head_dim=64, kda_chunk_size=64, kv_lora_rank=256, qk_nope_head_dim=64,
                 qk_rope_head_dim=32, v_head_dim=64, kda_mla_ratio=3, num_moe_experts=32, moe_router_topk=8,
                 moe_ffn_hidden_size=512, moe_shared_expert_intermediate_size=512),
}


def measurement_overrides(dtype: torch.dtype, device: str) -> dict:
    """Megatron-side settings of a fidelity run: dtype, aux and z losses on, all-gather dispatcher."""
    return dict(params_dtype=dtype, moe_router_dtype="fp64" if dtype == torch.float64 else "fp32",
                moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_router_load_balancing_type="aux_loss",
                moe_token_dispatcher_type="allgather", use_cpu_initialization=device == "cpu",
                tree_attention_backend="sdpa", hidden_dropout=0.0, attention_dropout=0.0)


def preset_config(name: str, dtype: torch.dtype, device: str = "cpu"):
    """(HybridConfig, vocab size) of a preset.  Kimi-Linear numerics: sigmoid group routing with
    expert bias and scaling, NoPE MLA; norm eps 1e-6 (transformers' MLA latent norms use 1e-6)."""
    from ..models.config import HybridConfig
    kw = dict(PRESETS[name])
    vocab = kw.pop("vocab_size")
    kw.update(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
              layernorm_epsilon=1e-6, first_k_dense_replace=1, moe_router_score_function="sigmoid",
              moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5)
    kw.update(measurement_overrides(dtype, device))
    return HybridConfig(**kw), vocab


def randomize_parameters(model, seed: int = 0) -> None:
    """Deterministic random weights of a realistic spread: matrices N(0, 0.2^2), norms 1 + N(0, 0.1^2),
    KDA decay A ~ U[1, 16] (A_log = log A), dt_bias ~ -2 + N(0, 0.5^2), expert bias N(0, 0.05^2)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            r = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if "norm" in name:
                v = 1.0 + 0.1 * r
            elif name.endswith("A_log"):
                v = torch.empty(p.shape, dtype=torch.float64).uniform_(1.0, 16.0, generator=gen).log()
            elif name.endswith("dt_bias"):
                v = -2.0 + 0.5 * r
            else:
                v = 0.2 * r
            p.copy_(v.to(p.device))
        for name, b in sorted(model.named_buffers()):
            if name.endswith("expert_bias"):
                b.copy_((0.05 * torch.randn(b.shape, generator=gen, dtype=torch.float64)).to(b.device))


def initialize_weights(model, init: str, seed: int = 0) -> None:
    """``init`` "megatron": keep the weights the model was built with (megatron's init_method_std,
    fla's KDA init); "random": :func:`randomize_parameters` (module docstring: which to use)."""
    if init not in INITS:
        raise ValueError(f"init must be one of {', '.join(INITS)}, got {init!r}")
    if init == "random":
        randomize_parameters(model, seed)


def pg_loss(logprobs: torch.Tensor, weight: torch.Tensor, advantage: torch.Tensor, old_logprobs: torch.Tensor,
            clip: float = PPO_CLIP):
    """(loss, loss_scale) of per-target log-probs (module docstring); NaN advantage -> 1, NaN old -> plain PG."""
    dt = logprobs.dtype
    w = weight.to(dt)
    adv = torch.where(torch.isnan(advantage), torch.ones_like(advantage), advantage).to(dt)
    old = old_logprobs.to(dt)
    has_old = ~torch.isnan(old)
    ratio = torch.exp(logprobs - torch.where(has_old, old, logprobs.detach()))
    ppo = -w * torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    plain = -w * adv * logprobs
    terms = torch.where(has_old, ppo, plain)
    n = max(int(terms.shape[0]), 1)
    return terms.sum() / n, terms.detach().abs().sum() / n


@dataclass
class ModeRun:
    """One mode's numbers: per-target log-probs (layout target order), loss, gradients, MoE statistics,
    and the logits of every (trajectory, position) in trajectory-major order."""
    logprobs: torch.Tensor
    loss: torch.Tensor
    loss_scale: torch.Tensor
    grads: Dict[str, torch.Tensor]
    aux: torch.Tensor
    tokens_per_expert: torch.Tensor
    logits: torch.Tensor


def _moe_state(model):
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    tracker = get_moe_layer_wise_logging_tracker()
    vals = [tracker[k]["values"].detach().clone().double().cpu() for k in ("load_balancing_loss", "z_loss")
            if k in tracker]
    aux = torch.cat(vals) if vals else torch.zeros(0, dtype=torch.float64)
    routers = [l.mlp.router for l in model.decoder.layers if getattr(l, "is_moe_layer", False)]
    tpe = torch.stack([r.last_tokens_per_expert.detach().double().cpu() for r in routers]) if routers \
        else torch.zeros(0, dtype=torch.float64)
    return aux, tpe


def _reset(model):
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
    clear_aux_losses_tracker()
    model.zero_grad(set_to_none=True)
    for p in model.parameters():        # a module under megatron DDP: its hooks move .grad to main_grad
        if getattr(p, "main_grad", None) is not None:
            p.main_grad.zero_()
    for l in model.decoder.layers:
        r = getattr(getattr(l, "mlp", None), "router", None)
        if r is not None and getattr(r, "local_tokens_per_expert", None) is not None:
            r.local_tokens_per_expert.zero_()


def _finish(model, lp, layout, logits) -> ModeRun:
    loss, scale = pg_loss(lp, layout.target_weight.to(lp.device), layout.target_advantage.to(lp.device),
                          layout.target_old_logprob.to(lp.device))
    loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad if p.grad is not None else getattr(p, "main_grad", None)
        if g is not None:
            grads[n] = g.detach().clone()
    aux, tpe = _moe_state(model)
    return ModeRun(lp.detach(), loss.detach(), scale, grads, aux, tpe, logits)


def run_tree(model, layout, config, device="cpu") -> ModeRun:
    """Tree mode: one row per unique prefix token (the layout), targets read at their rows."""
    from ..models.packed import TreePackedSeqParams
    lay = layout.to(device)
    psp = TreePackedSeqParams.for_tree(lay, config=config, device=device)
    ids, pos = lay.tokens[None], lay.position_ids[None]
    with torch.no_grad():
        logits = model(ids, pos, packed_seq_params=psp)[:, 0][lay.traj_rows]
    _reset(model)
    lp = model(ids, pos, packed_seq_params=psp, pair_row=lay.pair_row, pair_token=lay.pair_token)[lay.target_pair]
    return _finish(model, lp, lay, logits)


def expanded_batch(forest, layout, device="cpu"):
    """Every trajectory on its own, packed back to back: (tokens, row of each layout target, packed
    params), each trajectory's compaction events applied to its own full attention."""
    from ..layout import sequence_visibility
    from ..models.packed import TreePackedSeqParams
    trajs = [forest.expand(tid) for tid in layout.traj_ids]
    lengths = [len(t) for t in trajs]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    rows = offsets[layout.target_traj.cpu().numpy()] + layout.target_position.cpu().numpy() - 1
    psp = TreePackedSeqParams.for_sequences(lengths, device=device,
                                            visibility=sequence_visibility(lengths, [t.compactions for t in trajs]))
    tokens = torch.as_tensor(np.concatenate([np.asarray(t.tokens) for t in trajs]))
    return tokens.to(device), torch.as_tensor(rows).to(device), psp


def run_expanded(model, forest, layout, config, device="cpu") -> ModeRun:
    """Expanded mode: each trajectory computed as its own sequence; the layout's targets gathered from it."""
    tokens, rows, psp = expanded_batch(forest, layout, device)
    ids, pos = tokens[None], psp.position_ids[None]
    with torch.no_grad():
        logits = model(ids, pos, packed_seq_params=psp)[:, 0]
    _reset(model)
    lp = model(ids, pos, packed_seq_params=psp, pair_row=rows, pair_token=layout.target_token.to(device))
    return _finish(model, lp, layout.to(device), logits)


def upcast_model(model, config, dtype: torch.dtype = torch.float32, *, build=None, **overrides):
    """(model, config) in ``dtype`` holding ``model``'s weights upcast: the oracle of a bf16 run.

    A second model of the same shape is built from ``config`` with ``params_dtype`` (and
    ``pipeline_dtype``) = ``dtype``, no initialization and ``overrides`` (other config fields), on
    ``model``'s device (built by ``build(config)`` when given, e.g. a pipeline stage's builder), and
    ``model``'s state dict (parameters and buffers) is loaded into it.
    bf16 -> fp32 is exact, and it is checked: every floating-point entry of the copy's state dict
    equals the original's, upcast, bitwise, and every parameter is in ``dtype``.  ``model`` is untouched (an in-place upcast would change what its config,
    optimizer or DDP buffers see).
    """
    import dataclasses

    from ..models.model import build_hybrid_model
    # the copy has no DDP main_grad buffers for megatron's fused weight-gradient accumulation to write into
    cfg = dataclasses.replace(config, params_dtype=dtype, pipeline_dtype=dtype, bf16=False, fp16=False,
                              perform_initialization=False, gradient_accumulation_fusion=False, **overrides)
    device = next(model.parameters()).device
    if build is not None:       # e.g. a pipeline stage's chunk: the builder of the original
        up = build(cfg)
    else:
        up = build_hybrid_model(cfg, vocab_size=model.vocab_size, max_sequence_length=model.max_sequence_length,
                                pre_process=model.pre_process, post_process=model.post_process,
                                share_embeddings_and_output_weights=model.share_embeddings_and_output_weights,
                                pg_collection=model.pg_collection, vp_stage=getattr(model, "vp_stage", None))
    up = up.to(device)
    state = model.state_dict()
    up.load_state_dict(state, strict=True)
    ours = up.state_dict()
    for name, v in state.items():
        if torch.is_tensor(v) and v.is_floating_point() and not torch.equal(ours[name], v.to(ours[name].dtype)):
            raise RuntimeError(f"upcast_model: {name} was not copied exactly")
    if any(p.dtype != dtype for p in up.parameters()):
        raise RuntimeError(f"upcast_model: the copy has parameters of another dtype than {dtype}")
    up.train(model.training)
    return up, cfg


@contextlib.contextmanager
def full_fp32_matmuls():
    """fp32 matmuls and convolutions without TF32 for the block (the oracle's precision)."""
    precision, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = cudnn


def run_bf16(model, forest, layout, config, device="cpu"):
    """(tree, expanded, fp32 oracle) runs of a bf16 ``model``: tree and expanded mode in bf16, and
    expanded mode on an fp32 copy of the same weights (reference KDA, no TF32; module docstring)."""
    expanded = run_expanded(model, forest, layout, config, device)
    tree = run_tree(model, layout, config, device)
    up, cfg32 = upcast_model(model, config, torch.float32, kda_backend="reference")
    with full_fp32_matmuls():
        oracle = run_expanded(up, forest, layout, cfg32, device)
    del up
    return tree, expanded, oracle


def _capture_layers(model, forward) -> Dict[str, torch.Tensor]:
    """``forward()`` (no grad) with every decoder layer's attention, MLP and layer outputs and each
    MoE router's routing map recorded, flattened to ``[rows, ...]``, plus ``forward()``'s result
    as ``"logits"``.  Keys: ``"{i}.attention"``, ``"{i}.mlp"``, ``"{i}.output"``, ``"{i}.routing"``."""
    cap, hooks = {}, []

    def keep(name, pick=0):
        def hook(module, args, out):
            t = out[pick] if isinstance(out, tuple) else out
            cap[name] = t.detach().reshape(-1, t.shape[-1])
        return hook
    for i, layer in enumerate(model.decoder.layers):
        hooks.append(layer.self_attention.register_forward_hook(keep(f"{i}.attention")))
        hooks.append(layer.mlp.register_forward_hook(keep(f"{i}.mlp")))
        hooks.append(layer.register_forward_hook(keep(f"{i}.output")))
        router = getattr(layer.mlp, "router", None)
        if router is not None:       # (probs, routing map [tokens, experts])
            hooks.append(router.register_forward_hook(keep(f"{i}.routing", pick=1)))
    try:
        with torch.no_grad():
            logits = forward()
    finally:
        for h in hooks:
            h.remove()
    cap["logits"] = logits.detach().reshape(-1, logits.shape[-1])
    return cap


def layer_errors(model, forest, layout, config, device="cpu") -> Dict[str, list]:
    """Where a bf16 model's rounding grows: per decoder layer, the relative error of the attention,
    MLP and layer outputs (``||x - x_fp32|| / ||x_fp32||`` over every trajectory position) and the
    fraction of positions whose MoE expert set differs from the fp32 oracle's (``routing_flips``),
    for tree mode and expanded mode in the model's dtype against expanded mode on an fp32 copy of the
    weights (the oracle of :func:`run_bf16`); the last entry of each list is the logits.

    ``layout`` must hold whole trajectories (``build_layout(forest)``): tree rows are compared at
    their trajectories' positions (``traj_rows``), in the expanded batch's order."""
    from ..models.packed import TreePackedSeqParams
    tokens, _, seq = expanded_batch(forest, layout, device)
    lay = layout.to(device)
    if lay.num_expanded_tokens != tokens.numel():
        raise ValueError("layer_errors: the layout must hold whole trajectories (build_layout(forest))")
    tree_psp = TreePackedSeqParams.for_tree(lay, config=config, device=device)
    runs = {"tree": _capture_layers(model, lambda: model(lay.tokens[None], lay.position_ids[None],
                                                         packed_seq_params=tree_psp)),
            "expanded": _capture_layers(model, lambda: model(tokens[None], seq.position_ids[None],
                                                             packed_seq_params=seq))}
    at_positions = lay.traj_rows.to(device)
    runs["tree"] = {k: v.index_select(0, at_positions) for k, v in runs["tree"].items()}
    up, _ = upcast_model(model, config, torch.float32, kda_backend="reference")
    with full_fp32_matmuls():
        oracle = _capture_layers(up, lambda: up(tokens[None], seq.position_ids[None], packed_seq_params=seq))
    del up

    def rel(a, b):
        a, b = a.double(), b.double()
        return float((a - b).norm() / b.norm().clamp_min(1e-300))
    out = {}
    for mode, cap in runs.items():
        rows = []
        for i in range(len(model.decoder.layers)):
            entry = {"layer": i, **{part: rel(cap[f"{i}.{part}"], oracle[f"{i}.{part}"])
                                    for part in ("attention", "mlp", "output")}}
            if f"{i}.routing" in cap:
                entry["routing_flips"] = float((cap[f"{i}.routing"] != oracle[f"{i}.routing"]).any(-1)
                                               .double().mean())
            rows.append(entry)
        rows.append({"layer": "logits", "output": rel(cap["logits"], oracle["logits"])})
        out[mode] = rows
    return out


def logit_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over positions of the cosine between the two runs' logit vectors at that position."""
    return float(F.cosine_similarity(a.double(), b.double(), dim=-1).mean())


def _rel(diff: float, scale: float) -> float:
    if diff == 0.0:
        return 0.0
    return diff / scale if scale > 0 else float("inf")


def logprob_diff_stats(d: torch.Tensor, limit: Optional[float] = None) -> dict:
    """max / mean / median of per-target |log-prob differences| ``d`` (0.0 for no targets) and,
    given ``limit`` (the tolerance in nats), how many targets exceed it (None without a limit)."""
    d = d.double()
    n = d.numel()
    return {"max_logprob_abs_diff": float(d.max()) if n else 0.0,
            "mean_logprob_abs_diff": float(d.mean()) if n else 0.0,
            "median_logprob_abs_diff": float(np.median(d.cpu().numpy())) if n else 0.0,
            "logprob_targets_over_tolerance": None if limit is None else int((d > limit).sum())}


def _against(run: ModeRun, oracle: ModeRun) -> dict:
    """Deviation of ``run`` from ``oracle``: logit cosine, log-prob max/mean/median |difference|, loss
    |difference|, largest relative gradient difference (each tensor to the oracle's largest) and
    the tensor it occurs in, and ``sign_step_alignment``: sum(g_oracle * sign(g_run)) /
    sum(|g_oracle|) over all gradients, the first-order loss decrease of a sign step (what Adam's
    first update is) along the run's gradients relative to one along the oracle's (1 = as good)."""
    d = (run.logprobs.double().cpu() - oracle.logprobs.double().cpu()).abs()
    grad, worst, along, best = 0.0, "", 0.0, 0.0
    for n, go in oracle.grads.items():
        g = run.grads.get(n)
        if g is None:
            grad, worst, along = float("inf"), n, float("nan")
            break
        go, g = go.double().cpu(), g.double().cpu()
        rel = _rel(float((g - go).abs().max()), float(go.abs().max()))
        if not worst or rel > grad:
            grad, worst = rel, n
        along += float((go * g.sign()).sum())
        best += float(go.abs().sum())
    stats = logprob_diff_stats(d)
    del stats["logprob_targets_over_tolerance"]         # the bf16 rule has no per-target tolerance
    return {"logit_cosine": logit_cosine(run.logits, oracle.logits), **stats,
            "loss_abs_diff": abs(float(run.loss) - float(oracle.loss)),
            "max_grad_rel_diff": grad, "worst_grad": worst,
            "sign_step_alignment": along / best if best > 0 else float("nan")}


def bf16_verdict(tree: ModeRun, expanded: ModeRun, oracle: ModeRun) -> dict:
    """The bf16 rule's fields (module docstring): each of tree and expanded bf16 against the fp32
    oracle (``<measure>_tree_vs_fp32`` / ``<measure>_expanded_vs_fp32``), the thresholds the tree
    must meet (``bf16_min_logit_cosine``, ``bf16_max_mean_logprob_abs_diff``) and ``failed``."""
    t, e = _against(tree, oracle), _against(expanded, oracle)
    out = {f"{k}_tree_vs_fp32": v for k, v in t.items()}
    out.update({f"{k}_expanded_vs_fp32": v for k, v in e.items()})
    out["loss_fp32"] = float(oracle.loss)
    out["bf16_min_logit_cosine"] = 1.0 - (BF16_COSINE_FACTOR * (1.0 - e["logit_cosine"]) + BF16_COSINE_FLOOR)
    out["bf16_max_mean_logprob_abs_diff"] = BF16_LOGPROB_FACTOR * e["mean_logprob_abs_diff"] + BF16_LOGPROB_FLOOR
    out["tolerance"] = (f"vs fp32 oracle: 1 - logit_cosine_tree <= {BF16_COSINE_FACTOR} * (1 - logit_cosine_expanded)"
                        f" + {BF16_COSINE_FLOOR:g}; mean_logprob_abs_diff_tree <= {BF16_LOGPROB_FACTOR} * "
                        f"mean_logprob_abs_diff_expanded + {BF16_LOGPROB_FLOOR:g}")
    failed = []
    if not t["logit_cosine"] >= out["bf16_min_logit_cosine"]:
        failed.append("logit_cosine_tree_vs_fp32")
    if not t["mean_logprob_abs_diff"] <= out["bf16_max_mean_logprob_abs_diff"]:
        failed.append("mean_logprob_abs_diff_tree_vs_fp32")
    out["failed"] = failed
    return out


def fidelity_report(tree: ModeRun, expanded: ModeRun, dtype: str, fp32_oracle: Optional[ModeRun] = None,
                    oracle_logprobs: Optional[torch.Tensor] = None) -> dict:
    """Differences of ``tree`` against ``expanded`` and the verdict ``pass`` (module docstring).

    ``dtype`` is "float64", "float32" or "bfloat16"; bf16 needs ``fp32_oracle`` (expanded mode on
    the same weights in fp32, :func:`run_bf16`) and judges by :func:`bf16_verdict`, whose fields
    join the report; the tree-vs-expanded fields are then information.  ``oracle_logprobs``:
    transformers' per-target log-probs (compared with expanded, fields ``oracle_*``).
    Each log-prob comparison reports max, mean and median |difference| and
    ``logprob_targets_over_tolerance``: how many targets differ by more than the tolerance times
    the reference's largest |log-prob| (None where ``dtype`` has no per-target tolerance: bf16).
    """
    if dtype not in ("float64", "float32", "bfloat16"):
        raise ValueError(f"dtype must be float64, float32 or bfloat16, got {dtype!r}")
    if dtype == "bfloat16" and fp32_oracle is None:
        raise ValueError("bfloat16 needs the fp32 oracle run (fp32_oracle: expanded mode on the weights in fp32)")
    lp_t, lp_e = tree.logprobs.double().cpu(), expanded.logprobs.double().cpu()
    d = (lp_t - lp_e).abs()
    lp_scale = float(lp_e.abs().max()) if lp_e.numel() else 0.0
    tol = TOLERANCE.get(dtype)
    grad_rel, worst = 0.0, None
    names = set(tree.grads) | set(expanded.grads)
    for n in sorted(names):
        if n not in tree.grads or n not in expanded.grads:
            grad_rel, worst = float("inf"), n
            break
        ge, gt = expanded.grads[n].double().cpu(), tree.grads[n].double().cpu()
        r = _rel(float((gt - ge).abs().max()), float(ge.abs().max()))
        if worst is None or r > grad_rel:
            grad_rel, worst = r, n
    loss_diff = abs(float(tree.loss) - float(expanded.loss))
    if tree.aux.shape == expanded.aux.shape:
        aux_diff = float((tree.aux - expanded.aux).abs().max()) if tree.aux.numel() else 0.0
    else:
        aux_diff = float("inf")
    aux_scale = float(expanded.aux.abs().max()) if expanded.aux.numel() else 0.0
    tpe_equal = tree.tokens_per_expert.shape == expanded.tokens_per_expert.shape and \
        bool(torch.equal(tree.tokens_per_expert, expanded.tokens_per_expert))
    report = {
        "dtype": dtype,
        "num_targets": int(lp_e.numel()),
        **logprob_diff_stats(d, None if tol is None else tol * lp_scale),
        "max_logprob_rel_diff": _rel(float(d.max()) if d.numel() else 0.0, lp_scale),
        "loss_tree": float(tree.loss), "loss_expanded": float(expanded.loss),
        "loss_abs_diff": loss_diff,
        "loss_rel_diff": _rel(loss_diff, float(expanded.loss_scale)),
        "max_grad_rel_diff": grad_rel, "worst_grad": worst, "num_grads": len(expanded.grads),
        "aux_loss_abs_diff": aux_diff, "aux_loss_rel_diff": _rel(aux_diff, aux_scale),
        "tokens_per_expert_equal": tpe_equal,
        "logit_cosine": logit_cosine(tree.logits, expanded.logits),
        **{f"oracle_{k}": None for k in logprob_diff_stats(d)}, "oracle_max_logprob_rel_diff": None,
    }
    failed = []
    if tol is not None:
        report["tolerance"] = tol
        for key in ("max_logprob_rel_diff", "loss_rel_diff", "max_grad_rel_diff", "aux_loss_rel_diff"):
            if not report[key] <= tol:
                failed.append(key)
        if not tpe_equal:
            failed.append("tokens_per_expert_equal")
    else:
        verdict = bf16_verdict(tree, expanded, fp32_oracle)
        failed.extend(verdict.pop("failed"))
        report.update(verdict)
    if oracle_logprobs is not None:
        o = oracle_logprobs.double().cpu()
        o_scale = float(o.abs().max()) if o.numel() else 0.0
        o_tol = ORACLE_TOLERANCE.get(dtype)
        stats = logprob_diff_stats((lp_e - o).abs(), None if o_tol is None else o_tol * o_scale)
        report.update({f"oracle_{k}": v for k, v in stats.items()})
        report["oracle_max_logprob_rel_diff"] = _rel(stats["max_logprob_abs_diff"], o_scale)
        if dtype in ORACLE_TOLERANCE and not report["oracle_max_logprob_rel_diff"] <= ORACLE_TOLERANCE[dtype]:
            failed.append("oracle_max_logprob_rel_diff")
    report["failed"] = failed
    report["pass"] = not failed
    return report


KIMI_LINEAR_MODELING = "transformers.models.kimi_linear.modeling_kimi_linear"
# packages whose kernels transformers may hand a Kimi-Linear layer's tensors (Triton/CUDA only)
KERNEL_PACKAGES = ("fla", "causal_conv1d")


def _defined_in(obj, packages) -> bool:
    mod = getattr(obj, "__module__", None) or ""
    return any(mod == p or mod.startswith(p + ".") for p in packages)


def _torch_reference(obj, home: str):
    """The plain function of file ``home`` that ``obj`` dispatches to kernels for, or None.

    Follows ``__wrapped__`` (transformers' ``use_kernel_func_from_hub_with_fallback`` wraps the
    torch implementation with ``functools.wraps``) and the ``kernels`` library's function modules
    (``use_kernel_forward_from_hub`` on a function: an ``nn.Module`` whose ``forward`` calls the
    function it was made from, its closure variable ``func``)."""
    seen = set()
    while obj is not None and id(obj) not in seen:
        seen.add(id(obj))
        wrapped = getattr(obj, "__wrapped__", None)
        if wrapped is not None:
            obj = wrapped
        elif isinstance(obj, torch.nn.Module):
            forward = type(obj).forward
            cells = dict(zip(forward.__code__.co_freevars, forward.__closure__ or ()))
            obj = cells["func"].cell_contents if "func" in cells else None
        elif callable(obj) and getattr(getattr(obj, "__code__", None), "co_filename", None) == home:
            return obj
        else:
            return None
    return None


@contextlib.contextmanager
def kimi_linear_torch_path():
    """transformers' Kimi-Linear on its plain torch code for the block, whatever kernels are installed.

    transformers picks fla's KDA kernels (``chunk_kda``, ``fused_recurrent_kda``) and
    causal-conv1d's convolutions when they import, and depending on the transformers version also
    for CPU tensors (Triton then fails: "Pointer argument cannot be accessed from Triton (cpu
    tensor?)"); on CUDA they compute in fp32/TF32, not in the oracle's dtype.  Inside the block,
    every module-level function of the modeling file that dispatches to kernels is its own torch
    implementation (:func:`_torch_reference`), and any name the module bound to an object of
    those packages (older transformers import them at module level and choose when a layer is
    built) is None, which selects the torch fallbacks.  Everything is restored on exit; nesting
    is allowed."""
    import importlib
    mod = importlib.import_module(KIMI_LINEAR_MODELING)
    home = mod.__file__
    saved = {}
    for name, value in list(vars(mod).items()):
        if name.startswith("__"):
            continue
        if _defined_in(value, KERNEL_PACKAGES):
            saved[name] = value
            continue
        dispatches = hasattr(value, "__wrapped__") or isinstance(value, torch.nn.Module)
        if isinstance(value, type) or not (callable(value) and dispatches):
            continue
        plain = _torch_reference(value, home)
        if plain is not None and plain is not value:
            saved[name] = value
    try:
        for name, value in saved.items():
            setattr(mod, name, None if _defined_in(value, KERNEL_PACKAGES) else _torch_reference(value, home))
        yield
    finally:
        for name, value in saved.items():
            setattr(mod, name, value)


def hf_oracle_model(model, config, vocab_size: int, dtype: torch.dtype = torch.float64, device="cpu"):
    """transformers' KimiLinearForCausalLM holding ``model``'s weights (parameters and the expert
    bias), in eval mode, in ``dtype`` on ``device`` (docs/design.md invariant 4's oracle).  Built inside
    :func:`kimi_linear_torch_path`, so no layer holds a kernel chosen at build time."""
    from transformers import KimiLinearForCausalLM

    from ..models.hf_convert import kimi_linear_hf_config, megatron_to_hf
    hf_cfg = kimi_linear_hf_config(config, vocab_size, rms_norm_eps=config.layernorm_epsilon)
    hf_cfg._experts_implementation = "eager"        # its grouped-mm experts reject float64
    state = {k: v.detach().cpu() for k, v in {**dict(model.named_parameters()),
                                              **dict(model.named_buffers())}.items()}
    with kimi_linear_torch_path():
        with torch.device("meta"):
            hf = KimiLinearForCausalLM(hf_cfg)
        missing, unexpected = hf.load_state_dict(megatron_to_hf(state, config), strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(f"oracle weights: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return hf.to(device=device, dtype=dtype).eval()


def eviction_mask(length: int, compactions=None, device=None) -> torch.Tensor:
    """Boolean ``[length, length]``: query i may attend key j in a full-attention (MLA) layer.

    True exactly when ``j <= i`` and no event ``(at, start, end)`` of ``compactions`` (``[E, 3]``,
    None or empty for none) has ``start <= j < end`` and ``at <= i``: from token ``at`` on, the
    span ``[start, end)`` is evicted.  Events satisfy ``0 <= start < end <= at < length``
    (``Trajectory.compactions``), so every query keeps its own key."""
    allowed = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    if compactions is not None:
        for at, start, end in np.asarray(compactions, dtype=np.int64).reshape(-1, 3).tolist():
            if not 0 <= start < end <= at < length:
                raise ValueError(f"compaction event (at={at}, start={start}, end={end}) needs "
                                 f"0 <= start < end <= at < {length}")
            allowed[at:, start:end] = False
    return allowed


def hf_logprobs(hf, tokens, compactions=None) -> torch.Tensor:
    """Per-position log-probs ``[T, vocab]`` (float64, CPU) of transformers' Kimi-Linear ``hf``
    over one trajectory's ``tokens`` (``[T]``): row i is log p(. | tokens[:i+1]).

    ``compactions`` (``Trajectory.compactions``: ``[E, 3]`` events ``(at, start, end)``, or None)
    evicts in the full-attention (MLA) layers only, by :func:`eviction_mask`; KDA layers and their
    short convolutions see the whole stream; positions stay 0..T-1.  An empty ``[0, 3]`` array
    takes the masked path and gives the unmasked numbers.  The forward runs transformers' plain
    torch code (:func:`kimi_linear_torch_path`) on whatever device ``hf`` is."""
    device = next(hf.parameters()).device
    ids = torch.as_tensor(np.asarray(tokens), dtype=torch.long, device=device).reshape(1, -1)
    mask = None
    if compactions is not None:
        dtype = next(hf.parameters()).dtype
        allowed = eviction_mask(ids.shape[1], compactions, device=device)
        additive = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
        # a dict is taken as the per-layer-type masks as they are: MLA gets the 4-D additive
        # mask, KDA layers None (their padding mask; nothing is padding)
        mask = {"full_attention": additive[None, None], "linear_attention": None}
    with torch.no_grad(), kimi_linear_torch_path():
        logits = hf(ids, attention_mask=mask).logits[0]
    return logits.double().log_softmax(-1).cpu()


def oracle_logprobs(model, config, vocab_size: int, forest, layout, device="cpu",
                    dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """transformers' KimiLinearForCausalLM with ``model``'s weights, each trajectory on its own
    (its compaction events applied, :func:`hf_logprobs`): the log-probs of the layout's targets.

    In ``dtype`` (float64) on ``device`` (the CPU by default, whatever device ``model`` is on),
    always through transformers' plain torch code (:func:`kimi_linear_torch_path`)."""
    hf = hf_oracle_model(model, config, vocab_size, dtype=dtype, device=device)
    target_traj, target_pos, target_tok = (x.cpu() for x in (layout.target_traj, layout.target_position,
                                                              layout.target_token))
    out = torch.empty(layout.num_targets, dtype=torch.float64)
    for t, tid in enumerate(layout.traj_ids):
        sel = torch.nonzero(target_traj == t)[:, 0]
        if sel.numel() == 0:
            continue
        traj = forest.expand(tid)
        logp = hf_logprobs(hf, traj.tokens, traj.compactions)
        out[sel] = logp[target_pos[sel] - 1, target_tok[sel]]
    return out
