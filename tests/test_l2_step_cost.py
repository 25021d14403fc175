"""``l2.step_cost`` (per-slot maxima in plain Python) against its definition on ``cost_matrix``."""
import numpy as np

from megatron_harts.planner.cost_model import ForestIndex
from megatron_harts.planner.l2 import plan_harts, step_cost
from megatron_harts.tree_data import build_forest
from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe


def _reference(plan) -> float:
    c = plan.cost_matrix()
    return float(c.max(axis=0).sum()) if c.size else 0.0


def test_step_cost_is_the_cost_matrix_definition():
    checked = 0
    for scheme, samples in (("tree-step", 4), ("step-wise", 8)):
        trajs = synthesize_swe(SweConfig(scheme=scheme, num_tasks=2, samples_per_task=samples, seed=5))
        forest = build_forest(trajs)
        ix = ForestIndex(forest)
        deepest = int(ix.tree_max_path.max())
        for dp in (1, 2, 3, 8):
            for M in (deepest, deepest + 5000):
                for plan in plan_harts(forest, dp, M, index=ix):
                    assert step_cost(plan) == _reference(plan)
                    checked += 1
    assert checked == 32


def test_step_cost_of_a_plan_with_idle_slots_by_hand():  # an idle replica's 0.0 is in its slot's maximum
    class _M:
        def __init__(self, replica, slot, cost):
            self.replica, self.slot, self.cost = replica, slot, cost

    class _P:
        slots = np.array([[0, 2], [1, -1]])
        microbatches = [_M(0, 0, 0.5), _M(1, 0, 0.75), _M(0, 1, -0.25)]  # a negative cost: the idle 0.0 is the maximum

        def cost_matrix(self):
            c = np.zeros((2, 2))
            for m in self.microbatches:
                c[m.replica, m.slot] = m.cost
            return c

    assert step_cost(_P()) == 0.75 == _reference(_P())


def test_packing_key_is_the_assembled_plans_step_and_tokens():
    # microbatch.packing_key (how L2 judges its candidates) equals (step_cost, tokens_computed) of
    # the plan assemble_plan builds from the same packing, floats exact, and is None exactly where
    # assemble_plan refuses a microbatch over the budget
    import dataclasses

    from megatron_harts.planner import microbatch as mb
    from megatron_harts.planner.cost_model import CostModel
    from megatron_harts.planner.l1 import plan_l1
    from megatron_harts.planner.l2 import groups_of, l2_units, search, window_start
    from megatron_harts.planner.microbatch import PlanningError, assemble_plan, packing_key

    model = CostModel()
    checked = refused = 0
    for scheme, samples in (("tree-step", 4), ("step-wise", 8)):
        forest = build_forest(synthesize_swe(SweConfig(scheme=scheme, num_tasks=2,
                                                       samples_per_task=samples,
                                                       seed=3)))
        ix = ForestIndex(forest)
        M = int(ix.tree_max_path.max()) + 3000
        for dp in (1, 2, 4):
            l1 = plan_l1(forest, dp, M, cost_model=model, index=ix)
            inst = l2_units(ix, l1, model, model.chunk_size, l1.tokens_computed)
            cells, slots = window_start(inst)
            starts = [inst, dataclasses.replace(inst, cell0=cells, slots=slots)]
            for at, moves in ((at, moves) for at in starts for moves in (0, 3000)):  # the starts, searched
                cells, reads, *_ = search(at, moves)
                for packed in (groups_of(at, cells, reads),):
                    for budget in (M, M // 2):  # half the budget: some microbatches over it
                        key = packing_key(ix, packed[0], packed[1], dp=dp, row_budget=budget,
                                          cost_model=model)
                        try:
                            plan = assemble_plan(ix, packed[0], packed[1], planner="t", dp=dp,
                                                 row_budget=budget, cost_model=model)
                        except PlanningError:
                            assert key is None
                            refused += 1
                            continue
                        assert key == (step_cost(plan), plan.tokens_computed)
                        keep = {}  # what judging leaves for the assembly: the same plan from it
                        assert packing_key(ix, packed[0], packed[1], dp=dp, row_budget=budget,
                                           cost_model=model, keep=keep) == key
                        again = assemble_plan(ix, None, None, planner="t", dp=dp, row_budget=budget,
                                              cost_model=model, keep=keep)
                        assert [(m.replica, m.slot, m.owned.tolist(), m.recomputed.tolist(),
                                 m.features, m.cost, [(e.producer, e.segments.tolist())
                                                      for e in m.external])
                                for m in again.microbatches] == \
                            [(m.replica, m.slot, m.owned.tolist(), m.recomputed.tolist(),
                              m.features,
                              m.cost, [(e.producer, e.segments.tolist()) for e in m.external])
                             for m in plan.microbatches]
                        checked += 1
    assert checked >= 10 and refused >= 1
    # the reference path (no compiled core) gives the same keys
    saved = mb._ASSEMBLE
    try:
        mb._ASSEMBLE = None
        key = packing_key(ix, packed[0], packed[1], dp=dp, row_budget=M, cost_model=model)
    finally:
        mb._ASSEMBLE = saved
    assert key == packing_key(ix, packed[0], packed[1], dp=dp, row_budget=M, cost_model=model)
