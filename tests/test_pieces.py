"""Paths longer than the row budget: pieces reading the earlier pieces' exports give the log-probs and
every parameter gradient of the uncut step (and of expanded training), fp64 to 1e-10."""
import numpy as np
import pytest
import torch

from megatron_harts.layout import build_layout
from megatron_harts.models.model import build_hybrid_model
from megatron_harts.planner.microbatch import MicrobatchPlan, PlanningError
from megatron_harts.planner.pieces import long_trees, plan_with_pieces, tree_pieces
from megatron_harts.schedules.windows import WindowedMicrobatch, piece_microbatches
from megatron_harts.tree_data import build_forest, make_trajectory

from hybrid_tiny import VOCAB, randomize_, tiny_config
from test_compaction_windows import expanded_with_events
from test_windows_schedule import assert_same, run_step


def long_forest(seed=0, compactions=False):
    """A 41-token chain, a tree whose shared 30-token prefix forks into four branches (one short), and a
    short tree."""
    rng = np.random.default_rng(seed)
    tok = lambda n: rng.integers(1, VOCAB, n).tolist()  # noqa: E731
    base = [1] + tok(29)
    recs = [{"id": "chain", "tokens": [0] + tok(40)},
            {"id": "a", "tokens": base + tok(7)}, {"id": "b", "tokens": base[:21] + tok(9)},
            {"id": "c", "tokens": base[:6] + tok(13)}, {"id": "d", "tokens": base[:30] + tok(2)},
            {"id": "e", "tokens": base[:6] + tok(3)},        # fits the budget: a group in expanded mode
            {"id": "short", "tokens": [2] + tok(6)}, {"id": "short2", "tokens": [2] + tok(8)}]
    if compactions:      # evictions whose spans and event rows sit in other pieces than their readers
        recs[0]["compactions"] = [{"at": 25, "start": 3, "end": 14}, {"at": 33, "start": 20, "end": 27}]
        recs[1]["compactions"] = [{"at": 24, "start": 2, "end": 11}]
        recs[4]["compactions"] = [{"at": 24, "start": 2, "end": 11}]
    return build_forest([make_trajectory(r) for r in recs])


def empty_plan(forest, mode):
    def make():
        from megatron_harts.planner.cost_model import CostModel
        return MicrobatchPlan(planner="pieces", mode=mode, num_replicas=1, num_slots=0, row_budget=12, chunk_size=4,
                              microbatches=[], slots=np.zeros((1, 0), dtype=np.int64), windows=[], expanded_tokens=0,
                              plan_seconds=0.0, cost_model=CostModel(chunk_size=4))
    return make


def whole_step(forest):
    return [WindowedMicrobatch(build_layout(forest))]


def pieces_step(forest, budget, mode="tree"):
    """Every tree cut into pieces (no fitting tree planned: the short tree is long-free and planned whole)."""
    plan = plan_with_pieces(forest, budget, 4, 1, lambda f: None, mode=mode, empty_plan=empty_plan(forest, mode)) \
        if long_trees(forest, budget).size == forest.num_trees else None
    return plan


@pytest.mark.parametrize("compactions", [False, True])
def test_long_paths_cut_into_pieces_equal_uncut(cpu_world, compactions):
    cfg = tiny_config(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 0)
    budget = 12
    full = long_forest(0, compactions)
    forest = full.select(long_trees(full, budget))        # the chain and the forked tree
    assert forest.num_trees == 2
    plan = plan_with_pieces(forest, budget, 4, 1, None, empty_plan=empty_plan(forest, "tree"))
    ps = plan.pieces
    step = ps.forest
    assert all(p.rows <= budget for p in ps.pieces)
    assert ps.chains[0][1] - ps.chains[0][0] >= 3
    items = piece_microbatches(plan, 0)
    assert sum(bool(mb.reads) for mb in items) >= 5
    cut = run_step(model, items)
    uncut = run_step(model, whole_step(step))
    assert_same(cut, uncut, "pieces vs uncut")
    assert_same(cut, expanded_with_events(model, step), "pieces vs expanded")


def test_plan_step_cuts_long_trees_and_keeps_the_rest(cpu_world):
    """``plan_step`` in every sharing mode: fitting trees planned as before, long trees cut into pieces of at
    most the budget; the replica's microbatches give the uncut step's log-probs and gradients."""
    from megatron_harts.training.step import SharingSettings, plan_step, replica_microbatches, step_forest
    cfg = tiny_config(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 1)
    forest = long_forest(1, compactions=True)
    budget = 12
    assert 0 < long_trees(forest, budget).size < forest.num_trees
    ref = None
    for sharing, planner in (("off", "ffd"), ("within", "l1"), ("windows", "l1l2")):
        settings = SharingSettings(sharing=sharing, microbatch_tokens=budget, planner=planner, replay=True)
        plan = plan_step(forest, settings, 1)
        assert plan.pieces is not None and plan.pieces.mode == ("expanded" if sharing == "off" else "tree")
        if sharing == "off":        # the long tree's trajectories that fit are packed, not cut
            ps = plan.pieces
            assert len(ps.groups) == 1 and ps.forest.traj_ids[int(ps.groups[0][0])] == "e"
            assert len(ps.chains) == 5 and ps.num_microbatches == len(ps.pieces) + 1   # chain, a, b, c, d
        items = replica_microbatches(forest, plan, 0, settings)
        assert all(mb.layout.num_rows <= budget for mb in items)
        assert any(mb.reads for mb in items)
        got = run_step(model, items)
        if ref is None:
            ref = expanded_with_events(model, step_forest(forest, plan))   # trajectory ids: the step forest's
        assert_same(got, ref, f"{sharing}: pieces vs expanded")


def test_every_tree_long_and_refusals():
    forest = long_forest(0)
    with pytest.raises(PlanningError, match="no empty plan"):
        plan_with_pieces(forest.select(long_trees(forest, 12)), 12, 4, 1, lambda f: None)
    f = forest.select(long_trees(forest, 12))
    with pytest.raises(PlanningError, match="--tree-microbatch-tokens"):
        tree_pieces(f, 0, 12)            # not cut at depths first: a segment is longer than the budget


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_pieces_and_windows_with_activation_recomputation(cpu_world, granularity):
    """``--recompute-granularity``: a windows-mode step with pieces (a read piece's forward again at its
    chain's end recomputes as configured, its exports' gradients entering through the recording layers'
    outputs) gives the same log-probs and gradients as without recomputation."""
    from megatron_harts.training.step import SharingSettings, plan_step, replica_microbatches
    kw = dict(recompute_granularity=granularity)
    if granularity == "full":
        kw.update(recompute_method="uniform", recompute_num_layers=1)
    forest = long_forest(2, compactions=True)
    settings = SharingSettings(sharing="windows", microbatch_tokens=12, planner="l1l2", replay=True)
    plan = plan_step(forest, settings, 1)
    items = replica_microbatches(forest, plan, 0, settings)
    assert any(mb.reads for mb in items)
    base = tiny_config(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    plain = run_step(randomize_(build_hybrid_model(base, vocab_size=VOCAB), 3), items)
    cfg = tiny_config(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none", **kw)
    model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 3)
    assert_same(run_step(model, items), plain, f"recompute {granularity} vs none")
    assert model.config.recompute_granularity == granularity
