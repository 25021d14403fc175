"""L2: cross-microbatch sharing, placement on DP replicas in aligned slots, and ordering.

Input: an L1 plan.  Its recomputed segments are the shared prefixes (computed in two or more
L1 microbatches).  L2

1. *decides producers*: per tree, the shared prefix becomes produced (computed once, read by
   consumers) when it has at least ``min_producer_rows`` rows and that computes fewer tokens
   than L1's recomputation (rows saved against KDA replay added at external roots); otherwise
   the tree keeps L1's pieces (recomputed ancestors).  A shared segment is owned by the first
   L1 microbatch (index order) that computes it, so owners along a root path never go back in
   that order: the producer graph is acyclic.
2. *cuts the work into atoms* that move between microbatches: a produced tree's connected
   shared segments of one owner (producer atoms) and the maximal private subtrees hanging
   below them (consumer atoms); an atom's parent atom holds its root's parent segment.  Atoms
   costing more than ``granularity`` times the mean microbatch cost are cut further at their
   root (the root becomes a producer atom of its own, its child subtrees consumer atoms),
   which is free in rows and gives the balancer small pieces.
3. *places and orders*: slots are filled one after another; an atom is ready in slot ``k`` when
   its parent atom sits in an earlier slot (then it reads the parent's exports) or in the same
   microbatch (then the rows are local).  Each slot takes ready atoms, oldest open tree first
   (consumers drain soon after their producer: short retention), largest first, each into the
   least-loaded of the slot's ``dp`` microbatches with room for its rows and cost under the
   slot target (the remaining cost spread over the remaining slots).  Then, per slot, atoms
   move from the costliest microbatch to the cheapest while that lowers the slot maximum.
   The number of slots tried starts at the row lower bound (at least two when trees have
   producers and ``dp > 1``: one slot leaves a producer no consumer slot); the fill with
   the best estimated step efficiency is kept.
4. *few slots* (at most ``FEW_SLOTS`` slots of work per replica and ``dp > 1``, e.g. a batch of
   5 microbatches of work on 8 replicas): the last slot takes whole subtrees, coarse against
   a slot, and how well they pack depends on where the earlier slots cut the trees; the best
   slot count is filled again with other slot targets (``FILL_VARIANTS``: tolerance and
   reserve) until the estimated step efficiency (per-microbatch overheads included) reaches
   ``GOOD_ENOUGH``; the best fill wins.

5. *executable windows*: the window schedule (``microbatch.replica_windows``) reads a
   consumer's context only from one earlier microbatch of the same replica that is not itself
   a consumer, and recomputes any other.  The fill of steps 3-4 plans chains and producers on
   other replicas, so its plan is judged as the schedule runs it (``as_executed``).  The
   window packer (``window_units``, ``pack_windows``) plans only windows that run: per
   produced tree one core (its shared prefix, or the most shared top of it that fits the
   budget) owned by one producer that reads nothing; the subtrees below the core are items,
   each in the producer, in a later microbatch of the producer's replica that reads no other
   producer, or anywhere else with its root path recomputed.  Its plans for a few slot counts
   and targets are candidates beside the executed fill.

L2 never computes more tokens than its L1 input, and its plan never has a longer modelled
step (sum over slots of the costliest microbatch) than L1's: the candidate with the shortest
modelled step (then the fewest tokens) among those computing no more tokens than L1 wins,
else (tiny trees where replay outweighs the rows saved; batches so small that a producer
slot would idle most replicas) the L1 microbatches are returned with L1's placement.  Every
window of the result runs as planned: its compression, costs and balance are the step's.
"""
from __future__ import annotations

import dataclasses
import math
import time
from bisect import bisect_left
from typing import Dict, List, Optional, Tuple

import numpy as np

from .compiled import compiled
from .cost_model import CostFeatures, CostModel, ForestIndex
from .l1 import plan_l1
from .microbatch import MicrobatchPlan, PlanningError, assemble_plan, gc_paused

#: (tolerance, reserve) slot targets of the fill: the first is the default; batches with at
#: most ``FEW_SLOTS`` slots of work per replica (and dp > 1) try the others at the best slot
#: count (step 4 of the module docstring)
FILL_VARIANTS = ((0.01, 0.85), (0.005, 1.0), (0.02, 1.2))
FEW_SLOTS = 2
#: estimated step efficiency at which the other fill targets are not tried
GOOD_ENOUGH = 0.985

__all__ = ["plan_l2", "plan_harts", "Atoms", "build_atoms", "fill_slots", "FillInputs", "prepare_atoms",
           "fill_plan", "fill_step_tokens", "step_tokens_of_features"]


class Atoms:
    """Units L2 moves: ``segs[a]`` owned (sorted), ``rec[a]`` recomputed, ``parent[a]`` the
    atom holding its root's parent segment (-1: none), ``tree[a]``, ``rows[a]``, ``cost[a]``
    (cost model without the per-microbatch and per-call terms)."""

    def __init__(self):
        self.segs: List[List[int]] = []
        self.rec: List[List[int]] = []
        self.parent: List[int] = []
        self.tree: List[int] = []
        self.rows: List[int] = []
        self.cost: List[float] = []

    def add(self, segs, rec, parent, tree) -> int:
        self.segs.append(segs)
        self.rec.append(rec)
        self.parent.append(parent)
        self.tree.append(tree)
        self.rows.append(0)
        self.cost.append(0.0)
        return len(self.segs) - 1

    def add_costed(self, segs, rec, parent, tree, rows, cost) -> int:
        """``add`` with the atom's rows and cost."""
        self.segs.append(segs)
        self.rec.append(rec)
        self.parent.append(parent)
        self.tree.append(tree)
        self.rows.append(rows)
        self.cost.append(cost)
        return len(self.cost) - 1

    def __len__(self):
        return len(self.segs)

    def children(self) -> List[List[int]]:
        kids: List[List[int]] = [[] for _ in range(len(self))]
        for a, p in enumerate(self.parent):
            if p >= 0:
                kids[p].append(a)
        return kids


