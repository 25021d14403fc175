"""L2: cross-microbatch sharing in windows the schedule runs, placed on DP replicas in slots.

Input: an L1 plan.  Its recomputed segments are the shared prefixes (computed in two or more
L1 microbatches).  The window schedule (``microbatch.replica_windows``) reads a consumer's
context only from one earlier microbatch of the same replica that is not itself a consumer,
and recomputes any other, so L2 plans only such windows (every window runs as planned):

1. *Units* (``window_units``): per tree, the shared set ``U`` (closed under ancestors) gives
   a **core**: ``U`` when it fits the row budget, else its most shared top that fits.  The
   subtrees hanging below the core are **items** (cut by L1's split when larger than the
   budget, the core's rows counting as external).  A tree is produced when its core has at
   least ``min_producer_rows`` rows and core plus items compute fewer tokens (KDA replay
   included) than its L1 pieces; else its L1 pieces are **free** units (no external context).
2. *Windows* (``pack_windows``): each produced tree is one window on one replica, the trees
   assigned to replicas largest first to the least-loaded replica (its window cost: core,
   items and replay).  The core goes alone into a fresh microbatch (its producer; one core
   per producer, so a producer's exports are one tree's prefix), its items best-fit into the
   window's microbatches (the producer itself: local rows; or its consumers, later
   microbatches of the replica that read nothing else) under the microbatch target, a new
   consumer opened when none can take one.  Free pieces then go where the load after them
   is lowest.  An item whose window is full while other replicas run short moves there with
   its root path recomputed (no window), when that lowers the slot target it overfills.
3. *Order*: on one replica each producer is followed by its consumers, so a producer's
   exports live only while its own window runs (one core's rows exported at a time).  On
   several, a replica's microbatches run costliest first (the slots line up across replicas),
   each producer moved just before its first consumer.
4. *Candidates*: slot counts from the row bound to ``WINDOW_EXTRA_SLOTS`` above it and the
   target tolerances ``WINDOW_TOLERANCES`` give a few packings; each is estimated from its
   microbatch loads (per-microbatch terms included) and only the best ``ASSEMBLED`` by that
   estimate are assembled into plans and judged exactly.

L2 never computes more tokens than its L1 input, and its plan never has a longer modelled
step (sum over slots of the costliest microbatch) than L1's: the candidate with the shortest
modelled step (then the fewest tokens) among those computing no more tokens than L1 wins,
else (tiny trees where replay outweighs the rows saved; batches so small that a window on one
replica idles the others) the L1 microbatches are returned with L1's placement.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Dict, List, Optional, Tuple

from .cost_model import CostModel, ForestIndex
from .l1 import plan_l1
from .microbatch import MicrobatchPlan, PlanningError, assemble_plan, gc_paused

import numpy as np

__all__ = ["plan_l2", "plan_harts", "window_units", "pack_windows", "window_plan", "step_cost"]

#: the window packer's slot counts above its row bound, and its microbatch target tolerances
WINDOW_EXTRA_SLOTS = 2
WINDOW_TOLERANCES = (0.01, 0.05)
#: packings assembled and judged exactly (the best by their estimated step)
ASSEMBLED = 2


@gc_paused
def plan_l2(forest, l1: MicrobatchPlan, *, cost_model: Optional[CostModel] = None,
            index: Optional[ForestIndex] = None, min_producer_rows: Optional[int] = None) -> MicrobatchPlan:
    """Refine an L1 plan (module docstring).  ``plan_seconds`` counts L2 alone.

    ``min_producer_rows``: a tree's shared prefix shorter than this stays recomputed (default:
    the KDA chunk size).
    """
    t0 = time.perf_counter()
    if l1.mode != "tree":
        raise ValueError("L2 refines a tree-mode (L1) plan")
    model = cost_model or l1.cost_model
    ix = index if index is not None else ForestIndex(forest)
    dp, M = l1.num_replicas, l1.row_budget
    mpr = model.chunk_size if min_producer_rows is None else int(min_producer_rows)
    if model != l1.cost_model:  # judge L1's microbatches with this cost model
        groups = [(m.owned, m.recomputed) for m in l1.microbatches]
        placement = [(m.replica, m.slot) for m in l1.microbatches]
        keep = assemble_plan(ix, groups, placement, planner="harts_l1l2", dp=dp, row_budget=M, cost_model=model)
    else:
        keep = dataclasses.replace(l1, planner="harts_l1l2", windows=list(l1.windows),
                                   microbatches=list(l1.microbatches), slots=l1.slots.copy())
    keep_tokens = keep.tokens_computed
    plan, plan_key = keep, (step_cost(keep), keep_tokens)
    units = window_units(ix, l1, model, mpr)
    if any(u.kind == "core" for u in units):
        S_w = max(1, math.ceil(math.ceil(sum(u.rows for u in units) / M) / dp))
        overhead = model.coefficients.microbatch + model.coefficients.kda_call
        packs = []
        for S in range(S_w, S_w + WINDOW_EXTRA_SLOTS + 1):
            for eps in WINDOW_TOLERANCES:
                packed = pack_windows(ix, units, dp, M, S, eps)
                est = estimate_step(packed, dp, overhead)
                if all(p[0] != est for p in packs):  # the same packing again (tolerance unused)
                    packs.append((est, len(packs), packed))
        packs.sort(key=lambda p: p[:2])
        for _, _, packed in packs[:ASSEMBLED]:
            cand = window_plan(ix, packed, dp=dp, M=M, model=model)
            if cand is None or cand.tokens_computed > keep_tokens:
                continue
            key = (step_cost(cand), cand.tokens_computed)
            if key < plan_key:
                plan, plan_key = cand, key
    plan.plan_seconds = time.perf_counter() - t0
    return plan


def step_cost(plan: MicrobatchPlan) -> float:
    """Modelled step time: sum over slots of the costliest microbatch of the slot."""
    c = plan.cost_matrix()
    return float(c.max(axis=0).sum()) if c.size else 0.0


def plan_harts(forest, dp: int, row_budget: int, *, cost_model: Optional[CostModel] = None,
               index: Optional[ForestIndex] = None, **l2_options) -> Tuple[MicrobatchPlan, MicrobatchPlan]:
    """(L1 plan, L1+L2 plan).  The L1+L2 plan's ``plan_seconds`` includes L1's time."""
    ix = index if index is not None else ForestIndex(forest)
    l1 = plan_l1(forest, dp, row_budget, cost_model=cost_model, index=ix)
    l2 = plan_l2(forest, l1, cost_model=cost_model, index=ix, **l2_options)
    l2.plan_seconds += l1.plan_seconds
    return l1, l2


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
    piece (an L1 piece of a tree that keeps recomputation: no external context)."""
    __slots__ = ("kind", "tree", "owned", "rec", "rows", "cost", "replay_cost", "path", "path_rows",
                 "path_cost")

    def __init__(self, kind, tree, owned, rec, rows, cost, replay_cost=0.0, path=(), path_rows=0,
                 path_cost=0.0):
        self.kind, self.tree, self.owned, self.rec = kind, tree, owned, rec
        self.rows, self.cost, self.replay_cost = rows, cost, replay_cost
        self.path, self.path_rows, self.path_cost = path, path_rows, path_cost


