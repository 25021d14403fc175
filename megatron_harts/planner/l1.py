"""L1: compression-oriented microbatches under a row budget (within-microbatch sharing only).

1. Split.  A tree whose rows fit the budget ``M`` is one piece.  A larger tree is cut into
   pieces bottom-up: at a segment ``s`` whose subtree with its root path does not fit
   (``start[s] + sub_rows[s] > M``), the pieces of its children (a child subtree that fits is
   one piece) are packed first-fit-decreasing into as few groups as possible, each holding at
   most ``M - start[s] - len(s)`` rows below ``s``; every group then contains ``s`` — owned by
   the first (largest) group, recomputed in the others.  Deep merges save the most shared rows
   (a merge at depth ``p`` saves ``p`` rows) and happen first.  Every piece is a set of whole
   segments closed under ancestors (its root path is in it) with at most ``M`` rows.
2. Pack.  Pieces are packed first-fit-decreasing by rows to find the microbatch count ``n``,
   then spread over ``K = dp * ceil(n / dp)`` microbatches worst-fit-decreasing by cost (each
   piece to the cheapest microbatch with room), so every replica gets the same number of
   microbatches of similar cost.
3. Place.  Microbatches sorted by cost fill slot after slot (``place_sorted``).

The recomputed segments of an L1 plan are exactly the shared prefixes that are candidates for
producers: L2 decides which of them become producers.

Steps 1-2 with the choice among the ``SPLIT_FACTORS`` variants run in the compiled ``_C.l1_plan``
when built (``_plan_compiled``); ``_plan_python`` is its reference (tests hold the two equal).
"""
from __future__ import annotations

import heapq
import time
from itertools import accumulate, chain
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .compiled import compiled
from .cost_model import CostFeatures, CostModel, ForestIndex
from .microbatch import MicrobatchPlan, assemble_plan, check_budget, check_dp, gc_paused, place_sorted

__all__ = ["plan_l1", "split_tree", "pack_pieces", "Piece"]

# a piece: (owned segments, recomputed segments, rows)
Piece = Tuple[List[int], List[int], int]

#: balance splits L1 tries (dp > 1): a piece costing more than this times the mean microbatch
#: cost is split; ``None`` splits only to reach ``K`` pieces.  L1 keeps the variant with the
#: shortest modelled step (sum over slots of the costliest microbatch).
SPLIT_FACTORS = (None, 1.5, 1.1, 1.05)

_MB_FEATURES = compiled("microbatch_features")
_L1_PLAN = compiled("l1_plan")


def split_tree(ix: ForestIndex, tree: int, M: int) -> List[Piece]:
    """Pieces of ``tree`` under budget ``M`` (step 1 of the module docstring).

    Invariant: the owned sets partition the tree's segments; each piece's segments are closed
    under ancestors; each piece has at most ``M`` rows.  Assumes ``check_budget`` passed.
    """
    r = int(ix.tree_offsets[tree])
    end = int(ix.tree_offsets[tree + 1])
    if int(ix.sub_rows[r]) <= M:
        return [(list(range(r, end)), [], int(ix.sub_rows[r]))]
    # a whole tree: the forest's subtree sums and children, subtrees are id ranges
    sub_rows, sub_size = ix.sub_rows_list, ix.sub_size_list

    def whole(x):
        return (list(range(x, x + sub_size[x])), [], sub_rows[x])

    return _split(ix, range(end - 1, r - 1, -1), ix.children, sub_rows, {r}, set(), whole, M)


def piece_depth(ix: ForestIndex, piece: Piece) -> int:
    """Rows of the longest root path inside a piece (the least budget that can split it)."""
    start, length = ix.start_list, ix.length_list
    return max([start[x] + length[x] for x in chain(piece[0], piece[1])])