class _SegCosts:
    """Per-segment terms of an atom's cost as plain lists (atoms are small: list sums beat
    numpy calls): ``body`` = rows + attention pairs, ``own`` = body + logits rows."""

    def __init__(self, ix: ForestIndex, model: CostModel):
        c = model.coefficients
        body = c.row * ix.length + c.attention_pair * ix.seg_pairs
        self.body = body.tolist()
        self.own = (body + c.logits_row * ix.seg_logits).tolist()
        self.length = ix.length.tolist()
        self.start = ix.start.tolist()
        self.replay = c.kda_replay_token
        self.B = model.chunk_size
        self.sub_size = ix.sub_size.tolist()
        self.sub_rows = ix.sub_rows.tolist()
        # cost of every segment's whole subtree (owned): children have larger ids
        sub_own = list(self.own)
        par = ix.parent
        for x in range(len(sub_own) - 1, -1, -1):
            q = par[x]
            if q >= 0:
                sub_own[q] += sub_own[x]
        self.sub_own = sub_own

    def atom(self, segs, rec, has_parent: bool) -> Tuple[int, float]:
        """(rows, cost) of an atom owning ``segs`` (first = root) and recomputing ``rec``."""
        length, own, body = self.length, self.own, self.body
        rows = sum([length[s] for s in segs])
        cost = sum([own[s] for s in segs])
        if rec:
            rows += sum([length[s] for s in rec])
            cost += sum([body[s] for s in rec])
        if has_parent:
            cost += self.replay * (self.start[segs[0]] % self.B)
        return rows, cost


def build_atoms(ix: ForestIndex, l1: MicrobatchPlan, model: CostModel,
                min_producer_rows: int) -> Tuple[Atoms, np.ndarray]:
    """Steps 1 and 2 (before granularity cuts).  Returns the atoms and, per tree, whether its
    shared prefix is produced."""
    # plain lists: per-segment Python loops (numpy scalar indexing costs more than the work)
    S = ix.num_segments
    count = [0] * S
    first = [len(l1.microbatches)] * S
    mb_lists = []
    for m in l1.microbatches:  # index order: the first to compute a segment sets ``first``
        own, rec = m.owned.tolist(), m.recomputed.tolist()
        mb_lists.append((own, rec))
        for x in own + rec:  # disjoint
            count[x] += 1
            if first[x] > m.index:
                first[x] = m.index
    shared = [c >= 2 for c in count]
    B = model.chunk_size
    par = ix.parent
    tree_of = ix.seg_tree.tolist()
    offs = ix.tree_offsets.tolist()
    length, start = ix.length_list, ix.start_list
    produce = np.zeros(ix.num_trees, dtype=bool)
    for t in range(ix.num_trees):
        a, b = offs[t], offs[t + 1]
        if not any(shared[a:b]):
            continue
        shared_rows = recompute = produced = 0
        for s in range(a, b):
            ln = length[s]
            if shared[s]:
                shared_rows += ln
            recompute += count[s] * ln
            produced += ln
            p = par[s]
            if p >= 0 and shared[p] and (not shared[s] or first[s] != first[p]):
                produced += start[s] % B
        produce[t] = shared_rows >= min_producer_rows and produced < recompute
    produce_l = produce.tolist()
    # the L1 pieces of trees that keep recomputation: (owned, recomputed) per microbatch
    kept: Dict[int, List[Tuple[List[int], List[int]]]] = {}
    for own, rec in mb_lists:
        for t in sorted({tree_of[x] for x in own}):
            if not produce_l[t]:
                kept.setdefault(t, []).append(([x for x in own if tree_of[x] == t],
                                               [x for x in rec if tree_of[x] == t]))
    atoms = Atoms()
    atom_of = [-1] * S
    for t in range(ix.num_trees):
        a, b = offs[t], offs[t + 1]
        if not produce_l[t]:
            for own, rec in kept.get(t, ()):
                atoms.add(own, rec, -1, t)
            continue
        for s in range(a, b):
            p = par[s]
            if shared[s]:
                if p >= 0 and first[p] == first[s]:
                    x = atom_of[p]
                    atoms.segs[x].append(s)
                else:
                    x = atoms.add([s], [], atom_of[p] if p >= 0 else -1, t)
            else:
                if p >= 0 and not shared[p]:
                    x = atom_of[p]
                    atoms.segs[x].append(s)
                else:
                    x = atoms.add([s], [], atom_of[p] if p >= 0 else -1, t)
            atom_of[s] = x
    return atoms, produce


def _cut(ix: ForestIndex, sc: _SegCosts, atoms: Atoms, threshold: float) -> Atoms:
    """Step 2's granularity cuts: an atom (without recomputed segments) costing more than
    ``threshold`` and holding more than one segment becomes its root segment plus one atom
    per child subtree inside it, recursively.  Owned segments are unchanged.  Needs the
    atoms' ``rows`` and ``cost``; atoms come parents first, and so do the cut ones."""
    out = Atoms()
    new_id: Dict[int, int] = {}
    piece_of: Dict[int, int] = {}  # segment of a cut atom -> the piece that owns it
    cut = set()
    par = ix.parent
    length, own, start = sc.length, sc.own, sc.start
    sub_size, sub_rows, sub_own = sc.sub_size, sc.sub_rows, sc.sub_own
    replay, B = sc.replay, sc.B
    for a in range(len(atoms)):
        p = atoms.parent[a]
        segs, rec = atoms.segs[a], atoms.rec[a]
        if p < 0:
            parent = -1
        elif p in cut:  # hang below the piece holding the root's parent segment
            parent = piece_of[par[segs[0]]]
        else:
            parent = new_id[p]
        if rec or atoms.cost[a] <= threshold or len(segs) == 1:
            new_id[a] = out.add_costed(segs, rec, parent, atoms.tree[a], atoms.rows[a], atoms.cost[a])
            continue
        cut.add(a)
        tree = atoms.tree[a]
        r0 = segs[0]
        if len(segs) == sub_size[r0]:  # a whole subtree (consumer atoms): forest sums, id ranges
            sub_c, sub_r = sub_own, sub_rows

            def kids_of(r):
                return ix.children[r]

            def piece(r):
                return list(range(r, r + sub_size[r]))
        else:  # within-atom subtree sums (segments sorted in preorder: children after parents)
            inset = set(segs)
            sub_c = {x: own[x] for x in segs}
            sub_r = {x: length[x] for x in segs}
            kids: Dict[int, List[int]] = {}
            for x in reversed(segs):
                q = par[x]
                if q in inset:
                    sub_c[q] += sub_c[x]
                    sub_r[q] += sub_r[x]
                    kids.setdefault(q, []).insert(0, x)

            def kids_of(r):
                return kids.get(r, ())

            def piece(r):
                return segs[bisect_left(segs, r):bisect_left(segs, r + sub_size[r])]
        # stack of (root segment, parent atom id); the original atom's root comes first
        stack = [(r0, parent)]
        while stack:
            r, pa = stack.pop()
            rep = replay * (start[r] % B) if pa >= 0 else 0.0
            ch = kids_of(r)
            if not ch or sub_c[r] + rep <= threshold:
                ss = piece(r) if ch else [r]
                x = out.add_costed(ss, [], pa, tree, sub_r[r], sub_c[r] + rep)
            else:
                ss = [r]
                x = out.add_costed(ss, [], pa, tree, length[r], own[r] + rep)
                for c in ch:  # popped last child first
                    stack.append((c, x))
            for y in ss:
                piece_of[y] = x
            if r == r0:
                new_id[a] = x
    return out


