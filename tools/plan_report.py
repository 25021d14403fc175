#!/usr/bin/env python3
"""Microbatch plans of a rollout set: HARTS L1, L1+L2 and the packing baselines side by side.

Reads trajectory files (JSONL/Parquet) or a converted dataset, plans one global batch on
--dp replicas with at most --microbatch-tokens computed rows per microbatch, and prints the
metrics of every planner (--l2 search: L1+L2 by the local search instead of the staged L2) (megatron_harts.planner.metrics.plan_metrics).  Planning times
include building the shared forest index.  OR-Tools (the ortools_ffd baseline) is optional:
without it that row says "unavailable".

--plot FILE.png draws the L1+L2 plan as a replicas x slots grid: one bar per microbatch (height =
modelled cost relative to the largest; colour = its role: producer of a sharing window, consumer,
both, or neither; hatched = idle slot); each sharing window is a line over its producer's replica
from the producer's slot to its last consumer's (while the exports stay alive), a dot on every
consumer of that replica and a dashed arrow to every consumer on another.  It needs matplotlib,
the optional extra "plot" (pip install -e ".[plot]"); without it --plot is refused before any
planning.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_harts.cli import (ArgumentParser, CliError, cost_model_from_flags, output_path, print_json,  # noqa: E402
                                 print_table, run)
from megatron_harts.planner.cost_model import ForestIndex  # noqa: E402
from megatron_harts.planner.l1 import plan_l1  # noqa: E402
from megatron_harts.planner.l2 import plan_l2  # noqa: E402
from megatron_harts.planner.metrics import plan_metrics  # noqa: E402
from megatron_harts.planner.microbatch import PlanningError  # noqa: E402
from megatron_harts.planner.packing_baselines import plan_ffd, plan_ortools_ffd, plan_tree_ffd  # noqa: E402
from megatron_harts.plotting import PlottingUnavailable, new_figure, require_matplotlib, save_figure  # noqa: E402
from megatron_harts.tree_data import load_forest  # noqa: E402

PLANNERS = ("harts_l1", "harts_l1l2", "ffd", "tree_ffd", "ortools_ffd")
KEYS = ("compression", "balance_mean", "balance_p5", "step_min_balance", "microbatches", "plan_seconds")

# microbatch roles (RGB): a producer exports rows to consumers of later slots
PRODUCER = (230, 126, 34)
CONSUMER = (52, 120, 198)
BOTH = (142, 68, 173)
PLAIN = (150, 150, 150)
WINDOW = (40, 40, 40)
ROLES = (("producer", PRODUCER), ("consumer", CONSUMER), ("producer and consumer", BOTH), ("neither", PLAIN))


def _rgb(color):
    return tuple(c / 255.0 for c in color)


def role(m) -> str:
    """A microbatch's role in its plan's sharing windows (one of ROLES' names)."""
    if m.consumers and m.external:
        return "producer and consumer"
    return "producer" if m.consumers else ("consumer" if m.external else "neither")


def plan_figure(plan, metrics: dict):
    """The plan as a replicas x slots grid (module docstring); ``metrics``: its ``plan_metrics``."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

    R, S = plan.num_replicas, max(plan.num_slots, 1)
    fig = new_figure(min(3.5 + 0.45 * S, 24.0) + 2.6, min(2.4 + 1.0 * R, 14.0))
    ax = fig.add_subplot()
    cmax = max((m.cost for m in plan.microbatches), default=0.0) or 1.0
    colors = dict(ROLES)
    # bars: the bottom of row r is y = r + 0.92, the top of the tallest r + 0.2, window lines above
    # (the y axis points down: replica 0 on top)
    for r in range(R):
        for k in range(plan.num_slots):
            m = plan.at(r, k)
            if m is None:
                ax.add_patch(Rectangle((k + 0.08, r + 0.08), 0.84, 0.84, facecolor="none", edgecolor="#bbbbbb",
                                       hatch="///", linewidth=0.6, linestyle="--"))
                continue
            h = 0.72 * m.cost / cmax
            ax.add_patch(Rectangle((k + 0.1, r + 0.92 - h), 0.8, h, facecolor=_rgb(colors[role(m)]),
                                   edgecolor="black", linewidth=0.5))
            if S <= 24 and h > 0.1:
                ax.text(k + 0.5, r + 0.94 - h, f"{m.rows}", ha="center", va="top", fontsize=7, color="white")
    # sharing windows: a line over the producer's row from its slot to its last consumer's (the
    # exports' lifetime), a dot on each consumer slot of that row, an arrow to a consumer elsewhere
    cross = False
    per_replica = [0] * R
    for w in plan.windows:
        p = plan.microbatches[w.producer]
        y = p.replica + 0.035 + 0.045 * min(per_replica[p.replica], 3)
        per_replica[p.replica] += 1
        ax.plot([w.producer_slot + 0.5, w.last_slot + 0.5], [y, y], color=_rgb(WINDOW), linewidth=1.4,
                marker="|", markersize=7, solid_capstyle="butt")
        here = [plan.microbatches[c] for c in w.consumers]
        same = [m.slot + 0.5 for m in here if m.replica == p.replica]
        ax.plot(same, [y] * len(same), linestyle="none", marker="o", markersize=3.5, color=_rgb(WINDOW))
        for m in here:
            if m.replica != p.replica:
                cross = True
                ax.add_patch(FancyArrowPatch((p.slot + 0.5, y), (m.slot + 0.5, m.replica + 0.5), arrowstyle="-|>",
                                             mutation_scale=9, linewidth=0.9, color=_rgb(WINDOW), alpha=0.8,
                                             linestyle="--", connectionstyle="arc3,rad=-0.2", shrinkA=0, shrinkB=2))
    ax.set_xlim(0, S)
    ax.set_ylim(R, 0)
    step = max(1, S // 30)
    ax.set_xticks([k + 0.5 for k in range(0, S, step)], [str(k) for k in range(0, S, step)])
    ax.set_yticks([r + 0.5 for r in range(R)], [f"replica {r}" for r in range(R)])
    ax.set_xticks(range(S + 1), minor=True)
    ax.set_yticks(range(R + 1), minor=True)
    ax.grid(which="minor", color="#dddddd", linewidth=0.6)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("slot (replicas run slot k side by side, slots in order)")
    ax.set_ylabel("data-parallel replica")
    ax.set_title(f"{plan.planner} plan: {R} replicas x {plan.num_slots} slots, {len(plan.microbatches)} microbatches, "
                 f"{len(plan.windows)} sharing windows\nrow budget {plan.row_budget}, compression "
                 f"{metrics['compression']:.2f}x, balance {100 * metrics['balance_mean']:.1f}%", fontsize=10)
    present = {role(m) for m in plan.microbatches}
    handles = [Patch(facecolor=_rgb(c), edgecolor="black", linewidth=0.5, label=name) for name, c in ROLES
               if name in present]
    if (plan.slots < 0).any():
        handles.append(Patch(facecolor="none", edgecolor="#bbbbbb", hatch="///", linestyle="--", label="idle slot"))
    if plan.windows:
        handles += [Line2D([], [], color=_rgb(WINDOW), linewidth=1.4, marker="|", markersize=7,
                           label="sharing window:\nproducer to last consumer"),
                    Line2D([], [], color=_rgb(WINDOW), linestyle="none", marker="o", markersize=3.5,
                           label="a consumer of it")]
    if cross:
        handles.append(Line2D([], [], color=_rgb(WINDOW), linestyle="--", linewidth=0.9,
                              label="consumer on another replica"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False,
              title="bar height: modelled cost" + ("\nnumber: rows computed" if S <= 24 else ""), title_fontsize=8)
    return fig


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    ap.add_argument("--plot", metavar="FILE.png",
                    help="draw the L1+L2 plan's replicas x slots grid, producers and sharing windows marked "
                         "(needs matplotlib: pip install -e \".[plot]\")")
    args = ap.parse_args(argv)
    if args.dp < 1:
        raise CliError(f"--dp must be >= 1, got {args.dp}")
    if args.microbatch_tokens < 1:
        raise CliError(f"--microbatch-tokens must be >= 1, got {args.microbatch_tokens}")
    if args.chunk_size is not None and args.chunk_size < 1:
        raise CliError(f"--chunk-size must be >= 1, got {args.chunk_size}")
    if not args.ortools_time_limit > 0:
        raise CliError(f"--ortools-time-limit must be > 0, got {args.ortools_time_limit}")
    if args.plot:
        if not args.plot.lower().endswith(".png"):
            raise CliError(f"--plot must name a .png file, got {args.plot!r}")
        output_path(args.plot, "--plot")
        try:
            require_matplotlib()
        except PlottingUnavailable as e:
            raise CliError(f"--plot {args.plot}: {e}") from None
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
        save_figure(plan_figure(plans["harts_l1l2"], results["harts_l1l2"]), args.plot)
    if args.json:
        print_json({name: results[name] for name in PLANNERS})
        if args.plot:      # stdout stays one JSON document
            print(f"wrote {args.plot}", file=sys.stderr)
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
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    run(main)
