"""``_C.forest_index`` (ForestIndex's compiled core) against its Python reference ``_build_python``:
every array and list of the index equal, on Tree-Step and Step-wise batches (many loss-mask
exceptions), random forests, and forests without exceptions; bad layouts refused."""
import numpy as np
import pytest

from megatron_harts.planner import cost_model as cm
from megatron_harts.planner.cost_model import ForestIndex
from megatron_harts.tree_data import build_forest
from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe

FIELDS = ("seg_pairs", "seg_logits", "sub_rows", "sub_size", "traj_targets", "tree_max_path",
          "tree_rows", "seg_tree", "parent", "sub_rows_list", "sub_size_list", "start_list",
          "length_list", "expanded_tokens", "num_segments", "num_trees")


def _needs_compiled():
    if cm._FOREST_INDEX is None:
        pytest.skip("the compiled extension is not built")


def _assert_same(f):
    fast, ref = ForestIndex(f), ForestIndex(f, compiled_core=False)
    for name in FIELDS:
        a, b = getattr(fast, name), getattr(ref, name)
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype == np.int64, name
            np.testing.assert_array_equal(a, b, err_msg=name)
        else:
            assert a == b, name
    assert fast.tree_longest_traj == ref.tree_longest_traj
    assert all(type(x) is int for x in fast.tree_longest_traj)
    assert fast.children == ref.children
    return ref


def _random_forest(rng, n):
    trajs = synthesize_swe(SweConfig(scheme=("tree-step", "step-wise")[n % 2], num_tasks=1 + n % 3,
                                     samples_per_task=2 + n % 5, seed=int(rng.integers(1 << 30))))
    keep = rng.choice(len(trajs), size=max(1, len(trajs) // 2), replace=False)
    return build_forest([trajs[i] for i in sorted(keep.tolist())])


@pytest.mark.parametrize("scheme,samples", [("tree-step", 4), ("step-wise", 8)])
def test_compiled_forest_index_matches_python(scheme, samples):
    _needs_compiled()
    f = build_forest(synthesize_swe(SweConfig(scheme=scheme, num_tasks=3, samples_per_task=samples,
                                              seed=2)))
    ref = _assert_same(f)
    assert ref.seg_logits.sum() > 0 and len(ref.children) == f.num_segments
    if scheme == "step-wise":
        assert f.exc_loss_mask.traj.size > 0  # the exceptions' targets exercised


def test_compiled_forest_index_matches_python_random():
    _needs_compiled()
    rng = np.random.default_rng(7)
    for n in range(12):
        _assert_same(_random_forest(rng, n))


def test_compiled_forest_index_without_exceptions():
    _needs_compiled()
    f = build_forest(synthesize_swe(SweConfig(scheme="step-wise", num_tasks=2, samples_per_task=3,
                                              seed=1)))
    f.exc_loss_mask.traj = f.exc_loss_mask.traj[:0]
    f.exc_loss_mask.pos = f.exc_loss_mask.pos[:0]
    f.exc_loss_mask.value = f.exc_loss_mask.value[:0]
    _assert_same(f)


def test_compiled_forest_index_refuses_bad_layouts():
    _needs_compiled()
    f = build_forest(synthesize_swe(SweConfig(scheme="tree-step", num_tasks=1, samples_per_task=3,
                                              seed=0)))
    ix = ForestIndex(f)
    exc = f.exc_loss_mask
    args = [ix.parent_arr, ix.start, ix.length, ix.row, ix.tree_offsets, f.row_loss_mask,
            f.traj_leaf, ix.traj_length, f.seg_traj_lo, f.seg_traj_hi, exc.traj, exc.pos, exc.value]
    bad_parent = ix.parent_arr.copy()
    bad_parent[1] = 5  # a parent after its child
    bad_row = ix.row.copy()
    bad_row[-1] += 1  # rows not contiguous
    bad_leaf = f.traj_leaf.astype(np.int64)
    bad_leaf[0] = f.num_segments
    for i, bad, msg in ((0, bad_parent, "precede"), (3, bad_row, "contiguous"),
                        (6, bad_leaf, "traj_leaf"),
                        (5, f.row_loss_mask[:-1], "one entry per segment row")):
        with pytest.raises(ValueError, match=msg):
            cm._FOREST_INDEX(*[bad if j == i else a for j, a in enumerate(args)])
