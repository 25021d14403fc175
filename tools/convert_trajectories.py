#!/usr/bin/env python3
"""Convert trajectory files (JSONL/Parquet, one trajectory per row) into a rollout-tree dataset.

Writes PREFIX.bin and PREFIX.idx atomically; on bad input prints one error line
naming file, line, trajectory and field, exits 2 and writes nothing.

--compaction keep (default) stores compaction events as given (KV eviction in place,
one continuous trace per trajectory).  --compaction reprefill stores instead the split
samples trainers without in-place eviction build: a trajectory with events at the distinct
times p1 < p2 < ... becomes samples ID/r0 (tokens [0, p1)), ID/r1, ID/r2, ...; sample
ID/rk re-emits the tokens still visible at pk as context (loss mask 0) and continues with
tokens [pk, p(k+1)).  Every target is a target in exactly one sample; trajectories without
events pass unchanged; a target at pk with every token before it evicted is an error.

Engine token records (one row per model call with the engine's prompt and completion ids,
docs/messages.md) are merged by prefix into trajectories with no re-tokenization.

--tokenizer DIR (a transformers tokenizer directory with a chat template, read locally) also
takes rollouts as chat messages (docs/messages.md), in the exact form by default: every model
call is the prompt the engine rendered for it (the messages before it, with the generation
prompt) followed by what it generated; consecutive calls stay one trajectory while each prompt
extends the previous prompt and completion token for token, and where the template re-renders
the history the conversation continues as a new trajectory sharing the tokens up to the first
difference.  --single-trajectory-context-differs-from-rollout keeps one trajectory per
conversation instead, whose later turns are trained on a context the model did not see where
the template re-renders history.  The converter prints, per input, the calls, the trajectories
re-render branching made and their cost, and the unique tokens of both forms; and the
tokenization drift of the set (text shared by trajectories of a group whose ids differ);
--repair-drift re-tokenizes such context alike before the trees are built.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_harts.cli import ArgumentParser, CliError, Progress, output_path, print_json, run  # noqa: E402
from megatron_harts.tree_data import build_forest, write_dataset  # noqa: E402
from megatron_harts.tree_data.drift import TokenText, analyze_drift, repair_drift, repair_lines  # noqa: E402
from megatron_harts.tree_data.messages import (EXACT, SINGLE, compare_forms, compare_lines,  # noqa: E402
                                               load_chat_tokenizer, merged_reports, read_rollouts)
from megatron_harts.tree_data.reprefill import reprefill, reprefill_tokens  # noqa: E402


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, nargs="+", metavar="FILE",
                    help="trajectory files, engine token record files, or with --tokenizer chat-message files")
    ap.add_argument("--output", required=True, metavar="PREFIX", help="dataset prefix (PREFIX.bin, PREFIX.idx)")
    ap.add_argument("--vocab-size", type=int, default=None, metavar="N", help="reject token ids >= N")
    ap.add_argument("--workers", type=int, default=1, metavar="N", help="parallel JSONL parsing processes")
    ap.add_argument("--compaction", choices=("keep", "reprefill"), default="keep",
                    help="keep: store compaction events as given (default); reprefill: store the split "
                         "samples ID/r0, ID/r1, ... (see above)")
    ap.add_argument("--tokenizer", metavar="DIR", default=None,
                    help="a transformers tokenizer directory with a chat template: input rows may hold chat "
                         "messages (docs/messages.md); prints the tokenization drift of the set")
    ap.add_argument("--single-trajectory-context-differs-from-rollout", dest="single", action="store_true",
                    help="with --tokenizer: one trajectory per conversation, every turn kept as rendered when it "
                         "was the latest; where the chat template re-renders history, later turns are trained on a "
                         "context that differs from the one the model saw in the rollout (off-policy)")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="run the code a tokenizer directory ships (tiktoken-based tokenizers such as "
                         "Kimi-Linear's); without it such a tokenizer is refused")
    ap.add_argument("--repair-drift", action="store_true",
                    help="with --tokenizer: re-tokenize context whose text a trajectory of its group holds with "
                         "other ids alike (targets are never changed) and report what changed")
    ap.add_argument("--json", action="store_true",
                    help="print the dataset's stats as JSON (with --compaction reprefill, plus 'reprefill': "
                         "input trajectories and tokens, re-prefilled tokens; with --tokenizer, plus 'messages', "
                         "'drift' and with --repair-drift 'repair')")
    args = ap.parse_args(argv)
    if args.workers < 1:
        raise CliError(f"--workers must be >= 1, got {args.workers}")
    if args.vocab_size is not None and args.vocab_size < 1:
        raise CliError(f"--vocab-size must be >= 1, got {args.vocab_size}")
    if args.repair_drift and args.tokenizer is None:
        raise CliError("--repair-drift needs --tokenizer DIR to decode the token ids")
    if args.single and args.tokenizer is None:
        raise CliError("--single-trajectory-context-differs-from-rollout needs --tokenizer DIR (it applies to "
                       "chat messages)")
    output_path(args.output, "--output")
    t0 = time.perf_counter()
    tokenizer = load_chat_tokenizer(args.tokenizer, args.trust_remote_code) if args.tokenizer else None
    progress = Progress("reading", unit="lines")
    trajs, inputs = read_rollouts(args.input, tokenizer, vocab_size=args.vocab_size, workers=args.workers,
                                  progress=progress, form=SINGLE if args.single else EXACT)
    progress.close()
    extra, notes = {}, []
    tokenized, records = merged_reports(inputs)
    compared = compare_forms(inputs, trajs, tokenizer, vocab_size=args.vocab_size)
    if compared:
        extra["inputs"] = compared
        notes += compare_lines(compared)
    if records is not None:
        extra["records"] = records.to_dict()
        notes += records.lines()
    if tokenizer is not None:
        text_of = TokenText(tokenizer)
        drift = analyze_drift(trajs, text_of)
        extra.update(messages=(tokenized.to_dict() if tokenized is not None else None), drift=drift.to_dict())
        notes += (tokenized.lines() if tokenized is not None else []) + drift.lines()
        if args.repair_drift:
            before = build_forest(trajs).stats()["unique_tokens"]
            trajs, changes = repair_drift(trajs, text_of)
            after = build_forest(trajs).stats()["unique_tokens"]
            extra["repair"] = {"trajectories": len({c.trajectory for c in changes}), "spans": len(changes),
                               "removed_tokens": sum(c.removed for c in changes),
                               "added_tokens": sum(c.added for c in changes),
                               "unique_tokens_before": before, "unique_tokens_after": after}
            notes += repair_lines(changes, before, after)
    split = None
    if args.compaction == "reprefill":
        samples = reprefill(trajs)
        split = {"input_trajectories": len(trajs), "input_tokens": int(sum(len(t) for t in trajs)),
                 "reprefilled_tokens": reprefill_tokens(trajs)}
        trajs = samples
    forest = build_forest(trajs)
    write_dataset(forest, args.output)
    stats = forest.stats()
    if args.json:
        print_json({**(stats if split is None else {**stats, "reprefill": split}), **extra})
        return 0
    line = (f"wrote {args.output}.bin/.idx: {stats['num_trajectories']} trajectories, {stats['num_trees']} trees, "
            f"{stats['expanded_tokens']:,} expanded -> {stats['unique_tokens']:,} unique tokens "
            f"({stats['compression']:.2f}x)")
    if stats["compaction_events"]:
        line += (f", {stats['compaction_events']:,} compaction events ({stats['compaction_events_tree']:,} in "
                 f"the trees), {stats['visible_pairs_tree']:,} visible pairs in the trees "
                 f"({stats['visible_pairs_expanded']:,} expanded)")
    if split is not None:
        line += (f"; re-prefill of {split['input_trajectories']} trajectories ({split['input_tokens']:,} tokens) "
                 f"adds {split['reprefilled_tokens']:,} re-prefilled tokens, "
                 f"{stats['visible_pairs_tree']:,} visible pairs in the trees")
    print(f"{line} in {time.perf_counter() - t0:.1f}s")
    for note in notes:
        print(note)
    return 0


if __name__ == "__main__":
    run(main)
