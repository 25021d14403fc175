"""Training data loader (megatron_harts.training.data) and Forest.select.

Pins the module docstring's invariants: whole-tree greedy steps under --global-batch-size,
seeded epoch permutations, lazy reads with one CRC check per tree, background planning (thread,
overlap, errors at their step, shutdown), identical plans for identical arguments, resume.
"""
import gc
import json
import re
import threading

import numpy as np
import pytest
from hypothesis import given, settings

from megatron_harts.planner import plan_harts, plan_l1
from megatron_harts.planner.packing_baselines import plan_ffd, plan_tree_ffd
from megatron_harts.tree_data import TreeDataset, TreeFormatError, build_forest, write_dataset, write_jsonl
from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe
from megatron_harts.training.data import LoaderError, StepBatch, TreeBatchLoader, plan_digest, replica_share
from test_forest import assert_same_trajectory, trajectory_sets

G = 50          # trees of the fixture hold 11..27 trajectories: 1 to 3 trees a step
ROW_BUDGET = 800


def _config(**kw):
    base = dict(num_tasks=12, samples_per_task=3, prompt_median=60, action_median=10, observation_median=20,
                min_turns=2, max_turns=5, max_tokens=600, seed=3)
    base.update(kw)
    return SweConfig(**base)


@pytest.fixture(scope="module")
def trajs():
    return synthesize_swe(_config())


@pytest.fixture(scope="module")
def forest(trajs):
    return build_forest(trajs)


@pytest.fixture(scope="module")
def prefix(forest, tmp_path_factory):
    p = str(tmp_path_factory.mktemp("loader") / "swe")
    write_dataset(forest, p)
    return p


def tree_sizes(f):
    roots = f.tree_offsets[:-1]
    return f.seg_traj_hi[roots] - f.seg_traj_lo[roots]


def harts(dp=2):
    return lambda f: plan_harts(f, dp, ROW_BUDGET)[1]


def take(loader, n):
    return [next(loader) for _ in range(n)]


FOREST_ARRAYS = ("tokens", "row_loss_mask", "row_old_logprobs", "row_advantage", "seg_parent", "seg_start",
                 "seg_length", "seg_row", "seg_traj_lo", "seg_traj_hi", "tree_offsets", "traj_leaf",
                 "traj_length", "traj_has_old_logprobs", "traj_adv_kind", "traj_advantage", "traj_reward",
                 "traj_weight")


def assert_same_forest(a, b):
    for name in FOREST_ARRAYS:
        x, y = np.asarray(getattr(a, name)), np.asarray(getattr(b, name))
        assert x.shape == y.shape and x.tobytes() == y.astype(x.dtype).tobytes(), name
    for name in ("exc_loss_mask", "exc_old_logprobs", "exc_advantage"):
        ea, eb = getattr(a, name), getattr(b, name)
        for col in ("traj", "pos", "value"):
            x, y = np.asarray(getattr(ea, col)), np.asarray(getattr(eb, col))
            assert x.shape == y.shape and x.tobytes() == y.astype(x.dtype).tobytes(), f"{name}.{col}"
    assert a.traj_ids == b.traj_ids and a.traj_group == b.traj_group and a.traj_parent == b.traj_parent


# ---------------------------------------------------------------------------------------------
# Forest.select
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", ["tree-step", "step-wise"])
def test_select_equals_build_forest_of_its_trajectories(forest, scheme):
    # one group per tree: build_forest keeps the groups in order of first appearance, so the
    # rebuilt forest lists the trees in the selected order and every array must agree exactly
    if scheme == "step-wise":   # context copies of earlier actions: loss-mask exceptions
        forest = build_forest(synthesize_swe(_config(scheme="step-wise", num_tasks=8)))
        assert forest.exc_loss_mask.traj.size > 0
    rng = np.random.default_rng(0)
    for k in (1, 2, 5, forest.num_trees):
        trees = rng.permutation(forest.num_trees)[:k]
        sel = forest.select(trees)
        expanded = [forest.expand(tid) for i in trees for tid in forest.tree(int(i)).traj_ids]
        ref = build_forest(expanded)
        assert sel.stats() == ref.stats()
        assert_same_forest(sel, ref)
        for t in expanded:
            assert_same_trajectory(sel.expand(t.id), t)
        for j, i in enumerate(trees):
            assert_same_forest(sel.tree(j), forest.tree(int(i)))


