"""L2's one-slot packer (``pack_one_slot``): a batch whose units fit in one slot (``dp`` microbatches or fewer).

With one slot no microbatch can read another's exports (a consumer runs in a later slot than its producer),
so every item away from its window's core recomputes its root path, and the slot's step is its costliest
microbatch.  The window and spreading packers place units greedily toward targets made for many slots; on
one slot their packings leave the costliest microbatch well above the mean (Step-wise 256 at DP 8: whole
turns of thousands of rows, a prompt recomputed per tree and microbatch).  This packer searches the
assignment of units to the ``dp`` microbatches directly:

1. *Start*: units by decreasing standalone cost (an item's root path included), each to the microbatch
   it leaves cheapest (row budget kept; a unit that fits nowhere: no packing).
2. *Descent*: each step takes the change that lowers (step, sum of squared microbatch costs) most
   (lexicographically: the second term makes progress below an unchanged maximum, toward even
   microbatches), among: from a microbatch ``x`` to a cheaper one ``y``, a unit of ``x`` or all items of
   one window in ``x`` (they share their root path: moving them together can drop a recomputed prompt)
   moved to ``y``, or swapped with one unit of ``y``; no microbatch over ``M`` rows.  At most
   ``ONE_SLOT_STEPS`` steps.

A microbatch's estimated cost: its units' costs (in entry order) plus the recomputed cost of the root-path
segments its items need and its cores do not own (each once, in first-need order); its rows likewise
(units' rows plus those path rows).  The packing is judged exactly by ``plan_l2`` like the others.

``_C.l2_one_slot`` is the compiled search; ``_one_slot_python`` its reference, step for step (a test
holds them equal).
"""
from __future__ import annotations

import math
from typing import List

from .compiled import compiled
from .l2_units import unit_arrays

__all__ = ["pack_one_slot", "ONE_SLOT_STEPS"]

#: at most this many descent steps
ONE_SLOT_STEPS = 200

_ONE_SLOT = compiled("l2_one_slot")
_EPS = 1e-12


def _better(over, mx, sq, over0, mx0, sq0) -> bool:
    """(rows over the budget, step, sum of squares) lower than the second triple (steps within ``_EPS``
    equal, then the squares by more than ``_EPS``)."""
    if over != over0:
        return over < over0
    return mx < mx0 - _EPS or (mx <= mx0 + _EPS and sq < sq0 - _EPS)


