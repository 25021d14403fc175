"""The cost model's logits rows are the rows the model computes logits for: rows with at least one
target, loss-mask exceptions of single trajectories included (the layout's rule)."""
import numpy as np
import pytest

from megatron_harts.planner.cost_model import ForestIndex
from megatron_harts.tree_data import build_forest
from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe
from megatron_harts.tree_data.trajectory import Trajectory


def _brute(f):
    """(per segment: rows predicting a target of some trajectory, per trajectory: its targets)."""
    logit = np.zeros(f.num_rows, dtype=bool)
    targets = np.zeros(f.num_trajectories, dtype=np.int64)
    for t in range(f.num_trajectories):
        rows = f.trajectory_rows(t)
        lm = f.exc_loss_mask.apply(t, f.row_loss_mask[rows])
        hit = np.flatnonzero(lm[1:] != 0)
        logit[rows[hit]] = True
        targets[t] = hit.size
    seg = np.repeat(np.arange(f.num_segments), f.seg_length)
    return np.bincount(seg, weights=logit, minlength=f.num_segments).astype(np.int64), targets


def _traj(i, tokens, mask):
    return Trajectory(id=i, tokens=np.array(tokens, dtype=np.int64), loss_mask=np.array(mask, dtype=np.uint8))


def test_exceptions_add_logits_rows():
    # three trajectories share [1 2 3 4]; only the first trains on tokens 2..3 (an exception: the
    # rows keep the last trajectory's mask), the third trains on its fork token 9
    trajs = [_traj(0, [1, 2, 3, 4, 5], [0, 1, 1, 0, 1]),
             _traj(1, [1, 2, 3, 4, 6, 7], [0, 0, 0, 0, 1, 1]),
             _traj(2, [1, 2, 3, 4, 6, 8, 9], [0, 0, 0, 0, 0, 0, 1])]
    f = build_forest(trajs)
    assert len(f.exc_loss_mask.traj) > 0
    ix = ForestIndex(f)
    seg, targets = _brute(f)
    np.testing.assert_array_equal(ix.seg_logits, seg)
    np.testing.assert_array_equal(ix.traj_targets, targets)
    assert ix.seg_logits.sum() == 5  # the rows of tokens 1, 2, 4 (-> 5 and -> 6), 6 and 8


def test_step_wise_logits_rows_match_the_layout_rule():
    trajs = synthesize_swe(SweConfig(scheme="step-wise", num_tasks=2, samples_per_task=3, seed=1))
    f = build_forest(trajs)
    assert (f.exc_loss_mask.value != 0).any()  # step-wise: earlier actions are exceptions
    ix = ForestIndex(f)
    seg, targets = _brute(f)
    np.testing.assert_array_equal(ix.seg_logits, seg)
    np.testing.assert_array_equal(ix.traj_targets, targets)


@pytest.mark.parametrize("seed", [0, 3])
def test_compiled_exception_targets_match_python(seed):
    # _C.exception_targets equals its Python reference on step-wise forests (many exceptions)
    from megatron_harts.planner import cost_model as cm
    if cm._EXC_TARGETS is None:
        pytest.skip("the compiled extension is not built")
    f = build_forest(synthesize_swe(SweConfig(scheme="step-wise", num_tasks=3, samples_per_task=4, seed=seed)))
    ix = ForestIndex(f)
    last = np.zeros(ix.num_segments, dtype=np.int64)
    last[f.seg_parent[f.seg_parent >= 0]] = 1  # either value of `last` exercised
    for lst in (np.zeros_like(last), last):
        fast = cm._exception_targets(f, ix.parent_arr, ix.start, ix.length, ix.row, lst)
        ref = cm._exception_targets_python(f, ix.parent_arr, ix.start, ix.length, ix.row, lst)
        assert ref[0].sum() > 0 and (ref[1] != 0).any()
        for a, b in zip(fast, ref):
            np.testing.assert_array_equal(a, b)
    bad = f.exc_loss_mask.pos.copy()
    bad[-1] = 10 ** 9
    with pytest.raises(ValueError, match="position out of range"):
        cm._EXC_TARGETS(ix.parent_arr, ix.start, ix.length, ix.row, f.traj_leaf, f.row_loss_mask, last,
                        f.exc_loss_mask.traj, bad, f.exc_loss_mask.value)
