"""The re-prefill form of compacted trajectories: the split samples of trainers without
in-place KV eviction.

A trajectory with compaction events at the distinct times ``p_1 < ... < p_m`` becomes
``m + 1`` samples with ids ``f"{id}/r{k}"``:

- ``r0``: tokens ``[0, p_1)``;
- ``rk`` (k >= 1): the tokens still visible at ``p_k`` (positions ``[0, p_k)`` minus the
  union of the spans of every event with ``at <= p_k``, in order), re-emitted as context
  (``loss_mask`` 0), then the trajectory's tokens ``[p_k, p_{k+1})`` (``p_{m+1}`` = its
  length) with their own loss mask.

So every original token is new in exactly one sample and every original target is a
target there, predicted from the tokens visible at that point; a sample's positions
start again at 0 and it carries no events.  Per-token log-probs (old, rollout, reference) and advantages
are gathered with the tokens; scalar advantage, reward, weight and group carry over.
Trajectories without events pass unchanged.
"""
from __future__ import annotations

import dataclasses
from typing import List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .trajectory import LOGPROB_FIELDS, Trajectory, TrajectoryId


def _event_times(t: Trajectory) -> np.ndarray:
    return np.unique(t.compactions[:, 0])


def _visible(t: Trajectory, p: int) -> np.ndarray:
    """Positions ``[0, p)`` not evicted by an event with ``at <= p``, in order."""
    seen = np.ones(p, dtype=bool)
    for at, a, b in t.compactions.tolist():
        if at <= p:
            seen[a:b] = False
    return np.flatnonzero(seen)


def _sample_positions(t: Trajectory) -> List[Tuple[np.ndarray, int]]:
    """Per sample: the original positions it holds, and how many of them lead as context."""
    times = _event_times(t).tolist()
    bounds = times + [len(t)]
    out = [(np.arange(bounds[0], dtype=np.int64), 0)]
    for k, p in enumerate(times):
        vis = _visible(t, p)
        if vis.size == 0 and t.loss_mask[p] == 1:
            raise t.error("compactions", f"re-prefill: token {p} is a target (loss_mask 1) but the events "
                                         f"at {p} evict every token before it, so its sample would have no "
                                         f"token to predict it from")
        out.append((np.concatenate([vis, np.arange(p, bounds[k + 1], dtype=np.int64)]), int(vis.size)))
    return out


def reprefill_trajectory(t: Trajectory, split: Optional[Mapping[TrajectoryId, int]] = None) -> List[Trajectory]:
    """The re-prefill samples of ``t`` (``[t]`` itself when it has no events and no link to
    re-point).

    ``split`` maps the id of every trajectory that is split to its first event time
    (``r0``'s length).  The parent link of ``r0`` (or of ``t`` unsplit) is ``t``'s, cut to
    ``r0``'s length and pointing at the parent's ``r0`` when the parent is split, so
    ``tokens[:at]`` still agree; a later sample of a trajectory with a parent link points at
    its own ``r0`` with ``at`` 0 (it stays in the same merge scope).  Raises
    TreeFormatError naming ``t`` and the position for a target left with no token before it.
    """
    split = split or {}
    parent = t.parent
    if parent is not None and parent[0] in split:
        parent = (f"{parent[0]}/r0", min(parent[1], split[parent[0]]))
    if t.compactions is None:
        return [t if parent == t.parent else dataclasses.replace(t, parent=parent)]
    out = []
    for k, (pos, ctx) in enumerate(_sample_positions(t)):
        mask = t.loss_mask[pos].copy()
        mask[:ctx] = 0
        logprobs = {name: None if getattr(t, name) is None else getattr(t, name)[pos] for name in LOGPROB_FIELDS}
        adv = t.advantage[pos] if isinstance(t.advantage, np.ndarray) else t.advantage
        if parent is None:
            link = None
        elif k == 0:
            link = (parent[0], min(parent[1], int(pos.size)))
        else:
            link = (f"{t.id}/r0", 0)
        out.append(Trajectory(id=f"{t.id}/r{k}", tokens=t.tokens[pos], loss_mask=mask, advantage=adv, reward=t.reward,
                              weight=t.weight, group=t.group, parent=link,
                              compactions=None, source=t.source, **logprobs))
    return out


def reprefill(trajs: Sequence[Trajectory]) -> List[Trajectory]:
    """Every trajectory in its re-prefill form, samples in input order (module docstring);
    the input is not modified."""
    split = {t.id: int(_event_times(t)[0]) for t in trajs if t.compactions is not None}
    return [r for t in trajs for r in reprefill_trajectory(t, split)]


def reprefill_tokens(trajs: Sequence[Trajectory]) -> int:
    """Tokens the re-prefill form adds: the visible tokens re-emitted at every event time.

    The samples of ``reprefill(trajs)`` hold ``sum(len(t)) + reprefill_tokens(trajs)``
    tokens.
    """
    total = 0
    for t in trajs:
        if t.compactions is not None:
            total += sum(int(_visible(t, p).size) for p in _event_times(t).tolist())
    return total
