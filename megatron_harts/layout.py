"""Compact microbatch layout: the rows of a set of (sub)trees, each unique prefix token once.

A :class:`CompactLayout` is what the model and the ops consume for one microbatch.  It is
built by :func:`build_layout` from whole trees of a :class:`~megatron_harts.tree_data.Forest`,
from whole subtrees whose ancestor rows live in another (producer) layout, or from a
microbatch's computed segment set (``segments=``, ``owned=``: a set closed under "the parent is
in the set or is context"; only owned segments carry targets).

Invariants (tests pin every one of them against per-trajectory, "expanded", computation):

- Rows are the forest rows of the selected subtrees in forest order, i.e. DFS preorder
  (for whole trees: the forest's own row order).  ``forest_rows`` is strictly increasing.
- ``position_ids[r]`` is the depth of row r on its path: the position expanded mode gives
  the token in every trajectory that holds it (for a subtree: the true depth, not 0).
- ``prev[r]`` is the previous row on r's path, -1 at a root and at the first row of a
  subtree whose ancestors live in the context; for those rows ``prev_external[r]`` is the
  index of the previous row among the context rows (``ctx_*``), -1 everywhere else.
- Visibility (full attention): key row k is visible to query row q iff k is an ancestor-or-self
  of q and no compaction event on q's path at or before q evicts k (an event ``(at, start, end)``
  of the forest, at the row e of position ``at`` on that path, evicts the keys at positions
  ``[start, end)`` of that path from e and e's whole subtree).  It is stored in the general form,
  a CSR list of half-open query intervals per key (``vis_offsets``, ``vis_start``, ``vis_end``):
  key k's intervals are ``[k, end[k])`` minus the union of ``[e, end[e])`` over the event rows e
  that evict k, ``end[k]`` = one past the last row of k's subtree (sorted, disjoint, non-empty;
  the first starts at k).  Without events (``num_events == 0``) every key has exactly the one
  interval ``[k, end[k])``.
- Context visibility (``ctx_vis_*``, same CSR form, over this layout's rows; a key may have no
  interval): context row k is visible to row q iff k is an ancestor of q and no event on q's path
  at or before q evicts k, whether the event sits on a context row (it applies to every row below
  it) or on a row of this layout.  Without events context row k sees one interval: the rows of the
  layout roots below it.
- ``occurrence[r]`` = number of trajectories whose path contains row r.
- Targets: row r carries one target per trajectory t through r whose token at position
  ``position_ids[r] + 1`` has loss mask 1 in t.  The token may differ between trajectories at a
  fork row.  Targets are sorted by (row, token, trajectory).  A trajectory that ends at r has
  no target there.  The target predicting a subtree root's first token sits on a context row,
  so it belongs to the producer layout, not to this one.  A ``segments=`` layout keeps only the
  targets whose row lies in an owned segment, including those that the last row of a segment
  predicts for a trajectory continuing into a child outside the layout.
- ``target_weight`` is the trajectory's ``weight`` (1.0 when absent); it is a per-trajectory
  factor only: any per-token normalisation is the RL objective's job.  ``target_old_logprob``
  is the trajectory's old log-prob of the target token (NaN when the trajectory has none).
  ``target_advantage`` is the trajectory's per-token advantage of the target token, or its
  scalar advantage broadcast, or NaN when it has none.
- ``pair_row``/``pair_token``: the unique (row, target token) pairs, sorted;
  ``target_pair[i]`` is the pair of target i (non-decreasing).
- Trajectory table: ``traj_rows[traj_row_offsets[t]:traj_row_offsets[t+1]]`` are the rows of
  trajectory t's positions ``traj_start[t] ... traj_length[t]-1`` (``traj_start`` = 0 for whole
  trees; for a subtree layout the positions before it are context rows).  For a ``segments=``
  layout the run stops where the trajectory's path leaves the set (it never re-enters).
- Segment table (layout-local, int64 numpy, the KDA call planner's input): segments in DFS
  preorder, ``seg_parent[s] < s`` (-1 at a root of the layout), ``seg_start`` = true path
  position, ``seg_row`` = first layout row; rows are segment after segment.

Construction is vectorized numpy: linear in rows + expanded tokens of the layout (plus the
forest's segment count for a ``segments=`` layout), with Python loops only per segment or per
root.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .tree_data.forest import ADV_SCALAR, ADV_TOKEN, Forest
from .tree_data.trajectory import TrajectoryId

__all__ = ["CompactLayout", "ExpandedBatch", "Visibility", "build_layout", "build_expanded_batch",
           "sequence_visibility", "scatter_to_expanded", "scatter_to_expanded_padded", "scatter_targets_to_expanded"]


# ---------------------------------------------------------------------------
# visibility
# ---------------------------------------------------------------------------

@dataclass
class Visibility:
    """Per-key visible query intervals in CSR form.

    Key k is visible to query q iff ``start[i] <= q < end[i]`` for some
    ``i in [offsets[k], offsets[k+1])``.  Intervals of one key are non-empty, sorted and
    disjoint, inside ``[0, num_queries)``.  With ``causal=True`` keys and queries index the
    same rows, and every key's first interval starts at the key itself (a row always sees
    itself; it is seen only by itself and later rows).
    """
    offsets: torch.Tensor   # int64 [K+1]
    start: torch.Tensor     # int64 [I]
    end: torch.Tensor       # int64 [I]
    num_queries: int
    causal: bool = True

    @property
    def num_keys(self) -> int:
        return int(self.offsets.shape[0]) - 1

    @property
    def num_intervals(self) -> int:
        return int(self.start.shape[0])

    def interval_keys(self) -> torch.Tensor:
        """Key of every interval (int64 [I])."""
        counts = self.offsets[1:] - self.offsets[:-1]
        return torch.repeat_interleave(torch.arange(self.num_keys, device=self.offsets.device), counts)

    def validate(self, name: str = "visibility") -> "Visibility":
        """Raise ValueError naming ``name`` unless the invariants in the class docstring hold."""
        off, s, e = self.offsets, self.start, self.end
        for fname, t in (("offsets", off), ("start", s), ("end", e)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1:
                raise ValueError(f"{name}.{fname} must be a 1-D int64 tensor")
        if off.shape[0] < 1 or int(off[0]) != 0 or int(off[-1]) != s.shape[0] or s.shape != e.shape:
            raise ValueError(f"{name}.offsets must start at 0 and end at the number of intervals "
                             f"({s.shape[0]}), and start/end must have equal lengths")
        if bool((off[1:] < off[:-1]).any()):
            raise ValueError(f"{name}.offsets must be non-decreasing")
        if s.numel():
            if bool((s >= e).any()):
                i = int(torch.nonzero(s >= e)[0])
                raise ValueError(f"{name}: interval {i} [{int(s[i])}, {int(e[i])}) is empty")
            if int(s.min()) < 0 or int(e.max()) > self.num_queries:
                raise ValueError(f"{name}: intervals must lie in [0, {self.num_queries})")
            keys = self.interval_keys()
            same = keys[1:] == keys[:-1]
            if bool((same & (s[1:] < e[:-1])).any()):
                raise ValueError(f"{name}: intervals of one key must be sorted and disjoint")
        if self.causal:
            if self.num_keys != self.num_queries:
                raise ValueError(f"{name}: causal visibility needs as many keys as queries")
            counts = off[1:] - off[:-1]
            if bool((counts < 1).any()):
                k = int(torch.nonzero(counts < 1)[0])
                raise ValueError(f"{name}: row {k} does not see itself (no interval)")
            first = s[off[:-1]]
            if not torch.equal(first, torch.arange(self.num_keys, device=first.device)):
                k = int(torch.nonzero(first != torch.arange(self.num_keys, device=first.device))[0])
                raise ValueError(f"{name}: row {k}'s first interval must start at {k}, got {int(first[k])}")
        return self

    def dense(self) -> torch.Tensor:
        """Boolean [num_queries, num_keys] mask (small sizes only: tests and references)."""
        nq, nk = self.num_queries, self.num_keys
        diff = torch.zeros(nq + 1, nk, dtype=torch.int64, device=self.offsets.device)
        keys = self.interval_keys()
        ones = torch.ones_like(keys)
        diff.index_put_((self.start, keys), ones, accumulate=True)
        diff.index_put_((self.end, keys), -ones, accumulate=True)
        return diff.cumsum(0)[:nq] > 0

    def to(self, device) -> "Visibility":
        return Visibility(*host_to_device_many([self.offsets, self.start, self.end], device), self.num_queries,
                          self.causal)


def host_to_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device``; a CPU tensor bound for a GPU is copied without stalling the host.

    A copy from pageable host memory synchronizes the stream: the host waits until the GPU has
    run everything queued before it, so it cannot queue kernels ahead.  Through pinned memory the
    copy is asynchronous and ordered on the current stream before every kernel queued after it
    (the pinned block is not reused before the copy has run: torch's host allocator records it).
    """
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


