"""L2's units: what its packers place (cores, items, free pieces of the trees), and split windows.

Invariants: every segment a unit owns is owned by that unit alone (a unit's ``owned`` are its
own; ``rec`` and ``path`` are recomputed rows it reads or recomputes); a tree's units either
form windows (one core per window, its items below it) or are the tree's L1 pieces (free), so
the units of a tree compute no more rows than its L1 pieces did when they form windows.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from itertools import accumulate, chain
from typing import Dict, List, Optional, Tuple

import numpy as np

from .cost_model import CostModel, ForestIndex
from .l1 import split_piece
from .microbatch import MicrobatchPlan

__all__ = ["window_units", "split_windows", "unit_arrays", "most_shared_top"]

#: unit kinds as the compiled packers read them
_KIND = {"core": 0, "item": 1, "free": 2}



def most_shared_top(root: int, count, length, children, M: int) -> List[int]:
    """The most shared top of a tree's shared set that fits ``M`` rows, sorted: from ``root``, the
    segment computed in the most microbatches (``count``) first, its children computed in two or more
    joining the candidates; a segment that does not fit is passed over."""
    top, rows, heap = [], 0, [(-count[root], root)]
    while heap:
        heap.sort()
        _, s = heap.pop(0)
        if rows + length[s] > M:
            continue
        top.append(s)
        rows += length[s]
        heap.extend((-count[c], c) for c in children[s] if count[c] >= 2)
    return sorted(top)

def _segment_costs(ix: ForestIndex, model: CostModel) -> Tuple[List[float], List[float]]:
    """Per segment: (cost owned: rows, attention pairs and logits rows; cost recomputed: rows
    and attention pairs), as plain lists (units are small: list sums beat numpy calls)."""
    c = model.coefficients
    body = c.row * ix.length + c.attention_pair * ix.seg_pairs
    return (body + c.logits_row * ix.seg_logits).tolist(), body.tolist()


class _Unit:
    """What the window packer places: a produced tree's ``core`` (its producer rows), an
    ``item`` (a piece of a subtree hanging below a core: read the core's rows as external
    context, or recompute ``path`` when placed away from the core's window) or a ``free``
    piece (an L1 piece of a tree that keeps recomputation: no external context).

    ``win``: the window a core or item belongs to (the tree's id; a window split off a tree by
    ``split_windows`` has an id of its own, ``upper`` naming the window whose producer owns the
    top of its producer's root path, which that producer recomputes)."""
    __slots__ = ("kind", "tree", "owned", "rec", "rows", "own_rows", "cost", "replay_cost", "path", "path_rows",
                 "path_cost", "win", "upper", "replay")

    def __init__(self, kind, tree, owned, rec, rows, own_rows, cost, replay_cost=0.0, path=(), path_rows=0,
                 path_cost=0.0, win=None, upper=-1, replay=0):
        self.kind, self.tree, self.owned, self.rec = kind, tree, owned, rec
        self.replay = replay  # KDA replay tokens of an item read from its producer by a consumer
        self.rows, self.own_rows, self.cost, self.replay_cost = rows, own_rows, cost, replay_cost
        self.path, self.path_rows, self.path_cost = path, path_rows, path_cost
        self.win = tree if win is None else win
        self.upper = upper

    def moved(self, win, upper):
        """This unit in window ``win`` (split off its tree's window ``upper``)."""
        return _Unit(self.kind, self.tree, self.owned, self.rec, self.rows, self.own_rows, self.cost,
                     self.replay_cost, self.path, self.path_rows, self.path_cost, win, upper, self.replay)


def window_units(ix: ForestIndex, l1: MicrobatchPlan, model: CostModel,
                 min_producer_rows: int, item_rows: Optional[int] = None) -> List[_Unit]:
    """Cores, items and free pieces of ``l1`` (steps 1-2 of the module docstring).

    A tree's shared set ``U`` (segments computed in two or more L1 microbatches) is closed
    under ancestors.  Its core is ``U`` when it fits the row budget, else the top of ``U`` that
    fits (most shared segments first).  The subtrees hanging below the core become items (cut
    into pieces of at most ``M`` rows by L1's split, the core's rows counting as external).  A
    tree is produced when its core has at least ``min_producer_rows`` rows and its core plus
    items compute fewer tokens (replay included) than its L1 pieces; else its L1 pieces are
    free units.  ``item_rows``: a subtree of more rows (at most ``M``) is cut into pieces of at
    most that many rows (or its longest path, when longer), its rows above a cut recomputed."""
    M = l1.row_budget
    cut = M if item_rows is None else min(M, int(item_rows))
    S = ix.num_segments
    pieces: Dict[int, List[Tuple[List[int], List[int]]]] = {}
    length, start, par = ix.length_list, ix.start_list, ix.parent
    offs = ix.tree_offsets.tolist()
    tree_of = ix.seg_tree.tolist()
    mbs = l1.microbatches
    ids_all = [m.owned for m in mbs] + [m.recomputed for m in mbs]
    # count[s]: the L1 microbatches computing s; l1_rows[t]: the rows L1 computes of tree t
    count_a = np.bincount(np.concatenate(ids_all), minlength=S) if ids_all else np.zeros(S, dtype=np.int64)
    count = count_a.tolist()
    shared: Dict[int, List[int]] = {}  # per tree its segments computed twice or more, in id order
    for s in np.flatnonzero(count_a >= 2).tolist():
        shared.setdefault(tree_of[s], []).append(s)
    l1_rows = np.add.reduceat(count_a * ix.length, ix.tree_offsets[:-1]).tolist() if S else []
    for m in mbs:
        # a plan's ids are sorted and a tree's segments are one id range: each tree's ids are a run
        per: Dict[int, Tuple[List[int], List[int]]] = {}
        for ids, side in ((m.owned.tolist(), 0), (m.recomputed.tolist(), 1)):
            i, n = 0, len(ids)
            while i < n:
                t = tree_of[ids[i]]
                j = bisect_left(ids, offs[t + 1], i)
                per.setdefault(t, ([], []))[side].extend(ids[i:j])
                i = j
        for t, (o, _) in per.items():
            if o:
                pieces.setdefault(t, []).append(per[t])
    own_c, body_c = _segment_costs(ix, model)
    B = model.chunk_size
    rp = model.coefficients.kda_replay_token
    sub_size, sub_rows = ix.sub_size_list, ix.sub_rows_list
    children = ix.children
    units: List[_Unit] = []
    for t in range(ix.num_trees):
        a = offs[t]
        produced = None
        core = shared.get(t, [])
        if core:
            if sum([length[s] for s in core]) > M:  # the most shared top of U that fits
                core = most_shared_top(a, count, length, children, M)
            inset = set(core)
            core_rows = sum([length[s] for s in core])
            items: List[_Unit] = []
            tokens = core_rows
            # item roots: the segments outside the core whose parent is in it, in id order
            paths: Dict[int, Tuple[List[int], float]] = {}  # an item root's parent -> (root path, its cost)
            for s in sorted([c for x in core for c in children[x] if c not in inset]):
                e = s + sub_size[s]
                got = paths.get(par[s])
                if got is None:
                    path, x = [], par[s]
                    while x >= 0:
                        path.append(x)
                        x = par[x]
                    got = paths[par[s]] = (path, sum([body_c[x] for x in path]))
                path, path_cost = list(got[0]), got[1]
                replay = start[s] % B
                own_rows = sub_rows[s]
                if own_rows <= cut:  # the whole subtree, ids s..e-1 (preorder), nothing recomputed
                    items.append(_Unit("item", t, list(range(s, e)), [], own_rows, own_rows,
                                       sum(own_c[s:e]), rp * replay, path, start[s], path_cost, None,
                                       -1, replay))
                    tokens += own_rows + replay
                    continue
                budget = M + start[s]
                if cut < M and sub_rows[s] <= M:  # cut below the budget: at least its longest path
                    budget = max(cut + start[s], max(start[x] + length[x] for x in range(s, e)))
                for piece in split_piece(ix, list(range(s, e)), [], budget):
                    own, rec = piece[0], piece[1]
                    own_rows = sum([length[x] for x in own])
                    rows = own_rows + sum([length[x] for x in rec])
                    cost = sum([own_c[x] for x in own]) + sum([body_c[x] for x in rec])
                    items.append(_Unit("item", t, sorted(own), sorted(rec), rows, own_rows, cost, rp * replay, path,
                                       start[s], path_cost, replay=replay))
                    tokens += rows + replay
            if core_rows >= min_producer_rows and tokens < l1_rows[t]:
                produced = [_Unit("core", t, core, [], core_rows, core_rows, sum([own_c[x] for x in core]))] + items
        if produced is not None:
            units.extend(produced)
            continue
        for own, rec in pieces.get(t, ()):
            own_rows = sum([length[x] for x in own])
            units.append(_Unit("free", t, own, rec, own_rows + sum([length[x] for x in rec]), own_rows,
                               sum([own_c[x] for x in own]) + sum([body_c[x] for x in rec])))
    return units


def split_windows(ix: ForestIndex, units: List[_Unit], model: CostModel, dp: int,
                  share: float) -> Optional[List[_Unit]]:
    """``units`` with every window costlier than ``share`` of a replica's work (estimated cost
    over ``dp``) cut into ``k = ceil(cost / (share * total / dp))`` windows, for replicas to
    share a tree (None when no window is that costly, or none has a branch point to cut at).

    A cut at a core segment ``c`` (not the root) makes a window of its own: its producer owns
    the core below ``c`` and recomputes ``c``'s root path (so it reads nothing), and the items
    hanging below ``c`` are its consumers' (they read the path from its owner, the tree's
    first window, and the rest from their producer; the schedule takes all of it from their
    producer, whose computed rows hold it).  Cuts are chosen one after the other on what is
    left of the tree's core, each the segment whose window (path included) costs closest to
    the tree's cost over ``k`` (not on an earlier cut's path: every cut's path is owned by the
    first window)."""
    if all(len(u.owned) < 2 for u in units if u.kind == "core"):
        return None  # a cut needs a core segment below its root (Step-wise: every core is the prompt)
    total = sum(u.cost + u.replay_cost for u in units)
    limit = share * total / dp
    wins: Dict[int, List[_Unit]] = {}
    for u in units:
        if u.kind != "free":
            wins.setdefault(u.win, []).append(u)
    if not any(sum(u.cost + u.replay_cost for u in us) > limit for us in wins.values()):
        return None
    own_c, body_c = _segment_costs(ix, model)
    length, par, sub_size = ix.length_list, ix.parent, ix.sub_size_list
    out = [u for u in units if u.kind == "free"]
    key = first_key = ix.num_trees
    for t, us in wins.items():
        W = sum(u.cost + u.replay_cost for u in us)
        k = math.ceil(W / limit) if W > limit else 1
        core = next(u for u in us if u.kind == "core")
        items = [u for u in us if u.kind == "item"]
        rem = set(core.owned)
        pinned = set()  # the paths of the cuts so far: owned by the first window
        for _ in range(k - 1):
            hang: Dict[int, float] = {}
            for u in items:
                hang[u.path[0]] = hang.get(u.path[0], 0.0) + u.cost + u.replay_cost
            order = sorted(rem)
            acc = {x: own_c[x] + hang.get(x, 0.0) for x in order}
            has = {x: x in hang for x in order}
            for x in reversed(order):
                q = par[x]
                if q in rem:
                    acc[q] += acc[x]
                    has[q] = has[q] or has[x]
            pc: Dict[int, float] = {}
            best = None
            for x in order:
                q = par[x]
                pc[x] = pc[q] + body_c[q] if q >= 0 else 0.0
                if q >= 0 and has[x] and x not in pinned:
                    d = abs(acc[x] + pc[x] - W / k)
                    if best is None or d < best[0]:
                        best = (d, x)
            if best is None:
                break
            c = best[1]
            lower = [x for x in order if c <= x < c + sub_size[c]]
            low = set(lower)
            path, x = [], par[c]
            while x >= 0:
                path.append(x)
                x = par[x]
            lower_rows = sum([length[x] for x in lower])
            out.append(_Unit("core", t, lower, sorted(path), lower_rows + sum([length[x] for x in path]), lower_rows,
                             sum([own_c[x] for x in lower]) + sum([body_c[x] for x in path]), win=key))
            out.extend(u.moved(key, t) for u in items if u.path[0] in low)
            items = [u for u in items if u.path[0] not in low]
            rem -= low
            pinned.update(path)
            key += 1
        if len(rem) == len(core.owned):
            out.extend(us)
            continue
        kept = sorted(rem)
        rows = sum([length[x] for x in kept])
        out.append(_Unit("core", t, kept, [], rows, rows, sum([own_c[x] for x in kept])))
        out.extend(items)
    return out if key > first_key else None


def unit_arrays(units: List[_Unit]):
    """``units`` as the compiled packers read them: int64[units, 8] (kind, tree, window, upper
    window, owned rows, replay tokens, path rows, rows), float64[units, 3] (cost, replay cost,
    path cost), owned / recomputed / path segments as CSR (offsets, ids)."""
    nu = len(units)
    ints = np.fromiter(chain.from_iterable([(_KIND[u.kind], u.tree, u.win, u.upper, u.own_rows, u.replay, u.path_rows,
                                             u.rows) for u in units]), dtype=np.int64, count=8 * nu).reshape(nu, 8)
    flts = np.fromiter(chain.from_iterable([(u.cost, u.replay_cost, u.path_cost) for u in units]), dtype=np.float64,
                       count=3 * nu).reshape(nu, 3)

    def csr(lists):
        lens = [0, *accumulate(map(len, lists))]
        return np.array(lens, dtype=np.int64), np.fromiter(chain.from_iterable(lists), dtype=np.int64, count=lens[-1])

    return (ints, flts) + csr([u.owned for u in units]) + csr([u.rec for u in units]) + csr([u.path for u in units])
