"""Paths longer than the row budget: cut into pieces that read the earlier pieces' exports.

A tree whose longest trajectory exceeds the row budget ``M`` (a *long tree*) cannot be placed by
the microbatch planners, which recompute a microbatch's whole root path.  Its rows are cut into
**pieces** instead, each one microbatch of at most ``M`` rows that reads the rows above it (its
root path) from the earlier pieces holding them, the way a sharing-window consumer reads its
producer: MLA key/value latents, conv context, KDA boundary states and replay inputs.

Invariants of :func:`plan_with_pieces` (``tests/test_pieces.py``):

- The step forest (``PieceSet.forest``) holds the fitting trees first, in their order, then the long
  trees, with the long trees' segments cut at the positive multiples of ``width`` (``B``-aligned
  when ``M >= B``: a cut is then a KDA chunk boundary, no replay).  The base plan covers
  the fitting trees; its segment and trajectory ids are the step forest's (they come first).
- Tree mode: every segment of a long tree is in exactly one piece; a piece's segments are closed
  under "the parent is in the piece or in a piece it reads"; ``reads`` lists every earlier piece
  holding a row of its root path (so it reads its whole context), and pieces come in an order
  where every read piece is earlier.  A piece owns the targets of its rows.
- Expanded mode (``--tree-sharing off``): every trajectory longer than ``M`` is a chain of its own (a
  one-trajectory forest, cut the same way), computed without sharing; the long trees' other
  trajectories are packed whole, first-fit decreasing by length, into ``groups`` of at most ``M``
  tokens, one expanded microbatch each.
- Every piece and group has at most ``M`` rows; each chain (a long tree, or in expanded mode one
  trajectory) runs on one data-parallel replica.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..tree_data.forest import Forest, build_forest
from .microbatch import PlanningError

__all__ = ["Piece", "PieceSet", "long_trees", "piece_width", "tree_pieces", "plan_with_pieces",
           "piece_backward_points"]


@dataclass(frozen=True)
class Piece:
    """One microbatch of a chain: ``segments`` (sorted ids of the chain's forest), ``reads`` (earlier
    pieces of the same chain, by index in ``PieceSet.pieces``, holding its root path), ``rows``."""
    segments: np.ndarray
    reads: Tuple[int, ...]
    rows: int


@dataclass
class PieceSet:
    """The pieces of a step's long trees (module docstring).

    ``chains[c] = (lo, hi)``: pieces ``lo .. hi-1`` form chain c (one tree, or one trajectory in
    expanded mode), in execution order; ``chain_forest[c]``: the forest their segments index (the
    step forest, or the trajectory's own forest); ``chain_trajectory[c]``: expanded mode, the step
    forest's index of that trajectory (-1 in tree mode); ``chain_replica[c]``: the replica running it.
    ``groups[g]`` (expanded mode): step-forest trajectories of the long trees that fit the budget,
    packed into one expanded microbatch on replica ``group_replica[g]``.
    """
    forest: Forest
    mode: str
    width: int
    num_fit_trees: int
    pieces: List[Piece] = field(default_factory=list)
    chains: List[Tuple[int, int]] = field(default_factory=list)
    chain_forest: List[Forest] = field(default_factory=list)
    chain_trajectory: List[int] = field(default_factory=list)
    chain_replica: List[int] = field(default_factory=list)
    groups: List[np.ndarray] = field(default_factory=list)
    group_replica: List[int] = field(default_factory=list)

    def fitting_forest(self) -> Forest:
        """The fitting trees as the forest the base plan was made for (a prefix of the step forest's
        segments, rows and trajectories, so its ids are the step forest's)."""
        return self.forest.select(np.arange(self.num_fit_trees))

    @property
    def rows(self) -> int:
        length = np.asarray(self.forest.traj_length, dtype=np.int64)
        return sum(p.rows for p in self.pieces) + sum(int(length[g].sum()) for g in self.groups)

    @property
    def num_microbatches(self) -> int:
        return len(self.pieces) + len(self.groups)

    @property
    def expanded_tokens(self) -> int:
        """Trajectory tokens of the long trees (what their microbatches route, every copy counted)."""
        f, lo = self.forest, int(self.forest.tree_offsets[self.num_fit_trees])
        t0 = int(f.seg_traj_lo[lo]) if lo < f.num_segments else f.num_trajectories
        return int(np.asarray(f.traj_length[t0:], dtype=np.int64).sum())


def long_trees(forest: Forest, row_budget: int) -> np.ndarray:
    """Trees holding a trajectory longer than ``row_budget`` rows."""
    lengths = np.asarray(forest.traj_length, dtype=np.int64)
    traj_tree = np.searchsorted(forest.tree_offsets, np.asarray(forest.traj_leaf, dtype=np.int64), side="right") - 1
    long = np.zeros(forest.num_trees, dtype=bool)
    long[traj_tree[lengths > int(row_budget)]] = True
    return np.flatnonzero(long).astype(np.int64)


def piece_width(row_budget: int, chunk_size: int) -> int:
    """Depth between cuts: a quarter of the budget rounded down to a multiple of the KDA chunk size
    (at least one chunk; the budget itself when it is below one chunk).  Cuts at chunk multiples
    start every continued sequence on a chunk boundary (no replay); a quarter of the budget lets
    the preorder fill of :func:`tree_pieces` leave at most that much of a piece empty."""
    M, B = int(row_budget), int(chunk_size)
    if M < B:
        return M
    return max(B, (M // 4 // B) * B)


def tree_pieces(forest: Forest, tree: int, row_budget: int, first: int = 0) -> List[Piece]:
    """Pieces of tree ``tree`` of a forest cut at depths (no segment longer than the budget).

    The segments in preorder (every segment after its parent) fill pieces in turn: a segment joins
    the current piece while its rows fit in ``M``, else it opens the next one.  A piece's segments
    then have their parents in it or in earlier pieces, every piece but the tree's last is full to
    within one segment, and ``reads`` are the earlier pieces holding a row of any of its segments'
    root paths.  ``first``: the index of the first piece in the caller's list (``reads`` are absolute).
    """
    M = int(row_budget)
    lo, hi = int(forest.tree_offsets[tree]), int(forest.tree_offsets[tree + 1])
    parent = np.asarray(forest.seg_parent[lo:hi], dtype=np.int64) - lo
    length = np.asarray(forest.seg_length[lo:hi], dtype=np.int64)
    if int(length.max()) > M:
        raise PlanningError(f"tree {tree}: a segment of {int(length.max())} rows is longer than the microbatch "
                            f"row budget {M} (--tree-microbatch-tokens); cut the forest at depths first")
    n = hi - lo
    piece_of = np.empty(n, dtype=np.int64)       # local piece index of every segment
    path: List[frozenset] = [frozenset()] * n    # local pieces holding the segment's root path, itself included
    groups: List[List[int]] = []
    load = M + 1
    for seg in range(n):        # segment ids of a tree are in preorder: a parent before its children
        if load + int(length[seg]) > M:
            groups.append([])
            load = 0
        groups[-1].append(seg)
        load += int(length[seg])
        piece_of[seg] = len(groups) - 1
        up = path[parent[seg]] if seg else frozenset()
        path[seg] = up | {int(piece_of[seg])}
    out: List[Piece] = []
    for k, segs in enumerate(groups):
        reads = set().union(*(path[s] for s in segs)) - {k}
        seg = np.asarray(segs, dtype=np.int64) + lo
        out.append(Piece(segments=seg, reads=tuple(first + r for r in sorted(reads)),
                         rows=int(length[segs].sum())))
    return out


def _trajectory_forest(forest: Forest, t: int, width: int) -> Forest:
    one = build_forest([forest.expand(forest.traj_ids[t])])
    return one.cut_at_depths([0], width)


def plan_with_pieces(forest: Forest, row_budget: int, chunk_size: int, dp: int,
                     plan_fn: Callable[[Forest], object], *, mode: str = "tree",
                     empty_plan: Optional[Callable[[], object]] = None):
    """``plan_fn``'s plan of the fitting trees with the long trees' pieces attached (``plan.pieces``).

    Returns ``plan_fn(forest)`` unchanged when no tree is long.  Otherwise the plan of the fitting
    trees of the step forest (``plan.pieces.forest``, module docstring; ``empty_plan()`` when every
    tree is long), whose ``expanded_tokens`` then count the long trees' tokens too, with a
    :class:`PieceSet`.  Chains go, largest first, to the replica with the fewest rows so far.
    """
    if mode not in ("tree", "expanded"):
        raise ValueError(f"plan_with_pieces: mode must be 'tree' or 'expanded', got {mode!r}")
    M = int(row_budget)
    if isinstance(row_budget, bool) or M < 1:
        raise PlanningError(f"the microbatch row budget must be an integer >= 1, got {row_budget!r}")
    long = long_trees(forest, M)
    if long.size == 0:
        return plan_fn(forest)
    fit = np.setdiff1d(np.arange(forest.num_trees, dtype=np.int64), long)
    width = piece_width(M, chunk_size)
    step = forest.select(np.concatenate([fit, long]))
    n_fit = int(fit.size)
    if mode == "tree":
        step = step.cut_at_depths(range(n_fit, step.num_trees), width)
    if n_fit:
        base = plan_fn(step.select(np.arange(n_fit)))     # = PieceSet.fitting_forest()
    elif empty_plan is not None:
        base = empty_plan()
    else:
        raise PlanningError("plan_with_pieces: every tree is longer than the budget and no empty plan was given")
    ps = PieceSet(forest=step, mode=mode, width=width, num_fit_trees=n_fit)
    if mode == "tree":
        for t in range(n_fit, step.num_trees):
            lo = len(ps.pieces)
            ps.pieces += tree_pieces(step, t, M, first=lo)
            ps.chains.append((lo, len(ps.pieces)))
            ps.chain_forest.append(step)
            ps.chain_trajectory.append(-1)
    else:
        t0 = int(step.seg_traj_lo[int(step.tree_offsets[n_fit])])
        length = np.asarray(step.traj_length, dtype=np.int64)
        short = []
        for t in range(t0, step.num_trajectories):
            if length[t] <= M:
                short.append(t)
                continue
            one = _trajectory_forest(step, t, width)
            lo = len(ps.pieces)
            ps.pieces += tree_pieces(one, 0, M, first=lo)
            ps.chains.append((lo, len(ps.pieces)))
            ps.chain_forest.append(one)
            ps.chain_trajectory.append(t)
        loads: List[int] = []
        groups: List[List[int]] = []
        for t in sorted(short, key=lambda t: (-int(length[t]), t)):     # first-fit decreasing
            g = next((g for g, used in enumerate(loads) if used + length[t] <= M), len(loads))
            if g == len(loads):
                groups.append([])
                loads.append(0)
            groups[g].append(t)
            loads[g] += int(length[t])
        ps.groups = [np.array(sorted(g), dtype=np.int64) for g in groups]
    # placement: each chain and group on one replica, largest first to the least-loaded one (rows)
    load = np.zeros(int(dp), dtype=np.int64)
    for m in getattr(base, "microbatches", []):
        load[m.replica] += int(m.features.rows)
    units = [sum(ps.pieces[i].rows for i in range(a, b)) for a, b in ps.chains] + \
        [int(np.asarray(step.traj_length, dtype=np.int64)[g].sum()) for g in ps.groups]
    where = [0] * len(units)
    for u in sorted(range(len(units)), key=lambda u: (-units[u], u)):
        r = int(np.argmin(load))
        where[u] = r
        load[r] += units[u]
    ps.chain_replica, ps.group_replica = where[:len(ps.chains)], where[len(ps.chains):]
    base.pieces = ps
    base.expanded_tokens = int(base.expanded_tokens) + ps.expanded_tokens
    return base


def piece_backward_points(reads: Sequence[Sequence[int]]) -> Dict[int, List[int]]:
    """When the backward of each piece read by later pieces runs, given each step position's ``reads``:
    ``{position: [read pieces]}``, the read pieces whose backwards run right after that position's
    forward (after its own backward where no piece reads it), in that order.  A read piece's backward
    needs its readers' backwards (its exports' gradients accumulate there): a reader read by none runs
    its backward with its forward, a read reader at its own point.  So a read piece's point is the
    latest point of its readers (a reader read by none: its own position), and pieces of one point run
    last first.  The schedules of pipeline size 1 and of pipeline stages, and the memory model, run the
    backwards at these points, so a branch's pieces release their graphs when the branch ends rather
    than when its tree does."""
    readers: Dict[int, List[int]] = {}
    for j, rs in enumerate(reads):
        for i in rs:
            if not 0 <= int(i) < j:
                raise ValueError(f"position {j} reads piece {int(i)}, which does not run before it")
            readers.setdefault(int(i), []).append(j)
    point: Dict[int, int] = {}
    for i in sorted(readers, reverse=True):          # a reader comes later: its point is known
        point[i] = max(point.get(j, j) for j in readers[i])
    out: Dict[int, List[int]] = {}
    for i in sorted(point, reverse=True):
        out.setdefault(point[i], []).append(i)
    return out
