#!/usr/bin/env python3
"""Compare two training runs of pretrain_tree_gpt.py on the same data and initial weights.

Each run is given as REPORT[:PROBE_DIR]: its --tree-plan-report file and, optionally, its
--tree-logit-probe directory.  Prints the absolute loss difference per iteration (and its max),
each run's median step throughput, and for every probed iteration the token-wise logit cosine
(mean and min over the sampled target tokens) and |logit difference|.

    python tools/compare_runs.py out/expanded/report.jsonl:out/expanded/probe \\
        out/tree/report.jsonl:out/tree/probe            # table
    python tools/compare_runs.py A.jsonl:A_probe B.jsonl:B_probe --json
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_harts.cli import ArgumentParser, CliError, print_json, print_table, run  # noqa: E402
from megatron_harts.training.compare import ProbeError, compare_runs  # noqa: E402


def _run_spec(text: str, which: str) -> dict:
    report, _, probe = text.partition(":")
    if not report:
        raise CliError(f"{which} {text!r}: expected REPORT[:PROBE_DIR]")
    return {"report": report, "probe": probe or None}


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("baseline", metavar="BASELINE", help="REPORT[:PROBE_DIR] of the baseline run")
    ap.add_argument("candidate", metavar="CANDIDATE", help="REPORT[:PROBE_DIR] of the run compared with it")
    ap.add_argument("--json", action="store_true", help="print everything as one JSON object")
    args = ap.parse_args(argv)
    a, b = _run_spec(args.baseline, "BASELINE"), _run_spec(args.candidate, "CANDIDATE")
    try:
        res = compare_runs(a, b)
    except ProbeError as e:
        raise CliError(str(e)) from None
    if args.json:
        print_json(res)
        return 0
    los = res["losses"]
    print_table([(it, f"{x:.8e}", f"{y:.8e}", f"{d:.3e}")
                 for it, x, y, d in zip(los["iterations"], los["loss_a"], los["loss_b"], los["loss_abs_diff"])],
                header=("iteration", "loss baseline", "loss candidate", "|difference|"))
    print(f"max |loss difference| {los['loss_abs_diff_max']:.3e}")
    ta, tb = res["throughput_a"], res["throughput_b"]
    print(f"trajectory tokens/s (median): baseline {ta['trajectory_tokens_per_s']:.1f}, candidate "
          f"{tb['trajectory_tokens_per_s']:.1f} ({tb['trajectory_tokens_per_s'] / ta['trajectory_tokens_per_s']:.2f}x)")
    if "probes" in res:
        print_table([(it, p["tokens"], f"{p['logit_cosine_mean']:.9f}", f"{p['logit_cosine_min']:.9f}",
                      f"{p['logit_abs_diff_max']:.3e}") for it, p in sorted(res["probes"].items())],
                    header=("probed iteration", "tokens", "logit cosine mean", "min", "max |logit diff|"))
    return 0


if __name__ == "__main__":
    run(main)
