#!/usr/bin/env python3
"""Summarize a training run from its ``--tree-plan-report`` file (one JSON line per iteration).

    python examples/summarize_run.py [REPORT [REPORT2]]

REPORT defaults to out/cpu_tiny/report.jsonl, the file examples/cpu_tiny.sh writes.  Prints the
loss curve's first and last values, the trajectory tokens over the tokens computed (the
tree/expanded token ratio: 1.0 for --tree-sharing off) and the mean update throughput.  With two
reports (tree, expanded) it also prints the speedup of the first over the second.  A missing or
malformed report is one ``error:`` line and exit status 2.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_harts.cli import ArgumentParser, CliError, require_path, run  # noqa: E402

DEFAULT_REPORT = os.path.join("out", "cpu_tiny", "report.jsonl")
FIELDS = ("loss", "trajectory_tokens", "computed_tokens", "step_seconds", "peak_memory_gib")


def read_report(path: str) -> list:
    """The report's iterations (``training.compare.read_report``), each holding every field of
    FIELDS (else CliError naming the file, line and field)."""
    from megatron_harts.training.compare import ProbeError, read_report as read_iterations
    require_path(path, "REPORT")
    try:
        rows = read_iterations(path)
    except ProbeError as e:
        raise CliError(str(e)) from None
    for n, row in enumerate(rows, 1):
        missing = [k for k in FIELDS if k not in row]
        if missing:
            raise CliError(f"{path}: iteration {n}: no field {missing[0]!r} (is this a --tree-plan-report file?)")
    return rows


def summary(path: str) -> dict:
    rows = read_report(path)
    traj = sum(r["trajectory_tokens"] for r in rows)
    comp = sum(r["computed_tokens"] for r in rows)
    secs = sum(r["step_seconds"] for r in rows[1:]) or rows[0]["step_seconds"]   # the first step warms up
    toks = sum(r["trajectory_tokens"] for r in rows[1:]) or rows[0]["trajectory_tokens"]
    return {"iterations": len(rows), "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"],
            "trajectory_tokens": traj, "computed_tokens": comp, "token_ratio": traj / max(comp, 1),
            "trajectory_tokens_per_s": toks / secs if secs > 0 else 0.0,
            "peak_memory_gib": max(r["peak_memory_gib"] for r in rows)}


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="*", metavar="REPORT", help=f"run report(s) (default {DEFAULT_REPORT})")
    args = ap.parse_args(argv)
    paths = args.reports or [DEFAULT_REPORT]
    if len(paths) > 2:
        raise CliError(f"at most two reports (tree, expanded), got {len(paths)}")
    sums = [summary(p) for p in paths]
    for path, s in zip(paths, sums):
        print(f"{path}: {s['iterations']} iterations | loss first {s['loss_first']:.4f} last {s['loss_last']:.4f} | "
              f"tree/expanded token ratio {s['token_ratio']:.2f}x ({s['trajectory_tokens']} trajectory tokens, "
              f"{s['computed_tokens']} computed) | {s['trajectory_tokens_per_s']:.0f} trajectory tokens/s | "
              f"peak memory {s['peak_memory_gib']:.2f} GiB")
    if len(sums) == 2 and sums[1]["trajectory_tokens_per_s"] > 0:
        print(f"speedup (update throughput, first over second): "
              f"{sums[0]['trajectory_tokens_per_s'] / sums[1]['trajectory_tokens_per_s']:.2f}x")
    return 0


if __name__ == "__main__":
    run(main)
