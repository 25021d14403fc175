"""Metrics of a microbatch plan: one function, used by the tests, the report tool and the benchmark.

``plan_metrics(plan)`` returns a dict:

- ``compression``: expanded tokens (sum of trajectory lengths) / tokens computed, where tokens
  computed counts every row of every microbatch (a producer's rows once, recomputed ancestors
  each time they are recomputed) plus every KDA replay token.
- ``balance_mean``, ``balance_p5``: per slot, balance = mean over replicas of the slot's
  microbatch cost / the maximum (an idle entry costs 0; a slot counts only if some replica
  works in it); their mean and 5th percentile (linear interpolation, ``numpy.percentile``).
- ``step_min_balance``: balance of the step totals: the least-loaded replica's total cost over
  the step / the most-loaded one's.  (Aggregated over several steps, the benchmark reports
  the minimum over steps.)
- ``step_efficiency``: sum over slots of the mean cost / sum over slots of the maximum: the
  fraction of the slot-synchronized step time the replicas spend working.
- ``microbatches`` (non-empty), ``slots``, ``peak_rows`` (largest microbatch), ``plan_seconds``,
  ``tokens_computed``, ``expanded_tokens``, ``replay_tokens``, ``recomputed_rows``,
  ``producers``, ``windows``, ``max_retention`` and ``mean_retention`` (slots between a
  producer and its last consumer), ``step_cost`` (sum over slots of the slot maximum: the
  modelled step time in seconds).
- retention memory, in rows: ``export_rows`` (rows exported by all producers: every window's
  rows) and ``peak_export_rows`` (the most rows one replica keeps exported at once: a window's
  rows stay on its producer's replica from the producer's slot through its last consumer's
  slot).  Times a model's exported bytes per row (MLA key/value latents of every MLA
  layer, KDA replay inputs and conv context) this is the memory retention costs; KDA boundary
  states are per window, not per row, and are not counted.
"""
from __future__ import annotations

from typing import Dict

import numpy as np

from .microbatch import MicrobatchPlan

__all__ = ["plan_metrics", "slot_balance"]


def slot_balance(plan: MicrobatchPlan) -> np.ndarray:
    """Balance of every slot with work in it: mean / max of its replicas' costs."""
    c = plan.cost_matrix()
    mx = c.max(axis=0) if c.size else np.zeros(0)
    keep = mx > 0
    return c.mean(axis=0)[keep] / mx[keep]


def plan_metrics(plan: MicrobatchPlan) -> Dict[str, float]:
    """The metrics of the module docstring for one plan (one step)."""
    mbs = plan.microbatches
    computed = plan.tokens_computed
    c = plan.cost_matrix()
    bal = slot_balance(plan)
    totals = c.sum(axis=1) if c.size else np.zeros(plan.num_replicas)
    mx = c.max(axis=0) if c.size else np.zeros(0)
    means = c.mean(axis=0) if c.size else np.zeros(0)
    ret = [w.retention for w in plan.windows]
    alive = np.zeros(plan.slots.shape, dtype=np.int64)  # exported rows kept per (replica, slot)
    for w in plan.windows:
        alive[plan.microbatches[w.producer].replica, w.producer_slot:w.last_slot + 1] += w.rows
    return {
        "compression": plan.expanded_tokens / computed if computed else 0.0,
        "balance_mean": float(bal.mean()) if bal.size else 1.0,
        "balance_p5": float(np.percentile(bal, 5)) if bal.size else 1.0,
        "step_min_balance": float(totals.min() / totals.max()) if totals.size and totals.max() > 0 else 1.0,
        "step_efficiency": float(means.sum() / mx.sum()) if mx.size and mx.sum() > 0 else 1.0,
        "microbatches": len(mbs),
        "slots": plan.num_slots,
        "peak_rows": max((m.rows for m in mbs), default=0),
        "plan_seconds": float(plan.plan_seconds),
        "tokens_computed": int(computed),
        "expanded_tokens": int(plan.expanded_tokens),
        "replay_tokens": int(sum(m.features.replay_tokens for m in mbs)),
        "recomputed_rows": int(sum(m.recomputed_rows for m in mbs)),
        "producers": sum(1 for m in mbs if m.consumers),
        "windows": len(plan.windows),
        "max_retention": max(ret, default=0),
        "mean_retention": float(np.mean(ret)) if ret else 0.0,
        "step_cost": float(mx.sum()),
        "export_rows": int(sum(w.rows for w in plan.windows)),
        "peak_export_rows": int(alive.max()) if alive.size else 0,
    }

