"""L2 as one local search over L1's plan, with sharing windows the schedule runs as planned.

**Units** (``l2_units``).  A segment computed in two or more of L1's microbatches is shared; per
tree the shared set ``U`` (closed under ancestors) gives a **core**: ``U`` when it fits the row
budget, else its most shared top that fits.  A tree whose core has at least ``min_producer_rows``
rows is *produced*: its core is cut at its branch points into **blocks** (a core segment whose
parent has two or more children in the core starts one), one unit each, whose path (the core above the block)
is computed wherever the block is; each L1 microbatch's share of the tree, less the core, is cut
into **items**, one per branch hanging below the core: its owned segments, the segments below the
core its root paths need (recomputed), and its **path** (the core segments above it), read from
the producer of its block (the block holding its parent) or recomputed.  An item of more rows than
L1's mean microbatch is cut as L1 cuts a piece (``l1.split_piece``): its pieces recompute the
item's segments above them.  Every other tree keeps its L1 pieces as **free** units.

**State.**  Every unit sits in a bin ``(replica, bin)``, ``dp`` replicas of L1's slot count plus two
bins (``_WINDOW_BINS``: the bins a new window takes, its producer and a microbatch reading it); a non-empty bin
is a microbatch.  A replica runs its producers (bins holding
a block) first, then its other bins, each group costliest first; slot ``k`` is the ``k``-th bin of
every replica.  An item may read its path from its block's bin when that bin is on its replica,
its own bin holds no block, and every block above its block sits on its replica or on one with no
more producers (their owners then run in earlier slots); the items of one tree in a bin read
together or not at all; a bin reads one producer (the one saving it the most path rows), the
items of other windows recompute their paths; the pieces of one item in one bin replay its path
once.  That is what the window schedule (``microbatch.replica_windows``) runs, so every planned
window runs.  A core whose blocks sit in several bins is a cut window: a producer per bin.

**Objective**, compared in order: rows over the budget (summed over bins), then the tokens computed
above L1's tokens (the judge never keeps a plan computing more than L1), then the modelled step (sum over
slots of the costliest bin, each bin costed by the cost model's terms, KDA calls estimated as one per
microbatch and replay as the reading items' replay) plus the mean replica's load (the sum of the bin
costs over ``dp``), then the tokens (as the judge breaks ties), then the sum of squared bin costs.  With several
replicas most moves leave every slot's costliest bin as it is, so the step alone cannot tell a state that
spreads work into extra microbatches or recomputes a path under another replica's costliest bin from one
that does not; the load can, and the search then keeps its microbatches full and its windows read (the
judge keeps a plan by its step).

**Moves**: a unit to another bin (any, the lightest of a slot, or one of its producer's replica; a
core's top block with the blocks below it in its bin); every unit of a bin into another (a
microbatch fewer); two units swapped (the other from any bin, the lightest of a slot, or, for an
item off its producer's replica, a bin of that replica); two bins exchanged (any two, or two of
different replicas: a microbatch changes replica); a window cut (a block alone to any bin; a block
with the blocks below it in its bin to a bin of another replica, its items on other replicas to
bins of that one; or back into the bin of the block above it).  With several replicas two more
moves change every replica at once, so that a slot that only pays once each replica has emptied
its bin there is one move away: a **slot emptied** (each replica's ``k``-th bin, its units largest
first, each into the replica's other non-empty bin that it fills most within the budget, its rows
estimated as the unit's rows less its path where it may read it there; nothing moves where a unit
has room nowhere) and a **slot lightened** (the same, one random unit
of each replica's ``k``-th bin).  A unit moved away from its producer's replica
recomputes its path.  Two more moves put together what belongs together: a produced tree re-packed (its
blocks into its top block's bin, its items best fit into that replica's bins) and a unit joined to a unit
recomputing one of its segments (into its bin, or swapped with a unit there).  The kind of move is drawn by
weights that follow each kind's recent share of the improving moves.  The search (compiled: ``_C.l2_search``)
anneals: a move is taken when it improves the objective; a move adding rows over the budget or tokens above
L1's (the two summed) never, one removing them always; else with probability ``exp(-d / t)``, ``d`` what it
adds to the step plus load, ``t`` falling linearly from ``TEMPERATURE`` mean microbatch costs to 0
over ``moves`` tries (default ``default_moves``: ``MOVES`` times the fourth root of the units); a chain stops
early once ``PATIENCE`` of its budget has passed without a new best; the best state seen is the result.

**Starts.**  Two: L1's placement, and where a tree is produced a **window packing** of the same units
(``window_start``): trees largest first, each core onto the replica with the least rows so far, its items
following it while that replica stays within its share of the rows (the others, with their paths, onto the
least loaded replica); with several replicas a tree larger than one replica's share is cut at its blocks
first, each block a window of its own with the items below it (its bin computes the core above it), so that
its items read on several replicas instead of recomputing their paths; per replica the cores best fit into
producer bins, each producer's items best fit into bins reading it (or a producer bin with room), then the
rest best fit anywhere.  Local moves from L1's
placement seldom reach a packing of few, full windows that this start has from the outset, while L1's
placement wins where the windows matter little.  Each start is searched with the whole budget, side by side
on two threads (``threads.concurrently``: the compiled search releases the GIL; the first begins while the window
packing is made), and both results are judged (each on its chain's thread, while the other chain may still search;
a state both chains found is judged once);
with one start the two threads run two chains from it, of half the budget each and different seeds.

**Judge.**  The best state of each chain is assembled (``microbatch.packing_key``: the exact cost
model, KDA call planner included), and where a tree is produced also the bests each chain found just
before it (``CANDIDATES`` states a chain); the best of them by the judge is kept when it computes no
more tokens than L1 and its modelled step is shorter (then: fewer tokens); otherwise L1's microbatches
are returned with L1's placement.

**Tuning constants**: five, each explained where it is defined: ``MOVES`` (the budget), ``PATIENCE`` (when a
chain stops), ``TEMPERATURE`` (the annealing's start), ``CANDIDATES`` (the states a chain hands the judge) and,
in ``csrc/l2_search.cpp``, ``RATE_FLOOR`` (the least rate of improving moves a move kind is weighted by).  The
rest follows from them or from the plan's rules: a token above L1's is a rule of the objective, not a price (no
plan computing more than L1 is kept); the grid's two extra bins are a new window's (``_WINDOW_BINS``); the
move-kind weights are updated every ``1 / RATE_FLOOR`` tries (the least window that shows a kind at the floor
one improving move).

``l2_bruteforce`` holds the same objective in Python and its optimum over every assignment of a
small instance: the tests hold the search to it.
"""
from __future__ import annotations