def _subtree_stats(atoms: Atoms, kids: List[List[int]]):
    """Per atom: (atoms on the longest chain below it, cost and rows of it with all its
    descendants).  Children's sums are added in child order, one by one (the float sums do not
    depend on the Python version)."""
    n = len(atoms)
    cost, rows, parent = atoms.cost, atoms.rows, atoms.parent
    height = [0] * n
    if all(parent[a] < a for a in range(n)):  # parents first (every atom list L2 builds): by index
        order = range(n)
    else:
        order = []
        stack = [a for a in range(n) if parent[a] < 0]
        while stack:
            a = stack.pop()
            order.append(a)
            stack.extend(kids[a])
    below = list(cost)
    rows_below = list(rows)
    for a in reversed(order):
        ks = kids[a]
        if ks:
            h = t = 0
            tc = 0.0
            for c in ks:
                if height[c] > h:
                    h = height[c]
                tc += below[c]
                t += rows_below[c]
            height[a] = 1 + h
            below[a] += tc
            rows_below[a] += t
    return height, below, rows_below


def _fill(atoms: Atoms, kids: List[List[int]], dp: int, M: int, S: int,
          tree_rank: np.ndarray, recompute=None, eps: float = 0.01, reserve: float = 0.85,
          stats=None):
    """Slot-by-slot fill (step 3).  Returns per atom its slot and microbatch, the estimated
    loads and members per slot, and the ancestors recomputed for atoms placed by recomputation.

    ``recompute(a, have)`` -> (segments, rows, cost) of the ancestors of atom ``a`` missing from
    a microbatch computing ``have``: when a slot (not the last) still has a microbatch under
    its target after the ready atoms, an atom whose parent runs in the same slot elsewhere may
    go there with its ancestors recomputed (overhead at most the cost of its subtree, which
    follows it into that microbatch as far as it fits).  ``stats``: ``_subtree_stats`` of the
    atoms (computed when not given).
    """
    n = len(atoms)
    cost, rows, parent, tree = atoms.cost, atoms.rows, atoms.parent, atoms.tree
    slot_of = [-1] * n
    mb_of = [-1] * n
    height, below, rows_below = stats if stats is not None else _subtree_stats(atoms, kids)
    remaining = float(sum(cost))
    extra: Dict[int, List[int]] = {}
    pending = [a for a in range(n) if parent[a] < 0]
    opened: Dict[int, int] = {}
    k = 0
    loads_all: List[List[float]] = []
    members_all: List[List[List[int]]] = []
    placed = 0
    while placed < n:
        left = S - k
        if left > 1 and dp > 1:
            # the last planned slot is planned lighter (``reserve``): it takes whatever is left
            # and must not spill past the plan for want of rows
            tau = remaining / (dp * (left - 1 + reserve))
            hi, lo = tau * (1.0 + eps), tau * (1.0 - eps)
        else:  # one replica (no balance to keep: fill by rows) or the last planned slot,
            # which takes everything left, least-loaded first (LPT)
            hi = lo = math.inf
        big = len(opened)
        # atoms with a chain of atoms below them as long as the slots left go first (else the
        # chain spills past the planned slots), then the oldest open tree, then the largest
        if left <= 1 and dp > 1:  # the last slot packs whole subtrees: largest first (LPT)
            pending.sort(key=lambda a: -below[a])
        else:
            pending.sort(key=lambda a: (height[a] + 1 < left, opened.get(tree[a], big + int(tree_rank[tree[a]])),
                                        -cost[a]))
        loads = [0.0] * dp
        rws = [0] * dp
        members: List[List[int]] = [[] for _ in range(dp)]
        have: List[set] = [set() for _ in range(dp)]
        nxt: List[int] = []
        full = 0
        track = recompute is not None and dp > 1 and left > 1  # ``have`` serves recomputation

        def run_queue(queue):
            """Place atoms (``(atom, only_mb)``, LIFO); a placed atom's children follow into its
            microbatch; whatever does not fit is ready in the next slot."""
            nonlocal full, placed, remaining
            while queue:
                a, only = queue.pop()
                # in the last planned slot an atom goes with all its descendants (a bundle), so
                # that nothing spills past the plan; past it, atoms go one by one
                whole = left == 1 and kids[a]
                bc, br = (below[a], rows_below[a]) if whole else (cost[a], rows[a])
                best = -1
                cands = (only,) if only >= 0 else range(dp)
                for b in cands:
                    if rws[b] + br > M:
                        continue
                    if loads[b] > 0 and loads[b] + bc > hi:
                        continue
                    if best < 0 or loads[b] < loads[best]:
                        best = b
                if best < 0:
                    nxt.append(a)  # an atom whose parent is in this slot is ready in the next
                    continue
                was_full = loads[best] >= lo
                bundle = [a]
                if whole:
                    i = 0
                    while i < len(bundle):
                        bundle.extend(kids[bundle[i]])
                        i += 1
                for x in bundle:
                    members[best].append(x)
                    slot_of[x] = k
                    mb_of[x] = best
                    if track:
                        have[best].update(atoms.segs[x])
                loads[best] += bc
                rws[best] += br
                if not was_full and loads[best] >= lo:
                    full += 1
                placed += len(bundle)
                remaining -= bc
                if tree[a] not in opened:
                    opened[tree[a]] = len(opened)
                if len(bundle) == 1:
                    for c in kids[a]:
                        queue.append((c, best))

        for a0 in pending:
            if full == dp:
                nxt.append(a0)
                continue
            run_queue([(a0, -1)])
        if recompute is not None and dp > 1 and left > 1 and full < dp:
            blocked = sorted((a for a in nxt if parent[a] >= 0 and slot_of[parent[a]] == k),
                             key=lambda a: -below[a])
            for a in blocked:
                if slot_of[a] >= 0:
                    continue
                under = sorted((b for b in range(dp) if loads[b] < lo), key=lambda b: loads[b])
                if not under:
                    break
                for b in under:
                    if loads[b] + cost[a] > hi or rws[b] + rows[a] > M:
                        continue
                    segs, r_add, c_add = recompute(a, have[b])
                    if c_add > below[a] or rws[b] + rows[a] + r_add > M or loads[b] + cost[a] + c_add > hi:
                        continue
                    was_full = loads[b] >= lo
                    members[b].append(a)
                    slot_of[a], mb_of[a] = k, b
                    have[b].update(atoms.segs[a])
                    have[b].update(segs)
                    extra[a] = segs
                    loads[b] += cost[a] + c_add
                    rws[b] += rows[a] + r_add
                    if not was_full and loads[b] >= lo:
                        full += 1
                    placed += 1
                    remaining -= cost[a]
                    run_queue([(c, b) for c in kids[a]])  # its subtree follows where it fits
                    break
            nxt = [a for a in nxt if slot_of[a] < 0]
        # atoms whose parent landed in this slot but were not queued (full slot) become ready
        pending = nxt
        if k > 4 * (S + n):
            raise AssertionError("L2 fill made no progress")  # a bug, never a silent loop
        loads_all.append(loads)
        members_all.append(members)
        k += 1
    return slot_of, mb_of, loads_all, members_all, extra


