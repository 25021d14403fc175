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
   assigned largest first (core, items and replay) to the least-loaded replica.  The core
   goes alone into a fresh microbatch (its producer; one core per producer, so a producer's
   exports are one tree's prefix), its items best-fit into the window's microbatches (the
   producer itself: local rows; or its consumers, later microbatches of the replica that
   read nothing else) under the microbatch target, a new consumer opened when none can take
   one.  An item that would push its replica past its share of the step goes to the
   least-loaded replica with its root path recomputed (no window) when that replica ends
   lower.  Free pieces last, best fit under the target.  On several replicas with few
   windows (at most ``WINDOW_SPLIT_PER_REPLICA`` per replica), the units are also packed with
   the windows costlier than a part (``WINDOW_SPLIT_SHARES``) of a replica's work split
   (``split_windows``; packed by the spreading packer): a cut at a branch point of the core
   makes a second window, whose producer recomputes the path above the cut (it reads
   nothing) and owns the core below it, and whose consumers (the items below the cut) read
   that producer's rows; a replica then computes the shared top once per window instead of
   once per microbatch.  The plan names the path's owner (the tree's first window, on another
   replica, run in an earlier slot: those producers lead their replicas) as a producer of
   those consumers too; the schedule reads all of their context from their own producer,
   which computes it.  One replica: everything by rows (fullest first), and a free piece
   that fits nowhere puts its top into the spare rows of a microbatch that reads nothing,
   the rest reading it from the next microbatch.
3. *Variants* (several replicas): the packing as it is; its windows leveled (a window's
   items spread over its microbatches, largest first to the least loaded); its light
   microbatches (under half the target, producing for nobody) dissolved into others under
   the target (items of a window into the window, else with their root path recomputed);
   both.