import dataclasses
import heapq
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from .compiled import compiled
from .cost_model import CostModel, ForestIndex
from .l1 import plan_l1, split_piece
from .microbatch import MicrobatchPlan, assemble_plan, gc_paused, packing_key, slot_step
from .threads import concurrently, soon

__all__ = ["plan_l2", "plan_harts", "step_cost", "l2_units", "most_shared_top", "L2Instance", "search",
           "groups_of", "window_start", "windows_in_turn", "default_moves", "MOVES", "PATIENCE", "TEMPERATURE",
           "CANDIDATES"]

#: the default budget, the one effort knob: ``MOVES`` times the fourth root of the units (``default_moves``).
#: A small instance needs many tries per unit to leave the local optima of its few bins, a large one few
#: (on benchmarks/compare_l2.py's full set 400 moves a unit, or a budget growing with the square root of the
#: units, gave fewer plans no worse than the staged planner in more time)
MOVES = 30000
#: a chain stops once this share of its budget has passed without a new best: where the start is nearly
#: optimal (no produced tree, one replica) the budget is not spent on tries that find nothing, and the time
#: saved pays for the larger ``MOVES`` (over compare_l2's set, seeds 1-3, each chain's best alone judged: 456
#: of 480 no worse than its reference in 4.4 s a pass; 0.15 gave 452 in 4.0 s, the whole budget of 20000 x
#: units^(1/4) 450 in 4.9 s)
PATIENCE = 0.2
#: the annealing's start temperature, in mean microbatch costs of the start state: a move lengthening the
#: step by that much is taken with probability 1/e at the start, never at the end
TEMPERATURE = 0.005
#: where a tree is produced, the states of a chain the judge sees: its best and the bests it found just before
#: (the search estimates a reading bin's replay and every bin's KDA calls, and the judge's exact costs may
#: order nearby states otherwise); over compare_l2's set, seeds 1-6: 910 of 960 plans no worse than its
#: reference with 3, 905 with 1 (the best alone), no more with 4 or 6
CANDIDATES = 3
#: empty bins the grid has per replica beyond L1's microbatches (not a tuning constant): the bins a new window
#: takes, its producer and one microbatch reading it, so that a move can open a window (or a microbatch) on any
#: replica.  One bin (room for a microbatch only) planned as well over compare_l2's set (seeds 1-6, the earlier
#: constants: 910 of 960 with one, two or three) but made the search's tries dearer (fewer tries pick an empty
#: bin and stop at once): 10% more search time
_WINDOW_BINS = 2
#: the search's random seed (the plan depends on nothing else)
_SEED = 1

