"""L2's unit search over (replica, slot) microbatches: the one-slot packer (``pack_one_slot``) and the few-slot
refinement (``search_slots``).

With one slot no microbatch can read another's exports (a consumer runs in a later slot than its producer),
so every item away from its window's core recomputes its root path, and the slot's step is its costliest
microbatch.  The window and spreading packers place units greedily toward targets made for many slots; on
one slot their packings leave the costliest microbatch well above the mean (Step-wise 256 at DP 8: whole
turns of thousands of rows, a prompt recomputed per tree and microbatch).  ``pack_one_slot`` searches the
assignment of units to the ``dp`` microbatches directly; ``search_slots`` runs the same descent on a plan of
a few slots from the plan's own assignment (``plan_l2``: the chosen plan of at most ``SEARCH_SLOTS`` slots):

1. *Start*: one slot: units by decreasing standalone cost (an item's root path included), each to the
   microbatch it leaves cheapest (row budget kept; a unit that fits nowhere: no packing).  Several slots:
   the plan's microbatches (cores stay where they are: their windows' consumers read them).
2. *Descent*: each step takes the change that lowers (rows over ``max_rows``, step, sum of squared
   microbatch costs) most (lexicographically: the last term makes progress below an unchanged step, toward
   even microbatches), among: from a microbatch ``x`` to a cheaper one ``y`` (of any slot), a unit of ``x``
   (a core only on one slot) or all items of one window in ``x`` (they share their root path: moving them
   together can drop a recomputed prompt) moved to ``y``, or swapped with one unit of ``y`` (not a core on
   several slots); no microbatch over ``M`` rows.  The step is the sum over slots of each slot's costliest
   microbatch.  At most ``ONE_SLOT_STEPS`` steps.

A microbatch's estimated cost: its units' costs (in entry order), then per item whose window's core it does
not hold either the item's KDA replay cost, where it reads that core's producer (an earlier microbatch of
its replica; this microbatch holds no core and reads no other producer: the first such item's), or the
recomputed cost of the item's root-path segments (each once per microbatch, in first-need order); its rows
likewise (units' rows plus those path rows).  Each packing is judged exactly by ``plan_l2`` like the
packers' (no more tokens than L1, a shorter modelled step).

``_C.l2_slot_search`` is the compiled search; ``_search_python`` its reference, step for step (a test
holds them equal).
"""
from __future__ import annotations

import math
from typing import List

import numpy as np

from .compiled import compiled
from .l2_units import unit_arrays

__all__ = ["pack_one_slot", "search_slots", "ONE_SLOT_STEPS"]

#: at most this many descent steps
ONE_SLOT_STEPS = 200

_SEARCH = compiled("l2_slot_search")
_EPS = 1e-12


def _better(over, mx, sq, over0, mx0, sq0) -> bool:
    """(rows over the budget, step, sum of squares) lower than the second triple (steps within ``_EPS``
    equal, then the squares by more than ``_EPS``)."""
    if over != over0:
        return over < over0
    return mx < mx0 - _EPS or (mx <= mx0 + _EPS and sq < sq0 - _EPS)