def _rebalance(atoms: Atoms, kids: List[List[int]], slot_of, mb_of, loads_all, members_all,
               M: int, extra, rounds: int = 64) -> None:
    """Per slot, move or swap *local groups* (an atom with its descendants in the same
    microbatch and slot) between the costliest microbatch and the cheapest one that can take
    them while the slot's maximum drops.  A group moves only where its root's parent atom is in an earlier slot or
    in the target microbatch; the row budget is kept."""
    cost, rows, parent = atoms.cost, atoms.rows, atoms.parent

    cache: Dict[Tuple[int, int], list] = {}

    def groups(k, b):
        """Local groups of microbatch ``b`` of slot ``k`` (cached until it changes)."""
        got = cache.get((k, b))
        if got is None:
            got = cache[(k, b)] = _groups(k, b)
        return got

    def _groups(k, b):
        out = []
        if extra and any(a in extra for a in members_all[k][b]):
            return out  # what the recomputed ancestors stop at must stay
        for a in members_all[k][b]:
            p = parent[a]
            if (p >= 0 and slot_of[p] == k and mb_of[p] == b) or a in extra:
                continue  # a local child moves with its parent; recomputing atoms stay
            g, i = [a], 0
            while i < len(g):
                g.extend(x for x in kids[g[i]] if slot_of[x] == k and mb_of[x] == b)
                i += 1
            gc = 0.0  # sequential sum, as the compiled core adds (sum() compensates on Python >= 3.12)
            for x in g:
                gc += cost[x]
            out.append((g, gc, sum(rows[x] for x in g), p))
        return out

    def movable(p, k, b):
        return p < 0 or slot_of[p] < k or (slot_of[p] == k and mb_of[p] == b)

    for k, (loads, members) in enumerate(zip(loads_all, members_all)):
        dp = len(loads)
        if dp < 2:
            continue
        rws = [sum(rows[a] for a in mem) for mem in members]
        for _ in range(rounds):
            bmax = max(range(dp), key=lambda b: loads[b])
            hi_load = loads[bmax]
            gmax = groups(k, bmax)
            best = None
            # the cheapest microbatch first; another one when rows leave the cheapest no room
            for bmin in sorted(range(dp), key=lambda b: loads[b]):
                if bmin == bmax or hi_load - loads[bmin] <= 0:
                    break
                gmin = groups(k, bmin)
                best_new = hi_load - 1e-12 * max(1.0, hi_load)
                for gx, cx, rx, px in gmax:
                    if not movable(px, k, bmin):
                        continue
                    if rws[bmin] + rx <= M:
                        new = max(hi_load - cx, loads[bmin] + cx)
                        if new < best_new:
                            best, best_new = (gx, None), new
                    for gy, cy, ry, py in gmin:
                        if cy >= cx or not movable(py, k, bmax):
                            continue
                        if rws[bmin] + rx - ry > M or rws[bmax] - rx + ry > M:
                            continue
                        new = max(hi_load - cx + cy, loads[bmin] + cx - cy)
                        if new < best_new:
                            best, best_new = (gx, gy), new
                if best is not None:
                    break
            if best is None:
                break
            cache.pop((k, bmax), None)
            cache.pop((k, bmin), None)
            for g, src, dst in ((best[0], bmax, bmin), (best[1], bmin, bmax)):
                if g is None:
                    continue
                for a in g:
                    members[src].remove(a)
                    members[dst].append(a)
                    mb_of[a] = dst
                    loads[src] -= cost[a]
                    loads[dst] += cost[a]
                    rws[src] -= rows[a]
                    rws[dst] += rows[a]


