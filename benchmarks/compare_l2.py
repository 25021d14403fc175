"""Plan quality of L2 on the planner benchmark's batches and on random forests, as JSON.

For every instance (scheme, size or seed, DP, windows on/off) it records L1's and L2's modelled step,
compression, mean slot balance and L2's planning time (the faster of two runs), so that two versions
of the planner can be compared (``--compare OLD.json NEW.json`` prints the table).  "Windows off"
plans with ``min_producer_rows`` above the row budget: no tree gets a producer.
``benchmarks/results/l2-staged-reference.json`` holds the rows of the staged planner L2 used to be (nine
passes, measured side by side with the search on one 2-core machine), the reference the search is held to:

    python benchmarks/compare_l2.py --json out/l2.json
    python benchmarks/compare_l2.py --compare benchmarks/results/l2-staged-reference.json out/l2.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_harts.planner.cost_model import CostModel, ForestIndex  # noqa: E402
from megatron_harts.planner.l1 import plan_l1  # noqa: E402
from megatron_harts.planner.l2 import plan_l2  # noqa: E402
from megatron_harts.planner.metrics import plan_metrics  # noqa: E402
from megatron_harts.tree_data import build_forest  # noqa: E402
from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe  # noqa: E402

from bench_planner import swe_batch  # noqa: E402


def instances(quick: bool):
    """(name, forest, row budget) of the benchmark's batches and the random forests."""
    sizes = (256, 512) if quick else (256, 512, 1024, 2048)
    for scheme in ("tree-step", "step-wise"):
        for n in sizes:
            yield f"bench/{scheme}/{n}", swe_batch(scheme, n, 0), 32768
    for seed in range(6 if quick else 12):
        scheme = ("tree-step", "step-wise")[seed % 2]
        cfg = SweConfig(scheme=scheme, num_tasks=2 + seed % 5, samples_per_task=2 + seed % 4, seed=100 + seed,
                        prompt_median=1000 + 300 * (seed % 4), max_tokens=8192)
        forest = build_forest(synthesize_swe(cfg))
        yield f"random/{scheme}/seed{seed}", forest, (8192, 12288, 16384)[seed % 3]


def measure(quick: bool) -> list:
    """A row per instance."""
    model = CostModel()
    rows = []
    for name, forest, M in instances(quick):
        ix = ForestIndex(forest)
        for dp in (1, 2, 4, 8):
            l1 = plan_l1(forest, dp, M, cost_model=model, index=ix)
            for windows in (True, False):
                mpr = None if windows else M + 1
                best = None
                for _ in range(2):
                    got = plan_l2(forest, l1, cost_model=model, index=ix, min_producer_rows=mpr)
                    if best is None or got.plan_seconds < best.plan_seconds:
                        best = got
                best.validate(forest)
                a, b = plan_metrics(l1), plan_metrics(best)
                row = {"instance": name, "dp": dp, "windows": windows, "row_budget": M, "planner": "search",
                       "l1_step": a["step_cost"], "l1_compression": a["compression"],
                       "step": b["step_cost"], "compression": b["compression"], "balance": b["balance_mean"],
                       "tokens": best.tokens_computed, "l1_tokens": l1.tokens_computed,
                       "microbatches": b["microbatches"], "windows_made": b["windows"],
                       "plan_seconds": best.plan_seconds}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def compare(old_path: str, new_path: str) -> None:
    old = {(r["instance"], r["dp"], r["windows"]): r for r in json.load(open(old_path))}
    new = {(r["instance"], r["dp"], r["windows"]): r for r in json.load(open(new_path))}
    keys = [k for k in old if k in new]
    ratios, worse, t_old, t_new = [], [], 0.0, 0.0
    print("| instance | DP | windows | step before | step after | after/before | compression before / after "
          "| plan ms before / after |")
    print("|---|---|---|---|---|---|---|---|")
    for k in keys:
        a, b = old[k], new[k]
        r = b["step"] / a["step"]
        ratios.append(r)
        if r > 1.0 + 1e-9:
            worse.append(k)
        t_old += a["plan_seconds"]
        t_new += b["plan_seconds"]
        print(f"| {k[0]} | {k[1]} | {'on' if k[2] else 'off'} | {a['step']:.4f} | {b['step']:.4f} | {r:.4f} | "
              f"{a['compression']:.3f} / {b['compression']:.3f} | {1e3 * a['plan_seconds']:.1f} / "
              f"{1e3 * b['plan_seconds']:.1f} |")
    n = len(ratios)
    print(f"\ninstances {n}; no worse: {n - len(worse)} ({100 * (n - len(worse)) / max(n, 1):.1f}%); mean step "
          f"after/before {sum(ratios) / max(n, 1):.5f}; worst {max(ratios, default=1):.4f}; planning total "
          f"{t_old:.2f} s before, {t_new:.2f} s after")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write every row to this file")
    p.add_argument("--quick", action="store_true", help="fewer, smaller instances")
    p.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="compare two files this tool wrote")
    a = p.parse_args()
    if a.compare:
        compare(*a.compare)
        return
    rows = measure(a.quick)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
