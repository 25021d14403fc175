"""L2's last pass (``l2_even.even_slots``): the compiled search equals its Python reference change for
change; its plans are valid, run every window as planned, pass no row budget, recompute at most what
they are allowed, keep replicas and slots, and lower the objective; within ``plan_l2`` it never computes
more tokens than L1 nor lengthens L1's modelled step."""
import numpy as np
import pytest

from test_l2_executed import CASES, check_executes_as_planned

import megatron_harts.planner.l2 as l2
import megatron_harts.planner.l2_even as even_mod
from megatron_harts.planner.cost_model import ForestIndex
from megatron_harts.planner.l1 import plan_l1
from megatron_harts.planner.l2 import plan_l2, step_cost
from megatron_harts.planner.l2_even import EVEN_WEIGHT, even_objective, even_slots


def _plans(name, forest, M, model, dp, monkeypatch):
    """(index, L1 plan, the L2 plan before the pass)."""
    ix = ForestIndex(forest)
    l1 = plan_l1(forest, dp, M, cost_model=model, index=ix)
    monkeypatch.setattr(l2, "even_slots", lambda *a, **k: None)
    before = plan_l2(forest, l1, cost_model=model, index=ix)
    monkeypatch.undo()
    return ix, l1, before


def _search_args(ix, plan, model, spend):
    mbs = plan.microbatches
    pinned = [[] for _ in mbs]
    for w in plan.windows:
        pinned[w.producer] = w.segments.tolist()
    c = model.coefficients
    reads = []
    for m in mbs:
        ps = {e.producer for e in m.external if mbs[e.producer].replica == m.replica}
        reads.append(ps.pop() if len(ps) == 1 else -1)
    return (ix, [m.replica for m in mbs], [m.slot for m in mbs], [m.owned.tolist() for m in mbs],
            [m.recomputed.tolist() for m in mbs], [m.cost for m in mbs], [bool(m.consumers) for m in mbs], pinned,
            reads, plan.num_replicas, plan.num_slots, plan.row_budget, (c.row, c.attention_pair, c.logits_row), spend)


def _python(ix, rep, slot, owns, recs, cost, is_prod, pinned, reads, dp, S, M, coef, spend):
    return even_mod._even_python(ix.parent, ix.length_list, ix.seg_pairs.tolist(), ix.seg_logits.tolist(),
                                 ix.sub_size_list, rep, slot, owns, recs, cost, is_prod, pinned, reads, dp, S, M, coef,
                                 even_mod.EVEN_MOVES, even_mod.EVEN_SLOTS, EVEN_WEIGHT, spend)


def _compiled(ix, rep, slot, owns, recs, cost, is_prod, pinned, reads, dp, S, M, coef, spend):
    from megatron_harts.planner.microbatch import _csr
    oo, o = _csr(owns)
    ro, r = _csr(recs)
    po, p = _csr(pinned)
    out = even_mod._EVEN(ix.parent_arr, ix.length, ix.seg_pairs, ix.seg_logits, ix.sub_size,
                         np.asarray(rep, dtype=np.int64), np.asarray(slot, dtype=np.int64), oo, o, ro, r,
                         np.asarray(cost, dtype=np.float64), np.asarray(is_prod, dtype=np.int64), po, p,
                         np.asarray(reads, dtype=np.int64), dp, S, M,
                         coef[0], coef[1], coef[2], even_mod.EVEN_MOVES, even_mod.EVEN_SLOTS, EVEN_WEIGHT, spend)
    return bool(out[0]), even_mod._split(out[1], out[2]), even_mod._split(out[3], out[4])


@pytest.mark.parametrize("dp", [2, 8])
@pytest.mark.parametrize("name,forest,M,model", CASES, ids=[c[0] for c in CASES])
def test_compiled_equals_reference(name, forest, M, model, dp, monkeypatch):
    if even_mod._EVEN is None:
        pytest.skip("megatron_harts._C not built")
    ix, l1, plan = _plans(name, forest, M, model, dp, monkeypatch)
    for spend in (0, max(0, l1.tokens_computed - plan.tokens_computed)):
        args = _search_args(ix, plan, model, spend)
        py = _python(*args)
        assert _compiled(*args) == (py[0], [list(o) for o in py[1]], [list(r) for r in py[2]])


