#!/usr/bin/env python3
"""Pipeline schedules of sharing windows, simulated side by side on SWE-like plans.

For each rollout scheme (synthetic Tree-Step and Step-wise global batches) and each pipeline depth,
one HARTS L1+L2 plan per batch (replica 0's step, the windows ``schedules/windows.py`` runs) is
simulated under the three schedules of ``megatron_harts.schedules.simulator`` (non-overlap,
overlap backward-first, consumer 1F1B): tokens per second, bubble fraction, peak windows alive
and peak retained export bytes per stage.  Reported against the targets: consumer 1F1B >= 1.2x
non-overlap and above overlap, with peak retained memory no higher than overlap's.
The real multi-GPU run belongs to the multi-GPU validation issue.

Consumer 1F1B chooses its order with the step's costs (simulator module docstring); its peak
microbatches in flight per stage are in the JSON beside overlap's.  ``bound``: the makespan no
order can beat (``makespan_lower_bound``); the table's ``ovl/bound`` and ``1f1b/bound`` are the
makespans over it (how much any order could still gain), ``best/non`` the most any order could
reach over non-overlap.

    .venv/bin/python benchmarks/bench_pp_schedule.py                 # table
    .venv/bin/python benchmarks/bench_pp_schedule.py --json --plot-dir out/pp   # + one PNG per case
    .venv/bin/python benchmarks/bench_pp_schedule.py --plot-dir out/pp --out out/pp/results.json
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_harts.cli import ArgumentParser, run  # noqa: E402
from megatron_harts.planner.cost_model import ForestIndex  # noqa: E402
from megatron_harts.planner.l2 import plan_harts  # noqa: E402
from megatron_harts.schedules.simulator import (SCHEDULES, draw_timeline, makespan_lower_bound, simulate,  # noqa: E402
                                                step_from_plan)
from megatron_harts.tree_data import build_forest  # noqa: E402
from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe  # noqa: E402


def main(argv=None):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", nargs="+", default=["tree-step", "step-wise"], choices=["tree-step", "step-wise"])
    ap.add_argument("--num-tasks", type=int, default=8, help="tasks (trees) per batch (default 8)")
    ap.add_argument("--stages", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--microbatch-tokens", type=int, default=32768)
    ap.add_argument("--export-bytes-per-row", type=float, default=8192.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot-dir", default=None, help="write one timeline PNG per scheme and depth here")
    ap.add_argument("--json", action="store_true", help="print the results as JSON after the table")
    ap.add_argument("--out", default=None, help="write the results as JSON to this file")
    a = ap.parse_args(argv)
    out = {"args": vars(a), "cases": []}
    if a.plot_dir:
        os.makedirs(a.plot_dir, exist_ok=True)
    print(f"{'scheme':10s} {'S':>2s} {'mbs':>4s} {'win':>4s} | " + " | ".join(
        f"{n:>13s} tok/s bubble" for n in SCHEDULES) + " | 1f1b/non  1f1b/ovl  mem 1f1b/ovl | ovl/bound 1f1b/bound"
        " best/non")
    for scheme in a.schemes:
        forest = build_forest(synthesize_swe(SweConfig(scheme=scheme, num_tasks=a.num_tasks, seed=a.seed)))
        ix = ForestIndex(forest)
        plan = plan_harts(forest, 1, a.microbatch_tokens, index=ix)[1]
        step = step_from_plan(plan, 0, forest=forest, index=ix, export_bytes_per_row=a.export_bytes_per_row)
        windows = len({m.producer for m in step if m.producer is not None})
        for S in a.stages:
            res = {name: simulate(step, S, name) for name in SCHEDULES}
            tps = {n: r.tokens_per_second for n, r in res.items()}
            mem = {n: max(r.peak_export_bytes) for n, r in res.items()}
            bound = makespan_lower_bound(step, S)
            case = {"scheme": scheme, "stages": S, "microbatches": len(step), "windows": windows,
                    "trajectories": forest.num_trajectories,
                    "schedules": {n: {"tokens_per_second": r.tokens_per_second, "bubble_fraction": r.bubble_fraction,
                                      "makespan": r.makespan, "peak_export_bytes": r.peak_export_bytes,
                                      "peak_windows_alive": r.peak_windows_alive,
                                      "peak_in_flight": r.peak_in_flight} for n, r in res.items()},
                    "consumer_1f1b_over_non_overlap": tps["consumer-1f1b"] / tps["non-overlap"],
                    "consumer_1f1b_over_overlap": tps["consumer-1f1b"] / tps["overlap"],
                    "peak_memory_1f1b_over_overlap": mem["consumer-1f1b"] / mem["overlap"] if mem["overlap"] else None,
                    "makespan_lower_bound": bound,
                    "makespan_over_bound": {n: r.makespan / bound for n, r in res.items()},
                    "best_possible_over_non_overlap": res["non-overlap"].makespan / bound}
            out["cases"].append(case)
            if a.plot_dir:
                draw_timeline(res, os.path.join(a.plot_dir, f"pp_{scheme}_s{S}.png"))
            print(f"{scheme:10s} {S:2d} {len(step):4d} {windows:4d} | " + " | ".join(
                f"{tps[n]:13,.0f} {100 * res[n].bubble_fraction:5.1f}%" for n in SCHEDULES)
                + f" | {case['consumer_1f1b_over_non_overlap']:7.4f}x {case['consumer_1f1b_over_overlap']:7.4f}x"
                f" {case['peak_memory_1f1b_over_overlap'] or 0:9.2f}"
                f" | {res['overlap'].makespan / bound:9.4f} {res['consumer-1f1b'].makespan / bound:10.4f}"
                f" {case['best_possible_over_non_overlap']:7.4f}x", flush=True)
    met = [c["consumer_1f1b_over_non_overlap"] >= 1.2 and c["consumer_1f1b_over_overlap"] > 1.0
           and (c["peak_memory_1f1b_over_overlap"] or 0.0) <= 1.0 for c in out["cases"]]
    out["targets_met"] = met
    print(f"targets (>= 1.2x non-overlap, > overlap, memory <= overlap) met in {sum(met)} of {len(met)} cases")
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2)
    if a.json:
        print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    run(main)
