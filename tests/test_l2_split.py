"""L2 splits a window costlier than a replica's share of the step (``split_windows``): a second
producer on another replica recomputes the top of the tree's shared prefix and owns a lower part,
its consumers read only it.  On one huge tree and a few small ones, DP 4, that balances the
replicas where whole windows cannot."""
import gc

import pytest

from test_l2_executed import check_executes_as_planned, huge_forest, split_producers
from test_microbatch_planner import _packing_key

from megatron_harts.planner import l2 as l2_module
from megatron_harts.planner import threads as planner_threads
from megatron_harts.planner.cost_model import CostModel, ForestIndex
from megatron_harts.planner.l2 import pack_spread, pack_windows, plan_harts, split_windows, window_plan, window_units
from megatron_harts.planner.metrics import plan_metrics


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_split_windows_balance_one_huge_tree(seed, monkeypatch):
    f = huge_forest(seed)
    model = CostModel(chunk_size=64)
    l1, split = plan_harts(f, 4, 6000, cost_model=model)
    monkeypatch.setattr(l2_module, "WINDOW_SPLIT_SHARES", ())
    _, whole = plan_harts(f, 4, 6000, cost_model=model)
    assert split_producers(split) and not split_producers(whole)
    check_executes_as_planned(f, split)
    a, b = plan_metrics(split), plan_metrics(whole)
    assert a["balance_mean"] > b["balance_mean"] and a["balance_p5"] > b["balance_p5"]
    assert a["step_cost"] < b["step_cost"]
    assert split.tokens_computed <= l1.tokens_computed


def test_split_windows_units():
    # the huge tree's window cut into parts: each part's producer recomputes the path above its cut
    # (owned by the tree's first window) and owns the core below it; every item in exactly one window
    f = huge_forest(0)
    ix = ForestIndex(f)
    model = CostModel(chunk_size=64)
    l1, _ = plan_harts(f, 4, 6000, cost_model=model, index=ix)
    units = window_units(ix, l1, model, 64)
    assert split_windows(ix, units, model, 4, 100.0) is None       # no window that costly
    parts = split_windows(ix, units, model, 4, 0.5)
    cores = [u for u in parts if u.kind == "core"]
    assert len(cores) > sum(u.kind == "core" for u in units)
    first = {u.tree: u for u in cores if u.win == u.tree}
    for u in cores:
        if u.win != u.tree:
            assert u.rec and set(u.rec) <= set(first[u.tree].owned)
            assert all(ix.parent[x] in u.rec or ix.parent[x] in u.owned for x in u.owned[1:])
    owned = sorted(x for u in parts for x in u.owned)
    assert owned == sorted(x for u in units for x in u.owned)
    for u in parts:
        if u.kind == "item" and u.upper >= 0:
            assert u.path[0] in next(c.owned for c in cores if c.win == u.win)


@pytest.mark.parametrize("packer", [pack_windows, pack_spread])
def test_packers_run_split_windows_as_planned(packer):
    # both packers place split windows so that every consumer runs after its path's owner and reads
    # all its context from its own producer
    f = huge_forest(0)
    ix = ForestIndex(f)
    model = CostModel(chunk_size=64)
    dp, M = 4, 6000
    l1, _ = plan_harts(f, dp, M, cost_model=model, index=ix)
    parts = split_windows(ix, window_units(ix, l1, model, 64), model, dp, 0.35)
    plans = 0
    for S in (3, 4, 5):
        for packed in packer(ix, parts, dp, M, S, 0.05)[0]:
            plan = window_plan(ix, packed, dp=dp, M=M, model=model)
            if plan is None:
                continue
            plan.validate(f)
            check_executes_as_planned(f, plan)
            plans += bool(split_producers(plan))
    assert plans


def _split_items(packed):
    """Per split window's item (its id): (the cores and split windows' items of its microbatch (ids),
    whether its root path is recomputed there)."""
    out = {}
    for es in packed[3]:
        ids = frozenset(id(u) for u, _, _ in es if u.kind == "core" or (u.kind == "item" and u.upper >= 0))
        for u, ex, _ in es:
            if u.kind == "item" and u.upper >= 0:
                out[id(u)] = (ids, bool(len(ex)))
    return out


