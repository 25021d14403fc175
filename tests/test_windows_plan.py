"""A planned step runs: ``windowed_microbatches`` turns a ``plan_harts`` plan into windowed
microbatches (layouts of the microbatches' computed segment sets, targets on owned segments only,
external context read from a producer's exports), and ``forward_backward_windows`` over them gives
the per-trajectory log-probs and every parameter gradient of the same step with the shared prefixes
recomputed and of expanded training (fp64, 1e-10).

MoE: tokens per expert (the expert-bias counts, summed over the step) equal expanded training's:
each row counts with its occurrence count in the one microbatch that owns its segment
(``WindowedMicrobatch.counted``), never where it is recomputed.  The load-balancing aux loss is off:
it is a per-microbatch nonlinear statistic, so any split of a batch into microbatches changes it
(expanded training split the same way would too); it is not compared here.
"""
import numpy as np
import pytest
import torch

from megatron_harts.layout import build_layout
from megatron_harts.models.model import build_hybrid_model
from megatron_harts.planner.cost_model import CostModel
from megatron_harts.planner.l2 import plan_harts
from megatron_harts.schedules.windows import WindowedMicrobatch, windowed_microbatches

from hybrid_tiny import VOCAB, random_forest, randomize_, tiny_config, tiny_forest
from test_windows_schedule import assert_same, expanded_step, run_step


def routers(model):
    return [m for m in model.modules() if hasattr(m, "local_tokens_per_expert")]


def counted_step(model, step, *args):
    """``step(model, *args)`` with the routers' tokens-per-expert counts reset before, returned after."""
    for r in routers(model):
        r.local_tokens_per_expert.zero_()
    out = step(model, *args)
    return out, [r.local_tokens_per_expert.clone() for r in routers(model)]


def assert_same_counts(a, b, what):
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert float(y.sum()) > 0
        assert torch.equal(x, y), f"{what}: tokens per expert {x.tolist()} != {y.tolist()}"


def recomputed(forest, plan):
    """The plan's microbatches with every external segment recomputed locally (no windows)."""
    out = []
    for m in plan.schedule(0):
        ext = [int(s) for e in m.external for s in e.segments.tolist()]
        segs = sorted(set(m.computed.tolist()) | set(ext))
        out.append(WindowedMicrobatch(build_layout(forest, segments=segs, owned=m.owned)))
    return out


@pytest.mark.parametrize("forest_seed,budget", [("tiny", 20), ("tiny", 17), (3, 30)])
def test_planned_step_equals_recomputed_and_expanded(cpu_world, forest_seed, budget):
    cfg = tiny_config(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 0)
    forest = tiny_forest(0) if forest_seed == "tiny" else random_forest(forest_seed)
    if forest_seed == "tiny" and budget == 20:
        # tree 0 (24 rows) does not fit: L1 recomputes its shared prefix 0 -> 1 in two microbatches,
        # and L2, planned with the model's KDA chunk and no minimum core size, reads it from a producer
        l1, plan = plan_harts(forest, 1, budget, cost_model=CostModel(chunk_size=cfg.kda_chunk_size),
                              min_producer_rows=1)
        assert any(len(m.recomputed) for m in l1.microbatches)
        assert plan.tokens_computed < l1.tokens_computed          # the shared prefix computed once
    else:
        _, plan = plan_harts(forest, 1, budget)
    plan.validate(forest)
    items = windowed_microbatches(forest, plan)
    assert len(items) == len(plan.microbatches)
    n_windows = sum(it.producer is not None for it in items)
    if forest_seed == "tiny" and budget == 20:
        assert n_windows >= 1                      # a real window: context read from a producer
    if budget == 17:
        assert any(len(m.recomputed) for m in plan.microbatches)   # recomputed context, owned subsets
    for it, m in zip(items, plan.schedule(0)):
        if it.producer is not None:
            assert it.layout.num_rows == m.rows and it.layout.num_context_rows == m.external_rows
    win, win_counts = counted_step(model, run_step, items)
    assert win[2]["windows"] == len({it.producer for it in items if it.producer is not None})
    rec = run_step(model, recomputed(forest, plan))
    exp, exp_counts = counted_step(model, expanded_step, forest)
    assert_same(win, rec, "planned windows vs recomputed")
    assert_same(win, exp, "planned windows vs expanded")
    assert_same_counts(win_counts, exp_counts, "planned windows vs expanded")


