#!/usr/bin/env python3
"""Update throughput: tree mode vs expanded (trajectory-by-trajectory) training, one run, one GPU.

For each rollout scheme (SWE-like synthetic Tree-Step and Step-wise rollouts), the same global
batch of trajectories is trained by the same Kimi-Linear-shaped model (bf16, KDA:MLA 3:1, MoE)
through the training driver (``training.trainer.Trainer``, i.e. exactly what
``pretrain_tree_gpt.py`` runs): forward + backward + optimizer step per iteration, the same
flags except ``--tree-sharing`` (``off`` for expanded; for tree mode each of ``--tree-sharing``'s
modes: ``within``, L1 plans with sharing inside microbatches, and/or ``windows``, L1+L2 plans
with producer/consumer windows across microbatches; same ``--tree-microbatch-tokens`` budget).
All runs start from the same initial weights (same seed).  Reported per scheme and mode: step time (median of the timed iterations after
warm-up), update throughput (trajectory tokens per second), rows computed, within-microbatch
compression (trajectory tokens / rows computed), KDA calls (summed over microbatches),
peak memory, model FLOPs (``model_flops``: dense 6 x parameters a row passes through x rows
computed; MLA attention 2 x visible pairs x heads x (q/k dim + v dim) x 3 per MLA layer, over the
pairs the mode executed: tree mode's layout pairs, expanded mode's causal pairs per trajectory,
evicted keys left out; the KDA chunk algorithm's core; the output layer at the vocabulary on the
rows that carry targets), MFU (model FLOPs / (time x bf16 peak)), and the speedup; plus, for tree mode,
KDA calls per layer of the HARTS call plan vs per-depth bucketing (``planner.baselines``) over
the step's whole forest, and the logit cosine between tree and expanded mode on a sample of one
tree at the initial weights (``testing.fidelity``).  ``--kda-call-plans per-depth node-wise`` adds
the ablations: the same tree step (``within``) with per-depth bucketing's and node-wise KDA
calls instead of HARTS' plan.  ``--profile FILE`` profiles one more step of every mode: wall
time against GPU kernel time (a GPU waiting for the host shows as wall >> kernels), kernel time
per category, the host synchronizations by source line, and per tree mode ``kernel_speedup``
(expanded's kernel time over the mode's: the speedup a host fast enough to keep the GPU busy
would show; the step times of a host-bound run move with the host's speed).  ``--memory-profile``
records one more step of every mode under the CUDA allocator's history: the bytes alive at the
step's peak by allocation site (``memory_at_peak``).  Every mode records its step's peak as the driver's
memory model predicts it (``predicted_peak_gib``), as the allocator measured it (``measured_peak_gib``; None
on the CPU), the memory budget and how many of its windows recomputed their producer; windows run with
the driver's default budget (expanded mode's), ``--recompute-producers`` and ``--keep-producers`` add
windows with every producer recomputed and with every producer kept.

Presets (``PRESETS``, also read by bench_compaction, calibrate_cost and step_fidelity): ``h200`` and
``h200-2k`` (Kimi-Linear-shaped, hidden 1024 / 2048), ``kimi48b-layers`` (Kimi-Linear-48B-A3B's
per-layer shapes as one rank of 8-way expert parallelism holds them: ``KIMI48B_LAYERS``; 16 layers,
every layer recomputed in the backward; ``memory_estimate`` sizes it) and ``tiny`` (CPU smoke runs).
``--layers`` changes a preset's layer count, ``--max-turns`` / ``--observation-median`` /
``--max-leaves`` let trajectories reach a ``--max-tokens`` of 64k-128k (``--branch-prob`` /
``--branch-factor`` set where a Tree-Step rollout forks), and ``--plan-only`` prints
each mode's rows, pairs, model FLOPs and estimated peak memory without training.

``--peer`` trains the same batch with the peer baseline, transformers' Kimi-Linear trajectory by
trajectory with its fastest kernels (``peer_hf.py``), and reports every mode's tokens/s over its
(``tokens_per_s_over_peer``).

Targets: speedup >= 0.8 x compression; Step-wise >= 7x and Tree-Step >= 3.9x at the
paper's compression levels; logit cosine >= 0.9997; tree-mode peak memory <= expanded.

Writes ``--out`` (JSON: machine, versions, every figure).  Needs CUDA (``--device cpu`` with a
tiny ``--preset`` is a smoke run only).
"""
import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))     # benchmarks/: peer_hf

import numpy as np  # noqa: E402
import torch  # noqa: E402

from megatron_harts.cli import ArgumentParser, CliError, run  # noqa: E402
from megatron_harts.planner.memory import state_bytes_per_parameter  # noqa: E402

PRESETS = {
    # Kimi-Linear-shaped, fits one H200 with bf16 and the driver's default (non-distributed) optimizer
    "h200": dict(layers=12, hidden=1024, heads=16, ffn=4096, experts=32, topk=8, moe_ffn=512, vocab=32000,
                 kv_lora=256, qk=64, rope=32, v=64, lin_head=64),
    # the same shape at hidden 2048 (~2.6B parameters): more GPU work per row for the same host work
    "h200-2k": dict(layers=12, hidden=2048, heads=16, ffn=8192, experts=32, topk=8, moe_ffn=1024, vocab=32000,
                    kv_lora=512, qk=128, rope=64, v=128, lin_head=128),
    # Kimi-Linear-48B-A3B's layers as one rank of 8-way expert parallelism holds them (32 of its 256
    # experts; KIMI48B_LAYERS, docs/benchmarks.md), 16 of its 27 layers: 4.9B parameters, 88 GB of
    # weights, gradients and Adam state; every layer recomputed in the backward (memory_estimate)
    "kimi48b-layers": dict(layers=16, hidden=2304, heads=32, ffn=9216, experts=32, topk=8, moe_ffn=1024,
                           vocab=163840, kv_lora=512, qk=128, rope=64, v=128, lin_head=128, lin_heads=32,
                           shared_ffn=1024, recompute="full"),
    "tiny": dict(layers=4, hidden=64, heads=2, ffn=128, experts=4, topk=2, moe_ffn=32, vocab=512,
                 kv_lora=16, qk=16, rope=8, v=16, lin_head=16),
}
#: what ``kimi48b-layers`` keeps of Kimi-Linear-48B-A3B (the released checkpoint's config) and what
#: it cuts; docs/benchmarks.md explains the choice
KIMI48B_LAYERS = {
    "model": "moonshotai/Kimi-Linear-48B-A3B",
    "kept": "hidden 2304; MLA: 32 heads, kv_lora_rank 512, q/k nope 128 + rope 64, v 128, no q LoRA; KDA: 32 "
            "heads of 128 (keys and values), short conv 4; dense first MLP 9216; MoE: experts 1024 wide, top-8 "
            "sigmoid routing with expert bias, one shared expert 1024 wide; vocabulary 163,840; 3 KDA : 1 MLA",
    "per_rank": "32 local experts: one rank's share of 256 experts under 8-way expert parallelism (top-8 routing "
                "over the 32, so every token's 8 experts are local: the expert compute per token is the real "
                "model's, the all-to-all is not there)",
    "cut": "16 of 27 layers (weights, gradients and optimizer state of 27 layers x 32 experts do not fit one "
           "141 GB H200 beside 32k-row activations); no expert-parallel communication; routed scaling 2.5",
}
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12}
#: a stack frame in these is the project's (profiles name the first such frame as the site)
PROJECT_ROOTS = (os.sep + "megatron_harts" + os.sep, os.sep + "megatron" + os.sep)