def _one_slot_python(kind, win, cost, rows, path_off, path, length, body, dp: int, M: int, max_rows: int,
                     steps: int):
    """Reference of ``_C.l2_one_slot``: the units of each of the ``dp`` microbatches (entry order), or None
    (a unit fits nowhere).  ``kind``: 0 core, 1 item, 2 free; ``win``: a unit's window (0..); ``path``: an
    item's root path (CSR); ``length``, ``body``: a segment's rows and recomputed cost; ``max_rows``: the rows
    the microbatches may compute together (as estimated)."""
    n = len(kind)
    smark = [0] * len(length)
    wmark = [0] * (max(win, default=-1) + 1)
    stamp = [0]

    def measure(lst, cap=math.inf):
        """(cost, rows) of a microbatch holding units ``lst`` (in that order); None once its cost passes
        ``cap`` (costs only add up: such a change is never taken)."""
        stamp[0] += 1
        st = stamp[0]
        c = 0.0
        r = 0
        for u in lst:
            c += cost[u]
            r += rows[u]
            if kind[u] == 0:
                wmark[win[u]] = st
        if c > cap:
            return None
        for u in lst:
            if kind[u] == 1 and wmark[win[u]] != st:
                for q in range(path_off[u], path_off[u + 1]):
                    s = path[q]
                    if smark[s] != st:
                        smark[s] = st
                        c += body[s]
                        r += length[s]
                if c > cap:
                    return None
        return c, r

    # start: decreasing standalone cost, each unit to the microbatch it leaves cheapest
    alone = [measure([u])[0] for u in range(n)]
    ent: List[List[int]] = [[] for _ in range(dp)]
    load = [0.0] * dp
    nrows = [0] * dp
    for u in sorted(range(n), key=lambda u: (-alone[u], u)):
        best_b, best_c = -1, 0.0
        for b in range(dp):
            c, r = measure(ent[b] + [u])
            if r <= M and (best_b < 0 or c < best_c):
                best_b, best_c = b, c
        if best_b < 0:
            return None
        ent[best_b].append(u)
        load[best_b] = best_c
        nrows[best_b] = measure(ent[best_b])[1]
    # descent on (step, sum of squares)
    for _ in range(steps):
        total = 0
        for r in nrows:
            total += r
        over = total - max_rows if total > max_rows else 0  # rows past the budget
        mx = sq = 0.0
        for v in load:
            mx = v if v > mx else mx
            sq += v * v
        top = sorted(range(dp), key=lambda b: (-load[b], b))[:3]
        best = None
        for x in range(dp):
            ex = ent[x]
            groups = [[u] for u in ex]
            by = {}
            for u in ex:
                if kind[u] == 1:
                    by.setdefault(win[u], []).append(u)
            groups.extend(g for g in by.values() if len(g) > 1)
            for y in range(dp):
                if y == x or load[x] <= load[y]:
                    continue
                other = 0.0  # the costliest microbatch but x and y
                for b in top:
                    if b != x and b != y:
                        other = load[b]
                        break
                ey = ent[y]
                for g in groups:
                    rest = [u for u in ex if u not in g]
                    cands = [(rest, ey + g)]
                    cands.extend((rest + [ey[j]], ey[:j] + ey[j + 1:] + g) for j in range(len(ey)))
                    for lx_list, ly_list in cands:
                        cap = math.inf if over > 0 else (mx if best is None or best[1] > mx else best[1]) + _EPS
                        got_x = measure(lx_list, cap)
                        if got_x is None or got_x[1] > M:
                            continue
                        got_y = measure(ly_list, cap)
                        if got_y is None or got_y[1] > M:
                            continue
                        lx, ly = got_x[0], got_y[0]
                        tm = other if other > lx else lx
                        tm = tm if tm > ly else ly
                        tq = sq - load[x] * load[x] - load[y] * load[y] + lx * lx + ly * ly
                        to = total - nrows[x] - nrows[y] + got_x[1] + got_y[1] - max_rows
                        to = to if to > 0 else 0
                        if _better(to, tm, tq, over, mx, sq) and (best is None or _better(to, tm, tq, *best[:3])):
                            best = (to, tm, tq, x, y, lx_list, ly_list, got_x, got_y)
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
    global _ONE_SLOT
    if dp < 2 or not units:
        return None
    ints, flts, _, _, _, _, path_off, path = unit_arrays(units) if arrays is None else arrays
    kind, win, rows, cost = ints[:, 0], ints[:, 2], ints[:, 7], flts[:, 0]
    c = model.coefficients
    body_arr = c.row * ix.length + c.attention_pair * ix.seg_pairs
    ent = None
    if _ONE_SLOT is not None:
        try:
            eo, eu = _ONE_SLOT(kind, win, cost, rows, path_off, path, ix.length, body_arr, dp, M, int(max_rows),
                               ONE_SLOT_STEPS)
            eo, eu = eo.tolist(), eu.tolist()
            ent = None if len(eo) == 1 else [eu[eo[b]:eo[b + 1]] for b in range(len(eo) - 1)]
        except TypeError:  # a different compiled signature: the Python path
            _ONE_SLOT = None
    if _ONE_SLOT is None:
        ent = _one_slot_python(kind.tolist(), win.tolist(), cost.tolist(), rows.tolist(), path_off.tolist(),
                               path.tolist(), ix.length_list, body_arr.tolist(), dp, M, int(max_rows),
                               ONE_SLOT_STEPS)
    if ent is None:
        return None
    body = body_arr.tolist()
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
