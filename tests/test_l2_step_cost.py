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
