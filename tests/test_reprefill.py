"""The re-prefill form of compacted trajectories: every target new in exactly one sample, seen
from the tokens visible at its position; re-emitted context untrained; counts add up."""
import numpy as np
import pytest

from megatron_harts.tree_data import TreeFormatError, build_forest, make_trajectory
from megatron_harts.tree_data.reprefill import reprefill, reprefill_tokens
from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe


def visible_at(t, j):
    """Positions [0, j) that token j still attends to: minus every span of an event with at <= j."""
    seen = np.ones(j, dtype=bool)
    for at, a, b in ([] if t.compactions is None else t.compactions.tolist()):
        if at <= j:
            seen[a:b] = False
    return np.flatnonzero(seen)


def check_reprefill(trajs):
    samples = reprefill(trajs)
    by_id = {}
    for s in samples:
        assert s.compactions is None
        by_id.setdefault(str(s.id).rsplit("/r", 1)[0] if "/r" in str(s.id) else s.id, []).append(s)
    assert sum(len(s) for s in samples) == sum(len(t) for t in trajs) + reprefill_tokens(trajs)
    for t in trajs:
        mine = by_id[str(t.id) if t.compactions is not None else t.id]
        if t.compactions is None:
            assert len(mine) == 1 and mine[0] is t
            continue
        times = sorted(set(t.compactions[:, 0].tolist()))
        assert [s.id for s in mine] == [f"{t.id}/r{k}" for k in range(len(times) + 1)]
        bounds = [0] + times + [len(t)]
        found = 0
        for k, s in enumerate(mine):
            new = bounds[k + 1] - bounds[k]
            ctx = len(s) - new
            assert ctx == (0 if k == 0 else visible_at(t, times[k - 1]).size)
            assert s.loss_mask[:ctx].sum() == 0  # re-emitted tokens are context only
            assert np.array_equal(s.loss_mask[ctx:], t.loss_mask[bounds[k]: bounds[k + 1]])
            for i in np.flatnonzero(s.loss_mask):
                j = bounds[k] + int(i) - ctx  # the original position of this target
                assert s.tokens[i] == t.tokens[j]
                assert np.array_equal(s.tokens[:i], t.tokens[visible_at(t, j)]), (t.id, j)
                if t.old_logprobs is not None:
                    assert s.old_logprobs[i] == t.old_logprobs[j]
                if isinstance(t.advantage, np.ndarray):
                    assert s.advantage[i] == t.advantage[j]
                found += 1
            assert (s.reward, s.weight, s.group) == (t.reward, t.weight, t.group)
            if not isinstance(t.advantage, np.ndarray):
                assert s.advantage == t.advantage
        assert found == int(t.loss_mask.sum())  # each target in exactly one sample
    return samples


def rec(tid, tokens, events, **kw):
    return make_trajectory({"id": tid, "tokens": tokens, "compactions": [
        {"at": p, "start": a, "end": b} for p, a, b in events], **kw})


def test_hand_made():
    t = rec("a", [10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
            [(6, 2, 4), (4, 1, 3), (6, 5, 6), (8, 0, 1)],
            loss_mask=[0, 1, 1, 0, 1, 1, 1, 0, 1, 1], advantage=[float(i) for i in range(10)], reward=1.0)
    r0, r1, r2, r3 = check_reprefill([t])
    assert r0.tokens.tolist() == [10, 11, 12, 13]
    assert r1.tokens.tolist() == [10, 13, 14, 15] and r1.loss_mask.tolist() == [0, 0, 1, 1]
    assert r2.tokens.tolist() == [10, 14, 16, 17] and r2.loss_mask.tolist() == [0, 0, 1, 0]
    assert r3.tokens.tolist() == [14, 16, 17, 18, 19] and r3.loss_mask.tolist() == [0, 0, 0, 1, 1]
    assert r3.advantage.tolist() == [4.0, 6.0, 7.0, 8.0, 9.0]
    assert reprefill_tokens([t]) == 2 + 2 + 3


@pytest.mark.parametrize("scheme", ["tree-step", "step-wise"])
@pytest.mark.parametrize("comp", ["sliding-window", "markovian", "summary"])
def test_synthetic(scheme, comp):
    trajs = synthesize_swe(SweConfig(scheme=scheme, compaction=comp, num_tasks=2, samples_per_task=2,
                                     prompt_median=200, action_median=80, observation_median=150,
                                     max_tokens=3000, context_budget=600, keep_prefix=32, keep_last=100,
                                     evict_chunk=100, summary_tokens=32, seed=1))
    assert any(t.compactions is not None for t in trajs)
    samples = check_reprefill(trajs)
    st = build_forest(samples).stats()
    assert st["compaction_events"] == 0 and st["expanded_tokens"] > sum(len(t) for t in trajs)
    assert st["max_trajectory_tokens"] <= 600  # every sample fits the engine's budget


def test_unchanged_without_events_and_links_repointed():
    plain = make_trajectory({"id": "p", "tokens": [1, 2, 3]})
    a = rec("a", [5, 6, 7, 8, 9, 4], [(3, 1, 2)], group="g")
    b = make_trajectory({"id": "b", "tokens": [5, 6, 7, 8, 1], "parent": {"id": "a", "at": 4}})
    c = rec("c", [5, 6, 7, 8, 2, 3], [(5, 4, 5)], parent={"id": "a", "at": 4})
    out = reprefill([plain, a, b, c])
    assert out[0] is plain and b.parent == ("a", 4)  # the input is not modified
    ids = [t.id for t in out]
    assert ids == ["p", "a/r0", "a/r1", "b", "c/r0", "c/r1"]
    assert out[3].parent == ("a/r0", 3) and out[4].parent == ("a/r0", 3) and out[5].parent == ("c/r0", 0)
    f = build_forest(out)  # the links hold and keep the merge scope of group g
    assert f.num_trees == 2


def test_target_with_no_context_is_an_error():
    t = make_trajectory({"id": "x", "tokens": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1],
                         "compactions": [{"at": 2, "start": 0, "end": 2}]}, file="f.jsonl", line=7)
    with pytest.raises(TreeFormatError) as e:
        reprefill([t])
    msg = str(e.value)
    assert "f.jsonl:7" in msg and "'x'" in msg and "token 2" in msg and "compactions" in msg
    # the same eviction before a context token is fine: that sample starts at it
    ok = make_trajectory({"id": "y", "tokens": [1, 2, 3, 4], "loss_mask": [0, 0, 0, 1],
                          "compactions": [{"at": 2, "start": 0, "end": 2}]})
    assert [s.tokens.tolist() for s in reprefill([ok])] == [[1, 2], [3, 4]]
