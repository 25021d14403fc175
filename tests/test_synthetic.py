"""The synthetic SWE-like generator: seeded, shaped as documented."""
import numpy as np
import pytest

from megatron_harts.tree_data import build_forest
from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe

SMALL = dict(num_tasks=3, samples_per_task=3, prompt_median=300, max_tokens=6000)


@pytest.mark.parametrize("scheme", ["tree-step", "step-wise"])
def test_seeded(scheme):
    a = synthesize_swe(SweConfig(scheme=scheme, seed=3, **SMALL))
    b = synthesize_swe(SweConfig(scheme=scheme, seed=3, **SMALL))
    c = synthesize_swe(SweConfig(scheme=scheme, seed=4, **SMALL))
    assert [t.tokens.tolist() for t in a] == [t.tokens.tolist() for t in b]
    assert [t.tokens.tolist() for t in a] != [t.tokens.tolist() for t in c]


def test_tree_step_shape():
    trajs = synthesize_swe(SweConfig(scheme="tree-step", branch_prob=0.5, **SMALL))
    f = build_forest(trajs)
    st = f.stats()
    assert st["num_trees"] == SMALL["num_tasks"]  # one tree per task: the prompt is shared
    assert st["compression"] > 1.5
    assert st["max_trajectory_tokens"] <= SMALL["max_tokens"]
    assert max(f.children(s).size for s in range(f.num_segments)) >= 2
    for t in trajs:
        assert t.loss_mask[0] == 0 and t.loss_mask.sum() > 0
        assert np.all(t.old_logprobs[t.loss_mask == 1] < 0)
    groups = {}
    for t in trajs:
        groups.setdefault(t.group, []).append(t.advantage)
    for advs in groups.values():
        assert abs(np.mean(advs)) < 1e-6 or len(set(advs)) == 1


def test_step_wise_each_step_ends_inside_the_next():
    trajs = synthesize_swe(SweConfig(scheme="step-wise", **SMALL))
    by_sample = {}
    for t in trajs:
        by_sample.setdefault(t.id.rsplit("/", 1)[0], []).append(t)
    for steps in by_sample.values():
        for a, b in zip(steps, steps[1:]):
            assert len(a) < len(b) and np.array_equal(b.tokens[: len(a)], a.tokens)
            # only the step's own action is a target
            assert b.loss_mask[: len(a)].sum() == 0
    assert build_forest(trajs).stats()["compression"] > 3


def test_invalid_config():
    with pytest.raises(ValueError, match="scheme"):
        synthesize_swe(SweConfig(scheme="bogus"))
    with pytest.raises(ValueError, match="max_turns"):
        synthesize_swe(SweConfig(min_turns=5, max_turns=2))
