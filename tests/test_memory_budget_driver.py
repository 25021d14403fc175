"""``--tree-memory-budget`` through the training driver (CPU, fp64, world of one): a step whose windows
partly keep and partly recompute their producers gives the loss, gradient norms and gradients of the step
keeping every producer and of ``--tree-recompute-producers``; the default budget is expanded mode's; bad
values are one error line naming the flag."""
import pytest
import torch

from megatron_harts.planner.memory import GIB, default_budget_bytes

from test_memory_budget import _mixing_budget


def _driver_run(extra, forest, steps=2):
    from test_recompute_producers import argv

    from megatron_harts.training.trainer import Trainer
    with Trainer.from_args(argv(*extra)) as t:
        params = dict(t.model[0].module.named_parameters())
        captured = {}
        real_step = t.optimizer.step

        def step_capturing():
            if not captured:
                captured.update({n: (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad)
                                 .detach().clone() for n, p in params.items()})
            return real_step()
        t.optimizer.step = step_capturing
        metrics = [t.step(forest) for _ in range(steps)]
        return metrics, captured, t


def test_memory_budget_through_the_driver():
    from test_recompute_producers import argv
    from test_training_driver import rollouts

    from megatron_harts.schedules.windows import step_memory_plan
    from megatron_harts.training.step import replica_microbatches
    from megatron_harts.training.trainer import Trainer
    from megatron_harts.tree_data import build_forest
    forest = build_forest(rollouts(0))
    with Trainer.from_args(argv()) as t:       # the step's items, to find a budget that mixes the choice
        items = replica_microbatches(forest, t._plan(forest), 0, t.settings)
        budget, plan = _mixing_budget(items, t.config)
    keep_all, g_keep, _ = _driver_run(["--tree-memory-budget", "1000"], forest)
    mixed, g_mixed, _ = _driver_run(["--tree-memory-budget", repr(budget / GIB)], forest)
    forced, g_forced, _ = _driver_run(["--tree-recompute-producers"], forest)
    default, _, t = _driver_run([], forest, steps=1)
    windows = keep_all[0]["windows"]
    assert windows > 1
    assert [m["recomputed_windows"] for m in (keep_all[0], mixed[0], forced[0])] == [0, len(plan.recompute), windows]
    assert 0 < mixed[0]["recomputed_windows"] < windows
    for run, grads in ((mixed, g_mixed), (forced, g_forced)):
        for a, b in zip(run, keep_all):
            assert abs(a["loss"] - b["loss"]) <= 1e-10 * abs(b["loss"])
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-10 * b["grad_norm"]
        for n, g in g_keep.items():
            assert g.dtype == torch.float64
            assert float((grads[n] - g).abs().max()) <= 1e-10 * max(float(g.abs().max()), 1e-30), n
    # the default budget: expanded mode's largest microbatch under the row budget, x saved bytes per row
    d = default[0]
    assert d["memory_budget_gib"] * GIB == default_budget_bytes(t.memory_shape, 48)
    assert d["predicted_peak_gib"] > 0 and d["measured_peak_gib"] is None and d["alloc_retries"] is None
    assert mixed[0]["predicted_peak_gib"] < keep_all[0]["predicted_peak_gib"]
    assert forced[0]["predicted_peak_gib"] <= mixed[0]["predicted_peak_gib"]
    assert forced[0]["memory_budget_gib"] is None


@pytest.mark.parametrize("extra,needle", [
    (["--tree-memory-budget", "0"], "positive"),
    (["--tree-memory-budget", "nan"], "finite"),
    (["--tree-memory-budget", "2", "--tree-sharing", "within", "--tree-planner", "l1"], "needs --tree-sharing windows"),
    (["--tree-memory-budget", "2", "--tree-recompute-producers"], "whatever the budget"),
    (["--tree-memory-budget", "2", "--pipeline-model-parallel-size", "2"], "pipeline size 1"),
])
def test_memory_budget_refused(extra, needle):
    from test_recompute_producers import argv

    from megatron_harts.training.arguments import ArgumentsError, parse_args
    parse_args(argv("--tree-memory-budget", "2"), require_data=False)
    with pytest.raises(ArgumentsError) as e:
        parse_args(argv(*extra), require_data=False)
    msg = str(e.value)
    assert "--tree-memory-budget" in msg and needle in msg and "\n" not in msg


