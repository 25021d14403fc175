"""A planned step runs (issue 8): ``windowed_microbatches`` turns a ``plan_harts`` plan into windowed
microbatches (layouts of the microbatches' computed segment sets, targets on owned segments only,
external context read from a producer's exports), and ``forward_backward_windows`` over them gives
the per-trajectory log-probs and every parameter gradient of the same step with the shared prefixes
recomputed and of expanded training (fp64, 1e-10).

The MoE aux loss is off here: it is a per-microbatch statistic, and a recomputed row is counted in
every microbatch that computes it (``occurrence`` counts the row's trajectories, not the rows owned
here), so with aux on the step would not match expanded training.
"""
import numpy as np
import pytest

from megatron_harts.layout import build_layout
from megatron_harts.models.model import build_hybrid_model
from megatron_harts.planner.l2 import plan_harts
from megatron_harts.schedules.windows import WindowedMicrobatch, windowed_microbatches

from hybrid_tiny import VOCAB, random_forest, randomize_, tiny_config, tiny_forest
from test_windows_schedule import assert_same, expanded_step, run_step


def recomputed(forest, plan):
    """The plan's microbatches with every external segment recomputed locally (no windows)."""
    out = []
    for m in plan.schedule(0):
        ext = [int(s) for e in m.external for s in e.segments.tolist()]
        segs = sorted(set(m.computed.tolist()) | set(ext))
        out.append(WindowedMicrobatch(build_layout(forest, segments=segs, owned=m.owned)))
    return out


@pytest.mark.parametrize("forest_seed,budget", [("tiny", 30), ("tiny", 17), (3, 30)])
def test_planned_step_equals_recomputed_and_expanded(cpu_world, forest_seed, budget):
    cfg = tiny_config(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 0)
    forest = tiny_forest(0) if forest_seed == "tiny" else random_forest(forest_seed)
    _, plan = plan_harts(forest, 1, budget)
    plan.validate(forest)
    items = windowed_microbatches(forest, plan)
    assert len(items) == len(plan.microbatches)
    n_windows = sum(it.producer is not None for it in items)
    if forest_seed == "tiny" and budget == 30:
        assert n_windows >= 1                      # a real window: context read from a producer
    if budget == 17:
        assert any(len(m.recomputed) for m in plan.microbatches)   # recomputed context, owned subsets
    for it, m in zip(items, plan.schedule(0)):
        if it.producer is not None:
            assert it.layout.num_rows == m.rows and it.layout.num_context_rows == m.external_rows
    win = run_step(model, items)
    assert win[2]["windows"] == len({it.producer for it in items if it.producer is not None})
    rec = run_step(model, recomputed(forest, plan))
    exp = expanded_step(model, forest)
    assert_same(win, rec, "planned windows vs recomputed")
    assert_same(win, exp, "planned windows vs expanded")


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
