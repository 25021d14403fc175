#!/usr/bin/env python3
"""Convert trajectory files (JSONL/Parquet, one trajectory per row) into a rollout-tree dataset.

Writes PREFIX.bin and PREFIX.idx atomically; on bad input prints one error line
naming file, line, trajectory and field, exits 2 and writes nothing.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_harts.cli import CliError, Progress, print_json, run  # noqa: E402
from megatron_harts.tree_data import build_forest, read_trajectories, write_dataset  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, nargs="+", metavar="FILE", help="trajectory files")
    ap.add_argument("--output", required=True, metavar="PREFIX", help="dataset prefix (PREFIX.bin, PREFIX.idx)")
    ap.add_argument("--vocab-size", type=int, default=None, metavar="N", help="reject token ids >= N")
    ap.add_argument("--workers", type=int, default=1, metavar="N", help="parallel JSONL parsing processes")
    ap.add_argument("--json", action="store_true", help="print the dataset's stats as JSON")
    args = ap.parse_args(argv)
    if args.workers < 1:
        raise CliError(f"--workers must be >= 1, got {args.workers}")
    if args.vocab_size is not None and args.vocab_size < 1:
        raise CliError(f"--vocab-size must be >= 1, got {args.vocab_size}")
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        raise CliError(f"--output: directory {out_dir} does not exist")
    t0 = time.perf_counter()
    progress = Progress("reading", unit="lines")
    trajs = read_trajectories(args.input, vocab_size=args.vocab_size, workers=args.workers, progress=progress)
    progress.close()
    forest = build_forest(trajs)
    write_dataset(forest, args.output)
    stats = forest.stats()
    if args.json:
        print_json(stats)
    else:
        print(f"wrote {args.output}.bin/.idx: {stats['num_trajectories']} trajectories, {stats['num_trees']} trees, "
              f"{stats['expanded_tokens']:,} expanded -> {stats['unique_tokens']:,} unique tokens "
              f"({stats['compression']:.2f}x) in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    run(main)