def _search_python(kind, win, cost, rows, replay, path_off, path, length, body, dp: int, S: int, M: int,
                   max_rows: int, steps: int, start=None):
    """Reference of ``_C.l2_slot_search``: the units of each microbatch ``r * S + k`` (replica ``r``, slot ``k``;
    entry order), or None (one slot: a unit fits nowhere).  ``kind``: 0 core, 1 item, 2 free; ``win``: a
    unit's window (0..); ``replay``: an item's cost of KDA replay when it reads its window's producer;
    ``path``: an item's root path (CSR); ``length``, ``body``: a segment's rows and recomputed cost;
    ``max_rows``: the rows the microbatches may compute together (as estimated); ``start``: each unit's
    microbatch (None: one slot, the start of the module docstring)."""
    n = len(kind)
    nb = dp * S
    smark = [0] * len(length)
    wmark = [0] * (max(win, default=-1) + 1)
    stamp = [0]
    core_bin = [-1] * len(wmark)  # several slots: each window's producer (cores stay)

    def measure(b, lst, cap=math.inf):
        """(cost, rows) of microbatch ``b`` holding units ``lst`` (in that order); None once its cost passes
        ``cap`` (costs only add up: such a change is never taken).  An item reads its window's producer when
        that runs earlier on the replica, this microbatch produces nothing and reads no other producer (the
        first such item's); else it recomputes its root path (each segment once)."""
        stamp[0] += 1
        st = stamp[0]
        c = 0.0
        r = 0
        prod = False
        for u in lst:
            c += cost[u]
            r += rows[u]
            if kind[u] == 0:
                wmark[win[u]] = st
                prod = True
        if c > cap:
            return None
        rb, kb = divmod(b, S)
        reads = -1
        for u in lst:
            if kind[u] == 1 and wmark[win[u]] != st:
                p = core_bin[win[u]]
                if S > 1 and not prod and p >= 0 and p // S == rb and p % S < kb and (reads < 0 or reads == p):
                    reads = p
                    c += replay[u]
                else:
                    for q in range(path_off[u], path_off[u + 1]):
                        s = path[q]
                        if smark[s] != st:
                            smark[s] = st
                            c += body[s]
                            r += length[s]
                if c > cap:
                    return None
        return c, r

    ent: List[List[int]] = [[] for _ in range(nb)]
    load = [0.0] * nb
    nrows = [0] * nb
    if start is None:  # one slot: decreasing standalone cost, each unit to the microbatch it leaves cheapest
        alone = [measure(0, [u])[0] for u in range(n)]
        for u in sorted(range(n), key=lambda u: (-alone[u], u)):
            best_b, best_c = -1, 0.0
            for b in range(nb):
                c, r = measure(b, ent[b] + [u])
                if r <= M and (best_b < 0 or c < best_c):
                    best_b, best_c = b, c
            if best_b < 0:
                return None
            ent[best_b].append(u)
            load[best_b] = best_c
            nrows[best_b] = measure(best_b, ent[best_b])[1]
    else:
        for u in range(n):
            ent[start[u]].append(u)
            if kind[u] == 0:
                core_bin[win[u]] = start[u]
        for b in range(nb):
            load[b], nrows[b] = measure(b, ent[b])
    # descent on (rows over the budget, step, sum of squares)
    for _ in range(steps):
        total = 0
        for r in nrows:
            total += r
        over = total - max_rows if total > max_rows else 0
        mk = []  # per slot its costliest microbatch, and its three costliest
        top = []
        for k in range(S):
            mx = 0.0
            for r in range(dp):
                v = load[r * S + k]
                mx = v if v > mx else mx
            mk.append(mx)
            top.append(sorted(range(k, nb, S), key=lambda b: (-load[b], b))[:3])
        step = 0.0
        for v in mk:
            step += v
        sq = 0.0
        for v in load:
            sq += v * v
        best = None
        for x in range(nb):
            ex = ent[x]
            kx = x % S
            groups = [[u] for u in ex if S == 1 or kind[u] != 0]
            by = {}
            for u in ex:
                if kind[u] == 1:
                    by.setdefault(win[u], []).append(u)
            groups.extend(g for g in by.values() if len(g) > 1)
            for y in range(nb):
                ky = y % S
                if y == x or load[x] <= load[y]:
                    continue
                ox = oy = 0.0  # the costliest microbatches of x's and y's slots but x and y
                for b in top[kx]:
                    if b != x and b != y:
                        ox = load[b]
                        break
                for b in top[ky]:
                    if b != x and b != y:
                        oy = load[b]
                        break
                ey = ent[y]
                for g in groups:
                    rest = [u for u in ex if u not in g]
                    cands = [(rest, ey + g)]
                    cands.extend((rest + [ey[j]], ey[:j] + ey[j + 1:] + g) for j in range(len(ey))
                                 if S == 1 or kind[ey[j]] != 0)
                    for lx_list, ly_list in cands:
                        cap = math.inf if over > 0 else (step if best is None or best[1] > step else best[1]) + _EPS
                        got_x = measure(x, lx_list, cap)
                        if got_x is None or got_x[1] > M:
                            continue
                        got_y = measure(y, ly_list, cap)
                        if got_y is None or got_y[1] > M:
                            continue
                        lx, ly = got_x[0], got_y[0]
                        nx = ox if ox > lx else lx
                        if ky == kx:
                            nx = nx if nx > ly else ly
                            ts = step - mk[kx] + nx
                        else:
                            ny = oy if oy > ly else ly
                            ts = step - mk[kx] - mk[ky] + nx + ny
                        tq = sq - load[x] * load[x] - load[y] * load[y] + lx * lx + ly * ly
                        to = total - nrows[x] - nrows[y] + got_x[1] + got_y[1] - max_rows
                        to = to if to > 0 else 0
                        if _better(to, ts, tq, over, step, sq) and (best is None or _better(to, ts, tq, *best[:3])):
                            best = (to, ts, tq, x, y, lx_list, ly_list, got_x, got_y)
        if best is None:
            break
        _, _, _, x, y, ent[x], ent[y], (load[x], nrows[x]), (load[y], nrows[y]) = best
    return ent


