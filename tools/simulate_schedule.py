#!/usr/bin/env python3
"""Pipeline schedules of sharing windows, simulated: non-overlap, overlap and consumer 1F1B.

Reads trajectory files (JSONL/Parquet) or a converted dataset, plans one global batch with
HARTS L1+L2 on --dp replicas (at most --microbatch-tokens computed rows per microbatch), takes
the step replica --replica runs (the windows megatron_harts.schedules.windows runs: one
producer per consumer, no nesting; other external context recomputed), and simulates it on
--stages pipeline stages under the three schedules of megatron_harts.schedules.simulator
(forward cost = the cost model's microbatch cost, backward = --backward-ratio x forward, layers
split evenly over the stages).  The table gives per schedule the makespan, the bubble fraction,
tokens per second (expanded tokens of the replica's step / makespan), the throughput relative
to non-overlap, and per stage (s0/s1/...) the peak number of windows alive, the peak retained
export bytes (--export-bytes-per-row x exported rows, a stage's share of the layers) and the
peak number of microbatches in flight.  --plot draws the three timelines as one PNG.
"""
import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_harts.cli import ArgumentParser, CliError, cost_model_from_flags, print_json, print_table, run  # noqa: E402
from megatron_harts.planner.cost_model import ForestIndex  # noqa: E402
from megatron_harts.planner.l2 import plan_harts  # noqa: E402
from megatron_harts.planner.microbatch import PlanningError  # noqa: E402
from megatron_harts.schedules.simulator import SCHEDULES, draw_timeline, simulate, step_from_plan, step_windows  # noqa: E402
from megatron_harts.tree_data import load_forest  # noqa: E402


def _human_bytes(n: float) -> str:
    """1536 -> '1.5K' (powers of 1024); under 1024: the integer."""
    if n < 1024:
        return f"{n:.0f}"
    for unit in ("K", "M", "G", "T"):
        n /= 1024.0
        if n < 1024 or unit == "T":
            return f"{n:.1f}{unit}"


def _positive(name: str, value: float, allow_zero: bool = False) -> float:
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise CliError(f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, got {value}")
    return value


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, metavar="FILE", help="trajectory file or dataset prefix")
    ap.add_argument("--microbatch-tokens", required=True, type=int, metavar="M",
                    help="row budget: computed rows per microbatch")
    ap.add_argument("--stages", required=True, type=int, metavar="S", help="pipeline stages")
    ap.add_argument("--dp", type=int, default=1, metavar="N", help="data-parallel replicas (default 1)")
    ap.add_argument("--replica", type=int, default=0, metavar="R", help="the replica whose step is simulated")
    ap.add_argument("--backward-ratio", type=float, default=2.0, metavar="X",
                    help="backward cost / forward cost (default 2)")
    ap.add_argument("--export-bytes-per-row", type=float, default=1.0, metavar="B",
                    help="bytes a producer retains per exported row over all layers (default 1: the export "
                         "columns count rows)")
    ap.add_argument("--p2p-latency", type=float, default=0.0, metavar="SECONDS",
                    help="time between stages for an activation or gradient (default 0)")
    ap.add_argument("--chunk-size", type=int, default=None, metavar="B",
                    help="KDA chunk size (default: the calibration's, else 64)")
    ap.add_argument("--calibration", metavar="FILE", help="cost-model calibration file (JSON)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--plot", metavar="FILE.png", help="draw the three timelines (one PNG)")
    args = ap.parse_args(argv)
    if args.dp < 1:
        raise CliError(f"--dp must be >= 1, got {args.dp}")
    if args.microbatch_tokens < 1:
        raise CliError(f"--microbatch-tokens must be >= 1, got {args.microbatch_tokens}")
    if args.stages < 1:
        raise CliError(f"--stages must be >= 1, got {args.stages}")
    if not 0 <= args.replica < args.dp:
        raise CliError(f"--replica must be in [0, {args.dp}) (--dp {args.dp}), got {args.replica}")
    if args.chunk_size is not None and args.chunk_size < 1:
        raise CliError(f"--chunk-size must be >= 1, got {args.chunk_size}")
    _positive("--backward-ratio", args.backward_ratio)
    _positive("--export-bytes-per-row", args.export_bytes_per_row, allow_zero=True)
    _positive("--p2p-latency", args.p2p_latency, allow_zero=True)
    if args.plot and not args.plot.lower().endswith(".png"):
        raise CliError(f"--plot must name a .png file, got {args.plot!r}")
    if args.plot and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
        raise CliError(f"--plot: directory {os.path.dirname(os.path.abspath(args.plot))} does not exist")
    model = cost_model_from_flags(args.calibration, args.chunk_size)
    forest = load_forest(args.input)
    ix = ForestIndex(forest)
    try:
        _, plan = plan_harts(forest, args.dp, args.microbatch_tokens, cost_model=model, index=ix)
    except PlanningError as e:
        raise CliError(f"{args.input}: {e}") from None
    step = step_from_plan(plan, args.replica, forest=forest, index=ix, backward_ratio=args.backward_ratio,
                          export_bytes_per_row=args.export_bytes_per_row)
    if not step:
        raise CliError(f"replica {args.replica} runs no microbatch ({len(plan.microbatches)} microbatches on "
                       f"--dp {args.dp} replicas): use a smaller --dp")
    windows = step_windows(step)
    results = {name: simulate(step, args.stages, name, p2p_latency=args.p2p_latency) for name in SCHEDULES}
    base = results["non-overlap"].tokens_per_second
    summary = {
        "input": args.input, "dp": args.dp, "stages": args.stages, "replica": args.replica,
        "microbatches": len(step), "windows": len(windows), "consumers": sum(len(c) for c in windows.values()),
        "tokens": results["non-overlap"].tokens, "backward_ratio": args.backward_ratio,
        "export_bytes_per_row": args.export_bytes_per_row, "p2p_latency": args.p2p_latency,
        "schedules": {},
    }
    for name, r in results.items():
        summary["schedules"][name] = {
            "makespan": r.makespan, "bubble_fraction": r.bubble_fraction,
            "tokens_per_second": r.tokens_per_second,
            "relative_throughput": r.tokens_per_second / base if base > 0 else 0.0,
            "peak_windows_alive": r.peak_windows_alive, "peak_export_bytes": r.peak_export_bytes,
            "peak_in_flight": r.peak_in_flight,
        }
    if args.plot:
        draw_timeline(results, args.plot)
    if args.json:
        print_json(summary)
        return 0
    rows = []
    for name in SCHEDULES:
        r = summary["schedules"][name]
        rows.append((name, f"{r['makespan']:.3f}", f"{100 * r['bubble_fraction']:.1f}%",
                     f"{r['tokens_per_second']:,.0f}", f"{r['relative_throughput']:.3f}x",
                     "/".join(str(w) for w in r["peak_windows_alive"]),
                     "/".join(_human_bytes(b) for b in r["peak_export_bytes"]),
                     "/".join(str(f) for f in r["peak_in_flight"])))
    print_table(rows, header=("schedule", "makespan_s", "bubble", "tokens/s", "relative", "windows_alive",
                              "export_bytes", "in_flight"))
    print(f"replica {args.replica} of {args.dp}: {summary['microbatches']} microbatches, {summary['windows']} "
          f"windows ({summary['consumers']} consumers), {summary['tokens']:,} tokens, {args.stages} stages")
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    run(main)