@settings(max_examples=60, deadline=None)
@given(trajectory_sets())
def test_select_random_forests(trajs):
    f = build_forest(trajs)
    n = f.num_trees
    keep = np.flatnonzero(np.arange(n) % 2 == 0)   # a sorted subset: build_forest's own order
    sel = f.select(keep)
    expanded = [f.expand(tid) for i in keep for tid in f.tree(int(i)).traj_ids]
    ref = build_forest(expanded)
    assert sel.stats() == ref.stats()
    assert_same_forest(sel, ref)
    for t in expanded:
        assert_same_trajectory(sel.expand(t.id), t)
    rev = f.select(np.arange(n)[::-1])              # any order: tree by tree
    for j in range(n):
        assert_same_forest(rev.tree(j), f.tree(n - 1 - j))
    for tid in f.traj_ids:
        assert_same_trajectory(rev.expand(tid), f.expand(tid))


def test_tree_is_a_view_and_select_checks_its_input(forest, prefix):
    t = forest.tree(3)
    assert np.shares_memory(t.tokens, forest.tokens) and np.shares_memory(t.seg_length, forest.seg_length)
    assert t.num_trees == 1 and t.tree_offsets.tolist() == [0, t.num_segments]
    ds = TreeDataset(prefix)
    assert_same_forest(ds[3], forest.tree(3))        # the dataset's tree(i) path is unchanged
    with pytest.raises(IndexError, match=r"tree 12 out of range \[0, 12\)"):
        forest.select([0, 12])
    with pytest.raises(IndexError, match="out of range"):
        forest.tree(-1)
    with pytest.raises(ValueError, match="tree 4 listed twice"):
        forest.select([4, 1, 4])
    empty = forest.select([])
    assert empty.num_trees == 0 and empty.num_rows == 0 and empty.num_trajectories == 0


# ---------------------------------------------------------------------------------------------
# steps and order
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("gbs", [27, 50, 90])
def test_steps_are_greedy_whole_trees_within_an_epoch(forest, gbs):
    sizes = tree_sizes(forest)
    with TreeBatchLoader(forest, global_batch_size=gbs, shuffle=False, prefetch=0) as loader:
        seen = {0: [], 1: []}
        for b in take(loader, 40):
            if b.epoch > 1:
                break
            order = loader.epoch_order(b.epoch)
            assert b.num_trajectories == sizes[b.tree_ids].sum() <= gbs
            assert b.expanded_tokens == int(b.forest.traj_length.sum())
            assert len(b.tree_ids) >= 1
            p = len(seen[b.epoch]) + len(b.tree_ids)
            if p < len(order):   # the next tree of the order did not fit
                assert b.num_trajectories + sizes[order[p]] > gbs
            seen[b.epoch] += b.tree_ids.tolist()
            assert_same_forest(b.forest, forest.select(b.tree_ids))
    assert seen[0] == seen[1] == list(range(forest.num_trees))   # file order, every tree once


def test_epoch_permutations_are_seeded(forest):
    def epochs(seed, n_epochs=3):
        loader = TreeBatchLoader(forest, global_batch_size=G, seed=seed, prefetch=0)
        out = {}
        while True:
            b = next(loader)
            if b.epoch == n_epochs:
                return out
            out.setdefault(b.epoch, []).extend(b.tree_ids.tolist())

    a, b, c = epochs(7), epochs(7), epochs(8)
    assert a == b
    for e in range(3):
        assert a[e] == np.random.default_rng([7, e]).permutation(forest.num_trees).tolist()
    assert a[0] != a[1] and a != c


# ---------------------------------------------------------------------------------------------
# lazy reads
# ---------------------------------------------------------------------------------------------