def test_windowed_microbatches_refusals():
    forest = tiny_forest(0)
    l1, plan = plan_harts(forest, 1, 30)
    with pytest.raises(ValueError, match="replica"):
        windowed_microbatches(forest, plan, replica=1)
    with pytest.raises(ValueError, match="another forest"):
        windowed_microbatches(random_forest(3), plan)
    plan.mode = "expanded"
    with pytest.raises(ValueError, match="tree-mode"):
        windowed_microbatches(forest, plan)


def hand_plan(forest, dp, placement):
    """tiny_forest(0) (tree 0: 0 -> 1 -> {2, 3, 4}; tree 1: 5 -> {6, 7}) planned by hand: nested
    producers (1 reads 0, 2 reads 1), context from two producers (2 reads 0 and 1), a consumer with a
    recomputed segment (owns 3, 4, recomputes 1, reads 0), a plain window (7 reads 5)."""
    from megatron_harts.planner.cost_model import CostModel, ForestIndex
    from megatron_harts.planner.microbatch import assemble_plan
    E = np.zeros(0, dtype=np.int64)
    a = lambda *x: np.array(x, dtype=np.int64)
    groups = [(a(0), E), (a(1), E), (a(2), E), (a(3, 4), a(1)), (a(5, 6), E), (a(7), E)]
    plan = assemble_plan(ForestIndex(forest), groups, placement, planner="hand", dp=dp, row_budget=40,
                         cost_model=CostModel(chunk_size=4))
    plan.validate(forest)
    return plan


@pytest.mark.parametrize("dp", [1, 2])
def test_hand_plan_windows_and_recompute_fallback(cpu_world, dp):
    cfg = tiny_config(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 1)
    forest = tiny_forest(0)
    if dp == 1:
        plan = hand_plan(forest, 1, [(0, 0), (0, 2), (0, 4), (0, 3), (0, 1), (0, 5)])
    else:   # replica 1 runs 1 and 7: 1 reads 0 on replica 0 -> recomputed; 7 reads 5 on replica 1
        plan = hand_plan(forest, 2, [(0, 0), (1, 1), (0, 2), (0, 3), (1, 0), (1, 2)])
    ext = {m.index: bool(m.external) for m in plan.microbatches}
    lp, grads = {}, None
    for r in routers(model):
        r.local_tokens_per_expert.zero_()
    for r in range(dp):
        items = windowed_microbatches(forest, plan, replica=r)
        ms = [m for m in plan.schedule(r) if m is not None]
        owned = {tuple(m.owned.tolist()): it for m, it in zip(ms, items)}
        for it in items:
            if it.producer is not None:          # producers hold no context of their own
                assert items[it.producer].producer is None and items[it.producer].layout.num_context_rows == 0
        if dp == 1:
            assert owned[(1,)].producer is not None and owned[(3, 4)].producer is not None
            assert owned[(7,)].producer is not None
            assert owned[(2,)].producer is None and owned[(2,)].layout.num_context_rows == 0   # fallback
            assert owned[(3, 4)].layout.num_context_rows == int(forest.seg_length[0])
        elif r == 1:
            assert owned[(1,)].producer is None and owned[(7,)].producer is not None
        for m, it in zip(ms, items):
            assert it.producer is not None or not ext[m.index] or it.layout.num_context_rows == 0
        lp_r, g_r, _ = run_step(model, items)
        assert not set(lp_r) & set(lp)
        lp.update(lp_r)
        grads = g_r if grads is None else {n: grads.get(n, 0) + g_r.get(n, 0) for n in set(grads) | set(g_r)}
    counts = [x.local_tokens_per_expert.clone() for x in routers(model)]
    rec = run_step(model, recomputed_all(forest, plan))
    exp, exp_counts = counted_step(model, expanded_step, forest)
    assert_same_counts(counts, exp_counts, "hand plan vs expanded")
    assert_same((lp, grads), rec, "hand plan vs recomputed")
    assert_same((lp, grads), exp, "hand plan vs expanded")


def recomputed_all(forest, plan):
    return [WindowedMicrobatch(build_layout(forest, segments=sorted(set(m.computed.tolist()) | {
        int(s) for e in m.external for s in e.segments.tolist()}), owned=m.owned)) for m in plan.microbatches]
