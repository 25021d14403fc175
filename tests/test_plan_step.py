"""plan_step's choice between the L1 and L1+L2 plans (training/step.py): L2's plan runs only when its
windows execute as planned well enough, i.e. the step computes no more rows than L1's plan and no
microbatch exceeds the row budget once the context the window schedule cannot read from a producer is
recomputed (planner.microbatch.replica_windows' rule)."""
import pytest

from test_training_driver import write_rollouts

from megatron_harts.cli import cost_model_from_flags
from megatron_harts.planner.l2 import plan_harts
from megatron_harts.schedules.windows import windowed_microbatches
from megatron_harts.training.data import TreeBatchLoader
from megatron_harts.training.step import FALLBACK_PLANNER, SharingSettings, executed_rows, plan_step


def batches(tmp_path, n=3):
    write_rollouts(tmp_path / "r")
    ld = TreeBatchLoader(str(tmp_path / "r"), global_batch_size=16, seed=7, prefetch=0)
    try:
        return [next(ld).forest for _ in range(n)]
    finally:
        ld.close()


def test_executed_rows_match_the_window_schedule(tmp_path):
    cm = cost_model_from_flags(None, 8)
    for forest in batches(tmp_path):
        for dp in (1, 2):
            _, l2 = plan_harts(forest, dp, 48, cost_model=cm)
            for windows in (True, False):
                rows = [int(mb.layout.num_rows) for r in range(dp)
                        for mb in windowed_microbatches(forest, l2, r, windows=windows)]
                assert executed_rows(forest, l2, windows=windows) == (sum(rows), max(rows))


@pytest.mark.parametrize("dp", [1, 2])
def test_plan_step_keeps_l2_only_when_it_executes_within_budget(tmp_path, dp):
    cm = cost_model_from_flags(None, 8)
    settings = SharingSettings(sharing="windows", microbatch_tokens=48, planner="l1l2", cost_model=cm)
    kinds = []
    for forest in batches(tmp_path):
        l1, l2 = plan_harts(forest, dp, 48, cost_model=cm)
        rows_l1 = executed_rows(forest, l1, windows=True)[0]
        rows_l2, peak_l2 = executed_rows(forest, l2, windows=True)
        plan = plan_step(forest, settings, dp)
        rows, peak = executed_rows(forest, plan, windows=True)
        assert peak <= 48 and rows <= rows_l1
        if peak_l2 <= 48 and rows_l2 <= rows_l1:
            assert plan.planner == "harts_l1l2" and rows == rows_l2
            kinds.append("l2")
        else:
            assert plan.planner == FALLBACK_PLANNER and rows == rows_l1
            kinds.append("l1")
    # these batches: L2 plans only windows the schedule runs, so its plan runs on DP 1 and DP 2 alike
    assert kinds == ["l2", "l2", "l2"]