def split_piece(ix: ForestIndex, owned: List[int], rec: List[int], M: int) -> List[Piece]:
    """Cut an ancestor-closed segment set (``owned`` + ``rec``, one tree) into pieces of at most
    ``M`` rows; segments recomputed in the input stay recomputed in every output piece.

    Invariant: output owned sets partition ``owned``; every piece is ancestor-closed; requires
    ``M >= piece_depth``.
    """
    segs = sorted(owned + rec)
    inset = set(segs)
    recset = set(rec)
    par, length = ix.parent, ix.length_list
    kids: Dict[int, List[int]] = {s: [] for s in segs}
    subr = {s: length[s] for s in segs}
    for s in reversed(segs):
        p = par[s]
        if p in inset:
            subr[p] += subr[s]
    for s in segs:
        p = par[s]
        if p in inset:
            kids[p].append(s)

    def whole(s):
        out, stack = [], [s]
        while stack:
            x = stack.pop()
            out.append(x)
            stack.extend(kids[x])
        own = [x for x in out if x not in recset]
        return (own, [x for x in out if x in recset], subr[s])

    roots = {s for s in segs if par[s] not in inset}
    return _split(ix, reversed(segs), kids, subr, roots, recset, whole, M)


def _split(ix: ForestIndex, desc, kids, subr, roots, recset, whole, M: int) -> List[Piece]:
    """The bottom-up cut of ``split_piece`` over segments ``desc`` (decreasing ids: children
    first) with their in-set children ``kids[s]``, in-set subtree rows ``subr[s]``, the set's
    ``roots``, its recomputed segments and ``whole(s)`` (the piece of a subtree that fits)."""
    start, length = ix.start_list, ix.length_list
    result: List[Piece] = []
    groups = {}
    for s in desc:
        if start[s] + subr[s] <= M:
            if s in roots:
                result.append(whole(s))
            continue
        items = []
        for c in kids[s]:
            items.extend([whole(c)] if start[c] + subr[c] <= M else groups.pop(c))
        ls = length[s]
        cap = M - start[s] - ls
        items.sort(key=lambda g: -g[2])
        bins: List[list] = []
        loads: List[int] = []
        for it in items:
            for j in range(len(bins)):
                if loads[j] + it[2] <= cap:
                    bins[j].append(it)
                    loads[j] += it[2]
                    break
            else:
                if it[2] > cap:
                    raise AssertionError(f"a piece of {it[2]} rows does not fit under segment {s}")
                bins.append([it])
                loads.append(it[2])
        if not bins:
            raise AssertionError(f"segment {s}: {start[s] + ls} rows on its path exceed the budget {M}")
        out = []
        for j, b in enumerate(bins):
            own = [x for it in b for x in it[0]]
            rc = [x for it in b for x in it[1]]
            (own if (j == 0 and s not in recset) else rc).append(s)
            out.append((own, rc, ls + loads[j]))
        if s in roots:
            result.extend(out)
        else:
            groups[s] = out
    return result


def _ffd_count(sizes: Sequence[int], cap: int) -> int:
    """Bins first-fit-decreasing needs (sizes <= cap)."""
    loads: List[int] = []
    for x in sorted(sizes, reverse=True):
        for j in range(len(loads)):
            if loads[j] + x <= cap:
                loads[j] += x
                break
        else:
            loads.append(x)
    return len(loads)


