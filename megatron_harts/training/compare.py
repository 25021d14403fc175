"""Two training runs side by side: per-iteration losses, step throughput and logit probes.

A run is what the driver leaves behind with ``--tree-plan-report REPORT`` (one JSON object per
iteration) and ``--tree-logit-probe DIR`` (logits of a fixed token sample of the first global
batch, before the first step and after the last: training/probe.py).  :func:`compare_runs`
gives the figures the multi-GPU validation reports per parallel configuration: token-wise logit
cosine at each probed iteration, absolute loss difference per iteration, and each run's median
step throughput.

Invariants: only iterations present in both reports are compared, and they must be the same
iterations (a run that stopped early is an error naming the report, not a shorter comparison);
the throughput median skips the first iteration (warm-up: allocator, kernel compilation) when
there are more than one.
"""
from __future__ import annotations

import json
import os
from statistics import median
from typing import Any, Dict, List

from .probe import ProbeError, compare_probes

__all__ = ["read_report", "throughput", "compare_reports", "compare_runs", "ProbeError"]


def read_report(path: str) -> List[Dict[str, Any]]:
    """The iterations of a ``--tree-plan-report`` file, in order (errors name the file and line)."""
    if not os.path.isfile(path):
        raise ProbeError(f"{path}: no such report file")
    rows: List[Dict[str, Any]] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ProbeError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(row, dict) or "iteration" not in row or "loss" not in row:
                raise ProbeError(f"{path}:{n}: a report line needs 'iteration' and 'loss'")
            rows.append(row)
    if not rows:
        raise ProbeError(f"{path}: the report holds no iterations")
    return rows


def throughput(rows: List[Dict[str, Any]]) -> Dict[str, float]:
    """Median trajectory tokens/s and step seconds of a run (first iteration skipped when there are more)."""
    steady = rows[1:] if len(rows) > 1 else rows
    return {"trajectory_tokens_per_s": median(r["trajectory_tokens_per_s"] for r in steady),
            "step_seconds": median(r["step_seconds"] for r in steady),
            "computed_tokens_per_s": median(r["computed_tokens_per_s"] for r in steady),
            "compression": median(r["compression"] for r in steady),
            "peak_memory_gib": max(r["peak_memory_gib"] for r in rows)}


def compare_reports(report_a: str, report_b: str) -> Dict[str, Any]:
    """Absolute loss difference per iteration (and its max) of two reports of the same iterations."""
    a, b = read_report(report_a), read_report(report_b)
    ia, ib = [r["iteration"] for r in a], [r["iteration"] for r in b]
    if ia != ib:
        raise ProbeError(f"{report_a} has iterations {ia[0]}..{ia[-1]} ({len(ia)}), {report_b} has "
                         f"{ib[0]}..{ib[-1]} ({len(ib)}): not the same run length")
    diffs = [abs(float(x["loss"]) - float(y["loss"])) for x, y in zip(a, b)]
    return {"iterations": ia, "loss_a": [float(r["loss"]) for r in a], "loss_b": [float(r["loss"]) for r in b],
            "loss_abs_diff": diffs, "loss_abs_diff_max": max(diffs), "loss_abs_diff_first": diffs[0]}


def _probe_iterations(directory: str) -> List[str]:
    if not os.path.isdir(directory):
        raise ProbeError(f"{directory}: no such probe directory")
    its = sorted(d for d in os.listdir(directory) if d.startswith("iter_"))
    if not its:
        raise ProbeError(f"{directory}: no iter_* probe directories there")
    return its


def compare_runs(run_a: Dict[str, str], run_b: Dict[str, str]) -> Dict[str, Any]:
    """Compare two runs, each ``{"report": REPORT, "probe": DIR}`` (module docstring)."""
    out: Dict[str, Any] = {"losses": compare_reports(run_a["report"], run_b["report"]),
                           "throughput_a": throughput(read_report(run_a["report"])),
                           "throughput_b": throughput(read_report(run_b["report"]))}
    if run_a.get("probe") or run_b.get("probe"):
        if not (run_a.get("probe") and run_b.get("probe")):
            raise ProbeError("a logit probe comparison needs a probe directory for both runs")
        ia, ib = _probe_iterations(run_a["probe"]), _probe_iterations(run_b["probe"])
        if ia != ib:
            raise ProbeError(f"{run_a['probe']} probed {ia}, {run_b['probe']} probed {ib}")
        out["probes"] = {int(it.split("_")[1]): compare_probes(os.path.join(run_a["probe"], it),
                                                               os.path.join(run_b["probe"], it)) for it in ia}
    return out
