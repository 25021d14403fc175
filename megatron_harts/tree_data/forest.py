"""Rollout forest: trajectories merged on identical token prefixes.

Layout invariants every consumer may rely on (tests pin them):

- Segments are in DFS preorder: ``seg_parent[s] < s`` and the subtree of ``s``
  is the contiguous range ``[s, s + seg_subtree_size[s])``.  Trees are
  contiguous ranges of segments (``tree_offsets``).
- Unique tokens (rows) are laid out segment after segment:
  ``tokens[seg_row[s] : seg_row[s] + seg_length[s]]`` are the tokens of ``s``,
  at path positions ``seg_start[s] ...``.  So rows are in DFS preorder too.
- A segment is a maximal run of tokens shared by exactly the same set of
  trajectories: it ends where the path forks or where a trajectory ends.
- Trajectories are ordered so that those through segment ``s`` are exactly
  ``[seg_traj_lo[s], seg_traj_hi[s])``; a trajectory's last segment is
  ``traj_leaf[t]`` (its path is the root path of that segment).
- Per-token metadata is stored once per row (``row_*``) with per-(trajectory,
  position) exceptions where a trajectory's value differs from its row's, so
  ``expand`` returns every trajectory's metadata exactly as given.  The log-prob
  fields ``rollout_logprobs`` and ``ref_logprobs`` are stored exactly as
  ``old_logprobs`` (rows, ``traj_has_*``, exceptions); their three arrays are None
  when no trajectory of the forest has the field.
- Compaction (KV-eviction) events: two trajectories share a position only if their
  tokens and their events with ``at`` up to that position agree, so the events at a
  path position belong to the one segment holding it.  ``seg_evt_*`` lists each
  segment's events (CSR over segments, each segment's sorted by (at, start, end),
  without repeats; ``seg_start[s] <= at < seg_start[s] + seg_length[s]``); ``traj_evt``
  keeps every trajectory's events as given (CSR over trajectories), for ``expand``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np

from .errors import TreeFormatError
from .trajectory import Trajectory, TrajectoryId

#: per-token log-prob fields stored like ``old_logprobs`` but optional as a whole (None: no trajectory has one)
EXTRA_LOGPROBS = ("rollout_logprobs", "ref_logprobs")

# advantage kinds per trajectory
ADV_NONE, ADV_SCALAR, ADV_TOKEN = 0, 1, 2


@dataclass
class Exceptions:
    """(trajectory, position, value) triples, sorted by trajectory then position."""
    traj: np.ndarray
    pos: np.ndarray
    value: np.ndarray

    @staticmethod
    def empty(dtype) -> "Exceptions":
        return Exceptions(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, dtype))

    def slice_traj(self, lo: int, hi: int) -> "Exceptions":
        a, b = np.searchsorted(self.traj, [lo, hi])
        return Exceptions(self.traj[a:b] - lo, self.pos[a:b], self.value[a:b])

    def apply(self, t: int, values: np.ndarray) -> np.ndarray:
        a, b = np.searchsorted(self.traj, [t, t + 1])
        if a != b:
            values = values.copy()
            values[self.pos[a:b]] = self.value[a:b]
        return values


@dataclass
class Forest:
    # rows
    tokens: np.ndarray                  # int64[U]
    row_loss_mask: np.ndarray           # uint8[U]
    row_old_logprobs: np.ndarray        # float64[U], NaN where no trajectory gives one
    row_advantage: np.ndarray           # float64[U], per-token advantages
    # segments
    seg_parent: np.ndarray              # int64[S], -1 at a root
    seg_start: np.ndarray               # int64[S], path position of the first token
    seg_length: np.ndarray              # int64[S] >= 1
    seg_row: np.ndarray                 # int64[S], first row
    seg_traj_lo: np.ndarray             # int64[S]
    seg_traj_hi: np.ndarray             # int64[S]
    tree_offsets: np.ndarray            # int64[T+1] over segments
    # trajectories
    traj_ids: List[TrajectoryId]
    traj_leaf: np.ndarray               # int64[N]
    traj_length: np.ndarray             # int64[N]
    traj_has_old_logprobs: np.ndarray   # bool[N]
    traj_adv_kind: np.ndarray           # int8[N]: ADV_NONE / ADV_SCALAR / ADV_TOKEN
    traj_advantage: np.ndarray          # float64[N], the scalar advantage (NaN otherwise)
    traj_reward: np.ndarray             # float64[N], NaN when absent
    traj_weight: np.ndarray             # float64[N], NaN when absent
    traj_group: List[Optional[str]]
    traj_parent: List[Optional[tuple]]
    exc_loss_mask: Exceptions
    exc_old_logprobs: Exceptions
    exc_advantage: Exceptions
    # compaction events (empty when no trajectory has any)
    seg_evt_offsets: Optional[np.ndarray] = None   # int64[S+1]
    evt_at: Optional[np.ndarray] = None            # int64[E], path position of the event
    evt_start: Optional[np.ndarray] = None         # int64[E], evicted span [start, end)
    evt_end: Optional[np.ndarray] = None           # int64[E]
    traj_evt_offsets: Optional[np.ndarray] = None  # int64[N+1]
    traj_evt: Optional[np.ndarray] = None          # int64[E', 3]: (at, start, end) as given
    # the engine's and a reference model's log-probs (all three None when no trajectory has the field)
    row_rollout_logprobs: Optional[np.ndarray] = None        # float64[U], NaN where no trajectory gives one
    traj_has_rollout_logprobs: Optional[np.ndarray] = None   # bool[N]
    exc_rollout_logprobs: Optional[Exceptions] = None
    row_ref_logprobs: Optional[np.ndarray] = None
    traj_has_ref_logprobs: Optional[np.ndarray] = None
    exc_ref_logprobs: Optional[Exceptions] = None
    _id_index: Optional[Dict[TrajectoryId, int]] = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.seg_evt_offsets is None:
            self.seg_evt_offsets = np.zeros(self.num_segments + 1, dtype=np.int64)
            self.evt_at = self.evt_start = self.evt_end = np.zeros(0, dtype=np.int64)
        if self.traj_evt_offsets is None:
            self.traj_evt_offsets = np.zeros(self.num_trajectories + 1, dtype=np.int64)
            self.traj_evt = np.zeros((0, 3), dtype=np.int64)

    # ---- sizes -------------------------------------------------------------
    @property
    def num_segments(self) -> int:
        return int(self.seg_parent.shape[0])

    @property
    def num_trees(self) -> int:
        return int(self.tree_offsets.shape[0] - 1)

    @property
    def num_trajectories(self) -> int:
        return len(self.traj_ids)

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_events(self) -> int:
        """Compaction events of the forest, each counted once per segment holding it."""
        return int(self.evt_at.shape[0])

    @property
    def has_compactions(self) -> bool:
        return self.num_events > 0

    def segment_events(self, s: int) -> np.ndarray:
        """Events of segment ``s`` as an int64 ``[e, 3]`` array of (at, start, end)."""
        a, b = int(self.seg_evt_offsets[s]), int(self.seg_evt_offsets[s + 1])
        return np.stack([self.evt_at[a:b], self.evt_start[a:b], self.evt_end[a:b]], axis=1)

    def row_evicted(self) -> np.ndarray:
        """int64[U]: how many of row r's ancestor-or-self rows r no longer sees.

        Row r at position p sees ``p + 1 - row_evicted()[r]`` keys in full attention: its
        root path minus the union of the spans of every event on that path with ``at <= p``.
        One pass over the segments in preorder (parents first) carries the union of spans
        down each path; segments without events inherit their parent's.
        """
        out = np.zeros(self.num_rows, dtype=np.int64)
        if not self.has_compactions:
            return out
        S = self.num_segments
        end_spans: List[List[tuple]] = [None] * S      # union at the end of s: sorted disjoint spans
        end_count = np.zeros(S, dtype=np.int64)
        off = self.seg_evt_offsets
        for s in range(S):
            p = int(self.seg_parent[s])
            spans = end_spans[p] if p >= 0 else []
            count = int(end_count[p]) if p >= 0 else 0
            r0, L, st = int(self.seg_row[s]), int(self.seg_length[s]), int(self.seg_start[s])
            a, b = int(off[s]), int(off[s + 1])
            out[r0: r0 + L] = count
            if a < b:
                spans = list(spans)
                for e in range(a, b):
                    spans = _add_span(spans, int(self.evt_start[e]), int(self.evt_end[e]))
                    if e + 1 == b or self.evt_at[e + 1] != self.evt_at[e]:
                        count = sum(hi - lo for lo, hi in spans)
                        out[r0 + int(self.evt_at[e]) - st: r0 + L] = count
            end_spans[s] = spans
            end_count[s] = count
        return out

    @property
    def seg_tree(self) -> np.ndarray:
        """Tree index of every segment."""
        return np.repeat(np.arange(self.num_trees, dtype=np.int64), np.diff(self.tree_offsets))

    @property
    def seg_subtree_size(self) -> np.ndarray:
        """Number of segments in each segment's subtree (itself included)."""
        size = np.ones(self.num_segments, dtype=np.int64)
        parent = self.seg_parent
        for s in range(self.num_segments - 1, 0, -1):
            p = parent[s]
            if p >= 0:
                size[p] += size[s]
        return size

    @property
    def seg_depth(self) -> np.ndarray:
        """Number of segments on the root path of each segment (1 at a root)."""
        depth = np.ones(self.num_segments, dtype=np.int64)
        parent = self.seg_parent
        for s in range(self.num_segments):
            if parent[s] >= 0:
                depth[s] = depth[parent[s]] + 1
        return depth

    def children(self, s: int) -> np.ndarray:
        """Child segments of ``s`` (in preorder)."""
        lo = s + 1
        hi = s + int(self.seg_subtree_size[s])
        cand = np.arange(lo, hi)
        return cand[self.seg_parent[lo:hi] == s]

    def segment_tokens(self, s: int) -> np.ndarray:
        r = int(self.seg_row[s])
        return self.tokens[r: r + int(self.seg_length[s])]

    def segment_trajectories(self, s: int) -> List[TrajectoryId]:
        return self.traj_ids[int(self.seg_traj_lo[s]): int(self.seg_traj_hi[s])]

    def segment_path(self, s: int) -> List[int]:
        """Segments from the root down to ``s``."""
        path = []
        while s >= 0:
            path.append(int(s))
            s = int(self.seg_parent[s])
        return path[::-1]

    def trajectory_index(self, traj_id: TrajectoryId) -> int:
        if self._id_index is None:
            self._id_index = {tid: i for i, tid in enumerate(self.traj_ids)}
        try:
            return self._id_index[traj_id]
        except KeyError:
            raise KeyError(f"no trajectory with id {traj_id!r} in this forest") from None

    def trajectory_rows(self, t: int) -> np.ndarray:
        """Row index of every position of trajectory ``t`` (its expanded -> compact map)."""
        path = self.segment_path(int(self.traj_leaf[t]))
        return np.concatenate([np.arange(self.seg_row[s], self.seg_row[s] + self.seg_length[s]) for s in path])

    def has_logprobs(self, name: str) -> np.ndarray:
        """bool[N]: which trajectories carry the per-token field ``name`` (``old_logprobs``,
        ``rollout_logprobs`` or ``ref_logprobs``)."""
        has = getattr(self, f"traj_has_{name}")
        return np.zeros(self.num_trajectories, dtype=bool) if has is None else np.asarray(has, dtype=bool)

    def trajectory_logprobs(self, name: str, t: int, rows: Optional[np.ndarray] = None) -> Optional[np.ndarray]:
        """Trajectory ``t``'s per-token field ``name`` as given (float64, NaN for null), or None when it
        has none; ``rows``: its ``trajectory_rows(t)`` when the caller has them."""
        has = getattr(self, f"traj_has_{name}")
        if has is None or not has[t]:
            return None
        rows = self.trajectory_rows(t) if rows is None else rows
        return getattr(self, f"exc_{name}").apply(t, np.asarray(getattr(self, f"row_{name}")[rows],
                                                                dtype=np.float64))

    # ---- expansion -----------------------------------------------------------
    def expand(self, traj_id: TrajectoryId) -> Trajectory:
        """The trajectory with its tokens and metadata exactly as given."""
        t = self.trajectory_index(traj_id)
        rows = self.trajectory_rows(t)
        loss_mask = self.exc_loss_mask.apply(t, self.row_loss_mask[rows])
        old_logprobs = None
        if self.traj_has_old_logprobs[t]:
            old_logprobs = self.exc_old_logprobs.apply(t, self.row_old_logprobs[rows])
        kind = self.traj_adv_kind[t]
        advantage = None
        if kind == ADV_SCALAR:
            advantage = float(self.traj_advantage[t])
        elif kind == ADV_TOKEN:
            advantage = self.exc_advantage.apply(t, self.row_advantage[rows])
        reward = None if np.isnan(self.traj_reward[t]) else float(self.traj_reward[t])
        weight = None if np.isnan(self.traj_weight[t]) else float(self.traj_weight[t])
        a, b = int(self.traj_evt_offsets[t]), int(self.traj_evt_offsets[t + 1])
        compactions = np.array(self.traj_evt[a:b], dtype=np.int64) if b > a else None
        return Trajectory(id=self.traj_ids[t], tokens=self.tokens[rows].astype(np.int64),
                          loss_mask=loss_mask.astype(np.uint8), old_logprobs=old_logprobs,
                          advantage=advantage, reward=reward, weight=weight,
                          group=self.traj_group[t], parent=self.traj_parent[t], compactions=compactions,
                          **{name: self.trajectory_logprobs(name, t, rows) for name in EXTRA_LOGPROBS})

    # ---- per-tree views -------------------------------------------------------
    def tree(self, i: int) -> "Forest":
        """Tree ``i`` as a forest of its own (tree-local indices; arrays are views)."""
        return self.select([i])

    def select(self, trees: Sequence[int]) -> "Forest":
        """The listed trees, in the given order, as one forest with re-based indices.

        Tree ``k`` of the result is tree ``trees[k]`` of ``self``: its segments, rows,
        trajectories and exception entries are copied in order and every index into them
        (``seg_parent``, ``seg_row``, ``seg_traj_lo/hi``, ``traj_leaf``, ``tree_offsets``, the
        exceptions' trajectory column) is re-based.  Trajectory ids, groups and parent links
        are kept as they are.  Work is vectorized and linear in the selected rows, segments,
        trajectories and exception entries (on a memory-mapped forest only their bytes are
        read).  A single tree comes back as views (``tree(i)``); several as copies.

        Raises ``IndexError`` for a tree out of range and ``ValueError`` for a tree listed
        twice (its trajectory ids would repeat).
        """
        idx = np.asarray(trees)
        if idx.size == 0:
            idx = np.zeros(0, dtype=np.int64)
        if idx.ndim != 1 or idx.dtype.kind not in "iu":
            raise TypeError(f"trees must be a sequence of integers, got {trees!r}")
        idx = idx.astype(np.int64, copy=False)
        n = self.num_trees
        bad = np.flatnonzero((idx < 0) | (idx >= n))
        if bad.size:
            raise IndexError(f"tree {int(idx[bad[0]])} out of range [0, {n})")
        if idx.size > 1:
            srt = np.sort(idx)
            dup = np.flatnonzero(srt[1:] == srt[:-1])
            if dup.size:
                raise ValueError(f"tree {int(srt[dup[0]])} listed twice")
        off = self.tree_offsets.astype(np.int64, copy=False)
        s0, s1 = off[idx], off[idx + 1]
        last = s1 - 1
        seg_row = self.seg_row.astype(np.int64, copy=False)
        r0 = seg_row[s0]
        r1 = seg_row[last] + self.seg_length[last].astype(np.int64) if idx.size else r0
        t0 = self.seg_traj_lo[s0].astype(np.int64)
        t1 = self.seg_traj_hi[s0].astype(np.int64)
        seg_sel, ns, new_s0 = _ranges(s0, s1)
        row_sel, _, new_r0 = _ranges(r0, r1)
        traj_sel, nt, new_t0 = _ranges(t0, t1)
        seg_shift = np.repeat(new_s0 - s0, ns)      # old segment -> new segment, per segment
        traj_seg_shift = np.repeat(new_s0 - s0, nt)
        row_shift = np.repeat(new_r0 - r0, ns)
        traj_shift_seg = np.repeat(new_t0 - t0, ns)

        def rebase(arr, sel, shift):
            v = arr[sel]
            return (v + shift).astype(v.dtype, copy=False)

        parent = self.seg_parent[seg_sel]
        parent = np.where(parent >= 0, parent + seg_shift, parent).astype(parent.dtype, copy=False)
        tree_offsets = np.zeros(idx.size + 1, dtype=np.int64)
        np.cumsum(ns, out=tree_offsets[1:])
        if isinstance(traj_sel, slice):
            pick = lambda lst: lst[traj_sel]  # noqa: E731
        else:
            order = traj_sel.tolist()
            pick = lambda lst: [lst[t] for t in order]  # noqa: E731
        return Forest(
            tokens=self.tokens[row_sel], row_loss_mask=self.row_loss_mask[row_sel],
            row_old_logprobs=self.row_old_logprobs[row_sel], row_advantage=self.row_advantage[row_sel],
            seg_parent=parent, seg_start=self.seg_start[seg_sel], seg_length=self.seg_length[seg_sel],
            seg_row=rebase(self.seg_row, seg_sel, row_shift),
            seg_traj_lo=rebase(self.seg_traj_lo, seg_sel, traj_shift_seg),
            seg_traj_hi=rebase(self.seg_traj_hi, seg_sel, traj_shift_seg),
            tree_offsets=tree_offsets,
            traj_ids=pick(self.traj_ids), traj_leaf=rebase(self.traj_leaf, traj_sel, traj_seg_shift),
            traj_length=self.traj_length[traj_sel], traj_has_old_logprobs=self.traj_has_old_logprobs[traj_sel],
            traj_adv_kind=self.traj_adv_kind[traj_sel], traj_advantage=self.traj_advantage[traj_sel],
            traj_reward=self.traj_reward[traj_sel], traj_weight=self.traj_weight[traj_sel],
            traj_group=pick(self.traj_group), traj_parent=pick(self.traj_parent),
            exc_loss_mask=_select_exceptions(self.exc_loss_mask, t0, t1, new_t0),
            exc_old_logprobs=_select_exceptions(self.exc_old_logprobs, t0, t1, new_t0),
            exc_advantage=_select_exceptions(self.exc_advantage, t0, t1, new_t0),
            **_select_events(self, s0, s1, t0, t1),
            **{f"{part}_{name}": value for name in EXTRA_LOGPROBS if getattr(self, f"row_{name}") is not None
               for part, value in (("row", getattr(self, f"row_{name}")[row_sel]),
                                   ("traj_has", getattr(self, f"traj_has_{name}")[traj_sel]),
                                   ("exc", _select_exceptions(getattr(self, f"exc_{name}"), t0, t1, new_t0)))},
        )

    def cut_at_depths(self, trees: Sequence[int], width: int) -> "Forest":
        """The forest with every segment of ``trees`` cut at the path positions that are positive
        multiples of ``width`` (a piece of a long path never crosses one).

        A cut segment becomes consecutive segments, each the only child of the one before, the
        last one keeping the children and the trajectories' leaves, each compaction event going to
        the one holding its position; rows, trajectories and per-token metadata are unchanged, segments stay in
        DFS preorder.  Segments are then maximal runs except at those positions, which every
        consumer of a forest accepts (the layouts, KDA call plans and planners work per segment).
        """
        width = int(width)
        if width < 1:
            raise ValueError(f"cut_at_depths: width must be >= 1, got {width}")
        S = self.num_segments
        sel = np.zeros(S, dtype=bool)
        off = self.tree_offsets.astype(np.int64)
        for t in np.asarray(list(trees), dtype=np.int64).tolist():
            if not 0 <= t < self.num_trees:
                raise IndexError(f"tree {t} out of range [0, {self.num_trees})")
            sel[off[t]:off[t + 1]] = True
        start = self.seg_start.astype(np.int64)
        end = start + self.seg_length.astype(np.int64)
        # cut positions inside segment s: multiples of width in (start, end)
        first_cut = (start // width + 1) * width
        ncuts = np.where(sel & (first_cut < end), (end - 1 - first_cut) // width + 1, 0)
        if not ncuts.any():
            return self
        parts = ncuts + 1
        new_first = np.zeros(S + 1, dtype=np.int64)
        np.cumsum(parts, out=new_first[1:])
        last = new_first[:-1] + parts - 1
        owner = np.repeat(np.arange(S, dtype=np.int64), parts)             # old segment of each part
        k = np.arange(owner.size, dtype=np.int64) - new_first[owner]        # part index inside it
        p_start = np.where(k == 0, start[owner], first_cut[owner] + (k - 1) * width)
        p_end = np.where(k == parts[owner] - 1, end[owner], first_cut[owner] + k * width)
        old_parent = self.seg_parent.astype(np.int64)[owner]
        parent = np.where(k > 0, np.arange(owner.size) - 1, np.where(old_parent >= 0, last[np.maximum(old_parent, 0)],
                                                                      -1))
        seg_row = self.seg_row.astype(np.int64)[owner] + (p_start - start[owner])
        # events: each to the part holding its position
        ev_seg = np.repeat(np.arange(S, dtype=np.int64), np.diff(self.seg_evt_offsets))
        at = self.evt_at.astype(np.int64)
        ev_part = new_first[ev_seg] + np.where(at >= first_cut[ev_seg], (at - first_cut[ev_seg]) // width + 1, 0)
        seg_evt_offsets = np.zeros(owner.size + 1, dtype=np.int64)
        np.cumsum(np.bincount(ev_part, minlength=owner.size), out=seg_evt_offsets[1:])
        import dataclasses
        return dataclasses.replace(
            self, seg_parent=parent.astype(np.int64), seg_start=p_start, seg_length=p_end - p_start, seg_row=seg_row,
            seg_traj_lo=self.seg_traj_lo[owner], seg_traj_hi=self.seg_traj_hi[owner],
            tree_offsets=new_first[off], traj_leaf=last[self.traj_leaf.astype(np.int64)],
            seg_evt_offsets=seg_evt_offsets, _id_index=None)

    # ---- statistics -----------------------------------------------------------
    def stats(self) -> dict:
        """Sharing statistics.  ``max_depth`` counts segments on the deepest path.

        ``visible_pairs_tree`` / ``visible_pairs_expanded``: the (query, key) pairs full
        attention computes over the compact rows / over every trajectory on its own, compaction
        events applied.  ``compaction_events``: events over all trajectories;
        ``compaction_events_tree``: each shared event once.
        """
        expanded = int(self.traj_length.sum())
        unique = self.num_rows
        seg_of_row = np.repeat(np.arange(self.num_segments, dtype=np.int64), self.seg_length)
        position = (np.arange(unique, dtype=np.int64) - np.repeat(self.seg_row, self.seg_length)
                    + self.seg_start[seg_of_row])
        seen = position + 1 - self.row_evicted()
        occurrence = (self.seg_traj_hi - self.seg_traj_lo)[seg_of_row]
        return {
            "num_trajectories": self.num_trajectories,
            "num_trees": self.num_trees,
            "num_segments": self.num_segments,
            "expanded_tokens": expanded,
            "unique_tokens": unique,
            "compression": expanded / unique if unique else 0.0,
            "max_depth": int(self.seg_depth.max()) if self.num_segments else 0,
            "max_trajectory_tokens": int(self.traj_length.max()) if self.num_trajectories else 0,
            "compaction_events": int(self.traj_evt.shape[0]),
            "compaction_events_tree": self.num_events,
            "visible_pairs_tree": int(seen.sum()),
            "visible_pairs_expanded": int((seen * occurrence).sum()),
        }


def _ranges(lo: np.ndarray, hi: np.ndarray):
    """Concatenation of the index ranges ``[lo[k], hi[k])``.

    Returns (selector, lengths, new starts): the selector is a slice for a single range (so
    indexing gives views) and an int64 index array otherwise.
    """
    lengths = (hi - lo).astype(np.int64, copy=False)
    starts = np.zeros(lengths.shape[0], dtype=np.int64)
    if lengths.shape[0] > 1:
        np.cumsum(lengths[:-1], out=starts[1:])
    if lengths.shape[0] == 1:
        return slice(int(lo[0]), int(hi[0])), lengths, starts
    total = int(lengths.sum())
    sel = np.arange(total, dtype=np.int64) + np.repeat(lo.astype(np.int64) - starts, lengths)
    return sel, lengths, starts


def _add_span(spans: List[tuple], lo: int, hi: int) -> List[tuple]:
    """The sorted disjoint spans ``spans`` united with ``[lo, hi)`` (a new list)."""
    out = []
    for a, b in spans:
        if b < lo or a > hi:
            out.append((a, b))
        else:
            lo, hi = min(lo, a), max(hi, b)
    out.append((lo, hi))
    out.sort()
    return out


def _select_csr(offsets: np.ndarray, lo: np.ndarray, hi: np.ndarray):
    """Entries of CSR items ``[lo[k], hi[k])`` in that order: (new offsets, entry selector)."""
    item_sel, _, _ = _ranges(lo, hi)
    counts = np.diff(offsets.astype(np.int64))[item_sel]
    new_off = np.zeros(counts.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=new_off[1:])
    off = offsets.astype(np.int64)
    entry_sel, _, _ = _ranges(off[lo], off[hi])
    return new_off, entry_sel


def _select_events(f: "Forest", s0, s1, t0, t1) -> dict:
    """The compaction-event fields of segments ``[s0[k], s1[k])`` and trajectories ``[t0[k], t1[k])``."""
    seg_off, e = _select_csr(f.seg_evt_offsets, s0, s1)
    traj_off, te = _select_csr(f.traj_evt_offsets, t0, t1)
    return {"seg_evt_offsets": seg_off, "evt_at": f.evt_at[e], "evt_start": f.evt_start[e],
            "evt_end": f.evt_end[e], "traj_evt_offsets": traj_off, "traj_evt": f.traj_evt[te]}


def _select_exceptions(exc: Exceptions, t0: np.ndarray, t1: np.ndarray, new_t0: np.ndarray) -> Exceptions:
    """Entries of trajectory ranges ``[t0[k], t1[k])``, in that order, re-based to ``new_t0[k]``."""
    a = np.searchsorted(exc.traj, t0)
    b = np.searchsorted(exc.traj, t1)
    sel, counts, _ = _ranges(a, b)
    traj = exc.traj[sel]
    traj = (traj + np.repeat(new_t0 - t0, counts)).astype(traj.dtype, copy=False)
    return Exceptions(traj, exc.pos[sel], exc.value[sel])


# ---------------------------------------------------------------------------
# building
# ---------------------------------------------------------------------------

def _merge_scopes(trajs: Sequence[Trajectory]) -> np.ndarray:
    """Scope (merge domain) of each trajectory: its group, or its parent's scope.

    Checks explicit parent links: the parent exists, ``tokens[:at]`` agree, the
    links have no cycle, and linked trajectories do not name different groups.
    """
    n = len(trajs)
    index: Dict[TrajectoryId, int] = {}
    for i, t in enumerate(trajs):
        if t.id in index:
            first = trajs[index[t.id]]
            raise t.error("id", f"duplicate id (first seen at {first.source[0]}:{first.source[1]})")
        index[t.id] = i
    parent_of = np.full(n, -1, dtype=np.int64)
    for i, t in enumerate(trajs):
        if t.parent is None:
            continue
        pid, at = t.parent
        j = index.get(pid)
        if j is None:
            raise t.error("parent", f"parent id {pid!r} does not exist")
        if j == i:
            raise t.error("parent", "a trajectory cannot be its own parent (cycle)")
        p = trajs[j]
        if at > len(p):
            raise t.error("parent", f"'at' is {at} but parent {pid!r} has only {len(p)} tokens")
        if not np.array_equal(t.tokens[:at], p.tokens[:at]):
            k = int(np.argmax(t.tokens[:at] != p.tokens[:at]))
            raise t.error("parent", f"tokens[:{at}] disagree with parent {pid!r} at position {k}")
        parent_of[i] = j
    # resolve every trajectory to the root of its link chain, detecting cycles
    root = np.full(n, -1, dtype=np.int64)
    state = np.zeros(n, dtype=np.int8)  # 0 new, 1 on the current chain, 2 done
    for i in range(n):
        chain = []
        j = i
        while j >= 0 and state[j] == 0:
            state[j] = 1
            chain.append(j)
            j = int(parent_of[j])
        if j >= 0 and state[j] == 1:
            raise trajs[j].error("parent", "parent links form a cycle")
        r = root[j] if j >= 0 else chain[-1]
        for c in chain:
            state[c] = 2
            root[c] = r
    component_group: Dict[int, Optional[str]] = {}
    component_member: Dict[int, int] = {}
    for i in range(n):
        g = trajs[i].group
        r = int(root[i])
        if g is None:
            continue
        other = component_group.setdefault(r, g)
        if other != g:
            j = component_member[r]
            raise trajs[i].error("group", f"group {g!r} differs from group {other!r} of trajectory "
                                          f"{trajs[j].id!r}, to which it is linked through 'parent'")
        component_member.setdefault(r, i)
    scope_names: Dict[Optional[str], int] = {}
    scopes = np.empty(n, dtype=np.int64)
    for i in range(n):
        g = component_group.get(int(root[i]))
        scopes[i] = scope_names.setdefault(g, len(scope_names))
    return scopes


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays (galloping compare)."""
    m = min(a.shape[0], b.shape[0])
    lo = 0
    step = 256
    while lo < m:
        hi = min(m, lo + step)
        ne = np.flatnonzero(a[lo:hi] != b[lo:hi])
        if ne.size:
            return lo + int(ne[0])
        lo = hi
        step *= 4
    return m


def _merge_keys(trajs: Sequence[Trajectory]) -> List[np.ndarray]:
    """Per trajectory the sequence prefixes are merged on: its tokens, or, where any trajectory
    has compaction events, ``token << 32 | event-set id`` per position (0: no event there).

    Two trajectories share positions ``[0, i]`` iff these keys agree on them: the same tokens
    and the same events at every position up to i (the set of events at a position, so their
    order and repeats in the input do not matter).
    """
    if all(t.compactions is None for t in trajs):
        return [t.tokens for t in trajs]
    set_ids: Dict[tuple, int] = {}
    keys = []
    for t in trajs:
        key = t.tokens.astype(np.uint64) << np.uint64(32)
        if t.compactions is not None:
            ev = np.unique(t.compactions, axis=0)       # sorted by (at, start, end), no repeats
            for p in np.unique(ev[:, 0]).tolist():
                spans = tuple(map(tuple, ev[ev[:, 0] == p, 1:].tolist()))
                key[p] |= np.uint64(set_ids.setdefault(spans, len(set_ids) + 1))
        keys.append(key)
    return keys


def _lexicographic_order(keys: Sequence[np.ndarray], scopes: np.ndarray) -> List[int]:
    """Trajectory indices sorted by (scope, key sequence); a prefix sorts before its extensions.

    Big-endian bytes of unsigned keys compare (memcmp) exactly like the sequences they encode.
    """
    width = ">u8" if keys and keys[0].dtype == np.uint64 else ">u4"
    enc = [k.astype(width).tobytes() for k in keys]
    return sorted(range(len(keys)), key=lambda i: (scopes[i], enc[i]))


def build_forest(trajectories: Sequence[Trajectory]) -> Forest:
    """Merge identical token prefixes (within a group) into a forest.

    Runs in O(total tokens) array work plus O(trajectories) Python steps: sort
    the trajectories lexicographically (bytes of big-endian ids compare like
    the id sequences), take the longest common prefix of sorted neighbours,
    and build the trie of those prefixes with one stack pass.
    """
    trajs = list(trajectories)
    n = len(trajs)
    if n == 0:
        raise TreeFormatError("no trajectories in the input")
    scopes = _merge_scopes(trajs)
    for t in trajs:
        if t.tokens.size and t.tokens.max() > np.iinfo(np.uint32).max:
            raise t.error("tokens", "token id does not fit in 32 bits")
    keys = _merge_keys(trajs)
    order = _lexicographic_order(keys, scopes)
    lengths = np.array([len(trajs[i]) for i in order], dtype=np.int64)

    # one stack pass over the sorted trajectories builds the trie of nodes
    # (a node sits at a fork or a trajectory end; a segment is the edge into it)
    node_parent = [-1]
    node_depth = [0]
    node_first = [0]
    node_last = [n - 1]
    end_node = np.empty(n, dtype=np.int64)
    stack = [0]
    prev = None
    for rank, i in enumerate(order):
        cur = keys[i]
        if prev is None or scopes[order[rank - 1]] != scopes[i]:
            ell = 0
        else:
            ell = _lcp(prev, cur)
        popped = -1
        while node_depth[stack[-1]] > ell:
            popped = stack.pop()
            node_last[popped] = rank - 1
        top = stack[-1]
        if node_depth[top] < ell:
            w = len(node_parent)
            node_parent.append(top)
            node_depth.append(ell)
            node_first.append(node_first[popped])
            node_last.append(rank - 1)
            node_parent[popped] = w
            stack.append(w)
        length = int(lengths[rank])
        if length > ell:
            v = len(node_parent)
            node_parent.append(stack[-1])
            node_depth.append(length)
            node_first.append(rank)
            node_last.append(n - 1)
            stack.append(v)
        end_node[rank] = stack[-1]
        prev = cur
    for v in stack:
        node_last[v] = n - 1

    node_parent = np.asarray(node_parent, dtype=np.int64)
    node_depth = np.asarray(node_depth, dtype=np.int64)
    node_first = np.asarray(node_first, dtype=np.int64)
    node_last = np.asarray(node_last, dtype=np.int64)
    # segments = non-root nodes, in preorder = sorted by (first trajectory, depth)
    nodes = np.arange(1, node_parent.shape[0])
    nodes = nodes[np.lexsort((node_depth[nodes], node_first[nodes]))]
    seg_of_node = np.full(node_parent.shape[0], -1, dtype=np.int64)
    seg_of_node[nodes] = np.arange(nodes.shape[0])
    seg_parent = seg_of_node[node_parent[nodes]]
    seg_start = node_depth[node_parent[nodes]]
    seg_length = node_depth[nodes] - seg_start
    seg_row = np.zeros(nodes.shape[0], dtype=np.int64)
    np.cumsum(seg_length[:-1], out=seg_row[1:])
    seg_traj_lo = node_first[nodes]
    seg_traj_hi = node_last[nodes] + 1
    traj_leaf = seg_of_node[end_node]
    roots = np.flatnonzero(seg_parent < 0)
    tree_offsets = np.append(roots, nodes.shape[0]).astype(np.int64)

    # rows: the tokens of each segment, read from its first trajectory
    num_rows = int(seg_length.sum())
    tokens = np.empty(num_rows, dtype=np.int64)
    for s in range(nodes.shape[0]):
        src = trajs[order[int(seg_traj_lo[s])]].tokens
        a = int(seg_start[s])
        tokens[seg_row[s]: seg_row[s] + seg_length[s]] = src[a: a + seg_length[s]]

    sorted_trajs = [trajs[i] for i in order]
    fields = _store_token_fields(sorted_trajs, lengths, seg_start, seg_length, seg_row,
                                 seg_traj_lo, seg_traj_hi, num_rows)

    adv_kind = np.zeros(n, dtype=np.int8)
    adv = np.full(n, np.nan)
    reward = np.full(n, np.nan)
    weight = np.full(n, np.nan)
    for k, t in enumerate(sorted_trajs):
        if isinstance(t.advantage, np.ndarray):
            adv_kind[k] = ADV_TOKEN
        elif t.advantage is not None:
            adv_kind[k] = ADV_SCALAR
            adv[k] = t.advantage
        if t.reward is not None:
            reward[k] = t.reward
        if t.weight is not None:
            weight[k] = t.weight
    return Forest(
        tokens=tokens, **fields["rows"], **_store_events(sorted_trajs, seg_start, seg_length, seg_traj_lo),
        seg_parent=seg_parent, seg_start=seg_start, seg_length=seg_length, seg_row=seg_row,
        seg_traj_lo=seg_traj_lo, seg_traj_hi=seg_traj_hi, tree_offsets=tree_offsets,
        traj_ids=[t.id for t in sorted_trajs], traj_leaf=traj_leaf, traj_length=lengths,
        traj_has_old_logprobs=np.array([t.old_logprobs is not None for t in sorted_trajs], dtype=bool),
        traj_adv_kind=adv_kind, traj_advantage=adv, traj_reward=reward, traj_weight=weight,
        traj_group=[t.group for t in sorted_trajs], traj_parent=[t.parent for t in sorted_trajs],
        **fields["exceptions"], **fields["extra"],
    )


def _store_events(trajs: Sequence[Trajectory], seg_start, seg_length, seg_traj_lo) -> dict:
    """The compaction-event fields of a forest whose trajectories (in forest order) are ``trajs``.

    A segment's events are read from its first trajectory: every trajectory through it has the
    same events at its positions (the merge keys include them).
    """
    S, N = seg_start.shape[0], len(trajs)
    traj_off = np.zeros(N + 1, dtype=np.int64)
    np.cumsum([0 if t.compactions is None else t.compactions.shape[0] for t in trajs], out=traj_off[1:])
    if traj_off[-1] == 0:
        return {}
    traj_evt = np.concatenate([t.compactions for t in trajs if t.compactions is not None]).astype(np.int64)
    seg_off = np.zeros(S + 1, dtype=np.int64)
    parts = []
    for s in range(S):
        ev = trajs[int(seg_traj_lo[s])].compactions
        if ev is not None:
            a = int(seg_start[s])
            ev = ev[(ev[:, 0] >= a) & (ev[:, 0] < a + int(seg_length[s]))]
            if ev.shape[0]:
                ev = np.unique(ev, axis=0)
                parts.append(ev)
                seg_off[s + 1] = ev.shape[0]
    np.cumsum(seg_off, out=seg_off)
    evt = np.concatenate(parts) if parts else np.zeros((0, 3), dtype=np.int64)
    return {"seg_evt_offsets": seg_off, "evt_at": np.ascontiguousarray(evt[:, 0]),
            "evt_start": np.ascontiguousarray(evt[:, 1]), "evt_end": np.ascontiguousarray(evt[:, 2]),
            "traj_evt_offsets": traj_off, "traj_evt": traj_evt}


def _token_field(trajs, get, seg_start, seg_length, seg_row, seg_traj_lo, seg_traj_hi, num_rows,
                 fill, dtype):
    """Row values of one per-token field, plus exceptions where a trajectory differs.

    A segment's rows take the value of the last trajectory through it that has
    the field (for step-wise data that is the longest one, whose context copy
    of earlier actions is what most trajectories hold); every other trajectory
    through the segment is compared slice by slice, bitwise, in
    O(expanded tokens) sequential work.
    """
    out = np.full(num_rows, fill, dtype=dtype)
    exc_t, exc_p, exc_v = [], [], []
    values = [get(t) for t in trajs]
    if all(v is None for v in values):
        return out, Exceptions.empty(dtype)
    bits = (lambda x: x.view(np.int64)) if dtype == np.float64 else (lambda x: x)
    for s in range(seg_start.shape[0]):
        a, L, r = int(seg_start[s]), int(seg_length[s]), int(seg_row[s])
        lo, hi = int(seg_traj_lo[s]), int(seg_traj_hi[s])
        ref = hi - 1
        while ref >= lo and values[ref] is None:
            ref -= 1
        if ref < lo:
            continue
        row = values[ref][a: a + L].astype(dtype, copy=False)
        out[r: r + L] = row
        rb = bits(row)
        for t in range(lo, ref):
            v = values[t]
            if v is None:
                continue
            mine = v[a: a + L].astype(dtype, copy=False)
            diff = np.flatnonzero(bits(mine) != rb)
            if diff.size:
                exc_t.append(np.full(diff.size, t, dtype=np.int64))
                exc_p.append(diff + a)
                exc_v.append(mine[diff])
    if not exc_t:
        return out, Exceptions.empty(dtype)
    et, ep, ev = np.concatenate(exc_t), np.concatenate(exc_p), np.concatenate(exc_v)
    o = np.lexsort((ep, et))
    return out, Exceptions(et[o], ep[o], ev[o])


def _store_token_fields(trajs, lengths, seg_start, seg_length, seg_row, seg_traj_lo, seg_traj_hi,
                        num_rows) -> dict:
    seg = (seg_start, seg_length, seg_row, seg_traj_lo, seg_traj_hi, num_rows)
    row_lm, exc_lm = _token_field(trajs, lambda t: t.loss_mask, *seg, 0, np.uint8)
    row_lp, exc_lp = _token_field(trajs, lambda t: t.old_logprobs, *seg, np.nan, np.float64)
    row_av, exc_av = _token_field(
        trajs, lambda t: t.advantage if isinstance(t.advantage, np.ndarray) else None, *seg, np.nan, np.float64)
    extra = {}
    for name in EXTRA_LOGPROBS:
        has = np.array([getattr(t, name) is not None for t in trajs], dtype=bool)
        if has.any():       # merged at shared tokens exactly as old_logprobs: rows, then exceptions
            row, exc = _token_field(trajs, lambda t: getattr(t, name), *seg, np.nan, np.float64)
            extra.update({f"row_{name}": row, f"traj_has_{name}": has, f"exc_{name}": exc})
    return {
        "rows": {"row_loss_mask": row_lm, "row_old_logprobs": row_lp, "row_advantage": row_av},
        "exceptions": {"exc_loss_mask": exc_lm, "exc_old_logprobs": exc_lp, "exc_advantage": exc_av},
        "extra": extra,
    }
