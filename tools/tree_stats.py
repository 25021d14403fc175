#!/usr/bin/env python3
"""Sharing statistics of a rollout set: trajectory files (JSONL/Parquet) or a converted dataset.

The statistics include compaction events (all trajectories' and each shared event once) and
the (query, key) pairs full attention computes with the events applied, over the trees and
over every trajectory on its own.  --reprefill puts beside them the statistics of the
re-prefill form of the same set (each compacted trajectory split into the samples ID/r0,
ID/r1, ... that re-emit the visible tokens at each event; see convert_trajectories.py) and
the tokens it re-prefills.

--tokenizer DIR (a transformers tokenizer directory with a chat template) also reads rollouts
as chat messages (docs/messages.md).  --drift (needs --tokenizer) adds the tokenization drift
of the set: trajectories of a group whose decoded text shares a longer prefix than their token
ids, the tokens of sharing that costs, what --repair-drift of convert_trajectories.py would
recover, and the worst examples with the text around where the ids fork; and, per input in
messages form or of engine token records, the model calls, the trajectories re-render branching
makes in the exact form, the re-rendered tokens they compute again, and the unique tokens and
compression of the exact form beside the single-trajectory form.  Messages are read in the
exact form unless --single-trajectory-context-differs-from-rollout is given (docs/messages.md).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_harts.cli import ArgumentParser, CliError, print_json, print_table, run  # noqa: E402
from megatron_harts.tree_data import TreeDataset, build_forest, is_dataset  # noqa: E402
from megatron_harts.tree_data.drift import analyze_drift  # noqa: E402
from megatron_harts.tree_data.messages import (EXACT, SINGLE, compare_forms, compare_lines,  # noqa: E402
                                               load_chat_tokenizer, read_rollouts)
from megatron_harts.tree_data.reprefill import reprefill, reprefill_tokens  # noqa: E402


def _cell(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else f"{v:,}"


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, nargs="+", metavar="FILE",
                    help="trajectory files (.jsonl, .jsonl.gz, .parquet), engine token record files, chat-message "
                         "files (with --tokenizer), or one dataset prefix")
    ap.add_argument("--vocab-size", type=int, default=None, help="reject token ids >= N")
    ap.add_argument("--reprefill", action="store_true",
                    help="also the stats of the re-prefill form, and the tokens it re-prefills")
    ap.add_argument("--tokenizer", metavar="DIR", default=None,
                    help="a transformers tokenizer directory with a chat template: inputs may hold chat messages "
                         "(docs/messages.md), and --drift decodes token ids with it")
    ap.add_argument("--drift", action="store_true",
                    help="also the tokenization drift of the set (needs --tokenizer; see above)")
    ap.add_argument("--single-trajectory-context-differs-from-rollout", dest="single", action="store_true",
                    help="with --tokenizer: read chat messages as one trajectory per conversation; where the chat "
                         "template re-renders history, later turns are trained on a context that differs from the "
                         "one the model saw in the rollout (off-policy)")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="run the code a tokenizer directory ships (tiktoken-based tokenizers such as "
                         "Kimi-Linear's); without it such a tokenizer is refused")
    ap.add_argument("--json", action="store_true",
                    help="print the stats dict as JSON; with --reprefill one object "
                         '{"keep": stats, "reprefill": stats, "reprefilled_tokens": N}; with --drift plus "drift" and '
                         '"messages" (per input in messages form or of engine records: calls, branching, both forms)')
    args = ap.parse_args(argv)
    if args.drift and args.tokenizer is None:
        raise CliError("--drift needs --tokenizer DIR to decode the token ids")
    if args.single and args.tokenizer is None:
        raise CliError("--single-trajectory-context-differs-from-rollout needs --tokenizer DIR (it applies to "
                       "chat messages)")
    tokenizer = load_chat_tokenizer(args.tokenizer, args.trust_remote_code) if args.tokenizer else None
    trajs, compared = None, []
    if len(args.input) == 1 and is_dataset(args.input[0]):
        ds = TreeDataset(args.input[0])
        stats = ds.stats()
        if args.reprefill or args.drift:
            forest = ds.forest()
            trajs = [forest.expand(tid) for tid in forest.traj_ids]
    else:
        trajs, inputs = read_rollouts(args.input, tokenizer, vocab_size=args.vocab_size,
                                      form=SINGLE if args.single else EXACT)
        stats = build_forest(trajs).stats()
        if args.drift:
            compared = compare_forms(inputs, trajs, tokenizer, vocab_size=args.vocab_size)
    drift = analyze_drift(trajs, tokenizer) if args.drift else None
    result = None
    if args.reprefill:
        result = {"keep": stats, "reprefill": build_forest(reprefill(trajs)).stats(),
                  "reprefilled_tokens": reprefill_tokens(trajs)}
    if args.json:
        body = stats if result is None else result
        print_json(body if drift is None else {**body, "drift": drift.to_dict(), "messages": compared})
        return 0
    if result is not None:
        rows = [(k, _cell(v), _cell(result["reprefill"][k])) for k, v in stats.items()]
        rows.append(("reprefilled_tokens", _cell(0), _cell(result["reprefilled_tokens"])))
        print_table(rows, header=("statistic", "keep", "reprefill"))
    else:
        print_table([(k, _cell(v)) for k, v in stats.items()], header=("statistic", "value"))
    for line in drift.lines() if drift is not None else ():
        print(line)
    for line in compare_lines(compared):
        print(line)
    return 0


if __name__ == "__main__":
    run(main)