#: byte alignment of each tensor in ``host_to_device_many``'s staging buffer (any dtype's element size)
_STAGE_ALIGN = 16


def stage_bytes(tensors: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, List[int]]:
    """The tensors' bytes back to back in one uint8 host buffer (pinned on a machine with a GPU), each
    at an offset aligned to ``_STAGE_ALIGN``: ``(buffer, offsets)``.  ``unstage_bytes`` gives the
    tensors back, bit for bit."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _STAGE_ALIGN) * _STAGE_ALIGN
    pin = torch.cuda.is_available() and all(t.device.type == "cpu" for t in tensors)
    buf = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    for t, o in zip(tensors, offsets):
        if t.numel():
            buf[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)
    return buf, offsets


def unstage_bytes(buf: torch.Tensor, offsets: Sequence[int], like: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The tensors ``stage_bytes`` put into ``buf`` (on ``buf``'s device), shaped and typed as ``like``:
    views of ``buf`` (contiguous)."""
    out = []
    for t, o in zip(like, offsets):
        if t.numel() == 0:
            out.append(torch.empty(t.shape, dtype=t.dtype, device=buf.device))
        else:
            out.append(buf[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape))
    return out


def host_to_device_many(tensors: Sequence[Optional[torch.Tensor]], device) -> List[Optional[torch.Tensor]]:
    """``[host_to_device(t, device) for t in tensors]`` (a None stays None) with one pinned staging
    buffer and one copy for all the CPU tensors bound for a GPU (their values, dtypes and shapes,
    contiguous), instead of a pinned block and a copy each: a microbatch's dozens of small index
    tensors cost the host one transfer.  The results are views of one device buffer, alive while any
    of them is."""
    device = torch.device(device)
    tensors = list(tensors)
    host = [i for i, t in enumerate(tensors) if t is not None and t.device.type == "cpu"]
    if device.type != "cuda" or len(host) < 2:
        return [None if t is None else host_to_device(t, device) for t in tensors]
    out = [t if t is None or t.device.type == "cpu" else t.to(device) for t in tensors]
    buf, offsets = stage_bytes([tensors[i] for i in host])
    moved = unstage_bytes(buf.to(device, non_blocking=True), offsets, [tensors[i] for i in host])
    for i, t in zip(host, moved):
        out[i] = t
    return out


# ---------------------------------------------------------------------------
# the layout
# ---------------------------------------------------------------------------

class _RowsAndTargets:
    """What every microbatch batch form shares: row and target counts, moving to a device.

    ``host_copy``: on a copy made by :meth:`to` from host (CPU) tensors, that host batch (else
    None): per-microbatch metadata (conv taps, block masks, loss scales) is built from it on the
    host, so building it never waits for the device.
    """

    host_copy = None

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_targets(self) -> int:
        return int(self.target_row.shape[0])

    def to(self, device):
        """A copy with every torch tensor (and every :class:`Visibility`) on ``device`` (numpy tables
        and lists are shared)."""
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        names = [k for k, v in kw.items() if isinstance(v, torch.Tensor)]
        kw.update(zip(names, host_to_device_many([kw[k] for k in names], device)))
        kw.update({k: v.to(device) for k, v in kw.items() if isinstance(v, Visibility)})
        out = type(self)(**kw)
        out.host_copy = self.host_copy if self.host_copy is not None else \
            (self if self.tokens.device.type == "cpu" else None)
        return out