def _compact(atoms: Atoms, kids: List[List[int]], slot_of, mb_of, loads_all, members_all,
             M: int, extra, tol: float = 0.01) -> None:
    """Dissolve the last slot into holes of earlier slots when all of its atoms fit there.

    An atom moves to slot ``j`` only where its parent atom is in an earlier slot or in the
    target microbatch, the rows fit, and the target's load stays within ``(1 + tol)`` of slot
    ``j``'s maximum (holes are filled, no slot gets slower by more than ``tol``).  Its
    children, all in the last slot, then read it from slot ``j``.  Repeats while it succeeds.
    """
    cost, rows, parent = atoms.cost, atoms.rows, atoms.parent
    while len(loads_all) > 1:
        L = len(loads_all) - 1
        todo = [a for mem in members_all[L] for a in mem]
        if any(a in extra for a in todo):
            return
        depth = {}
        for a in todo:
            d, x = 0, parent[a]
            while x >= 0 and slot_of[x] == L:
                d += 1
                x = parent[x]
            depth[a] = d
        todo.sort(key=lambda a: (depth[a], -cost[a]))
        caps = [max(l) * (1.0 + tol) for l in loads_all[:L]]
        rws = [[sum(rows[a] for a in mem) for mem in members_all[j]] for j in range(L)]
        moves = []
        ok = True
        for a in todo:
            p = parent[a]
            best, best_left = None, None
            for j in range(L - 1, -1, -1):
                if p >= 0 and slot_of[p] > j:
                    break
                loads = loads_all[j]
                for b in range(len(loads)):
                    if p >= 0 and slot_of[p] == j and mb_of[p] != b:
                        continue
                    left = caps[j] - loads[b] - cost[a]
                    if left < 0 or rws[j][b] + rows[a] > M:
                        continue
                    if best is None or left < best_left:
                        best, best_left = (j, b), left
            if best is None:
                ok = False
                break
            j, b = best
            moves.append((a, slot_of[a], mb_of[a], j, b))
            loads_all[j][b] += cost[a]
            rws[j][b] += rows[a]
            members_all[j][b].append(a)
            slot_of[a], mb_of[a] = j, b
        if not ok:
            for a, k0, b0, j, b in reversed(moves):
                loads_all[j][b] -= cost[a]
                members_all[j][b].remove(a)
                slot_of[a], mb_of[a] = k0, b0
            return
        loads_all.pop()
        members_all.pop()


_L2_FILL = compiled("l2_fill")
#: the window packer's slot counts above its row bound, and its microbatch target tolerances
WINDOW_EXTRA_SLOTS = 2
WINDOW_TOLERANCES = (0.01, 0.05)
#: the last slot dissolves into earlier slots' holes within this tolerance (``_compact``)
COMPACT_TOL = 0.01
#: moves or swaps per slot in ``_rebalance``
REBALANCE_ROUNDS = 64


def _recompute_fn(ix: ForestIndex, atoms: Atoms, seg_cost: List[float]):
    """``recompute(a, have)`` of ``_fill``: (segments, rows, cost) of the ancestors of atom ``a``
    that a microbatch computing the segments ``have`` lacks (nearest first)."""
    parent_seg, seg_len = ix.parent, ix.length_list

    def recompute(a, have):
        segs = []
        r, cost = 0, 0.0
        x = parent_seg[atoms.segs[a][0]]
        while x >= 0 and x not in have:
            segs.append(x)
            r += seg_len[x]
            cost += seg_cost[x]
            x = parent_seg[x]
        return segs, r, cost

    return recompute


class FillInputs:
    """The atoms, their children and statistics as the arrays ``_C.l2_fill`` reads (built once
    per L2 plan, shared by every fill)."""

    def __init__(self, ix: ForestIndex, atoms: Atoms, kids: List[List[int]], stats, tree_rank: np.ndarray,
                 seg_cost: List[float]):
        height, below, rows_below = stats
        n = len(atoms)
        kid_off = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([len(k) for k in kids], out=kid_off[1:])
        seg_off = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([len(x) for x in atoms.segs], out=seg_off[1:])
        rec_off = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([len(x) for x in atoms.rec], out=rec_off[1:])
        flat_kids = [c for k in kids for c in k]
        flat_segs = [x for ss in atoms.segs for x in ss]
        flat_rec = [x for ss in atoms.rec for x in ss]
        self.arrays = (np.asarray(atoms.parent, dtype=np.int64), np.asarray(atoms.cost, dtype=np.float64),
                       np.asarray(atoms.rows, dtype=np.int64), np.asarray(atoms.tree, dtype=np.int64),
                       kid_off, np.asarray(flat_kids, dtype=np.int64), seg_off,
                       np.asarray(flat_segs, dtype=np.int64), np.asarray(height, dtype=np.int64),
                       np.asarray(below, dtype=np.float64), np.asarray(rows_below, dtype=np.int64),
                       np.asarray(tree_rank, dtype=np.int64), ix.parent_arr, ix.length,
                       np.asarray(seg_cost, dtype=np.float64))
        self.feature_arrays = (rec_off, np.asarray(flat_rec, dtype=np.int64), ix.start, ix.seg_pairs, ix.seg_logits)
        self.remaining = float(sum(atoms.cost))


def fill_slots(ix: ForestIndex, atoms: Atoms, kids: List[List[int]], dp: int, M: int, S: int,
               tree_rank: np.ndarray, seg_cost: List[float], *, eps: float, reserve: float, stats,
               chunk_size: int = 64, compiled: bool = True, inputs: Optional[FillInputs] = None):
    """Step 3 for ``S`` planned slots: ``_fill`` (with recomputation), ``_compact`` and
    ``_rebalance``.  Returns (slot_of, mb_of, loads per slot, members per slot, extra, features).
    The compiled ``_C.l2_fill`` runs when built and ``compiled``; the Python functions are its
    reference (same outputs, floats included: a test holds them equal).  ``features``: the
    compiled path's int64[slots, dp, 6] cost features of every microbatch of the fill (KDA
    chunk ``chunk_size``; ``fill_step_tokens`` computes the same numbers), None otherwise."""
    global _L2_FILL
    if compiled and _L2_FILL is not None:
        inp = inputs if inputs is not None else FillInputs(ix, atoms, kids, stats, tree_rank, seg_cost)
        try:
            return tuple(_L2_FILL(*inp.arrays, dp, M, S, eps, reserve, inp.remaining, True, COMPACT_TOL,
                                  REBALANCE_ROUNDS, *inp.feature_arrays, chunk_size))
        except TypeError:  # a different compiled signature: the Python path
            _L2_FILL = None
    slot_of, mb_of, loads_all, members_all, extra = _fill(
        atoms, kids, dp, M, S, tree_rank, _recompute_fn(ix, atoms, seg_cost), eps=eps, reserve=reserve, stats=stats)
    _compact(atoms, kids, slot_of, mb_of, loads_all, members_all, M, extra, tol=COMPACT_TOL)
    _rebalance(atoms, kids, slot_of, mb_of, loads_all, members_all, M, extra, rounds=REBALANCE_ROUNDS)
    return slot_of, mb_of, loads_all, members_all, extra, None


