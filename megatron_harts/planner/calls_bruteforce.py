"""Exhaustive judge for the call planner (small forests only, <= ~12 segments).

It knows nothing of the planner's algorithm: it enumerates every continuation choice (each
segment continues one of its children or none), builds the sequences straight from the model's
definition (``docs/design.md``, "the packed chunkwise-call model, exactly"), and finds the
fewest calls for that choice, either as the longest chain of producer -> consumer sequences or,
with ``exhaustive_calls=True``, by trying every assignment of calls to sequences.  The answer is
the lexicographic minimum of (calls, total replay) over all choices.
"""
from __future__ import annotations

import itertools

__all__ = ["brute_force_optimum", "sequences_of_choice"]


def sequences_of_choice(parent, start, length, chunk_size, cont, replay=True):
    """Sequences of one continuation choice.

    ``cont[i]`` is the child continuing segment ``i`` or -1.  Returns a list of
    ``(head, replay, holder)`` per sequence, heads in increasing index order, where ``holder``
    is the segment holding token ``s - 1`` of the head's path (-1 when ``s == 0``), and the map
    segment -> index of its sequence.
    """
    n = len(parent)
    B = chunk_size
    seq_of = [-1] * n
    seqs = []
    for i in range(n):
        p = parent[i]
        if p >= 0 and cont[p] == i:
            seq_of[i] = seq_of[p]
            continue
        pos = start[i]
        s = (pos // B) * B if replay else pos
        holder = -1
        if s > 0:
            holder = p
            while start[holder] > s - 1:
                holder = parent[holder]
        seq_of[i] = len(seqs)
        seqs.append((i, pos - s, holder))
    return seqs, seq_of


def _min_calls_longest_path(seqs, seq_of):
    level = []
    for head, _, holder in seqs:
        level.append(0 if holder < 0 else level[seq_of[holder]] + 1)
    return max(level) + 1 if level else 0


def _min_calls_exhaustive(seqs, seq_of, upper):
    m = len(seqs)
    if m == 0:
        return 0
    deps = [(seq_of[holder], q) for q, (_, _, holder) in enumerate(seqs) if holder >= 0]
    for k in range(1, upper + 1):
        for assign in itertools.product(range(k), repeat=m):
            if all(assign[a] < assign[b] for a, b in deps):
                return k
    raise AssertionError("no call assignment found within the upper bound")


def _continuation_options(parent):
    n = len(parent)
    children = [[] for _ in range(n)]
    for i, p in enumerate(parent):
        if p >= 0:
            children[p].append(i)
    return [[-1] + ch for ch in children]


def brute_force_optimum(parent, start, length, chunk_size, *, replay=True,
                        exhaustive_calls=False):
    """Minimum ``(calls, total replay)`` over every legal plan of a small forest.

    ``replay=False`` is the no-replay model: sequences start exactly at their first segment,
    from the state produced by the parent's sequence.  ``exhaustive_calls=True`` also searches
    all call assignments per choice (exponential; for a handful of sequences).
    """
    parent = [int(x) for x in parent]
    start = [int(x) for x in start]
    length = [int(x) for x in length]
    best = None
    for cont in itertools.product(*_continuation_options(parent)):
        seqs, seq_of = sequences_of_choice(parent, start, length, chunk_size, cont, replay)
        calls = _min_calls_longest_path(seqs, seq_of)
        if exhaustive_calls:
            exact = _min_calls_exhaustive(seqs, seq_of, len(seqs))
            if exact != calls:
                raise AssertionError(f"longest path {calls} != exhaustive {exact}")
        key = (calls, sum(r for _, r, _ in seqs))
        if best is None or key < best:
            best = key
    return best if best is not None else (0, 0)
