"""Baseline executions of a forest's KDA calls, for comparison with the call planner.

Each function returns ``{"calls", "replay_tokens", "tokens_computed"}`` where
``tokens_computed`` counts every token the KDA core processes (semantic plus replay).

* ``per_depth_bucketing``: what existing GDN prefix-tree trainers do.  The forest is cut at its
  forks; a run of segments without a fork (a chain through single-child segments) is one
  sequence, and every sequence starts from the exact state at its first token, produced by the
  previous call.  One call per fork level: a sequence's call is the number of forking
  segments (two or more children) above it.  No replay.
* ``node_wise``: every segment is its own sequence started from its exact fork state; its call
  is its depth in segments (root 0), so calls = deepest segment depth + 1.  No replay.
* ``expanded``: no sharing; every trajectory is its own sequence from position 0, all in one
  call.  Trajectories end at leaves and at segments with exactly one child (a segment with one
  child only exists because a trajectory ends there), unless ``trajectory_ends`` says otherwise.
* ``harts``: the optimal plan of ``megatron_harts.planner.calls.plan_calls`` in the same form.
"""
from __future__ import annotations

import numpy as np

from megatron_harts.planner.calls import check_inputs, plan_calls

__all__ = ["per_depth_bucketing", "node_wise", "expanded", "harts", "all_baselines"]


def _child_counts(parent: np.ndarray) -> np.ndarray:
    n = parent.size
    return np.bincount(parent[parent >= 0], minlength=n) if n else np.zeros(0, np.int64)


def per_depth_bucketing(parent, start, length, chunk_size=1) -> dict:
    """One call per fork level; chains without forks run as one sequence (exact states)."""
    parent, start, length = check_inputs(parent, start, length, chunk_size)
    n = parent.size
    forks = _child_counts(parent) >= 2
    level = [0] * n
    par = parent.tolist()
    fk = forks.tolist()
    for i in range(n):
        p = par[i]
        if p >= 0:
            level[i] = level[p] + (1 if fk[p] else 0)
    return {
        "calls": (max(level) + 1) if n else 0,
        "replay_tokens": 0,
        "tokens_computed": int(length.sum()),
    }


def node_wise(parent, start, length, chunk_size=1) -> dict:
    """Every segment its own sequence from its exact fork state: calls = max depth + 1."""
    parent, start, length = check_inputs(parent, start, length, chunk_size)
    n = parent.size
    depth = [0] * n
    par = parent.tolist()
    for i in range(n):
        p = par[i]
        if p >= 0:
            depth[i] = depth[p] + 1
    return {
        "calls": (max(depth) + 1) if n else 0,
        "replay_tokens": 0,
        "tokens_computed": int(length.sum()),
    }


def expanded(parent, start, length, chunk_size=1, trajectory_ends=None) -> dict:
    """Every trajectory from position 0 in one call; tokens = sum of trajectory lengths."""
    parent, start, length = check_inputs(parent, start, length, chunk_size)
    n = parent.size
    if trajectory_ends is None:
        ends = _child_counts(parent) <= 1
    else:
        ends = np.asarray(trajectory_ends, dtype=bool)
        if ends.shape != (n,):
            raise ValueError(f"trajectory_ends must have shape ({n},), got {ends.shape}")
    return {
        "calls": 1 if n else 0,
        "replay_tokens": 0,
        "tokens_computed": int((start + length)[ends].sum()),
    }


def harts(parent, start, length, chunk_size, *, replay=True, backend="auto") -> dict:
    """The optimal plan's numbers: calls, replay, semantic tokens plus replay."""
    plan = plan_calls(parent, start, length, chunk_size, replay=replay, backend=backend)
    return {
        "calls": plan.num_calls,
        "replay_tokens": plan.replay_tokens,
        "tokens_computed": int(np.asarray(length, dtype=np.int64).sum()) + plan.replay_tokens,
    }


def all_baselines(parent, start, length, chunk_size) -> dict:
    """``{name: result}`` for harts, harts without replay, per-depth, node-wise, expanded."""
    return {
        "harts": harts(parent, start, length, chunk_size),
        "harts_no_replay": harts(parent, start, length, chunk_size, replay=False),
        "per_depth": per_depth_bucketing(parent, start, length, chunk_size),
        "node_wise": node_wise(parent, start, length, chunk_size),
        "expanded": expanded(parent, start, length, chunk_size),
    }
