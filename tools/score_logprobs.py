#!/usr/bin/env python3
"""Score trajectories with a checkpoint: the same records out, with every token's log-prob filled in.

--input is a trajectory file (.jsonl, .jsonl.gz, .parquet) or a dataset prefix (tools/
convert_trajectories.py); --checkpoint a driver checkpoint directory (--save of the driver, or a
release from tools/convert_hf_checkpoint.py) or a transformers Kimi-Linear directory.  The model
is described by the training driver's flags (harts-pretrain --help), given after the tool's own
(--train-iters, --global-batch-size and --lr are not needed);
--tree-sharing (default within) and --tree-microbatch-tokens choose how the forward-only passes run
(the log-probs do not depend on them).

Every record is written back unchanged except --field (old_logprobs by default, or ref_logprobs),
a list aligned with "tokens": entry j is log p(token j | tokens before j), entry 0 null.  Output
format from the --output name: .jsonl, .jsonl.gz or .parquet.  Progress goes to stderr.  Bad input
(a malformed record, an unknown flag, a missing checkpoint) is one ``error:`` line and exit status 2;
the output file appears whole or not at all.
"""
import argparse
import gzip
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_harts.cli import ArgumentParser, CliError, output_path, require_path, run  # noqa: E402
from megatron_harts.tree_data import TreeDataset, is_dataset, make_trajectory  # noqa: E402
from megatron_harts.tree_data.errors import TreeFormatError  # noqa: E402
from megatron_harts.tree_data.readers import trajectory_record, write_records  # noqa: E402

FIELDS = ("old_logprobs", "ref_logprobs")


def read_records(path: str):
    """(records as dicts, how to name record i in an error)."""
    if is_dataset(path):
        forest = TreeDataset(path).forest()
        return [trajectory_record(forest.expand(tid)) for tid in forest.traj_ids]
    require_path(path, "--input")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq
        return pq.read_table(path).to_pylist()
    opener = gzip.open if path.endswith(".gz") else open
    records = []
    with opener(path, "rt", encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TreeFormatError(f"not valid JSON ({e.msg})", file=path, line=i) from None
            if not isinstance(rec, dict):
                raise TreeFormatError("a line must hold one JSON object", file=path, line=i)
            records.append(rec)
    return records


def write_output(records, path: str) -> None:
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq
        tmp = f"{path}.tmp.{os.getpid()}"
        try:
            pq.write_table(pa.Table.from_pylist(records), tmp)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
    else:
        write_records(records, path)


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                        usage="%(prog)s --input FILE --output FILE --checkpoint DIR [options] [driver flags]")
    ap.add_argument("--input", required=True, metavar="FILE", help="trajectory file (.jsonl, .jsonl.gz, .parquet) "
                    "or dataset prefix")
    ap.add_argument("--output", required=True, metavar="FILE", help="scored records (.jsonl, .jsonl.gz, .parquet)")
    ap.add_argument("--checkpoint", required=True, metavar="DIR",
                    help="driver checkpoint directory or transformers Kimi-Linear directory")
    ap.add_argument("--field", choices=FIELDS, default="old_logprobs",
                    help="the field to fill (default old_logprobs; ref_logprobs for a reference model)")
    ap.add_argument("--batch-trajectories", type=int, default=256, metavar="N",
                    help="trajectories per forward-only pass, in input order (default 256; a group is shared "
                         "within a pass)")
    args, driver = ap.parse_known_args(argv)
    if args.batch_trajectories < 1:
        raise CliError(f"--batch-trajectories must be >= 1, got {args.batch_trajectories}")
    if not args.output.endswith((".jsonl", ".jsonl.gz", ".parquet")):
        raise CliError(f"--output {args.output}: name a .jsonl, .jsonl.gz or .parquet file")
    output_path(args.output, "--output")
    require_path(args.checkpoint, "--checkpoint", kind="dir")
    records = read_records(args.input)
    if not records:
        raise CliError(f"--input {args.input}: no records")
    for i, rec in enumerate(records):
        make_trajectory(rec, file=args.input, line=i + 1)      # every record valid before the model is built

    # the driver's required training flags mean nothing for a forward-only pass
    for name, value in (("--train-iters", "1"), ("--global-batch-size", "1"), ("--lr", "0")):
        if not any(a == name or a.startswith(name + "=") for a in driver):
            driver += [name, value]
    from megatron_harts.training.arguments import parse_args
    from megatron_harts.training.trainer import Trainer, TrainingError
    try:
        trainer = Trainer(parse_args(driver, require_data=False))
    except TrainingError as e:
        raise CliError(str(e)) from None
    t0 = time.perf_counter()
    with trainer:
        try:
            trainer.load_weights(args.checkpoint)
        except TrainingError as e:
            raise CliError(str(e).replace("load_weights", "--checkpoint")) from None
        done = 0
        for lo in range(0, len(records), args.batch_trajectories):
            chunk = records[lo:lo + args.batch_trajectories]
            for rec, lp in zip(chunk, trainer.logprobs(chunk)):
                rec[args.field] = [None if v != v else float(v) for v in lp.tolist()]
            done += len(chunk)
            print(f"scored {done}/{len(records)} trajectories ({time.perf_counter() - t0:.1f}s)", file=sys.stderr,
                  flush=True)
    write_output(records, args.output)
    print(f"wrote {len(records)} records with {args.field} to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run(main)