@dataclass
class CompactLayout(_RowsAndTargets):
    """One microbatch's rows, see the module docstring for the invariants.

    Torch tensors (moved by :meth:`to`) are what the ops read on the device; numpy arrays are
    host-side tables (segment table for the KDA call planner, ids).
    """
    # rows [R]
    forest_rows: torch.Tensor       # int64, row in the forest (strictly increasing)
    tokens: torch.Tensor            # int64
    position_ids: torch.Tensor      # int64, depth on the path
    prev: torch.Tensor              # int64, previous row on the path, -1 at a root / subtree root
    prev_external: torch.Tensor     # int64, index into ctx rows where the previous row is there, else -1
    row_segment: torch.Tensor       # int64, layout segment of each row
    row_tree: torch.Tensor          # int64, index of the layout tree (root) holding the row
    occurrence: torch.Tensor        # int64, trajectories through the row (>= 1)
    # visibility of key rows over query rows (CSR)
    vis_offsets: torch.Tensor       # int64 [R+1]
    vis_start: torch.Tensor         # int64 [I]
    vis_end: torch.Tensor           # int64 [I]
    # targets [T], sorted by (row, token, trajectory)
    target_row: torch.Tensor        # int64, row whose output predicts the target
    target_traj: torch.Tensor       # int64, layout trajectory index
    target_token: torch.Tensor      # int64, the token to predict
    target_position: torch.Tensor   # int64, path position of the target token (= position_ids[row] + 1)
    target_weight: torch.Tensor     # float64, trajectory weight (1.0 when absent)
    target_old_logprob: torch.Tensor  # float64, NaN when the trajectory has none
    target_advantage: torch.Tensor  # float64, per-token or broadcast scalar, NaN when absent
    target_pair: torch.Tensor       # int64, index of the target's (row, token) pair
    # unique (row, token) pairs [P], sorted
    pair_row: torch.Tensor          # int64
    pair_token: torch.Tensor        # int64
    # trajectories [N]
    traj_ids: List[TrajectoryId]
    traj_forest: np.ndarray         # int64, trajectory index in the forest
    traj_length: torch.Tensor       # int64, full length (positions 0 .. length-1)
    traj_start: torch.Tensor        # int64, first position held by this layout's rows
    traj_row_offsets: torch.Tensor  # int64 [N+1], CSR over traj_rows
    traj_rows: torch.Tensor         # int64 [E], rows of positions traj_start .. length-1
    # segment table (layout-local, host)
    seg_parent: np.ndarray          # int64 [S], -1 at a layout root
    seg_start: np.ndarray           # int64 [S], path position of the first token
    seg_length: np.ndarray          # int64 [S]
    seg_row: np.ndarray             # int64 [S], first layout row
    seg_forest: np.ndarray          # int64 [S], segment index in the forest
    seg_traj_lo: np.ndarray         # int64 [S], layout trajectories through s: [lo, hi)
    seg_traj_hi: np.ndarray         # int64 [S]
    # trees / subtrees of the layout [T']
    tree_roots: np.ndarray          # int64, forest segment of each layout root
    tree_seg_offsets: np.ndarray    # int64 [T'+1] over layout segments
    tree_row_offsets: np.ndarray    # int64 [T'+1] over layout rows
    # external context: ancestor rows of subtree roots, living in a producer layout [Rc]
    ctx_forest_rows: torch.Tensor   # int64, forest rows (strictly increasing)
    ctx_source_rows: torch.Tensor   # int64, row index in the producer layout
    ctx_prev: torch.Tensor          # int64, previous row on the path among ctx rows, -1 at a root
    ctx_position_ids: torch.Tensor  # int64
    ctx_vis_offsets: torch.Tensor   # int64 [Rc+1], visibility of ctx rows over this layout's rows
    ctx_vis_start: torch.Tensor     # int64
    ctx_vis_end: torch.Tensor       # int64
    num_events: int = 0             # compaction events on the layout's and its context's segments
                                    # (0: one interval per key)

    # ---- sizes -------------------------------------------------------------
    @property
    def num_pairs(self) -> int:
        return int(self.pair_row.shape[0])

    @property
    def num_trajectories(self) -> int:
        return len(self.traj_ids)

    @property
    def num_segments(self) -> int:
        return int(self.seg_parent.shape[0])

    @property
    def num_trees(self) -> int:
        return int(self.tree_roots.shape[0])

    @property
    def num_context_rows(self) -> int:
        return int(self.ctx_forest_rows.shape[0])

    @property
    def num_expanded_tokens(self) -> int:
        """Positions held by this layout, summed over its trajectories."""
        return int(self.traj_rows.shape[0])

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    # ---- views -------------------------------------------------------------
    @property
    def visibility(self) -> Visibility:
        """Visibility of this layout's rows (keys) over its rows (queries)."""
        return Visibility(self.vis_offsets, self.vis_start, self.vis_end, self.num_rows, causal=True)

    @property
    def context_visibility(self) -> Visibility:
        """Visibility of the context rows (keys) over this layout's rows (queries)."""
        return Visibility(self.ctx_vis_offsets, self.ctx_vis_start, self.ctx_vis_end, self.num_rows,
                          causal=False)

    def trajectory_rows(self, t: int) -> torch.Tensor:
        """Rows of trajectory t's positions ``traj_start[t] ...`` (its expanded -> compact map)."""
        return self.traj_rows[int(self.traj_row_offsets[t]): int(self.traj_row_offsets[t + 1])]



# ---------------------------------------------------------------------------
# construction
# ---------------------------------------------------------------------------

def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(starts[i], starts[i] + lengths[i])`` (vectorized)."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    first = np.zeros(lengths.shape[0], dtype=np.int64)
    np.cumsum(lengths[:-1], out=first[1:])
    return np.repeat(starts - first, lengths) + np.arange(total, dtype=np.int64)


def _int_list(values, name: str, upper: int, allow_empty: bool = False) -> np.ndarray:
    """Validated sorted unique int64 indices in [0, upper) (ValueError naming ``name``)."""
    try:
        arr = np.asarray(list(values))
    except TypeError:
        raise ValueError(f"{name} must be a sequence of integers, got {type(values).__name__}") from None
    if arr.size == 0 and allow_empty:
        return np.zeros(0, dtype=np.int64)
    if arr.size == 0:
        raise ValueError(f"{name} is empty: a layout needs at least one tree")
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must be a flat sequence of integers")
    arr = arr.astype(np.int64)
    if arr.min() < 0 or arr.max() >= upper:
        bad = int(arr[(arr < 0) | (arr >= upper)][0])
        raise ValueError(f"{name}: index {bad} out of range [0, {upper})")
    uniq = np.unique(arr)
    if uniq.shape[0] != arr.shape[0]:
        raise ValueError(f"{name} holds duplicates")
    return uniq


def _subtree_end(seg_start: np.ndarray, s: int, hi: int) -> int:
    """One past the last segment of s's subtree, inside its tree's range ``[s, hi)``.

    In preorder the subtree of s ends at the first later segment starting at a path
    position <= s's own (a sibling of s or of an ancestor, or the end of the tree).
    """
    later = np.flatnonzero(seg_start[s + 1:hi] <= seg_start[s])
    return s + 1 + int(later[0]) if later.size else hi


def _local_subtree_ends(parent: np.ndarray) -> np.ndarray:
    """One past the last segment of every segment's subtree (preorder, parent < child)."""
    end = list(range(1, parent.shape[0] + 1))
    par = parent.tolist()
    for s in range(len(par) - 1, -1, -1):
        p = par[s]
        if p >= 0 and end[s] > end[p]:
            end[p] = end[s]
    return np.asarray(end, dtype=np.int64)


def _overlay(values: np.ndarray, exc, traj_local: np.ndarray, flat_offsets: np.ndarray,
             traj_start: np.ndarray, flat_lengths: np.ndarray, at: Optional[np.ndarray] = None) -> np.ndarray:
    """Apply per-(forest trajectory, position) exceptions onto expanded flat values.

    Trajectory t's flat values are ``flat_lengths[t]`` of its positions from ``traj_start[t]``, at
    flat indices ``flat_offsets[t] ...``.  ``values`` are the values at every flat index, or with
    ``at`` (ascending flat indices) at those only; the result has the shape of ``values``."""
    if exc.traj.shape[0] == 0 or traj_local.shape[0] == 0 or values.shape[0] == 0:
        return values
    # exceptions are sorted by trajectory: keep those of our trajectories
    idx = np.searchsorted(traj_local, exc.traj)
    idx_c = np.minimum(idx, traj_local.shape[0] - 1)
    ours = traj_local[idx_c] == exc.traj
    t = idx_c[ours]
    pos = exc.pos[ours]
    keep = (pos >= traj_start[t]) & (pos < traj_start[t] + flat_lengths[t])
    t, pos, value = t[keep], pos[keep], exc.value[ours][keep]
    flat = flat_offsets[t] + pos - traj_start[t]
    if at is not None:
        j = np.minimum(np.searchsorted(at, flat), at.shape[0] - 1)
        hit = at[j] == flat
        flat, value = j[hit], value[hit]
    out = values.copy()
    out[flat] = value
    return out


def _target_order(row: np.ndarray, token: np.ndarray, traj: np.ndarray) -> np.ndarray:
    """The targets sorted by (row, token, trajectory): one sort of a combined key where it fits 63
    bits, else a three-key lexsort (the same order: the keys are non-negative)."""
    if row.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    n_tok, n_traj = int(token.max()) + 1, int(traj.max()) + 1
    if (int(row.max()) + 1) * n_tok * n_traj < 2 ** 63:
        return np.argsort((row * n_tok + token) * n_traj + traj, kind="stable")
    return np.lexsort((traj, token, row))