@pytest.mark.parametrize("dp", [2, 4, 8])
@pytest.mark.parametrize("name,forest,M,model", CASES, ids=[c[0] for c in CASES])
def test_even_plans_are_valid(name, forest, M, model, dp, monkeypatch):
    ix, l1, plan = _plans(name, forest, M, model, dp, monkeypatch)
    for spend in (0, max(0, l1.tokens_computed - plan.tokens_computed)):
        out = even_slots(ix, plan, model, spend)
        if out is None:
            continue
        out.validate(forest)
        check_executes_as_planned(forest, out)
        assert max(m.rows for m in out.microbatches) <= M
        assert out.num_slots == plan.num_slots and len(out.microbatches) == len(plan.microbatches)
        assert sorted((m.replica, m.slot) for m in out.microbatches) == \
            sorted((m.replica, m.slot) for m in plan.microbatches)
        # rows added: at most the spend (KDA replay is not the pass's to bound: rows only)
        assert sum(m.rows for m in out.microbatches) <= sum(m.rows for m in plan.microbatches) + spend
        if out.tokens_computed > plan.tokens_computed:  # tokens are spent only to shorten the step
            assert step_cost(out) < step_cost(plan)
        tau = sum(m.cost for m in plan.microbatches) / (dp * plan.num_slots)
        assert even_objective(out.cost_matrix(), EVEN_WEIGHT, tau) < \
            even_objective(plan.cost_matrix(), EVEN_WEIGHT, tau)


@pytest.mark.parametrize("name,forest,M,model", CASES, ids=[c[0] for c in CASES])
def test_plan_l2_keeps_its_promises(name, forest, M, model):
    ix = ForestIndex(forest)
    l1 = plan_l1(forest, 8, M, cost_model=model, index=ix)
    plan = plan_l2(forest, l1, cost_model=model, index=ix)
    plan.validate(forest)
    check_executes_as_planned(forest, plan)
    assert plan.tokens_computed <= l1.tokens_computed
    assert step_cost(plan) <= step_cost(l1)


def test_even_moves_a_piece_on_a_lopsided_slot():
    """Two replicas, one slot: one microbatch holds two chains of a tree, the other one chain of
    another tree; the pass moves a whole chain (no new rows: the receiver recomputes its root)."""
    from megatron_harts.planner.cost_model import CostModel
    from megatron_harts.planner.microbatch import assemble_plan
    from megatron_harts.tree_data import build_forest
    from megatron_harts.tree_data.trajectory import Trajectory
    rng = np.random.default_rng(0)

    def traj(tid, toks):
        return Trajectory(id=tid, tokens=np.asarray(toks, dtype=np.int64),
                          loss_mask=np.ones(len(toks), dtype=np.int8), advantage=1.0)

    root = rng.integers(1, 50, 20).tolist()
    trajs = [traj("a", root + [51] * 300), traj("b", root + [52] * 300), traj("c", root + [53] * 300),
             traj("d", [60] + [61] * 10)]
    forest = build_forest(trajs)
    ix = ForestIndex(forest)
    model = CostModel()
    t0 = [s for s in range(forest.num_segments) if forest.seg_tree[s] == forest.seg_tree[0]]
    t1 = [s for s in range(forest.num_segments) if s not in t0]
    chains = [s for s in t0 if forest.seg_parent[s] == t0[0]]
    heavy = (np.array(sorted(t0)), np.zeros(0, dtype=np.int64))
    light = (np.array(sorted(t1)), np.zeros(0, dtype=np.int64))
    plan = assemble_plan(ix, [heavy, light], [(0, 0), (1, 0)], planner="t", dp=2, row_budget=2000, cost_model=model)
    out = even_slots(ix, plan, model, spend=1000)
    assert out is not None and len(chains) == 3
    out.validate(forest)
    assert max(m.cost for m in out.microbatches) < max(m.cost for m in plan.microbatches)
    assert even_slots(ix, plan, model, spend=0) is None  # moving a chain recomputes the root: 20 rows
