#!/usr/bin/env python3
"""Tree attention (FlexAttention, interval block mask) vs dense causal SDPA vs expanded attention.

One run, same device, same dtype, fwd+bwd each:

- ``tree_flex``: :func:`megatron_harts.ops.tree_attention` with ``backend="flex"`` over the
  compact rows of SWE-like rollout trees (``megatron_harts.tree_data.synthetic``); the block
  mask is built once (its build time is reported separately, it is shared by all layers).
- ``causal_sdpa``: ``scaled_dot_product_attention(is_causal=True)`` over the same R rows, as if
  they were one sequence: the speed of light for a kernel doing R(R+1)/2 pairs.
- ``expanded_flex``: what expanded training does: every trajectory's own causal attention,
  packed (document-causal FlexAttention mask) over all trajectories' tokens.
- ``tree_varlen``: the same with ``backend="varlen"``: bottom-right causal flash-attention varlen
  kernels (torch's bundled flash-attention 2) over key paths gathered per run of rows
  (``megatron_harts.ops.key_paths``; their build time is reported separately too).
- ``tree_varlen_fa4``: the same key paths through flash-attn-4's Hopper kernels, where
  flash-attn-4 is installed (``key_paths.fa4_available``).
- ``tree_fa4_blocks``: ``backend="fa4"``: flash-attn-4's block-sparse kernels over the tiles that
  hold visible pairs, keys/values read in place (``megatron_harts.ops.fa4_blocks``; the lists' build
  time is reported separately), where flash-attn-4 runs.
- ``causal_fa4``, ``band_fa4``, ``tree_fa4_blocks_nomask`` (where flash-attn-4 runs): yardsticks for
  the fa4 tiles, not tree attention.  flash-attn-4's own causal kernel over the same R rows; its
  sliding-window kernel over the same R rows with each query seeing its w most recent keys, w the
  tree's visible pairs per row (the same rows and about the same pairs, in the layout a native
  kernel runs best: what a layout this sparse costs per pair without any mask); and the fa4 tiles
  with every partial tile run as a full one (wrong values, timing only: what the mask costs).
- ``tree_interval``: ``backend="interval"``: Triton kernels reading keys/values in place over the
  tiles that hold visible pairs (``megatron_harts.ops.interval_attention``; the tile lists' build
  time is reported separately), where Triton and CUDA are available
  (``interval_attention.interval_available``).  ``--interval-block M N`` sets its tile.
- ``expanded_sdpa_loop`` (``--expanded-loop``): one causal SDPA call per trajectory.
- ``tree_sdpa`` (``--tree-sdpa``, default on CPU): the chunked dense-mask fallback backend.

Reported per method: time, visible (query, key) pairs, time per pair, and the ratio of time
per pair to causal SDPA's (target for tree_flex on GPU: <= 1.5).  Also the wall-time speedup of
tree_flex over expanded attention.  Before timing, tree_flex's output and input gradients are
checked against expanded attention of the same values (max error and cosine, reported).

With ``--compaction STRATEGY`` the workload is compaction traces (KV-streams, docs/data_format.md):
one rollout of ``--max-tokens``-token traces under that strategy at ``--context-budget``; every tree
method's mask excludes the evicted keys, expanded attention applies each trajectory's own evictions,
and "pairs" are the visible pairs (a key evicted before a query is no pair of it).  Time per visible
pair against causal SDPA's over the same rows then says whether eviction costs nothing: the block
mask must skip evicted blocks, the key paths must gather only visible keys.

On CPU torch's FlexAttention has no backward: flex methods are timed forward only there
(``bwd`` fields are null).  Use ``--device cpu --rows 512`` for a smoke run.
"""
import argparse
import json
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron_harts.cli import ArgumentParser, CliError, run  # noqa: E402
from megatron_harts.layout import Visibility, build_layout, sequence_visibility  # noqa: E402
from megatron_harts.ops.interval_attention import build_interval_blocks, interval_available  # noqa: E402
from megatron_harts.ops.key_paths import build_key_paths, fa4_available  # noqa: E402
from megatron_harts.ops.tree_attention import (build_tree_block_mask, set_flex_compile_mode,  # noqa: E402
                                                tree_attention)
