#!/usr/bin/env python3
"""Sharing statistics of a rollout set: trajectory files (JSONL/Parquet) or a converted dataset."""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_harts.cli import print_json, print_table, run  # noqa: E402
from megatron_harts.tree_data import TreeDataset, build_forest, is_dataset, read_trajectories  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--input", required=True, nargs="+", metavar="FILE",
                    help="trajectory files (.jsonl, .jsonl.gz, .parquet) or one dataset prefix")
    ap.add_argument("--vocab-size", type=int, default=None, help="reject token ids >= N")
    ap.add_argument("--json", action="store_true", help="print the stats dict as JSON")
    args = ap.parse_args(argv)
    if len(args.input) == 1 and is_dataset(args.input[0]):
        stats = TreeDataset(args.input[0]).stats()
    else:
        stats = build_forest(read_trajectories(args.input, vocab_size=args.vocab_size)).stats()
    if args.json:
        print_json(stats)
    else:
        rows = [(k, f"{v:.3f}" if isinstance(v, float) else f"{v:,}") for k, v in stats.items()]
        print_table(rows, header=("statistic", "value"))
    return 0


if __name__ == "__main__":
    run(main)