def check_device(device: str) -> None:
    """CliError unless the driver would train on ``device``: CUDA when asked for must be visible, and
    a CPU measurement needs CUDA hidden (the driver trains on a visible GPU)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda: no CUDA device is visible here (use --device cpu --preset tiny for a smoke run)")
    if device == "cpu" and torch.cuda.is_available():
        raise CliError("--device cpu: a CUDA device is visible and the training driver trains on it; hide it "
                       "(CUDA_VISIBLE_DEVICES=) to measure on the CPU")


#: driver flags of a preset's ``recompute`` entry: "full" recomputes every layer in the backward
#: (only each layer's input is kept), megatron's uniform full recomputation of one layer at a time
RECOMPUTE_FLAGS = {"full": "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
                   None: ""}


def model_flags(p, dtype_flag):
    """Driver flags of a preset's model: every shape of ``p`` (KDA heads ``lin_heads``, default the
    attention heads; shared expert ``shared_ffn``, default ``moe_ffn``; ``recompute``, default none).
    The router computes in fp32 (``--moe-router-dtype fp32``), as Kimi-Linear's gate does
    (``hf_convert`` sets the same), except under ``--fp64`` (fp64 throughout)."""
    router = "" if "--fp64" in dtype_flag else " --moe-router-dtype fp32"
    lin_heads = p.get("lin_heads", p["heads"])
    recompute = RECOMPUTE_FLAGS[p.get("recompute")]
    return (f"--num-layers {p['layers']} --hidden-size {p['hidden']} --num-attention-heads {p['heads']} "
            f"--ffn-hidden-size {p['ffn']} --swiglu --disable-bias-linear --multi-latent-attention "
            f"--kv-lora-rank {p['kv_lora']} --qk-head-dim {p['qk']} --qk-pos-emb-head-dim {p['rope']} "
            f"--v-head-dim {p['v']} --linear-attention-freq 4 --linear-num-key-heads {lin_heads} "
            f"--linear-num-value-heads {lin_heads} --linear-key-head-dim {p['lin_head']} "
            f"--linear-value-head-dim {p['lin_head']} --num-experts {p['experts']} --moe-router-topk {p['topk']} "
            f"--moe-ffn-hidden-size {p['moe_ffn']} "
            f"--moe-shared-expert-intermediate-size {p.get('shared_ffn', p['moe_ffn'])} "
            f"--moe-layer-freq ([0]+[1]*{p['layers'] - 1}) --moe-router-score-function sigmoid "
            f"--moe-router-enable-expert-bias --moe-router-topk-scaling-factor 2.5 --moe-aux-loss-coeff 0.001 "
            f"--vocab-size {p['vocab']} --untie-embeddings-and-output-weights {recompute} {dtype_flag}{router}"
            ).split()


def synthesize(scheme, num_tasks, max_tokens, vocab, seed, samples_per_task=2, **shape):
    """The scheme's SWE-like forest; ``shape``: more ``SweConfig`` fields (``max_turns``,
    ``observation_median``...: trajectories reach ``max_tokens`` only where their turns allow it;
    a turn cap under the default minimum lowers the minimum)."""
    from megatron_harts.tree_data import build_forest
    from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe
    cfg = SweConfig(scheme=scheme, num_tasks=num_tasks, samples_per_task=samples_per_task, max_tokens=max_tokens,
                    vocab_size=vocab, seed=seed, **shape)
    cfg.min_turns = min(cfg.min_turns, cfg.max_turns)
    return build_forest(synthesize_swe(cfg))


def layer_kinds(p):
    """Per layer (attention, MLP): ``--linear-attention-freq 4`` makes every 4th layer MLA, the others
    KDA; ``--moe-layer-freq ([0]+[1]*(L-1))`` makes the first MLP dense, the others MoE."""
    return [("mla" if (i + 1) % 4 == 0 else "kda", "dense" if i == 0 else "moe") for i in range(p["layers"])]


def parameter_counts(p):
    """Parameters of a preset's model by part (every weight the driver builds, norms included):
    ``embedding``, ``output``, ``final_norm``, per layer kind ``kda`` / ``mla`` (attention and its input
    norm), ``dense`` / ``moe`` (MLP and its norm; ``moe`` all local experts), ``moe_active`` (what one
    token passes through: norm, router, top-k experts, shared expert) and ``total``."""
    h, H, d = p["hidden"], p["heads"], p["lin_head"]
    Hk = p.get("lin_heads", H)
    hd = Hk * d
    kda = (h                                   # input norm
           + 3 * hd * h + 3 * hd * 4           # q, k, v projections and their short convolutions
           + Hk * h                            # beta
           + 2 * (d * h + hd * d)              # decay gate f and output gate g, low rank d
           + Hk + hd + d                       # A_log, dt_bias, output norm
           + h * hd)                           # output projection
    mla = (h + p["kv_lora"]                    # input norm, latent norm
           + H * (p["qk"] + p["rope"]) * h      # queries (no q LoRA)
           + (p["kv_lora"] + p["rope"]) * h     # key/value down projection (and the rope key)
           + p["kv_lora"] * H * (p["qk"] + p["v"])  # key/value up projection
           + H * p["v"] * h)                    # output projection
    expert = 3 * h * p["moe_ffn"]
    shared = 3 * h * p.get("shared_ffn", p["moe_ffn"])
    counts = {"embedding": p["vocab"] * h, "output": p["vocab"] * h, "final_norm": h, "kda": kda, "mla": mla,
              "dense": h + 3 * h * p["ffn"], "moe": h + h * p["experts"] + p["experts"] * expert + shared,
              "moe_active": h + h * p["experts"] + p["topk"] * expert + shared}
    counts["total"] = counts["embedding"] + counts["output"] + h + sum(counts[a] + counts[m]
                                                                       for a, m in layer_kinds(p))
    return counts


def kda_core_flops_per_token(p, chunk=64):
    """Forward FLOPs of the chunked KDA core per token and layer, all heads (fla's chunk algorithm,
    chunk C = ``chunk``, key dim dk, value dim dv per head): within a chunk the key-key and
    query-key products (C x dk each), the triangular inverse (about C^2/3), W = A K and U = A V
    (C x dk, C x dv) and the intra-chunk output (C x dv); across chunks q S, W S and the state
    update (dk x dv each); 2 FLOPs per multiply-add."""
    dk = dv = p["lin_head"]
    return 2 * p.get("lin_heads", p["heads"]) * (3 * dk * dv + chunk * (3 * dk + 2 * dv) + chunk * chunk / 3)


def model_flops(p, rows, pairs, logits_rows):
    """Model FLOPs of one step's forward + backward (the MFU numerator), by term:

    * ``dense``: 6 x (parameters a row passes through in every layer: KDA / MLA projections, the
      dense MLP or MoE's router, top-k experts and shared expert, norms) x rows computed;
    * ``attention``: MLA's scores and weighted values, 2 x pairs x heads x (q/k dim + v dim) forward
      (q/k dim = nope + rope) per MLA layer, x 3 for forward + backward; ``pairs`` is the step's
      visible (query, key) pairs of one MLA layer: tree mode's over its layouts (ancestor-or-self,
      a consumer's context keys included), expanded mode's each trajectory's causal pairs, evicted
      keys left out in both;
    * ``kda``: ``kda_core_flops_per_token`` x rows per KDA layer, x 3;
    * ``output``: the output layer at the vocabulary, 6 x hidden x vocab per row that carries a
      target (``logits_rows``: the only rows whose logits are computed).

    Not counted: activation recomputation and KDA replay tokens (work a mode adds, not the
    model's), softmax and norms' elementwise work, the embedding lookup."""
    c = parameter_counts(p)
    kinds = layer_kinds(p)
    per_row = sum(c[a] + (c["moe_active"] if m == "moe" else c["dense"]) for a, m in kinds)
    n_mla = sum(a == "mla" for a, _ in kinds)
    terms = {"dense": 6.0 * per_row * rows,
             "attention": 3.0 * 2.0 * pairs * p["heads"] * (p["qk"] + p["rope"] + p["v"]) * n_mla,
             "kda": 3.0 * kda_core_flops_per_token(p) * rows * (len(kinds) - n_mla),
             "output": 6.0 * p["hidden"] * p["vocab"] * logits_rows}
    terms["total"] = sum(terms.values())
    return terms


def logits_rows(plan) -> int:
    """Rows of a plan whose logits are computed: each microbatch's owned rows that carry a target
    (tree mode: a row once, whatever its targets; expanded mode: every target's row)."""
    return int(sum(m.features.logits_rows for m in plan.microbatches) + pieces_accounting(plan)["logits_rows"])


#: bytes per parameter under the driver's bf16 training: bf16 weight 2, fp32 gradient buffer 4, fp32
#: main weight 4, Adam's two fp32 moments 8 (megatron-core's mixed-precision optimizer, not distributed)
BYTES_PER_PARAM = int(state_bytes_per_parameter(2))    # 18


def activation_bytes_per_row(p):
    """Estimated bytes of a row's saved activations per layer part in a bf16 forward without
    recomputation: the package's memory model (``planner.memory.activation_bytes_per_row``, the same
    one ``--tree-memory-budget`` uses) on the preset's shape."""
    from megatron_harts.planner.memory import ModelShape
    from megatron_harts.planner.memory import activation_bytes_per_row as per_row
    return per_row(ModelShape.from_preset(p))


def memory_estimate(p, rows, recompute=None, activations=None):
    """Estimated peak bytes of a bf16 training step on one GPU whose largest microbatch has ``rows``
    rows: ``weights_optimizer`` (``BYTES_PER_PARAM`` x parameters); ``activations`` (given: a step's
    live activation bytes as the driver's memory model predicts them, :func:`step_activation_bytes`;
    else one microbatch's: ``planner.memory.saved_bytes_per_row`` x rows, every layer's activations
    without recomputation, with ``recompute="full"`` each layer's input plus the largest layer's
    activations while its backward runs); ``output`` (the log-prob op at its default chunk,
    ``planner.memory.output_bytes``); ``total`` (``planner.memory.step_peak_bytes``: the weights beside
    the larger of the activations and the output layer's phase); and per layer kind its parameter bytes
    and activation bytes per row (``per_layer``).  The driver's own prediction (``predicted_peak_gib``)
    is the same function of the same terms.  An estimate to size a run, not a measurement."""
    from megatron_harts.ops.logprobs import default_chunk_rows
    from megatron_harts.planner.memory import ModelShape, output_bytes, saved_bytes_per_row, step_peak_bytes
    c = parameter_counts(p)
    act = activation_bytes_per_row(p)
    kinds = layer_kinds(p)
    shape = ModelShape.from_preset(dict(p, recompute=recompute))
    if activations is None:
        activations = rows * saved_bytes_per_row(shape)
    chunk = min(default_chunk_rows(p["vocab"], torch.bfloat16), max(1, rows))
    output = output_bytes(p["hidden"], p["vocab"], 2, chunk, rows)
    weights = BYTES_PER_PARAM * c["total"]
    per_layer = {f"{a}+{m}": {"parameter_bytes": BYTES_PER_PARAM * (c[a] + c[m]),
                              "activation_bytes_per_row": act[a] + act[m]} for a, m in sorted(set(kinds))}
    total = step_peak_bytes(shape, state_bytes=weights, activation_bytes=int(activations), output=output,
                            largest_rows=rows)
    return {"parameters": c["total"], "weights_optimizer": weights, "activations": int(activations),
            "output": output, "total": int(total), "per_layer": per_layer}


def driver_model_config(p, forest, microbatch_tokens):
    """The model config the driver builds for preset ``p`` training ``forest`` (bf16, on the CPU: only
    its shapes are read)."""
    from megatron_harts.training.arguments import hybrid_config, parse_args
    flags = model_flags(p, "--bf16") + ["--seq-length", str(int(forest.traj_length.max())), "--global-batch-size", "1",
                                        "--train-iters", "1", "--lr", "1e-5", "--distributed-backend", "gloo",
                                        "--tree-microbatch-tokens", str(microbatch_tokens)]
    return hybrid_config(parse_args(flags, require_data=False), device="cpu")


def step_activation_bytes(cfg, forest, plan, settings) -> int:
    """The live activation bytes of a planned step at its peak as the driver predicts them
    (``schedules.windows.step_memory_plan`` on replica 0's microbatches, pieces and windows included;
    windows decided under the default memory budget, as the driver does; read pieces of long paths
    recomputed, the least memory they take: ``--tree-piece-keep none``); ``cfg``: :func:`driver_model_config`."""
    from megatron_harts.planner.memory import ModelShape, default_budget_bytes
    from megatron_harts.schedules.windows import step_memory_plan
    from megatron_harts.training.step import replica_microbatches
    budget = default_budget_bytes(ModelShape.from_config(cfg), settings.microbatch_tokens) \
        if settings.sharing == "windows" else None
    mbs = replica_microbatches(forest, plan, 0, settings)
    return step_memory_plan(mbs, cfg, budget_bytes=budget, piece_keep="none").predicted_peak_bytes


def pieces_accounting(plan) -> dict:
    """What the step computes for a plan's pieces (``plan.pieces``: trees with a path longer than the
    row budget, cut into microbatches that read the earlier pieces' exports), as the step builds
    them: rows, the largest piece's rows, visible pairs (context keys included) and logits rows;
    zeros where the plan has none."""
    from megatron_harts.schedules.windows import piece_microbatches
    from megatron_harts.training.step import visible_pairs as batch_pairs
    out = {"rows": 0, "largest": 0, "pairs": 0, "logits_rows": 0, "microbatches": 0}
    if getattr(plan, "pieces", None) is None:
        return out
    if _PIECES.get("plan") is plan:
        return _PIECES["out"]
    for r in range(plan.num_replicas):
        for mb in piece_microbatches(plan, r):
            lay = mb.layout
            out["rows"] += lay.num_rows
            out["largest"] = max(out["largest"], lay.num_rows)
            out["pairs"] += batch_pairs(lay)
            rows = lay.target_row if mb.owned is None else lay.target_row[mb.owned]
            out["logits_rows"] += int(torch.unique(rows).numel())
            out["microbatches"] += 1
    _PIECES.update(plan=plan, out=out)
    return out


_PIECES: dict = {}     # the last plan pieces_accounting built, and its figures


def visible_pairs(plan):
    """Attention pairs of the step's microbatches as planned (tree: ancestor-or-self; expanded: causal),
    pieces included."""
    return float(sum(m.features.attention_pairs for m in plan.microbatches) + pieces_accounting(plan)["pairs"])


def warmup_forest(forest, trajectories):
    """The batch's ``trajectories`` longest trajectories as a forest of their own (None: the whole
    batch), and, where none of them forks from another but the longest one forks from some trajectory
    of the batch, the longest such trajectory too: a warm-up step over it meets the step's kernels,
    pieces and a fork's state hand-off included, at a fraction of a long batch's cost."""
    from megatron_harts.tree_data import build_forest
    if trajectories is None or trajectories >= forest.num_trajectories:
        return forest
    order = [int(t) for t in np.argsort(-forest.traj_length, kind="stable")]
    paths = {t: set(forest.segment_path(int(forest.traj_leaf[t]))) for t in order}

    def fork(a, b):       # same tree, neither path a prefix of the other
        la, lb = int(forest.traj_leaf[a]), int(forest.traj_leaf[b])
        return not paths[a].isdisjoint(paths[b]) and la not in paths[b] and lb not in paths[a]

    chosen = order[:trajectories]
    if not any(fork(a, b) for i, a in enumerate(chosen) for b in chosen[i + 1:]):
        chosen += [t for t in order[trajectories:] if fork(chosen[0], t)][:1]
    return build_forest([forest.expand(forest.traj_ids[t]) for t in sorted(chosen)])


def run_mode(argv, forest, iters, warmup, device, profile=False, memory=False, stacks=False, op_names=(),
             warm=None):
    """Timed steps of one mode (median after ``warmup``), their metrics, the loss and gradient norm of
    every step (warm-ups included: the first at the initial weights, the same in every mode up to
    rounding; warm-ups train ``warm`` where given, :func:`warmup_forest`), peak memory, the plan,
    with ``profile`` the profile of one more step (``profile_step``; a callable ``profile(trainer, forest)``:
    its result instead), with
    ``memory`` where the bytes live at the peak of one more step (``memory_step``), and the
    backends the driver resolved (``auto`` made concrete)."""
    from megatron_harts.training.trainer import Trainer
    with Trainer.from_args(argv) as t:
        times, metrics, losses = [], [], []   # losses: (loss, grad norm before clipping) of every step
        for i in range(warmup + iters):
            if device == "cuda":
                torch.cuda.synchronize()
                if i == warmup:
                    torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            m = t.step(forest if i >= warmup or warm is None else warm)
            losses.append((m["loss"], m["grad_norm"]))
            if device == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                metrics.append(m)
        # the driver resets the allocator's peak at every step (its measured_peak_gib): the timed steps' largest
        peak = max(m["measured_peak_gib"] for m in metrics) if device == "cuda" else None
        plan = t._plan(forest)
        prof = None if not profile else profile(t, forest) if callable(profile) else \
            profile_step(t, forest, device, stacks=stacks, op_names=op_names)
        mem = memory_step(t, forest) if memory and device == "cuda" else None
        backends = {"kda_backend": t.config.kda_backend, "attention_backend": t.config.tree_attention_backend}
        return times, metrics, losses, peak, plan, prof, mem, backends


#: kernel-name patterns of the profile's categories, first match wins (fla's KDA kernels, FlexAttention's
#: and the flash/cuDNN attention kernels, GEMMs, collectives, inductor-fused and eager elementwise work)
KERNEL_CATEGORIES = (
    ("kda", re.compile(r"kda|gated_delta|delta_rule|wy_|w_u|solve_tril|chunk_local|chunk_fwd|chunk_bwd|l2norm|"
                       r"cumsum|merge_16x16|chunk_scaled_dot|_kkt")),
    ("attention", re.compile(r"flex|attention|fmha|flash|sdpa|triton_tem")),
    ("gemm", re.compile(r"gemm|cutlass|cublas|xmma|nvjet|matmul|sm90|sm80|ampere|hopper|Kernel2|splitK")),
    ("comm", re.compile(r"nccl")),
    ("triton_fused", re.compile(r"^triton_")),
    ("index_copy", re.compile(r"index|scatter|gather|copy|cat|fill|memcpy|Memcpy|Memset|arange|nonzero|sort|"
                              r"unique|cumsum|where")),
    ("elementwise", re.compile(r"elementwise|vectorized|reduce|softmax|norm|silu|sigmoid|exp|log|mul|add")),
)


def kernel_category(name: str) -> str:
    for cat, pattern in KERNEL_CATEGORIES:
        if pattern.search(name):
            return cat
    return "other"


def _device_time(e) -> float:
    v = getattr(e, "self_device_time_total", None)
    return float(v if v is not None else getattr(e, "self_cuda_time_total", 0.0))


def kernel_categories(events) -> dict:
    """GPU time and launches per ``KERNEL_CATEGORIES`` category of a profile's averaged events.

    Only the GPU's own work counts (device type CUDA, not a user annotation): a host-side record (an aten
    op, a custom autograd Function, a Triton launcher) carries the device time of the kernels it launched,
    and a ``record_function`` range (the project's ``harts.*`` ranges: ``harts.kda``, ``harts.attention``,
    ``harts.pieces_extra_forward``) shows on the GPU's timeline as an annotation spanning its kernels;
    either would count those kernels a second time, in the range's category by its name."""
    from torch.autograd import DeviceType

    from step_profile import annotation, project_ranges
    ranges = project_ranges()
    categories = {}
    for e in events:
        if e.device_type != DeviceType.CUDA or _device_time(e) <= 0 or annotation(e, ranges):
            continue
        entry = categories.setdefault(kernel_category(e.key), {"seconds": 0.0, "launches": 0})
        entry["seconds"] += _device_time(e) / 1e6
        entry["launches"] += int(e.count)
    return categories


def op_stacks(trainer, forest, names, top: int = 6, depth: int = 12) -> str:
    """One more step under ``torch.profiler`` with Python stacks and input shapes: for each operator in
    ``names`` (``aten::gather``), its calls grouped by their innermost ``depth`` Python frames (object
    addresses and layer numbers dropped, so the layers' calls group together), the operators that
    enclose them (an autograd engine's ``evaluate_function: XBackward0`` names the forward operator
    whose backward runs it) and their input shapes, the ``top`` groups by count.  It finds operators
    that no project frame dispatches (compiled graphs, library code, the autograd engine's thread,
    which has no Python frames unless a Python backward runs it)."""
    from torch.profiler import ProfilerActivity, profile
    verbose = torch._C._profiler._ExperimentalConfig(verbose=True)    # Python frames in the events' stacks
    with profile(activities=[ProfilerActivity.CPU], with_stack=True, record_shapes=True,
                 experimental_config=verbose) as prof:
        trainer.step(forest)
    counts = {name: {} for name in names}     # name -> (frames, enclosing ops, shapes) -> calls
    for e in prof.events():
        if e.name not in counts:
            continue
        frames = tuple(re.sub(r"(nn\.Module: \w+?)_\d+$", r"\1", re.sub(r" at 0x[0-9a-f]+", "", f))
                       for f in (e.stack or [])[:depth] if f) or ("(no Python frame)",)
        parents, p = [], e.cpu_parent
        while p is not None and len(parents) < 3:
            if not re.search(r"^<|\(\d+\): ", p.name):      # operators and autograd nodes, not Python frames
                parents.append(p.name)
            p = p.cpu_parent
        key = (frames, " < ".join(parents) or "(top level)", str(e.input_shapes))
        counts[e.name][key] = counts[e.name].get(key, 0) + 1
    out = []
    for name, groups in counts.items():
        out.append(f"{name}: {sum(groups.values())} calls, {len(groups)} distinct stacks\n")
        for (frames, parents, shapes), n in sorted(groups.items(), key=lambda kv: -kv[1])[:top]:
            out.append(f"  {n:>7}  " + "\n           ".join(frames) + f"\n           in: {parents}"
                       f"\n           shapes: {shapes}\n")
    return "".join(out)


def profile_step(trainer, forest, device, top: int = 30, stacks: bool = False, op_names=()):
    """One more step under ``torch.profiler``: wall time, GPU kernel time (summed per kernel, so a
    GPU idle while Python launches shows as wall >> kernel time), kernel time per category
    (``KERNEL_CATEGORIES``), and the text tables of the top kernels and the top CPU operators;
    with ``stacks`` also the operators one more step dispatches, counted and timed by call site (``op_sites``);
    with ``op_names`` where those operators' calls run in one more step (``op_stacks``)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        trainer.step(forest)
        if device == "cuda":
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    categories = kernel_categories(events)
    kernel_s = sum(v["seconds"] for v in categories.values())
    sort_dev = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    tables = (events.table(sort_by=sort_dev, row_limit=top, max_name_column_width=90) if device == "cuda" else "") \
        + "\n" + events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=90) \
        + "\n" + events.table(sort_by="count", row_limit=top, max_name_column_width=90)
    syncs = sync_sites(trainer, forest) if device == "cuda" else {}
    tables += "\nCUDA synchronizations by first project frame (one step):\n" + "".join(
        f"{n:>8}  {site}\n" for site, n in syncs.items())
    if op_names:
        tables += "\nPython stacks of " + ", ".join(op_names) + " (one step, innermost frames first):\n" \
            + op_stacks(trainer, forest, list(op_names))
    if stacks:
        tables += "\nOperators dispatched, by innermost project frame (one step; the autograd engine's device " \
                  "thread's under no project frame):\n"
        try:
            tables += op_site_tables(op_sites(trainer, forest))
        except Exception as e:       # an operator that refuses dispatch modes (torch.compile'd kernels)
            tables += f"    not counted: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}\n"
    return {"wall_seconds": wall, "kernel_seconds": kernel_s,
            "kernel_launches": sum(v["launches"] for v in categories.values()),
            "categories": dict(sorted(categories.items(), key=lambda kv: -kv[1]["seconds"])),
            "synchronizations": sum(syncs.values())}, tables


def _project_site(skip: int = 1) -> str:
    """``file:line (function)`` of the innermost megatron_harts or megatron-core frame of the stack, the
    innermost ``skip`` frames (this function's, and its callers' that are hooks) left out."""
    import traceback
    for fr in reversed(traceback.extract_stack()[:-skip]):
        if any(r in fr.filename for r in PROJECT_ROOTS):
            return f"{fr.filename.split(os.sep + 'site' + os.sep)[-1]}:{fr.lineno} ({fr.name})"
    return "(no project frame)"


def op_sites(trainer, forest) -> dict:
    """One more step under a dispatch mode that counts and times every ATen operator the host runs, at
    its innermost project frame: ``{(site, operator): [calls, host seconds]}``.  Host time of a
    launch-bound step goes with the operator count; an operator whose host time per call is far above
    its kernels' (a host copy, a blocking wait) shows its seconds.  Operators the autograd engine runs
    on its device thread have no project frame, except inside a custom Function's backward."""
    from torch.utils._python_dispatch import TorchDispatchMode
    sites = {}

    class Count(TorchDispatchMode):
        supports_higher_order_operators = True      # flex_attention: counted as one, run as it is

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.name() if isinstance(func, torch._ops.HigherOrderOperator) else \
                str(func.overloadpacket.__name__)
            entry = sites.setdefault((_project_site(2), name), [0, 0.0])
            t0 = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            entry[1] += time.perf_counter() - t0
            entry[0] += 1
            return out

    with Count():
        trainer.step(forest)
    return sites


def op_site_tables(sites: dict, top: int = 40) -> str:
    """``op_sites``' record as text: the sites by operator count (each with its most frequent
    operators), then the (site, operator) pairs by host time."""
    per_site = {}
    for (site, op), (n, _) in sites.items():
        per_site.setdefault(site, {})[op] = n
    rows = sorted(per_site.items(), key=lambda kv: -sum(kv[1].values()))[:top]
    text = "".join(f"{sum(ops.values()):>8}  {site}  ["
                   + ", ".join(f"{k} x{v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:6]) + "]\n"
                   for site, ops in rows)
    text += "\nHost time by operator and innermost project frame (the same step; the time of each call as " \
            "the host thread saw it, a wait for the device included):\n"
    by_time = sorted(sites.items(), key=lambda kv: -kv[1][1])[:top]
    return text + "".join(f"{sec * 1e3:>10.2f} ms {n:>7}  {op:<24} {site}\n" for (site, op), (n, sec) in by_time)


def sync_sites(trainer, forest, top: int = 40):
    """One more step with CUDA's sync debug mode on: every operation that waits for the GPU (a
    host copy of a device value, ``nonzero``, a boolean mask...) is counted at the first frame of
    megatron_harts or megatron-core on its Python stack (``{"file:line (function)": count}``,
    most frequent first).  Synchronizations inside the autograd engine's backward thread show the
    custom Function's backward when there is one."""
    import warnings
    counts = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        site = _project_site(2)
        counts[site] = counts.get(site, 0) + 1

    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.step(forest)
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:top])


def allocation_site(frames, depth: int = 1) -> str:
    """Where a block was allocated: ``file:line (function)`` of the innermost ``depth`` frames of
    megatron_harts or megatron-core in its stack (innermost first, as torch's memory snapshots list
    them; joined by `` < ``, so a shared helper names its caller), followed by `` via `` and the
    innermost megatron_harts frame where none of those is ours (so a megatron linear layer's output
    names the model code that called it); "(no project frame)" without any."""
    def where(fr):
        return f"{fr['filename'].split(os.sep + 'site' + os.sep)[-1]}:{fr['line']} ({fr['name']})"
    ours = [fr for fr in frames if any(r in fr["filename"] for r in PROJECT_ROOTS)]
    if not ours:
        return "(no project frame)"
    site = " < ".join(where(fr) for fr in ours[:depth])
    if any(PROJECT_ROOTS[0] in fr["filename"] for fr in ours[:depth]):
        return site
    mine = next((fr for fr in ours if PROJECT_ROOTS[0] in fr["filename"]), None)
    return site + ("" if mine is None else " via " + where(mine))


def live_at_peak(trace, top: int = 30, depth: int = 1) -> dict:
    """Where the bytes live at the peak of an allocator trace (``torch.cuda.memory._snapshot()``'s
    ``device_traces[i]``): the trace is replayed (``alloc`` adds a block, ``free_requested`` removes
    it; a free of a block allocated before the trace began is ignored), its highest point found, and
    the blocks alive there summed by their allocation site (``allocation_site`` of ``depth`` frames).  Returns the
    peak above the trace's start (bytes), the event index of the peak and the site of the block
    that made it, ``sites``: ``{site: bytes}`` of the ``top`` largest sites, the rest summed under
    "(other sites)", and ``blocks``: ``{site: {block bytes: count}}`` of those sites."""
    live, total, peak, at = {}, 0, 0, -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
            if total > peak:
                peak, at = total, i
        elif e["action"] == "free_requested" and e["addr"] in live:
            total -= live.pop(e["addr"])
    sites, blocks, live = {}, {}, {}
    for e in trace[:at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_requested":
            live.pop(e["addr"], None)
    for e in live.values():
        site = allocation_site(e.get("frames", ()), depth)
        sites[site] = sites.get(site, 0) + e["size"]
        sizes = blocks.setdefault(site, {})
        sizes[e["size"]] = sizes.get(e["size"], 0) + 1
    ranked = sorted(sites.items(), key=lambda kv: -kv[1])
    out = dict(ranked[:top])
    if len(ranked) > top:
        out["(other sites)"] = sum(v for _, v in ranked[top:])
    return {"peak_bytes": peak, "peak_event": at,
            "peak_site": allocation_site(trace[at].get("frames", ()), depth) if at >= 0 else None, "sites": out,
            "blocks": {k: dict(sorted(blocks[k].items(), key=lambda kv: -kv[0] * kv[1])) for k, _ in ranked[:top]}}


def memory_step(trainer, forest) -> dict:
    """One more step under the CUDA allocator's history (Python stacks): ``live_at_peak`` of the
    step, plus what was allocated when it started (model, gradients, optimizer state)."""
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
    try:
        trainer.step(forest)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    return {"allocated_at_start_bytes": start, "trace_events": len(trace), **live_at_peak(trace, top=80, depth=2)}


def cosine_sample(forest, max_tokens: int):
    """The forest of the first trajectories of the smallest tree that hold at most ``max_tokens``
    expanded tokens (at least two, so the sample has a fork; when two are longer, the first and
    the one leaving its path earliest, cut to ``max_tokens // 2`` tokens each where both keep a
    target; the fork survives when their shared prefix is shorter): the fp32 oracle runs expanded mode
    with the reference KDA, whose chunk-decay tensors grow with the sample's tokens (two 8k-token
    Tree-Step trajectories already need more than an H200's memory)."""
    import dataclasses
    from megatron_harts.tree_data import build_forest
    sizes = np.diff(forest.tree_offsets)
    one = forest.select([int(np.argmin(sizes))])
    lengths = np.cumsum(one.traj_length)
    n = max(2, int(np.searchsorted(lengths, max_tokens, side="right")))
    if n >= one.num_trajectories and lengths[-1] <= max_tokens:
        return one
    trajs = [one.expand(t) for t in one.traj_ids[:n]]
    if sum(len(t) for t in trajs) > max_tokens:
        # the first trajectory and the one that leaves its path earliest, cut to max_tokens // 2
        first = one.expand(one.traj_ids[0])

        def shared(t):
            m = min(len(t), len(first))
            diff = np.flatnonzero(t.tokens[:m] != first.tokens[:m])
            return int(diff[0]) if diff.size else m
        other = min((one.expand(t) for t in one.traj_ids[1:]), key=shared)
        cut = max_tokens // 2

        def head(t):
            kw = {f: getattr(t, f)[:cut] for f in ("tokens", "loss_mask", "old_logprobs", "advantage")
                  if isinstance(getattr(t, f), np.ndarray)}
            return dataclasses.replace(t, **kw)
        short = [head(first), head(other)]
        if all(t.loss_mask[1:].any() for t in short):
            trajs = short
    return build_forest(trajs)


def logit_cosine(argv, forest, device, max_tokens: int = 8192):
    """Logit cosines on ``cosine_sample`` at the initial weights (``testing.fidelity.run_bf16``):
    tree vs expanded in the run's dtype (``logit_cosine``), and each of them against the fp32
    oracle, expanded mode on an fp32 copy of the same weights (``logit_cosine_tree_vs_fp32``,
    ``logit_cosine_expanded_vs_fp32``): bf16 rounding's own size, which tree mode should match;
    also each mode's gradients and log-probs against the oracle's (``testing.fidelity.bf16_verdict``):
    the largest relative gradient difference, its tensor, ``sign_step_alignment`` (how much of the
    first Adam step's first-order loss decrease the mode's gradients keep), the mean log-prob
    difference, and the bf16 rule's thresholds and verdict (``bf16_rule_failed``: empty = met); and
    where the bf16 rounding grows (``bf16_per_layer``, ``testing.fidelity.layer_errors``: per decoder
    layer, each mode's relative error against the oracle and its MoE routing flips)."""
    from megatron_harts.layout import build_layout
    from megatron_harts.testing.fidelity import bf16_verdict, layer_errors, logit_cosine as cosine, run_bf16
    from megatron_harts.training.trainer import Trainer
    one = cosine_sample(forest, max_tokens)
    with Trainer.from_args(argv) as t:
        model = t.model[0].module
        lay = build_layout(one)
        a, b, oracle = run_bf16(model, one, lay, t.config, device=device)
        v = bf16_verdict(a, b, oracle)
        grads = {f"{m}_{who}_vs_fp32": v[f"{m}_{who}_vs_fp32"] for who in ("tree", "expanded")
                 for m in ("max_grad_rel_diff", "worst_grad", "sign_step_alignment", "mean_logprob_abs_diff")}
        # the bf16 rule (testing.fidelity): tree mode within a factor of expanded mode's own distance to fp32
        grads.update({k: v[k] for k in ("bf16_min_logit_cosine", "bf16_max_mean_logprob_abs_diff", "tolerance")})
        grads["bf16_rule_failed"] = v["failed"]
        grads["bf16_per_layer"] = layer_errors(model, one, lay, t.config, device=device)
        return {"logit_cosine": cosine(a.logits, b.logits),
                "logit_cosine_tree_vs_fp32": cosine(a.logits, oracle.logits),
                "logit_cosine_expanded_vs_fp32": cosine(b.logits, oracle.logits), **grads,
                "logit_cosine_sample": {"trajectories": one.num_trajectories,
                                        "expanded_tokens": int(one.traj_length.sum())}}


def peer_row(p, forest, a, warm) -> dict:
    """The peer baseline (benchmarks/peer_hf.py) on the scheme's batch: same shapes, dtype, iterations
    and warm-up as our modes."""
    import peer_hf
    release_memory(a.device)
    cfg = driver_model_config(p, forest, a.microbatch_tokens)
    res = peer_hf.run_peer(cfg, p["vocab"], forest, a.iters, a.warmup, a.device,
                           dtype=torch.bfloat16 if a.device == "cuda" else torch.float32,
                           recompute=p.get("recompute") is not None, triton_max_configs=a.peer_triton_max_configs,
                           warm=warm)
    print(f"peer (transformers, {res['implementation']}): {res['step_seconds']:.3f} s/step, "
          f"{res['trajectory_tokens_per_s']:.0f} trajectory tokens/s, peak {res['peak_memory_gib']} GiB", flush=True)
    return res


def release_memory(device) -> float:
    """Free what the last mode left (collected objects, cached blocks); GiB still allocated after."""
    import gc
    gc.collect()
    if device != "cuda":
        return 0.0
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated() / 2 ** 30


def plan_only(p, scheme, forest, a):
    """What a run would compute, without training (``--plan-only``): per mode the plan's microbatches,
    rows (tree modes: as the step executes them, recomputed context included), the planned visible
    pairs (no evictions), logits rows, ``model_flops`` and ``memory_estimate`` with the step's predicted
    live activations (``step_activation_bytes``: the driver's own memory model); a CPU can size a GPU
    run with it."""
    from megatron_harts.training.step import SharingSettings, executed_rows, plan_step
    out = {}
    cfg = driver_model_config(p, forest, a.microbatch_tokens)
    for sharing in list(a.tree_sharing) + ["off"]:
        settings = SharingSettings(sharing=sharing, microbatch_tokens=a.microbatch_tokens,
                                   planner="l1l2" if sharing == "windows" else "l1")
        plan = plan_step(forest, settings, 1)
        fitting = forest if plan.pieces is None else \
            plan.pieces.fitting_forest() if plan.pieces.num_fit_trees else None
        if sharing == "off" or fitting is None:
            rows = int(sum(m.features.rows for m in plan.microbatches))
            largest = int(max((m.features.rows for m in plan.microbatches), default=0))
        else:
            rows, largest = executed_rows(fitting, plan, windows=sharing == "windows")
        cut = pieces_accounting(plan)
        rows, largest = rows + cut["rows"], max(largest, cut["largest"])
        pairs, lrows = visible_pairs(plan), logits_rows(plan)
        flops = model_flops(p, rows, pairs, lrows)
        mem = memory_estimate(p, largest, p.get("recompute"), step_activation_bytes(cfg, forest, plan, settings))
        out["expanded" if sharing == "off" else f"tree_{sharing}"] = {
            "planner": plan.planner, "microbatches": len(plan.microbatches) + cut["microbatches"], "rows": rows,
            "largest_microbatch_rows": largest, "visible_pairs_planned": pairs, "logits_rows": lrows,
            "model_flops": flops, "memory_estimate_gib": {k: v / 2 ** 30 for k, v in mem.items()
                                                          if k not in ("per_layer", "parameters")}}
        print(f"{scheme} {sharing}: {len(plan.microbatches) + cut['microbatches']} microbatches, {rows} rows (largest {largest}), "
              f"{pairs:.3e} pairs, {lrows} logits rows, {flops['total'] / 1e15:.2f} PFLOP, estimated peak "
              f"{mem['total'] / 2 ** 30:.1f} GiB", flush=True)
    return out


def rl_recipe_flags(common, mini_batches: int, ref_dir: str) -> list:
    """The driver flags of ``--rl-recipe`` (after ``common``, so they override its ``--rl-objective sft``);
    saves the initial weights of ``common``'s model (same seed) to ``ref_dir`` first: the reference."""
    from megatron_harts.training.trainer import Trainer
    with Trainer.from_args(common + ["--tree-sharing", "within", "--save", ref_dir, "--save-interval", "1"]) as t:
        t.save(announce=False)
    return ["--rl-objective", "ppo", "--clip-ratio-high", "0.28", "--rl-old-logprobs", "recompute",
            "--kl-coef", "0.01", "--kl-to", "ref", "--kl-estimator", "k3", "--ref-load", ref_dir,
            "--rl-mini-batches", str(mini_batches)]


def main(argv=None):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="h200", choices=sorted(PRESETS))
    ap.add_argument("--schemes", nargs="+", default=["tree-step", "step-wise"], choices=["tree-step", "step-wise"])
    ap.add_argument("--tree-sharing", nargs="+", default=["within"], choices=["within", "windows"],
                    help="tree modes to run beside expanded, same run (within: L1 plans, sharing inside "
                         "microbatches; windows: L1+L2 plans with producer/consumer windows)")
    ap.add_argument("--kda-call-plans", nargs="*", default=[], choices=["per-depth", "node-wise"],
                    help="ablations: the tree step (--tree-sharing within) also with these KDA call plans "
                         "(--tree-kda-call-plan; per-depth bucketing, node-wise LA) beside HARTS' plan")
    ap.add_argument("--num-tasks", type=int, default=4, help="rollout tasks per scheme (trees)")
    ap.add_argument("--samples-per-task", type=int, default=2,
                    help="rollouts per task (sharing the task's prompt; more gives higher compression)")
    ap.add_argument("--layers", type=int, default=None,
                    help="layers of the preset's model instead of its own count (a multiple of 4: the 3:1 "
                         "KDA:MLA pattern; e.g. fewer layers where longer microbatches need the memory)")
    ap.add_argument("--max-tokens", type=int, default=16384,
                    help="trajectory length cap (trajectories reach it only where --max-turns and the turn "
                         "lengths allow: 64k-128k tokens need more turns or longer observations)")
    ap.add_argument("--max-turns", type=int, default=None,
                    help="turns per rollout at most (default the generator's 16; SweConfig.max_turns)")
    ap.add_argument("--observation-median", type=int, default=None,
                    help="median observation tokens per turn (default the generator's 400)")
    ap.add_argument("--prompt-median", type=int, default=None,
                    help="median prompt tokens per task (default the generator's 3000)")
    ap.add_argument("--max-leaves", type=int, default=None,
                    help="Tree-Step: leaves per rollout at most (default the generator's 16)")
    ap.add_argument("--branch-prob", type=float, default=None,
                    help="Tree-Step: chance that an open branch forks at a turn (default the generator's 0.3; "
                         "lower spreads a long rollout's forks over more turns)")
    ap.add_argument("--branch-factor", type=int, default=None,
                    help="Tree-Step: children of a fork (default the generator's 3)")
    ap.add_argument("--plan-only", action="store_true",
                    help="plan every mode and print rows, visible pairs, model FLOPs and the memory estimate "
                         "without training (sizes a GPU run on any machine)")
    ap.add_argument("--microbatch-tokens", type=int, default=32768)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--warmup-trajectories", type=int, default=None, metavar="K",
                    help="warm-up steps train only the batch's K longest trajectories, and one that forks from the "
                         "longest where these do not fork (default: the whole batch; a 128k-token batch's expanded "
                         "step takes minutes, its longest trajectory's a fraction)")
    ap.add_argument("--recompute-producers", action="store_true",
                    help="also run windows with --tree-recompute-producers (producers' activations freed "
                         "until their windows close: peak memory against one more producer forward)")
    ap.add_argument("--keep-producers", action="store_true",
                    help="also run windows with every producer keeping its activations until its window closes "
                         "(--tree-memory-budget far above any step: the fastest windows, the largest peak)")
    ap.add_argument("--kda-backend", default="auto")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--no-cosine", action="store_true")
    ap.add_argument("--cosine-tokens", type=int, default=8192, help="token cap of the logit-cosine sample (halved "
                    "while the fp32 oracle runs out of memory, down to 1024)")
    ap.add_argument("--driver-flags", default="", metavar="'FLAGS'",
                    help="more training-driver flags for every mode, e.g. '--tree-triton-max-configs 1'")
    ap.add_argument("--rl-recipe", action="store_true",
                    help="every mode trains an RL recipe update instead of an SFT step: PPO on the data's GRPO "
                         "advantages, old log-probs recomputed by a forward-only pass, a k3 KL (--kl-coef 0.01) "
                         "to a frozen reference model (the initial weights, saved once and read by --ref-load) and "
                         "--rl-mini-batches optimizer steps of whole groups; step_seconds is the whole update")
    ap.add_argument("--rl-mini-batches", type=int, default=4, metavar="M",
                    help="with --rl-recipe: mini-batches per update (default 4; at most the number of tasks)")
    ap.add_argument("--profile", metavar="FILE",
                    help="profile one extra step of every mode (torch.profiler): kernel time per category into "
                         "the results JSON, the top kernels and CPU operators of each mode into FILE (text)")
    ap.add_argument("--profile-stacks", action="store_true",
                    help="with --profile: one more step per mode counting and timing the operators the host "
                         "dispatches by call site (the innermost project frame), into FILE")
    ap.add_argument("--profile-op-stacks", nargs="+", default=[], metavar="OP",
                    help="with --profile: one more step per mode recording the Python stacks, enclosing operators "
                         "and input shapes of these operators' calls (profiler names, e.g. aten::gather), the most "
                         "frequent into FILE")
    ap.add_argument("--memory-profile", action="store_true",
                    help="one extra step of every mode under the CUDA allocator's history: the bytes alive "
                         "at the step's peak by allocation site (innermost project frames), into the results JSON")
    ap.add_argument("--peer", action="store_true",
                    help="also train the batch with the peer baseline (benchmarks/peer_hf.py: transformers' "
                         "Kimi-Linear, trajectory by trajectory, its fastest kernels) and report our modes' "
                         "tokens/s over its")
    ap.add_argument("--peer-triton-max-configs", type=int, default=1, metavar="N",
                    help="with --peer: Triton autotuning configurations per kernel for the peer (default 1, as "
                         "the benchmark's own runs usually pass --tree-triton-max-configs 1)")
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/throughput-<time>.json)")
    ap.add_argument("--json", action="store_true", help="print the results JSON")
    a = ap.parse_args(argv)
    for flag, given in (("--profile-stacks", a.profile_stacks), ("--profile-op-stacks", a.profile_op_stacks)):
        if given and not a.profile:
            ap.error(f"{flag} needs --profile FILE (its tables go there)")
    p = dict(PRESETS[a.preset])
    if a.layers is not None:
        if a.layers < 4 or a.layers % 4:
            raise CliError(f"--layers {a.layers}: must be a positive multiple of 4 (3 KDA : 1 MLA)")
        p["layers"] = a.layers
    for flag, value in (("--max-tokens", a.max_tokens), ("--microbatch-tokens", a.microbatch_tokens),
                        ("--max-turns", a.max_turns), ("--observation-median", a.observation_median),
                        ("--prompt-median", a.prompt_median), ("--max-leaves", a.max_leaves),
                        ("--num-tasks", a.num_tasks), ("--warmup-trajectories", a.warmup_trajectories),
                        ("--branch-factor", a.branch_factor),
                        ("--samples-per-task", a.samples_per_task)):
        if value is not None and value < 1:
            raise CliError(f"{flag} {value}: must be >= 1")
    if a.branch_prob is not None and not 0.0 <= a.branch_prob <= 1.0:
        raise CliError(f"--branch-prob {a.branch_prob}: must be in [0, 1]")
    shape = {k: v for k, v in (("max_turns", a.max_turns), ("observation_median", a.observation_median),
                               ("prompt_median", a.prompt_median), ("max_leaves", a.max_leaves),
                               ("branch_prob", a.branch_prob), ("branch_factor", a.branch_factor)) if v is not None}
    if not a.plan_only:
        check_device(a.device)
    dtype_flag = "--bf16" if a.device == "cuda" else ""
    results = {"machine": {"device": torch.cuda.get_device_name() if a.device == "cuda" else platform.processor(),
                           "python": platform.python_version(), "torch": torch.__version__},
               "preset": a.preset, "model": p, "args": vars(a), "schemes": {},
               "parameters": parameter_counts(p)}
    if a.preset == "kimi48b-layers":
        results["preset_stands_for"] = KIMI48B_LAYERS
    try:
        import megatron.core
        results["machine"]["megatron_core"] = megatron.core.__version__
        import fla
        results["machine"]["fla"] = fla.__version__
    except Exception:
        pass
    from megatron_harts.ops.key_paths import FA4_VERSION, fa4_available
    # flash-attn-4, where it runs, is the attention kernel of both modes (tree varlen, expanded THD)
    results["machine"]["flash_attn_4"] = FA4_VERSION if fa4_available(a.device, (p["qk"] + p["rope"], p["v"])) \
        else None
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                time.strftime("throughput-%Y%m%d-%H%M%S.json"))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    rl_reference = None
    for scheme in a.schemes:
        forest = synthesize(scheme, a.num_tasks, a.max_tokens, p["vocab"], seed=0, samples_per_task=a.samples_per_task,
                            **shape)
        G = forest.num_trajectories
        if a.plan_only:
            results["schemes"][scheme] = {"forest": forest.stats(), **plan_only(p, scheme, forest, a)}
            with open(out, "w") as f:
                json.dump(results, f, indent=2, default=float)
            continue
        common = model_flags(p, dtype_flag) + [
            "--seq-length", str(int(forest.traj_length.max())), "--tree-microbatch-tokens", str(a.microbatch_tokens),
            "--global-batch-size", str(G), "--train-iters", "1000", "--lr", "1e-5", "--seed", "1234",
            "--log-interval", "1000000", "--rl-objective", "sft", "--distributed-backend",
            "nccl" if a.device == "cuda" else "gloo", "--tree-kda-backend", a.kda_backend,
            "--tree-attention-backend", a.attention_backend] + a.driver_flags.split()
        if a.rl_recipe:
            if rl_reference is None:       # removed at exit
                rl_reference = tempfile.TemporaryDirectory(prefix="harts-rl-reference-")
            common += rl_recipe_flags(common, a.rl_mini_batches, os.path.join(rl_reference.name, scheme))
        row = {"forest": forest.stats()}
        warm = warmup_forest(forest, a.warmup_trajectories)
        modes = [(s, "harts", []) for s in a.tree_sharing] + [("within", p, []) for p in a.kda_call_plans] \
            + ([("windows", "harts", ["--tree-recompute-producers"])] if a.recompute_producers else []) \
            + ([("windows", "harts", ["--tree-memory-budget", "1e9"])] if a.keep_producers else []) \
            + [("off", "harts", [])]
        for sharing, call_plan, extra in modes:
            argv_mode = common + ["--tree-sharing", sharing, "--tree-kda-call-plan", call_plan] + extra
            left = release_memory(a.device)
            key = "expanded" if sharing == "off" else f"tree_{sharing}" \
                + ("" if call_plan == "harts" else f"_{call_plan}") \
                + ("" if not extra else "_recompute_producers" if extra[0] == "--tree-recompute-producers"
                   else "_keep_producers")
            try:
                times, metrics, losses, peak, plan, prof, mem, backends = run_mode(
                    argv_mode, forest, a.iters, a.warmup, a.device, profile=bool(a.profile),
                    memory=a.memory_profile, stacks=a.profile_stacks, op_names=tuple(a.profile_op_stacks),
                    warm=warm)
            except torch.OutOfMemoryError as e:   # a preset larger than this GPU: one line, not a traceback
                raise CliError(f"--preset {a.preset}: {scheme} {key} ran out of memory on "
                               f"{results['machine']['device']} ({str(e).splitlines()[0]}); what was measured "
                               f"before is in {out}") from None
            t = statistics.median(times)
            m = metrics[-1]
            # model FLOPs over the rows and visible pairs the step executed (evictions applied)
            flops = model_flops(p, m["computed_tokens"], m["visible_pairs"], logits_rows(plan))
            peak_flops = next((v for k, v in PEAK_BF16_FLOPS.items() if k in results["machine"]["device"]), None)
            row[key] = {
                "sharing": sharing, "kda_call_plan": call_plan, "planner": plan.planner, **backends,
                "step_seconds": t, "step_seconds_all": times,
                "trajectory_tokens_per_s": m["trajectory_tokens"] / t, "rows_computed": m["computed_tokens"],
                "compression": m["compression"], "kda_calls": m["kda_calls"], "replay_tokens": m["replay_tokens"],
                "microbatches": m["microbatches"],
                "windows": m["windows"], "peak_export_bytes": m["peak_export_bytes"],
                "recomputed_windows": m["recomputed_windows"], "memory_budget_gib": m["memory_budget_gib"],
                # the driver's memory model's step peak, and the allocator's (None on the CPU), last timed step
                "predicted_peak_gib": m["predicted_peak_gib"], "measured_peak_gib": m["measured_peak_gib"],
                "alloc_retries": m["alloc_retries"],
                "peak_memory_gib": peak, "loss": m["loss"], "loss_per_step": [l for l, _ in losses],
                "grad_norm_per_step": [g for _, g in losses], "allocated_at_start_gib": left,
                # what this mode itself needed above what the process held when it started (a closed
                # Trainer frees its model and optimizer: ~0.06 GiB of caches remain)
                "peak_memory_above_start_gib": None if peak is None else peak - left,
                "visible_pairs": m["visible_pairs"], "logits_rows": logits_rows(plan),
                "largest_microbatch_rows": max(max((int(mb.features.rows) for mb in plan.microbatches), default=0),
                                               pieces_accounting(plan)["largest"]),
                "model_flops": flops, "model_tflops_per_s": flops["total"] / t / 1e12,
                # --rl-recipe: optimizer steps per update and the reference's weight bytes
                "optimizer_steps": m.get("optimizer_steps"), "ref_model_gib": m.get("ref_model_gib"),
                "mfu": flops["total"] / (t * peak_flops) if peak_flops else None}
            results["schemes"][scheme] = row
            with open(out, "w") as f:      # after every mode: a cut-short run keeps what it measured
                json.dump(results, f, indent=2, default=float)
            print(f"{scheme} {key}: {row[key]['step_seconds']:.3f} s, {row[key]['kda_calls']} KDA calls, "
                  f"compression {row[key]['compression']:.3f}x, peak {peak} (predicted "
                  f"{row[key]['predicted_peak_gib']}), {row[key]['recomputed_windows']} of {row[key]['windows']} "
                  f"windows recomputed", flush=True)
            if mem is not None:
                row[key]["memory_at_peak"] = mem
                print(f"{scheme} {key}: {mem['peak_bytes'] / 2 ** 30:.3f} GiB above the step's start at its "
                      f"peak, by site:\n" + "".join(f"  {v / 2 ** 30:8.3f}  {k}\n"
                                                   for k, v in list(mem["sites"].items())[:15]), flush=True)
            if prof is not None:
                summary, tables = prof
                row[key]["profile"] = summary
                with open(a.profile, "a") as f:
                    f.write(f"===== {scheme} / {key}: wall {summary['wall_seconds']:.3f} s, "
                            f"kernels {summary['kernel_seconds']:.3f} s ({summary['kernel_launches']} launches)\n")
                    for cat, v in summary["categories"].items():
                        f.write(f"  {cat:>14}: {v['seconds']:.3f} s, {v['launches']} launches\n")
                    f.write(tables + "\n")
        exp = row["expanded"]
        if a.peer:
            row["peer_transformers"] = peer_row(p, forest, a, warm)
            for k in [k for k in row if k.startswith("tree_")] + ["expanded"]:
                row[k]["tokens_per_s_over_peer"] = row[k]["trajectory_tokens_per_s"] \
                    / row["peer_transformers"]["trajectory_tokens_per_s"]
        for k in [k for k in row if k.startswith("tree_")] + ["expanded"]:
            print(f"{scheme} {k}: {row[k]['step_seconds']:.3f} s/step, {row[k]['trajectory_tokens_per_s']:.0f} "
                  f"trajectory tokens/s, MFU {row[k]['mfu']}, {row[k]['model_tflops_per_s']:.1f} model TFLOP/s, "
                  f"peak {row[k]['peak_memory_gib']} GiB", flush=True)
        tree_keys = [k for k in row if k.startswith("tree_")]
        for k in tree_keys:
            tree = row[k]
            tree["speedup"] = exp["step_seconds"] / tree["step_seconds"]
            tree["speedup_over_compression"] = tree["speedup"] / tree["compression"]
            if "profile" in tree and "profile" in exp and tree["profile"]["kernel_seconds"] > 0:
                # GPU kernel time of the profiled steps: the ratio without the host's share
                tree["kernel_speedup"] = exp["profile"]["kernel_seconds"] / tree["profile"]["kernel_seconds"]
        from megatron_harts.planner.baselines import harts, per_depth_bucketing
        harts_calls = harts(forest.seg_parent, forest.seg_start, forest.seg_length, 64)
        bucket = per_depth_bucketing(forest.seg_parent, forest.seg_start, forest.seg_length, 64)
        row["kda_calls_per_layer_whole_forest"] = {"harts": harts_calls, "per_depth_bucketing": bucket}
        cap = a.cosine_tokens
        while not a.no_cosine and cap >= 1024:     # a smaller sample where the fp32 oracle does not fit
            release_memory(a.device)
            try:
                row.update(logit_cosine(common + ["--tree-sharing", a.tree_sharing[0]], forest, a.device, cap))
                row.pop("logit_cosine_error", None)
                break
            except torch.OutOfMemoryError as e:
                row["logit_cosine_error"] = f"out of memory at a {cap}-token cap: {str(e).splitlines()[0]}"
                print(f"{scheme}: logit cosine not measured ({row['logit_cosine_error']})", flush=True)
                cap //= 2
        results["schemes"][scheme] = row
        modes = " | ".join(
            f"{k} ({row[k]['planner']}, {row[k]['kda_calls']} KDA calls): compression {row[k]['compression']:.2f}x, "
            f"{row[k]['step_seconds']:.2f}s ({row[k]['trajectory_tokens_per_s']:.0f} tok/s, "
            f"peak {row[k]['peak_memory_gib']}), speedup {row[k]['speedup']:.2f}x "
            f"({row[k]['speedup_over_compression']:.2f} of compression)" for k in tree_keys)
        print(f"{scheme}: {modes} | expanded {exp['step_seconds']:.2f}s ({exp['trajectory_tokens_per_s']:.0f} "
              f"tok/s, peak {exp['peak_memory_gib']}) | cosine {row.get('logit_cosine')}", flush=True)
        with open(out, "w") as f:          # after every scheme: a cut-short run keeps what it measured
            json.dump(results, f, indent=2, default=float)
    if a.json:
        print(json.dumps(results, indent=2, default=float))
    return results


if __name__ == "__main__":
    run(main)
