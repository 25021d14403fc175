"""L1's compiled core (``_C.l1_plan``) and compiled piece costs against their Python references."""
import numpy as np
import pytest

from megatron_harts.planner import l1
from megatron_harts.planner.cost_model import CostCoefficients, CostModel, ForestIndex
from megatron_harts.planner.microbatch import check_budget
from megatron_harts.tree_data import build_forest, make_trajectory
from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe

pytestmark = pytest.mark.skipif(l1._L1_PLAN is None, reason="the C++ extension is not built")


def _forest(rng):
    """Trajectories that mostly extend a prefix of an earlier one of their group (a few trees, deep forks)."""
    seqs, groups = [], []
    for j in range(int(rng.integers(4, 40))):
        if seqs and rng.random() < 0.85:
            k = int(rng.integers(len(seqs)))
            cut = int(rng.integers(1, len(seqs[k]) + 1))
            seqs.append(seqs[k][:cut] + rng.integers(1, 50, size=int(rng.integers(1, 60))).tolist())
            groups.append(groups[k])
        else:
            seqs.append(rng.integers(1, 50, size=int(rng.integers(1, 90))).tolist())
            groups.append(f"g{j}")
    return build_forest([make_trajectory({"id": f"t{i}", "tokens": s, "group": g})
                         for i, (s, g) in enumerate(zip(seqs, groups))])


def _same(ix, model, dp, M):
    got = l1._plan_compiled(ix, model, dp, M)
    ref = l1._plan_python(ix, model, dp, M)
    assert got is not None
    assert [(o.tolist(), r.tolist()) for o, r in got[0]] == [(o.tolist(), r.tolist()) for o, r in ref[0]]
    assert [tuple(p) for p in got[1]] == [tuple(p) for p in ref[1]]


def test_compiled_l1_matches_python_on_random_forests():
    rng = np.random.default_rng(7)
    models = [CostModel(), CostModel(coefficients=CostCoefficients(microbatch=0.5, row=1e-3, attention_pair=3e-6,
                                                                    kda_call=0.2, kda_replay_token=1e-4,
                                                                    logits_row=2e-4), chunk_size=16)]
    for case in range(40):
        ix = ForestIndex(_forest(rng))
        deepest = int(ix.tree_max_path.max())
        total = int(ix.length.sum())
        for dp in (1, 2, 3, 8):
            M = int(rng.integers(deepest, max(deepest, total // 2) + 2))
            _same(ix, models[case % 2], dp, check_budget(ix, M))


def test_compiled_l1_matches_python_on_swe_batches():
    for scheme, samples in (("tree-step", 4), ("step-wise", 8)):
        trajs = synthesize_swe(SweConfig(scheme=scheme, num_tasks=3, samples_per_task=samples, seed=3))
        ix = ForestIndex(build_forest(trajs))
        deepest = int(ix.tree_max_path.max())
        for dp in (1, 2, 4, 8):
            for M in (deepest, deepest + 3000, 2 * deepest):
                _same(ix, CostModel(), dp, check_budget(ix, M))


def test_compiled_piece_costs_match_python():
    rng = np.random.default_rng(3)
    for _ in range(10):
        ix = ForestIndex(_forest(rng))
        M = int(ix.tree_max_path.max())
        pieces = [p for t in range(ix.num_trees) for p in l1.split_tree(ix, t, M)]
        pieces += [q for p in pieces if len(p[0]) + len(p[1]) > 1
                   for q in l1.split_piece(ix, p[0], p[1], max(l1.piece_depth(ix, p), p[2] // 2))]
        assert l1._piece_costs(ix, CostModel(), pieces) == l1._piece_costs_python(ix, CostModel(), pieces)


def test_plan_l1_without_the_compiled_core_is_the_same_plan(monkeypatch):
    rng = np.random.default_rng(11)
    forest = _forest(rng)
    ix = ForestIndex(forest)
    M = int(ix.tree_max_path.max()) + 40
    fast = l1.plan_l1(forest, 4, M, index=ix)
    monkeypatch.setattr(l1, "_L1_PLAN", None)
    slow = l1.plan_l1(forest, 4, M, index=ix)
    assert [(m.replica, m.slot, m.owned.tolist(), m.recomputed.tolist(), m.cost) for m in fast.microbatches] == \
        [(m.replica, m.slot, m.owned.tolist(), m.recomputed.tolist(), m.cost) for m in slow.microbatches]
