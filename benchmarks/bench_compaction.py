#!/usr/bin/env python3
"""Compaction traces (KV-streams) against the re-prefill form: training throughput, one run, one GPU.

For each set (a synthetic SWE-like rollout scheme, Tree-Step or Step-wise, under a compaction
strategy, sliding-window, markovian or summary, at a context budget), the same rollouts are
trained in two forms (docs/design.md, "Compaction traces"):

- **KV-streams traces**: one continuous trajectory per rollout with its compaction events (full
  attention stops seeing the evicted spans; linear attention runs over the whole stream);
- **re-prefill samples**: each compaction starts a new sample of the retained tokens, positions
  reset (``tree_data.reprefill``), the form trainers without in-place eviction use.

Each form trains in expanded mode (``--tree-sharing off``) and tree mode (``within``; the traces
also ``windows`` where the driver accepts events in sharing windows, else the refusal is
recorded), by the training driver (``training.trainer.Trainer`` through bench_throughput's
``run_mode``: forward + backward + optimizer step), the same model and the same driver flags for
every mode of the run except ``--tree-sharing``, each mode from the same initial weights.

Per mode: step time (median of ``--iters`` timed steps after ``--warmup``), trajectory tokens/s
(the traces' tokens N over the step time: the same numerator for both forms), rows computed,
visible attention pairs of the plan's microbatches, the rows of its largest microbatch (what
activation memory follows), peak memory (CUDA; None on the CPU), the loss
of the first step (initial weights) and after one optimizer step.  Per set, the ratios the targets
read: KV-streams tree over KV-streams expanded (step-time speedup against its compression),
KV-streams tree over re-prefill tree (speedup against the ratio of their rows), peak memory of
KV-streams tree against expanded; and the row identities, checked: KV-streams expanded computes
exactly N rows, re-prefill expanded N + its re-prefilled tokens.

The default sizes: one task and one rollout per set, turns until the next would pass
``--max-tokens`` 35,000, so every set's longest trace holds 33k-35k tokens (Tree-Step: a rollout
forking once into two traces, 45k-50k rows as a tree; Step-wise: ~32 steps, ~0.6M expanded
tokens); sliding-window evicts a quarter of the budget per compaction; the row budget is the largest
tree's rows (every rollout in one microbatch); one warm-up and one timed step per mode.  At preset
h200 the twelve sets (two schemes, three strategies, budgets 4096 and 8192) take about eight
minutes on one H200; ``--schemes``, ``--strategies`` and ``--budgets`` select sets.  A CPU smoke
run: ``--device cpu --preset tiny`` with small ``--max-tokens``, ``--budgets``, ``--prompt-median``,
``--action-median``, ``--observation-median``, ``--keep-prefix``, ``--keep-last``, ``--summary-tokens``.
``--profile FILE`` adds one profiled step per mode (where the time goes: GPU kernel seconds by category,
the top kernels and operators).

``--set long-mixed``: instead of the grid, one set per budget of long agent-like traces
(``tree_data.synthetic.synthesize_forks``): ``--num-tasks`` 6 GRPO-like groups of ``--samples-per-task``
4 traces, each group's later traces forking from an earlier one at a random turn (before or after
compaction events), each trace running to its own cap between half of ``--max-tokens`` 74,000 and it,
the groups cycling through ``--strategies`` (sliding-window evicting half the budget), a row budget of
32,768 below the longest trace (pieces), the four modes of the comparison (re-prefill and KV-streams,
expanded and within).  Its row records the groups' strategies, the forks and those after events.
``--split`` (on for this set): one more profiled step per mode split into attention forward, attention
backward, KDA, GEMMs, the pieces' extra forward, other device work and host (``step_profile.py``),
into the mode's ``split`` and a table.  ``--scale S`` multiplies every token count (a CPU-sized set).

``--piece-study``: instead of the four modes, what training in pieces costs.  The traces in tree mode
(``within``) run three times: at the row budget with ``--tree-piece-keep auto`` (a read piece keeps its
graph, one forward, while the memory model says the kept graphs fit) and ``none`` (read pieces run a
forward without graph, then recompute in the backward), and at ``--piece-study-above`` rows, above the longest trace (default: it rounded up to a
multiple of 4096), where no trace is cut.  A ``--tree-piece-memory`` in ``--driver-flags`` applies to
the ``auto`` and uncut runs.  The set's row ``piece_study`` holds the three runs and the
step of each budget-limited run over the uncut one (``auto_over_uncut``, ``none_over_uncut``).

``--plan-only``: instead of training, per mode the driver's plan and the step's memory choice
(``schedules.windows.schedule_choice`` under ``training.trainer.memory_budgets``: the same read pieces
kept whole or in part, the same rows run forward again) and the predicted peak, into the set's row
``plans`` and a table; with ``--device cuda`` the GPU run's bf16 model, ``--device-memory-gib`` its
memory where this machine has no GPU.
"""
import argparse
import contextlib
import json
import math
import os
import platform
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench_throughput import (PRESETS, check_device, memory_estimate, model_flags, parameter_counts,  # noqa: E402
                              pieces_accounting, profile_step, release_memory, run_mode, visible_pairs)
from step_profile import idle_table, profiled_split, split_table  # noqa: E402
from megatron_harts.cli import ArgumentParser, CliError, output_path, run  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEMES = ("tree-step", "step-wise")
STRATEGIES = ("sliding-window", "markovian", "summary")
SETS = ("grid", "long-mixed")
#: the arguments holding token counts (``--scale`` multiplies them)
SCALED = ("max_tokens", "prompt_median", "action_median", "observation_median", "budgets", "keep_prefix",
          "keep_last", "evict_chunk", "summary_tokens", "microbatch_tokens")