def step_tokens_of_features(feats: np.ndarray, model: CostModel, M: int) -> Tuple[float, int]:
    """``fill_step_tokens`` from the compiled fill's features (int64[slots, dp, 6]; an empty
    microbatch is all zeros): the same costs, slot compaction and sums, hence the same floats."""
    S, dp = feats.shape[0], feats.shape[1]
    rows = feats[:, :, 0]
    used = [k for k in range(S) if rows[k].any()]
    cm = np.zeros((dp, len(used)), dtype=np.float64)
    tokens = 0
    for j, k in enumerate(used):
        for b, row in enumerate(feats[k].tolist()):
            if row[0] == 0:
                continue
            f = CostFeatures(*row)
            if f.rows > M:
                raise PlanningError(f"harts_l1l2: a microbatch has {f.rows} rows, over the row budget {M}")
            cm[b, j] = model.cost(f)
            tokens += f.rows + f.replay_tokens
    return (float(cm.max(axis=0).sum()) if cm.size else 0.0), tokens


def _score(loads_all, overhead: float = 0.0) -> Tuple[float, float]:
    """(step efficiency, mean slot balance) of a fill, by estimated loads; every microbatch
    with work also pays ``overhead`` (the per-microbatch terms the atom costs leave out)."""
    means = maxes = 0.0
    bal = []
    for l in loads_all:
        l = [x + overhead if x > 0 else 0.0 for x in l]
        mx = max(l)
        mean = sum(l) / len(l)
        means += mean
        maxes += mx
        if mx > 0:
            bal.append(mean / mx)
    return (means / maxes if maxes > 0 else 1.0, sum(bal) / len(bal) if bal else 1.0)


class Prepared:
    """Steps 1-2 of an L2 plan: ``atoms`` (granularity cuts done), their ``kids`` and
    ``stats`` (``_subtree_stats``), ``tree_rank`` (trees by decreasing cost), ``seg_cost``
    (row + attention cost per segment), ``produce`` (per tree) and ``S0`` (the slot lower
    bound from rows)."""

    def __init__(self, atoms, kids, stats, tree_rank, seg_cost, produce, S0):
        self.atoms, self.kids, self.stats, self.tree_rank = atoms, kids, stats, tree_rank
        self.seg_cost, self.produce, self.S0 = seg_cost, produce, S0


def prepare_atoms(ix: ForestIndex, l1: MicrobatchPlan, model: CostModel, granularity: float,
                  min_producer_rows: int) -> Prepared:
    """Producers, atoms and granularity cuts of ``l1`` (steps 1-2 of the module docstring)."""
    dp, M = l1.num_replicas, l1.row_budget
    base, produce = build_atoms(ix, l1, model, min_producer_rows)
    sc = _SegCosts(ix, model)
    for a in range(len(base)):
        base.rows[a], base.cost[a] = sc.atom(base.segs[a], base.rec[a], base.parent[a] >= 0)
    total_rows = sum(base.rows)
    S0 = max(1, math.ceil(math.ceil(total_rows / M) / dp))
    tau0 = sum(base.cost) / (dp * S0)
    atoms = _cut(ix, sc, base, granularity * tau0)
    kids = atoms.children()
    tree_cost = np.zeros(ix.num_trees)
    np.add.at(tree_cost, np.asarray(atoms.tree, dtype=np.int64), np.asarray(atoms.cost))
    tree_rank = np.empty(ix.num_trees, dtype=np.int64)
    tree_rank[np.argsort(-tree_cost, kind="stable")] = np.arange(ix.num_trees)
    c = model.coefficients
    seg_cost = (c.row * ix.length + c.attention_pair * ix.seg_pairs).tolist()
    return Prepared(atoms, kids, _subtree_stats(atoms, kids), tree_rank, seg_cost, produce, S0)


