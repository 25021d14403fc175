"""Summarize a training run from its ``--tree-plan-report`` file (one JSON line per iteration).

    python examples/summarize_run.py out/cpu_tiny/tree.jsonl [out/cpu_tiny/expanded.jsonl]

Prints the loss curve's first and last values, the trajectory tokens over the tokens computed
(the tree/expanded token ratio: 1.0 for --tree-sharing off) and the mean update throughput.
With two reports (tree, expanded) it also prints the speedup of the first over the second.
"""
import json
import sys


def summary(path):
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise SystemExit(f"error: {path}: no iterations recorded")
    traj = sum(r["trajectory_tokens"] for r in rows)
    comp = sum(r["computed_tokens"] for r in rows)
    secs = sum(r["step_seconds"] for r in rows[1:]) or rows[0]["step_seconds"]   # the first step warms up
    toks = sum(r["trajectory_tokens"] for r in rows[1:]) or rows[0]["trajectory_tokens"]
    return {"iterations": len(rows), "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"],
            "trajectory_tokens": traj, "computed_tokens": comp, "token_ratio": traj / max(comp, 1),
            "trajectory_tokens_per_s": toks / secs, "peak_memory_gib": max(r["peak_memory_gib"] for r in rows)}


def main(argv):
    if not argv or len(argv) > 2:
        raise SystemExit(__doc__)
    sums = [summary(p) for p in argv]
    for path, s in zip(argv, sums):
        print(f"{path}: {s['iterations']} iterations | loss first {s['loss_first']:.4f} last {s['loss_last']:.4f} | "
              f"tree/expanded token ratio {s['token_ratio']:.2f}x ({s['trajectory_tokens']} trajectory tokens, "
              f"{s['computed_tokens']} computed) | {s['trajectory_tokens_per_s']:.0f} trajectory tokens/s | "
              f"peak memory {s['peak_memory_gib']:.2f} GiB")
    if len(sums) == 2:
        print(f"speedup (update throughput, first over second): "
              f"{sums[0]['trajectory_tokens_per_s'] / sums[1]['trajectory_tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