def build_layout(forest: Forest, trees: Optional[Sequence[int]] = None, *,
                 roots: Optional[Sequence[int]] = None,
                 context: Optional[CompactLayout] = None,
                 segments: Optional[Sequence[int]] = None,
                 owned: Optional[Sequence[int]] = None) -> CompactLayout:
    """The compact layout of whole trees, of whole subtrees, or of a computed segment set.

    - ``trees``: tree indices (default: all trees).
    - ``roots``: forest segment ids instead: the layout holds each one's whole subtree.  They
      must not be nested.  A root that is not a tree root has ancestors: their rows are the
      layout's context rows, which must live in ``context``, the producer layout (a layout
      of the same forest holding those rows as its own rows).
    - ``segments``: forest segment ids instead: the layout holds exactly these segments (a
      microbatch's computed set, e.g. ``Microbatch.computed``).  A segment whose parent is not
      in the set is a layout root; all its ancestors are context rows (from ``context``), so
      none of them may be in the set (a computed segment above external context is refused).
      ``owned`` (default: all of ``segments``) are the segments whose rows carry targets: a
      target belongs to the segment of the row that predicts it, and the last row of an owned
      segment also predicts the next token of trajectories that leave the set there.  The other
      segments (recomputed) contribute rows, keys, KDA and conv context, but no targets.
      Trajectories are those through the layout roots; ``traj_rows`` holds the run of their
      positions held here (``traj_start`` ... up to where the path leaves the set).
    Either way the layout's rows are in forest order, whatever order the ids are given in.
    """
    if not isinstance(forest, Forest):
        raise ValueError(f"forest must be a Forest, got {type(forest).__name__}")
    if sum(x is not None for x in (trees, roots, segments)) > 1:
        given = " and ".join(n for n, x in (("trees", trees), ("roots", roots), ("segments", segments))
                             if x is not None)
        raise ValueError(f"{given}: pass one of trees, roots, segments, not several")
    if owned is not None and segments is None:
        raise ValueError("owned applies to a segments= layout only")
    S_f = forest.num_segments
    owned_f = None
    if segments is not None:
        seg_f = _int_list(segments, "segments", S_f)
        owned_f = seg_f if owned is None else _int_list(owned, "owned", S_f, allow_empty=True)
        if not np.isin(owned_f, seg_f).all():
            bad = int(owned_f[~np.isin(owned_f, seg_f)][0])
            raise ValueError(f"owned: segment {bad} is not in segments")
        fpar = forest.seg_parent[seg_f]
        lpar = np.searchsorted(seg_f, fpar)
        lpar_c = np.minimum(lpar, seg_f.shape[0] - 1)
        in_set = (fpar >= 0) & (seg_f[lpar_c] == fpar)
        roots_a = seg_f[~in_set]
        root_end = None
    elif roots is None:
        tree_idx = _int_list(range(forest.num_trees) if trees is None else trees, "trees", forest.num_trees)
        roots_a = forest.tree_offsets[tree_idx]
        root_end = forest.tree_offsets[tree_idx + 1]
    else:
        roots_a = _int_list(roots, "roots", S_f)
        tree_of = np.searchsorted(forest.tree_offsets, roots_a, side="right") - 1
        root_end = np.array([_subtree_end(forest.seg_start, int(s), int(forest.tree_offsets[t + 1]))
                             for s, t in zip(roots_a, tree_of)], dtype=np.int64)
        nested = roots_a[1:] < root_end[:-1]
        if nested.any():
            i = int(np.flatnonzero(nested)[0])
            raise ValueError(f"roots: segment {int(roots_a[i + 1])} lies inside the subtree of "
                             f"segment {int(roots_a[i])}; roots must not be nested")
    if context is not None and not isinstance(context, CompactLayout):
        raise ValueError(f"context must be a CompactLayout (the producer), got {type(context).__name__}")

    # ---- segments ----------------------------------------------------------
    if segments is None:
        n_seg_block = root_end - roots_a
        seg_f = _ranges(roots_a, n_seg_block)                   # forest segment of each local segment
        S = seg_f.shape[0]
        block_of_seg = np.repeat(np.arange(roots_a.shape[0], dtype=np.int64), n_seg_block)
        tree_seg_offsets = np.zeros(roots_a.shape[0] + 1, dtype=np.int64)
        np.cumsum(n_seg_block, out=tree_seg_offsets[1:])
        shift = seg_f - np.arange(S, dtype=np.int64)             # constant inside a block
        seg_parent = forest.seg_parent[seg_f] - shift
        is_root = np.zeros(S, dtype=bool)
        is_root[tree_seg_offsets[:-1]] = True
        seg_parent[is_root] = -1
    else:
        S = seg_f.shape[0]
        seg_parent = np.where(in_set, lpar_c, -1).astype(np.int64)
        is_root = ~in_set
        tree_seg_offsets = np.append(np.flatnonzero(is_root), S).astype(np.int64)
        block_of_seg = np.cumsum(is_root) - 1
    seg_start = forest.seg_start[seg_f].copy()
    seg_length = forest.seg_length[seg_f].copy()
    seg_row = np.zeros(S, dtype=np.int64)
    np.cumsum(seg_length[:-1], out=seg_row[1:])

    # ---- rows --------------------------------------------------------------
    R = int(seg_length.sum())
    row_seg = np.repeat(np.arange(S, dtype=np.int64), seg_length)
    forest_rows = _ranges(forest.seg_row[seg_f], seg_length)
    rows = np.arange(R, dtype=np.int64)
    offset_in_seg = rows - seg_row[row_seg]
    position_ids = seg_start[row_seg] + offset_in_seg
    seg_last_row = seg_row + seg_length - 1
    prev = rows - 1
    first_rows = seg_row
    has_parent = seg_parent >= 0
    prev[first_rows] = np.where(has_parent, seg_last_row[np.maximum(seg_parent, 0)], -1)
    occurrence = (forest.seg_traj_hi - forest.seg_traj_lo)[seg_f][row_seg]
    tree_row_offsets = np.append(seg_row[tree_seg_offsets[:-1]], R).astype(np.int64)
    row_tree = block_of_seg[row_seg]

    # visibility without eviction: one interval per key, [k, end of k's subtree of rows)
    seg_end = _local_subtree_ends(seg_parent)
    seg_end_row = seg_row[seg_end - 1] + seg_length[seg_end - 1]
    vis_end = seg_end_row[row_seg]

    # ---- trajectories ------------------------------------------------------
    t_lo_f = forest.seg_traj_lo[roots_a]
    t_n = forest.seg_traj_hi[roots_a] - t_lo_f
    traj_forest = _ranges(t_lo_f, t_n)
    N = traj_forest.shape[0]
    t_base = np.zeros(roots_a.shape[0], dtype=np.int64)
    np.cumsum(t_n[:-1], out=t_base[1:])
    t_shift = (t_lo_f - t_base)[block_of_seg]
    seg_traj_lo = forest.seg_traj_lo[seg_f] - t_shift
    seg_traj_hi = forest.seg_traj_hi[seg_f] - t_shift
    traj_length = forest.traj_length[traj_forest]
    traj_start = np.repeat(seg_start[tree_seg_offsets[:-1]], t_n)

    # expanded -> compact map: (trajectory, segment) pairs on each path, in path order
    cnt = seg_traj_hi - seg_traj_lo
    pair_seg = np.repeat(np.arange(S, dtype=np.int64), cnt)
    pair_traj = _ranges(seg_traj_lo, cnt)
    order = np.argsort(pair_traj, kind="stable")               # segments stay in preorder = path order
    pair_seg, pair_traj = pair_seg[order], pair_traj[order]
    traj_rows = _ranges(seg_row[pair_seg], seg_length[pair_seg])
    local_len = np.bincount(pair_traj, weights=seg_length[pair_seg], minlength=N).astype(np.int64)
    traj_row_offsets = np.zeros(N + 1, dtype=np.int64)
    np.cumsum(local_len, out=traj_row_offsets[1:])

    # exits (segments= layouts): a trajectory whose path leaves the set after its held run has
    # one more position, the first row of the forest child it continues into; the held run's
    # last row predicts that token.  Whole (sub)trees have no exits.
    exit_frow = np.full(N, -1, dtype=np.int64)
    if segments is not None:
        children = np.flatnonzero(np.isin(forest.seg_parent, seg_f) & ~np.isin(np.arange(S_f), seg_f))
        for c in children.tolist():
            lp = int(np.searchsorted(seg_f, forest.seg_parent[c]))
            sh = int(t_shift[lp])
            exit_frow[int(forest.seg_traj_lo[c]) - sh: int(forest.seg_traj_hi[c]) - sh] = forest.seg_row[c]
    has_exit = exit_frow >= 0
    ext_len = local_len + has_exit
    ext_offsets = np.zeros(N + 1, dtype=np.int64)
    np.cumsum(ext_len, out=ext_offsets[1:])
    if has_exit.any():      # an exit is the last position of its trajectory's run
        exit_pos = ext_offsets[1:][has_exit] - 1
        ext_held = np.ones(int(ext_offsets[-1]), dtype=bool)
        ext_held[exit_pos] = False
        ext_row = np.full(ext_held.shape[0], -1, dtype=np.int64)     # layout row, -1 at an exit position
        ext_row[ext_held] = traj_rows
        ext_frow = np.empty(ext_held.shape[0], dtype=np.int64)
        ext_frow[ext_held] = forest_rows[traj_rows]
        ext_frow[exit_pos] = exit_frow[has_exit]
    else:
        ext_row, ext_frow = traj_rows, forest_rows[traj_rows]

    # targets: expanded position i >= 1 (not the first held position) with loss mask 1, whose
    # predicting row (the previous position, always held) lies in an owned segment
    E = ext_row.shape[0]
    lm = _overlay(forest.row_loss_mask[ext_frow], forest.exc_loss_mask, traj_forest, ext_offsets, traj_start,
                  ext_len)
    is_first = np.zeros(E, dtype=bool)
    is_first[ext_offsets[:-1][ext_len > 0]] = True
    tgt = np.flatnonzero((lm == 1) & ~is_first)
    target_row = ext_row[tgt - 1]
    if owned_f is not None:
        keep = np.isin(seg_f[row_seg[target_row]], owned_f)
        tgt, target_row = tgt[keep], target_row[keep]
    target_traj = np.searchsorted(ext_offsets, tgt, side="right") - 1
    target_frow = ext_frow[tgt]
    target_token = forest.tokens[target_frow]

    # the targets' old log-probs and advantages (per-token values with the trajectories' exceptions)
    weight = forest.traj_weight[traj_forest]
    weight = np.where(np.isnan(weight), 1.0, weight)
    traj_of = traj_forest[target_traj]
    old_lp = _overlay(forest.row_old_logprobs[target_frow], forest.exc_old_logprobs, traj_forest, ext_offsets,
                      traj_start, ext_len, at=tgt)
    old_lp = np.where(forest.traj_has_old_logprobs[traj_of], old_lp, np.nan)
    adv_tok = _overlay(forest.row_advantage[target_frow], forest.exc_advantage, traj_forest, ext_offsets,
                       traj_start, ext_len, at=tgt)
    kind = forest.traj_adv_kind[traj_of]
    adv = np.where(kind == ADV_TOKEN, adv_tok, np.where(kind == ADV_SCALAR, forest.traj_advantage[traj_of], np.nan))

    order = _target_order(target_row, target_token, target_traj)
    target_row, target_traj, target_token = target_row[order], target_traj[order], target_token[order]
    old_lp, adv = old_lp[order], adv[order]
    target_position = position_ids[target_row] + 1
    new_pair = np.ones(tgt.shape[0], dtype=bool)
    new_pair[1:] = (target_row[1:] != target_row[:-1]) | (target_token[1:] != target_token[:-1])
    target_pair = np.cumsum(new_pair) - 1
    pair_row, pair_token = target_row[new_pair], target_token[new_pair]

    # ---- external context ----------------------------------------------------
    ctx = _build_context(forest, roots_a, seg_f, tree_seg_offsets, tree_row_offsets, context)
    prev_external = np.full(R, -1, dtype=np.int64)
    prev_external[seg_row[tree_seg_offsets[:-1]]] = ctx["root_prev_external"]

    # ---- compaction events: holes in the keys' intervals -------------------------
    vis_offsets, vis_start, num_events = np.arange(R + 1, dtype=np.int64), rows.copy(), 0
    if forest.has_compactions:
        vis_offsets, vis_start, vis_end, num_events = _evicted_visibility(
            forest, seg_f, seg_start, seg_row, row_seg, vis_end, seg_traj_lo, traj_rows, traj_row_offsets,
            traj_start, block_of_seg, ctx)

    T = torch.from_numpy
    return CompactLayout(
        forest_rows=T(forest_rows), tokens=T(forest.tokens[forest_rows].astype(np.int64)),
        position_ids=T(position_ids), prev=T(prev), prev_external=T(prev_external),
        row_segment=T(row_seg), row_tree=T(row_tree), occurrence=T(occurrence.astype(np.int64)),
        vis_offsets=T(vis_offsets), vis_start=T(vis_start), vis_end=T(vis_end),
        target_row=T(target_row), target_traj=T(target_traj), target_token=T(target_token.astype(np.int64)),
        target_position=T(target_position), target_weight=T(weight[target_traj].astype(np.float64)),
        target_old_logprob=T(old_lp.astype(np.float64)), target_advantage=T(adv.astype(np.float64)),
        target_pair=T(target_pair.astype(np.int64)), pair_row=T(pair_row), pair_token=T(pair_token.astype(np.int64)),
        traj_ids=[forest.traj_ids[i] for i in traj_forest.tolist()], traj_forest=traj_forest,
        traj_length=T(traj_length.astype(np.int64)), traj_start=T(traj_start),
        traj_row_offsets=T(traj_row_offsets), traj_rows=T(traj_rows),
        seg_parent=seg_parent, seg_start=seg_start, seg_length=seg_length, seg_row=seg_row, seg_forest=seg_f,
        seg_traj_lo=seg_traj_lo, seg_traj_hi=seg_traj_hi,
        tree_roots=roots_a.astype(np.int64), tree_seg_offsets=tree_seg_offsets, tree_row_offsets=tree_row_offsets,
        ctx_forest_rows=T(ctx["forest_rows"]), ctx_source_rows=T(ctx["source_rows"]), ctx_prev=T(ctx["prev"]),
        ctx_position_ids=T(ctx["position_ids"]), ctx_vis_offsets=T(ctx["vis_offsets"]),
        ctx_vis_start=T(ctx["vis_start"]), ctx_vis_end=T(ctx["vis_end"]), num_events=num_events,
    )