@gc_paused
def plan_l2(forest, l1: MicrobatchPlan, *, cost_model: Optional[CostModel] = None,
            index: Optional[ForestIndex] = None, granularity: float = 0.1,
            min_producer_rows: Optional[int] = None, extra_slots: int = 2,
            compiled: bool = True) -> MicrobatchPlan:
    """Refine an L1 plan (module docstring).  ``plan_seconds`` counts L2 alone.

    ``granularity``: atoms costing more than this fraction of the mean microbatch cost are cut
    (> 0).  ``min_producer_rows``: a tree's shared prefix shorter than this stays recomputed
    (default: the KDA chunk size).  ``extra_slots``: slot counts tried above the row bound.
    ``compiled``: use the compiled fill (``_C.l2_fill``) when built; False runs the Python
    reference (the same plan).
    """
    t0 = time.perf_counter()
    if l1.mode != "tree":
        raise ValueError("L2 refines a tree-mode (L1) plan")
    model = cost_model or l1.cost_model
    ix = index if index is not None else ForestIndex(forest)
    if not granularity > 0:
        raise ValueError(f"granularity must be > 0, got {granularity}")
    dp, M = l1.num_replicas, l1.row_budget
    mpr = model.chunk_size if min_producer_rows is None else int(min_producer_rows)
    prep = prepare_atoms(ix, l1, model, granularity, mpr)
    atoms, kids, stats, tree_rank, seg_cost, produce, S0 = (
        prep.atoms, prep.kids, prep.stats, prep.tree_rank, prep.seg_cost, prep.produce, prep.S0)
    best = None
    # few microbatches of work per replica (at most FEW_SLOTS slots, step 4 of the module
    # docstring): other slot targets are tried at the best slot count
    few = dp > 1 and S0 <= FEW_SLOTS
    overhead = model.coefficients.microbatch + model.coefficients.kda_call

    fills = []  # few-slot batches: every fill, judged by its assembled plan below
    inputs = FillInputs(ix, atoms, kids, stats, tree_rank, seg_cost) if compiled and _L2_FILL is not None else None

    def attempt(S, eps, reserve):
        nonlocal best
        slot_of, mb_of, loads_all, members_all, extra, feats = fill_slots(
            ix, atoms, kids, dp, M, S, tree_rank, seg_cost, eps=eps, reserve=reserve, stats=stats,
            chunk_size=model.chunk_size, compiled=compiled, inputs=inputs)
        score = _score(loads_all, overhead)
        key = (score[0], -len(loads_all))
        if best is None or key > best[0]:
            best = (key, members_all, extra, S, feats)
        if few:
            fills.append((members_all, extra, feats))
        return len(loads_all)

    # one slot leaves producers no consumer slot: with producers and replicas to spread over,
    # start at two (a plan without producers is L1's, which the guard below keeps if better)
    S_first = max(S0, 2) if dp > 1 and produce.any() else S0
    for S in range(S_first, S0 + 1 + max(0, extra_slots)):
        if attempt(S, *FILL_VARIANTS[0]) <= S:
            break  # more slots would only spread the same work thinner
    if few:
        # few microbatches of work per replica: the last slot's whole subtrees are coarse
        # against a slot, so the best slot count is filled again with other slot targets; the
        # estimate misses per-microbatch KDA calls and replay, so every fill is judged by its
        # exact modelled step (``fill_step_tokens``: its plan's numbers without building it)
        # and the shortest wins among those computing no more tokens than L1 (then the fewest
        # tokens, then the earliest fill); only the winner is assembled
        S_best = best[3]
        for eps, reserve in FILL_VARIANTS[1:]:
            if best[0][0] >= GOOD_ENOUGH:
                break
            attempt(S_best, eps, reserve)
    else:
        fills = [(best[1], best[2], best[4])]
    if model != l1.cost_model:  # judge L1's microbatches with this cost model
        groups = [(m.owned, m.recomputed) for m in l1.microbatches]
        placement = [(m.replica, m.slot) for m in l1.microbatches]
        keep = assemble_plan(ix, groups, placement, planner="harts_l1l2", dp=dp, row_budget=M, cost_model=model)
    else:
        keep = dataclasses.replace(l1, planner="harts_l1l2", windows=list(l1.windows),
                                   microbatches=list(l1.microbatches), slots=l1.slots.copy())
    # never more tokens than L1, never a longer modelled step: else L1's plan
    keep_tokens = keep.tokens_computed
    if len(fills) == 1:
        plan = fill_plan(ix, atoms, *fills[0][:2], dp=dp, M=M, model=model)
    else:
        scored = [fill_step_tokens(ix, atoms, f[0], f[1], dp=dp, M=M, model=model) if f[2] is None
                  else step_tokens_of_features(f[2], model, M) for f in fills]
        ok = [i for i in range(len(fills)) if scored[i][1] <= keep_tokens]
        plan = fill_plan(ix, atoms, *fills[min(ok, key=lambda i: scored[i])][:2], dp=dp, M=M, model=model) \
            if ok else None
    # the fill's plan as the window schedule runs it (chains and other replicas' producers
    # recomputed), and the window packer's plans (every window runs): the shortest modelled
    # step among those computing no more tokens than L1 wins, else L1's plan
    candidates = [as_executed(ix, plan)] if plan is not None else []
    units = window_units(ix, l1, model, mpr)
    S_w = max(1, math.ceil(math.ceil(sum(u.rows for u in units) / M) / dp))
    for S in range(S_w, S_w + WINDOW_EXTRA_SLOTS + 1):
        for eps in WINDOW_TOLERANCES:
            candidates.append(window_plan(ix, units, dp=dp, M=M, S=S, model=model, eps=eps))
    plan, plan_key = keep, (step_cost(keep), keep_tokens)
    for cand in candidates:
        if cand is None or cand.tokens_computed > keep_tokens:
            continue
        key = (step_cost(cand), cand.tokens_computed)
        if key < plan_key:
            plan, plan_key = cand, key
    plan.plan_seconds = time.perf_counter() - t0
    return plan


def fill_plan(ix: ForestIndex, atoms: Atoms, members_all, extra, *, dp: int, M: int,
              model: CostModel) -> MicrobatchPlan:
    """The plan of a fill: every non-empty microbatch of ``members_all[k][b]`` owns its atoms'
    segments and recomputes their recomputed segments and the ancestors ``extra`` lists."""
    groups, placement = [], []
    for k, members in enumerate(members_all):
        for b, mem in enumerate(members):
            if not mem:
                continue
            owned = [s for a in mem for s in atoms.segs[a]]
            rec = [s for a in mem for s in atoms.rec[a]] + [s for a in mem for s in extra.get(a, ())]
            groups.append((np.asarray(owned, dtype=np.int64), np.asarray(rec, dtype=np.int64)))
            placement.append((b, k))
    return assemble_plan(ix, groups, placement, planner="harts_l1l2", dp=dp, row_budget=M, cost_model=model)


def fill_step_tokens(ix: ForestIndex, atoms: Atoms, members_all, extra, *, dp: int, M: int,
                     model: CostModel) -> Tuple[float, int]:
    """(``step_cost``, ``tokens_computed``) of ``fill_plan(...)`` without building it: the same
    microbatches, features, costs and slot compaction, hence the same floats (a test holds
    them equal).  Raises ``PlanningError`` where ``fill_plan`` would (a microbatch over budget)."""
    comps, owns, place = [], [], []
    for k, members in enumerate(members_all):
        for b, mem in enumerate(members):
            if not mem:
                continue
            owned = sorted([s for a in mem for s in atoms.segs[a]])  # atoms own disjoint segments
            rec = {s for a in mem for s in atoms.rec[a]}
            for a in mem:
                rec.update(extra.get(a, ()))
            rec.difference_update(owned)
            comps.append(np.array(sorted(rec.union(owned)), dtype=np.int64))
            owns.append(np.array(owned, dtype=np.int64))
            place.append((b, k))
    feats = model.features_many(ix, comps, owns)
    slot_ids = {k: j for j, k in enumerate(sorted({k for _, k in place}))}
    cm = np.zeros((dp, len(slot_ids)), dtype=np.float64)
    tokens = 0
    for (b, k), f, comp in zip(place, feats, comps):
        if f.rows > M:
            raise PlanningError(f"harts_l1l2: a microbatch of tree {int(ix.seg_tree[comp[0]])} has {f.rows} "
                                f"rows, over the row budget {M}")
        cm[b, slot_ids[k]] = model.cost(f)
        tokens += f.rows + f.replay_tokens
    return (float(cm.max(axis=0).sum()) if cm.size else 0.0), tokens


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


