"""L2's last pass (``even_slots``): subtrees moved between the microbatches of an assembled plan toward even slots.

The balance pass (``l2_balance.rebalance``) moves whole units of a packing; a slot it leaves uneven (a light
entry nothing fits into, a tail slot of small microbatches, a single slot of free pieces) is evened out here
at segment granularity.  A **piece** of microbatch ``x`` is an owned segment ``s`` with every segment of its
subtree that ``x`` computes: all owned by ``x``, none read by another microbatch (no exported segment of a
window).  A change moves one piece from ``x`` to a microbatch ``y`` that computes nothing of its subtree (of
its slot or of its replica), or swaps two pieces of two such microbatches:

- ``x`` drops the piece and every recomputed segment (and external read) left without a computed child; a
  producer (a microbatch others read) drops none of its recomputed segments (its consumers may read them):
  a change that would is not tried;
- ``y`` owns the piece; the segments of its root path it neither computes nor reads (walking up to the
  first one it computes or reads) it reads from its producer when it reads one (the one of its replica),
  that producer owns them all and the first one met is read too (they are pinned there from then on);
  else it recomputes them.  Either way every window runs as before: ``y`` reads from no new producer, and
  nothing it computes lies above a segment it reads.

The objective is ``l2_balance``'s: per slot the costliest entry plus ``weight`` times the mean microbatch
cost times its imbalance (1 - mean / max; an idle entry counts 0), costs estimated from each microbatch's
exact cost plus the rows, attention pairs and logits rows a change adds or removes (KDA calls and replay
left as they were).  Each step takes the change that lowers it most, among: pieces of the entries above
their slot's mean in the ``n_slots`` least balanced slots, to a lighter entry of their slot or to any other
microbatch of their replica; pieces of any microbatch of the replica of an entry below its slot's mean in
those slots, to that entry; swaps of a piece of such a heavy entry with a piece of a lighter microbatch of
its slot or of its replica, and of a piece of a heavier microbatch of a light entry's replica with a piece
of that entry (a piece of fewer rows back, the rows given worth less than the two microbatches' cost gap,
the two subtrees disjoint).  No change computes more rows (as estimated) than ``spend`` minus what the changes
before it added, none that adds rows leaves the estimated step (the slots' maxima) as long as it was (rows
are spent only to shorten it, never to raise a slot's mean alone), none puts a microbatch over ``M`` rows,
none empties one.

``_C.l2_even`` is its compiled search; ``_even_python`` the reference, change for change (a test holds them
equal).  ``even_slots`` assembles the result and keeps it only where its exact objective is lower and, when
it computes more tokens, its exact modelled step is shorter.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from .compiled import compiled
from .cost_model import CostModel, ForestIndex
from .microbatch import MicrobatchPlan, PlanningError, _csr, assemble_plan

__all__ = ["even_slots", "even_objective", "EVEN_BINS", "EVEN_MOVES", "EVEN_SLOTS", "EVEN_SPEND", "EVEN_WEIGHT"]

#: at most this many changes per plan, sources from the ``EVEN_SLOTS`` least balanced slots; the objective
#: weighs each slot's imbalance by ``EVEN_WEIGHT`` times the mean microbatch cost
EVEN_MOVES = 200
EVEN_SLOTS = 12
EVEN_WEIGHT = 1.0
#: the pass may recompute this part of the tokens the plan saves against L1
EVEN_SPEND = 0.5
#: ``plan_l2`` runs the pass on plans of at least this many microbatches (smaller: planning time counts
#: more, OR-Tools+FFD plans Step-wise 256-1024 DP 8 in 5-115 ms, and the pass took 11-45 ms on Step-wise
#: 256-512, which have many pieces per microbatch)
EVEN_BINS = 48

_EVEN = compiled("l2_even")

_NONE, _OWN, _REC, _EXT = 0, 1, 2, 3


def even_objective(costs: np.ndarray, weight: float, tau: float) -> float:
    """Per slot (columns of ``costs[replica, slot]``, an idle entry 0.0) the costliest entry plus
    ``weight * tau`` times its imbalance 1 - mean / max, summed over the slots with work."""
    f = 0.0
    dp = costs.shape[0]
    for k in range(costs.shape[1]):
        col = costs[:, k].tolist()
        mx = max(col)
        if mx > 0.0:
            f += mx + weight * tau * (1.0 - sum(col) / (dp * mx))
    return f


class _State:
    """The pass's microbatches: per microbatch its segments' states (owned, recomputed, external), each
    present segment's count of present children, rows, attention pairs, logits rows, estimated cost.
    ``move`` changes all of it exactly and logs what it changed, so ``undo`` restores it."""

    def __init__(self, parent, length, pairs, logits, sub_size, owns, recs, cost, is_prod, pinned, reads, coef):
        self.parent, self.length, self.pairs, self.logits, self.sub_size = parent, length, pairs, logits, sub_size
        self.c_row, self.c_pair, self.c_logit = coef
        n = len(owns)
        self.st: List[dict] = [{} for _ in range(n)]
        self.cc: List[dict] = [{} for _ in range(n)]
        self.rows = [0] * n
        self.pr = [0] * n
        self.lg = [0] * n
        self.n_own = [0] * n
        self.cost = list(cost)
        self.is_prod = list(is_prod)
        self.pinned = [set(p) for p in pinned]
        self.reads = list(reads)
        self.owner = {}
        for b in range(n):
            for s in owns[b]:
                self.owner[s] = b
        for b in range(n):
            st, cc = self.st[b], self.cc[b]
            for s in owns[b]:
                st[s] = _OWN
                self.rows[b] += length[s]
                self.pr[b] += pairs[s]
                self.lg[b] += logits[s]
            for s in recs[b]:
                st[s] = _REC
                self.rows[b] += length[s]
                self.pr[b] += pairs[s]
            self.n_own[b] = len(owns[b])
            for s in sorted(st):
                a = parent[s]
                while a >= 0 and a not in st:
                    st[a] = _EXT
                    a = parent[a]
            for s in st:
                a = parent[s]
                if a >= 0:
                    cc[a] = cc.get(a, 0) + 1
        self.log: list = []

    def _set(self, b, s, state, count):
        self.log.append((b, s, self.st[b].get(s, _NONE), self.cc[b].get(s, 0)))
        self._put(b, s, state, count)

    def _put(self, b, s, state, count):
        """Segment ``s`` of microbatch ``b`` in ``state`` with ``count`` computed children (unlogged)."""
        if state == _NONE:
            self.st[b].pop(s, None)
            self.cc[b].pop(s, None)
        else:
            self.st[b][s] = state
            self.cc[b][s] = count

    def _scalars(self, b):
        self.log.append((b, -1, (self.rows[b], self.pr[b], self.lg[b], self.n_own[b]), self.cost[b]))

    def _own(self, s, b):
        self.log.append((-1, s, self.owner[s], 0))
        self.owner[s] = b

    def _pin(self, b, s):
        if s not in self.pinned[b]:
            self.log.append((-2, s, b, 0))
            self.pinned[b].add(s)

    def piece(self, x, s) -> Optional[List[int]]:
        """The piece of ``x`` rooted at ``s`` (its segments in id order), None when it is none: ``s``
        not owned, a segment of its subtree computed but not owned here, or one pinned; or it is all
        that ``x`` owns."""
        st = self.st[x]
        if st.get(s) != _OWN:
            return None
        out = []
        pin = self.pinned[x]
        for d in range(s, s + self.sub_size[s]):
            v = st.get(d, _NONE)
            if v == _NONE:
                continue
            if v != _OWN or d in pin:
                return None
            out.append(d)
        return out if len(out) < self.n_own[x] else None

    def move(self, x, seg, y, M) -> Optional[int]:
        """Move the piece ``seg`` (``piece``'s list, root first) from ``x`` to ``y``; returns the rows
        both gain together, or None (then undone by the caller: ``undo``) when ``y`` computes or reads
        its root, a producer would drop a recomputed segment, or ``y`` would pass ``M`` rows."""
        parent, length, pairs, logits = self.parent, self.length, self.pairs, self.logits
        s = seg[0]
        if self.st[y].get(s, _NONE) != _NONE:
            return None
        self._scalars(x)
        self._scalars(y)
        d_rows_x = d_pr_x = d_lg = 0
        inside = set(seg)
        for d in seg:
            self._set(x, d, _NONE, 0)
            d_rows_x -= length[d]
            d_pr_x -= pairs[d]
            d_lg += logits[d]
        a = parent[s]
        while a >= 0:
            c = self.cc[x].get(a, 0) - 1
            v = self.st[x][a]
            if c > 0 or v == _OWN:
                self._set(x, a, v, c)
                break
            if v == _REC:
                if self.is_prod[x]:
                    return None
                d_rows_x -= length[a]
                d_pr_x -= pairs[a]
            self._set(x, a, _NONE, 0)
            a = parent[a]
        kids = {}
        for d in seg:
            if parent[d] in inside:
                kids[parent[d]] = kids.get(parent[d], 0) + 1
        d_rows_y = d_pr_y = 0
        for d in seg:
            self._set(y, d, _OWN, kids.get(d, 0))
            self._own(d, y)
            d_rows_y += length[d]
            d_pr_y += pairs[d]
        missing = []  # the root path's segments y neither computes nor reads, bottom up
        a = parent[s]
        while a >= 0 and self.st[y].get(a, _NONE) == _NONE:
            missing.append(a)
            a = parent[a]
        p = self.reads[y]
        read = p >= 0 and (a < 0 or self.st[y][a] == _EXT) and all(self.owner[m] == p for m in missing)
        for m in missing:
            if read:  # read from y's producer, which owns them: they stay there
                self._set(y, m, _EXT, 1)
                self._pin(p, m)
            else:
                self._set(y, m, _REC, 1)
                d_rows_y += length[m]
                d_pr_y += pairs[m]
        if a >= 0:
            self._set(y, a, self.st[y][a], self.cc[y].get(a, 0) + 1)
        if self.rows[y] + d_rows_y > M:
            return None
        self.rows[x] += d_rows_x
        self.pr[x] += d_pr_x
        self.lg[x] -= d_lg
        self.n_own[x] -= len(seg)
        self.rows[y] += d_rows_y
        self.pr[y] += d_pr_y
        self.lg[y] += d_lg
        self.n_own[y] += len(seg)
        self.cost[x] += self.c_row * d_rows_x + self.c_pair * d_pr_x - self.c_logit * d_lg
        self.cost[y] += self.c_row * d_rows_y + self.c_pair * d_pr_y + self.c_logit * d_lg
        return d_rows_x + d_rows_y

    def mark(self) -> int:
        return len(self.log)

    def undo(self, mark: int):
        """Restore the state as it was when ``mark`` was taken."""
        while len(self.log) > mark:
            b, s, v, c = self.log.pop()
            if b == -1:
                self.owner[s] = v
            elif b == -2:
                self.pinned[v].discard(s)
            elif s < 0:
                self.rows[b], self.pr[b], self.lg[b], self.n_own[b] = v
                self.cost[b] = c
            else:
                self._put(b, s, v, c)

    def owned(self, b) -> List[int]:
        return sorted(s for s, v in self.st[b].items() if v == _OWN)

    def recomputed(self, b) -> List[int]:
        return sorted(s for s, v in self.st[b].items() if v == _REC)


def _even_python(parent, length, pairs, logits, sub_size, rep, slot, owns, recs, cost, is_prod, pinned, reads,
                 dp: int, S: int, M: int, coef: Tuple[float, float, float], moves: int, n_slots: int,
                 weight: float, spend: int):
    """Reference of ``_C.l2_even`` (the module docstring's search): returns (moved, owned lists,
    recomputed lists), per microbatch sorted."""
    n = len(owns)
    st = _State(parent, length, pairs, logits, sub_size, owns, recs, cost, is_prod, pinned, reads, coef)
    total = 0.0
    for c in st.cost:
        total += c
    tau = total / (dp * S)
    grid = [[-1] * dp for _ in range(S)]
    for b in range(n):
        grid[slot[b]][rep[b]] = b
    by_rep = [[b for k in range(S) for b in [grid[k][r]] if b >= 0] for r in range(dp)]

    def slot_f(k):
        mx = sm = 0.0
        for i in grid[k]:
            v = 0.0 if i < 0 else st.cost[i]
            sm += v
            if v > mx:
                mx = v
        return mx + weight * tau * (1.0 - sm / (dp * mx)) if mx > 0.0 else 0.0

    def delta(x, y):  # the objective's change by the change just made (base: each slot's term before it)
        kx, ky = slot[x], slot[y]
        if kx == ky:
            return slot_f(kx) - base[kx]
        return slot_f(kx) - base[kx] + slot_f(ky) - base[ky]

    def slot_max(k):
        mx = 0.0
        for i in grid[k]:
            if i >= 0 and st.cost[i] > mx:
                mx = st.cost[i]
        return mx

    def shorter(x, y):  # the change just made shortens the estimated step (the slots' maxima)
        kx, ky = slot[x], slot[y]
        if kx == ky:
            return slot_max(kx) < base_mx[kx] - 1e-12
        return slot_max(kx) + slot_max(ky) < base_mx[kx] + base_mx[ky] - 1e-12

    added = 0
    moved = False
    for _ in range(moves):
        base = [slot_f(k) for k in range(S)]
        base_mx = [slot_max(k) for k in range(S)]
        bal = []
        for k in range(S):
            mx = sm = 0.0
            for i in grid[k]:
                v = 0.0 if i < 0 else st.cost[i]
                sm += v
                if v > mx:
                    mx = v
            if mx > 0.0 and sm / (dp * mx) < 1.0 - 1e-9:
                bal.append((sm / (dp * mx), k, sm / dp))
        bal.sort()
        tries = []  # (x, y) pairs whose piece moves are tried, in order; then the swaps (x, y)
        swaps = []
        for _, k, mean in bal[:n_slots]:
            for x in grid[k]:
                if x < 0 or st.cost[x] <= mean:
                    continue
                for y in grid[k]:
                    if y >= 0 and y != x and st.cost[y] < st.cost[x]:
                        tries.append((x, y))
                        swaps.append((x, y))
                for y in by_rep[rep[x]]:
                    if y != x:
                        tries.append((x, y))
                        if st.cost[y] < st.cost[x]:
                            swaps.append((x, y))
            for y in grid[k]:
                if y < 0 or st.cost[y] >= mean:
                    continue
                for x in by_rep[rep[y]]:
                    if x != y:
                        tries.append((x, y))
                        if st.cost[x] > st.cost[y]:
                            swaps.append((x, y))
        cache = {}  # microbatch -> its pieces this step: (root, segments, rows)

        def pieces(b):
            if b not in cache:
                out = []
                for s in st.owned(b):
                    seg = st.piece(b, s)
                    if seg is not None:
                        out.append((s, seg, sum([length[d] for d in seg])))
                cache[b] = out
            return cache[b]

        best = None
        for x, y in tries:
            for s, seg, _ in pieces(x):
                m = st.mark()
                got = st.move(x, seg, y, M)
                if got is not None and added + got <= spend and (got <= 0 or shorter(x, y)):
                    d = delta(x, y)
                    if d < -1e-12 and (best is None or d < best[0]):
                        best = (d, x, s, y, -1)
                st.undo(m)
        for x, y in swaps:
            gap = st.cost[x] - st.cost[y]
            for s, seg, rows in pieces(x):
                for t, seg2, rows2 in pieces(y):
                    if rows2 >= rows or coef[0] * (rows - rows2) >= gap or (t <= s < t + sub_size[t]) or \
                            (s <= t < s + sub_size[s]):
                        continue  # x gives rows, less than the gap's worth; disjoint subtrees
                    m = st.mark()
                    got = st.move(x, seg, y, M)
                    got2 = None if got is None else st.move(y, seg2, x, M)
                    if got2 is not None and added + got + got2 <= spend and (got + got2 <= 0 or shorter(x, y)):
                        d = delta(x, y)
                        if d < -1e-12 and (best is None or d < best[0]):
                            best = (d, x, s, y, t)
                    st.undo(m)
        if best is None:
            break
        _, x, s, y, t = best
        seg = st.piece(x, s)
        seg2 = None if t < 0 else st.piece(y, t)
        added += st.move(x, seg, y, M)
        if seg2 is not None:
            added += st.move(y, seg2, x, M)
        st.log.clear()
        moved = True
    return moved, [st.owned(b) for b in range(n)], [st.recomputed(b) for b in range(n)]


def even_slots(ix: ForestIndex, plan: MicrobatchPlan, model: CostModel, spend: int) -> Optional[MicrobatchPlan]:
    """``plan`` (tree mode, several replicas) evened out by the pass of the module docstring, allowed to
    recompute ``spend`` rows more: the plan assembled from its result (same replicas and slots) when its
    exact objective (``even_objective`` with the pass's weight and the plan's mean microbatch cost) is lower
    than ``plan``'s and, if it computes more tokens than ``plan``, its modelled step (sum over slots of the
    costliest entry) is shorter; else None.  Every window runs as in ``plan``; no microbatch passes the row
    budget."""
    mbs = plan.microbatches
    dp, S, M = plan.num_replicas, plan.num_slots, plan.row_budget
    if dp < 2 or not mbs:
        return None
    pinned = [[] for _ in mbs]
    for w in plan.windows:
        pinned[w.producer] = w.segments.tolist()
    rep = [m.replica for m in mbs]
    slot = [m.slot for m in mbs]
    reads = []  # the producer of its replica each microbatch reads (-1: none, or several)
    for m in mbs:
        ps = {e.producer for e in m.external if mbs[e.producer].replica == m.replica}
        reads.append(ps.pop() if len(ps) == 1 else -1)
    cost = [m.cost for m in mbs]
    is_prod = [bool(m.consumers) for m in mbs]
    c = model.coefficients
    coef = (c.row, c.attention_pair, c.logits_row)
    spend = max(0, int(spend))
    out = None
    if _EVEN is not None:
        own_off, own = _csr([m.owned for m in mbs])
        rec_off, rec = _csr([m.recomputed for m in mbs])
        pin_off, pin = _csr(pinned)
        moved, oo, o, ro, r = _EVEN(ix.parent_arr, ix.length, ix.seg_pairs, ix.seg_logits, ix.sub_size,
                                    np.asarray(rep, dtype=np.int64), np.asarray(slot, dtype=np.int64),
                                    own_off, own, rec_off, rec, np.asarray(cost, dtype=np.float64),
                                    np.asarray(is_prod, dtype=np.int64), pin_off, pin,
                                    np.asarray(reads, dtype=np.int64), dp, S, M,
                                    coef[0], coef[1], coef[2], EVEN_MOVES, EVEN_SLOTS, EVEN_WEIGHT, spend)
        out = (bool(moved), _split(oo, o), _split(ro, r))
    if out is None:
        out = _even_python(ix.parent, ix.length_list, ix.seg_pairs.tolist(), ix.seg_logits.tolist(),
                           ix.sub_size_list, rep, slot, [m.owned.tolist() for m in mbs],
                           [m.recomputed.tolist() for m in mbs], cost, is_prod, pinned, reads, dp, S, M, coef,
                           EVEN_MOVES, EVEN_SLOTS, EVEN_WEIGHT, spend)
    moved, owns, recs = out
    if not moved:
        return None
    groups = [(np.asarray(o, dtype=np.int64), np.asarray(r, dtype=np.int64)) for o, r in zip(owns, recs)]
    try:
        even = assemble_plan(ix, groups, list(zip(rep, slot)), planner=plan.planner, dp=dp, row_budget=M,
                             cost_model=model)
    except PlanningError:
        return None
    tau = float(sum(cost)) / (dp * S)
    c_even, c_plan = even.cost_matrix(), plan.cost_matrix()
    if even.num_slots != S or even_objective(c_even, EVEN_WEIGHT, tau) >= even_objective(c_plan, EVEN_WEIGHT, tau):
        return None
    if even.tokens_computed > plan.tokens_computed and \
            float(c_even.max(axis=0).sum()) >= float(c_plan.max(axis=0).sum()):
        return None  # tokens spent without shortening the step
    return even


def _split(off: np.ndarray, ids: np.ndarray) -> List[Sequence[int]]:
    o, v = off.tolist(), ids.tolist()
    return [v[o[j]:o[j + 1]] for j in range(len(o) - 1)]
