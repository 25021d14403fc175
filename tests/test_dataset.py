"""The on-disk dataset reads back exactly what was written, one tree at a time."""
import os

import numpy as np
from hypothesis import given, settings

from megatron_harts.tree_data import TreeDataset, build_forest, load_forest, write_dataset, write_jsonl
from test_forest import assert_same_trajectory, trajectory_sets


def _forest_arrays(f):
    names = ["tokens", "row_loss_mask", "row_old_logprobs", "row_advantage", "seg_parent", "seg_start",
             "seg_length", "seg_row", "seg_traj_lo", "seg_traj_hi", "tree_offsets", "traj_leaf", "traj_length",
             "traj_has_old_logprobs", "traj_adv_kind", "traj_advantage", "traj_reward", "traj_weight"]
    return {n: np.asarray(getattr(f, n)) for n in names}


@settings(max_examples=60, deadline=None)
@given(trajectory_sets())
def test_dataset_round_trip(tmp_path_factory, trajs):
    prefix = str(tmp_path_factory.mktemp("ds") / "d")
    f = build_forest(trajs)
    write_dataset(f, prefix)
    ds = TreeDataset(prefix)
    g = ds.forest()
    a, b = _forest_arrays(f), _forest_arrays(g)
    for k in a:
        assert a[k].tobytes() == b[k].astype(a[k].dtype).tobytes(), k
    assert g.traj_ids == f.traj_ids and g.traj_group == f.traj_group and g.traj_parent == f.traj_parent
    assert len(ds) == f.num_trees and ds.stats() == f.stats()
    by_id = {t.id: t for t in trajs}
    for i in range(len(ds)):
        tree = ds[i]
        assert tree.num_trees == 1
        for tid in tree.traj_ids:
            assert_same_trajectory(tree.expand(tid), by_id[tid])
    assert not [p for p in os.listdir(os.path.dirname(prefix)) if ".tmp." in p]


def test_load_forest_accepts_files_and_datasets(tmp_path):
    from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe

    trajs = synthesize_swe(SweConfig(num_tasks=2, samples_per_task=2, prompt_median=100, max_tokens=2000))
    path = str(tmp_path / "r.jsonl.gz")
    write_jsonl(trajs, path)
    f1 = load_forest(path)
    write_dataset(f1, str(tmp_path / "d"))
    f2 = load_forest(str(tmp_path / "d"))
    assert f1.stats() == f2.stats()
    for t in trajs[:5]:
        assert_same_trajectory(f2.expand(t.id), t)


def test_tree_read_touches_only_its_slices(tmp_path):
    from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe

    trajs = synthesize_swe(SweConfig(num_tasks=3, samples_per_task=2, prompt_median=100, max_tokens=2000))
    write_dataset(build_forest(trajs), str(tmp_path / "d"))
    ds = TreeDataset(str(tmp_path / "d"))
    assert isinstance(ds._arrays["tokens"], np.ndarray) and ds._arrays["tokens"].base is not None
    assert sum(ds[i].num_rows for i in range(len(ds))) == ds.stats()["unique_tokens"]