def test_rebalance_moves_split_items():
    # rebalance(split=True) also moves split windows' items, never into a microbatch that recomputes
    # their root path (one the packer placed so may leave it); the compiled pass equals its Python
    # reference (a compiled packing against the reference's numbering and search), every plan it gives
    # is valid and runs as planned; without split those items stay with the cores and split windows' items
    # they were packed with
    from megatron_harts.planner import l2_balance
    from megatron_harts.planner.l2_units import unit_arrays
    f = huge_forest(2)
    ix = ForestIndex(f)
    model = CostModel(chunk_size=64)
    overhead = model.coefficients.microbatch + model.coefficients.kda_call
    moved = compared = plans = 0
    for dp, M, share in ((4, 4000, 0.5), (8, 4000, 0.35)):
        l1, _ = plan_harts(f, dp, M, cost_model=model, index=ix)
        parts = split_windows(ix, window_units(ix, l1, model, 64), model, dp, share)
        arrays = unit_arrays(parts)
        for S in (2, 3, 6):
            for packed in pack_spread(ix, parts, dp, M, S, 0.05, arrays)[0]:
                start = _split_items(packed)
                for spend, ordered, weight in ((0, False, 1.0), (20000, False, 4.0), (20000, True, 2.0)):
                    plain = l2_balance.rebalance(ix, packed, dp, M, overhead, spend, ordered=ordered, arrays=arrays,
                                                 weight=weight)
                    if plain is not None:
                        assert _split_items(plain) == start
                    fast = l2_balance.rebalance(ix, packed, dp, M, overhead, spend, ordered=ordered, arrays=arrays,
                                                weight=weight, split=True)
                    if l2_balance._REBALANCE_PACKING is not None:
                        ref = l2_balance.rebalance(ix, packed, dp, M, overhead, spend, ordered=ordered,
                                                   weight=weight, split=True)
                        assert _packing_key(fast) == _packing_key(ref)
                        compared += 1
                    if fast is None:
                        continue
                    after = _split_items(fast)
                    assert after.keys() == start.keys()
                    for k, (mates, path) in after.items():
                        assert not path or start[k] == (mates, True)  # recomputed only where the packer put it
                        moved += mates != start[k][0]
                    plan = window_plan(ix, fast, dp=dp, M=M, model=model)
                    if plan is None:
                        continue
                    plan.validate(f)
                    check_executes_as_planned(f, plan)
                    plans += 1
    assert moved > 0 and plans > 0
    assert compared > 0 or l2_balance._REBALANCE_PACKING is None


@pytest.mark.parametrize("seed,M", [(1, 2500), (1, 3000), (2, 3000)])
def test_plan_l2_spends_on_split_items(seed, M, monkeypatch):
    # DP 8, one huge tree split over replicas: plan_l2's spending passes include the one that moves split
    # windows' items (BALANCE_SPLIT); its plan is valid and runs as planned, and the whole L2 plan is the
    # same with the balance pass compiled and with its Python reference
    from megatron_harts.planner import l2_balance
    f = huge_forest(seed)
    model = CostModel(chunk_size=64)
    ix = ForestIndex(f)
    tried = []
    orig = l2_module.rebalance

    def spy(*args, **kwargs):
        out = orig(*args, **kwargs)
        if kwargs.get("split"):
            tried.append(out is not None)
        return out

    monkeypatch.setattr(l2_module, "rebalance", spy)
    l1, fast = plan_harts(f, 8, M, cost_model=model, index=ix)
    assert any(tried)
    fast.validate(f)
    check_executes_as_planned(f, fast)
    assert fast.tokens_computed <= l1.tokens_computed
    monkeypatch.setattr(l2_balance, "_REBALANCE", None)
    monkeypatch.setattr(l2_balance, "_REBALANCE_PACKING", None)
    _, ref = plan_harts(f, 8, M, cost_model=model, index=ix)
    assert [(m.replica, m.slot, m.owned.tolist(), m.recomputed.tolist()) for m in fast.microbatches] == \
        [(m.replica, m.slot, m.owned.tolist(), m.recomputed.tolist()) for m in ref.microbatches]


def test_passes_side_by_side_plan_as_one_after_another(monkeypatch):
    # plan_l2 runs its independent spending passes on threads (``concurrently``; the compiled searches
    # release the GIL): the plan is the one the passes give one after another
    f = huge_forest(1)
    model = CostModel(chunk_size=64)
    sizes = []
    run = l2_module.concurrently

    gc_on = []

    def recorded(fn, items):
        items = list(items)
        sizes.append(len(items))
        gc_on.append(gc.isenabled())
        return run(fn, items)
    monkeypatch.setattr(l2_module, "concurrently", recorded)
    plans = []
    for threads in (1, 2):
        monkeypatch.setattr(planner_threads, "PLAN_THREADS", threads)
        plans.append(plan_harts(f, 8, 3000, cost_model=model)[1])
    assert max(sizes) > 1 and planner_threads.plan_threads(max(sizes)) == 2
    assert gc.isenabled() and not any(gc_on)      # planning runs with the cyclic collector paused (gc_paused)
    one, two = plans

    def content(p):
        return (p.slots.tolist(), [(m.replica, m.slot, m.owned.tolist(), m.recomputed.tolist(), m.cost,
                                    [(e.producer, e.segments.tolist()) for e in m.external])
                                   for m in p.microbatches])
    assert content(one) == content(two)
    two.validate(f)