def _evicted_visibility(forest: Forest, seg_f, seg_start, seg_row, row_seg, vis_end, seg_traj_lo, traj_rows,
                        traj_row_offsets, traj_start, block_of_seg, ctx: dict):
    """The visibility CSR ``(offsets, start, end, number of events)`` of the layout's rows, whose keys'
    uncompacted intervals are ``[k, vis_end[k])`` (module docstring); with context rows, ``ctx``'s
    visibility (``vis_offsets``, ``vis_start``, ``vis_end``) gets its holes too, in place.

    An event of layout segment s at position ``at`` sits at row ``e = seg_row[s] + at - seg_start[s]``
    and opens the hole ``[e, vis_end[e])`` (e's subtree) in every key on e's path at positions
    ``[start, end)``: a layout row, read from the trajectory table of a trajectory through s, or,
    above s's layout root, a context row.  An event of a context segment c opens, in the context
    keys of its span, the hole of every layout row below it: the rows of the roots under c.  The
    holes of one key are sets of rows below a forest row, so any two are nested or disjoint
    (:func:`_subtract_holes`).  Work is linear in rows plus the (key, event) pairs, i.e. the
    events' span lengths, plus the context's (root, ancestor segment) pairs.
    """
    R = int(vis_end.shape[0])
    S = int(seg_f.shape[0])
    rows = np.arange(R, dtype=np.int64)
    a, b = forest.seg_evt_offsets[seg_f], forest.seg_evt_offsets[seg_f + 1]
    n = (b - a).astype(np.int64)
    ev = _ranges(a, n)
    cseg = ctx["seg"]
    ca, cb = forest.seg_evt_offsets[cseg], forest.seg_evt_offsets[cseg + 1]
    cn = (cb - ca).astype(np.int64)
    cev = _ranges(ca, cn)
    if ev.size == 0 and cev.size == 0:
        return np.arange(R + 1, dtype=np.int64), rows, vis_end, 0
    # events of the layout's segments
    ev_seg = np.repeat(np.arange(S, dtype=np.int64), n)
    e_row = seg_row[ev_seg] + forest.evt_at[ev] - seg_start[ev_seg]
    span = (forest.evt_end[ev] - forest.evt_start[ev]).astype(np.int64)
    of = np.repeat(np.arange(ev.shape[0], dtype=np.int64), span)
    pos = _ranges(forest.evt_start[ev], span)
    t = seg_traj_lo[ev_seg][of]
    h0 = e_row[of]
    h1 = vis_end[h0]
    held = pos >= traj_start[t]                   # the key is a layout row (else a context row)
    key = traj_rows[traj_row_offsets[t[held]] + pos[held] - traj_start[t[held]]]
    offsets, start, end = _subtract_holes(rows, vis_end, key, h0[held], h1[held], R + 1)
    if cseg.shape[0]:
        # context keys: above a layout root (events of layout segments) ...
        ext = ~held
        c_root = [block_of_seg[ev_seg[of[ext]]]]
        c_pos, c_h0, c_h1 = [pos[ext]], [h0[ext]], [h1[ext]]
        # ... and events of the context segments: the hole is every layout row below the event
        c_ev_seg = np.repeat(np.arange(cseg.shape[0], dtype=np.int64), cn)
        c_span = (forest.evt_end[cev] - forest.evt_start[cev]).astype(np.int64)
        c_of = np.repeat(c_ev_seg, c_span)
        lo, hi = ctx["block_rows"]
        c_root.append(ctx["first_root"][c_of])
        c_pos.append(_ranges(forest.evt_start[cev], c_span))
        c_h0.append(lo[c_of])
        c_h1.append(hi[c_of])
        c_key = _context_rows_at(forest, ctx, np.concatenate(c_root), np.concatenate(c_pos))
        ctx["vis_offsets"], ctx["vis_start"], ctx["vis_end"] = _subtract_holes(
            ctx["vis_start"], ctx["vis_end"], c_key, np.concatenate(c_h0), np.concatenate(c_h1), R + 1)
    return offsets, start, end, int(ev.shape[0] + cev.shape[0])