_SEARCH = compiled("l2_search")


@dataclass
class L2Instance:
    """What the search reads: per segment its ``length``, attention ``pairs`` and ``logits`` rows;
    ``units`` unit arrays (kind 0 block of a core / 1 item / 2 free; ``win`` the
    item's block unit, else -1; ``up`` a block's upper block, else -1; ``replay`` the item's replay tokens when it reads its path; owned,
    recomputed and path segments as CSR), the start cell of each unit (``replica * slots + slot``),
    the grid, the budget, the cost model's coefficients and L1's tokens."""
    length: np.ndarray
    pairs: np.ndarray
    logits: np.ndarray
    kind: np.ndarray
    win: np.ndarray
    up: np.ndarray
    replay: np.ndarray
    own_off: np.ndarray
    own: np.ndarray
    rec_off: np.ndarray
    rec: np.ndarray
    path_off: np.ndarray
    path: np.ndarray
    cell0: np.ndarray
    dp: int
    slots: int
    row_budget: int
    overhead: float
    c_row: float
    c_pair: float
    c_logit: float
    c_replay: float
    base_tokens: int

    @property
    def num_units(self) -> int:
        return int(self.kind.shape[0])

    def segments(self, which: str, u: int) -> np.ndarray:
        off, ids = getattr(self, which + "_off"), getattr(self, which)
        return ids[off[u]:off[u + 1]]


def most_shared_top(root: int, count, length, children, M: int) -> List[int]:
    """The most shared top of a tree's shared set that fits ``M`` rows, sorted: from ``root``, the segment
    computed in the most microbatches (``count``) first (ties: the lower segment), its children computed in
    two or more joining the candidates; a segment that does not fit is passed over."""
    top, rows, heap = [], 0, [(-count[root], root)]
    while heap:
        _, s = heapq.heappop(heap)
        if rows + length[s] > M:
            continue
        top.append(s)
        rows += length[s]
        for c in children[s]:
            if count[c] >= 2:
                heapq.heappush(heap, (-count[c], c))
    return sorted(top)


def _csr(lists) -> Tuple[np.ndarray, np.ndarray]:
    off = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum([len(x) for x in lists], out=off[1:])
    ids = np.fromiter((x for xs in lists for x in xs), dtype=np.int64, count=int(off[-1]))
    return off, ids