def test_reads_are_lazy_and_check_each_trees_crc_at_every_read(prefix, forest, monkeypatch):
    checked = []
    real = TreeDataset._verify
    monkeypatch.setattr(TreeDataset, "_verify", lambda self, i: (checked.append(i), real(self, i))[1])
    loader = TreeBatchLoader(prefix, global_batch_size=G, seed=1, prefetch=0)
    assert checked == []                             # building the loader reads no tree
    touched = []
    while True:
        b = next(loader)
        if b.epoch == 2:
            break
        touched += b.tree_ids.tolist()
        assert checked == touched                      # only the steps' trees, each checked at every read
        assert b.forest.tokens.dtype == np.int64
        assert_same_forest(b.forest, forest.select(b.tree_ids))
    assert sorted(set(checked)) == list(range(forest.num_trees))


def test_corrupt_tree_fails_the_step_that_reads_it(forest, tmp_path):
    p = str(tmp_path / "bad")
    write_dataset(forest, p)
    order = TreeBatchLoader(p, global_batch_size=G, seed=2, prefetch=0).epoch_order(0)
    victim = int(order[-1])                          # read by the last step of epoch 0
    ds = TreeDataset(p)
    off = ds.header["bin"]["tokens"][0] + ds._arrays["tokens"].itemsize * int(ds.forest(verify=False).seg_row[forest.tree_offsets[victim]])
    del ds
    with open(p + ".bin", "r+b") as fh:
        fh.seek(off)
        byte = fh.read(1)
        fh.seek(off)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with TreeBatchLoader(p, global_batch_size=G, seed=2) as loader:
        good = []
        with pytest.raises(TreeFormatError, match=f"tree {victim} is corrupt"):
            while True:
                good.append(next(loader))
        assert good and victim not in np.concatenate([b.tree_ids for b in good])
        assert loader.state_dict()["iteration"] == len(good)


# ---------------------------------------------------------------------------------------------
# background planning
# ---------------------------------------------------------------------------------------------

def test_planning_runs_in_a_worker_and_overlaps_the_step(forest):
    threads, started = [], [threading.Event() for _ in range(4)]

    def plan(f):
        threads.append(threading.get_ident())
        if len(threads) <= len(started):
            started[len(threads) - 1].set()
        return plan_harts(f, 2, ROW_BUDGET)[1]

    with TreeBatchLoader(forest, global_batch_size=G, plan_fn=plan, prefetch=1) as loader:
        b0 = next(loader)
        # while the caller holds step 0, the worker plans step 1 without being asked
        assert started[1].wait(5.0)
        assert not started[2].wait(0.2)               # ... and not beyond prefetch=1
        b1 = next(loader)
        assert (b0.iteration, b1.iteration) == (0, 1)
        assert b0.plan is not None and b0.plan_seconds > 0 and b0.load_seconds > 0
        assert loader.worker_alive
    assert threading.get_ident() not in threads and len(set(threads)) == 1


def test_worker_error_surfaces_at_its_step_with_its_message(forest):
    calls = []

    def plan(f):
        calls.append(f.num_trees)
        if len(calls) == 3:
            raise RuntimeError(f"planner broke on a step of {f.num_trajectories} trajectories")
        return len(calls)

    loader = TreeBatchLoader(forest, global_batch_size=G, plan_fn=plan, prefetch=2)
    assert [b.plan for b in take(loader, 2)] == [1, 2]
    with pytest.raises(RuntimeError, match=r"^planner broke on a step of \d+ trajectories$"):
        next(loader)
    assert loader.state_dict()["iteration"] == 2      # the failed step was not delivered
    with pytest.raises(RuntimeError, match="stopped at iteration 2 after an error"):
        next(loader)
    assert loader.close()
    # a new loader from the state retries step 2
    retry = TreeBatchLoader(forest, global_batch_size=G, start=loader.state_dict(), prefetch=0)
    assert next(retry).iteration == 2


def test_close_with_a_pending_plan_stops_the_worker(forest):
    release = threading.Event()
    blocked = threading.Event()

    calls = []

    def plan(f):
        calls.append(1)
        if len(calls) == 2:                           # step 1: block until released
            blocked.set()
            release.wait(30)
        return None

    loader = TreeBatchLoader(forest, global_batch_size=G, plan_fn=plan, prefetch=3)
    next(loader)
    assert blocked.wait(5.0)
    worker = loader._thread
    assert not loader.close(timeout=0.05)            # mid-plan: it cannot stop at once ...
    release.set()
    worker.join(5.0)
    assert not worker.is_alive()                     # ... but ends right after, steps 2-3 cancelled
    with pytest.raises(RuntimeError, match="closed"):
        next(loader)