def _subtract_holes(base_start: np.ndarray, base_end: np.ndarray, key: np.ndarray, h0: np.ndarray, h1: np.ndarray,
                    width: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR ``(offsets, start, end)`` of key k's base interval ``[base_start[k], base_end[k])`` minus the
    union of its holes ``[h0[i], h1[i])`` (``key[i] == k``): sorted, disjoint, non-empty intervals (a
    key may keep none).  The holes of one key must lie inside its base interval and be laminar (any
    two nested or disjoint); ``width`` exceeds every hole end.

    After sorting by (key, hole start, -hole end) a hole inside an earlier one starts before the
    running maximum of the earlier ends and is dropped; the kept holes are disjoint and sorted, so
    the intervals pair the sorted starts (base start, hole ends) with the sorted ends (hole starts,
    base end) of each key.
    """
    K = int(base_start.shape[0])
    keys = np.arange(K, dtype=np.int64)
    if key.size == 0:
        return np.arange(K + 1, dtype=np.int64), base_start.astype(np.int64), base_end.astype(np.int64)
    order = np.lexsort((-h1, h0, key))
    key, h0, h1 = key[order], h0[order], h1[order]
    reach = np.maximum.accumulate(key * width + h1)
    keep = np.ones(key.shape[0], dtype=bool)
    keep[1:] = key[1:] * width + h0[1:] >= reach[:-1]
    key, h0, h1 = key[keep], h0[keep], h1[keep]
    s_key = np.concatenate([keys, key])
    s_val = np.concatenate([base_start, h1])
    e_key = np.concatenate([key, keys])
    e_val = np.concatenate([h0, base_end])
    so = np.lexsort((s_val, s_key))
    eo = np.lexsort((e_val, e_key))
    i_key, i_start, i_end = s_key[so], s_val[so], e_val[eo]
    real = i_start < i_end
    i_key, i_start, i_end = i_key[real], i_start[real], i_end[real]
    offsets = np.zeros(K + 1, dtype=np.int64)
    np.cumsum(np.bincount(i_key, minlength=K), out=offsets[1:])
    return offsets, i_start.astype(np.int64), i_end.astype(np.int64)


def _context_rows_at(forest: Forest, ctx: dict, root: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """The context row at path position ``pos[i]`` above layout root ``root[i]`` (``pos[i]`` below the
    root's start): the row of the root's ancestor segment holding that position, found by one
    binary search over the (root, ancestor start)-sorted pairs of ``ctx``."""
    if root.size == 0:
        return np.zeros(0, dtype=np.int64)
    cstart = forest.seg_start[ctx["seg"]]
    anc_root, anc = ctx["anc_root"], ctx["anc_local"]
    width = int(max(int(cstart.max()), int(pos.max()))) + 1
    table = anc_root * width + cstart[anc]
    order = np.argsort(table, kind="stable")
    idx = np.searchsorted(table[order], root * width + pos, side="right") - 1
    seg = anc[order][idx]
    return ctx["seg_row"][seg] + pos - cstart[seg]


def _build_context(forest: Forest, roots: np.ndarray, seg_f: np.ndarray, tree_seg_offsets: np.ndarray,
                   tree_row_offsets: np.ndarray, producer: Optional[CompactLayout]) -> dict:
    """Context rows: all ancestor rows of the layout's roots, and their visibility before compaction
    events (:func:`_evicted_visibility` opens their holes).

    Each ancestor segment a is on the path of a contiguous run of roots (roots are in preorder
    and those below a are exactly the roots inside a's subtree), so each context row sees one
    interval of this layout's rows, the rows of those roots.
    """
    empty = np.zeros(0, dtype=np.int64)
    n_roots = roots.shape[0]
    anc_seg, anc_root = [], []
    for i, s in enumerate(roots.tolist()):
        p = int(forest.seg_parent[s])
        while p >= 0:
            anc_seg.append(p)
            anc_root.append(i)
            p = int(forest.seg_parent[p])
    if not anc_seg:
        return {"forest_rows": empty, "source_rows": empty, "prev": empty, "position_ids": empty,
                "vis_offsets": np.zeros(1, dtype=np.int64), "vis_start": empty, "vis_end": empty,
                "root_prev_external": np.full(n_roots, -1, dtype=np.int64), "seg": empty, "seg_row": empty,
                "first_root": empty, "block_rows": (empty, empty), "anc_root": empty, "anc_local": empty}
    local = np.isin(np.asarray(anc_seg, dtype=np.int64), seg_f)
    if local.any():
        j = int(np.flatnonzero(local)[0])
        raise ValueError(f"segments: segment {int(roots[anc_root[j]])} has external context (its parent is not "
                         f"in the set) below segment {anc_seg[j]}, which is in the set; a computed segment "
                         f"above external context is not supported (recompute the context instead)")
    if producer is None:
        i = anc_root[0]
        raise ValueError(f"context: root segment {int(roots[i])} is not a tree root; its ancestor rows "
                         f"must come from a producer layout passed as context")
    anc_seg = np.asarray(anc_seg, dtype=np.int64)
    anc_root = np.asarray(anc_root, dtype=np.int64)
    cseg, inv = np.unique(anc_seg, return_inverse=True)
    first_root = np.full(cseg.shape[0], n_roots, dtype=np.int64)
    last_root = np.full(cseg.shape[0], -1, dtype=np.int64)
    np.minimum.at(first_root, inv, anc_root)
    np.maximum.at(last_root, inv, anc_root)
    clen = forest.seg_length[cseg]
    crow = np.zeros(cseg.shape[0], dtype=np.int64)
    np.cumsum(clen[:-1], out=crow[1:])
    Rc = int(clen.sum())
    ctx_forest_rows = _ranges(forest.seg_row[cseg], clen)
    ctx_seg = np.repeat(np.arange(cseg.shape[0], dtype=np.int64), clen)
    ctx_position_ids = forest.seg_start[cseg][ctx_seg] + np.arange(Rc, dtype=np.int64) - crow[ctx_seg]
    ctx_prev = np.arange(Rc, dtype=np.int64) - 1
    fpar = forest.seg_parent[cseg]
    lpar = np.searchsorted(cseg, fpar)                       # every ancestor's parent is an ancestor too
    ctx_prev[crow] = np.where(fpar >= 0, crow[np.minimum(lpar, cseg.shape[0] - 1)]
                              + clen[np.minimum(lpar, cseg.shape[0] - 1)] - 1, -1)
    vis_start = tree_row_offsets[first_root][ctx_seg]
    vis_end = tree_row_offsets[last_root + 1][ctx_seg]
    # previous row of each root's first row: last row of its forest parent segment
    root_parent = forest.seg_parent[roots]
    rp = np.searchsorted(cseg, root_parent)
    rp_c = np.minimum(rp, cseg.shape[0] - 1)
    root_prev_external = np.where(root_parent >= 0, crow[rp_c] + clen[rp_c] - 1, -1)
    # where the context rows live in the producer
    src = np.searchsorted(producer.forest_rows.cpu().numpy(), ctx_forest_rows)
    src_c = np.minimum(src, max(producer.num_rows - 1, 0))
    pf = producer.forest_rows.cpu().numpy()
    missing = (src >= producer.num_rows) | (pf[src_c] != ctx_forest_rows)
    if missing.any():
        r = int(ctx_forest_rows[np.flatnonzero(missing)[0]])
        raise ValueError(f"context: the producer layout does not hold forest row {r}, an ancestor row "
                         f"of this layout's roots")
    if not np.array_equal(producer.tokens.cpu().numpy()[src_c], forest.tokens[ctx_forest_rows]):
        raise ValueError("context: the producer layout's tokens differ from this forest's ancestor rows "
                         "(was it built from another forest?)")
    return {"forest_rows": ctx_forest_rows, "source_rows": src_c.astype(np.int64), "prev": ctx_prev,
            "position_ids": ctx_position_ids, "vis_offsets": np.arange(Rc + 1, dtype=np.int64),
            "vis_start": vis_start, "vis_end": vis_end, "root_prev_external": root_prev_external,
            # for compaction events (_evicted_visibility): the context segments, their first rows, the
            # first root below each and the layout rows below each, every (root, ancestor) pair
            "seg": cseg, "seg_row": crow, "first_root": first_root,
            "block_rows": (tree_row_offsets[first_root], tree_row_offsets[last_root + 1]),
            "anc_root": anc_root, "anc_local": inv.astype(np.int64).reshape(-1)}


# ---------------------------------------------------------------------------
# compact -> expanded
# ---------------------------------------------------------------------------

def _check_values(layout: CompactLayout, values, n: int, what: str, name: str):
    if not isinstance(layout, CompactLayout):
        raise ValueError(f"layout must be a CompactLayout, got {type(layout).__name__}")
    if not isinstance(values, (torch.Tensor, np.ndarray)) or values.ndim < 1 or values.shape[0] != n:
        shape = tuple(values.shape) if hasattr(values, "shape") else type(values).__name__
        raise ValueError(f"{name} must be an array with {n} {what} on its first axis, got {shape}")


def _index(values, idx: torch.Tensor):
    if isinstance(values, np.ndarray):
        return values[idx.cpu().numpy()]
    return values[idx.to(values.device)]


def scatter_to_expanded(layout: CompactLayout, values) -> Tuple[Union[torch.Tensor, np.ndarray], torch.Tensor]:
    """Per-row values -> every trajectory's positions, concatenated in trajectory order.

    Returns ``(flat, offsets)``: ``flat[offsets[t] + j]`` is the value of trajectory t at
    position ``traj_start[t] + j``, i.e. ``values[traj_rows[offsets[t] + j]]``.  Differentiable
    for torch tensors (the gradient sums over all copies of a row).
    """
    _check_values(layout, values, layout.num_rows, "rows", "values")
    return _index(values, layout.traj_rows), layout.traj_row_offsets


def scatter_to_expanded_padded(layout: CompactLayout, values, pad=0):
    """Per-row values -> ``[N, Lmax, ...]``: entry (t, j) is position ``traj_start[t] + j``.

    ``Lmax`` is the longest run of positions held here; entries beyond a trajectory's end are
    ``pad``.
    """
    flat, off = scatter_to_expanded(layout, values)
    return _pad(layout, flat, off, pad)


def _pad(layout: CompactLayout, flat, off: torch.Tensor, pad):
    N = layout.num_trajectories
    lengths = (off[1:] - off[:-1]).cpu()
    L = int(lengths.max()) if N else 0
    traj = torch.repeat_interleave(torch.arange(N), lengths)
    col = torch.arange(flat.shape[0]) - off[:-1].cpu()[traj]
    if isinstance(flat, np.ndarray):
        out = np.full((N, L) + flat.shape[1:], pad, dtype=flat.dtype)
        out[traj.numpy(), col.numpy()] = flat
        return out
    out = torch.full((N, L) + tuple(flat.shape[1:]), pad, dtype=flat.dtype, device=flat.device)
    return out.index_put((traj.to(flat.device), col.to(flat.device)), flat)


def scatter_targets_to_expanded(layout: CompactLayout, values, fill=float("nan"), *, padded: bool = False):
    """Per-target values -> expanded positions: target i lands on trajectory ``target_traj[i]``
    at position ``target_position[i]`` (the position of the predicted token, as expanded
    log-probs are indexed); positions without a target here hold ``fill``.

    Returns ``(flat, offsets)`` in :func:`scatter_to_expanded`'s order, or the padded
    ``[N, Lmax, ...]`` array when ``padded``.
    """
    _check_values(layout, values, layout.num_targets, "targets", "values")
    off = layout.traj_row_offsets
    dest = off[layout.target_traj] + layout.target_position - layout.traj_start[layout.target_traj]
    E = layout.num_expanded_tokens
    if isinstance(values, np.ndarray):
        flat = np.full((E,) + values.shape[1:], fill, dtype=np.result_type(values.dtype, np.asarray(fill).dtype))
        flat[dest.cpu().numpy()] = values
    else:
        flat = torch.full((E,) + tuple(values.shape[1:]), fill, dtype=values.dtype, device=values.device)
        flat = flat.index_put((dest.to(values.device),), values)
    if padded:
        return _pad(layout, flat, off, fill)
    return flat, off


# ---------------------------------------------------------------------------
# expanded (trajectory-by-trajectory) batches
# ---------------------------------------------------------------------------

@dataclass
class ExpandedBatch(_RowsAndTargets):
    """Trajectories packed back to back with no sharing: the expanded-mode microbatch.

    It carries the same target fields as a :class:`CompactLayout` (``target_*``,
    ``pair_*``, ``traj_forest``), with rows being packed token positions: trajectory t
    occupies rows ``[offsets[t], offsets[t+1])`` and its target at position j (loss mask 1,
    j >= 1) sits on row ``offsets[t] + j - 1``.  Every target is its own (row, token) pair.
    Target metadata (weight, old log-prob, advantage) follows :func:`build_layout`'s rules,
    so a loss computed from a batch's targets is the one tree mode computes for them.
    ``visibility``: None when no trajectory of the batch has compaction events (every sequence is
    plainly causal), else the full-attention visibility of the packed rows
    (:func:`sequence_visibility`), which expanded-mode attention must honour.
    """
    tokens: torch.Tensor            # int64 [T]
    position_ids: torch.Tensor      # int64 [T], position inside its trajectory
    lengths: List[int]
    traj_ids: List[TrajectoryId]
    traj_forest: np.ndarray         # int64, trajectory index in the forest
    target_row: torch.Tensor
    target_traj: torch.Tensor       # int64, index into traj_forest
    target_token: torch.Tensor
    target_position: torch.Tensor
    target_weight: torch.Tensor
    target_old_logprob: torch.Tensor
    target_advantage: torch.Tensor
    visibility: Optional[Visibility] = None

    @property
    def num_trajectories(self) -> int:
        return len(self.lengths)

    @property
    def pair_row(self) -> torch.Tensor:
        return self.target_row

    @property
    def pair_token(self) -> torch.Tensor:
        return self.target_token

    @property
    def target_pair(self) -> torch.Tensor:
        return torch.arange(self.num_targets, device=self.target_row.device)


def sequence_visibility(lengths: Sequence[int], compactions: Sequence[Optional[np.ndarray]]) -> Optional[Visibility]:
    """Full-attention visibility of sequences packed back to back, each with its compaction events
    (``compactions[i]``: ``Trajectory.compactions`` of sequence i, an ``[E, 3]`` array of
    ``(at, start, end)`` or None); None when no sequence has any (plain causal sequences).

    Sequence i's key j (local position) is seen by its queries ``[j, min(n_i, at of every event
    with start <= j < end))``: one interval per key, the per-trajectory mask
    ``j <= q and not any(start <= j < end and at <= q)``.
    """
    lengths = [int(n) for n in lengths]
    if len(compactions) != len(lengths):
        raise ValueError(f"sequence_visibility: {len(compactions)} event lists for {len(lengths)} sequences")
    if all(c is None or len(c) == 0 for c in compactions):
        return None
    total = sum(lengths)
    end = np.empty(total, dtype=np.int64)
    o = 0
    for n, ev in zip(lengths, compactions):
        local = np.full(n, n, dtype=np.int64)
        if ev is not None:
            for at, a, b in np.asarray(ev, dtype=np.int64).reshape(-1, 3).tolist():
                if not 0 <= a < b <= at < n:
                    raise ValueError(f"sequence_visibility: compaction event (at={at}, start={a}, end={b}) needs "
                                     f"0 <= start < end <= at < {n} (the sequence's length)")
                np.minimum(local[a:b], at, out=local[a:b])
        end[o:o + n] = local + o
        o += n
    rows = torch.arange(total, dtype=torch.int64)
    return Visibility(torch.arange(total + 1, dtype=torch.int64), rows, torch.from_numpy(end), total, causal=True)


def build_expanded_batch(forest: Forest, trajectories: Sequence[int]) -> ExpandedBatch:
    """The listed forest trajectories (indices; packed in increasing index order) as one expanded batch,
    with the visibility of their compaction events where any has some."""
    idx = _int_list(trajectories, "trajectories", forest.num_trajectories)
    toks, pos, rows, traj, tok, tpos, w, old, adv, events = [], [], [], [], [], [], [], [], [], []
    offset = 0
    for local, t in enumerate(idx.tolist()):
        tr = forest.expand(forest.traj_ids[t])
        n = len(tr)
        events.append(tr.compactions)
        toks.append(tr.tokens)
        pos.append(np.arange(n))
        j = np.flatnonzero(np.asarray(tr.loss_mask[1:], dtype=bool)) + 1
        rows.append(offset + j - 1)
        traj.append(np.full(j.size, local))
        tok.append(tr.tokens[j])
        tpos.append(j)
        w.append(np.full(j.size, 1.0 if tr.weight is None else tr.weight))
        old.append(np.full(j.size, np.nan) if tr.old_logprobs is None else np.asarray(tr.old_logprobs, np.float64)[j])
        if tr.advantage is None:
            adv.append(np.full(j.size, np.nan))
        elif np.ndim(tr.advantage) == 0:
            adv.append(np.full(j.size, float(tr.advantage)))
        else:
            adv.append(np.asarray(tr.advantage, np.float64)[j])
        offset += n

    def cat(parts, dtype):
        return torch.as_tensor(np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype))
    return ExpandedBatch(
        tokens=cat(toks, np.int64), position_ids=cat(pos, np.int64), lengths=[len(x) for x in toks],
        traj_ids=[forest.traj_ids[t] for t in idx.tolist()], traj_forest=idx.astype(np.int64),
        target_row=cat(rows, np.int64), target_traj=cat(traj, np.int64), target_token=cat(tok, np.int64),
        target_position=cat(tpos, np.int64), target_weight=cat(w, np.float64),
        target_old_logprob=cat(old, np.float64), target_advantage=cat(adv, np.float64),
        visibility=sequence_visibility([len(x) for x in toks], events))
