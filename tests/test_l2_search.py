"""L2's local search (planner.l2, compiled _C.l2_search): held to the brute-force optimum of its
objective (planner.l2_bruteforce) on small instances, and its plans valid, no worse than L1's, run as
planned by the window schedule."""
import dataclasses
import warnings

import numpy as np
import pytest
from test_l2_executed import check_executes_as_planned

from megatron_harts.planner import l2, l2_bruteforce
from megatron_harts.planner.cost_model import CostModel, ForestIndex
from megatron_harts.planner.l1 import plan_l1
from megatron_harts.planner.metrics import plan_metrics
from megatron_harts.planner.microbatch import packing_key
from megatron_harts.tree_data import build_forest
from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe

needs_core = pytest.mark.skipif(l2._SEARCH is None, reason="megatron_harts._C is not built")


def _csr(lists):
    off = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum([len(x) for x in lists], out=off[1:])
    return off, np.array([x for xs in lists for x in xs], dtype=np.int64)


def random_instance(seed: int, units: int, dp: int, bins: int) -> l2.L2Instance:
    """A core of segments 0..2 (a chain; in every other instance two blocks, 0 and 1..2 below it), items
    below it (their path: the core's top 1..3 segments, some with a segment of their own recomputed, some
    cut in two pieces), free
    pieces sharing a recomputed segment; random lengths, pairs, logits and start bins; a budget some bins
    exceed."""
    rng = np.random.default_rng(seed)
    nseg = 3 + 2 * units + 2
    length = rng.integers(1, 40, nseg).astype(np.int64)
    pairs = (length * rng.integers(1, 60, nseg)).astype(np.int64)
    logits = rng.integers(0, length + 1).astype(np.int64)
    kind, win, up, replay, own, rec, path = [0], [-1], [-1], [0], [[0, 1, 2]], [[], ], [[]]
    if seed % 2:  # the core in two blocks
        own[0] = [0]
        kind.append(0), win.append(-1), up.append(0), replay.append(0), own.append([1, 2]), rec.append([])
        path.append([0])
    free_shared = nseg - 1
    nxt = 3
    for _ in range(units - len(kind)):
        up.append(-1)
        if kind[-1] == 1 and rng.random() < 0.3:  # a piece of the item before (a cut item): its root recomputed
            kind.append(1), win.append(win[-1]), replay.append(replay[-1]), path.append(path[-1])
            own.append([nxt])
            rec.append(sorted(own[-2] + rec[-2]))
        elif rng.random() < 0.7:
            p = list(range(int(rng.integers(1, 4))))
            kind.append(1)
            win.append(1 if seed % 2 and len(p) > 1 else 0)
            replay.append(int(rng.integers(0, 20)))
            own.append([nxt])
            rec.append([nxt + 1] if rng.random() < 0.3 else [])
            path.append(p)
        else:
            kind.append(2)
            win.append(-1)
            replay.append(0)
            own.append([nxt])
            rec.append([free_shared])
            path.append([])
        nxt += 2
    total = int(length.sum())
    cell0 = rng.integers(0, dp * bins, units).astype(np.int64)
    return l2.L2Instance(length, pairs, logits, np.array(kind, dtype=np.int64), np.array(win, dtype=np.int64),
                                np.array(up, dtype=np.int64), np.array(replay, dtype=np.int64), *_csr(own), *_csr(rec), *_csr(path), cell0, dp,
                                bins, int(rng.integers(total // 3, total)), 0.02, 4.5e-5, 1.4e-9, 5.7e-6, 9e-6,
                                int(rng.integers(total // 2, total)))


@needs_core
@pytest.mark.parametrize("seed,units,dp,bins", [(s, 4 + s % 5, 1 + s % 2, 2 + (s // 2) % 2) for s in range(10)])
def test_search_reaches_the_brute_force_optimum(seed, units, dp, bins):
    if (dp * bins) ** units > 70000:
        units -= 1
    inst = random_instance(seed, units, dp, bins)
    best, _ = l2_bruteforce.optimum(inst)
    cells, reads, (overflow, excess, primary, _), _, step, _, _ = l2.search(inst, 20000)
    assert (overflow, excess, primary) <= (best[0], best[1], best[2] + 1e-9 * (1 + abs(best[2])))
    # the compiled objective is the Python one, on the state it returns (slots as run)
    o = l2_bruteforce.objective(inst, cells.tolist())
    assert o[:2] == (overflow, excess) and o[2] == pytest.approx(primary, rel=1e-12, abs=1e-15)
    assert sum(o[3]) == pytest.approx(step, rel=1e-12)
    # an item reads only a producer of its replica, never where its bin holds a core, and the producers
    # of the blocks above its block run in earlier slots
    for u in np.flatnonzero(reads):
        assert inst.kind[u] == 1 and cells[u] // bins == cells[inst.win[u]] // bins
        a = inst.up[inst.win[u]]
        while a >= 0:
            assert cells[a] % bins < cells[u] % bins
            a = inst.up[a]
        assert not any(inst.kind[v] == 0 and cells[v] == cells[u] for v in range(units))


@needs_core
def test_a_chain_stops_once_its_patience_runs_out(monkeypatch):
    """A chain stops after PATIENCE x moves tries in a row found no new best: on a small instance a large budget is
    cut short; with a patience of the whole budget every try is made."""
    inst = random_instance(3, 6, 2, 3)
    moves = 200000
    *_, tries, _ = l2.search(inst, moves)
    assert 0 < tries < moves
    monkeypatch.setattr(l2, "PATIENCE", 1.0)
    *_, every, _ = l2.search(inst, moves)
    assert every == moves


@needs_core
@pytest.mark.parametrize("seed", range(4))
def test_a_chain_hands_the_judge_its_last_bests(seed):
    """With ``candidates`` the chain also returns the bests it found before its best, latest first: states whose
    objective (the Python one) is worse than the best's and than the one after it; the chain itself, and so its
    best, is the same as without."""
    inst = random_instance(seed, 8, 2, 3)
    cells, reads, obj, *_, none = l2.search(inst, 3000)
    cells3, reads3, obj3, *_, others = l2.search(inst, 3000, candidates=3)
    assert none == [] and np.array_equal(cells3, cells) and np.array_equal(reads3, reads) and obj3 == obj
    assert 1 <= len(others) <= 2
    keys = [l2_bruteforce.objective(inst, c.tolist())[:3] for c in [cells] + [c for c, _ in others]]
    assert keys[0] == (obj[0], obj[1], pytest.approx(obj[2], rel=1e-12))
    assert all(a < b for a, b in zip(keys, keys[1:])), keys
    for c, r in others:
        assert c.shape == cells.shape and r.shape == reads.shape and set(np.unique(r)) <= {0, 1}


def test_bruteforce_refuses_large_instances():
    with pytest.raises(ValueError, match="up to 8 units"):
        l2_bruteforce.optimum(random_instance(0, 9, 1, 2))


def _forest(seed: int, scheme: str):
    cfg = SweConfig(scheme=scheme, num_tasks=3, samples_per_task=3, seed=seed, prompt_median=1200, max_tokens=6000)
    return build_forest(synthesize_swe(cfg))


@needs_core
@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("scheme", ["tree-step", "step-wise"])
def test_search_plans_are_valid_no_worse_than_l1_and_run_as_planned(dp, scheme):
    forest = _forest(dp, scheme)
    ix = ForestIndex(forest)
    model = CostModel()
    M = int(ix.tree_max_path.max()) * 2
    l1 = plan_l1(forest, dp, M, cost_model=model, index=ix)
    plan = l2.plan_l2(forest, l1, cost_model=model, index=ix)
    plan.validate(forest)
    assert plan.planner == "harts_l1l2"
    assert plan.tokens_computed <= l1.tokens_computed
    assert plan_metrics(plan)["step_cost"] <= plan_metrics(l1)["step_cost"]
    check_executes_as_planned(forest, plan)  # every planned window runs


@needs_core
def test_search_budget_is_the_effort_knob():
    forest = _forest(7, "tree-step")
    ix = ForestIndex(forest)
    l1 = plan_l1(forest, 2, int(ix.tree_max_path.max()) * 2, index=ix)
    none = l2.plan_l2(forest, l1, index=ix, moves=0)
    assert plan_metrics(none)["step_cost"] <= plan_metrics(l1)["step_cost"]
    a = l2.plan_l2(forest, l1, index=ix, moves=5000)
    b = l2.plan_l2(forest, l1, index=ix, moves=5000)
    assert [m.owned.tolist() for m in a.microbatches] == [m.owned.tolist() for m in b.microbatches]


def test_without_the_compiled_core_l1_plans_and_the_planner_says_so_once(monkeypatch):
    import sys

    from megatron_harts.planner import compiled as compiled_mod

    forest = _forest(3, "tree-step")
    ix = ForestIndex(forest)
    l1 = plan_l1(forest, 2, int(ix.tree_max_path.max()) * 2, index=ix)
    import megatron_harts

    monkeypatch.setitem(sys.modules, "megatron_harts._C", None)  # the extension cannot be imported
    monkeypatch.delattr(megatron_harts, "_C", raising=False)
    monkeypatch.setattr(compiled_mod, "_SAID", [])
    with pytest.warns(compiled_mod.CompiledCoreMissing, match="not built"):
        routine = compiled_mod.compiled("l2_search")
    assert routine is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compiled_mod.compiled("plan_calls") is None  # said once per process
        from megatron_harts.planner.calls import plan_calls
        got = plan_calls([-1, 0], [0, 5], [5, 7], 4)  # the reference, silently after the one warning
        ref = plan_calls([-1, 0], [0, 5], [5, 7], 4, backend="python")
        assert (got.num_calls, got.replay_tokens) == (ref.num_calls, ref.replay_tokens)
        monkeypatch.setattr(l2, "_SEARCH", routine)
        plan = l2.plan_l2(forest, l1, index=ix)
    assert [m.owned.tolist() for m in plan.microbatches] == [m.owned.tolist() for m in l1.microbatches]


@needs_core
def test_an_extension_without_a_routine_is_refused_at_lookup():
    from megatron_harts.planner.compiled import compiled

    with pytest.raises(ImportError, match="rebuild it"):
        compiled("no_such_routine")


@needs_core
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_the_window_packing_start(dp):
    """window_start: every unit in the grid it names; a produced tree's blocks in one producer bin, unless there
    are several replicas and the tree has more rows than one replica's share (then it is cut at its blocks: the
    tree's blocks sit on two or more replicas); an item on
    its block's replica outside a producer bin reads that producer (on one replica every item is there); no bin
    over the row budget (the search's objective on that state, no move made, has no overflow)."""
    forest = _forest(dp + 10, "tree-step")
    ix = ForestIndex(forest)
    model = CostModel()
    M = int(ix.tree_max_path.max()) * 2
    l1 = plan_l1(forest, dp, M, cost_model=model, index=ix)
    inst = l2.l2_units(ix, l1, model, model.chunk_size, l1.tokens_computed)
    assert (inst.kind == 0).any() and (inst.kind == 1).any()
    cells, slots = l2.window_start(inst)
    assert slots >= inst.slots and cells.min() >= 0 and cells.max() < dp * slots
    at = dataclasses.replace(inst, cell0=cells, slots=slots)
    got, reads, (overflow, _, _, _), _, _, _, _ = l2.search(at, 0)
    assert overflow == 0
    bare = l2._rows(inst, "own") + l2._rows(inst, "rec")
    full = bare + l2._rows(inst, "path")
    tree = {}
    for u in range(inst.num_units):
        t = u if inst.kind[u] == 0 else int(inst.win[u]) if inst.kind[u] == 1 else -1
        while t >= 0 and inst.up[t] >= 0:
            t = int(inst.up[t])
        tree[u] = t
    size = {t: 0 for t in set(tree.values()) - {-1}}
    for u, t in tree.items():
        if t >= 0:
            size[t] += int(full[u] if u == t else bare[u] + inst.replay[u] * (inst.kind[u] == 1))
    share = (sum(size.values()) + sum(int(full[u]) for u in range(inst.num_units) if inst.kind[u] == 2)) / dp
    cut = 0
    for t in size:
        bins = {int(cells[u]) for u in range(inst.num_units) if tree[u] == t and inst.kind[u] == 0}
        if len(bins) > 1:                                            # a tree cut at its blocks
            cut += 1
            assert dp > 1 and size[t] > share and len({b // slots for b in bins}) > 1
    assert cut > 0 or dp == 1 or max(size.values()) <= share
    items = np.flatnonzero(inst.kind == 1).tolist()
    producers = set(cells[inst.kind == 0].tolist())
    with_core = [i for i in items if cells[i] // slots == cells[inst.win[i]] // slots and cells[i] not in producers]
    assert with_core and all(np.asarray(reads)[with_core] == 1)      # beside their block's producer: read it
    if dp == 1:
        assert all(cells[i] in producers or i in with_core for i in items)


@needs_core
def test_both_starts_searched_and_the_better_kept():
    """With a produced tree the plan is no worse than the search from L1's placement alone gives (both starts
    are searched with the whole budget and judged exactly)."""
    forest = _forest(5, "tree-step")
    ix = ForestIndex(forest)
    model = CostModel()
    l1 = plan_l1(forest, 2, int(ix.tree_max_path.max()) * 2, cost_model=model, index=ix)
    both = l2.plan_l2(forest, l1, cost_model=model, index=ix)
    inst = l2.l2_units(ix, l1, model, model.chunk_size, l1.tokens_computed)
    cells, reads, *_ = l2.search(inst, l2.default_moves(inst.num_units))
    groups, placement = l2.groups_of(inst, cells, reads)
    alone = packing_key(ix, groups, placement, dp=2, row_budget=l1.row_budget, cost_model=model)
    bound = min(alone[0], plan_metrics(l1)["step_cost"]) if alone[1] <= l1.tokens_computed else \
        plan_metrics(l1)["step_cost"]
    assert plan_metrics(both)["step_cost"] <= bound + 1e-12


@needs_core
def test_starts_side_by_side_plan_as_one_after_another(monkeypatch):
    """The two starts are searched on threads: the plan is the one one thread gives."""
    from megatron_harts.planner import threads
    forest = _forest(5, "tree-step")
    ix = ForestIndex(forest)
    model = CostModel()
    l1 = plan_l1(forest, 2, int(ix.tree_max_path.max()) * 2, cost_model=model, index=ix)
    plans = []
    for n in (1, 2):
        monkeypatch.setattr(threads, "PLAN_THREADS", n)
        plans.append(l2.plan_l2(forest, l1, cost_model=model, index=ix))
    one, two = ([(m.replica, m.slot, m.owned.tolist(), m.recomputed.tolist()) for m in p.microbatches]
                for p in plans)
    assert one == two and plan_metrics(plans[0])["windows"] > 0
