#!/usr/bin/env python3
"""Write seeded synthetic SWE-agent-like rollouts as JSONL (see megatron_harts/tree_data/synthetic.py)."""
import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_harts.cli import CliError, print_json, run  # noqa: E402
from megatron_harts.tree_data import write_jsonl  # noqa: E402
from megatron_harts.tree_data.synthetic import SCHEMES, SweConfig, synthesize_swe  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--output", required=True, metavar="FILE", help="JSONL file (.jsonl or .jsonl.gz)")
    ap.add_argument("--scheme", choices=SCHEMES, default="tree-step")
    defaults = SweConfig()
    for f in dataclasses.fields(SweConfig):
        if f.name == "scheme":
            continue
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(defaults, f.name)),
                        default=getattr(defaults, f.name), help=f"default {getattr(defaults, f.name)}")
    ap.add_argument("--json", action="store_true", help="print a JSON summary")
    args = ap.parse_args(argv)
    cfg = SweConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SweConfig)})
    try:
        cfg.validate()
    except ValueError as e:
        raise CliError("--" + str(e).replace("_", "-", 1)) from None
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        raise CliError(f"--output: directory {out_dir} does not exist")
    trajs = synthesize_swe(cfg)
    write_jsonl(trajs, args.output)
    summary = {"output": args.output, "trajectories": len(trajs),
               "expanded_tokens": int(sum(len(t) for t in trajs)), "config": dataclasses.asdict(cfg)}
    if args.json:
        print_json(summary)
    else:
        print(f"wrote {args.output}: {summary['trajectories']} trajectories, "
              f"{summary['expanded_tokens']:,} tokens ({cfg.scheme}, seed {cfg.seed})")
    return 0


if __name__ == "__main__":
    run(main)