def window_units(ix: ForestIndex, l1: MicrobatchPlan, model: CostModel,
                 min_producer_rows: int) -> List[_Unit]:
    """Cores, items and free pieces of ``l1`` (steps 1-2 of the module docstring).

    A tree's shared set ``U`` (segments computed in two or more L1 microbatches) is closed
    under ancestors.  Its core is ``U`` when it fits the row budget, else the top of ``U`` that
    fits (most shared segments first).  The subtrees hanging below the core become items (cut
    into pieces of at most ``M`` rows by L1's split, the core's rows counting as external).  A
    tree is produced when its core has at least ``min_producer_rows`` rows and its core plus
    items compute fewer tokens (replay included) than its L1 pieces; else its L1 pieces are
    free units."""
    from .l1 import split_piece  # local: l1 imports nothing of l2, the import is cheap
    M = l1.row_budget
    S = ix.num_segments
    count = [0] * S
    tree_of = ix.seg_tree.tolist()
    l1_rows: Dict[int, int] = {}
    pieces: Dict[int, List[Tuple[List[int], List[int]]]] = {}
    length, start, par = ix.length_list, ix.start_list, ix.parent
    for m in l1.microbatches:
        own, rec = m.owned.tolist(), m.recomputed.tolist()
        per: Dict[int, Tuple[List[int], List[int]]] = {}
        for x in own:
            count[x] += 1
            per.setdefault(tree_of[x], ([], []))[0].append(x)
        for x in rec:
            count[x] += 1
            per.setdefault(tree_of[x], ([], []))[1].append(x)
        for t, (o, r) in per.items():
            if o:
                pieces.setdefault(t, []).append((o, r))
            l1_rows[t] = l1_rows.get(t, 0) + sum([length[x] for x in o]) + sum([length[x] for x in r])
    own_c, body_c = _segment_costs(ix, model)
    B = model.chunk_size
    rp = model.coefficients.kda_replay_token
    offs = ix.tree_offsets.tolist()
    sub_size, sub_rows = ix.sub_size_list, ix.sub_rows_list
    children = ix.children
    units: List[_Unit] = []
    for t in range(ix.num_trees):
        a, b = offs[t], offs[t + 1]
        produced = None
        if any(count[s] >= 2 for s in range(a, b)):
            core = [s for s in range(a, b) if count[s] >= 2]
            if sum([length[s] for s in core]) > M:  # the most shared top of U that fits
                core, rows, inset = [], 0, set()
                heap = [(-count[a], a)]
                while heap:
                    heap.sort()
                    _, s = heap.pop(0)
                    if rows + length[s] > M:
                        continue
                    core.append(s)
                    inset.add(s)
                    rows += length[s]
                    heap.extend((-count[c], c) for c in children[s] if count[c] >= 2)
                core.sort()
            inset = set(core)
            core_rows = sum([length[s] for s in core])
            items: List[_Unit] = []
            tokens = core_rows
            for s in range(a, b):
                if s in inset or par[s] not in inset:
                    continue
                segs = list(range(s, s + sub_size[s]))
                parts = [(segs, [])] if sub_rows[s] <= M else \
                    [(p[0], p[1]) for p in split_piece(ix, segs, [], M + start[s])]
                path, x = [], par[s]
                while x >= 0:
                    path.append(x)
                    x = par[x]
                path_cost = sum([body_c[x] for x in path])
                replay = start[s] % B
                for own, rec in parts:
                    rows = sum([length[x] for x in own]) + sum([length[x] for x in rec])
                    cost = sum([own_c[x] for x in own]) + sum([body_c[x] for x in rec])
                    items.append(_Unit("item", t, sorted(own), sorted(rec), rows, cost, rp * replay, path,
                                       start[s], path_cost))
                    tokens += rows + replay
            if core_rows >= min_producer_rows and tokens < l1_rows.get(t, 0):
                produced = [_Unit("core", t, core, [], core_rows, sum([own_c[x] for x in core]))] + items
        if produced is not None:
            units.extend(produced)
            continue
        for own, rec in pieces.get(t, ()):
            rows = sum([length[x] for x in own]) + sum([length[x] for x in rec])
            units.append(_Unit("free", t, own, rec, rows, sum([own_c[x] for x in own]) +
                               sum([body_c[x] for x in rec])))
    return units