def pack_pieces(rows: Sequence[int], costs: Sequence[float], dp: int, M: int,
                min_bins: Optional[int] = None) -> List[List[int]]:
    """Spread pieces over a multiple of ``dp`` bins: worst-fit decreasing by cost under the row
    budget (step 2).  Returns the bins as lists of piece indices (some may be empty)."""
    n = len(rows)
    if n == 0:
        return []
    count = min_bins if min_bins is not None else _ffd_count(rows, M)
    K = dp * max(1, -(-count // dp))
    order = sorted(range(n), key=lambda i: (-costs[i], -rows[i]))
    while True:
        heap = [(0.0, j) for j in range(K)]
        bins: List[List[int]] = [[] for _ in range(K)]
        brows = [0] * K
        ok = True
        for i in order:
            aside = []
            while heap:
                load, j = heapq.heappop(heap)
                if brows[j] + rows[i] <= M:
                    bins[j].append(i)
                    brows[j] += rows[i]
                    heapq.heappush(heap, (load + costs[i], j))
                    break
                aside.append((load, j))
            else:
                ok = False
            for a in aside:
                heapq.heappush(heap, a)
            if not ok:
                break
        if ok:
            return bins
        K += dp


def _piece_cost(ix: ForestIndex, model: CostModel, piece: Piece) -> float:
    """Cost of a piece without the per-microbatch overhead (additive across pieces)."""
    own = np.asarray(piece[0], dtype=np.int64)
    comp = np.sort(np.concatenate((own, np.asarray(piece[1], dtype=np.int64))) if piece[1] else own)  # disjoint
    return model.cost(model.features(ix, comp, own)) - model.coefficients.microbatch


def _piece_costs(ix: ForestIndex, model: CostModel, pieces: Sequence[Piece]) -> List[float]:
    """``_piece_cost`` of every piece, the features of all of them in one call of the compiled
    ``_C.microbatch_features`` when built (the id lists read into two flat arrays in one pass each),
    else ``_piece_costs_python`` (the same floats; tests hold them equal)."""
    if _MB_FEATURES is not None and pieces:
        comps = [sorted(p[0] + p[1]) for p in pieces]
        comp_n = [0, *accumulate(map(len, comps))]
        own_n = [0, *accumulate([len(p[0]) for p in pieces])]
        out = _MB_FEATURES(ix.parent_arr, ix.start, ix.length, ix.seg_pairs, ix.seg_logits,
                           np.array(comp_n, dtype=np.int64),
                           np.fromiter(chain.from_iterable(comps), dtype=np.int64, count=comp_n[-1]),
                           np.array(own_n, dtype=np.int64),
                           np.fromiter(chain.from_iterable([p[0] for p in pieces]), dtype=np.int64,
                                       count=own_n[-1]), model.chunk_size)
        mb = model.coefficients.microbatch
        return [model.cost(CostFeatures(*row)) - mb for row in out.tolist()]
    return _piece_costs_python(ix, model, pieces)


def _piece_costs_python(ix: ForestIndex, model: CostModel, pieces: Sequence[Piece]) -> List[float]:
    """Reference of ``_piece_costs``: the features of every piece from ``CostModel.features_many``."""
    owns, comps = [], []
    for p in pieces:
        own = np.asarray(p[0], dtype=np.int64)
        owns.append(own)
        comps.append(np.sort(np.concatenate((own, np.asarray(p[1], dtype=np.int64))) if p[1] else own))
    mb = model.coefficients.microbatch
    return [model.cost(f) - mb for f in model.features_many(ix, comps, owns)]


def balance_pieces(ix: ForestIndex, model: CostModel, pieces: List[Piece], dp: int,
                   M: int, factor: Optional[float] = None,
                   costs: Optional[List[float]] = None,
                   memo: Optional[dict] = None) -> Tuple[List[Piece], List[float], int]:
    """Split the costliest pieces until there are at least ``K`` (a multiple of ``dp``) pieces
    and, when ``dp > 1`` and ``factor`` is given, none costs more than ``factor`` times the
    mean microbatch cost ``total / K``.

    A split recomputes the shared ancestors of the parts (``split_piece`` at about half the
    piece's rows), so it costs compression: it happens only where balance needs it.  Returns
    the pieces, their costs and ``K``.  ``memo`` (a dict shared by calls on the same forest
    and model) keeps each split and its parts' costs: the variants of ``plan_l1`` split the
    same pieces.
    """
    memo = {} if memo is None else memo
    costs = list(costs) if costs is not None else _piece_costs(ix, model, pieces)
    K = dp * max(1, -(-_ffd_count([p[2] for p in pieces], M) // dp))
    stuck = [False] * len(pieces)
    for _ in range(8 * K + 8 * len(pieces)):
        cand = -1
        for i in range(len(pieces)):
            if not stuck[i] and (cand < 0 or costs[i] > costs[cand]):
                cand = i
        if cand < 0:
            break
        tau = sum(costs) / K
        if len(pieces) >= K and (dp == 1 or factor is None or costs[cand] <= factor * tau):
            break
        p = pieces[cand]
        key = (tuple(p[0]), tuple(p[1]))
        got = memo.get(key)
        if got is None:
            m = max(piece_depth(ix, p), -(-p[2] // 2))
            parts = split_piece(ix, p[0], p[1], m) if m < p[2] else [p]
            got = memo[key] = (parts, _piece_costs(ix, model, parts) if len(parts) >= 2 else [])
        parts, part_costs = got
        if len(parts) < 2:
            stuck[cand] = True
            continue
        pieces[cand:cand + 1] = parts
        costs[cand:cand + 1] = part_costs
        stuck[cand:cand + 1] = [False] * len(parts)
    return pieces, costs, K


@gc_paused
def plan_l1(forest, dp: int, row_budget: int, *, cost_model: Optional[CostModel] = None,
            index: Optional[ForestIndex] = None) -> MicrobatchPlan:
    """L1 plan of ``forest`` on ``dp`` replicas with at most ``row_budget`` rows per microbatch.

    Raises ``PlanningError`` naming the tree and the budget when some trajectory cannot fit.
    """
    t0 = time.perf_counter()
    model = cost_model or CostModel()
    ix = index if index is not None else ForestIndex(forest)
    dp = check_dp(dp)
    M = check_budget(ix, row_budget)
    out = _plan_compiled(ix, model, dp, M)
    if out is None:
        out = _plan_python(ix, model, dp, M)
    groups, placement = out
    plan = assemble_plan(ix, groups, placement, planner="harts_l1", dp=dp, row_budget=M, cost_model=model)
    plan.plan_seconds = time.perf_counter() - t0
    return plan


def _compiled_model(model: CostModel) -> bool:
    """Whether the compiled core computes ``model``'s costs (``CostModel.cost`` on float coefficients)."""
    c = model.coefficients
    return type(model).cost is CostModel.cost and all(
        type(x) is float for x in (c.microbatch, c.row, c.attention_pair, c.kda_call, c.kda_replay_token, c.logits_row))


def _plan_compiled(ix: ForestIndex, model: CostModel, dp: int, M: int):
    """``_plan_python``'s (groups, placement) from ``_C.l1_plan`` (the same values; tests hold them
    equal), or None when it is not built or does not take ``model``."""
    if _L1_PLAN is None or not _compiled_model(model):
        return None
    c = model.coefficients
    coef = np.array([c.microbatch, c.row, c.attention_pair, c.kda_call, c.kda_replay_token, c.logits_row],
                    dtype=np.float64)
    factors = np.array([-1.0 if f is None else float(f) for f in SPLIT_FACTORS], dtype=np.float64)
    own_off, own, rec_off, rec, place = _L1_PLAN(ix.parent_arr, ix.start, ix.length, ix.seg_pairs, ix.seg_logits,
                                                  ix.tree_offsets, coef, model.chunk_size, dp, M, factors)
    oo, ro = own_off.tolist(), rec_off.tolist()
    groups = [(own[oo[j]:oo[j + 1]], rec[ro[j]:ro[j + 1]]) for j in range(len(oo) - 1)]
    return groups, [tuple(p) for p in place.tolist()]


def _plan_python(ix: ForestIndex, model: CostModel, dp: int, M: int):
    """Reference of ``_plan_compiled``: steps 1-2 of the module docstring for every variant of
    ``SPLIT_FACTORS``, the one with the shortest modelled step kept (then the fewest rows);
    returns its (groups, placement)."""
    base: List[Piece] = []
    for t in range(ix.num_trees):
        base.extend(split_tree(ix, t, M))
    base_costs = _piece_costs(ix, model, base)
    best = None
    memo: dict = {}
    tried = set()  # the variants' piece lists (by identity: the memo keeps each split's parts)
    for factor in (SPLIT_FACTORS if dp > 1 else (None,)):
        pieces, costs, K = balance_pieces(ix, model, list(base), dp, M, factor, base_costs, memo)
        ident = tuple(map(id, pieces))
        if ident in tried:  # the same pieces as an earlier variant: the same bins, not better
            continue
        tried.add(ident)
        rows = [p[2] for p in pieces]
        bins = pack_pieces(rows, costs, dp, M, min_bins=K)
        loads = [sum(costs[i] for i in b) + (model.coefficients.microbatch if b else 0.0) for b in bins]
        placement = place_sorted(loads, dp)
        slot_max: dict = {}
        for (r, k), c in zip(placement, loads):
            slot_max[k] = max(slot_max.get(k, 0.0), c)
        key = (sum(slot_max.values()), sum(rows))
        if best is None or key < best[0]:
            best = (key, pieces, bins, placement)
    _, pieces, bins, placement = best
    groups = []
    for b in bins:
        owned = [x for i in b for x in pieces[i][0]]
        rec = [x for i in b for x in pieces[i][1]]
        groups.append((np.asarray(owned, dtype=np.int64), np.asarray(rec, dtype=np.int64)))
    return groups, placement
