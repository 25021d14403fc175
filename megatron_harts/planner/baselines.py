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

``per_depth_bucketing_plan`` and ``node_wise_plan`` return the first two as executable
``CallPlan``s (``replay=False``, no replay tokens) for the tree KDA executor: each sequence
that does not start a tree starts at its first segment's start ``p`` (any position, aligned
or not) from the state its parent's sequence exports at its own end ``p``.  Their
``num_calls`` equal the counts above, and they pass ``CallPlan.validate``.
"""
from __future__ import annotations

import numpy as np

from megatron_harts.planner.calls import CallPlan, _assemble, check_inputs, plan_calls

__all__ = ["per_depth_bucketing", "node_wise", "expanded", "harts", "all_baselines",
           "per_depth_bucketing_plan", "node_wise_plan", "BASELINE_PLANS", "CALL_PLANS"]


def _child_counts(parent: np.ndarray) -> np.ndarray:
    n = parent.size
    return np.bincount(parent[parent >= 0], minlength=n) if n else np.zeros(0, np.int64)


def _fork_levels(parent: np.ndarray) -> list:
    """Per segment: the number of forking segments (two or more children) above it."""
    n = parent.size
    fk = (_child_counts(parent) >= 2).tolist()
    par = parent.tolist()
    level = [0] * n
    for i in range(n):
        p = par[i]
        if p >= 0:
            level[i] = level[p] + (1 if fk[p] else 0)
    return level


def _depths(parent: np.ndarray) -> list:
    """Per segment: its depth in segments (roots 0)."""
    par = parent.tolist()
    depth = [0] * len(par)
    for i, p in enumerate(par):
        if p >= 0:
            depth[i] = depth[p] + 1
    return depth


def per_depth_bucketing(parent, start, length, chunk_size=1) -> dict:
    """One call per fork level; chains without forks run as one sequence (exact states)."""
    parent, start, length = check_inputs(parent, start, length, chunk_size)
    n = parent.size
    level = _fork_levels(parent)
    return {
        "calls": (max(level) + 1) if n else 0,
        "replay_tokens": 0,
        "tokens_computed": int(length.sum()),
    }


def node_wise(parent, start, length, chunk_size=1) -> dict:
    """Every segment its own sequence from its exact fork state: calls = max depth + 1."""
    parent, start, length = check_inputs(parent, start, length, chunk_size)
    n = parent.size
    depth = _depths(parent)
    return {
        "calls": (max(depth) + 1) if n else 0,
        "replay_tokens": 0,
        "tokens_computed": int(length.sum()),
    }


def _exact_state_plan(parent, start, length, chunk_size, cont, call) -> CallPlan:
    """The replay-free ``CallPlan`` in which segment ``i`` runs on into ``cont[i]`` (-1: none)
    in call ``call[i]``.

    Every other segment heads a sequence starting at its own start from the state its parent
    (whose sequence ends there) exports; ``call`` must be constant along a chain, at least one
    more than the parent's call at a sequence head, and leave no call empty.  The CSR fields
    are built by the planner's own assembly (sequences sorted by call, then first segment).
    """
    n = len(cont)
    B = int(chunk_size)
    ends = (start + length).tolist()
    return _assemble(parent.tolist(), start.tolist(), length.tolist(), B, False,
                     (max(call) + 1) if n else 0, cont, call, [True] * n, ends)


def per_depth_bucketing_plan(parent, start, length, chunk_size) -> CallPlan:
    """``per_depth_bucketing`` as an executable plan: one sequence per fork-free chain.

    A segment with exactly one child runs on into it; a forking segment ends its sequence, and
    each of its children starts one in the next call (call = number of forks above), at the fork
    position, from the state the parent chain exported at its end.  No replay; ``num_calls ==
    per_depth_bucketing(...)["calls"]``.
    """
    parent, start, length = check_inputs(parent, start, length, chunk_size)
    n = parent.size
    counts = _child_counts(parent).tolist()
    cont = [-1] * n
    for i, p in enumerate(parent.tolist()):
        if p >= 0 and counts[p] == 1:
            cont[p] = i
    return _exact_state_plan(parent, start, length, chunk_size, cont, _fork_levels(parent))


def node_wise_plan(parent, start, length, chunk_size) -> CallPlan:
    """``node_wise`` as an executable plan: every segment its own sequence, call = its depth.

    Each non-root segment starts at its start from the state its parent's sequence exported at
    its end.  No replay; ``num_calls == node_wise(...)["calls"]``.
    """
    parent, start, length = check_inputs(parent, start, length, chunk_size)
    n = parent.size
    return _exact_state_plan(parent, start, length, chunk_size, [-1] * n, _depths(parent))


#: executable baseline plans by ``--tree-kda-call-plan`` name (``harts`` is ``plan_calls``)
BASELINE_PLANS = {"per-depth": per_depth_bucketing_plan, "node-wise": node_wise_plan}
#: the values of ``--tree-kda-call-plan`` (``HybridConfig.tree_kda_call_plan``); the first is the default
CALL_PLANS = ("harts",) + tuple(BASELINE_PLANS)


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
