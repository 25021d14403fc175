#!/usr/bin/env python3
"""Walk through a rollout set with the Python API: build the forest, look at one tree, expand a trajectory.

    python examples/inspect_rollouts.py rollouts.jsonl.gz        # or a dataset prefix

A missing or malformed input is one ``error:`` line and exit status 2.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_harts.cli import ArgumentParser, CliError, run  # noqa: E402
from megatron_harts.tree_data import load_forest  # noqa: E402


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("input", metavar="INPUT", help="trajectory file (.jsonl, .jsonl.gz, .parquet) or dataset prefix")
    args = ap.parse_args(argv)
    forest = load_forest(args.input)
    if forest.num_trees == 0:
        raise CliError(f"{args.input}: holds no trajectories")
    stats = forest.stats()
    print(f"{stats['num_trajectories']} trajectories in {stats['num_trees']} trees: "
          f"{stats['expanded_tokens']:,} tokens, {stats['unique_tokens']:,} unique ({stats['compression']:.2f}x)")
    tree = forest.tree(0)
    print(f"tree 0: {tree.num_segments} segments, {tree.num_rows:,} rows, {tree.num_trajectories} trajectories")
    for s in range(min(tree.num_segments, 8)):
        kids = tree.children(s).tolist()
        print(f"  segment {s}: positions [{tree.seg_start[s]}, {tree.seg_start[s] + tree.seg_length[s]}), "
              f"parent {tree.seg_parent[s]}, children {kids}, shared by {len(tree.segment_trajectories(s))}")
    traj = tree.expand(tree.traj_ids[0])
    print(f"trajectory {traj.id!r}: {len(traj)} tokens, {int(traj.loss_mask.sum())} trained, "
          f"advantage {traj.advantage}")
    return 0


if __name__ == "__main__":
    run(main)
