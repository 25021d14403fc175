"""Packing baselines the HARTS planner is compared with (same plan objects, same metrics).

- ``plan_ffd``: expanded packing: whole trajectories, first-fit-decreasing into microbatches of
  at most ``M`` rows, no sharing at all (compression 1 by definition).
- ``plan_tree_ffd``: whole trees first-fit-decreasing; a tree over the budget is split
  naively: its trajectories in DFS order are cut into consecutive runs whose union of root
  paths fits ``M`` (shared ancestors recomputed in each run).
- ``plan_ortools_ffd``: our reading of the paper's baseline: the same items as
  ``plan_tree_ffd`` bin-packed by OR-Tools CP-SAT (minimum number of microbatches, FFD as the
  hint and the upper bound, a time limit), then FFD placement onto the DP replicas.
  OR-Tools is a benchmark dependency (setup.py extra "bench"), imported only when called;
  ``ortools_available()`` says whether it is installed.

Every baseline places microbatches like L1: sorted by cost, ``dp`` per slot
(``microbatch.place_sorted``), so a slot holds microbatches of similar cost.
"""
from __future__ import annotations

import time
from typing import List, Optional, Sequence

import numpy as np

from .cost_model import CostModel, ForestIndex
from .microbatch import (MicrobatchPlan, assemble_expanded_plan, assemble_plan, check_budget, check_dp,
                         place_sorted)

__all__ = ["plan_ffd", "plan_tree_ffd", "plan_ortools_ffd", "ortools_available", "ffd", "naive_split"]


def ffd(sizes: Sequence[int], cap: int) -> List[List[int]]:
    """First-fit-decreasing: bins (lists of item indices) of total size <= ``cap``."""
    order = np.argsort(-np.asarray(sizes, dtype=np.int64), kind="stable")
    free = np.zeros(0, dtype=np.int64)
    bins: List[List[int]] = []
    for i in order.tolist():
        x = int(sizes[i])
        if x > cap:
            raise ValueError(f"item {i} of size {x} exceeds the capacity {cap}")
        fits = np.flatnonzero(free >= x)
        if fits.size:
            j = int(fits[0])
            free[j] -= x
            bins[j].append(i)
        else:
            free = np.append(free, cap - x)
            bins.append([i])
    return bins


def naive_split(ix: ForestIndex, tree: int, M: int):
    """Pieces (owned, recomputed, rows) of a tree: its trajectories in DFS order cut into
    consecutive runs whose union of root paths has at most ``M`` rows; a segment is owned by
    the first run that computes it.  Invariant: owned sets partition the tree's segments."""
    f = ix.forest
    r = int(ix.tree_offsets[tree])
    lo, hi = int(f.seg_traj_lo[r]), int(f.seg_traj_hi[r])
    owner_done = set()
    pieces = []
    cur: set = set()
    rows = 0

    def close():
        nonlocal cur, rows
        if cur:
            segs = sorted(cur)
            own = [s for s in segs if s not in owner_done]
            owner_done.update(own)
            pieces.append((own, [s for s in segs if s not in own], rows))
        cur, rows = set(), 0

    for t in range(lo, hi):
        path = []
        s = int(f.traj_leaf[t])
        while s >= 0 and s not in cur:
            path.append(s)
            s = ix.parent[s]
        add = int(ix.length[path].sum()) if path else 0
        if rows + add > M:
            close()
            path = []
            s = int(f.traj_leaf[t])
            while s >= 0:
                path.append(s)
                s = ix.parent[s]
            add = int(ix.length[path].sum())
        cur.update(path)
        rows += add
    close()
    return [p for p in pieces if p[0]]  # a run whose rows are all owned earlier adds nothing


def _tree_items(ix: ForestIndex, M: int):
    items = []
    for t in range(ix.num_trees):
        a, b = int(ix.tree_offsets[t]), int(ix.tree_offsets[t + 1])
        if int(ix.tree_rows[t]) <= M:
            items.append((list(range(a, b)), [], int(ix.tree_rows[t])))
        else:
            items.extend(naive_split(ix, t, M))
    return items


