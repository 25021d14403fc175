"""L2's units with their largest items cut (``window_units(..., item_rows=...)``, the extra unit sets of
``ITEM_CUTS``): the same segments owned once, cut items no longer than the cut (or their longest path),
and plans that stay valid, compute no more tokens than L1 and model no longer a step."""
import numpy as np

from megatron_harts.planner import l2 as l2mod
from megatron_harts.planner.cost_model import ForestIndex
from megatron_harts.planner.l1 import plan_l1
from megatron_harts.planner.l2 import plan_l2, step_cost, window_units
from test_microbatch_planner import _l2_forests


def _owned(units):
    return sorted(s for u in units for s in u.owned)


def test_cut_items_partition_the_same_segments():
    checked = 0
    for f, M, model in _l2_forests()[1:5]:
        ix = ForestIndex(f)
        l1 = plan_l1(f, 2, M, cost_model=model, index=ix)
        whole = window_units(ix, l1, model, model.chunk_size)
        for part in (0.3, 0.6):
            cut = int(part * M)
            units = window_units(ix, l1, model, model.chunk_size, item_rows=cut)
            assert _owned(units) == _owned(whole)  # every segment owned once, as before
            # cut items compute more rows: a tree may stay recomputed (its L1 pieces free), never the reverse
            assert {u.tree for u in units if u.kind == "core"} <= {u.tree for u in whole if u.kind == "core"}
            for u in units:
                if u.kind != "item":
                    continue
                segs = np.array(list(u.owned) + list(u.rec), dtype=np.int64)
                root = int(segs.min())  # the subtree the item comes from (preorder: its root first)
                depth = int((ix.start[segs] + ix.length[segs]).max() - ix.start[root])
                limit = M if ix.sub_rows[root] > M else max(cut, depth)  # larger subtrees: L1's split
                assert u.own_rows <= limit
            checked += len(units) > len(whole)
    assert checked > 0  # some items were cut


def test_plans_with_cut_items_stay_valid(monkeypatch):
    monkeypatch.setattr(l2mod, "ITEM_CUTS", (0.3, 0.6))
    monkeypatch.setattr(l2mod, "ITEM_CUT_SLOTS", 10 ** 6)
    for f, M, model in _l2_forests()[1:5]:
        ix = ForestIndex(f)
        for dp in (2, 4):
            l1 = plan_l1(f, dp, M, cost_model=model, index=ix)
            plan = plan_l2(f, l1, cost_model=model, index=ix)
            plan.validate(f)
            assert plan.tokens_computed <= l1.tokens_computed
            assert step_cost(plan) <= step_cost(l1) + 1e-9