def test_garbage_collected_loader_stops_its_worker(forest):
    loader = TreeBatchLoader(forest, global_batch_size=G, plan_fn=lambda f: f.num_trees, prefetch=2)
    next(loader)
    worker = loader._thread
    del loader
    gc.collect()
    worker.join(5.0)
    assert not worker.is_alive()


def test_prefetch_depth_does_not_change_the_batches(forest):
    runs = []
    for prefetch in (0, 1, 3):
        with TreeBatchLoader(forest, global_batch_size=G, seed=4, plan_fn=harts(), prefetch=prefetch) as ld:
            runs.append([(b.tree_ids.tolist(), plan_digest(b.plan)) for b in take(ld, 9)])
    assert runs[0] == runs[1] == runs[2]


# ---------------------------------------------------------------------------------------------
# determinism: every rank plans the same
# ---------------------------------------------------------------------------------------------

def test_planners_are_deterministic(forest):
    sub = forest.select([5, 0, 9])
    for planner in (lambda f: plan_harts(f, 2, ROW_BUDGET)[0], lambda f: plan_harts(f, 2, ROW_BUDGET)[1],
                    lambda f: plan_l1(f, 4, ROW_BUDGET), lambda f: plan_ffd(f, 2, ROW_BUDGET),
                    lambda f: plan_tree_ffd(f, 2, ROW_BUDGET)):
        a, b = planner(sub), planner(sub)
        assert plan_digest(a) == plan_digest(b)
        np.testing.assert_array_equal(a.slots, b.slots)
        for x, y in zip(a.microbatches, b.microbatches):
            for name in ("owned", "recomputed", "trajectories"):
                np.testing.assert_array_equal(getattr(x, name), getattr(y, name))
        # a select()ed step plans exactly like the same trees built from scratch
        rebuilt = build_forest([sub.expand(t) for t in sub.traj_ids])
        assert plan_digest(planner(rebuilt)) == plan_digest(a)


def test_same_arguments_give_every_rank_the_same_batches_and_plans(prefix):
    """Two DP ranks (or pipeline stages), each with its own loader: no broadcast needed."""
    ranks = [TreeBatchLoader(prefix, global_batch_size=G, seed=9, plan_fn=harts(2)) for _ in range(2)]
    try:
        for _ in range(5):
            a, b = next(ranks[0]), next(ranks[1])
            assert a.tree_ids.tolist() == b.tree_ids.tolist() and a.epoch == b.epoch
            assert plan_digest(a.plan) == plan_digest(b.plan)
            for r in range(2):
                sa, sb = replica_share(a, r), b.replica_share(r)
                assert [m and m.index for m in sa] == [m and m.index for m in sb]
    finally:
        for ld in ranks:
            ld.close()


def test_replica_share_is_the_plans_schedule(forest):
    with TreeBatchLoader(forest, global_batch_size=G, plan_fn=harts(3), prefetch=0) as loader:
        b = next(loader)
        owned = []
        for r in range(3):
            share = replica_share(b, r)
            assert len(share) == b.plan.num_slots
            assert all(x is y for x, y in zip(share, b.plan.schedule(r)))
            owned += [s for m in share if m is not None for s in m.owned.tolist()]
        assert sorted(owned) == list(range(b.forest.num_segments))
        with pytest.raises(ValueError, match=r"replica must be an integer in \[0, 3\)"):
            replica_share(b, 3)
    bare = next(TreeBatchLoader(forest, global_batch_size=G, prefetch=0))
    with pytest.raises(ValueError, match="without plan_fn"):
        replica_share(bare, 0)


# ---------------------------------------------------------------------------------------------
# resume
# ---------------------------------------------------------------------------------------------

