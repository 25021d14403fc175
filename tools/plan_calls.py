#!/usr/bin/env python3
"""KDA call plans of a rollout set: calls and replay tokens of the HARTS plan vs per-depth and node-wise.

Reads trajectory files (JSONL/Parquet) or a converted dataset.  Per tree and in
total, where all trees are planned together as one microbatch (independent
trees share calls, so the total is the largest per-tree count).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_harts.cli import ArgumentParser, CliError, print_json, print_table, run  # noqa: E402
from megatron_harts.planner.baselines import node_wise, per_depth_bucketing  # noqa: E402
from megatron_harts.planner.calls import plan_calls  # noqa: E402
from megatron_harts.tree_data import load_forest  # noqa: E402


def tree_figures(tree, chunk_size: int) -> dict:
    args = (tree.seg_parent, tree.seg_start, tree.seg_length)
    plan = plan_calls(*args, chunk_size)
    return {
        "segments": tree.num_segments,
        "depth": int(tree.seg_depth.max()),
        "calls": plan.num_calls,
        "replay_tokens": plan.replay_tokens,
        "per_depth_calls": per_depth_bucketing(*args, chunk_size)["calls"],
        "node_wise_calls": node_wise(*args, chunk_size)["calls"],
    }


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, metavar="FILE", help="trajectory file or dataset prefix")
    ap.add_argument("--chunk-size", type=int, default=64, metavar="B", help="KDA chunk size (default 64)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(argv)
    if args.chunk_size < 1:
        raise CliError(f"--chunk-size must be >= 1, got {args.chunk_size}")
    forest = load_forest(args.input)
    per_tree = [tree_figures(forest.tree(i), args.chunk_size) for i in range(forest.num_trees)]
    whole = plan_calls(forest.seg_parent, forest.seg_start, forest.seg_length, args.chunk_size)
    total = {
        "calls": whole.num_calls,
        "replay_tokens": whole.replay_tokens,
        "per_depth_calls": max(t["per_depth_calls"] for t in per_tree),
        "node_wise_calls": max(t["node_wise_calls"] for t in per_tree),
        "segments": forest.num_segments,
        "chunk_size": args.chunk_size,
        "per_tree": per_tree,
    }
    if args.json:
        print_json(total)
        return 0
    cols = ("segments", "depth", "calls", "replay_tokens", "per_depth_calls", "node_wise_calls")
    rows = [(i, *(t[c] for c in cols)) for i, t in enumerate(per_tree)]
    rows.append(("all", total["segments"], max(t["depth"] for t in per_tree), total["calls"],
                 total["replay_tokens"], total["per_depth_calls"], total["node_wise_calls"]))
    print_table(rows, header=("tree", "segments", "depth", "calls", "replay", "per-depth", "node-wise"))
    return 0


if __name__ == "__main__":
    run(main)
