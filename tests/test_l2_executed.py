"""L1+L2 plans only windows the window schedule runs: the plan's own accounting (rows, peak,
compression) is what the step executes (``training.step.executed_rows`` under
``planner.microbatch.replica_windows``' rule), on DP 1 and DP > 1, Tree-Step and Step-wise."""
import numpy as np
import pytest

from test_microbatch_planner import forest_of, random_prefix_forest

from megatron_harts.planner.cost_model import CostModel, ForestIndex
from megatron_harts.planner.l2 import plan_harts
from megatron_harts.planner.metrics import plan_metrics
from megatron_harts.planner.microbatch import replica_windows
from megatron_harts.tree_data import build_forest
from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe
from megatron_harts.training.step import SharingSettings, executed_rows, plan_step


def _random_forest(seed):
    return random_prefix_forest(np.random.default_rng(seed))


def _swe(scheme, seed, tasks=3):
    cfg = SweConfig(scheme=scheme, num_tasks=tasks, samples_per_task=4, prompt_median=300, max_tokens=3000,
                    action_median=40, observation_median=60, seed=seed)
    return build_forest(synthesize_swe(cfg))


def _cases():
    out = []
    for i in range(8):
        f = _random_forest(100 + i)
        M = int(f.traj_length.max() * (1.0 + 0.4 * (i % 3)))
        out.append((f"random{i}", f, M, CostModel(chunk_size=(1, 4, 16)[i % 3])))
    for scheme in ("tree-step", "step-wise"):
        for seed in (3, 4):
            f = _swe(scheme, seed)
            for slack in (0, 2000):
                out.append((f"{scheme}{seed}+{slack}", f, int(f.traj_length.max()) + slack, CostModel(chunk_size=64)))
    for scheme in ("tree-step", "step-wise"):  # 16 tasks: enough trees for windows on DP 8
        f = _swe(scheme, 3, tasks=16)
        out.append((f"{scheme}3x16", f, int(f.traj_length.max()) + 2000, CostModel(chunk_size=64)))
    return out


CASES = _cases()


def check_executes_as_planned(forest, plan):
    """Every consumer reads all its context from one earlier non-consumer producer of its
    replica, so the rows the step executes are the plan's rows."""
    for r in range(plan.num_replicas):
        for e in replica_windows(forest, plan, r):
            m = e.microbatch
            assert (e.producer is None) == (not m.external), f"microbatch {m.index}: its window does not run"
            assert np.array_equal(e.computed, m.computed)
    rows = [m.rows for m in plan.microbatches]
    assert executed_rows(forest, plan, windows=True) == (sum(rows), max(rows))
    assert max(rows) <= plan.row_budget


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_l2_executes_as_planned(dp):
    windows = 0
    for name, f, M, model in CASES:
        ix = ForestIndex(f)
        l1, l2 = plan_harts(f, dp, M, cost_model=model, index=ix)
        l2.validate(f)
        check_executes_as_planned(f, l2)
        # the plan's accounting is the executed one: compression from the executed rows
        m = plan_metrics(l2)
        replay = sum(mb.features.replay_tokens for mb in l2.microbatches)
        assert m["compression"] == pytest.approx(l2.expanded_tokens / (executed_rows(f, l2, windows=True)[0] + replay))
        assert l2.tokens_computed <= l1.tokens_computed, name
        if dp == 1:  # each producer's consumers run right after it: one window's rows exported at a time
            spans = sorted((w.producer_slot, w.last_slot) for w in l2.windows)
            assert all(a[1] < b[0] for a, b in zip(spans, spans[1:])), name
            assert m["peak_export_rows"] <= l2.row_budget
        windows += len(l2.windows)
    assert windows  # windows were planned (and run)


@pytest.mark.parametrize("dp", [1, 2])
def test_plan_step_runs_l2(dp):
    # on the Tree-Step / Step-wise batches with shared prefixes, plan_step keeps L2's plan
    for scheme in ("tree-step", "step-wise"):
        f = _swe(scheme, 3)
        M = int(f.traj_length.max()) + 500
        settings = SharingSettings(sharing="windows", microbatch_tokens=M, planner="l1l2",
                                   cost_model=CostModel(chunk_size=64))
        plan = plan_step(f, settings, dp)
        assert plan.planner == "harts_l1l2" and plan.windows, (scheme, dp)
        check_executes_as_planned(f, plan)


def huge_forest(seed=0):
    """One tree far larger than the others (a 1000-token prompt, four 500-token steps below it, six
    600-1000-token tails below each step) and three small trees (a 700-token prompt, two tails)."""
    rng = np.random.default_rng(seed)

    def tok(n):
        return rng.integers(1, 30000, size=n).tolist()

    seqs, groups = [], []
    prompt = tok(1000)
    for _ in range(4):
        step = tok(500)
        for _ in range(6):
            seqs.append(prompt + step + tok(int(rng.integers(600, 1000))))
            groups.append("huge")
    for t in range(3):
        small = tok(700)
        for _ in range(2):
            seqs.append(small + tok(int(rng.integers(300, 600))))
            groups.append(f"small{t}")
    return forest_of(seqs, groups=groups)


def split_producers(plan):
    """Producers that recompute the top of their root path: windows split off a tree's window."""
    return [m.index for m in plan.microbatches if m.consumers and len(m.recomputed)]


@pytest.mark.parametrize("M", [3000, 4000])
def test_l2_split_windows_execute_as_planned(M):
    # DP 8, one huge tree: its window is split over replicas, every part runs as planned
    f = huge_forest(0)
    l1, l2 = plan_harts(f, 8, M, cost_model=CostModel(chunk_size=64))
    l2.validate(f)
    assert split_producers(l2)
    check_executes_as_planned(f, l2)   # executed rows == planned rows, peak rows <= the budget
    m = plan_metrics(l2)
    replay = sum(mb.features.replay_tokens for mb in l2.microbatches)
    assert m["compression"] == pytest.approx(l2.expanded_tokens / (executed_rows(f, l2, windows=True)[0] + replay))
    assert m["peak_rows"] <= M
    assert l2.tokens_computed <= l1.tokens_computed