def _finish_tree_plan(ix, items, bins, dp, M, model, planner, t0) -> MicrobatchPlan:
    groups, loads = [], []
    for b in bins:
        own = np.asarray([x for i in b for x in items[i][0]], dtype=np.int64)
        rec = np.asarray([x for i in b for x in items[i][1]], dtype=np.int64)
        groups.append((own, rec))
        comp = np.union1d(own, rec)
        loads.append(model.cost(model.features(ix, comp, own)))
    plan = assemble_plan(ix, groups, place_sorted(loads, dp), planner=planner, dp=dp, row_budget=M,
                         cost_model=model)
    plan.plan_seconds = time.perf_counter() - t0
    return plan


def plan_ffd(forest, dp: int, row_budget: int, *, cost_model: Optional[CostModel] = None,
             index: Optional[ForestIndex] = None) -> MicrobatchPlan:
    """Expanded packing: trajectories first-fit-decreasing, no sharing."""
    t0 = time.perf_counter()
    model = cost_model or CostModel()
    ix = index if index is not None else ForestIndex(forest)
    dp = check_dp(dp)
    M = check_budget(ix, row_budget)
    bins = ffd(ix.traj_length.tolist(), M)
    loads = [model.cost(model.expanded_features(ix, np.asarray(b, dtype=np.int64))) for b in bins]
    plan = assemble_expanded_plan(ix, bins, place_sorted(loads, dp), planner="ffd", dp=dp, row_budget=M,
                                  cost_model=model)
    plan.plan_seconds = time.perf_counter() - t0
    return plan


def plan_tree_ffd(forest, dp: int, row_budget: int, *, cost_model: Optional[CostModel] = None,
                  index: Optional[ForestIndex] = None) -> MicrobatchPlan:
    """Whole trees (naively split when over the budget) first-fit-decreasing by rows."""
    t0 = time.perf_counter()
    model = cost_model or CostModel()
    ix = index if index is not None else ForestIndex(forest)
    dp = check_dp(dp)
    M = check_budget(ix, row_budget)
    items = _tree_items(ix, M)
    bins = ffd([it[2] for it in items], M)
    return _finish_tree_plan(ix, items, bins, dp, M, model, "tree_ffd", t0)


def ortools_available() -> bool:
    try:
        from ortools.sat.python import cp_model  # noqa: F401
    except ImportError:
        return False
    return True


def plan_ortools_ffd(forest, dp: int, row_budget: int, *, cost_model: Optional[CostModel] = None,
                     index: Optional[ForestIndex] = None, time_limit_s: float = 10.0,
                     workers: int = 2) -> MicrobatchPlan:
    """CP-SAT bin packing of the ``plan_tree_ffd`` items (minimum microbatch count, at most
    ``time_limit_s`` seconds of search, FFD as hint and upper bound), then FFD placement.

    Raises ``ImportError`` when OR-Tools is not installed (a benchmark-only dependency).
    """
    from ortools.sat.python import cp_model  # benchmark dependency, imported on use

    t0 = time.perf_counter()
    model = cost_model or CostModel()
    ix = index if index is not None else ForestIndex(forest)
    dp = check_dp(dp)
    M = check_budget(ix, row_budget)
    items = _tree_items(ix, M)
    sizes = [it[2] for it in items]
    hint = ffd(sizes, M)
    n, nb = len(items), len(hint)
    lower = -(-sum(sizes) // M)
    bins = hint
    if n:
        m = cp_model.CpModel()
        x = [[m.NewBoolVar(f"x{i}_{b}") for b in range(nb)] for i in range(n)]
        y = [m.NewBoolVar(f"y{b}") for b in range(nb)]
        for i in range(n):
            m.AddExactlyOne(x[i])
        for b in range(nb):
            m.Add(sum(sizes[i] * x[i][b] for i in range(n)) <= M * y[b])
            if b + 1 < nb:
                m.Add(y[b] >= y[b + 1])
        m.Add(sum(y) >= lower)
        m.Minimize(sum(y))
        where = {i: b for b, items_b in enumerate(hint) for i in items_b}
        for i in range(n):
            for b in range(nb):
                m.AddHint(x[i][b], 1 if where[i] == b else 0)
        for b in range(nb):
            m.AddHint(y[b], 1)
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = float(time_limit_s)
        solver.parameters.num_workers = int(workers)
        status = solver.Solve(m)
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            got: List[List[int]] = [[] for _ in range(nb)]
            for i in range(n):
                for b in range(nb):
                    if solver.BooleanValue(x[i][b]):
                        got[b].append(i)
                        break
            got = [b for b in got if b]
            if len(got) <= len(hint):
                bins = got
    return _finish_tree_plan(ix, items, bins, dp, M, model, "ortools_ffd", t0)