from megatron_harts.tree_data import build_forest  # noqa: E402
from megatron_harts.tree_data.synthetic import COMPACTIONS, SweConfig, synthesize_swe  # noqa: E402

warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", type=int, default=32768, help="target number of compact rows (whole trees are "
                   "added while they fit; default 32768)")
    p.add_argument("--scheme", default="tree-step", choices=["tree-step", "step-wise"])
    p.add_argument("--compaction", default="none", choices=COMPACTIONS,
                   help="compaction traces of this strategy (default none: plain rollout trees)")
    p.add_argument("--context-budget", type=int, default=4096, help="with --compaction: live tokens per rollout")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="with --compaction: trace length (default: --rows for step-wise, 2/3 of it for tree-step)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA); default = --heads")
    p.add_argument("--head-dim", type=int, default=128, help="q/k and v head dim (ignored with --mla)")
    p.add_argument("--mla", action="store_true", help="MLA-like head dims: q/k 192, v 128")
    p.add_argument("--dims", type=int, nargs=2, metavar=("QK", "V"), default=None,
                   help="q/k and v head dims (e.g. 96 64: the h200 preset's MLA); overrides --head-dim/--mla")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--interval-block", type=int, nargs=2, metavar=("M", "N"), default=(64, 64),
                   help="query rows and keys per tile of the interval backend (powers of two >= 16; default 64 64)")
    p.add_argument("--kernel-options", default=None,
                   help='JSON dict passed to flex_attention as kernel_options, e.g. \'{"BLOCK_M": 64}\'')
    p.add_argument("--compile-mode", default=None, help="torch.compile mode for flex_attention on GPU "
                   "(e.g. max-autotune-no-cudagraphs); default: torch's default")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--expanded-loop", action="store_true", help="also time one causal SDPA call per trajectory")
    p.add_argument("--tree-sdpa", action="store_true", default=None,
                   help="also time the chunked dense-mask tree backend (default: on CPU only)")
    p.add_argument("--no-check", action="store_true", help="skip the tree-vs-expanded correctness check")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(argv)
    for name in ("rows", "heads", "head_dim", "repeats", "context_budget"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.kv_heads is not None and (args.kv_heads < 1 or args.heads % args.kv_heads):
        p.error("--kv-heads must divide --heads")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if any(b < 16 or b & (b - 1) for b in args.interval_block):
        p.error("--interval-block sizes must be powers of two >= 16")
    if args.max_tokens is not None and args.max_tokens < 2:
        p.error("--max-tokens must be >= 2")
    if args.expanded_loop and args.compaction != "none":
        p.error("--expanded-loop times plain causal SDPA per trajectory, which ignores --compaction's evictions")
    if args.tree_sdpa is None:
        args.tree_sdpa = torch.device(args.device).type == "cpu"
    return args


def _per_pair_over(results, name, base):
    """Forward+backward time per pair of method ``name`` over method ``base``'s (None when either is absent)."""
    a, b = results.get(name), results.get(base)
    if not a or not b or not a["fwd_bwd_ms"] or not b["fwd_bwd_ms"]:
        return None
    return (a["fwd_bwd_ms"] / a["pairs"]) / (b["fwd_bwd_ms"] / b["pairs"])


def fa4_yardsticks(layout, fblocks, scale, tree_pairs):
    """(name, attention, visible pairs) of the fa4 yardsticks (module docstring): flash-attn-4 causal over
    the layout's R rows; its sliding window of w = tree pairs / R keys per query over them; and the fa4
    tiles with the partial tiles run as full ones (timing only)."""
    import dataclasses

    import numpy as np
    from flash_attn.cute.interface import flash_attn_func

    from megatron_harts.ops.fa4_blocks import block_lists, fa4_block_attention

    R = layout.num_rows
    w = max(1, min(R, round(tree_pairs / R)))
    band_pairs = w * (w + 1) // 2 + (R - w) * w

    def native(causal, window):
        def attend(q_, k_, v_):
            out = flash_attn_func(q_[None], k_[None], v_[None], softmax_scale=scale, causal=causal,
                                  window_size=window)
            return (out[0] if isinstance(out, tuple) else out)[0]
        return attend

    def unmasked(lists):  # the same tiles, the partial ones listed as full
        part_cnt, part_idx, full_cnt, full_idx = (t.cpu().numpy() for t in lists)
        kinds = np.zeros((len(part_cnt), int(max(part_idx.max(initial=0), full_idx.max(initial=0))) + 1), np.int8)
        for r in range(len(part_cnt)):
            kinds[r, part_idx[r, :part_cnt[r]]] = kinds[r, full_idx[r, :full_cnt[r]]] = 2
        dev = lists[0].device
        return tuple(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(dev) for a in block_lists(kinds))

    full = dataclasses.replace(fblocks, fwd_lists=unmasked(fblocks.fwd_lists), bwd_lists=unmasked(fblocks.bwd_lists))
    return [("causal_fa4", native(True, (None, None)), R * (R + 1) // 2),
            ("band_fa4", native(True, (w - 1, 0)), band_pairs),
            ("tree_fa4_blocks_nomask", lambda q_, k_, v_: fa4_block_attention(q_, k_, v_, full, scale), tree_pairs)]


# ---------------------------------------------------------------------------
# workload
# ---------------------------------------------------------------------------

def swe_forest(target_rows: int, scheme: str, seed: int):
    """Whole SWE-like trees (one task, one sampled rollout tree each) added while the total
    stays <= target_rows, until it reaches 3/4 of it.

    Full-size trees (3000-token prompt, 8 leaves, <= 8192 tokens per trajectory) are 10k-30k
    rows; below 32k target rows the synthetic lengths are scaled down so that several fit.
    """
    scale = min(1.0, target_rows / 32768)
    trajs, rows, task = [], 0, 0
    for attempt in range(200):
        cfg = SweConfig(scheme=scheme, num_tasks=1, samples_per_task=1, max_leaves=8,
                        prompt_median=max(8, int(3000 * scale)), action_median=max(2, int(150 * scale)),
                        observation_median=max(2, int(400 * scale)), max_tokens=max(64, int(8192 * scale)),
                        seed=seed * 100003 + attempt)
        group = synthesize_swe(cfg)
        n = build_forest(group).num_rows
        if rows + n <= target_rows:
            for t in group:
                t.group = f"task{task}"
                t.id = f"task{task}/{t.id}"
            trajs.extend(group)
            rows += n
            task += 1
        if rows >= 0.75 * target_rows:
            break
    if not trajs:
        raise CliError(f"no synthetic tree fits in --rows {target_rows}")
    return build_forest(trajs)


def compaction_forest(args):
    """One rollout (one task, one sample) of compaction traces: turns until ``--max-tokens``, the
    strategy at ``--context-budget`` (the sliding window evicts a quarter of it at a time)."""
    max_tokens = args.max_tokens or (args.rows if args.scheme == "step-wise" else 2 * args.rows // 3)
    budget = args.context_budget
    cfg = dict(scheme=args.scheme, num_tasks=1, samples_per_task=1, max_leaves=2, min_turns=200, max_turns=200,
               prompt_median=min(3000, max_tokens // 4), action_median=max(2, min(200, max_tokens // 40)),
               observation_median=max(2, min(600, max_tokens // 15)),
               max_tokens=max_tokens, seed=args.seed, compaction=args.compaction, context_budget=budget,
               keep_prefix=min(256, budget // 8), keep_last=min(512, budget // 4), evict_chunk=max(1, budget // 4),
               summary_tokens=min(256, budget // 8))
    try:
        trajs = synthesize_swe(SweConfig(**cfg))
    except ValueError as e:
        raise CliError(f"--compaction {args.compaction} --context-budget {budget}: {e}") from None
    return build_forest(trajs)


def expanded_visibility(forest, layout) -> Visibility:
    """Every trajectory of ``layout`` packed end to end in its order, each causal with its own
    compaction events (key k of a trajectory is seen from k until an event evicts it)."""
    lengths = layout.traj_length.cpu()
    events = [forest.expand(t).compactions for t in layout.traj_ids]
    return sequence_visibility(lengths.tolist(), events) or packed_causal_visibility(lengths)


def visible_pairs(vis: Visibility) -> int:
    return int((vis.end - vis.start).sum())


def packed_causal_visibility(lengths: torch.Tensor) -> Visibility:
    """Document-causal visibility over trajectories packed end to end: key k sees [k, end of its doc)."""
    E = int(lengths.sum())
    ends = torch.repeat_interleave(torch.cumsum(lengths, 0), lengths)
    return Visibility(torch.arange(E + 1), torch.arange(E), ends, E, causal=True)


# ---------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, warmup, repeats):
    """Median wall time (ms) of fn() over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize(device)
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def fwd_bwd(attn, inputs, grad_out, backward: bool):
    def run():
        if backward:
            for t in inputs:
                t.grad = None
            out = attn(*inputs)
            out.backward(grad_out)
        else:
            with torch.no_grad():
                attn(*inputs)
    return run


def cosine(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-300))


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------

def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    on_cpu = device.type == "cpu"
    H = args.heads
    Hk = args.kv_heads or H
    dqk, dv = tuple(args.dims) if args.dims else (192, 128) if args.mla else (args.head_dim, args.head_dim)

    set_flex_compile_mode(args.compile_mode)
    forest = swe_forest(args.rows, args.scheme, args.seed) if args.compaction == "none" else compaction_forest(args)
    layout = build_layout(forest).to(device)
    R = layout.num_rows
    lengths = layout.traj_length.cpu()
    E = int(lengths.sum())
    tree_pairs = visible_pairs(layout.visibility)
    causal_pairs = R * (R + 1) // 2
    exp_vis = expanded_visibility(forest, layout).to(device)
    expanded_pairs = visible_pairs(exp_vis)

    gen = torch.Generator(device=device).manual_seed(args.seed)
    mk = lambda *s: (torch.randn(*s, device=device, generator=gen) * 0.5).to(dtype).requires_grad_()
    q, k, v = mk(R, H, dqk), mk(R, Hk, dqk), mk(R, Hk, dv)
    g = torch.randn(R, H, dv, device=device, generator=gen).to(dtype)
    rows = layout.traj_rows
    qe, ke, ve = (t.detach()[rows].clone().requires_grad_() for t in (q, k, v))
    ge = g[rows]
    scale = dqk ** -0.5

    bm = build_tree_block_mask(layout, block_size=args.block_size)
    block_mask_ms = timed(lambda: build_tree_block_mask(layout, block_size=args.block_size), device, 1,
                          max(1, args.repeats // 2))
    nfull, npart = int(bm.full_kv_num_blocks.sum()), int(bm.kv_num_blocks.sum())
    block_stats = {"full_blocks": nfull, "partial_blocks": npart,
                   "visible_pairs_per_computed_pair": tree_pairs / ((nfull + npart) * args.block_size ** 2)}
    prev = layout.prev if layout.num_events else None      # eviction: runs break at event rows
    paths = build_key_paths(layout.visibility, prev=prev, device=device)
    key_paths_ms = timed(lambda: build_key_paths(layout.visibility, prev=prev, device=device), device, 1,
                         max(1, args.repeats // 2))
    exp_bm = build_tree_block_mask(exp_vis, block_size=args.block_size)
    with_interval = interval_available(device) is None
    interval_stats = None
    if with_interval:
        bm_, bn_ = args.interval_block
        iblocks = build_interval_blocks(layout.visibility, block_m=bm_, block_n=bn_, device=device)
        interval_ms = timed(lambda: build_interval_blocks(layout.visibility, block_m=bm_, block_n=bn_,
                                                          device=device), device, 1, max(1, args.repeats // 2))
        interval_stats = {"block_m": bm_, "block_n": bn_, "full_tiles": iblocks.num_full,
                          "partial_tiles": iblocks.num_partial, "max_intervals": iblocks.max_intervals,
                          "visible_pairs_per_computed_pair": iblocks.visible_fraction(), "build_ms": interval_ms}

    kernel_options = json.loads(args.kernel_options) if args.kernel_options else None
    tree_flex = lambda q_, k_, v_: tree_attention(q_, k_, v_, layout, scale, backend="flex", block_mask=bm,
                                                  kernel_options=kernel_options)
    tree_varlen = lambda q_, k_, v_: tree_attention(q_, k_, v_, layout, scale, backend="varlen", key_paths=paths,
                                                    varlen_kernel="flash" if not on_cpu else "reference")
    with_fa4 = fa4_available(device, (dqk, dv)) and dtype != torch.float32
    tree_fa4 = lambda q_, k_, v_: tree_attention(q_, k_, v_, layout, scale, backend="varlen", key_paths=paths,
                                                 varlen_kernel="fa4")
    tree_interval = lambda q_, k_, v_: tree_attention(q_, k_, v_, layout, scale, backend="interval",
                                                      interval_blocks=iblocks)
    fa4_stats = None
    if with_fa4:
        from megatron_harts.ops.fa4_blocks import build_fa4_blocks
        fblocks = build_fa4_blocks(layout.visibility, dims=(dqk, dv), device=device)
        fa4_build_ms = timed(lambda: build_fa4_blocks(layout.visibility, dims=(dqk, dv), device=device), device, 1,
                             max(1, args.repeats // 2))
        fa4_stats = {"fwd_block": fblocks.fwd_block, "bwd_block": fblocks.bwd_block, "full_tiles": fblocks.num_full,
                     "partial_tiles": fblocks.num_partial, "max_intervals": fblocks.width,
                     "visible_pairs_per_computed_pair": fblocks.visible_fraction(), "build_ms": fa4_build_ms}
    tree_fa4_blocks = lambda q_, k_, v_: tree_attention(q_, k_, v_, layout, scale, backend="fa4", fa4_blocks=fblocks)
    yardsticks = fa4_yardsticks(layout, fblocks, scale, tree_pairs) if with_fa4 else []
    exp_flex = lambda q_, k_, v_: tree_attention(q_, k_, v_, exp_vis, scale, backend="flex", block_mask=exp_bm,
                                                 kernel_options=kernel_options)

    def causal(q_, k_, v_):
        o = F.scaled_dot_product_attention(q_.transpose(0, 1)[None], k_.transpose(0, 1)[None],
                                           v_.transpose(0, 1)[None], is_causal=True, scale=scale,
                                           enable_gqa=H != Hk)
        return o[0].transpose(0, 1)

    offsets = layout.traj_row_offsets.tolist()

    def expanded_loop(q_, k_, v_):
        return torch.cat([causal(q_[a:b], k_[a:b], v_[a:b]) for a, b in zip(offsets[:-1], offsets[1:])])

    check = None
    if not args.no_check:
        grad_ok = not on_cpu
        with torch.set_grad_enabled(grad_ok):
            out_t = tree_flex(q, k, v)
            out_e = exp_flex(qe, ke, ve) if not on_cpu else tree_attention(qe, ke, ve, exp_vis, scale, backend="sdpa")
        check = {"out_max_abs_err": float((out_t.detach()[rows] - out_e.detach()).abs().max()),
                 "out_cosine": cosine(out_t.detach()[rows], out_e.detach())}
        if grad_ok:
            # expanded mode gives every copy of a row its own output gradient (here: the row's g);
            # tree mode gets their sum, and its input gradients must equal the expanded ones
            # summed back onto rows
            g_rows = torch.zeros_like(g, dtype=torch.float32).index_add_(0, rows, ge.float()).to(dtype)
            gt = torch.autograd.grad(out_t, (q, k, v), g_rows)
            ge_in = torch.autograd.grad(out_e, (qe, ke, ve), ge)
            for name, a, b in zip("qkv", gt, ge_in):
                summed = torch.zeros_like(a, dtype=torch.float32).index_add_(0, rows, b.float())
                check[f"grad_{name}_cosine"] = cosine(a, summed)
                check[f"grad_{name}_max_abs_err"] = float((a.float() - summed).abs().max())
        out_v = tree_varlen(q, k, v)
        check["varlen_out_cosine"] = cosine(out_v.detach()[rows], out_e.detach())
        if grad_ok:
            gv = torch.autograd.grad(out_v, (q, k, v), g_rows)
            for name, a, b in zip("qkv", gv, gt):
                check[f"varlen_grad_{name}_cosine_vs_flex"] = cosine(a, b)
        def check_against(prefix, fn):   # output vs expanded, input gradients vs tree flex's
            out_x = fn(q, k, v)
            check[f"{prefix}_out_cosine"] = cosine(out_x.detach()[rows], out_e.detach())
            check[f"{prefix}_out_max_abs_err"] = float((out_x.detach()[rows] - out_e.detach()).abs().max())
            gx = torch.autograd.grad(out_x, (q, k, v), g_rows)
            for name, a, b in zip("qkv", gx, gt):
                check[f"{prefix}_grad_{name}_cosine_vs_flex"] = cosine(a, b)
        if with_fa4:
            check_against("fa4", tree_fa4)
            check_against("fa4_blocks", tree_fa4_blocks)
        if with_interval:
            out_i = tree_interval(q, k, v)
            check["interval_out_cosine"] = cosine(out_i.detach()[rows], out_e.detach())
            check["interval_out_max_abs_err"] = float((out_i.detach()[rows] - out_e.detach()).abs().max())
            if grad_ok:
                gi = torch.autograd.grad(out_i, (q, k, v), g_rows)
                for name, a, b in zip("qkv", gi, gt):
                    check[f"interval_grad_{name}_cosine_vs_flex"] = cosine(a, b)
            del out_i
        del out_t, out_e, out_v

    methods = [("tree_flex", tree_flex, (q, k, v), g, tree_pairs, True),
               ("tree_varlen", tree_varlen, (q, k, v), g, tree_pairs, False),
               *([("tree_varlen_fa4", tree_fa4, (q, k, v), g, tree_pairs, False),
                  ("tree_fa4_blocks", tree_fa4_blocks, (q, k, v), g, tree_pairs, False)] if with_fa4 else []),
               *([("tree_interval", tree_interval, (q, k, v), g, tree_pairs, False)] if with_interval else []),
               ("causal_sdpa", causal, (q, k, v), g, causal_pairs, False),
               *[(name, fn, (q, k, v), g, pairs, False) for name, fn, pairs in yardsticks],
               ("expanded_flex", exp_flex, (qe, ke, ve), ge, expanded_pairs, True)]
    if args.expanded_loop:
        methods.append(("expanded_sdpa_loop", expanded_loop, (qe, ke, ve), ge, expanded_pairs, False))
    if args.tree_sdpa:
        methods.append(("tree_sdpa", lambda a, b, c: tree_attention(a, b, c, layout, scale, backend="sdpa"),
                        (q, k, v), g, tree_pairs, False))
    results = {}
    for name, fn, inputs, gout, pairs, is_flex in methods:
        backward = not (is_flex and on_cpu)
        fwd = timed(fwd_bwd(fn, inputs, gout, False), device, args.warmup, args.repeats)
        both = timed(fwd_bwd(fn, inputs, gout, True), device, args.warmup, args.repeats) if backward else None
        results[name] = {"pairs": pairs, "fwd_ms": fwd, "fwd_bwd_ms": both}
    base = results["causal_sdpa"]
    key = "fwd_bwd_ms"
    for name, r in results.items():
        for kind in ("fwd_ms", "fwd_bwd_ms"):
            t = r[kind]
            per = None if t is None else t / r["pairs"]
            r[kind.replace("_ms", "_ns_per_pair")] = None if per is None else per * 1e6
            ref = base[kind]
            r[kind.replace("_ms", "_per_pair_vs_causal")] = (
                None if per is None or ref is None else per / (ref / base["pairs"]))
    tf, tv, ef = results["tree_flex"], results["tree_varlen"], results["expanded_flex"]
    summary = {
        "tree_flex_per_pair_vs_causal_fwd_bwd": tf["fwd_bwd_per_pair_vs_causal"],
        "tree_flex_per_pair_vs_causal_fwd": tf["fwd_per_pair_vs_causal"],
        "tree_varlen_per_pair_vs_causal_fwd_bwd": tv["fwd_bwd_per_pair_vs_causal"],
        "tree_varlen_per_pair_vs_causal_fwd": tv["fwd_per_pair_vs_causal"],
        "tree_varlen_fa4_per_pair_vs_causal_fwd_bwd": results.get("tree_varlen_fa4", {}).get(
            "fwd_bwd_per_pair_vs_causal"),
        "tree_varlen_fa4_per_pair_vs_causal_fwd": results.get("tree_varlen_fa4", {}).get("fwd_per_pair_vs_causal"),
        "tree_fa4_blocks_per_pair_vs_causal_fwd_bwd": results.get("tree_fa4_blocks", {}).get(
            "fwd_bwd_per_pair_vs_causal"),
        "tree_fa4_blocks_per_pair_vs_causal_fwd": results.get("tree_fa4_blocks", {}).get("fwd_per_pair_vs_causal"),
        "tree_interval_per_pair_vs_causal_fwd_bwd": results.get("tree_interval", {}).get(
            "fwd_bwd_per_pair_vs_causal"),
        "tree_interval_per_pair_vs_causal_fwd": results.get("tree_interval", {}).get("fwd_per_pair_vs_causal"),
        "tree_fa4_blocks_per_pair_vs_band_fa4_fwd_bwd": _per_pair_over(results, "tree_fa4_blocks", "band_fa4"),
        "tree_fa4_blocks_per_pair_vs_causal_fa4_fwd_bwd": _per_pair_over(results, "tree_fa4_blocks", "causal_fa4"),
        "target_per_pair_vs_causal": 1.5,
        "speedup_tree_vs_expanded_fwd_bwd": (ef[key] / tf[key]) if tf[key] and ef[key] else None,
        "speedup_tree_vs_expanded_fwd": ef["fwd_ms"] / tf["fwd_ms"],
    }
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "dtype": args.dtype, "heads": H, "kv_heads": Hk, "dqk": dqk, "dv": dv,
        "block_size": args.block_size, "scheme": args.scheme, "compaction": args.compaction,
        "context_budget": args.context_budget if args.compaction != "none" else None,
        "compaction_events": int(forest.stats()["compaction_events"]),
        "rows": R, "trees": layout.num_trees, "trajectories": layout.num_trajectories,
        "expanded_tokens": E, "compression": E / R,
        "pairs": {"tree": tree_pairs, "causal": causal_pairs, "expanded": expanded_pairs},
        "block_mask_build_ms": block_mask_ms, "tree_block_mask": block_stats,
        "key_paths_build_ms": key_paths_ms, "interval_blocks": interval_stats, "fa4_blocks": fa4_stats,
        "interval_unavailable": interval_available(device),
        "key_paths": {"runs": paths.num_runs, "gathered_keys": paths.gathered_keys, "max_q": paths.max_q,
                      "max_k": paths.max_k},
        "kernel_options": kernel_options, "compile_mode": args.compile_mode, "check": check, "methods": results, "summary": summary,
        "note": "flex has no backward on CPU: fwd_bwd is null there" if on_cpu else None,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return report
    print(f"{report['device']}  torch {report['torch']}  {args.dtype}  heads {H}/{Hk}  dims {dqk}/{dv}")
    print(f"rows {R} in {layout.num_trees} trees, {layout.num_trajectories} trajectories, expanded tokens {E} "
          f"(compression {E / R:.2f}x); block mask build {block_mask_ms:.2f} ms")
    if args.compaction != "none":
        print(f"compaction {args.compaction} at budget {args.context_budget}: {report['compaction_events']} events; "
              f"visible pairs {tree_pairs} of {causal_pairs} causal ({tree_pairs / causal_pairs:.3f})")
    print("tree block mask: " + ", ".join(f"{k_} {v_:.3g}" for k_, v_ in block_stats.items()))
    if check:
        print("check vs expanded: " + ", ".join(f"{k_} {v_:.3g}" for k_, v_ in check.items()))
    print(f"{'method':<20}{'pairs':>13}{'fwd ms':>11}{'ns/pair':>10}{'x causal':>9}"
          f"{'fwd+bwd ms':>12}{'ns/pair':>10}{'x causal':>9}")
    fmt = lambda x, f: "-" if x is None else format(x, f)
    for name, r in results.items():
        print(f"{name:<20}{r['pairs']:>13}{r['fwd_ms']:>11.3f}{r['fwd_ns_per_pair']:>10.4f}"
              f"{r['fwd_per_pair_vs_causal']:>9.2f}{fmt(r['fwd_bwd_ms'], '.3f'):>12}"
              f"{fmt(r['fwd_bwd_ns_per_pair'], '.4f'):>10}{fmt(r['fwd_bwd_per_pair_vs_causal'], '.2f'):>9}")
    s = summary
    rel = s["tree_flex_per_pair_vs_causal_fwd_bwd"] or s["tree_flex_per_pair_vs_causal_fwd"]
    sp = s["speedup_tree_vs_expanded_fwd_bwd"] or s["speedup_tree_vs_expanded_fwd"]
    print(f"tree_flex time/pair vs causal SDPA: {rel:.2f}x (target <= 1.5); tree vs expanded: {sp:.2f}x faster"
          + ("  [CPU: forward only]" if on_cpu else ""))
    relv = s["tree_varlen_per_pair_vs_causal_fwd_bwd"] or s["tree_varlen_per_pair_vs_causal_fwd"]
    print(f"tree_varlen time/pair vs causal SDPA: {relv:.2f}x; key paths: {paths.num_runs} runs, "
          f"{paths.gathered_keys} gathered keys, build {key_paths_ms:.2f} ms")
    if with_fa4:
        print(f"tree_varlen_fa4 time/pair vs causal SDPA: {s['tree_varlen_fa4_per_pair_vs_causal_fwd_bwd']:.2f}x "
              f"(target <= 1.5)")
        print(f"tree_fa4_blocks time/pair vs flash-attn-4's sliding window at the same pairs per row: "
              f"{s['tree_fa4_blocks_per_pair_vs_band_fa4_fwd_bwd']:.2f}x, vs its causal: "
              f"{s['tree_fa4_blocks_per_pair_vs_causal_fa4_fwd_bwd']:.2f}x")
    if with_interval:
        ri = results["tree_interval"]
        rel_i = ri["fwd_bwd_per_pair_vs_causal"] or ri["fwd_per_pair_vs_causal"]
        print(f"tree_interval time/pair vs causal SDPA: {rel_i:.2f}x; tiles: {interval_stats['full_tiles']} full, "
              f"{interval_stats['partial_tiles']} partial, build {interval_stats['build_ms']:.2f} ms")
    else:
        print(f"tree_interval not timed: {interval_available(device)}")
    return report


if __name__ == "__main__":
    run(main)