# ---------------------------------------------------------------------------------------------
# windows the schedule executes (step 3 of the module docstring)
# ---------------------------------------------------------------------------------------------

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
    sc = _SegCosts(ix, model)
    own_c, body_c = sc.own, sc.body
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
    """Place ``units`` into microbatches, ``S`` planned per replica on each of ``dp`` replicas,
    so that every window runs as the schedule runs it (``replica_windows``): a core's
    microbatch (its producer) reads nothing; an item reads its core's rows from a later
    microbatch of the core's replica that holds no core and reads no other producer, or sits
    in the producer itself (local rows), or recomputes its root path (placed anywhere else,
    never beside an item of its tree that reads the core).  Cores go first, the costliest to
    the replica with the cheapest first microbatch; then items and free pieces, costliest
    first.  One replica: each where it fits fullest (first-fit by rows).  Several: each where
    the load after it is lowest, in its window while that stays under the microbatch target
    (the estimated cost over ``dp * S``, times ``1 + eps``), else wherever it is lowest.  A
    unit that fits nowhere opens a microbatch (on its core's replica for an item).  Returns
    (groups, placement) for ``assemble_plan``."""
    length = ix.length_list
    total = sum(u.cost + (u.replay_cost if u.kind == "item" else 0.0) for u in units)
    hi = total / (dp * S) * (1.0 + eps) if dp > 1 else math.inf
    rep: List[int] = []                                 # per microbatch: its replica
    load: List[float] = []
    rows: List[int] = []
    have: List[set] = []
    own_l: List[List[int]] = []
    rec_l: List[List[int]] = []
    cores_in: List[set] = []   # trees whose core a microbatch owns
    reads: List[int] = []      # the producer a microbatch reads (-1: none)
    reads_trees: List[set] = []
    recomputes: List[set] = []  # trees whose path a microbatch recomputes
    of_replica: List[List[int]] = [[] for _ in range(dp)]

    def open_bin(r):
        rep.append(r)
        load.append(0.0)
        rows.append(0)
        for lst in (have, cores_in, reads_trees, recomputes):
            lst.append(set())
        own_l.append([])
        rec_l.append([])
        reads.append(-1)
        of_replica[r].append(len(rep) - 1)
        return len(rep) - 1

    for r in range(dp):
        for _ in range(S):
            open_bin(r)
    core_bin: Dict[int, int] = {}

    def put(b, u, extra_segs, cost):
        load[b] += cost
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

    def better(after, b, best):
        if best is None:
            return True
        if dp == 1:  # fullest first (rows), then earliest
            return rows[b] > rows[best[1]]
        return after < best[0]

    cores = sorted((u for u in units if u.kind == "core"), key=lambda u: -u.cost)
    for u in cores:
        best = None
        for r in range(dp):
            for b in of_replica[r]:
                if reads[b] >= 0 or rows[b] + u.rows > M:
                    continue
                key = (of_replica[r].index(b), load[b])
                if best is None or key < best[0]:
                    best = (key, b)
                break  # the earliest microbatch of a replica with room: producers come first
        b = best[1] if best is not None else open_bin(min(range(dp), key=lambda r: len(of_replica[r])))
        put(b, u, (), u.cost)
        cores_in[b].add(u.tree)
        core_bin[u.tree] = b
    rest = sorted((u for u in units if u.kind != "core"), key=lambda u: -(u.cost + u.replay_cost))
    for u in rest:
        win = other = None
        p = core_bin[u.tree] if u.kind == "item" else -1
        if p >= 0:
            for b in of_replica[rep[p]]:
                if b == p:
                    c = u.cost
                elif not cores_in[b] and reads[b] in (-1, p) and u.tree not in recomputes[b]:
                    c = u.cost + u.replay_cost
                else:
                    continue
                if rows[b] + u.rows > M:
                    continue
                if better(load[b] + c, b, win):
                    win = (load[b] + c, b, c)
        if win is None or win[0] > hi:
            for b in range(len(rep)):
                if p >= 0:
                    if u.tree in reads_trees[b] or b == p:
                        continue
                    extra = sum([length[x] for x in u.path if x not in have[b]])
                    add, c = u.rows + extra, u.cost + u.path_cost * extra / max(1, u.path_rows)
                else:
                    add, c = u.rows - sum([length[x] for x in u.rec if x in have[b]]), u.cost
                if rows[b] + add > M:
                    continue
                if better(load[b] + c, b, other):
                    other = (load[b] + c, b, c)
        if win is not None and (win[0] <= hi or other is None or win[0] <= other[0]):
            _, b, c = win
            put(b, u, (), c)
            if b != p:
                reads[b] = p
                reads_trees[b].add(u.tree)
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
        else:
            put(open_bin(min(range(dp), key=lambda r: len(of_replica[r]))), u, (), u.cost)
    groups, placement = [], []
    for r in range(dp):
        bins = [b for b in of_replica[r] if own_l[b]]
        first = [b for b in bins if cores_in[b]]
        later = sorted((b for b in bins if not cores_in[b]), key=lambda b: -load[b])
        for k, b in enumerate(first + later):
            groups.append((np.asarray(sorted(own_l[b]), dtype=np.int64),
                           np.asarray(sorted(rec_l[b]), dtype=np.int64)))
            placement.append((r, k))
    return groups, placement


def window_plan(ix: ForestIndex, units: List[_Unit], *, dp: int, M: int, S: int, model: CostModel,
                eps: float = 0.01) -> Optional[MicrobatchPlan]:
    """``pack_windows`` assembled (None when it fails or a microbatch exceeds the budget)."""
    packed = pack_windows(ix, units, dp, M, S, eps)
    if packed is None:
        return None
    try:
        return assemble_plan(ix, packed[0], packed[1], planner="harts_l1l2", dp=dp, row_budget=M, cost_model=model)
    except PlanningError:
        return None


def as_executed(ix: ForestIndex, plan: MicrobatchPlan) -> Optional[MicrobatchPlan]:
    """``plan`` as the window schedule runs it (``replica_windows``): external context that no
    single earlier non-consumer producer of the same replica holds is recomputed.  The result's
    windows all run as planned; None when a microbatch then exceeds the row budget."""
    from .microbatch import replica_windows
    groups, placement = [], []
    for r in range(plan.num_replicas):
        for e in replica_windows(ix.forest, plan, r):
            m = e.microbatch
            groups.append((m.owned, np.setdiff1d(e.computed, m.owned)))
            placement.append((r, m.slot))
    try:
        return assemble_plan(ix, groups, placement, planner=plan.planner, dp=plan.num_replicas,
                             row_budget=plan.row_budget, cost_model=plan.cost_model)
    except PlanningError:
        return None
