"""L2's balance pass (``rebalance``): a local search on a packing's units toward even slots.

``_C.l2_rebalance`` is its compiled search; ``_rebalance_python`` (with its state ``_Bins``)
the reference, move for move (a test holds them equal).  Invariants: no change computes more
tokens (as estimated) than the budget ``spend`` plus what the changes before it saved, no
microbatch passes the row budget,
every window still runs as the schedule runs it.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Dict, List, Optional

import numpy as np

from .compiled import compiled
from .cost_model import ForestIndex
from .l2_packing import _after_owners
from .l2_units import unit_arrays

__all__ = ["rebalance", "numbered_units", "BALANCE_MOVES", "BALANCE_SLOTS", "BALANCE_WEIGHT", "BALANCE_PACKINGS",
           "BALANCE_MORE_BINS", "BALANCE_SWAP_BINS", "BALANCE_WIDE"]

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
#: when no change lowers the objective, at most this many steps take their sources from every
#: unbalanced slot (not only the ``BALANCE_SLOTS`` least balanced; their moves go to the microbatches
#: below their slot's mean in those) before the pass stops
BALANCE_WIDE = 8

_REBALANCE = compiled("l2_rebalance")
_REBALANCE_PACKING = compiled("l2_rebalance_packing")  # rebalance of a compiled packing, all of it


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

    def __init__(self, units, rep, ent, length, dp, ordered=False, split=False):
        n = self.n = len(rep)
        self.ordered = ordered
        self.split = split  # split windows' items may leave their bins too (``groups``)
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
        """Replica ``r``'s microbatch costs (load + ``overhead``) costliest first; when ``ordered``, in the
        order ``rebalance`` runs them: costliest first, each producer just before its first reader."""
        rep, load, ent = self.rep, self.load, self.ent
        if not self.ordered:
            return sorted((load[b] + overhead for b in range(self.n) if rep[b] == r and ent[b]), reverse=True)
        out, done = [], set()
        for b in sorted((b for b in range(self.n) if rep[b] == r and ent[b]), key=lambda b: (-load[b], b)):
            if b in done:
                continue
            for p in sorted(self.reads[b]):
                if p not in done:
                    out.append(load[p] + overhead)
                    done.add(p)
            out.append(load[b] + overhead)
            done.add(b)
        return out

    def groups(self, b):
        """What may leave bin ``b``: every entry but cores and split windows' units (those too when
        ``split``) alone, then all path items of one window (free pieces of one tree) together
        (shared rows)."""
        out, by = [], {}
        for j, (k, path, _) in enumerate(self.ent[b]):
            u = self.units[k]
            if u.kind == "core" or (u.upper >= 0 and not self.split):
                continue
            out.append((j,))
            if u.kind == "free" or path:
                by.setdefault((u.kind == "free", u.win), []).append(j)
        out.extend(tuple(js) for js in by.values() if len(js) > 1)
        return out


def _rebalance_python(units, rep, ent, length, dp: int, M: int, overhead: float, moves: int, n_slots: int,
                      weight: float, swap_bins: int, wide: int, spend: int, ordered: bool = False,
                      split: bool = False):
    """Reference of ``_C.l2_rebalance`` (``rebalance``'s search): returns (moved, rep, ent)."""
    n = len(rep)
    st = _Bins(units, rep, ent, length, dp, ordered, split)
    rep, load, ent, rows, replay = st.rep, st.load, st.ent, st.rows, st.replay
    total = 0.0
    for x in load:
        total += x
    total += overhead * n
    tau = total / max(1, dp * max(rep.count(r) for r in range(dp)))
    costs = [st.costs(r, overhead) for r in range(dp)]
    f_now = _slot_objective(costs, dp, tau, weight)
    slack = spend  # tokens the pass may add: the budget given, then what its moves save
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
        return units[k].kind != "core" and (split or units[k].upper < 0)

    moved = False
    wide_now = False  # this step's sources: the microbatches above their slot's mean in every unbalanced slot
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
                slots.append((ratio, k, [b for b in bs if load[b] + overhead > mean],
                              [b for b in bs if load[b] + overhead <= mean]))
        slots.sort(key=lambda s: (s[0], s[1]))
        sources = []
        for sl in slots[:len(slots) if wide_now else n_slots]:
            sources.extend(b for b in sl[2] if b not in sources)
        live = [b for b in range(n) if ent[b]]
        light = min(live, key=lambda b: (load[b], b))
        if not st.is_prod[light] and light not in sources:
            sources.append(light)
        swaps = len(live) <= swap_bins
        dests = live + spare
        if wide_now:  # toward the microbatches below their slot's mean in the least balanced slots
            low = {b for sl in slots[:n_slots] for b in sl[3]}
            dests = [b for b in live if b in low] + spare
        best = None
        for x in sources:
            lx = load[x]
            for idxs in st.groups(x):
                if x != light:
                    c_out = 0.0
                    for j in idxs:
                        c_out += units[ent[x][j][0]].cost
                for y in dests:
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
            if wide_now or wide <= 0 or len(slots) <= n_slots:
                break
            wide_now = True  # stuck: the next step takes its sources from every unbalanced slot
            wide -= 1
            continue
        wide_now = False
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


def rebalance(ix: ForestIndex, packed, dp: int, M: int, overhead: float, spend: int = 0,
              swap_bins: Optional[int] = None, ordered: bool = False, arrays=None,
              weight: Optional[float] = None, split: bool = False):
    """A packing's microbatches evened out per slot (the balance pass, several replicas).

    A local search (``_C.l2_rebalance``; ``_rebalance_python`` its reference, move for move):
    at most ``BALANCE_MOVES`` steps, each taking the best change by the objective (the
    estimated step, each replica's microbatches costliest first and slots aligned, plus
    ``BALANCE_WEIGHT`` times the mean microbatch cost for every slot's imbalance 1 - mean /
    max: ``_slot_objective``), until none lowers it.  Sources: the microbatches above their
    slot's mean in the ``BALANCE_SLOTS`` least balanced slots (toward lighter microbatches),
    and the lightest microbatch (anywhere: emptying it saves a microbatch); when none of their
    changes lowers the objective, the next step moves units from the microbatches above their
    slot's mean in every unbalanced slot to those below it in the ``BALANCE_SLOTS`` least balanced
    ones (or to a new one; at most ``BALANCE_WIDE`` times: a light tail slot is evened out by
    units of the heavy microbatches of other slots).  Changes: a unit
    (alone, or a window's path items or a tree's free pieces together) to another microbatch
    or to a new one (each replica keeps an empty microbatch at hand); two units swapping
    microbatches (packings of at most ``BALANCE_SWAP_BINS`` microbatches); a whole block (a
    producer with its consumers, or a microbatch reading and producing nothing; no split
    window's units) to another replica, or two blocks swapping replicas.  A moved unit takes
    the form its destination allows (``_Bins.mode``: read from its window's producer, or its
    root path recomputed).  No change computes more tokens (rows and KDA replay, as
    estimated: ``plan_l2`` checks the assembled plan) than ``spend`` (tokens the caller lets the
    pass add; 0: none) plus what the changes before it saved, no microbatch exceeds ``M`` rows.
    Cores stay, and split windows' units too unless ``split``; a microbatch left empty is dropped.
    Then the order of ``pack_windows`` (costliest first, a producer just before its first
    consumer, split windows' consumers after their path's owner).  Returns the packing
    (``pack_windows``' format) or None when nothing changed (or that order is impossible, or
    there are fewer microbatches than replicas).  ``swap_bins``: swaps are tried in
    packings of at most this many microbatches (default ``BALANCE_SWAP_BINS``).  ``ordered``: the objective
    reads each replica's microbatches in the order this function returns them (producers moved before
    their first consumer), not costliest first only.  ``arrays``: ``unit_arrays`` of the units the
    packer was given, when ``packed`` is a compiled packer's packing (``_C.L2Packing``): then all of
    this runs in ``_C.l2_rebalance_packing`` (the same packing; the code below is its reference).
    ``weight``: the objective's weight of the slots' imbalance (default ``BALANCE_WEIGHT``).  ``split``:
    split windows' items move too, alone (to their window's producer or to a microbatch of its replica
    that reads that producer alone; never with their root path recomputed), their consumers placed after
    their path's owner as the packers place them (otherwise they stay where the packer put them)."""
    swaps = BALANCE_SWAP_BINS if swap_bins is None else int(swap_bins)
    weight = BALANCE_WEIGHT if weight is None else float(weight)
    if arrays is not None and _REBALANCE_PACKING is not None and not isinstance(packed, tuple):
        return _REBALANCE_PACKING(packed, ix.length, *arrays, dp, M, overhead, BALANCE_MOVES,
                                  BALANCE_SLOTS, weight, swaps, BALANCE_WIDE,
                                  max(0, int(spend)), bool(ordered), bool(split))
    groups, placement, loads, entries = packed[:4]
    n = len(groups)
    if n < 2 or dp < 2 or n < dp:  # fewer microbatches than replicas: every slot has idle ones
        return None
    units, ent = numbered_units(entries)
    rep = [placement[i][0] for i in range(n)]
    args = (dp, M, overhead, BALANCE_MOVES, BALANCE_SLOTS, weight, swaps, BALANCE_WIDE,
            max(0, int(spend)), bool(ordered), bool(split))
    out = None
    if _REBALANCE is not None:
        out = _rebalance_compiled(ix, units, rep, ent, *args)
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


def _rebalance_compiled(ix, units, rep, ent, dp, M, overhead, moves, n_slots, weight, swap_bins, wide, spend,
                        ordered=False, split=False):
    """``_rebalance_python``'s result from ``_C.l2_rebalance`` (the same values)."""
    ints8, flts, own_off, own, rec_off, rec, path_off, path = unit_arrays(units)
    ints = np.ascontiguousarray(ints8[:, :7])
    flat = [e for es in ent for e in es]
    ent_off = np.array([0, *accumulate(map(len, ent))], dtype=np.int64)
    cols = list(zip(*flat)) if flat else [(), (), ()]  # (units, path flags, costs)
    ent_unit = np.array(cols[0], dtype=np.int64)
    ent_path = np.array(cols[1], dtype=np.int64)
    ent_cost = np.array(cols[2], dtype=np.float64)
    moved, rep2, eo, eu, ep, ec = _REBALANCE(ix.length, ints, flts, own_off, own, rec_off, rec, path_off, path,
                                              np.asarray(rep, dtype=np.int64), ent_off, ent_unit, ent_path,
                                              ent_cost, dp, M, overhead, moves, n_slots, weight, swap_bins, wide, spend,
                                              ordered, split)
    eo, eu, ep, ec = eo.tolist(), eu.tolist(), ep.tolist(), ec.tolist()
    ent2 = [list(zip(eu[eo[b]:eo[b + 1]], map(bool, ep[eo[b]:eo[b + 1]]), ec[eo[b]:eo[b + 1]]))
            for b in range(len(eo) - 1)]
    return bool(moved), rep2.tolist(), ent2
