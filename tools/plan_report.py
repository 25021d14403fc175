#!/usr/bin/env python3
"""Microbatch plans of a rollout set: HARTS L1, L1+L2 and the packing baselines side by side.

Reads trajectory files (JSONL/Parquet) or a converted dataset, plans one global batch on
--dp replicas with at most --microbatch-tokens computed rows per microbatch, and prints the
metrics of every planner (megatron_harts.planner.metrics.plan_metrics).  Planning times
include building the shared forest index.  OR-Tools (the ortools_ffd baseline) is optional:
without it that row says "unavailable".  --plot draws the L1+L2 plan: one strip per replica,
one bar per slot (height = modelled cost; orange = producer, blue = consumer, grey = neither).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from megatron_harts.cli import CliError, cost_model_from_flags, print_json, print_table, run  # noqa: E402
from megatron_harts.planner.cost_model import ForestIndex  # noqa: E402
from megatron_harts.planner.l1 import plan_l1  # noqa: E402
from megatron_harts.planner.l2 import plan_l2  # noqa: E402
from megatron_harts.planner.metrics import plan_metrics  # noqa: E402
from megatron_harts.planner.microbatch import PlanningError  # noqa: E402
from megatron_harts.planner.packing_baselines import plan_ffd, plan_ortools_ffd, plan_tree_ffd  # noqa: E402
from megatron_harts.plotting import blank, fill_rect, write_png  # noqa: E402
from megatron_harts.tree_data import load_forest  # noqa: E402

PLANNERS = ("harts_l1", "harts_l1l2", "ffd", "tree_ffd", "ortools_ffd")
KEYS = ("compression", "balance_mean", "balance_p5", "step_min_balance", "microbatches", "plan_seconds")

PRODUCER = (230, 126, 34)
CONSUMER = (52, 120, 198)
PLAIN = (150, 150, 150)


def draw_plan(plan, strip: int = 60, gap: int = 6) -> np.ndarray:
    """Slots per replica as bars: one strip per replica, bar height proportional to cost."""
    R, S = plan.num_replicas, max(plan.num_slots, 1)
    bw = max(2, min(24, 1200 // S))
    margin = 8
    W = 2 * margin + S * bw
    H = 2 * margin + R * strip + (R - 1) * gap
    img = blank(H, W)
    cmax = max((m.cost for m in plan.microbatches), default=0.0) or 1.0
    for r in range(R):
        base = margin + r * (strip + gap) + strip  # bottom line of the strip
        fill_rect(img, margin, base, W - margin, base + 1, (0, 0, 0))
        for k in range(plan.num_slots):
            m = plan.at(r, k)
            if m is None:
                continue
            hgt = max(1, int(round((strip - 2) * m.cost / cmax)))
            color = PRODUCER if m.consumers else (CONSUMER if m.external else PLAIN)
            x0 = margin + k * bw
            x1 = x0 + max(1, bw - 1)
            fill_rect(img, x0, base - hgt, x1, base, color)
    return img


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, metavar="FILE", help="trajectory file or dataset prefix")
    ap.add_argument("--dp", required=True, type=int, metavar="N", help="data-parallel replicas")
    ap.add_argument("--microbatch-tokens", required=True, type=int, metavar="M",
                    help="row budget: computed rows per microbatch")
    ap.add_argument("--chunk-size", type=int, default=None, metavar="B",
                    help="KDA chunk size (default: the calibration's, else 64)")
    ap.add_argument("--calibration", metavar="FILE", help="cost-model calibration file (JSON)")
    ap.add_argument("--ortools-time-limit", type=float, default=10.0, metavar="S",
                    help="CP-SAT search limit of the ortools_ffd baseline (default 10 s)")
    ap.add_argument("--json", action="store_true", help="print the metrics as JSON, one object per planner")
    ap.add_argument("--plot", metavar="FILE.png", help="draw the L1+L2 plan's slots per replica")
    args = ap.parse_args(argv)
    if args.dp < 1:
        raise CliError(f"--dp must be >= 1, got {args.dp}")
    if args.microbatch_tokens < 1:
        raise CliError(f"--microbatch-tokens must be >= 1, got {args.microbatch_tokens}")
    if args.chunk_size is not None and args.chunk_size < 1:
        raise CliError(f"--chunk-size must be >= 1, got {args.chunk_size}")
    if not args.ortools_time_limit > 0:
        raise CliError(f"--ortools-time-limit must be > 0, got {args.ortools_time_limit}")
    if args.plot and not args.plot.lower().endswith(".png"):
        raise CliError(f"--plot must name a .png file, got {args.plot!r}")
    model = cost_model_from_flags(args.calibration, args.chunk_size)
    forest = load_forest(args.input)
    t0 = time.perf_counter()
    ix = ForestIndex(forest)
    index_seconds = time.perf_counter() - t0
    common = dict(cost_model=model, index=ix)
    results, plans = {}, {}
    try:
        l1 = plan_l1(forest, args.dp, args.microbatch_tokens, **common)
        l2 = plan_l2(forest, l1, **common)
        l2.plan_seconds += l1.plan_seconds
        plans["harts_l1"], plans["harts_l1l2"] = l1, l2
        plans["ffd"] = plan_ffd(forest, args.dp, args.microbatch_tokens, **common)
        plans["tree_ffd"] = plan_tree_ffd(forest, args.dp, args.microbatch_tokens, **common)
        try:
            plans["ortools_ffd"] = plan_ortools_ffd(forest, args.dp, args.microbatch_tokens,
                                                    time_limit_s=args.ortools_time_limit, **common)
        except ImportError:
            results["ortools_ffd"] = {"available": False,
                                      "reason": "OR-Tools is not installed (pip install ortools)"}
    except PlanningError as e:
        raise CliError(f"{args.input}: {e}") from None
    for name, plan in plans.items():
        m = plan_metrics(plan)
        m["plan_seconds"] += index_seconds
        results[name] = {"available": True, **m}
    if args.plot:
        write_png(args.plot, draw_plan(plans["harts_l1l2"]))
    if args.json:
        print_json({name: results[name] for name in PLANNERS})
        return 0
    rows = []
    for name in PLANNERS:
        r = results[name]
        if not r["available"]:
            rows.append((name, "unavailable", "", "", "", "", "", "", ""))
            continue
        rows.append((name, f"{r['compression']:.3f}x", f"{100 * r['balance_mean']:.2f}%",
                     f"{100 * r['balance_p5']:.2f}%", f"{100 * r['step_min_balance']:.2f}%",
                     r["microbatches"], r["peak_rows"], r["max_retention"], f"{r['plan_seconds']:.3f}"))
    print_table(rows, header=("planner", "compression", "balance", "balance_p5", "step_min", "microbatches",
                              "peak_rows", "retention", "plan_s"))
    return 0


if __name__ == "__main__":
    run(main)
