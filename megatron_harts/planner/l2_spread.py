"""L2's spreading packer (``pack_spread``): ``S`` microbatches per replica up front, cores leading.

``_C.l2_pack_spread`` is its compiled core; ``_pack_spread_python`` its reference (the same
values, floats included; a test holds them equal).  Invariant: every window of its packings
runs as the schedule runs it, as in ``pack_windows``.
"""
from __future__ import annotations

from typing import Dict, List

from .cost_model import ForestIndex
from .l2_packing import CompiledPacker, _after_owners
from .l2_units import _Unit

__all__ = ["pack_spread"]


def _spread_output(dp, rep, own_l, rec_l, load, has_core, after, ent, bound):
    """``pack_spread``'s packing from its bins: producers first on their replica, the rest
    costliest first, split windows' consumers after their path's owner."""
    seqs = []
    for r in range(dp):
        bins = [b for b in range(len(rep)) if rep[b] == r and own_l[b]]
        seqs.append([b for b in bins if has_core[b]] +
                    sorted((b for b in bins if not has_core[b]), key=lambda b: -load[b]))
    seqs = _after_owners(seqs, {b: {q for q in qs if q != b} for b, qs in after.items()})
    if seqs is None:
        return [], bound
    groups, placement, loads, entries = [], [], [], []
    for r, seq in enumerate(seqs):
        for k, b in enumerate(seq):
            groups.append((tuple(own_l[b]), tuple(rec_l[b])))
            placement.append((r, k))
            entries.append(ent[b])
        loads.append([load[b] for b in seq])
    return [(groups, placement, loads, entries)], bound


def _pack_spread_python(ix: ForestIndex, units: List[_Unit], dp: int, M: int, S: int, eps: float = 0.01):
    """The spreading packer (several replicas): ``S`` microbatches per replica opened up front;
    cores first, costliest first, each into the first microbatch of the replica whose first
    microbatch with room is earliest and cheapest (producers lead their replicas, several cores
    may share one); then items and free pieces, costliest first, each where the load after it
    is lowest: an item inside its window (its producer, or a microbatch of the producer's
    replica holding no core and reading nothing else) while that stays under the target, else
    anywhere its root path can be recomputed (not beside its window) when that is lower.
    Producers run first on their replica, the rest costliest first.  Its windows carry many
    consumers each (long retention); its balance is often the better one when windows are few
    against the replicas.  Returns ``pack_windows``' (packings, bound)."""
    length = ix.length_list
    total = sum(u.cost + u.replay_cost for u in units)
    hi = total / (dp * S) * (1.0 + eps)
    n_bins = dp * S
    rep = [b // S for b in range(n_bins)]
    load = [0.0] * n_bins
    rows = [0] * n_bins
    have: List[set] = [set() for _ in range(n_bins)]
    own_l: List[List[int]] = [[] for _ in range(n_bins)]
    rec_l: List[List[int]] = [[] for _ in range(n_bins)]
    has_core = [False] * n_bins
    reads = [-1] * n_bins                                # the producer a microbatch reads
    reads_trees: List[set] = [set() for _ in range(n_bins)]  # trees whose core a microbatch reads
    recomputes: List[set] = [set() for _ in range(n_bins)]   # trees whose root path it recomputes

    ent: List[list] = [[] for _ in range(n_bins)]  # per microbatch: (unit, extra segments, cost)

    def open_bin(r):
        rep.append(r)
        for lst, v in ((load, 0.0), (rows, 0), (has_core, False), (reads, -1)):
            lst.append(v)
        for lst in (have, reads_trees, recomputes):
            lst.append(set())
        own_l.append([])
        rec_l.append([])
        ent.append([])
        return len(rep) - 1

    def put(b, u, extra_segs, cost):
        ent[b].append((u, extra_segs, cost))
        load[b] += cost
        add = u.own_rows
        for seq in (u.rec, extra_segs):
            for x in seq:
                if x not in have[b]:
                    have[b].add(x)
                    rec_l[b].append(x)
                    add += length[x]
        rows[b] += add
        own_l[b].extend(u.owned)

    core_bin: Dict[int, int] = {}
    after: Dict[int, set] = {}  # a split window's consumer: the producers of its path (other replicas)
    bound = False
    for u in sorted((u for u in units if u.kind == "core"), key=lambda u: -u.cost):
        best = None
        for r in range(dp):
            for k in range(S):
                b = r * S + k
                if reads[b] < 0 and rows[b] + u.rows <= M:
                    if best is None or (k, load[b]) < best[0]:
                        best = ((k, load[b]), b)
                    break
        b = best[1] if best is not None else open_bin(min(range(dp), key=lambda q: rep.count(q)))
        put(b, u, (), u.cost)
        has_core[b] = True
        core_bin[u.win] = b
    for u in sorted((u for u in units if u.kind != "core"), key=lambda u: -(u.cost + u.replay_cost)):
        p = core_bin[u.win] if u.kind == "item" else -1
        win = other = None
        if p >= 0:
            for b in range(len(rep)):
                if rep[b] != rep[p]:
                    continue
                if b == p:
                    c = u.cost
                elif not has_core[b] and reads[b] in (-1, p) and u.tree not in recomputes[b]:
                    c = u.cost + u.replay_cost
                else:
                    continue
                if rows[b] + u.rows <= M and (win is None or load[b] + c < win[0]):
                    win = (load[b] + c, b, c)
        if win is None or win[0] > hi:
            bound = bound or win is not None
            for b in range(len(rep)):
                if p >= 0:
                    if b == p or u.tree in reads_trees[b]:
                        continue
                    extra = sum([length[x] for x in u.path if x not in have[b]])
                    add, c = u.rows + extra, u.cost + u.path_cost * extra / max(1, u.path_rows)
                else:
                    add, c = u.rows - sum([length[x] for x in u.rec if x in have[b]]), u.cost
                if rows[b] + add <= M and (other is None or load[b] + c < other[0]):
                    other = (load[b] + c, b, c)
        if win is not None and (win[0] <= hi or other is None or win[0] <= other[0]):
            _, b, c = win
            put(b, u, (), c)
            if b != p:
                reads[b] = p
                reads_trees[b].add(u.tree)
                if u.upper >= 0:
                    after.setdefault(b, set()).add(core_bin[u.upper])
        elif other is not None:
            _, b, c = other
            put(b, u, u.path if p >= 0 else (), c)
            if p >= 0:
                recomputes[b].add(u.tree)
        elif p >= 0:  # a new consumer of its window
            b = open_bin(rep[p])
            put(b, u, (), u.cost + u.replay_cost)
            reads[b] = p
            reads_trees[b].add(u.tree)
            if u.upper >= 0:
                after.setdefault(b, set()).add(core_bin[u.upper])
        else:
            b = open_bin(min(range(dp), key=lambda q: rep.count(q)))
            put(b, u, (), u.cost)
    return _spread_output(dp, rep, own_l, rec_l, load, has_core, after, ent, bound)


pack_spread = CompiledPacker("l2_pack_spread", _pack_spread_python, doc="""The spreading packer: (packings, bound)
of ``_pack_spread_python``, from the compiled ``_C.l2_pack_spread`` when it is built (the same values).""")