def pack_windows(ix: ForestIndex, units: List[_Unit], dp: int, M: int, S: int, eps: float = 0.01):
    """Place ``units`` into microbatches on ``dp`` replicas so that every window runs as the
    schedule runs it (``replica_windows``), with a microbatch target of the estimated cost over
    ``dp * S`` times ``1 + eps`` (none on one replica, where microbatches are filled by rows).

    Windows (a produced tree's core and items) go largest first to the replica with the least
    load so far.  The core opens the window's producer (one core per producer); its items,
    costliest first, go best-fit into the window's microbatches under the target (most loaded
    that takes them; one replica: fullest by rows), a new consumer opened when none can take
    one.  When the replica would pass its share of the step (``S`` targets) while another
    replica, after the item's root path is recomputed, would not, the item goes there
    instead (best fit, else a new microbatch when item and path fit the budget), reading nothing.  Free pieces last: best fit
    under the target, else a new microbatch on the least-loaded replica (one replica: first
    fit by rows).  Order: one replica, each producer followed by its consumers (costliest
    first), then the microbatches of no window; several, costliest first per replica, each
    producer moved just before its first consumer.

    Returns (groups, placement, loads): ``groups`` (owned, recomputed) and ``placement``
    (replica, slot) for ``assemble_plan``; ``loads[r]`` the estimated costs of replica ``r``'s
    microbatches in slot order."""
    length = ix.length_list
    total = sum(u.cost + u.replay_cost for u in units)
    tau = total / (dp * S)
    hi = tau * (1.0 + eps) if dp > 1 else math.inf
    cap = S * hi  # a replica's share of the step
    rep: List[int] = []        # per microbatch: its replica
    load: List[float] = []
    rows: List[int] = []
    have: List[set] = []
    own_l: List[List[int]] = []
    rec_l: List[List[int]] = []
    window_of: List[int] = []  # the tree whose window a microbatch belongs to (-1: none)
    total_r = [0.0] * dp
    blocks: List[List[List[int]]] = [[] for _ in range(dp)]  # per replica: [producer, consumers...]
    loose: List[List[int]] = [[] for _ in range(dp)]         # per replica: microbatches of no window

    def open_bin(r, tree):
        rep.append(r)
        load.append(0.0)
        rows.append(0)
        have.append(set())
        own_l.append([])
        rec_l.append([])
        window_of.append(tree)
        return len(rep) - 1

    def put(b, u, extra_segs, cost):
        load[b] += cost
        total_r[rep[b]] += cost
        hb = have[b]
        add = 0
        for x in u.owned:
            if x not in hb:
                hb.add(x)
                add += length[x]
        for seq in (u.rec, extra_segs):
            for x in seq:
                if x not in hb:
                    hb.add(x)
                    rec_l[b].append(x)
                    add += length[x]
        rows[b] += add
        own_l[b].extend(u.owned)

    def path_extra(u, b):
        """Rows and cost the root path of item ``u`` adds to microbatch ``b``."""
        extra = sum([length[x] for x in u.path if x not in have[b]])
        return extra, u.path_cost * extra / max(1, u.path_rows)

    def best_fit(cands, u, cost_of, add_of):
        best, best_key = -1, None
        for b in cands:
            c = cost_of(b)
            if rows[b] + add_of(b) > M or load[b] + c > hi:
                continue
            key = rows[b] if dp == 1 else load[b]
            if best < 0 or key > best_key:
                best, best_key = b, key
        return best

    windows: Dict[int, List[_Unit]] = {}
    free: List[_Unit] = []
    for u in units:
        if u.kind == "free":
            free.append(u)
        else:
            windows.setdefault(u.tree, []).append(u)
    order = sorted(windows, key=lambda t: -sum(u.cost + u.replay_cost for u in windows[t]))
    for t in order:
        us = windows[t]
        core = next(u for u in us if u.kind == "core")
        r = min(range(dp), key=lambda q: total_r[q])
        p = open_bin(r, t)
        put(p, core, (), core.cost)
        block = [p]
        blocks[r].append(block)
        items = sorted((u for u in us if u.kind == "item"), key=lambda u: -(u.cost + u.replay_cost))
        for u in items:
            b = best_fit(block, u, lambda x: u.cost if x == p else u.cost + u.replay_cost, lambda x: u.rows)
            c = u.cost if b == p else u.cost + u.replay_cost
            if dp > 1 and total_r[r] + c > cap:  # past the replica's share: elsewhere, path recomputed?
                r2 = min(range(dp), key=lambda q: total_r[q])
                if r2 != r and total_r[r2] + u.cost + u.path_cost < total_r[r] + c:
                    cands = [x for x in range(len(rep)) if rep[x] == r2]
                    b2 = best_fit(cands, u, lambda x: u.cost + path_extra(u, x)[1],
                                  lambda x: u.rows + path_extra(u, x)[0])
                    if b2 < 0 and u.rows + u.path_rows <= M:
                        b2 = open_bin(r2, -1)
                        loose[r2].append(b2)
                    if b2 >= 0:
                        put(b2, u, u.path, u.cost + path_extra(u, b2)[1])
                        continue
            if b < 0:
                b = open_bin(r, t)
                block.append(b)
                c = u.cost + u.replay_cost
            put(b, u, (), c)
    for u in sorted(free, key=lambda u: -u.cost):
        b = best_fit(range(len(rep)), u, lambda x: u.cost,
                     lambda x: u.rows - sum([length[y] for y in u.rec if y in have[x]]))
        if b < 0:
            r = min(range(dp), key=lambda q: total_r[q])
            b = open_bin(r, -1)
            loose[r].append(b)
        put(b, u, (), u.cost)
    groups, placement, loads = [], [], []
    for r in range(dp):
        seq = []
        for block in blocks[r]:
            seq.append(block[0])
            seq.extend(sorted(block[1:], key=lambda b: -load[b]))
        seq.extend(sorted(loose[r], key=lambda b: -load[b]))
        seq = [b for b in seq if own_l[b]]
        if dp > 1:  # costliest first (slots line up across replicas), a producer before its consumers
            prod = {block[0] for block in blocks[r]}
            srt = sorted(seq, key=lambda b: -load[b])
            seq, done = [], set()
            for b in srt:
                if b in done:
                    continue
                t = window_of[b]
                if t >= 0 and b not in prod:
                    pb = next(bl[0] for bl in blocks[r] if window_of[bl[0]] == t)
                    if pb not in done:
                        seq.append(pb)
                        done.add(pb)
                seq.append(b)
                done.add(b)
        for k, b in enumerate(seq):
            groups.append((np.asarray(sorted(own_l[b]), dtype=np.int64),
                           np.asarray(sorted(rec_l[b]), dtype=np.int64)))
            placement.append((r, k))
        loads.append([load[b] for b in seq])
    return groups, placement, loads


def estimate_step(packed, dp: int, overhead: float) -> float:
    """Estimated step of ``pack_windows``' result: per slot the costliest microbatch, every
    microbatch paying ``overhead`` (the per-microbatch terms the unit costs leave out)."""
    loads = packed[2]
    S = max((len(l) for l in loads), default=0)
    return sum(max(l[k] + overhead if k < len(l) else 0.0 for l in loads) for k in range(S))


def window_plan(ix: ForestIndex, packed, *, dp: int, M: int, model: CostModel) -> Optional[MicrobatchPlan]:
    """``pack_windows``' result assembled (None when a microbatch exceeds the budget)."""
    try:
        return assemble_plan(ix, packed[0], packed[1], planner="harts_l1l2", dp=dp, row_budget=M, cost_model=model)
    except PlanningError:
        return None
