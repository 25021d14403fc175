"""Microbatch plans: what the model, the schedule and the data loader read.

A plan covers one global batch (one optimizer step) on ``num_replicas`` data-parallel
replicas.  Every replica runs the same number of microbatch *slots* (``num_slots``); slot
``k`` of every replica runs at the same time, so a microbatch may read the exports of a
*producer* only when the producer sits in an earlier slot (of any replica) — or, trivially,
when the rows are its own.

Unit of work: whole segments.  A microbatch computes a set of segments (``computed``): the
``owned`` ones carry their targets (logits, loss) for every trajectory through them, the
``recomputed`` ones are context only (ancestors also computed elsewhere, no logits).  Every
segment of the forest is owned by exactly one microbatch.  Rows not computed in a microbatch
but on the root path of an owned segment come from producers as ``external`` context (MLA
key/value latents, KDA boundary states and replay inputs, conv context of those rows).  A segment is
never split into row ranges: the planners refuse a row budget smaller than the longest
root-to-leaf path (``check_budget``), so every segment, and every trajectory with all its
ancestors, fits in one microbatch.  ``Microbatch.row_ranges`` gives the forest rows of a
microbatch as ``[lo, hi)`` ranges (segments are contiguous in the row layout).

Expanded-mode plans (the trajectory-packing baseline) list ``trajectories`` instead: each is
computed on its own, no sharing, and ``owned``/``recomputed`` are empty.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate, chain
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .compiled import compiled
from .cost_model import CostFeatures, CostModel, ForestIndex, gc_paused

__all__ = [
    "PlanningError", "ExternalContext", "Microbatch", "SharingWindow", "MicrobatchPlan",
    "check_budget", "check_dp", "assemble_plan", "assemble_expanded_plan", "place_sorted",
    "ReplicaMicrobatch", "replica_windows", "gc_paused", "packing_key", "slot_step", "plan_order",
]

_EMPTY = np.zeros(0, dtype=np.int64)


class PlanningError(ValueError):
    """Input the planners refuse: the message names the tree (or trajectory) and the budget."""


def check_dp(dp) -> int:
    if isinstance(dp, bool) or not isinstance(dp, (int, np.integer)) or dp < 1:
        raise PlanningError(f"the data-parallel size must be an integer >= 1, got {dp!r}")
    return int(dp)


def check_budget(ix: ForestIndex, row_budget) -> int:
    """Refuse a row budget under which some tree cannot be planned.

    Every trajectory must fit in one microbatch with all its ancestors (the recompute-only
    fallback every planner relies on), so the budget must be at least the longest root-to-leaf
    path of every tree (the training step hands longer trees to ``planner.pieces`` instead).  The error names the first offending tree, its longest trajectory and
    the budget.
    """
    if isinstance(row_budget, bool) or not isinstance(row_budget, (int, np.integer)) or row_budget < 1:
        raise PlanningError(f"the microbatch row budget must be an integer >= 1, got {row_budget!r}")
    M = int(row_budget)
    bad = np.flatnonzero(ix.tree_max_path > M)
    if bad.size:
        t = int(bad[0])
        traj = ix.tree_longest_traj[t]
        raise PlanningError(
            f"tree {t} (trajectory {ix.forest.traj_ids[traj]!r}) has a root-to-leaf path of "
            f"{int(ix.tree_max_path[t])} rows, more than the microbatch row budget {M}: these planners "
            f"place whole root paths ({bad.size} tree(s) affected; the training step cuts such trees into "
            f"pieces, planner.pieces); use a budget of at least {int(ix.tree_max_path.max())} rows")
    return M


@dataclass(frozen=True)
class ExternalContext:
    """Rows a consumer reads from one producer: ``segments`` (preorder), ``rows`` in total."""
    producer: int
    segments: np.ndarray
    rows: int


@dataclass
class Microbatch:
    """One microbatch of a plan.

    Invariants (``MicrobatchPlan.validate``): ``owned`` and ``recomputed`` are disjoint, sorted
    segment ids; every ancestor of an owned segment is computed here or read from
    ``external``; every recomputed segment is an ancestor of an owned one; ``rows <=
    row_budget``.  ``consumers`` are the microbatches that read this one's rows.
    """
    index: int
    replica: int
    slot: int
    owned: np.ndarray
    recomputed: np.ndarray
    external: Tuple[ExternalContext, ...]
    consumers: Tuple[int, ...]
    features: CostFeatures
    cost: float
    trajectories: np.ndarray = field(default_factory=lambda: _EMPTY)
    recomputed_rows: int = 0

    @property
    def rows(self) -> int:
        """Rows computed here (owned + recomputed, or the packed trajectories)."""
        return self.features.rows

    @property
    def computed(self) -> np.ndarray:
        return np.union1d(self.owned, self.recomputed)

    @property
    def external_rows(self) -> int:
        return sum(e.rows for e in self.external)

    @property
    def is_producer(self) -> bool:
        return bool(self.consumers)

    @property
    def producers(self) -> Tuple[int, ...]:
        return tuple(e.producer for e in self.external)

    def row_ranges(self, forest) -> List[Tuple[int, int]]:
        """Forest rows computed here as sorted, merged ``[lo, hi)`` ranges (compact mode)."""
        segs = self.computed
        lo = forest.seg_row[segs]
        hi = lo + forest.seg_length[segs]
        out: List[Tuple[int, int]] = []
        for a, b in zip(lo.tolist(), hi.tolist()):
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
        return out


@dataclass(frozen=True)
class SharingWindow:
    """A producer and the consumers that read its exports (``segments``, ``rows`` rows).

    The producer runs in ``producer_slot``; every consumer runs in a later slot; the exports
    stay alive until ``last_slot`` (the last consumer's slot): ``retention`` slots.
    """
    producer: int
    consumers: Tuple[int, ...]
    segments: np.ndarray
    rows: int
    producer_slot: int
    last_slot: int

    @property
    def retention(self) -> int:
        return self.last_slot - self.producer_slot


@dataclass
class MicrobatchPlan:
    """A global batch planned on ``num_replicas`` replicas in ``num_slots`` aligned slots.

    ``slots[r, k]`` is the microbatch that replica ``r`` runs in slot ``k`` (-1: an idle
    slot).  ``microbatches[i].index == i``; they are numbered by (slot, replica), so index
    order is an execution order in which every producer precedes its consumers.
    """
    planner: str
    mode: str                       # "tree" or "expanded"
    num_replicas: int
    num_slots: int
    row_budget: int
    chunk_size: int
    microbatches: List[Microbatch]
    slots: np.ndarray
    windows: List[SharingWindow]
    expanded_tokens: int
    plan_seconds: float
    cost_model: CostModel
    pieces: Optional[Any] = None    # planner.pieces.PieceSet: the long trees' pieces (None: every tree fits)

    @property
    def tokens_computed(self) -> int:
        """Every computed token: rows of every microbatch (producers once, recomputed
        ancestors each time) plus KDA replay tokens."""
        return sum(m.features.rows + m.features.replay_tokens for m in self.microbatches)

    def at(self, replica: int, slot: int) -> Optional[Microbatch]:
        i = int(self.slots[replica, slot])
        return None if i < 0 else self.microbatches[i]

    def schedule(self, replica: int) -> List[Optional[Microbatch]]:
        """The microbatches replica ``replica`` runs, slot by slot (None: idle slot)."""
        return [self.at(replica, k) for k in range(self.num_slots)]

    def cost_matrix(self) -> np.ndarray:
        """float64[num_replicas, num_slots]: cost of each slot entry (0 when idle)."""
        c = np.zeros(self.slots.shape, dtype=np.float64)
        for m in self.microbatches:
            c[m.replica, m.slot] = m.cost
        return c

    def validate(self, forest) -> None:
        """Check every plan invariant against ``forest``; raise ``AssertionError`` naming it.

        Tree mode: every segment owned exactly once (so every target of every trajectory is
        computed exactly once); each owned segment's root path computed locally or read from
        producers that own those segments and run in an earlier slot; recomputed segments are
        ancestors of owned ones; no microbatch over the row budget; slots aligned (one entry
        per replica and slot, each microbatch exactly once); windows match the external reads.
        Expanded mode: every trajectory in exactly one microbatch, none over budget.
        """
        R, S = self.num_replicas, self.num_slots
        assert self.slots.shape == (R, S), f"slots shape {self.slots.shape} != {(R, S)}"
        ids = self.slots[self.slots >= 0]
        assert np.array_equal(np.sort(ids), np.arange(len(self.microbatches))), \
            "every microbatch must sit in exactly one (replica, slot)"
        for i, m in enumerate(self.microbatches):
            assert m.index == i, f"microbatch {i}: index {m.index}"
            assert self.slots[m.replica, m.slot] == i, f"microbatch {i}: replica/slot mismatch"
            assert m.rows <= self.row_budget, \
                f"microbatch {i}: {m.rows} rows over the budget {self.row_budget}"
        order = sorted(range(len(self.microbatches)),
                       key=lambda i: (self.microbatches[i].slot, self.microbatches[i].replica))
        assert order == list(range(len(order))), "microbatches must be numbered by (slot, replica)"
        if self.mode == "expanded":
            seen = np.zeros(forest.num_trajectories, dtype=np.int64)
            for m in self.microbatches:
                seen[m.trajectories] += 1
                assert m.features.rows == int(forest.traj_length[m.trajectories].sum())
            assert np.all(seen == 1), "every trajectory must be packed exactly once"
            return
        assert self.mode == "tree", f"unknown mode {self.mode!r}"
        parent = forest.seg_parent
        owner = np.full(forest.num_segments, -1, dtype=np.int64)
        for m in self.microbatches:
            assert np.all(np.diff(m.owned) > 0) and np.all(np.diff(m.recomputed) > 0), \
                f"microbatch {m.index}: segment lists must be sorted and unique"
            assert np.all(owner[m.owned] == -1), \
                f"microbatch {m.index}: owns a segment another microbatch owns"
            owner[m.owned] = m.index
        assert np.all(owner >= 0), f"segments {np.flatnonzero(owner < 0)[:5].tolist()} owned by no microbatch"
        reads: Dict[int, set] = {}
        for m in self.microbatches:
            comp = set(m.owned.tolist())
            rec = set(m.recomputed.tolist())
            assert not comp & rec, f"microbatch {m.index}: a segment both owned and recomputed"
            comp |= rec
            ext: Dict[int, int] = {}
            for e in m.external:
                p = self.microbatches[e.producer]
                assert p.slot < m.slot, \
                    f"microbatch {m.index} (slot {m.slot}) reads producer {p.index} of slot {p.slot}"
                for s in e.segments.tolist():
                    assert owner[s] == e.producer, f"microbatch {m.index}: segment {s} not owned by {e.producer}"
                    assert s not in comp and s not in ext, f"microbatch {m.index}: segment {s} twice"
                    ext[s] = e.producer
                assert e.rows == int(forest.seg_length[e.segments].sum())
                reads.setdefault(e.producer, set()).add(m.index)
            needed = set()
            for s in m.owned.tolist():
                a = int(parent[s])
                while a >= 0:
                    needed.add(a)
                    assert a in comp or a in ext, \
                        f"microbatch {m.index}: ancestor {a} of owned segment {s} neither computed nor read"
                    a = int(parent[a])
            assert rec <= needed, f"microbatch {m.index}: recomputes segments no owned segment needs"
            assert set(ext) <= needed, f"microbatch {m.index}: reads segments no owned segment needs"
            assert m.rows == int(forest.seg_length[m.computed].sum()), f"microbatch {m.index}: rows"
            assert m.recomputed_rows == int(forest.seg_length[m.recomputed].sum())
        for m in self.microbatches:
            assert set(m.consumers) == reads.get(m.index, set()), f"microbatch {m.index}: consumers"
        wins = {w.producer: w for w in self.windows}
        assert set(wins) == set(reads), "one sharing window per producer"
        for p, w in wins.items():
            assert set(w.consumers) == reads[p]
            assert w.producer_slot == self.microbatches[p].slot
            assert w.last_slot == max(self.microbatches[c].slot for c in w.consumers)


# ---------------------------------------------------------------------------------------------
# building plans
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ReplicaMicrobatch:
    """One microbatch of a replica's step as the pipeline-size-1 window schedule runs it.

    ``producer``: position (in :func:`replica_windows`' list) of the producer whose exports it
    reads, None when it reads none; ``computed``: the segments it computes (sorted), i.e. the
    plan's plus the external ones it recomputes when it reads no producer; ``external``: the
    plan's external segments (sorted).
    """
    microbatch: Microbatch
    producer: Optional[int]
    computed: np.ndarray
    external: np.ndarray


def replica_windows(forest, plan: MicrobatchPlan, replica: int, *, windows: bool = True) -> List[ReplicaMicrobatch]:
    """Replica ``replica``'s microbatches of a tree-mode plan in slot order (idle slots skipped), each
    with the sharing window it runs in.

    External context runs as a window when the schedule can express it: all of the microbatch's
    external segments are rows of one earlier microbatch of this replica that is not itself a
    consumer (nested producers are not supported), and no computed segment lies above an external
    one.  That producer is the first of ``m.producers`` whose computed set holds every external
    segment (a producer's recomputed rows serve too).  Otherwise (context from several producers,
    from another replica's microbatch or from a consumer; or ``windows=False``) the external
    segments are recomputed: the log-probs and gradients are the same, only the sharing is lost.
    """
    if forest.num_segments != sum(len(m.owned) for m in plan.microbatches):
        raise ValueError("the plan does not own every segment of this forest exactly once (was it planned for "
                         "another forest?)")
    parent = forest.seg_parent
    out: List[ReplicaMicrobatch] = []
    position: Dict[int, int] = {}
    computed_of: Dict[int, set] = {}
    for m in plan.schedule(replica):
        if m is None:
            continue
        comp = set(m.computed.tolist())
        ext = sorted(int(s) for e in m.external for s in e.segments.tolist())
        producer = None
        if ext and windows:
            above = False
            for s in ext:
                a = int(parent[s])
                while a >= 0 and not above:
                    above = a in comp
                    a = int(parent[a])
            if not above:
                for p in m.producers:
                    i = position.get(int(p))
                    if i is not None and out[i].producer is None and set(ext) <= computed_of[int(p)]:
                        producer = i
                        break
        if producer is None:
            comp |= set(ext)
        position[m.index] = len(out)
        computed_of[m.index] = comp
        out.append(ReplicaMicrobatch(m, producer, np.array(sorted(comp), dtype=np.int64),
                                     np.array(ext, dtype=np.int64)))
    return out


def place_sorted(costs: Sequence[float], dp: int) -> List[Tuple[int, int]]:
    """(replica, slot) of each bin: bins sorted by decreasing cost fill slot after slot, so a
    slot holds ``dp`` bins of similar cost (the baseline placement, also L1's)."""
    order = sorted(range(len(costs)), key=lambda i: -costs[i])
    place = [(0, 0)] * len(costs)
    for j, i in enumerate(order):
        place[i] = (j % dp, j // dp)
    return place


def _assemble_core_python(ix: ForestIndex, model: CostModel, owns: Sequence, recs: Sequence):
    """Reference of ``_C.assemble_core``: per microbatch (plan order) its owned ids (sorted,
    distinct), recomputed ids (sorted, distinct, not owned here), cost features, recomputed
    rows and external context [(producer, sorted segments, rows)]: walking up from the parent
    of every computed segment through segments neither computed here nor met yet, each read
    from its owner (the last microbatch owning it; -1: none)."""
    owner: Dict[int, int] = {}
    own_ls, rec_ls = [], []
    for j in range(len(owns)):
        own = sorted(set(np.asarray(owns[j]).tolist()))
        rec_set = set(np.asarray(recs[j]).tolist())
        rec_set.difference_update(own)
        own_ls.append(own)
        rec_ls.append(sorted(rec_set))
        for x in own:
            owner[x] = j
    parent = ix.parent
    length = ix.length_list
    comps, owned_l, rec_l, rec_rows, ext_l = [], [], [], [], []
    for j, (own, rec) in enumerate(zip(own_ls, rec_ls)):
        comp_l = sorted(own + rec)  # disjoint
        comp_set = set(comp_l)
        comps.append(np.array(comp_l, dtype=np.int64))
        owned_l.append(np.array(own, dtype=np.int64))
        rec_l.append(np.array(rec, dtype=np.int64))
        rec_rows.append(sum([length[x] for x in rec]))
        ext: Dict[int, List[int]] = {}
        seen = set()
        for x in comp_l:
            a = parent[x]
            while a >= 0 and a not in comp_set and a not in seen:
                seen.add(a)
                ext.setdefault(owner.get(a, -1), []).append(a)
                a = parent[a]
        ext_l.append([(p, np.array(sorted(ext[p]), dtype=np.int64), sum([length[x] for x in ext[p]]))
                      for p in sorted(ext)])
    return owned_l, rec_l, model.features_many(ix, comps, owned_l), rec_rows, ext_l


_ASSEMBLE = compiled("assemble_core")


def _csr(arrays: Sequence) -> Tuple[np.ndarray, np.ndarray]:
    """``arrays`` (int arrays, or lists / tuples of ints) as CSR (offsets, int64 ids): lists and tuples
    are read in one pass (``np.fromiter``), arrays concatenated."""
    lens = [0, *accumulate(map(len, arrays))]
    off = np.array(lens, dtype=np.int64)
    if not arrays:
        return off, np.zeros(0, np.int64)
    if isinstance(arrays[0], np.ndarray):
        flat = np.concatenate([np.asarray(a, dtype=np.int64) for a in arrays])
    else:
        flat = np.fromiter(chain.from_iterable(arrays), dtype=np.int64, count=lens[-1])
    return off, flat.astype(np.int64, copy=False)


def _assemble_core(ix: ForestIndex, model: CostModel, owns: Sequence, recs: Sequence):
    """``_assemble_core_python``'s result from the compiled ``_C.assemble_core`` when built
    (the same values; arrays are views of its outputs)."""
    return _assemble_core_csr(ix, model, *_csr(owns), *_csr(recs))


def _split_csr(off: np.ndarray, ids: np.ndarray) -> List[np.ndarray]:
    o = off.tolist()
    return [ids[o[j]:o[j + 1]] for j in range(len(o) - 1)]


def _core_out(ix: ForestIndex, model: CostModel, own_off, own, rec_off, rec):
    """The compiled ``_C.assemble_core``'s output for microbatches given as CSR, or None when it
    is not built."""
    if _ASSEMBLE is not None and own_off.shape[0] > 1:
        return _ASSEMBLE(ix.parent_arr, ix.start, ix.length, ix.seg_pairs, ix.seg_logits,
                         own_off, own, rec_off, rec, model.chunk_size)
    return None


def _assemble_core_csr(ix: ForestIndex, model: CostModel, own_off, own, rec_off, rec, out=None):
    """``_assemble_core`` of microbatches given as CSR (owned, recomputed: offsets, ids); ``out``:
    ``_core_out`` of the same arguments when the caller has it."""
    if out is None:
        out = _core_out(ix, model, own_off, own, rec_off, rec)
    if out is None:
        return _assemble_core_python(ix, model, _split_csr(own_off, own), _split_csr(rec_off, rec))
    oo, o, ro, r, feats, rec_rows, eo, ep, eso, es, er = out
    oo, ro, eo, ep, eso, er = (a.tolist() for a in (oo, ro, eo, ep, eso, er))
    k = len(oo) - 1
    ext_l = [[(ep[e], es[eso[e]:eso[e + 1]], er[e]) for e in range(eo[j], eo[j + 1])]
             for j in range(k)]
    return ([o[oo[j]:oo[j + 1]] for j in range(k)], [r[ro[j]:ro[j + 1]] for j in range(k)],
            [CostFeatures(*row) for row in feats.tolist()], rec_rows.tolist(), ext_l)


def plan_order(groups: Sequence, placement: Sequence[Tuple[int, int]]):
    """``assemble_plan``'s microbatches in plan order: (replica of each, compacted slot of each,
    slot count, owned segments as CSR offsets and ids, recomputed segments likewise).  The groups
    with owned segments are numbered by (slot, replica), the slots used renumbered 0.. in order."""
    keep = [i for i in range(len(groups)) if len(groups[i][0])]
    used_slots = sorted({placement[i][1] for i in keep})
    slot_map = {s: k for k, s in enumerate(used_slots)}
    order = sorted(keep, key=lambda i: (slot_map[placement[i][1]], placement[i][0]))
    return ([placement[i][0] for i in order], [slot_map[placement[i][1]] for i in order],
            len(used_slots), *_csr([groups[i][0] for i in order]),
            *_csr([groups[i][1] for i in order]))


def _feature_rows(ix: ForestIndex, model: CostModel, own_off, own, rec_off, rec,
                  keep: Optional[dict] = None) -> List[List[int]]:
    """Per microbatch (CSR) the six ``CostFeatures`` numbers ``_assemble_core`` gives it (the
    compiled core when built, read without building its other outputs; else the reference).
    ``keep``: a dict to leave the compiled core's output in (key ``"core"``)."""
    out = _core_out(ix, model, own_off, own, rec_off, rec)
    if keep is not None:
        keep["core"] = out
    if out is not None:
        return out[4].tolist()
    feats = _assemble_core_python(ix, model, _split_csr(own_off, own), _split_csr(rec_off, rec))[2]
    return [[f.rows, f.attention_pairs, f.kda_calls, f.replay_tokens, f.logits_rows,
             f.external_rows] for f in feats]


def slot_step(num_replicas: int, num_slots: int, slots: Sequence[int],
              costs: Sequence[float]) -> float:
    """Modelled step of microbatches at ``slots`` costing ``costs``: per slot the costliest (a slot
    with fewer than ``num_replicas`` microbatches: an idle replica's 0.0 is in its maximum), summed
    as numpy sums the maxima (``l2.step_cost`` of a plan: the maximum of ``cost_matrix()`` per
    slot)."""
    if num_replicas * num_slots == 0:
        return 0.0
    top: list = [None] * num_slots
    count = [0] * num_slots
    for k, c in zip(slots, costs):
        count[k] += 1
        if top[k] is None or c > top[k]:
            top[k] = c
    for k in range(num_slots):
        if count[k] < num_replicas and (top[k] is None or 0.0 > top[k]):
            top[k] = 0.0
    return float(np.array(top, dtype=np.float64).sum())


def packing_key(ix: ForestIndex, groups: Sequence[Tuple[np.ndarray, np.ndarray]],
                placement: Sequence[Tuple[int, int]], *, dp: int, row_budget: int,
                cost_model: CostModel, keep: Optional[dict] = None) -> Optional[Tuple[float, int]]:
    """(modelled step, tokens computed) of ``assemble_plan``'s plan of these arguments without
    building it: ``(slot_step`` of its microbatches, ``tokens_computed)``, the same floats and
    ints; None where ``assemble_plan`` raises ``PlanningError`` (a microbatch over the budget).
    Its other checks (two microbatches in one place, a consumer not after its producer) are left
    to ``assemble_plan``: plans are judged by this key and the chosen one assembled.
    ``keep``: a dict this function leaves the plan order and the compiled core's output in, for
    ``assemble_plan(..., keep=keep)`` of the same arguments to reuse."""
    order = plan_order(groups, placement)
    if keep is not None:
        keep["order"] = order
    _, ks, S, own_off, own, rec_off, rec = order
    rows = _feature_rows(ix, cost_model, own_off, own, rec_off, rec, keep)
    c = cost_model.coefficients
    cm, cr, ca, ck, cy, cl = (c.microbatch, c.row, c.attention_pair, c.kda_call, c.kda_replay_token,
                              c.logits_row)
    costs, tokens = [], 0
    for f in rows:  # CostModel.cost, term for term
        if f[0] > row_budget:
            return None
        costs.append(0.0 if f[0] == 0 else
                     cm + cr * f[0] + ca * f[1] + ck * f[2] + cy * f[3] + cl * f[4])
        tokens += f[0] + f[3]
    return slot_step(dp, S, ks, costs), tokens


def assemble_plan(ix: ForestIndex, groups: Sequence[Tuple[np.ndarray, np.ndarray]],
                  placement: Sequence[Tuple[int, int]], *, planner: str, dp: int,
                  row_budget: int, cost_model: CostModel, plan_seconds: float = 0.0,
                  keep: Optional[dict] = None) -> MicrobatchPlan:
    """Turn ``groups`` (owned, recomputed segment arrays, one per microbatch) placed at
    ``placement`` ((replica, slot) each) into a plan: microbatches numbered by (slot, replica),
    slots compacted (idle slots at the end dropped), external context read from the owners of
    the missing ancestors, sharing windows, exact cost features.  ``keep``: what
    ``packing_key(..., keep=keep)`` of the same arguments left (its plan order and core output;
    groups and placement then unread).

    Raises ``PlanningError`` if a microbatch exceeds the row budget (never a silent
    over-budget plan) and ``AssertionError`` if a placement puts a consumer before its producer.
    """
    order = keep["order"] if keep is not None else plan_order(groups, placement)
    rs, ks, S, own_off, own, rec_off, rec = order
    grid = [[-1] * S for _ in range(dp)]  # the slots as lists (one array built at the end)
    for new, (r, s) in enumerate(zip(rs, ks)):
        assert grid[r][s] == -1, f"two microbatches at replica {r}, slot {s}"
        grid[r][s] = new
    slots = np.array(grid, dtype=np.int64).reshape(dp, S)
    owned_l, rec_l, feats_l, rec_rows, ext_l = _assemble_core_csr(
        ix, cost_model, own_off, own, rec_off, rec, None if keep is None else keep["core"])
    consumers: Dict[int, set] = {}
    exported: Dict[int, set] = {}
    mbs: List[Microbatch] = []
    length = ix.length_list
    for new in range(len(rs)):
        feats = feats_l[new]
        if feats.rows > row_budget:
            own = owned_l[new]
            t = int(ix.seg_tree[min(int(own[0]), int(rec_l[new][0])) if rec_l[new].size else int(own[0])])
            raise PlanningError(f"{planner}: a microbatch of tree {t} has {feats.rows} rows, over the "
                                f"row budget {row_budget}")
        external = []
        for p, segs, rows in ext_l[new]:
            external.append(ExternalContext(p, segs, rows))
            consumers.setdefault(p, set()).add(new)
            exported.setdefault(p, set()).update(segs.tolist())
        r, k = rs[new], ks[new]
        mbs.append(Microbatch(index=new, replica=r, slot=k, owned=owned_l[new], recomputed=rec_l[new],
                              external=tuple(external), consumers=(), features=feats, cost=cost_model.cost(feats),
                              recomputed_rows=rec_rows[new]))
    windows = []
    for p in sorted(consumers):
        cons = tuple(sorted(consumers[p]))
        mbs[p].consumers = cons
        segs = sorted(exported[p])
        last = max(mbs[c].slot for c in cons)
        assert all(mbs[c].slot > mbs[p].slot for c in cons), \
            f"{planner}: a consumer of microbatch {p} runs in its slot or before it"
        windows.append(SharingWindow(p, cons, np.array(segs, dtype=np.int64), sum([length[x] for x in segs]),
                                     mbs[p].slot, last))
    return MicrobatchPlan(planner=planner, mode="tree", num_replicas=dp, num_slots=S,
                          row_budget=row_budget, chunk_size=cost_model.chunk_size, microbatches=mbs,
                          slots=slots, windows=windows, expanded_tokens=ix.expanded_tokens,
                          plan_seconds=plan_seconds, cost_model=cost_model)


def assemble_expanded_plan(ix: ForestIndex, bins: Sequence[Sequence[int]],
                           placement: Sequence[Tuple[int, int]], *, planner: str, dp: int,
                           row_budget: int, cost_model: CostModel,
                           plan_seconds: float = 0.0) -> MicrobatchPlan:
    """An expanded-mode plan: ``bins`` of trajectory indices packed without sharing."""
    keep = [i for i in range(len(bins)) if len(bins[i])]
    used_slots = sorted({placement[i][1] for i in keep})
    slot_map = {s: k for k, s in enumerate(used_slots)}
    order = sorted(keep, key=lambda i: (slot_map[placement[i][1]], placement[i][0]))
    slots = np.full((dp, len(used_slots)), -1, dtype=np.int64)
    mbs = []
    for new, i in enumerate(order):
        trajs = np.sort(np.asarray(bins[i], dtype=np.int64))
        feats = cost_model.expanded_features(ix, trajs)
        if feats.rows > row_budget:
            raise PlanningError(f"{planner}: a microbatch has {feats.rows} rows, over the row budget {row_budget}")
        r, k = placement[i][0], slot_map[placement[i][1]]
        slots[r, k] = new
        mbs.append(Microbatch(index=new, replica=r, slot=k, owned=_EMPTY, recomputed=_EMPTY,
                              external=(), consumers=(), features=feats, cost=cost_model.cost(feats),
                              trajectories=trajs))
    return MicrobatchPlan(planner=planner, mode="expanded", num_replicas=dp, num_slots=len(used_slots),
                          row_budget=row_budget, chunk_size=cost_model.chunk_size, microbatches=mbs,
                          slots=slots, windows=[], expanded_tokens=ix.expanded_tokens,
                          plan_seconds=plan_seconds, cost_model=cost_model)