def pack_one_slot(ix, units, dp: int, M: int, model, max_rows: int, arrays=None):
    """A packing of ``units`` (``window_units``) in one slot of ``dp`` microbatches (``pack_windows``'
    format: groups, placement, loads, entries), or None where a unit fits nowhere.  Cores own their
    segments; an item away from its window's core recomputes its root path (its entry names the path).
    The search keeps the rows the microbatches compute together (as estimated) at most ``max_rows`` where
    it can (``plan_l2``: L1's tokens).  ``arrays``: ``unit_arrays(units)`` when the caller has them."""
    if dp < 2 or not units:
        return None
    ent, body = _search(ix, units, model, dp, 1, M, max_rows, arrays, None)
    if ent is None:
        return None
    groups, placement, loads, entries = [], [], [[] for _ in range(dp)], []
    for b, lst in enumerate(ent):
        if not lst:
            continue
        us = [units[k] for k in lst]
        cores = {u.win for u in us if u.kind == "core"}
        own, rec, seen = [], set(), set()
        es, load = [], 0.0
        for u in us:
            own.extend(u.owned)
            rec.update(u.rec)
            extra, ec = (), u.cost
            if u.kind == "item" and u.win not in cores:
                extra = tuple(u.path)
                for x in u.path:
                    if x not in seen:
                        seen.add(x)
                        ec += body[x]
                rec.update(u.path)
            es.append((u, extra, ec))
            load += ec
        rec.difference_update(own)
        groups.append((tuple(own), tuple(sorted(rec))))
        placement.append((b, 0))
        loads[b].append(load)
        entries.append(es)
    return groups, placement, loads, entries


def search_slots(ix, units, plan, model, max_rows: int, arrays=None):
    """``plan``'s microbatches (assembled from a packing of ``units``) searched again unit by unit, every slot at
    once: the descent of the module docstring from the plan's own assignment (cores stay; an item reads its
    window's producer where the plan's windows allow, else recomputes its root path).  Returns the packing
    (groups, placement) when the search changed something, else None (also where a unit's segments lie in
    several microbatches or a unit belongs to a split window)."""
    dp, S = plan.num_replicas, plan.num_slots
    if dp < 2 or not units:
        return None
    if arrays is None:
        arrays = unit_arrays(units)
    ints, own_off, own = arrays[0], arrays[2], arrays[3]
    if (ints[:, 3] >= 0).any():
        return None  # a split window's unit
    where = np.full(ix.num_segments, -1, dtype=np.int64)  # each owned segment's microbatch
    for m in plan.microbatches:
        where[m.owned] = m.replica * S + m.slot
    lens = np.diff(own_off)
    if (lens == 0).any():
        return None
    at = where[own]
    first = at[own_off[:-1]]
    if (first < 0).any() or not np.array_equal(at, np.repeat(first, lens)):
        return None  # a unit's segments in several microbatches
    start = first.tolist()
    init: List[List[int]] = [[] for _ in range(dp * S)]
    for k, b in enumerate(start):
        init[b].append(k)
    ent, _ = _search(ix, units, model, dp, S, plan.row_budget, max_rows, arrays, start)
    if ent is None or ent == init:
        return None
    core_bin = {u.win: start[k] for k, u in enumerate(units) if u.kind == "core"}
    groups, placement = [], []
    for b, lst in enumerate(ent):
        if not lst:
            continue
        r, k = divmod(b, S)
        us = [units[j] for j in lst]
        cores = {u.win for u in us if u.kind == "core"}
        own, rec, reads = [], set(), -1
        for u in us:
            own.extend(u.owned)
            rec.update(u.rec)
            if u.kind != "item" or u.win in cores:
                continue
            p = core_bin.get(u.win, -1)
            if not cores and p >= 0 and p // S == r and p % S < k and (reads < 0 or reads == p):
                reads = p  # read from the producer (as the search measured it)
            else:
                rec.update(u.path)
        rec.difference_update(own)
        groups.append((tuple(own), tuple(sorted(rec))))
        placement.append((r, k))
    return groups, placement

def _search(ix, units, model, dp, S, M, max_rows, arrays, start):
    """(the search's microbatches, the segments' recomputed costs as a list): ``_C.l2_slot_search`` when
    built, else ``_search_python``."""
    ints, flts, _, _, _, _, path_off, path = unit_arrays(units) if arrays is None else arrays
    kind, win, rows, cost, replay = ints[:, 0], ints[:, 2], ints[:, 7], flts[:, 0], flts[:, 1]
    c = model.coefficients
    body = c.row * ix.length + c.attention_pair * ix.seg_pairs
    if _SEARCH is not None:
        eo, eu = _SEARCH(kind, win, cost, rows, replay, path_off, path, ix.length, body, dp, S, M, int(max_rows),
                         ONE_SLOT_STEPS, np.asarray([] if start is None else start, dtype=np.int64))
        eo, eu = eo.tolist(), eu.tolist()
        ent = None if len(eo) == 1 else [eu[eo[b]:eo[b + 1]] for b in range(len(eo) - 1)]
        return ent, body.tolist()
    ent = _search_python(kind.tolist(), win.tolist(), cost.tolist(), rows.tolist(), replay.tolist(),
                         path_off.tolist(), path.tolist(), ix.length_list, body.tolist(), dp, S, M, int(max_rows),
                         ONE_SLOT_STEPS, start)
    return ent, body.tolist()
