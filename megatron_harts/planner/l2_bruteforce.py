"""The L2 search's objective in Python, and its optimum over every state of a small instance.

``objective(inst, bins)`` is ``_C.l2_search``'s objective (``planner.l2`` module docstring)
of units placed in bins (``replica * slots + bin``), written plainly: per replica its producers
(bins holding a block); per bin its segments, the producer it reads (per tree: the bin of its items'
block, when every block above it is on the bin's replica or on one with no more producers), its
cost (a cut item's pieces replaying once); per replica its bins in run order (producers first,
then the others, costliest first); the step.  ``optimum(inst)`` tries every assignment of the units to the bins
(``(dp * slots) ** units`` states: instances of up to 8 units on a few bins) and returns the least
``(rows over the budget, tokens above L1's, step + load)``.  The tests hold the compiled search to it.
"""
from __future__ import annotations

import itertools
from typing import Dict, List, Sequence, Tuple

from .l2 import L2Instance

__all__ = ["objective", "optimum", "MAX_UNITS"]

#: the largest instance ``optimum`` enumerates
MAX_UNITS = 8


def objective(inst: L2Instance, bins: Sequence[int]) -> Tuple[int, int, float, List[float]]:
    """(rows over the budget, tokens above the base, step + mean replica load, per slot the costliest bin) of
    the units in ``bins``."""
    K, R = inst.slots, inst.dp
    units: Dict[int, List[int]] = {}
    for u, b in enumerate(bins):
        units.setdefault(int(b), []).append(u)
    length, pairs, logits = inst.length.tolist(), inst.pairs.tolist(), inst.logits.tolist()
    cost: Dict[int, float] = {}
    producer = {b: any(inst.kind[u] == 0 for u in us) for b, us in units.items()}
    producers = [sum(1 for b in units if b // K == r and producer[b]) for r in range(R)]

    def top(k: int) -> int:
        while inst.up[k] >= 0:
            k = int(inst.up[k])
        return k

    def source(u: int, r: int) -> int:
        """The bin item ``u`` on replica ``r`` may read (-1: none): its block's, on ``r``, every block
        above it on ``r`` or on a replica with no more producers."""
        p = int(bins[inst.win[u]])
        if p // K != r:
            return -1
        a = int(inst.up[inst.win[u]])
        while a >= 0:
            ra = int(bins[a]) // K
            if ra != r and producers[ra] > producers[r]:
                return -1
            a = int(inst.up[a])
        return p

    overflow = tokens = 0
    for b, us in units.items():
        reads = set()
        if not producer[b]:
            per_tree: Dict[int, List[int]] = {}
            for u in us:
                if inst.kind[u] == 1:
                    per_tree.setdefault(top(int(inst.win[u])), []).append(u)
            gain: Dict[int, int] = {}
            for t, its in per_tree.items():
                srcs = {source(u, b // K) for u in its}
                if len(srcs) == 1 and -1 not in srcs:
                    p = srcs.pop()
                    gain[p] = gain.get(p, 0) + sum(length[x] for u in its for x in inst.segments("path", u).tolist())
            if gain:
                reader = min(gain, key=lambda p: (-gain[p], p))
                reads = {u for t, its in per_tree.items() if {source(v, b // K) for v in its} == {reader}
                         for u in its}
        comp, owned, replay, replayed = set(), [], 0, set()
        for u in us:
            owned.extend(inst.segments("own", u).tolist())
            comp.update(inst.segments("own", u).tolist())
            comp.update(inst.segments("rec", u).tolist())
            if u in reads:
                root = min(inst.segments("own", u).tolist() + inst.segments("rec", u).tolist())
                if root not in replayed:  # the pieces of one cut item replay once
                    replayed.add(root)
                    replay += int(inst.replay[u])
            else:  # an item recomputing its path; a block's path (the core above it) always computed
                comp.update(inst.segments("path", u).tolist())
        rows = sum(length[x] for x in comp)
        cost[b] = (inst.overhead + inst.c_row * rows + inst.c_pair * sum(pairs[x] for x in comp)
                   + inst.c_logit * sum(logits[x] for x in owned) + inst.c_replay * replay)
        overflow += max(0, rows - inst.row_budget)
        tokens += rows + replay
    runs = []
    for r in range(R):
        mine = [b for b in range(r * K, (r + 1) * K) if b in units]
        mine.sort(key=lambda b: (0 if producer[b] else 1, -cost[b], b))
        runs.append([cost[b] for b in mine] + [0.0] * (K - len(mine)))
    tops = [max(run[k] for run in runs) for k in range(K)]
    step = 0.0
    for t in tops:
        step += t
    load = 0.0
    for b in sorted(cost):
        load += cost[b]
    return overflow, max(0, tokens - inst.base_tokens), step + load / R, tops


def optimum(inst: L2Instance) -> Tuple[Tuple[int, int, float], Tuple[int, ...]]:
    """The least ``(rows over the budget, tokens above the base, step + load)`` over every assignment of the
    units to the bins, and one assignment reaching it."""
    if inst.num_units > MAX_UNITS:
        raise ValueError(f"optimum enumerates instances of up to {MAX_UNITS} units, got {inst.num_units}")
    best = None
    for bins in itertools.product(range(inst.dp * inst.slots), repeat=inst.num_units):
        o = objective(inst, bins)
        key = (o[0], o[1], o[2])
        if best is None or key[:2] < best[0][:2] or (key[:2] == best[0][:2] and key[2] < best[0][2] - 1e-12):
            best = (key, bins)
    return best