#: (form, sharing): the modes of every set, in the order they run
MODES = (("reprefill", "off"), ("reprefill", "within"), ("kv", "off"), ("kv", "within"), ("kv", "windows"))
#: the generator's fields (``SweConfig``) that flags set, by flag
KNOBS = {"num_tasks": "--num-tasks", "samples_per_task": "--samples-per-task", "prompt_median": "--prompt-median",
         "min_turns": "--max-turns", "max_turns": "--max-turns", "action_median": "--action-median",
         "observation_median": "--observation-median", "branch_prob": "--branch-prob",
         "branch_factor": "--branch-factor", "max_leaves": "--max-leaves", "max_tokens": "--max-tokens",
         "context_budget": "the budget", "keep_prefix": "--keep-prefix", "keep_last": "--keep-last",
         "evict_chunk": "--evict-chunk", "summary_tokens": "--summary-tokens"}


def mode_key(form: str, sharing: str) -> str:
    return f"{form}_{'expanded' if sharing == 'off' else 'tree_' + sharing}"


def _progress(text: str) -> None:
    print(f"compaction: {text}", file=sys.stderr, flush=True)


def swe_config(a, scheme: str, strategy: str, budget: int):
    """The generator's configuration of one set: ``a``'s sizes, ``strategy`` at ``budget`` (the
    sliding window evicts ``--evict-chunk`` tokens, by default a quarter of the budget)."""
    from megatron_harts.tree_data.synthetic import SweConfig
    return SweConfig(scheme=scheme, num_tasks=a.num_tasks, samples_per_task=a.samples_per_task,
                     prompt_median=a.prompt_median, min_turns=a.max_turns, max_turns=a.max_turns,
                     action_median=a.action_median, observation_median=a.observation_median,
                     branch_prob=a.branch_prob, branch_factor=a.branch_factor, max_leaves=a.max_leaves,
                     max_tokens=a.max_tokens, vocab_size=PRESETS[a.preset]["vocab"], seed=a.seed, compaction=strategy,
                     context_budget=budget, keep_prefix=a.keep_prefix, keep_last=a.keep_last,
                     evict_chunk=a.evict_chunk or max(1, budget // 4), summary_tokens=a.summary_tokens)


def _synthesize(where: str, make):
    """``make()``'s trajectories; the generator's errors name its fields: here the flags."""
    try:
        return make()
    except ValueError as e:
        message = re.sub(r"\b(" + "|".join(KNOBS) + r")\b", lambda m: KNOBS[m.group(1)], str(e))
        raise CliError(f"{where}: {message}") from None


def _forms(name: str, traces) -> dict:
    """Both forms of ``traces``: ``kv`` (the traces) and ``reprefill`` (their samples) as forests, N
    (the traces' tokens) and the re-prefilled tokens (the samples hold N + that many)."""
    from megatron_harts.tree_data import build_forest
    from megatron_harts.tree_data.reprefill import reprefill, reprefill_tokens
    samples = reprefill(traces)
    kv, rp = build_forest(traces), build_forest(samples)
    n, extra = int(kv.traj_length.sum()), reprefill_tokens(traces)
    if int(rp.traj_length.sum()) != n + extra:
        raise AssertionError(f"{name}: the re-prefill samples hold {int(rp.traj_length.sum())} "
                             f"tokens, not N + re-prefilled = {n} + {extra}")
    return {"forests": {"kv": kv, "reprefill": rp}, "N": n, "reprefilled": extra}


def build_set(a, scheme: str, strategy: str, budget: int) -> dict:
    """One grid set's rollouts in both forms (``_forms``)."""
    from megatron_harts.tree_data.synthetic import synthesize_swe
    cfg = swe_config(a, scheme, strategy, budget)
    traces = _synthesize(f"--schemes {scheme} --strategies {strategy} --budgets {budget}", lambda: synthesize_swe(cfg))
    name = f"{scheme}/{strategy}/{budget}"
    return {"name": name, "scheme": scheme, "strategy": strategy, "budget": budget, **_forms(name, traces),
            "evict_chunk": cfg.evict_chunk}


def fork_facts(traces) -> dict:
    """Where a set's rollouts fork: per group its trajectories, and over the set the forks (each
    trajectory after its group's first, at its longest common prefix with an earlier one of the
    group) and the forks that inherit compaction events (an event before the fork point)."""
    groups: dict = {}
    for t in traces:
        groups.setdefault(t.group, []).append(t)
    forks = after = 0
    for members in groups.values():
        for j in range(1, len(members)):
            t = members[j]
            at = max(_common_prefix(t.tokens, m.tokens) for m in members[:j])
            forks += 1
            ev = t.compactions
            after += int(ev is not None and bool((ev[:, 0] < at).any()))
    return {"groups": {g: len(m) for g, m in groups.items()}, "forks": forks, "forks_after_events": after}


def _common_prefix(x: np.ndarray, y: np.ndarray) -> int:
    n = min(len(x), len(y))
    d = np.flatnonzero(x[:n] != y[:n])
    return int(d[0]) if len(d) else n


def build_long_set(a, budget: int) -> dict:
    """The long mixed set at ``budget`` (``tree_data.synthetic.synthesize_forks``): ``--num-tasks``
    groups of ``--samples-per-task`` traces forking at random turns, the groups' strategies cycling
    through ``--strategies``, in both forms (``_forms``)."""
    from megatron_harts.tree_data.synthetic import SweConfig, synthesize_forks
    cfg = SweConfig(scheme="tree-step", num_tasks=a.num_tasks, samples_per_task=a.samples_per_task,
                    prompt_median=a.prompt_median, min_turns=1, max_turns=a.max_turns,
                    action_median=a.action_median, observation_median=a.observation_median,
                    max_tokens=a.max_tokens, vocab_size=PRESETS[a.preset]["vocab"], seed=a.seed,
                    context_budget=budget, keep_prefix=a.keep_prefix, keep_last=a.keep_last,
                    evict_chunk=a.evict_chunk or max(1, budget // 2), summary_tokens=a.summary_tokens)
    traces = _synthesize(f"--set long-mixed --budgets {budget}", lambda: synthesize_forks(cfg, a.strategies))
    name = f"long-mixed/{budget}"
    strategy_of = {f"task{g}": a.strategies[g % len(a.strategies)] for g in range(a.num_tasks)}
    return {"name": name, "scheme": "forks", "strategy": "mixed", "budget": budget, **_forms(name, traces),
            "evict_chunk": cfg.evict_chunk, "group_strategies": strategy_of, **fork_facts(traces)}


def driver_argv(a, sets) -> list:
    """The driver flags of every mode of the run (all but ``--tree-sharing``): the preset's model,
    the run's longest sample as ``--seq-length``, the row budget, SFT."""
    p = PRESETS[a.preset]
    forests = [f for s in sets for f in s["forests"].values()]
    longest = max(int(f.traj_length.max()) for f in forests)
    batch = max(int(f.num_trajectories) for f in forests)
    return model_flags(p, "--bf16" if a.device == "cuda" else "") + [
        "--seq-length", str(longest), "--tree-microbatch-tokens", str(a.microbatch_tokens),
        "--global-batch-size", str(batch), "--train-iters", "1000", "--lr", "1e-5", "--seed", "1234",
        "--log-interval", "1000000", "--rl-objective", "sft", "--distributed-backend",
        "nccl" if a.device == "cuda" else "gloo", "--tree-kda-backend", a.kda_backend,
        "--tree-attention-backend", a.attention_backend] + a.driver_flags.split()


def measure(argv, forest, n: int, a, title: str) -> dict:
    """One mode: ``run_mode``'s timed steps and their figures (module docstring); N = ``n``.  With
    ``--split`` one more step under the profiler split by what runs (``step_profile``); with
    ``--profile`` one more: its wall and GPU kernel seconds, kernel time per category in the result,
    its tables appended to the file under ``title``; with ``--memory-profile`` one more under the
    allocator's history: the bytes alive at its peak by allocation site (``memory_step``)."""
    def probe(trainer, f):
        split = profiled_split(lambda: trainer.step(f), a.device) if a.split else None
        return split, profile_step(trainer, f, a.device) if a.profile else None
    times, metrics, losses, peak, plan, probed, memory, backends = run_mode(
        argv, forest, a.iters, a.warmup, a.device, profile=probe if a.split or a.profile else False,
        memory=a.memory_profile)
    split, prof = probed if probed is not None else (None, None)
    t = statistics.median(times)
    m = metrics[-1]
    extra = {}
    if split is not None:
        extra["split"] = split
    if memory is not None:
        extra["memory_profile"] = memory
    if prof is not None:
        summary, tables = prof
        extra["profile"] = summary
        with open(a.profile, "a") as f:
            f.write(f"===== {title}: wall {summary['wall_seconds']:.3f} s, kernels {summary['kernel_seconds']:.3f} s "
                    f"({summary['kernel_launches']} launches)\n"
                    + "".join(f"  {cat:>14}: {v['seconds']:.3f} s, {v['launches']} launches\n"
                              for cat, v in summary["categories"].items()) + tables + "\n")
    pieces = pieces_accounting(plan)
    return {**extra, "step_seconds": t, "step_seconds_all": times, "trajectory_tokens_per_s": n / t,
            "rows_computed": int(m["computed_tokens"]), "sample_tokens": int(m["trajectory_tokens"]),
            "visible_pairs": int(visible_pairs(plan)), "peak_memory_gib": peak,
            "largest_microbatch_rows": max(max((int(mb.features.rows) for mb in plan.microbatches), default=0),
                                           pieces["largest"]),
            "piece_microbatches": pieces["microbatches"], "piece_rows": pieces["rows"],
            "piece_extra_forward_rows": m.get("piece_extra_forward_rows"), "read_pieces": m.get("read_pieces"),
            "kept_pieces": m.get("kept_pieces"), "partly_kept_pieces": m.get("partly_kept_pieces"),
            "predicted_peak_gib": m.get("predicted_peak_gib"), "piece_memory_gib": m.get("piece_memory_gib"),
            "alloc_retries": m.get("alloc_retries"),
            "loss_first_step": losses[0][0], "loss_after_one_step": losses[1][0] if len(losses) > 1 else None,
            "loss_per_step": [loss for loss, _ in losses], "grad_norm_per_step": [g for _, g in losses],
            "microbatches": m["microbatches"], "kda_calls": m["kda_calls"], "planner": plan.planner, **backends}


def _kernel_seconds(mode: dict):
    return mode.get("profile", {}).get("kernel_seconds")


def _first_line(e: BaseException) -> str:
    """An out-of-memory error's first line (CUDA's message goes on for lines of allocator advice)."""
    return str(e).splitlines()[0] if str(e) else "out of memory"


def _ratio(x, y):
    return None if x is None or y is None or not y else x / y


def derived(row: dict) -> dict:
    """The ratios of one set's modes (module docstring)."""
    ran = {k: m for k, m in row["modes"].items() if "skipped" not in m}
    kv_e = ran.get("kv_expanded")
    rp_e, rp_t = (ran.get(k) for k in ("reprefill_expanded", "reprefill_tree_within"))  # --forms kv: None
    out = {}
    N, extra = row["trace_tokens"], row["reprefilled_tokens"]
    if kv_e is None:                  # the modes' yardstick did not run: no ratios, no rows check
        out["rows_check"] = {"N": N, "reprefilled_tokens": extra, "kv_expanded_rows": None,
                             "reprefill_expanded_rows": None, "ok": None}
        return out
    for key in ("kv_tree_within", "kv_tree_windows"):
        tree = ran.get(key)
        if tree is None:
            continue
        tag = key[len("kv_tree_"):]
        speedup = _ratio(kv_e["step_seconds"], tree["step_seconds"])
        compression = _ratio(kv_e["rows_computed"], tree["rows_computed"])
        out[f"kv_{tag}_over_kv_expanded"] = {
            "speedup": speedup, "compression": compression,
            "speedup_over_compression": _ratio(speedup, compression),
            "peak_memory_ratio": _ratio(tree["peak_memory_gib"], kv_e["peak_memory_gib"]),
            "largest_microbatch_rows_ratio": _ratio(tree.get("largest_microbatch_rows"),
                                                    kv_e.get("largest_microbatch_rows")),
            "kernel_speedup": _ratio(_kernel_seconds(kv_e), _kernel_seconds(tree))}
        if rp_t is not None:
            speedup = _ratio(rp_t["step_seconds"], tree["step_seconds"])
            rows = _ratio(rp_t["rows_computed"], tree["rows_computed"])
            out[f"kv_{tag}_over_reprefill_tree"] = {"speedup": speedup, "rows_ratio": rows,
                                                    "speedup_over_rows_ratio": _ratio(speedup, rows)}
        if rp_e is not None:
            out[f"kv_{tag}_over_reprefill_expanded"] = {
                "speedup": _ratio(rp_e["step_seconds"], tree["step_seconds"]),
                "rows_ratio": _ratio(rp_e["rows_computed"], tree["rows_computed"])}
    if rp_e is not None:
        out["kv_expanded_over_reprefill_expanded"] = {
            "speedup": _ratio(rp_e["step_seconds"], kv_e["step_seconds"]),
            "rows_ratio": _ratio(rp_e["rows_computed"], kv_e["rows_computed"])}
    rp_rows = None if rp_e is None else rp_e["rows_computed"]
    out["rows_check"] = {"N": N, "reprefilled_tokens": extra, "kv_expanded_rows": kv_e["rows_computed"],
                         "reprefill_expanded_rows": rp_rows,
                         "ok": kv_e["rows_computed"] == N and rp_rows in (None, N + extra)}
    return out


def form_stats(s: dict) -> dict:
    """Both forms' forest statistics (``Forest.stats()``), the traces' length range and events."""
    kv, rp = s["forests"]["kv"], s["forests"]["reprefill"]
    return {"kv": {**kv.stats(), "min_trajectory_tokens": int(kv.traj_length.min())},
            "reprefill": {**rp.stats(), "reprefilled_tokens": s["reprefilled"]}}


def parse(argv):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="h200", choices=sorted(PRESETS),
                    help="model of benchmarks/bench_throughput.py (tiny: CPU smoke run)")
    ap.add_argument("--set", default="grid", choices=SETS,
                    help="grid: one set per scheme, strategy and budget (33k-35k-token traces, one strategy a "
                         "set); long-mixed: one set per budget of 6 GRPO-like groups of 4 traces of up to 74k "
                         "tokens forking at random turns, the strategies mixed over the groups, 32k-row budget")
    ap.add_argument("--scale", type=float, default=1.0, metavar="S",
                    help="multiply every token count of the set (lengths, budgets, kept, evicted and summary "
                         "tokens, the row budget; given or default) by S: e.g. 0.02 for a CPU-sized long-mixed set")
    ap.add_argument("--schemes", nargs="+", default=None, choices=SCHEMES,
                    help="--set grid: rollout schemes (default both)")
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES,
                    help="compaction strategies (tree_data.synthetic: sliding-window evicts --evict-chunk tokens "
                         "wherever the budget would be exceeded; markovian keeps --keep-last tokens at a message "
                         "boundary; summary evicts everything after the prefix and adds a --summary-tokens bridge)")
    ap.add_argument("--budgets", nargs="+", type=int, default=[4096, 8192], metavar="C",
                    help="context budgets: live tokens a rollout holds at most (default 4096 8192)")
    ap.add_argument("--tree-sharing", nargs="+", default=None, choices=["within", "windows"],
                    help="tree modes of the traces beside expanded (default within windows; long-mixed: within; "
                         "windows runs where the driver accepts compaction events in sharing windows; else its "
                         "refusal is recorded)")
    ap.add_argument("--forms", nargs="+", default=["reprefill", "kv"], choices=["reprefill", "kv"],
                    help="forms to train (default both; kv alone: the traces' modes, e.g. to profile them)")
    ap.add_argument("--num-tasks", type=int, default=None,
                    help="rollout tasks (trees; long-mixed: GRPO groups) per set (default 1; long-mixed 6)")
    ap.add_argument("--samples-per-task", type=int, default=None,
                    help="rollouts per task (default 1; long-mixed: traces per group, 4)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="trace length cap: rollouts run until the next turn would pass it (default 35000; "
                         "long-mixed 74000, each trace its own cap between half of it and it)")
    ap.add_argument("--max-turns", type=int, default=200,
                    help="turns per rollout (enough that rollouts end at --max-tokens)")
    ap.add_argument("--prompt-median", type=int, default=3000)
    ap.add_argument("--action-median", type=int, default=200)
    ap.add_argument("--observation-median", type=int, default=600)
    ap.add_argument("--branch-prob", type=float, default=None,
                    help="--set grid, Tree-Step: probability that a step branches (default 0.05: rollouts fork "
                         "late and share more)")
    ap.add_argument("--branch-factor", type=int, default=None,
                    help="--set grid, Tree-Step: children of a branching step (default 2)")
    ap.add_argument("--max-leaves", type=int, default=None,
                    help="--set grid, Tree-Step: leaves per rollout at most (default 2)")
    ap.add_argument("--keep-prefix", type=int, default=256, help="tokens never evicted (system prompt, task)")
    ap.add_argument("--keep-last", type=int, default=512, help="markovian: tokens kept before a message")
    ap.add_argument("--evict-chunk", type=int, default=None,
                    help="sliding-window: tokens evicted per compaction (default a quarter of the budget; "
                         "long-mixed: half)")
    ap.add_argument("--summary-tokens", type=int, default=256, help="summary: bridge tokens after a compaction")
    ap.add_argument("--seed", type=int, default=0, help="generator seed")
    ap.add_argument("--microbatch-tokens", type=int, default=None,
                    help="--tree-microbatch-tokens of every mode (default the rows of the largest tree of traces, "
                         "rounded up to a multiple of 1024: every rollout's trace tree fits one microbatch; "
                         "long-mixed: 32768; below the longest trace, traces train in pieces)")
    ap.add_argument("--iters", type=int, default=1, help="timed steps per mode (the step time is their median)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per mode before them")
    ap.add_argument("--kda-backend", default="auto")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--driver-flags", default="", metavar="'FLAGS'",
                    help="more training-driver flags for every mode, e.g. '--tree-triton-max-configs 1'")
    ap.add_argument("--out", default=None, metavar="FILE",
                    help="results JSON (default out/compaction-<time>.json in the repository)")
    ap.add_argument("--profile", default=None, metavar="FILE",
                    help="profile one more step of every mode (torch.profiler): wall and GPU kernel seconds and "
                         "kernel time per category into the results (and the kernel-time speedup of tree over "
                         "expanded), the top kernels and operators appended to FILE")
    ap.add_argument("--split", action=argparse.BooleanOptionalAction, default=None,
                    help="one more profiled step per mode split into attention forward and backward, KDA, GEMMs, "
                         "the pieces' extra forward, other device work and host (benchmarks/step_profile.py) "
                         "into the results and a table (default: on with --set long-mixed)")
    ap.add_argument("--memory-profile", action="store_true",
                    help="one more step of every mode under the CUDA allocator's history: the bytes alive at the "
                         "step's peak by allocation site into the results (`memory_profile`), beside the memory "
                         "model's prediction (GPU only)")
    ap.add_argument("--piece-study", action="store_true",
                    help="instead of the modes: the traces in tree mode at the row budget with --tree-piece-keep "
                         "auto and none, and at --piece-study-above rows (no trace cut); their step times and ratios")
    ap.add_argument("--piece-study-above", type=int, default=None, metavar="ROWS",
                    help="--piece-study: the row budget of the uncut run (default: the longest trace rounded up to "
                         "a multiple of 4096)")
    ap.add_argument("--plan-only", action="store_true",
                    help="instead of training: per mode the driver's plan and memory choice (microbatches, rows, read "
                         "pieces kept whole or in part, rows whose forward runs again, predicted peak), on any machine")
    ap.add_argument("--device-memory-gib", type=float, default=None, metavar="GIB",
                    help="--plan-only with --device cuda: the GPU memory the pieces' default budget is taken from "
                         "(default: this machine's GPU; needed where there is none)")
    ap.add_argument("--json", action="store_true",
                    help="print the results JSON on stdout (the tables then go to stderr)")
    a = ap.parse_args(argv)
    long = a.set == "long-mixed"
    if long:
        for flag, value in (("--schemes", a.schemes), ("--branch-prob", a.branch_prob),
                            ("--branch-factor", a.branch_factor), ("--max-leaves", a.max_leaves)):
            if value is not None:
                raise CliError(f"{flag} applies to --set grid (long-mixed groups fork at random turns)")
    defaults = {"schemes": list(SCHEMES), "num_tasks": 6 if long else 1, "samples_per_task": 4 if long else 1,
                "max_tokens": 74000 if long else 35000, "branch_prob": 0.05, "branch_factor": 2, "max_leaves": 2,
                "tree_sharing": ["within"] if long else ["within", "windows"], "split": long,
                "microbatch_tokens": 32768 if long else None}
    for key, value in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if not a.scale > 0 or not math.isfinite(a.scale):
        raise CliError(f"--scale must be a positive number, got {a.scale}")
    if a.scale != 1.0:
        for key in SCALED:
            value = getattr(a, key)
            if isinstance(value, list):
                setattr(a, key, [max(1, round(v * a.scale)) for v in value])
            elif value is not None:
                setattr(a, key, max(min(value, 1), round(value * a.scale)))
    for flag, value, low in (("--num-tasks", a.num_tasks, 1), ("--samples-per-task", a.samples_per_task, 1),
                             ("--max-tokens", a.max_tokens, 2), ("--max-turns", a.max_turns, 1),
                             ("--iters", a.iters, 1), ("--warmup", a.warmup, 0)):
        if value < low:
            raise CliError(f"{flag} must be >= {low}, got {value}")
    for b in a.budgets:
        if b < 2:
            raise CliError(f"--budgets: each budget must be >= 2, got {b}")
    if a.microbatch_tokens is not None and a.microbatch_tokens < 1:
        raise CliError(f"--microbatch-tokens must be >= 1, got {a.microbatch_tokens}")
    if a.piece_study_above is not None and not a.piece_study:
        raise CliError("--piece-study-above applies with --piece-study")
    if a.device_memory_gib is not None and not (a.plan_only and a.device == "cuda"):
        raise CliError("--device-memory-gib applies with --plan-only --device cuda (a training run reads its GPU's "
                       "memory; a CPU run's budget does not depend on it)")
    if a.device_memory_gib is not None and not (a.device_memory_gib > 0 and math.isfinite(a.device_memory_gib)):
        raise CliError(f"--device-memory-gib must be a positive number of GiB, got {a.device_memory_gib}")
    if a.memory_profile and (a.device != "cuda" or a.plan_only or a.piece_study):
        raise CliError("--memory-profile needs a training run on a GPU (--device cuda, not --plan-only or "
                       "--piece-study): the allocator's history is CUDA's")
    if a.plan_only and a.piece_study:
        raise CliError("--plan-only and --piece-study: choose one")
    if a.piece_study and "--tree-piece-keep" in a.driver_flags.split():
        raise CliError("--driver-flags: --piece-study sets --tree-piece-keep itself (all, then none)")
    if not a.plan_only:
        check_device(a.device)
    elif a.device == "cuda" and not torch.cuda.is_available() and a.device_memory_gib is None:
        raise CliError("--plan-only --device cuda without a GPU here: give --device-memory-gib (the GPU's memory)")
    a.schemes, a.strategies = list(dict.fromkeys(a.schemes)), list(dict.fromkeys(a.strategies))
    a.budgets, a.tree_sharing = list(dict.fromkeys(a.budgets)), list(dict.fromkeys(a.tree_sharing))
    a.forms = list(dict.fromkeys(a.forms))
    if "kv" not in a.forms:
        raise CliError("--forms must include kv: every ratio is taken against the traces' expanded mode")
    if a.out is None:        # its folder is made when the run starts
        a.out = os.path.join(os.path.dirname(HERE), "out", time.strftime("compaction-%Y%m%d-%H%M%S.json"))
    else:
        output_path(a.out, "--out")
    if a.profile is not None:
        output_path(a.profile, "--profile")
    return a


def machine(device: str) -> dict:
    gpu = device == "cuda" and torch.cuda.is_available()      # --plan-only may size a GPU run elsewhere
    out = {"device": torch.cuda.get_device_name() if gpu else platform.processor(),
           "python": platform.python_version(), "torch": torch.__version__}
    for name, module in (("megatron_core", "megatron.core"), ("fla", "fla")):
        try:
            out[name] = __import__(module, fromlist=["__version__"]).__version__
        except Exception:
            out[name] = None
    return out


def summary_line(row: dict) -> str:
    """One set's figures on one line: each mode's step time and rows, then the ratios."""
    parts = []
    for key, m in row["modes"].items():
        parts.append(f"{key} skipped" if "skipped" in m else
                     f"{key} {m['step_seconds']:.3f}s {m['rows_computed']} rows")
    d = row["derived"]
    for tag in ("within", "windows"):
        w, r = d.get(f"kv_{tag}_over_kv_expanded"), d.get(f"kv_{tag}_over_reprefill_tree")
        if w:
            parts.append(f"KV {tag} / KV expanded {w['speedup']:.2f}x at {w['compression']:.2f}x compression"
                         + (f"; / re-prefill tree {r['speedup']:.2f}x at {r['rows_ratio']:.2f}x rows" if r else ""))
    return f"{row['set']}: " + " | ".join(parts)


def set_line(row: dict) -> str:
    """What a long mixed set holds, on one line."""
    kv = row["forms"]["kv"]
    mix = ", ".join(f"{st} {n}" for st, n in row["strategies"].items())
    return (f"{row['set']}: {kv['num_trajectories']} traces in {len(row['groups'])} groups ({mix}), "
            f"{kv['min_trajectory_tokens']:,}-{row['longest_trace_tokens']:,} tokens, N = {row['trace_tokens']:,}, "
            f"{kv['compaction_events']} events ({kv['compaction_events_tree']} as a forest), {row['forks']} forks "
            f"({row['forks_after_events']} after events); re-prefill form "
            f"{row['trace_tokens'] + row['reprefilled_tokens']:,} tokens; row budget {row['microbatch_tokens']:,}")


def mode_table(row: dict) -> str:
    """Each mode's rows, visible attention pairs, step time, peak memory and the memory model's prediction
    of it, then where its profiled step's time goes (``--split``) and where the bytes alive at its peak
    were allocated (``--memory-profile``: the six largest sites)."""
    lines = [f"{'mode':<24}{'rows':>11}{'pairs':>11}{'pieces':>8}{'step s':>9}{'peak GiB':>10}{'predicted':>11}"]
    splits, memory = {}, []
    for key, m in row["modes"].items():
        if "skipped" in m:
            lines.append(f"{key:<24}  not run")
            continue
        peak = "-" if m["peak_memory_gib"] is None else f"{m['peak_memory_gib']:.1f}"
        pred = "-" if m.get("predicted_peak_gib") is None else f"{m['predicted_peak_gib']:.1f}"
        lines.append(f"{key:<24}{m['rows_computed']:>11,}{m['visible_pairs']:>11.3g}{m['piece_microbatches']:>8}"
                     f"{m['step_seconds']:>9.3f}{peak:>10}{pred:>11}")
        if "split" in m:
            splits[key] = m["split"]
        if "memory_profile" in m:
            mp = m["memory_profile"]
            memory.append(f"{key}: {mp['peak_bytes'] / 2**30:.2f} GiB above the step's start "
                          f"({mp['allocated_at_start_bytes'] / 2**30:.2f} GiB)")
            memory += [f"  {b / 2**30:8.3f} GiB  {site}" for site, b in list(mp["sites"].items())[:6]]
    out = "\n".join(lines) + "\n"
    if splits:
        out += "profiled step: seconds (share of its wall time)\n" + split_table(splits)
        idle = idle_table(splits)
        if idle:
            out += "what the host ran while the device idled (profiled step)\n" + idle
    if memory:
        out += "alive at the profiled step's peak, by allocation site\n" + "\n".join(memory) + "\n"
    return out


def plan_mode(a, argv: list, forest) -> dict:
    """One mode without training (``--plan-only``): the driver's plan of ``forest`` under ``argv`` and its
    schedule's choices as the step makes them (``schedules.windows.schedule_choice`` on replica 0), with the
    budgets the driver takes (``training.trainer.memory_budgets``; the pieces' default from
    ``--device-memory-gib`` or this machine's GPU), the parameter state of the preset
    (``bench_throughput.parameter_counts``) and the predicted peak (``bench_throughput.memory_estimate``)."""
    from megatron_harts.planner.memory import GIB, ModelShape, state_bytes_per_parameter
    from megatron_harts.schedules.windows import piece_extra_forward_rows, schedule_choice
    from megatron_harts.training.arguments import cost_model, hybrid_config, parse_args
    from megatron_harts.training.step import SharingSettings, plan_step, replica_microbatches
    from megatron_harts.training.trainer import memory_budgets
    from megatron_harts.flags import shared_fields
    args = parse_args(argv, require_data=False)
    cfg = hybrid_config(args, device="cpu")
    shape = ModelShape.from_config(cfg)
    p = PRESETS[a.preset]
    state = parameter_counts(p)["total"] * state_bytes_per_parameter(shape.element_bytes, 1)
    device_bytes = a.device_memory_gib * GIB if a.device_memory_gib is not None else \
        torch.cuda.get_device_properties(0).total_memory if a.device == "cuda" else None
    _, step_budget, piece_budget = memory_budgets(args, shape, state, device_bytes=device_bytes)
    settings = SharingSettings(**shared_fields(args.tree, SharingSettings), cost_model=cost_model(args),
                               memory_budget_bytes=step_budget, piece_budget_bytes=piece_budget)
    plan = plan_step(forest, settings, 1)
    mbs = replica_microbatches(forest, plan, 0, settings)
    tree = args.tree
    choice = schedule_choice(mbs, cfg, recompute_producers=tree.recompute_producers,
                             memory_budget=None if tree.recompute_producers else step_budget,
                             piece_keep=tree.piece_keep, piece_budget=piece_budget, predict=True)
    largest = max((int(mb.layout.num_rows) for mb in mbs), default=0)
    act = choice.memory.predicted_peak_bytes
    mem = memory_estimate(p, largest, p.get("recompute"), act)
    return {"microbatches": len(mbs), "rows": int(sum(int(mb.layout.num_rows) for mb in mbs)),
            "largest_microbatch_rows": largest, "read_pieces": len(choice.pieces.readers),
            "kept_pieces": len(choice.keep), "partly_kept_pieces": sum(1 for n in choice.keep.values() if n),
            "piece_extra_forward_rows": piece_extra_forward_rows(mbs, choice.pieces.readers, choice.keep,
                                                                 cfg.num_layers),
            "recomputed_windows": len(choice.recompute), "windows": len(choice.consumers_of),
            "piece_memory_gib": None if piece_budget is None else piece_budget / GIB,
            "predicted_activations_gib": act / GIB, "predicted_peak_gib": mem["total"] / GIB,
            "state_gib": mem["weights_optimizer"] / GIB}


def plan_table(row: dict) -> str:
    """``--plan-only``'s table of one set: per mode microbatches, rows, read pieces kept (in part), rows run
    forward again, the pieces' budget and the predicted peak."""
    lines = [f"{'mode':<24}{'mbs':>5}{'rows':>11}{'read/kept/part':>16}{'fwd again':>11}{'budget GiB':>12}"
             f"{'peak GiB':>10}"]
    for key, m in row["plans"].items():
        if "skipped" in m:
            lines.append(f"{key:<24}  not planned ({m['skipped']})")
            continue
        budget = "-" if m["piece_memory_gib"] is None else f"{m['piece_memory_gib']:.1f}"
        kept = f"{m['read_pieces']}/{m['kept_pieces']}/{m['partly_kept_pieces']}"
        lines.append(f"{key:<24}{m['microbatches']:>5}{m['rows']:>11,}{kept:>16}{m['piece_extra_forward_rows']:>11,}"
                     f"{budget:>12}{m['predicted_peak_gib']:>10.1f}")
    return f"{row['set']} (planned, not trained)\n" + "\n".join(lines) + "\n"


def _with_budget(argv: list, rows: int) -> list:
    """``argv`` with its ``--tree-microbatch-tokens`` set to ``rows``."""
    i = argv.index("--tree-microbatch-tokens")
    return argv[:i + 1] + [str(rows)] + argv[i + 2:]


def piece_study(a, s: dict, common: list, row: dict, say, save) -> None:
    """``--piece-study`` on one set (module docstring) into ``row["piece_study"]``: the traces in tree
    mode with the pieces keeping their graphs, recomputing, and uncut at a budget above the longest
    trace; ``save()`` after each run."""
    above = a.piece_study_above
    sharing = a.tree_sharing[0]
    none = list(common)
    if "--tree-piece-memory" in none:         # a budget for auto's choice: the driver refuses it with none
        i = none.index("--tree-piece-memory")
        del none[i:i + 2]
    runs = (("auto", common + ["--tree-piece-keep", "auto"]), ("none", none + ["--tree-piece-keep", "none"]),
            ("uncut", _with_budget(common, above)))
    study = row["piece_study"] = {"sharing": sharing, "row_budget": a.microbatch_tokens, "uncut_row_budget": above}
    for tag, argv in runs:
        release_memory(a.device)
        _progress(f"{s['name']} piece study, {tag}: training ({a.warmup} warm-up + {a.iters} timed steps)")
        try:
            with contextlib.redirect_stdout(sys.stderr):
                m = measure(argv + ["--tree-sharing", sharing], s["forests"]["kv"], s["N"], a,
                            f"{s['name']} piece study {tag}")
        except torch.OutOfMemoryError as e:      # the other runs still go; the study says why this one did not
            study[tag] = {"skipped": f"out of GPU memory: {_first_line(e)}"}
            save()
            _progress(f"{s['name']} piece study, {tag}: not run ({study[tag]['skipped']})")
            continue
        study[tag] = m
        save()
        _progress(f"{s['name']} piece study, {tag}: {m['step_seconds']:.3f} s/step, {m['rows_computed']} rows, "
                  f"{m['piece_microbatches']} piece microbatches, extra forward rows "
                  f"{m['piece_extra_forward_rows']}, peak {m['peak_memory_gib']}")
    ran = {tag: study[tag] for tag, _ in runs if "skipped" not in study[tag]}
    for tag in ("auto", "none"):
        if tag in ran and "uncut" in ran:
            study[f"{tag}_over_uncut"] = ran[tag]["step_seconds"] / ran["uncut"]["step_seconds"]

    def told(tag: str) -> str:
        if tag not in ran:
            return "not run (out of GPU memory)"
        m, over = ran[tag], study.get(f"{tag}_over_uncut")
        kept = f", {m['kept_pieces']}/{m['read_pieces']} read pieces kept" if tag == "auto" else ""
        return f"{m['step_seconds']:.3f} s" + kept + (f", {over:.3f}x uncut" if over is not None else "")
    say(f"{s['name']}: pieces at {a.microbatch_tokens} rows, keeping graphs where memory allows {told('auto')}; "
        f"recomputing {told('none')}; uncut at {above} rows {told('uncut')}")
    save()


def main(argv=None):
    a = parse(argv)
    from megatron_harts.planner.microbatch import PlanningError
    results = {"machine": machine(a.device), "preset": a.preset, "model": PRESETS[a.preset], "args": vars(a),
               "sets": {}}
    # bad knobs fail here, before any output
    sets = [build_long_set(a, budget) for budget in a.budgets] if a.set == "long-mixed" else \
        [build_set(a, scheme, strategy, budget)
         for scheme in a.schemes for strategy in a.strategies for budget in a.budgets]
    longest = max(int(s["forests"]["kv"].traj_length.max()) for s in sets)
    largest = max(int(np.add.reduceat(f.seg_length, f.tree_offsets[:-1]).max())
                  for f in (s["forests"]["kv"] for s in sets))
    if a.microbatch_tokens is None:
        a.microbatch_tokens = 1024 * math.ceil(largest / 1024)
    if a.piece_study:
        if longest <= a.microbatch_tokens:
            raise CliError(f"--piece-study: the longest trace ({longest} tokens) fits the row budget "
                           f"--microbatch-tokens {a.microbatch_tokens}: no trace trains in pieces")
        if a.piece_study_above is None:
            a.piece_study_above = 4096 * math.ceil((longest + 1) / 4096)
        elif a.piece_study_above < longest:
            raise CliError(f"--piece-study-above {a.piece_study_above} is below the longest trace ({longest} tokens)")
    for s in sets:
        kv, rp = s["forests"]["kv"], s["forests"]["reprefill"]
        _progress(f"{s['name']}: {kv.num_trajectories} traces of {int(kv.traj_length.min())}-"
                  f"{int(kv.traj_length.max())} tokens, N = {s['N']}, {kv.num_rows} rows as a forest; "
                  f"{rp.num_trajectories} re-prefill samples, {s['reprefilled']} re-prefilled tokens")
    pieces = ": traces longer train in pieces" if longest > a.microbatch_tokens else ""
    _progress(f"--tree-microbatch-tokens {a.microbatch_tokens} (the largest tree of traces: {largest} rows, the "
              f"longest trace {longest} tokens{pieces})")
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if a.json else \
        (lambda text: print(text, flush=True))         # --json: stdout holds the JSON only
    common = driver_argv(a, sets)
    results["driver_argv"] = common
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    if a.profile:
        open(a.profile, "w").close()      # the modes' tables are appended as they run
    def save():
        with open(a.out, "w") as f:
            json.dump(results, f, indent=2, default=float)

    modes = [(f, s) for f, s in MODES if f in a.forms and (f == "reprefill" or s == "off" or s in a.tree_sharing)]
    failed = []
    for n_set, s in enumerate(sets):
        row = {"set": s["name"], "scheme": s["scheme"], "strategy": s["strategy"], "budget": s["budget"],
               "evict_chunk": s["evict_chunk"] if s["strategy"] == "sliding-window" or
               "sliding-window" in s.get("group_strategies", {}).values() else None,
               "trace_tokens": s["N"], "reprefilled_tokens": s["reprefilled"], "forms": form_stats(s),
               "longest_trace_tokens": int(s["forests"]["kv"].traj_length.max()),
               "microbatch_tokens": a.microbatch_tokens, "modes": {}}
        if "group_strategies" in s:
            row.update({k: s[k] for k in ("group_strategies", "groups", "forks", "forks_after_events")})
            row["strategies"] = {st: list(s["group_strategies"].values()).count(st)
                                 for st in dict.fromkeys(s["group_strategies"].values())}
            say(set_line(row))
        results["sets"][s["name"]] = row
        if a.piece_study:
            piece_study(a, s, common, row, say, save)
            continue
        if a.plan_only:
            row["plans"] = {}
            for form, sharing in modes:
                try:
                    planned = plan_mode(a, common + ["--tree-sharing", sharing], s["forests"][form])
                except PlanningError as e:
                    if sharing != "windows":
                        raise
                    planned = {"skipped": f"the driver refuses this data with --tree-sharing windows: {e}"}
                row["plans"][mode_key(form, sharing)] = planned
            say(plan_table(row))
            save()
            continue
        for form, sharing in modes:
            key = mode_key(form, sharing)
            release_memory(a.device)
            _progress(f"[{n_set + 1}/{len(sets)}] {s['name']} {key}: training "
                      f"({a.warmup} warm-up + {a.iters} timed steps)")
            t0 = time.perf_counter()
            try:
                with contextlib.redirect_stdout(sys.stderr):     # megatron's prints: stdout holds results only
                    m = measure(common + ["--tree-sharing", sharing], s["forests"][form], s["N"], a,
                                f"{s['name']} {key}")
            except PlanningError as e:
                if sharing != "windows":
                    raise
                row["modes"][key] = {"skipped": f"the driver refuses this data with --tree-sharing windows: {e}"}
                _progress(f"{s['name']} {key}: not run ({row['modes'][key]['skipped']})")
                continue
            except torch.OutOfMemoryError as e:      # the other modes still run; the row says why this one did not
                row["modes"][key] = {"form": form, "sharing": sharing,
                                     "skipped": f"out of GPU memory: {_first_line(e)} "
                                     f"(--driver-flags '--tree-piece-memory GIB' or '--tree-piece-keep none' keep "
                                     f"less)"}
                _progress(f"{s['name']} {key}: not run ({row['modes'][key]['skipped']})")
                save()
                continue
            row["modes"][key] = {"form": form, "sharing": sharing, **m}
            _progress(f"{s['name']} {key}: {m['step_seconds']:.3f} s/step, {m['rows_computed']} rows, "
                      f"{m['trajectory_tokens_per_s']:.0f} trace tok/s, peak {m['peak_memory_gib']} "
                      f"(allocator retries {m['alloc_retries']}), "
                      f"loss {m['loss_first_step']:.4f} ({time.perf_counter() - t0:.1f} s)")
            with open(a.out, "w") as f:       # after every mode: a cut-short run keeps what it measured
                json.dump(results, f, indent=2, default=float)
        row["derived"] = derived(row)
        rc = row["derived"]["rows_check"]
        say(f"{s['name']}: rows KV-streams expanded {rc['kv_expanded_rows']} (N = {rc['N']}), re-prefill "
            f"expanded {rc['reprefill_expanded_rows']} (N + re-prefilled = {rc['N']} + {rc['reprefilled_tokens']})"
            f"{' MISMATCH' if rc['ok'] is False else ' (not checked: a mode did not run)' if rc['ok'] is None else ''}")
        say(summary_line(row))
        say(mode_table(row))
        if rc["ok"] is False:
            failed.append(s["name"])
        with open(a.out, "w") as f:
            json.dump(results, f, indent=2, default=float)
    _progress(f"results in {a.out}")
    if a.json:
        print(json.dumps(results, indent=2, default=float))
    if failed:
        raise AssertionError(f"rows computed differ from N (KV-streams expanded) or N + re-prefilled tokens "
                             f"(re-prefill expanded) in {', '.join(failed)}: see {a.out}")
    return results


if __name__ == "__main__":
    run(main)