def l2_units(ix: ForestIndex, l1: MicrobatchPlan, model: CostModel, min_producer_rows: int,
             base_tokens: int) -> L2Instance:
    """The units of ``l1`` (module docstring) in L1's cells."""
    M, dp = l1.row_budget, l1.num_replicas
    slots = l1.num_slots + _WINDOW_BINS  # room for a new window on every replica
    S = ix.num_segments
    mbs = l1.microbatches
    ids_all = [m.owned for m in mbs] + [m.recomputed for m in mbs]
    count = np.bincount(np.concatenate(ids_all), minlength=S).tolist() if ids_all else [0] * S
    length, start, par, children = ix.length_list, ix.start_list, ix.parent, ix.children
    tree_of = ix.seg_tree.tolist()
    B = model.chunk_size
    cut = max(1, sum(int(m.rows) for m in mbs) // max(1, len(mbs)))  # an item's pieces: at most an L1 microbatch's mean rows
    cores: Dict[int, set] = {}
    for s in range(S):
        if count[s] >= 2:
            cores.setdefault(tree_of[s], set()).add(s)
    for t, core in list(cores.items()):
        if sum(length[s] for s in core) > M:  # the most shared top of U that fits
            core = cores[t] = set(most_shared_top(int(ix.tree_offsets[t]), count, length, children, M))
        if sum(length[s] for s in core) < min_producer_rows:
            del cores[t]
    kind, win, up, replay, own, rec, path, cell0 = [], [], [], [], [], [], [], []

    def unit(k: int, w: int, u: int, rp: int, o: List[int], r: List[int], pa: List[int], cell: int) -> None:
        for column, value in zip((kind, win, up, replay, own, rec, path, cell0), (k, w, u, rp, o, r, pa, cell)):
            column.append(value)

    block_unit: Dict[int, int] = {}  # a core segment -> the unit of its block
    core_cell: Dict[int, int] = {}
    for t in sorted(cores):  # blocks first: an item names its block's unit
        core = cores[t]
        for s in sorted(core):  # preorder: a block's top before its segments, a block before those below it
            p = par[s]
            if p in core and sum(1 for c in children[p] if c in core) < 2:
                block_unit[s] = block_unit[p]
                own[block_unit[s]].append(s)
                continue
            block_unit[s] = len(kind)
            above, a = [], p
            while a >= 0:
                above.append(a)
                a = par[a]
            # its cell for now the tree's number, until its core's cell is known
            unit(0, -1, block_unit[p] if p in core else -1, 0, [s], [], sorted(above), t)
    for m in mbs:
        cell = m.replica * slots + m.slot
        per: Dict[int, Tuple[List[int], List[int]]] = {}
        for x in m.owned.tolist():
            per.setdefault(tree_of[x], ([], []))[0].append(x)
        for x in m.recomputed.tolist():
            per.setdefault(tree_of[x], ([], []))[1].append(x)
        for t, (o, r) in per.items():
            if not o:
                continue
            if t not in cores:
                unit(2, -1, -1, 0, o, r, [], cell)
                continue
            core = cores[t]
            if core & set(o) and (t not in core_cell or min(core) in o):
                core_cell[t] = cell
            mine = [x for x in o if x not in core]
            mine_set = set(mine)
            branches: Dict[int, List[int]] = {}  # the item's segments by the top of their branch below the core
            top_of: Dict[int, int] = {}
            for x in mine:  # ids in preorder: a parent's top is known before its children's
                p = par[x]
                top_of[x] = top_of[p] if p in mine_set else x
                branches.setdefault(top_of[x], []).append(x)
            for part in branches.values():
                part_set = set(part)
                need, seen = [], set()
                for x in part:
                    a = par[x]
                    while a >= 0 and a not in part_set and a not in seen:
                        seen.add(a)
                        need.append(a)
                        a = par[a]
                below = sorted(a for a in need if a not in core)
                above = sorted(a for a in need if a in core)
                comp = part_set.union(below)
                rp = sum(start[x] % B for x in comp if par[x] >= 0 and par[x] not in comp)
                pieces = [(sorted(part), below)]
                if sum(length[x] for x in comp) > cut:  # cut the item as L1 cuts a piece
                    root = min(comp)
                    deepest = max(start[x] + length[x] for x in comp)
                    pieces = [(sorted(o), sorted(r)) for o, r, _ in
                              split_piece(ix, sorted(part), below, max(start[root] + cut, deepest))]
                for o, r in pieces:
                    unit(1, block_unit[max(above)], -1, rp, o, r, above, cell)
    for u in range(len(kind)):
        if kind[u] == 0:
            cell0[u] = core_cell[cell0[u]]
    c = model.coefficients
    return L2Instance(ix.length, ix.seg_pairs, ix.seg_logits, np.array(kind, dtype=np.int64), np.array(win, dtype=np.int64),
                      np.array(up, dtype=np.int64), np.array(replay, dtype=np.int64),
                      *_csr(own), *_csr(rec), *_csr(path), np.array(cell0, dtype=np.int64), dp, slots, M,
                      float(c.microbatch + c.kda_call), float(c.row), float(c.attention_pair), float(c.logits_row),
                      float(c.kda_replay_token), int(base_tokens))


def _rows(inst: L2Instance, which: str) -> np.ndarray:
    """Per unit the rows of its ``which`` segments."""
    off, ids = getattr(inst, which + "_off"), getattr(inst, which)
    unit = np.repeat(np.arange(inst.num_units), np.diff(off))
    return np.bincount(unit, weights=inst.length[ids], minlength=inst.num_units).astype(np.int64)


def _best_fit(bins: list, rows: int, budget: int, fits) -> Optional[list]:
    """The bin of ``bins`` (``[rows, is a producer, the producer it reads or its own number, units]``)
    accepted by ``fits`` that ``rows`` fill most within ``budget``; None where none has room."""
    best = None
    for b in bins:
        if fits(b) and b[0] + rows <= budget and (best is None or b[0] > best[0]):
            best = b
    return best


def _put(bins: list, b: Optional[list], u: int, rows: int, producer: bool = False, reads: int = -1) -> list:
    """Unit ``u`` of ``rows`` into bin ``b``, or into a new bin (a producer, or one reading ``reads``)."""
    if b is None:
        bins.append([0, producer, len(bins) if producer else reads, []])
        b = bins[-1]
    b[0] += rows
    b[3].append(u)
    return b


def window_start(inst: L2Instance) -> Tuple[np.ndarray, int]:
    """The window packing of ``inst``'s units (module docstring, *Starts*): (cell per unit, slots of the
    grid it needs)."""
    U, R, M = inst.num_units, inst.dp, inst.row_budget
    kind, win, up = inst.kind.tolist(), inst.win.tolist(), inst.up.tolist()
    bare = (_rows(inst, "own") + _rows(inst, "rec")).tolist()           # without the path
    full = (np.asarray(bare) + _rows(inst, "path")).tolist()             # with the path recomputed
    top = list(range(U))
    for u in range(U):                                                  # blocks in order: an upper one first
        if kind[u] == 0 and up[u] >= 0:
            top[u] = top[up[u]]
    members: Dict[int, List[int]] = {}                                  # per window (its first block) its units
    for u in range(U):
        if kind[u] == 1:
            top[u] = top[win[u]]
        if kind[u] != 2:
            members.setdefault(top[u], []).append(u)

    def sizes():                                                        # (rows of its blocks, of it all) per window
        core = {t: full[t] + sum(bare[u] for u in us if kind[u] == 0 and u != t) for t, us in members.items()}
        return core, {t: core[t] + sum(bare[u] + int(inst.replay[u]) for u in us if kind[u] == 1)
                      for t, us in members.items()}

    core, size = sizes()
    share = (sum(size.values()) + sum(full[u] for u in range(U) if kind[u] == 2)) / R
    if R > 1:                                                           # a tree above a replica's share: cut at its blocks
        for t in [t for t, us in members.items() if size[t] > share and sum(kind[u] == 0 for u in us) > 1]:
            for u in members.pop(t):                                    # a window per block, its own items with it
                top[u] = u if kind[u] == 0 else win[u]
                members.setdefault(top[u], []).append(u)
        core, size = sizes()
    load = [0] * R
    trees: List[List[int]] = [[] for _ in range(R)]
    loose: List[List[int]] = [[] for _ in range(R)]                     # items away from their core, free units
    items: Dict[int, List[int]] = {}

    def lightest() -> int:
        return min(range(R), key=lambda q: (load[q], q))

    def away(u: int) -> None:                                           # onto the least loaded replica, path and all
        q = lightest()
        loose[q].append(u)
        load[q] += full[u]

    for t in sorted(members, key=lambda t: (-size[t], t)):
        r = lightest()
        trees[r].append(t)
        load[r] += core[t]
        for u in sorted((u for u in members[t] if kind[u] == 1), key=lambda u: (-bare[u], u)):
            if R == 1 or load[r] + bare[u] <= share:
                items.setdefault(t, []).append(u)
                load[r] += bare[u] + int(inst.replay[u])
            else:
                away(u)
    for u in sorted((u for u in range(U) if kind[u] == 2), key=lambda u: (-full[u], u)):
        away(u)
    packed = []
    for r in range(R):
        bins: list = []
        producer = {}
        for t in sorted(trees[r], key=lambda t: (-core[t], t)):                # cores: producer bins
            blocks = [u for u in members[t] if kind[u] == 0]
            b = _put(bins, _best_fit(bins, core[t], M, lambda b: b[1]), blocks[0], core[t], producer=True)
            b[3] += blocks[1:]
            producer[t] = b[2]
        for u in sorted((u for t in trees[r] for u in items.get(t, ())), key=lambda u: (-bare[u], u)):
            p = producer[top[u]]
            b = _best_fit(bins, bare[u], M, lambda b: not b[1] and b[2] == p)      # a bin reading its producer
            room = None if b is not None else _best_fit(bins, full[u], M, lambda b: b[1])  # else a producer
            if room is not None:
                _put(bins, room, u, full[u])
            else:
                _put(bins, b, u, bare[u], reads=p)
        for u in sorted(loose[r], key=lambda u: (-full[u], u)):                # the rest, paths recomputed
            _put(bins, _best_fit(bins, full[u], M, lambda b: True), u, full[u])
        packed.append(bins)
    slots = max(inst.slots, max(len(b) for b in packed) + _WINDOW_BINS)   # and room for a new window, as l2_units
    cells = np.zeros(U, dtype=np.int64)
    for r, bins in enumerate(packed):
        for i, b in enumerate(bins):
            cells[b[3]] = r * slots + i
    return cells, slots


def search(inst: L2Instance, moves: int, seed: int = 0, candidates: int = 1):
    """``_C.l2_search`` on ``inst``, ``seed`` added to the planner's seed: (cell per unit (``replica * slots +
    slot``, slots as run), reads per unit, objective (rows over the budget, tokens above L1's, step + load, sum of squared
    costs), estimated tokens, estimated step, tries made (fewer than ``moves`` where the chain ran out of
    patience), others): ``others`` the (cells, reads) of up to ``candidates - 1`` more states, the bests the
    chain found before its best, latest first (objectives distinct and worse)."""
    return _SEARCH(inst.length, inst.pairs, inst.logits, inst.kind, inst.win, inst.up, inst.replay, inst.own_off,
                   inst.own, inst.rec_off, inst.rec, inst.path_off, inst.path, inst.cell0, inst.dp, inst.slots,
                   inst.row_budget, inst.overhead, inst.c_row, inst.c_pair, inst.c_logit, inst.c_replay,
                   inst.base_tokens, int(moves), int(PATIENCE * moves), TEMPERATURE, _SEED + seed,
                   int(candidates))


def groups_of(inst: L2Instance, cells: np.ndarray, reads: np.ndarray):
    """(groups, placement) of a state: per non-empty cell its owned and recomputed segments (an item's path
    recomputed unless it reads it) and its (replica, slot)."""
    cells = np.asarray(cells, dtype=np.int64)
    S = int(inst.length.shape[0])

    def keys(which: str, take: np.ndarray) -> np.ndarray:  # cell * S + segment of the units in take
        off, ids = getattr(inst, which + "_off"), getattr(inst, which)
        n = np.diff(off)
        sel = np.repeat(take, n)
        return np.repeat(cells, n)[sel] * S + ids[sel]

    every = np.ones(len(cells), dtype=bool)
    own = np.unique(keys("own", every))
    rec = np.setdiff1d(np.concatenate([keys("rec", every), keys("path", np.asarray(reads) == 0)]), own)
    used = np.unique(cells)
    # each cell's slice of the sorted keys; the segments are the keys less cell * S
    o_at, r_at = (np.searchsorted(k, np.append(used, used[-1] + 1) * S).tolist() for k in (own, rec))
    own, rec = own % S, rec % S
    groups = [(own[o_at[j]:o_at[j + 1]], rec[r_at[j]:r_at[j + 1]]) for j in range(len(used))]
    return groups, [divmod(c, inst.slots) for c in used.tolist()]


def windows_in_turn(inst: L2Instance, cells: np.ndarray, reads: np.ndarray) -> np.ndarray:
    """One replica's cells in a new order: each producer followed by the bins reading it, then the bins reading
    nothing (each group in the order given), every bin after the bins it reads from (a reading item reads the
    rows its block's bin and the bins of the blocks above it own; a bin may hold a producer and a reader).  On
    one replica the step is the sum of the bins' costs in any order, so the plan is as long, and one window's
    rows are held at a time instead of every producer's."""
    cells = np.asarray(cells, dtype=np.int64)
    source = {}                                         # a reading bin -> the producer bin its first reader reads
    needs: Dict[int, set] = {}                          # a bin -> every bin it reads from
    for u in np.flatnonzero(np.asarray(reads)).tolist():
        d = int(cells[u])
        source.setdefault(d, int(cells[inst.win[u]]))
        b = int(inst.win[u])
        while b >= 0:
            if int(cells[b]) != d:
                needs.setdefault(d, set()).add(int(cells[b]))
            b = int(inst.up[b])
    producers = {int(c) for c in cells[inst.kind == 0].tolist()}
    used = sorted(set(cells.tolist()))
    readers: Dict[int, List[int]] = {}                  # per producer bin the bins reading it, in order
    for d in used:
        if d in source and d not in producers:
            readers.setdefault(source[d], []).append(d)
    wanted = []
    for c in used:
        if c in producers:
            wanted += [c] + readers.get(c, [])
    wanted += [d for d in used if d not in wanted]
    order: List[int] = []                               # the wanted order, each bin once its sources are placed
    placed: set = set()
    while len(order) < len(wanted):
        c = next((c for c in wanted if c not in placed and needs.get(c, set()) <= placed), None)
        assert c is not None, "windows_in_turn: the bins read each other in a cycle (the search's state is invalid)"
        order.append(c)
        placed.add(c)
    slot = {c: k for k, c in enumerate(order)}
    return np.array([slot[int(c)] for c in cells.tolist()], dtype=np.int64)


def default_moves(num_units: int) -> int:
    """The search's default budget for ``num_units`` units: ``MOVES`` times their fourth root."""
    return int(MOVES * max(1, num_units) ** 0.25)


def l1_as_l1l2(forest, l1: MicrobatchPlan, cost_model: Optional[CostModel], index: Optional[ForestIndex]):
    """(cost model, forest index, L1's plan as an L1+L2 plan judged by that model): where every L2
    starts, and what it returns when it finds nothing better."""
    if l1.mode != "tree":
        raise ValueError("L2 refines a tree-mode (L1) plan")
    model = cost_model or l1.cost_model
    ix = index if index is not None else ForestIndex(forest)
    if model != l1.cost_model:  # judge L1's microbatches with this cost model
        groups = [(m.owned, m.recomputed) for m in l1.microbatches]
        placement = [(m.replica, m.slot) for m in l1.microbatches]
        keep = assemble_plan(ix, groups, placement, planner="harts_l1l2", dp=l1.num_replicas,
                             row_budget=l1.row_budget, cost_model=model)
    else:
        keep = dataclasses.replace(l1, planner="harts_l1l2", windows=list(l1.windows),
                                   microbatches=list(l1.microbatches), slots=l1.slots.copy())
    return model, ix, keep


@gc_paused
def plan_l2(forest, l1: MicrobatchPlan, *, cost_model: Optional[CostModel] = None,
            index: Optional[ForestIndex] = None, min_producer_rows: Optional[int] = None,
            moves: Optional[int] = None) -> MicrobatchPlan:
    """Refine an L1 plan by the local search (module docstring).  ``plan_seconds`` counts L2 alone.

    ``min_producer_rows``: a tree's shared prefix shorter than this stays recomputed (default:
    the KDA chunk size).  ``moves``: the search's budget (default ``default_moves``).
    Without the compiled core (``megatron_harts._C``) L1's plan is returned, with one warning.
    """
    t0 = time.perf_counter()
    model, ix, keep = l1_as_l1l2(forest, l1, cost_model, index)
    dp, M = l1.num_replicas, l1.row_budget
    mpr = model.chunk_size if min_producer_rows is None else int(min_producer_rows)
    plan = keep                                        # without the compiled core (said once by planner.compiled)
    if _SEARCH is not None and l1.microbatches:
        keep_key = (step_cost(keep), keep.tokens_computed)
        inst = l2_units(ix, l1, model, mpr, keep_key[1])
        budget = default_moves(inst.num_units) if moves is None else int(moves)
        best = (keep_key, None, None)                  # (judged key, groups and placement, judged parts)

        seen: dict = {}                                # a state's judgement, by its grid, cells and reads

        def chain(job) -> list:
            """A chain searched, then its states judged (on its thread: one chain's states are judged while the
            other chain still searches; a state the other chain found too is judged once): (judged key, (groups,
            placement), judged parts) each."""
            cells, reads, *_, others = search(*job)
            at, out = job[0], []
            for cells, reads in [(cells, reads), *others]:
                state = (at.slots, cells.tobytes(), reads.tobytes())
                if state not in seen:
                    if dp == 1:
                        cells = windows_in_turn(at, cells, reads)
                    groups, placement = groups_of(at, cells, reads)
                    judged: dict = {}
                    key = packing_key(ix, groups, placement, dp=dp, row_budget=M, cost_model=model, keep=judged)
                    seen[state] = (key, (groups, placement), judged)
                out.append(seen[state])
            return out

        if (inst.kind == 0).any():                     # a produced tree: L1's placement and the window packing
            first = soon(chain, (inst, budget, 0, CANDIDATES))  # searching while the window packing is made
            cells, slots = window_start(inst)
            second = chain((dataclasses.replace(inst, cell0=cells, slots=slots), budget, 0, CANDIDATES))
            chains = [first(), second]
        else:                                          # one start: two chains of half the budget, side by side
            chains = concurrently(chain, [(inst, budget // 2, 0), (inst, budget // 2, 1)])
        for states in chains:                          # in the chains' order: the same plan either way
            for key, grouped, judged in states:
                if key is not None and key[1] <= keep_key[1] and key < best[0]:
                    best = (key, grouped, judged)
        if best[1] is not None:
            plan = assemble_plan(ix, *best[1], planner="harts_l1l2", dp=dp, row_budget=M,
                                 cost_model=model, keep=best[2])
    plan.plan_seconds = time.perf_counter() - t0
    return plan


def plan_harts(forest, dp: int, row_budget: int, *, cost_model: Optional[CostModel] = None,
               index: Optional[ForestIndex] = None, **l2_options) -> Tuple[MicrobatchPlan, MicrobatchPlan]:
    """(L1 plan, L1+L2 plan).  The L1+L2 plan's ``plan_seconds`` includes L1's time; ``l2_options`` go to
    ``plan_l2``."""
    ix = index if index is not None else ForestIndex(forest)
    l1 = plan_l1(forest, dp, row_budget, cost_model=cost_model, index=ix)
    l2 = plan_l2(forest, l1, cost_model=cost_model, index=ix, **l2_options)
    l2.plan_seconds += l1.plan_seconds
    return l1, l2


def step_cost(plan: MicrobatchPlan) -> float:
    """Modelled step time: sum over slots of the costliest microbatch (an idle replica counting 0.0)."""
    R, S = plan.slots.shape
    mbs = plan.microbatches
    return slot_step(R, S, [m.slot for m in mbs], [m.cost for m in mbs])
