#!/usr/bin/env python3
"""Sharing statistics of a rollout set: trajectory files (JSONL/Parquet) or a converted dataset.

The statistics include compaction events (all trajectories' and each shared event once) and
the (query, key) pairs full attention computes with the events applied, over the trees and
over every trajectory on its own.  --reprefill puts beside them the statistics of the
re-prefill form of the same set (each compacted trajectory split into the samples ID/r0,
ID/r1, ... that re-emit the visible tokens at each event; see convert_trajectories.py) and
the tokens it re-prefills.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_harts.cli import ArgumentParser, print_json, print_table, run  # noqa: E402
from megatron_harts.tree_data import TreeDataset, build_forest, is_dataset, read_trajectories  # noqa: E402
from megatron_harts.tree_data.reprefill import reprefill, reprefill_tokens  # noqa: E402


def _cell(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else f"{v:,}"


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, nargs="+", metavar="FILE",
                    help="trajectory files (.jsonl, .jsonl.gz, .parquet) or one dataset prefix")
    ap.add_argument("--vocab-size", type=int, default=None, help="reject token ids >= N")
    ap.add_argument("--reprefill", action="store_true",
                    help="also the stats of the re-prefill form, and the tokens it re-prefills")
    ap.add_argument("--json", action="store_true",
                    help="print the stats dict as JSON; with --reprefill one object "
                         '{"keep": stats, "reprefill": stats, "reprefilled_tokens": N}')
    args = ap.parse_args(argv)
    trajs = None
    if len(args.input) == 1 and is_dataset(args.input[0]):
        ds = TreeDataset(args.input[0])
        stats = ds.stats()
        if args.reprefill:
            forest = ds.forest()
            trajs = [forest.expand(tid) for tid in forest.traj_ids]
    else:
        trajs = read_trajectories(args.input, vocab_size=args.vocab_size)
        stats = build_forest(trajs).stats()
    if args.reprefill:
        result = {"keep": stats, "reprefill": build_forest(reprefill(trajs)).stats(),
                  "reprefilled_tokens": reprefill_tokens(trajs)}
        if args.json:
            print_json(result)
        else:
            rows = [(k, _cell(v), _cell(result["reprefill"][k])) for k, v in stats.items()]
            rows.append(("reprefilled_tokens", _cell(0), _cell(result["reprefilled_tokens"])))
            print_table(rows, header=("statistic", "keep", "reprefill"))
    elif args.json:
        print_json(stats)
    else:
        print_table([(k, _cell(v)) for k, v in stats.items()], header=("statistic", "value"))
    return 0


if __name__ == "__main__":
    run(main)