4. *Order*: on one replica each producer is followed by its consumers, so a producer's
   exports live only while its own window runs (one core's rows exported at a time).  On
   several, a replica's microbatches run costliest first (the slots line up across replicas),
   each producer moved just before its first consumer.
5. *Candidates*: slot counts from the row bound to ``WINDOW_EXTRA_SLOTS`` above it and the
   target tolerances ``WINDOW_TOLERANCES`` (a larger one skipped where the smaller turned
   nothing away) give a few packings; on several replicas the spreading packer
   (``pack_spread``: cores lead their replicas, several to a producer, items wherever the
   load is lowest) adds its own.  Each is estimated from its microbatch loads (per-microbatch
   terms included); on several replicas the best few are also refined by the balance pass
   (``rebalance``: a local search moving and swapping units and whole windows toward even
   slots, never computing more tokens).  Only the best ``ASSEMBLED`` by that estimate that
   compute no more tokens than L1 (and a refined one no more than the packing it refines)
   are judged exactly.

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
from .compiled import compiled
from .microbatch import MicrobatchPlan, PlanningError, assemble_plan, gc_paused

__all__ = ["plan_l2", "plan_harts", "window_units", "split_windows", "pack_windows", "pack_spread", "window_plan",
           "step_cost"]

#: the window packer's slot counts above its row bound, and its microbatch target tolerances
WINDOW_EXTRA_SLOTS = 2
WINDOW_TOLERANCES = (0.01, 0.05)
#: ``split_windows``' shares: a window costlier than this part of a replica's work is split
WINDOW_SPLIT_SHARES = (0.5, 0.35)
#: windows are split only when there are at most this many per replica (more balance as they are)
WINDOW_SPLIT_PER_REPLICA = 2.5
#: packings judged exactly (the best by their estimated step that compute no more tokens than
#: L1; at most twice as many are assembled)
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
    if dp == 1 or any(u.kind == "core" for u in units):  # one replica: free pieces may fill spare rows
        unit_sets = [units]
        n_windows = sum(u.kind == "core" for u in units)
        if 1 < dp and n_windows <= WINDOW_SPLIT_PER_REPLICA * dp:  # few windows: split the costliest
            for share in WINDOW_SPLIT_SHARES:
                split = split_windows(ix, units, model, dp, share)
                if split is not None:
                    unit_sets.append(split)
        overhead = model.coefficients.microbatch + model.coefficients.kda_call
        packs = []
        for us in unit_sets:
            S_w = max(1, math.ceil(math.ceil(sum(u.rows for u in us) / M) / dp))
            # one replica: no target (every slot count packs the same); several: the spreading
            # packer too, and a larger tolerance only where the smaller one turned a placement away
            # (split windows: the spreading packer alone; the window packer's plans of them lost
            # to it on every benchmark batch)
            arrays = unit_arrays(us) if dp > 1 and _SPREAD is not None else None
            for packer in (pack_windows,) if dp == 1 else (pack_spread,) if us is not units else \
                    (pack_windows, pack_spread):
                for S in range(S_w, S_w + WINDOW_EXTRA_SLOTS + 1 if dp > 1 else S_w + 1):
                    bound = True
                    for eps in WINDOW_TOLERANCES:
                        if not bound:
                            break  # the target turned nothing away: a larger one packs the same
                        packings, bound = packer(ix, us, dp, M, S, eps, arrays) if packer is pack_spread else \
                            packer(ix, us, dp, M, S, eps)
                        for packed in packings:
                            est = estimate_step(packed, dp, overhead)
                            if all(p[0] != est for p in packs):  # the same packing again (tolerance unused)
                                packs.append((est, len(packs), packed))
        packs.sort(key=lambda p: p[:2])
        refined = {}  # a refined packing -> the packing it refines
        if dp > 1 and BALANCE_MOVES and packs:  # the best packings evened out per slot
            k = BALANCE_PACKINGS[len(packs[0][2][0]) >= BALANCE_MORE_BINS]
            for _, _, packed in packs[:k]:
                even = rebalance(ix, packed, dp, M, overhead)
                if even is not None:
                    refined[id(even)] = packed
                    packs.append((estimate_step(even, dp, overhead), len(packs), even))
            packs.sort(key=lambda p: p[:2])
        assembled = {}

        def assemble(packed):
            if id(packed) not in assembled:
                assembled[id(packed)] = window_plan(ix, packed, dp=dp, M=M, model=model)
            return assembled[id(packed)]

        judged = 0
        for _, _, packed in packs[:2 * ASSEMBLED]:
            if judged == ASSEMBLED:
                break
            cand = assemble(packed)
            if cand is None or cand.tokens_computed > keep_tokens:
                continue  # not a candidate: the next packing by estimate is assembled instead
            if id(packed) in refined:  # the balance pass never computes more tokens (exactly)
                src = assemble(refined[id(packed)])
                if src is not None and cand.tokens_computed > src.tokens_computed:
                    continue
            judged += 1
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
                    own_rows = sum([length[x] for x in own])
                    rows = own_rows + sum([length[x] for x in rec])
                    cost = sum([own_c[x] for x in own]) + sum([body_c[x] for x in rec])
                    items.append(_Unit("item", t, sorted(own), sorted(rec), rows, own_rows, cost, rp * replay, path,
                                       start[s], path_cost, replay=replay))
                    tokens += rows + replay
            if core_rows >= min_producer_rows and tokens < l1_rows.get(t, 0):
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


def pack_windows(ix: ForestIndex, units: List[_Unit], dp: int, M: int, S: int, eps: float = 0.01):
    """Place ``units`` into microbatches on ``dp`` replicas so that every window runs as the
    schedule runs it (``replica_windows``), with a microbatch target of the estimated cost over
    ``dp * S`` times ``1 + eps`` (none on one replica, where microbatches are filled by rows):
    steps 2-4 of the module docstring.

    Returns (packings, bound): every packing as (groups, placement, loads), ``groups`` (owned,
    recomputed) and ``placement`` (replica, slot) for ``assemble_plan``, ``loads[r]`` the
    estimated costs of replica ``r``'s microbatches in slot order; on several replicas also
    the packing leveled, with its light microbatches dissolved, and both (``_dissolve``,
    window leveling).  ``bound``: whether the target shaped a packing (else every target gives
    the same)."""
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
    window_of: List[int] = []  # the window a microbatch belongs to (-1: none)
    units_of: List[List[_Unit]] = []
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
        units_of.append([])
        return len(rep) - 1

    def put(b, u, extra_segs, cost):
        """Unit ``u`` into microbatch ``b``, recomputing ``extra_segs`` too.  ``have[b]`` holds the
        recomputed segments only (a unit's own segments are its alone, so another unit
        recomputing one of them counts its rows twice: an overestimate the plan's assembly
        drops)."""
        units_of[b].append((u, extra_segs, cost))
        load[b] += cost
        total_r[rep[b]] += cost
        add = u.own_rows
        if u.rec or extra_segs:
            hb = have[b]
            rb = rec_l[b]
            for seq in (u.rec, extra_segs):
                for x in seq:
                    if x not in hb:
                        hb.add(x)
                        rb.append(x)
                        add += length[x]
        rows[b] += add
        own_l[b].extend(u.owned)

    def path_extra(u, b):
        """Rows and cost the root path of item ``u`` adds to microbatch ``b``."""
        extra = sum([length[x] for x in u.path if x not in have[b]])
        return extra, u.path_cost * extra / max(1, u.path_rows)

    bound = False  # whether the target turned a placement away (else other targets pack the same)

    def best_fit(cands, u, cost_of, add_of):
        nonlocal bound
        best, best_key = -1, None
        for b in cands:
            c = cost_of(b)
            if rows[b] + add_of(b) > M:
                continue
            if load[b] + c > hi:
                bound = True
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
            windows.setdefault(u.win, []).append(u)
    win_tree = {w: us[0].tree for w, us in windows.items()}
    win_tree[-1] = -1
    has_upper = any(u.upper >= 0 for u in units)
    order = sorted(windows, key=lambda t: -sum(u.cost + u.replay_cost for u in windows[t]))
    for t in order:
        us = windows[t]
        core = next(u for u in us if u.kind == "core")
        r = total_r.index(min(total_r))
        p = open_bin(r, t)
        put(p, core, (), core.cost)
        block = [p]
        blocks[r].append(block)
        items = sorted((u for u in us if u.kind == "item"), key=lambda u: -(u.cost + u.replay_cost))
        for u in items:
            b, bk = -1, 0.0  # best_fit over the window's microbatches, inline
            cu, cr, ur = u.cost, u.cost + u.replay_cost, u.rows
            for x in block:
                if rows[x] + ur > M:
                    continue
                lx = load[x] + (cu if x == p else cr)
                if lx > hi:
                    bound = True
                    continue
                key = rows[x] if dp == 1 else load[x]
                if b < 0 or key > bk:
                    b, bk = x, key
            c = u.cost if b == p else u.cost + u.replay_cost
            if dp > 1 and total_r[r] + c > cap:  # past the replica's share: elsewhere, path recomputed?
                r2 = total_r.index(min(total_r))
                if r2 != r and total_r[r2] + u.cost + u.path_cost < total_r[r] + c:
                    b2, bk = -1, 0.0  # best_fit over replica r2's microbatches of other trees, inline
                    upath, pc, pr = u.path, u.path_cost, max(1, u.path_rows)
                    for x in range(len(rep)):
                        if rep[x] != r2 or win_tree[window_of[x]] == u.tree:
                            continue
                        hx = have[x]
                        extra = sum([length[y] for y in upath if y not in hx])
                        if rows[x] + (ur + extra) > M:
                            continue
                        if load[x] + (cu + pc * extra / pr) > hi:
                            bound = True
                            continue
                        key = rows[x] if dp == 1 else load[x]
                        if b2 < 0 or key > bk:
                            b2, bk = x, key
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
        if b < 0 and dp == 1 and not u.rec and _split_free(u, rows, M, length, blocks, loose, open_bin, put):
            continue
        if b < 0:
            r = total_r.index(min(total_r))
            b = open_bin(r, -1)
            loose[r].append(b)
        put(b, u, (), u.cost)

    def emit():
        """The packing as (groups, placement, loads) in the order of the docstring (None when a
        split window's consumer finds no slot after the producer of its path)."""
        seqs = []
        for r in range(dp):
            seq = []
            for block in blocks[r]:
                seq.append(block[0])
                seq.extend(sorted(block[1:], key=lambda b: -load[b]))
            seq.extend(sorted(loose[r], key=lambda b: -load[b]))
            seq = [b for b in seq if own_l[b]]
            if dp > 1:  # costliest first (slots line up across replicas), a producer before its consumers
                producer_of = {b: block[0] for block in blocks[r] for b in block[1:]}
                srt = sorted(seq, key=lambda b: -load[b])
                seq, done = [], set()
                for b in srt:
                    if b in done:
                        continue
                    pb = producer_of.get(b, -1)
                    if pb >= 0 and pb not in done:
                        seq.append(pb)
                        done.add(pb)
                    seq.append(b)
                    done.add(b)
            seqs.append(seq)
        producer_of_win = {window_of[block[0]]: block[0] for bl in blocks for block in bl}
        after = {}
        for b, entries in enumerate(units_of if has_upper else ()):
            for u, extra_segs, _ in entries:
                if u.upper >= 0 and not extra_segs and b != producer_of_win[u.win]:
                    after.setdefault(b, set()).add(producer_of_win[u.upper])
        seqs = _after_owners(seqs, after)
        if seqs is None:
            return None
        groups, placement, loads, entries = [], [], [], []
        for r, seq in enumerate(seqs):
            for k, b in enumerate(seq):  # assemble_plan sorts the ids
                groups.append((tuple(own_l[b]), tuple(rec_l[b])))
                placement.append((r, k))
                entries.append(list(units_of[b]))
            loads.append([load[b] for b in seq])
        return groups, placement, loads, entries

    def rebuild(b, entries):
        total_r[rep[b]] -= load[b]
        load[b], rows[b] = 0.0, 0
        have[b], own_l[b], rec_l[b], units_of[b] = set(), [], [], []
        for u, extra_segs, c in entries:
            put(b, u, extra_segs, c)

    def level(block):
        """Spread a window's items over its microbatches largest first to the least loaded
        (kept when the window's costliest microbatch gets cheaper)."""
        p, t = block[0], window_of[block[0]]
        mine = [e for b in block for e in units_of[b] if e[0].kind == "item" and e[0].win == t and not e[1]]
        if len(mine) < 2:
            return False
        spread = max(load[b] for b in block) - min(load[b] for b in block)
        if spread <= min(e[0].cost for e in mine):
            return False  # no item moved from the costliest to the cheapest would lower the maximum
        before = max(load[b] for b in block)
        snapshot = {b: list(units_of[b]) for b in block}
        for b in block:
            rebuild(b, [e for e in snapshot[b] if not (e[0].kind == "item" and e[0].win == t and not e[1])])
        for u, _, _ in sorted(mine, key=lambda e: -(e[0].cost + e[0].replay_cost)):
            best = None
            for b in block:
                c = u.cost if b == p else u.cost + u.replay_cost
                if rows[b] + u.rows <= M and (best is None or load[b] + c < best[0]):
                    best = (load[b] + c, b, c)
            if best is None:
                break
            put(best[1], u, (), best[2])
        else:
            if max(load[b] for b in block) < before:
                return True
        for b in block:
            rebuild(b, snapshot[b])
        return False

    def level_all():
        changed = False
        for bl in blocks:
            for block in bl:
                if len(block) > 1 and level(block):
                    changed = True
        if changed:
            out.append(emit())

    out = [emit()]
    if dp > 1:  # variants: leveled; light microbatches dissolved (they depend on the target); both
        state = (list(load), list(rows), [set(h) for h in have], [list(x) for x in own_l],
                 [list(x) for x in rec_l], [list(x) for x in units_of], list(total_r))
        level_all()
        load[:], rows[:], have[:], own_l[:], rec_l[:], units_of[:], total_r[:] = state
        tried, emptied = _dissolve(units_of, window_of, blocks, rep, load, rows, have, own_l, rec_l, total_r, hi, M,
                                   length, win_tree)
        bound = bound or tried
        if emptied:
            out.append(emit())
            level_all()
    return [p for p in out if p is not None], bound


_SPREAD = compiled("l2_pack_spread")


def unit_arrays(units: List[_Unit]):
    """``units`` as the compiled packer reads them: int64[units, 8] (kind, tree, window, upper
    window, owned rows, replay tokens, path rows, rows), float64[units, 3] (cost, replay cost,
    path cost), owned / recomputed / path segments as CSR (offsets, ids)."""
    import numpy as np
    nu = len(units)
    ints = np.array([[_KIND[u.kind], u.tree, u.win, u.upper, u.own_rows, u.replay, u.path_rows, u.rows]
                     for u in units], dtype=np.int64).reshape(nu, 8)
    flts = np.array([[u.cost, u.replay_cost, u.path_cost] for u in units], dtype=np.float64).reshape(nu, 3)

    def csr(lists):
        off = np.zeros(len(lists) + 1, dtype=np.int64)
        np.cumsum([len(x) for x in lists], out=off[1:])
        return off, np.fromiter((x for xs in lists for x in xs), dtype=np.int64, count=int(off[-1]))

    return (ints, flts) + csr([u.owned for u in units]) + csr([u.rec for u in units]) + csr([u.path for u in units])


def pack_spread(ix: ForestIndex, units: List[_Unit], dp: int, M: int, S: int, eps: float = 0.01, arrays=None):
    """``_pack_spread_python``'s packings from the compiled ``_C.l2_pack_spread`` when built (the
    same values); ``arrays``: ``unit_arrays(units)`` when the caller has them."""
    global _SPREAD
    if _SPREAD is not None:
        try:
            out = _SPREAD(ix.length, *(arrays if arrays is not None else unit_arrays(units)), dp, M, S, eps)
        except TypeError:  # a different compiled signature: the Python path
            _SPREAD = None
        else:
            bound, rep, oo, o, ro, r, load, core, after, eo, eu, ep, ec = out
            rep, oo, o, ro, r, core = rep.tolist(), oo.tolist(), o.tolist(), ro.tolist(), r.tolist(), core.tolist()
            eo, eu, ep, ec = eo.tolist(), eu.tolist(), ep.tolist(), ec.tolist()
            nb = len(rep)
            aft: Dict[int, set] = {}
            for b, q in after.tolist():
                aft.setdefault(b, set()).add(q)
            ent = [[(units[eu[i]], units[eu[i]].path if ep[i] else (), ec[i]) for i in range(eo[b], eo[b + 1])]
                   for b in range(nb)]
            return _spread_output(dp, rep, [o[oo[b]:oo[b + 1]] for b in range(nb)],
                                  [r[ro[b]:ro[b + 1]] for b in range(nb)], load.tolist(), core, aft, ent, bool(bound))
    return _pack_spread_python(ix, units, dp, M, S, eps)


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


def _after_owners(seqs: List[List[int]], after: Dict[int, set]) -> Optional[List[List[int]]]:
    """Per replica, its microbatches ``seqs[r]`` in slot order, with every microbatch ``b`` of
    ``after`` in a later slot than the microbatches ``after[b]`` (producers owning the root
    path of a split window, on other replicas): those producers lead their replicas (in their
    order), then every slot takes the first microbatch in order that may run there.  None
    when a replica is left with microbatches none of which may run in its next slot."""
    if not after:
        return seqs
    lead = set().union(*after.values())
    pos: Dict[int, int] = {}
    heads = []
    for seq in seqs:
        head = [b for b in seq if b in lead]
        for k, b in enumerate(head):
            pos[b] = k
        heads.append(head)
    out = []
    for seq, head in zip(seqs, heads):
        rest = [b for b in seq if b not in lead]
        new = list(head)
        while rest:
            k = len(new)
            i = next((i for i, b in enumerate(rest) if b not in after or all(pos[q] < k for q in after[b])), -1)
            if i < 0:
                return None
            new.append(rest.pop(i))
        out.append(new)
    return out


def _split_free(u, rows, M, length, blocks, loose, open_bin, put) -> bool:
    """One replica: a free piece ``u`` (a tree's top, nothing recomputed) that fits no
    microbatch puts its first segments in preorder (ancestor-closed) into the spare rows of
    the microbatch with the most of them that reads nothing, which then produces them; the
    rest goes into a new microbatch right after it in its window, reading them.  The rows
    are the same (the estimate splits the piece's cost by rows; the KDA replay at the rest's
    roots is left to the exact judgement).  False when no segment fits or all of it would."""
    consumers = {b for bl in blocks for block in bl for b in block[1:]}
    cands = [b for b in range(len(rows)) if b not in consumers and rows[b] < M]
    if not cands:
        return False
    p = max(cands, key=lambda b: (M - rows[b], -b))
    room, top, used = M - rows[p], [], 0
    for x in u.owned:  # preorder: every prefix is ancestor-closed
        if used + length[x] > room:
            break
        top.append(x)
        used += length[x]
    if not top or len(top) == len(u.owned):
        return False
    inset = set(top)
    rest = [x for x in u.owned if x not in inset]
    share = used / max(1, u.rows)
    put(p, _Unit("free", u.tree, top, [], used, used, u.cost * share), (), u.cost * share)
    c = open_bin(0, -1)
    put(c, _Unit("free", u.tree, rest, [], u.rows - used, u.rows - used, u.cost * (1.0 - share)), (),
        u.cost * (1.0 - share))
    for block in blocks[0]:
        if block[0] == p:
            block.append(c)
            break
    else:
        if p in loose[0]:
            loose[0].remove(p)
        blocks[0].append([p, c])
    return True


def _dissolve(units_of, window_of, blocks, rep, load, rows, have, own_l, rec_l, total_r, hi, M,
              length, win_tree) -> Tuple[bool, bool]:
    """``pack_windows``' last step on several replicas: the lightest microbatches (under half the
    target) that produce for nobody are emptied when every unit of theirs fits elsewhere under
    the target (best fit): an item of a window into another microbatch of its window (the
    producer: local rows; a consumer: reading it), or anywhere else with its root path
    recomputed (not beside its window); a free piece anywhere.  Each success saves a
    microbatch (and a slot where its replica had the most); the state of every microbatch
    touched is restored when one unit finds no place.  Returns (whether a microbatch was light
    enough to try, whether one was emptied)."""
    producers = {block[0] for bl in blocks for block in bl if len(block) > 1}
    core_of = {block[0]: window_of[block[0]] for bl in blocks for block in bl}
    n = len(rep)
    light = sorted((b for b in range(n) if own_l[b] and b not in producers and load[b] < 0.5 * hi),
                   key=lambda b: load[b])
    gone = set()
    for b in light:
        if any(u.kind == "core" for u, _, _ in units_of[b]):
            continue  # a producer (of no consumer yet) keeps its core
        saved = {}
        moves = []
        ok = True
        for u, _, _ in units_of[b]:
            best, best_key = None, None
            for x in range(n):
                if x == b or x in gone or not own_l[x] or load[x] + u.cost > hi:
                    continue
                if u.kind == "item" and window_of[x] == u.win:
                    local = core_of.get(x, -1) == u.win
                    c = u.cost if local else u.cost + u.replay_cost
                    extra_segs, add = (), u.rows
                elif u.kind == "item":
                    if win_tree[window_of[x]] == u.tree:
                        continue  # another window of its tree: its path would sit above that window's context
                    extra_segs = u.path  # a path item (its path rows deduplicated against the microbatch's)
                    add_path = sum([length[y] for y in u.path if y not in have[x]])
                    c = u.cost + u.path_cost * add_path / max(1, u.path_rows)
                    add = u.rows + add_path
                else:
                    extra_segs, c = (), u.cost
                    add = u.rows - sum([length[y] for y in u.rec if y in have[x]])
                if rows[x] + add > M or load[x] + c > hi:
                    continue
                if best is None or load[x] > best_key:
                    best, best_key = (x, extra_segs, c), load[x]
            if best is None:
                ok = False
                break
            x, extra_segs, c = best
            if x not in saved:
                saved[x] = (load[x], rows[x], set(have[x]), len(own_l[x]), len(rec_l[x]), len(units_of[x]))
            load[x] += c
            total_r[rep[x]] += c
            hx = have[x]
            rows[x] += u.own_rows
            for seq in (u.rec, extra_segs):
                for y in seq:
                    if y not in hx:
                        hx.add(y)
                        rec_l[x].append(y)
                        rows[x] += length[y]
            own_l[x].extend(u.owned)
            units_of[x].append((u, extra_segs, c))
            moves.append(x)
        if ok:
            gone.add(b)
            total_r[rep[b]] -= load[b]
            own_l[b], rec_l[b], units_of[b] = [], [], []
            load[b], rows[b] = 0.0, 0
            continue
        for x, (ld, rw, hv, no, nr, nu) in saved.items():
            total_r[rep[x]] -= load[x] - ld
            load[x], rows[x], have[x] = ld, rw, hv
            del own_l[x][no:], rec_l[x][nr:], units_of[x][nu:]
    return bool(light), bool(gone)


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


#: the balance pass (``rebalance``): at most ``BALANCE_MOVES`` moves per packing, sources taken
#: from the ``BALANCE_SLOTS`` least balanced slots; the objective adds ``BALANCE_WEIGHT`` times the
#: mean microbatch cost for each slot's imbalance (1 - mean / max) to the estimated step
BALANCE_MOVES = 1000
BALANCE_SLOTS = 12
BALANCE_WEIGHT = 1.0
#: packings (the best by estimate) the balance pass refines: the first number, the second when the
#: best packing has at least ``BALANCE_MORE_BINS`` microbatches (small batches: planning time
#: counts more there, and the search rarely finds more)
BALANCE_PACKINGS = (1, 4)
BALANCE_MORE_BINS = 48
#: swaps are tried in packings of at most this many microbatches
BALANCE_SWAP_BINS = 64

_KIND = {"core": 0, "item": 1, "free": 2}
_REBALANCE = compiled("l2_rebalance")


def _slot_objective(seqs_cost: List[List[float]], dp: int, tau: float, weight: float) -> float:
    """Estimated step (per slot the costliest) plus ``weight * tau`` times each slot's imbalance
    (1 - mean / max; an idle entry counts 0), each replica's costs in decreasing order."""
    S = max((len(c) for c in seqs_cost), default=0)
    f = 0.0
    w = weight * tau
    for k in range(S):
        mx = sm = 0.0
        for c in seqs_cost:
            if k < len(c):
                v = c[k]
                sm += v
                if v > mx:
                    mx = v
        if mx > 0.0:
            f += mx + w * (1.0 - sm / (dp * mx))
    return f


class _Bins:
    """The balance pass's state (Python reference of ``_C.l2_rebalance``): microbatches (bins)
    with their entries (unit index, whether its root path is recomputed, estimated cost) and
    what the pass's rules read: recomputed segments with their counts, the bin owning each
    segment, rows, cores and window items per tree, path items per tree, producers read, KDA
    replay tokens.  ``take`` and ``give`` keep all of it exact (as estimated), so a move is
    tried by doing it and undoing it."""

    def __init__(self, units, rep, ent, length, dp):
        n = self.n = len(rep)
        self.units, self.length, self.dp = units, length, dp
        self.rep = list(rep)
        self.ent: List[list] = [[] for _ in range(n)]
        self.load = [0.0] * n
        self.rows = [0] * n
        self.own = [0] * n  # rows of owned segments (rows >= own): a move past M refused untried
        self.replay = [0] * n
        self.cnt: List[Dict[int, int]] = [{} for _ in range(n)]
        self.owner: Dict[int, int] = {}
        self.win_t: List[Dict[int, int]] = [{} for _ in range(n)]
        self.path_t: List[Dict[int, int]] = [{} for _ in range(n)]
        self.reads: List[Dict[int, int]] = [{} for _ in range(n)]
        self.prod: Dict[int, int] = {}
        for b in range(n):
            for k, _, _ in ent[b]:
                if units[k].kind == "core":
                    self.prod[units[k].win] = b
        self.overlap = [bool(set(u.rec) & set(u.path)) for u in units]
        self.is_prod = [False] * n
        for b in self.prod.values():
            self.is_prod[b] = True
        for b in range(n):
            for k, path, c in ent[b]:
                self.add(b, len(self.ent[b]), k, path, c)

    def open(self, r):
        """A new empty bin on replica ``r``; returns its index."""
        self.rep.append(r)
        self.ent.append([])
        self.load.append(0.0)
        self.rows.append(0)
        self.own.append(0)
        self.replay.append(0)
        for tbl in (self.cnt, self.win_t, self.path_t, self.reads):
            tbl.append({})
        self.is_prod.append(False)
        self.n += 1
        return self.n - 1

    def add(self, b, j, k, path, c):
        """Unit ``k`` into bin ``b`` as its entry ``j`` (its root path recomputed when ``path``)."""
        u = self.units[k]
        length, cnt, owner = self.length, self.cnt[b], self.owner
        self.ent[b].insert(j, (k, path, c))
        self.load[b] += c
        for s in u.owned:
            if s in cnt:  # recomputed here by another unit: owned now
                self.rows[b] -= length[s]
            owner[s] = b
        self.rows[b] += u.own_rows
        self.own[b] += u.own_rows
        for seq in (u.rec, u.path if path else ()):
            for s in seq:
                m = cnt.get(s, 0)
                if m == 0 and owner.get(s, -1) != b:
                    self.rows[b] += length[s]
                cnt[s] = m + 1
        if u.kind == "free":
            return
        if path:
            self.path_t[b][u.tree] = self.path_t[b].get(u.tree, 0) + 1
            return
        self.win_t[b][u.tree] = self.win_t[b].get(u.tree, 0) + 1
        p = self.prod[u.win]
        if u.kind == "item" and p != b:
            self.reads[b][p] = self.reads[b].get(p, 0) + 1
            self.replay[b] += u.replay

    def take(self, b, j):
        """Remove entry ``j`` of bin ``b``; returns it."""
        k, path, c = e = self.ent[b].pop(j)
        u = self.units[k]
        length, cnt, owner = self.length, self.cnt[b], self.owner
        self.load[b] -= c
        if not self.ent[b]:
            self.load[b] = 0.0
        for seq in (u.rec, u.path if path else ()):
            for s in seq:
                m = cnt[s] - 1
                if m == 0:
                    del cnt[s]
                    if owner.get(s, -1) != b:
                        self.rows[b] -= length[s]
                else:
                    cnt[s] = m
        self.rows[b] -= u.own_rows
        self.own[b] -= u.own_rows
        for s in u.owned:
            owner[s] = -1
            if s in cnt:
                self.rows[b] += length[s]
        if u.kind != "free":
            tbl = self.path_t[b] if path else self.win_t[b]
            tbl[u.tree] -= 1
            if not tbl[u.tree]:
                del tbl[u.tree]
            p = self.prod[u.win]
            if not path and u.kind == "item" and p != b:
                self.reads[b][p] -= 1
                if not self.reads[b][p]:
                    del self.reads[b][p]
                self.replay[b] -= u.replay
        return e

    def mode(self, k, y):
        """How unit ``k`` would sit in bin ``y``: (path recomputed, cost), None where it may not:
        read from its window's producer when ``y`` is that producer or a bin of its replica
        producing nothing, reading nothing else and recomputing none of its tree's paths; else
        its root path recomputed when ``y`` holds no core or window item of its tree (not for a
        split window's item).  A free piece goes anywhere."""
        u = self.units[k]
        if u.kind == "free":
            return False, u.cost
        p = self.prod[u.win]
        if self.rep[y] == self.rep[p]:
            if y == p:
                return False, u.cost
            if not self.is_prod[y] and not self.path_t[y].get(u.tree, 0) and all(q == p for q in self.reads[y]):
                return False, u.cost + u.replay_cost
        if u.upper >= 0 or self.win_t[y].get(u.tree, 0):
            return None
        extra = 0
        cnt = self.cnt[y]
        for s in u.path:
            if s not in cnt:
                extra += self.length[s]
        return True, u.cost + u.path_cost * extra / max(1, u.path_rows)

    def move_bound(self, x, j, y, path_y):
        """Entry ``j`` of ``x`` moved alone to ``y`` (its root path recomputed there when
        ``path_y``), without moving it: (rows ``y`` gains, exactly; a lower bound of the tokens
        (rows and KDA replay) ``x`` and ``y`` gain together).  Units whose recomputed segments
        and root path overlap: None (not bounded)."""
        k, path_x, _ = self.ent[x][j]
        if self.overlap[k]:
            return None
        u, length, owner = self.units[k], self.length, self.owner
        cx, cy = self.cnt[x], self.cnt[y]
        loss = u.own_rows  # at least what x loses (owned rows it keeps as recomputed ignored)
        for seq in (u.rec, u.path if path_x else ()):
            for s in seq:
                if cx[s] == 1 and owner.get(s, -1) != x:
                    loss += length[s]
        if not path_x and u.kind == "item" and self.prod[u.win] != x:
            loss += u.replay
        gain = u.own_rows
        for s in u.owned:
            if s in cy:
                gain -= length[s]
        for seq in (u.rec, u.path if path_y else ()):
            for s in seq:
                if s not in cy and owner.get(s, -1) != y:
                    gain += length[s]
        replay = u.replay if not path_y and u.kind == "item" and self.prod[u.win] != y else 0
        return gain, gain + replay - loss

    def swap_bound(self, x, i, y, j):
        """A lower bound of the tokens (rows and KDA replay) ``x`` and ``y`` gain when entry ``i``
        of ``x`` and entry ``j`` of ``y`` swap bins, without swapping them (None when a unit's
        recomputed segments and root path overlap): each bin loses at most its unit's owned
        rows, its recomputed segments no other entry holds and its KDA replay, and gains at
        least the other unit's owned rows it does not recompute and its recomputed segments
        (root path and replay left out: whichever way the unit lands, they only add)."""
        length, owner = self.length, self.owner
        lb = 0
        for a, ia, bb in ((x, i, y), (y, j, x)):
            k, path_a, _ = self.ent[a][ia]
            if self.overlap[k]:
                return None
            u, ca, cb = self.units[k], self.cnt[a], self.cnt[bb]
            lb -= u.own_rows
            for seq in (u.rec, u.path if path_a else ()):
                for s in seq:
                    if ca[s] == 1 and owner.get(s, -1) != a:
                        lb -= length[s]
            if not path_a and u.kind == "item" and self.prod[u.win] != a:
                lb -= u.replay
            lb += u.own_rows
            for s in u.owned:
                if s in cb:
                    lb -= length[s]
            for s in u.rec:
                if s not in cb and owner.get(s, -1) != bb:
                    lb += length[s]
        return lb

    def give(self, y, k) -> bool:
        m = self.mode(k, y)
        if m is None:
            return False
        self.add(y, len(self.ent[y]), k, m[0], m[1])
        return True

    def blocks(self, live):
        """The bins ``live`` in blocks that may change replicas together: a producer with the
        bins reading it, a bin reading and producing nothing alone; blocks holding a split
        window's unit are left out.  Each block sorted, blocks by their first bin."""
        root = {b: b for b in live}

        def find(b):
            while root[b] != b:
                b = root[b]
            return b

        for b in live:
            for p in self.reads[b]:
                rb, rp = find(b), find(p)
                if rb != rp:
                    root[max(rb, rp)] = min(rb, rp)
        out: Dict[int, List[int]] = {}
        split = set()
        for b in live:
            r = find(b)
            out.setdefault(r, []).append(b)
            if any(self.units[k].upper >= 0 for k, _, _ in self.ent[b]):
                split.add(r)
        return [bs for r, bs in sorted(out.items()) if r not in split]

    def costs(self, r, overhead):
        rep, load, ent = self.rep, self.load, self.ent
        return sorted((load[b] + overhead for b in range(self.n) if rep[b] == r and ent[b]), reverse=True)

    def groups(self, b):
        """What may leave bin ``b``: every entry but cores and split windows' units alone, then
        all path items of one window (free pieces of one tree) together (shared rows)."""
        out, by = [], {}
        for j, (k, path, _) in enumerate(self.ent[b]):
            u = self.units[k]
            if u.kind == "core" or u.upper >= 0:
                continue
            out.append((j,))
            if u.kind == "free" or path:
                by.setdefault((u.kind == "free", u.win), []).append(j)
        out.extend(tuple(js) for js in by.values() if len(js) > 1)
        return out


def _rebalance_python(units, rep, ent, length, dp: int, M: int, overhead: float, moves: int, n_slots: int,
                      weight: float, swap_bins: int):
    """Reference of ``_C.l2_rebalance`` (``rebalance``'s search): returns (moved, rep, ent)."""
    n = len(rep)
    st = _Bins(units, rep, ent, length, dp)
    rep, load, ent, rows, replay = st.rep, st.load, st.ent, st.rows, st.replay
    total = 0.0
    for x in load:
        total += x
    total += overhead * n
    tau = total / max(1, dp * max(rep.count(r) for r in range(dp)))
    costs = [st.costs(r, overhead) for r in range(dp)]
    f_now = _slot_objective(costs, dp, tau, weight)
    slack = 0  # tokens the moves so far saved (a later move may spend them)
    spare = [st.open(r) for r in range(dp)]  # an empty bin per replica: a move may open a bin

    def score(rx, ry):
        cs = list(costs)
        cs[rx] = st.costs(rx, overhead)
        if ry != rx:
            cs[ry] = st.costs(ry, overhead)
        return _slot_objective(cs, dp, tau, weight)

    def try_move(x, idxs, y):
        """Entries ``idxs`` of ``x`` moved to ``y``: (tokens added, undo), or None (state as
        before) when not allowed."""
        if st.own[y] + sum([units[ent[x][j][0]].own_rows for j in idxs]) > M:
            return None  # y's owned rows alone would pass the budget: not tried
        if len(idxs) == 1:  # one unit: its rows and tokens bounded before trying
            k = ent[x][idxs[0]][0]
            m = st.mode(k, y)
            if m is None:
                return None
            bd = st.move_bound(x, idxs[0], y, m[0])
            if bd is not None and (rows[y] + bd[0] > M or bd[1] > slack):
                return None  # past the budget, or more tokens than the moves before saved
        before = rows[x] + replay[x] + rows[y] + replay[y]
        taken = [(j, st.take(x, j)) for j in sorted(idxs, reverse=True)]
        added = 0
        for _, e in reversed(taken):
            if not st.give(y, e[0]):
                break
            added += 1

        def undo():
            for _ in range(added):
                st.take(y, len(ent[y]) - 1)
            for j, e in reversed(taken):
                st.add(x, j, *e)

        if added < len(taken) or rows[y] > M:
            undo()
            return None
        return rows[x] + replay[x] + rows[y] + replay[y] - before, undo

    def try_swap(x, i, y, j):
        """Entry ``i`` of ``x`` and entry ``j`` of ``y`` swapped, as ``try_move``."""
        ou, ov = units[ent[x][i][0]].own_rows, units[ent[y][j][0]].own_rows
        if st.own[x] - ou + ov > M or st.own[y] - ov + ou > M:
            return None
        lb = st.swap_bound(x, i, y, j)
        if lb is not None and lb > slack:
            return None  # more tokens than the moves before saved: not tried
        before = rows[x] + replay[x] + rows[y] + replay[y]
        eu = st.take(x, i)
        ev = st.take(y, j)
        okv = st.give(x, ev[0])
        oku = okv and st.give(y, eu[0])

        def undo():
            if oku:
                st.take(y, len(ent[y]) - 1)
            if okv:
                st.take(x, len(ent[x]) - 1)
            st.add(y, j, *ev)
            st.add(x, i, *eu)

        if not oku or rows[x] > M or rows[y] > M:
            undo()
            return None
        return rows[x] + replay[x] + rows[y] + replay[y] - before, undo

    def movable(k):
        return units[k].kind != "core" and units[k].upper < 0

    moved = False
    for _ in range(moves):
        n = st.n
        order = [sorted((b for b in range(n) if rep[b] == r and ent[b]), key=lambda b: (-load[b], b))
                 for r in range(dp)]
        slots = []
        for k in range(max(len(o) for o in order)):
            bs = [o[k] for o in order if k < len(o)]
            mx = sm = 0.0
            for b in bs:
                v = load[b] + overhead
                sm += v
                if v > mx:
                    mx = v
            ratio = sm / (dp * mx)
            if ratio < 1.0 - 1e-9:
                mean = sm / dp
                slots.append((ratio, k, [b for b in bs if load[b] + overhead > mean]))
        slots.sort(key=lambda s: (s[0], s[1]))
        sources = []
        for sl in slots[:n_slots]:
            sources.extend(b for b in sl[2] if b not in sources)
        live = [b for b in range(n) if ent[b]]
        light = min(live, key=lambda b: (load[b], b))
        if not st.is_prod[light] and light not in sources:
            sources.append(light)
        swaps = len(live) <= swap_bins
        best = None
        for x in sources:
            lx = load[x]
            for idxs in st.groups(x):
                if x != light:
                    c_out = 0.0
                    for j in idxs:
                        c_out += units[ent[x][j][0]].cost
                for y in live + spare:
                    if y == x or (x != light and load[y] + c_out >= lx):
                        continue  # only toward a lighter bin (the lightest: anywhere, to empty it)
                    got = try_move(x, idxs, y)
                    if got is None:
                        continue
                    if got[0] <= slack:
                        f = score(rep[x], rep[y])
                        if f < f_now - 1e-12 and (best is None or f < best[0]):
                            best = (f, got[0], 0, x, idxs, y)
                    got[1]()
            if not swaps:
                continue
            for i in range(len(ent[x])):
                ku = ent[x][i][0]
                if not movable(ku):
                    continue
                cu = units[ku].cost
                for y in live:
                    if y == x:
                        continue
                    for j in range(len(ent[y])):
                        kv = ent[y][j][0]
                        if not movable(kv):
                            continue
                        d = cu - units[kv].cost
                        if d <= 0.0 or load[y] + d >= lx:
                            continue
                        got = try_swap(x, i, y, j)
                        if got is None:
                            continue
                        if got[0] <= slack:
                            f = score(rep[x], rep[y])
                            if f < f_now - 1e-12 and (best is None or f < best[0]):
                                best = (f, got[0], 1, x, (i, j), y)
                        got[1]()
        # whole blocks (a producer with its consumers, or a bin reading and producing nothing;
        # none holding a split window's unit) to another replica, or two blocks swapping replicas
        blocks = st.blocks(live)
        for a, ba in enumerate(blocks):
            rx = rep[ba[0]]
            for r2 in range(dp):
                if r2 == rx:
                    continue
                for b in ba:
                    rep[b] = r2
                f = score(rx, r2)
                for b in ba:
                    rep[b] = rx
                if f < f_now - 1e-12 and (best is None or f < best[0]):
                    best = (f, 0, 2, a, blocks, r2)
            for c in range(a + 1, len(blocks)):
                bc = blocks[c]
                ry = rep[bc[0]]
                if ry == rx:
                    continue
                for b in ba:
                    rep[b] = ry
                for b in bc:
                    rep[b] = rx
                f = score(rx, ry)
                for b in ba:
                    rep[b] = rx
                for b in bc:
                    rep[b] = ry
                if f < f_now - 1e-12 and (best is None or f < best[0]):
                    best = (f, 0, 3, a, blocks, c)
        if best is None:
            break
        f_now, delta, kind, x, arg, y = best
        if kind >= 2:  # x: a block's index in arg (the blocks); y: a replica, or another block
            rx = rep[arg[x][0]]
            ry = y if kind == 2 else rep[arg[y][0]]
            for b in arg[x]:
                rep[b] = ry
            if kind == 3:
                for b in arg[y]:
                    rep[b] = rx
            costs[rx] = st.costs(rx, overhead)
            costs[ry] = st.costs(ry, overhead)
            moved = True
            continue
        rx = rep[x]
        if kind == 0:
            try_move(x, arg, y)
            ry = rep[y]
        else:
            try_swap(x, arg[0], y, arg[1])
            ry = rep[y]
        slack -= delta
        costs[rx] = st.costs(rx, overhead)
        costs[ry] = st.costs(ry, overhead)
        moved = True
        for r in range(dp):
            if ent[spare[r]]:
                spare[r] = st.open(r)
    return moved, rep, ent


def numbered_units(entries):
    """A packing's per-microbatch entries ``(unit, path, cost)`` with each distinct unit numbered once
    (first appearance order): returns (units, entries as ``(unit number, path, cost)``), the form
    ``_Bins`` and the compiled balance pass read."""
    units, index, ent = [], {}, []
    for es in entries:
        row = []
        for u, ex, c in es:
            k = index.get(id(u))
            if k is None:
                k = index[id(u)] = len(units)
                units.append(u)
            row.append((k, bool(ex), c))
        ent.append(row)
    return units, ent


def rebalance(ix: ForestIndex, packed, dp: int, M: int, overhead: float):
    """A packing's microbatches evened out per slot (the balance pass, several replicas).

    A local search (``_C.l2_rebalance``; ``_rebalance_python`` its reference, move for move):
    at most ``BALANCE_MOVES`` steps, each taking the best change by the objective (the
    estimated step, each replica's microbatches costliest first and slots aligned, plus
    ``BALANCE_WEIGHT`` times the mean microbatch cost for every slot's imbalance 1 - mean /
    max: ``_slot_objective``), until none lowers it.  Sources: the microbatches above their
    slot's mean in the ``BALANCE_SLOTS`` least balanced slots (toward lighter microbatches),
    and the lightest microbatch (anywhere: emptying it saves a microbatch).  Changes: a unit
    (alone, or a window's path items or a tree's free pieces together) to another microbatch
    or to a new one (each replica keeps an empty microbatch at hand); two units swapping
    microbatches (packings of at most ``BALANCE_SWAP_BINS`` microbatches); a whole block (a
    producer with its consumers, or a microbatch reading and producing nothing; no split
    window's units) to another replica, or two blocks swapping replicas.  A moved unit takes
    the form its destination allows (``_Bins.mode``: read from its window's producer, or its
    root path recomputed).  No change computes more tokens (rows and KDA replay, as
    estimated: ``plan_l2`` checks the assembled plan) than the changes before it saved, no
    microbatch exceeds ``M`` rows.  Cores and split windows' units stay; a microbatch left
    empty is dropped.  Then the order of ``pack_windows`` (costliest first, a producer just
    before its first consumer, split windows' consumers after their path's owner).  Returns
    the packing (``pack_windows``' format) or None when nothing changed (or that order is
    impossible, or there are fewer microbatches than replicas)."""
    global _REBALANCE
    groups, placement, loads, entries = packed[:4]
    n = len(groups)
    if n < 2 or dp < 2 or n < dp:  # fewer microbatches than replicas: every slot has idle ones
        return None
    units, ent = numbered_units(entries)
    rep = [placement[i][0] for i in range(n)]
    args = (dp, M, overhead, BALANCE_MOVES, BALANCE_SLOTS, BALANCE_WEIGHT, BALANCE_SWAP_BINS)
    out = None
    if _REBALANCE is not None:
        try:
            out = _rebalance_compiled(ix, units, rep, ent, *args)
        except TypeError:  # a different compiled signature: the Python path
            _REBALANCE = None
    if out is None:
        out = _rebalance_python(units, rep, ent, ix.length_list, *args)
    moved, rep, ent = out
    if not moved:
        return None
    n = len(rep)  # bins the pass opened included
    prod = {units[k].win: b for b in range(n) for k, _, _ in ent[b] if units[k].kind == "core"}
    reads = [sorted({prod[units[k].win] for k, path, _ in ent[b] if units[k].kind == "item" and not path} - {b})
             for b in range(n)]
    load = [0.0] * n
    for b in range(n):
        for _, _, c in ent[b]:
            load[b] += c
    seqs = []
    for r in range(dp):
        srt = sorted((b for b in range(n) if rep[b] == r and ent[b]), key=lambda b: (-load[b], b))
        seq, done = [], set()
        for b in srt:
            if b in done:
                continue
            for p in reads[b]:
                if p not in done:
                    seq.append(p)
                    done.add(p)
            seq.append(b)
            done.add(b)
        seqs.append(seq)
    after: Dict[int, set] = {}
    for b in range(n):
        for k, path, _ in ent[b]:
            u = units[k]
            if u.kind == "item" and u.upper >= 0 and not path and b != prod[u.win]:
                after.setdefault(b, set()).add(prod[u.upper])
    seqs = _after_owners(seqs, after)
    if seqs is None:
        return None
    groups2, placement2, loads2, entries2 = [], [], [], []
    for r, seq in enumerate(seqs):
        for k, b in enumerate(seq):
            own, rec = [], set()
            for j, path, _ in ent[b]:
                u = units[j]
                own.extend(u.owned)
                rec.update(u.rec)
                if path:
                    rec.update(u.path)
            rec.difference_update(own)
            groups2.append((tuple(own), tuple(sorted(rec))))
            placement2.append((r, k))
            entries2.append([(units[j], units[j].path if path else (), c) for j, path, c in ent[b]])
        loads2.append([load[b] for b in seq])
    return groups2, placement2, loads2, entries2


def _rebalance_compiled(ix, units, rep, ent, dp, M, overhead, moves, n_slots, weight, swap_bins):
    """``_rebalance_python``'s result from ``_C.l2_rebalance`` (the same values)."""
    import numpy as np
    nu = len(units)
    ints = np.array([[_KIND[u.kind], u.tree, u.win, u.upper, u.own_rows, u.replay, u.path_rows] for u in units],
                    dtype=np.int64).reshape(nu, 7)
    flts = np.array([[u.cost, u.replay_cost, u.path_cost] for u in units], dtype=np.float64).reshape(nu, 3)

    def csr(lists):
        off = np.zeros(len(lists) + 1, dtype=np.int64)
        np.cumsum([len(x) for x in lists], out=off[1:])
        flat = np.fromiter((x for xs in lists for x in xs), dtype=np.int64, count=int(off[-1]))
        return off, flat

    own_off, own = csr([u.owned for u in units])
    rec_off, rec = csr([u.rec for u in units])
    path_off, path = csr([u.path for u in units])
    ent_off = np.zeros(len(ent) + 1, dtype=np.int64)
    np.cumsum([len(e) for e in ent], out=ent_off[1:])
    ent_unit = np.array([k for e in ent for k, _, _ in e], dtype=np.int64)
    ent_path = np.array([p for e in ent for _, p, _ in e], dtype=np.int64)
    ent_cost = np.array([c for e in ent for _, _, c in e], dtype=np.float64)
    moved, rep2, eo, eu, ep, ec = _REBALANCE(ix.length, ints, flts, own_off, own, rec_off, rec, path_off, path,
                                              np.asarray(rep, dtype=np.int64), ent_off, ent_unit, ent_path,
                                              ent_cost, dp, M, overhead, moves, n_slots, weight, swap_bins)
    eo, eu, ep, ec = eo.tolist(), eu.tolist(), ep.tolist(), ec.tolist()
    ent2 = [[(eu[i], bool(ep[i]), ec[i]) for i in range(eo[b], eo[b + 1])] for b in range(len(eo) - 1)]
    return bool(moved), rep2.tolist(), ent2
