"""L2 splits a window costlier than a replica's share of the step (``split_windows``): a second
producer on another replica recomputes the top of the tree's shared prefix and owns a lower part,
its consumers read only it.  On one huge tree and a few small ones, DP 4, that balances the
replicas where whole windows cannot."""
import pytest

from test_l2_executed import check_executes_as_planned, huge_forest, split_producers

from megatron_harts.planner import l2 as l2_module
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