def test_resume_yields_the_uninterrupted_batches(prefix):
    with TreeBatchLoader(prefix, global_batch_size=G, seed=5, plan_fn=harts()) as loader:
        first = take(loader, 2)
        state = json.loads(json.dumps(loader.state_dict()))   # JSON round trip
        rest = take(loader, 6)                           # crosses into epoch 1
    assert state["iteration"] == 2 and rest[-1].epoch == 1
    with TreeBatchLoader(prefix, global_batch_size=G, seed=5, plan_fn=harts(), start=state) as resumed:
        again = take(resumed, 6)
    for a, b in zip(rest, again):
        assert (a.iteration, a.epoch, a.tree_ids.tolist()) == (b.iteration, b.epoch, b.tree_ids.tolist())
        assert plan_digest(a.plan) == plan_digest(b.plan)
        assert_same_forest(a.forest, b.forest)
    # load_state_dict on a running loader drops what the worker prefetched
    with TreeBatchLoader(prefix, global_batch_size=G, seed=5, plan_fn=harts(), prefetch=2) as loader:
        take(loader, 4)
        loader.load_state_dict(state)
        assert [b.tree_ids.tolist() for b in take(loader, 3)] == [b.tree_ids.tolist() for b in rest[:3]]
    assert first[0].iteration == 0


def test_resume_state_mismatch_is_refused(prefix, forest):
    state = TreeBatchLoader(prefix, global_batch_size=G, seed=5, prefetch=0).state_dict()
    for kwargs, what in [(dict(seed=6), "seed: state 5, loader 6"), (dict(shuffle=False), "shuffle"),
                         (dict(global_batch_size=60), "--global-batch-size: state 50, loader 60")]:
        args = dict(global_batch_size=G, seed=5, prefetch=0)
        args.update(kwargs)
        with pytest.raises(LoaderError, match="does not match") as err:
            TreeBatchLoader(prefix, start=state, **args)
        assert what in str(err.value) and prefix in str(err.value)
    with pytest.raises(LoaderError, match="number of trees in the dataset: state 12, loader 5"):
        TreeBatchLoader(forest.select(range(5)), global_batch_size=G, seed=5, start=state)
    other = forest.select([1, 0] + list(range(2, 12)))   # same tree count, other trees
    with pytest.raises(LoaderError, match="trajectories per tree"):
        TreeBatchLoader(other, global_batch_size=G, seed=5, start=state)
    with pytest.raises(LoaderError, match="lacks position"):
        TreeBatchLoader(prefix, global_batch_size=G, seed=5, start={k: v for k, v in state.items()
                                                                   if k != "position"})


# ---------------------------------------------------------------------------------------------
# sources and bad input
# ---------------------------------------------------------------------------------------------

def test_tree_larger_than_the_global_batch_is_refused(prefix, forest):
    big = int(tree_sizes(forest).max())
    first_big = int(np.flatnonzero(tree_sizes(forest) > 20)[0])
    with pytest.raises(LoaderError) as err:
        TreeBatchLoader(prefix, global_batch_size=20)
    msg = str(err.value)
    assert msg.startswith(prefix + ".idx: ")
    assert f"tree {first_big} has {int(tree_sizes(forest)[first_big])} trajectories" in msg
    assert "--global-batch-size 20" in msg and f">= {big}" in msg
    assert isinstance(err.value, ValueError)
    with pytest.raises(LoaderError, match="--global-batch-size must be an integer >= 1"):
        TreeBatchLoader(prefix, global_batch_size=0)


def test_empty_dataset_is_refused(forest, tmp_path):
    p = str(tmp_path / "empty")
    write_dataset(forest.select([]), p)
    with pytest.raises(LoaderError, match="^" + re.escape(p + ".idx: the dataset has no trees")):
        TreeBatchLoader(p, global_batch_size=G)


def test_trajectory_files_and_datasets_give_the_same_batches(trajs, prefix, tmp_path):
    path = str(tmp_path / "swe.jsonl")
    write_jsonl(trajs, path)
    runs = []
    for src in (path, prefix, prefix + ".idx", TreeDataset(prefix)):
        with TreeBatchLoader(src, global_batch_size=G, seed=3, prefetch=0) as loader:
            runs.append(take(loader, 4))
    assert runs[0][0].forest is not None and isinstance(runs[0][0], StepBatch)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert a.tree_ids.tolist() == b.tree_ids.tolist()
            assert_same_forest(a.forest, b.forest)
