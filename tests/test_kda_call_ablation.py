"""The KDA call ablation: per-depth bucketing and node-wise plans, executed.

- ``per_depth_bucketing_plan`` / ``node_wise_plan`` are valid replay-free ``CallPlan``s whose
  call counts are the baselines' counts, shaped as the baselines describe them;
- ``tree_kda`` runs them (sequences starting at unaligned fork positions from their parent
  sequence's final state): outputs and gradients equal the HARTS plan's and expanded KDA's, fp64;
- ``--tree-kda-call-plan`` reaches ``TreePackedSeqParams.for_tree`` through the model config; a
  training step with each plan gives harts' loss and parameters and reports the ablation's calls;
- sharing-window layouts and flag combinations that cannot run an ablation are refused by name.
"""
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from multiproc import run_ranks
from test_call_planner import random_forest
from test_tree_kda import forests, random_inputs

from megatron_harts.ops.kda import kda_chunked
from megatron_harts.ops.tree_kda import build_kda_schedule, tree_kda
from megatron_harts.planner import baselines
from megatron_harts.planner.calls import plan_calls
from megatron_harts.tree_data import build_forest, make_trajectory

PLANS = {"per-depth": (baselines.per_depth_bucketing_plan, baselines.per_depth_bucketing),
         "node-wise": (baselines.node_wise_plan, baselines.node_wise)}


# ---------------------------------------------------------------------------
# the plans
# ---------------------------------------------------------------------------

def _children(parent):
    kids = [[] for _ in parent]
    for i, p in enumerate(parent):
        if p >= 0:
            kids[p].append(i)
    return kids


@pytest.mark.parametrize("name", sorted(PLANS))
def test_plans_are_valid_and_count_the_baselines_calls(name):
    build, count = PLANS[name]
    rng = random.Random(11)
    for trial in range(400):
        B = rng.choice([1, 2, 4, 8, 64])
        parent, start, length = random_forest(rng, rng.randint(0, 25), B)
        plan = build(parent, start, length, B)
        plan.validate(parent, start, length, B)
        assert plan.num_calls == count(parent, start, length, B)["calls"], (trial, parent, start, length, B)
        assert plan.replay_tokens == 0 and not plan.replay
        assert np.array_equal(plan.seq_start, plan.seq_semantic_start)
        kids = _children(parent)
        segs = [plan.seq_segments[plan.seq_segments_offsets[q]:plan.seq_segments_offsets[q + 1]].tolist()
                for q in range(plan.num_sequences)]
        if name == "node-wise":
            assert all(len(s) == 1 for s in segs)
            depth = []
            for p in parent:
                depth.append(0 if p < 0 else depth[p] + 1)
            assert np.array_equal(plan.segment_call, np.asarray(depth, dtype=np.int64))
        else:
            for s in segs:      # chains run through single children and stop at a fork or a leaf
                assert all(len(kids[g]) == 1 for g in s[:-1]) and len(kids[s[-1]]) != 1
        # a non-root sequence starts from its parent sequence's final state, one call or more later
        for q in range(plan.num_sequences):
            first = int(plan.seq_first_segment[q])
            if parent[first] >= 0:
                src = int(plan.seq_source[q])
                assert src == plan.segment_sequence[parent[first]] and plan.seq_end[src] == start[first]


def test_plan_shapes_on_a_small_tree():
    # 0 -> 1 -> {2 -> 3, 4}; a second tree 5 -> {6, 7}
    parent, start, length = [-1, 0, 1, 2, 1, -1, 5, 5], [0, 3, 5, 6, 5, 0, 2, 2], [3, 2, 1, 4, 7, 2, 1, 1]
    pd = baselines.per_depth_bucketing_plan(parent, start, length, 4)
    nw = baselines.node_wise_plan(parent, start, length, 4)
    assert pd.num_calls == 2 and nw.num_calls == 4
    assert pd.seq_segments.tolist() == [0, 1, 5, 2, 3, 4, 6, 7]
    assert pd.seq_call.tolist() == [0, 0, 1, 1, 1, 1]
    assert nw.seq_first_segment.tolist() == [0, 5, 1, 6, 7, 2, 4, 3]
    # each chain ending at a fork exports its final state once, read by all the fork's children
    assert pd.seq_export_positions.tolist() == [5, 2] and pd.seq_export_segment.tolist() == [1, 5]
    assert pd.seq_source.tolist() == [-1, -1, 0, 0, 1, 1]
    assert plan_calls(parent, start, length, 4).num_calls == 2


def test_bad_input_is_refused_like_the_planner():
    with pytest.raises(ValueError, match="segment 1: start"):
        baselines.node_wise_plan([-1, 0], [0, 2], [3, 1], 4)
    with pytest.raises(ValueError, match="chunk_size"):
        baselines.per_depth_bucketing_plan([-1], [0], [1], 0)


# ---------------------------------------------------------------------------
# the executor runs them
# ---------------------------------------------------------------------------

def _run(forest, plan, leaves):
    sched = build_kda_schedule(forest.seg_parent, forest.seg_start, forest.seg_length, forest.seg_row, plan)
    assert len(sched.calls) == plan.num_calls
    assert plan.replay or sched.replay_tokens == 0
    return tree_kda(*leaves, sched)


def check_against_harts_and_expanded(forest, B, seed=0):
    R = forest.num_rows
    leaves = [x[0].requires_grad_() for x in random_inputs(1, R, 2, 4, 3, torch.float64, seed)]
    w = torch.randn(R, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    seg = (forest.seg_parent, forest.seg_start, forest.seg_length)
    o_ref = _run(forest, plan_calls(*seg, B), leaves)
    g_ref = torch.autograd.grad((w * o_ref).sum(), leaves)
    for name, (build, _) in PLANS.items():
        o = _run(forest, build(*seg, B), leaves)
        torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-12, msg=f"{name}: outputs")
        for x, a, b in zip("q k v g beta".split(), torch.autograd.grad((w * o).sum(), leaves), g_ref):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"{name}: gradient of {x}")
        for t in range(forest.num_trajectories):
            rows = torch.as_tensor(forest.trajectory_rows(t))
            o_exp, _ = kda_chunked(*(x[rows][None] for x in leaves), chunk_size=B)
            torch.testing.assert_close(o[rows], o_exp[0], rtol=1e-10, atol=1e-12, msg=f"{name}: trajectory {t}")


@settings(max_examples=25, deadline=None)
@given(forests())
def test_ablation_plans_equal_harts_and_expanded_fp64(fb):
    forest, B = fb
    check_against_harts_and_expanded(forest, B)


def _forest(token_lists):
    return build_forest([make_trajectory({"id": i, "tokens": t}) for i, t in enumerate(token_lists)])


@pytest.mark.parametrize("tokens, B", [
    # forks inside a chunk and single-token segments (a fork after every token of a path)
    ([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9], [1, 2, 3, 4, 8], [1, 2, 3, 4, 5, 9, 9, 9, 9, 9, 1], [1, 9]], 4),
    ([[1], [1, 2], [1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 5], [2]], 8),
    # depth-1 forests: roots only (every plan is one call)
    ([[1, 2, 3], [2, 3, 4, 5, 6, 7, 8, 9, 1, 2]], 4),
    ([[5]], 2),
    # forks at chunk boundaries, one beyond a full chunk
    ([[1] * 8 + [2] * 5, [1] * 8 + [3], [1] * 9 + [4] * 6, [1] * 16 + [5]], 8),
])
def test_ablation_plans_on_chosen_forests(tokens, B):
    forest = _forest(tokens)
    check_against_harts_and_expanded(forest, B, seed=3)
    if all(int(p) < 0 for p in forest.seg_parent):
        seg = (forest.seg_parent, forest.seg_start, forest.seg_length)
        assert all(build(*seg, B).num_calls == 1 for build, _ in PLANS.values())


# ---------------------------------------------------------------------------
# model config, packed params and the driver flag
# ---------------------------------------------------------------------------

def test_config_and_packed_params_choose_the_plan():
    from megatron_harts.layout import build_layout
    from megatron_harts.models.config import HybridConfig
    from megatron_harts.models.packed import ExportSpec, TreePackedSeqParams

    forest = _forest([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9], [1, 2, 3, 4, 8, 8], [1, 2, 3, 4, 8, 7],
                      [1, 2, 3, 4, 8, 7, 6]])
    layout = build_layout(forest)
    seg = (layout.seg_parent, layout.seg_start, layout.seg_length)
    counts = {"harts": plan_calls(*seg, 4).num_calls}
    counts.update({n: build(*seg, 4).num_calls for n, (build, _) in PLANS.items()})
    assert counts["harts"] < counts["per-depth"] < counts["node-wise"]
    for name, n in counts.items():
        psp = TreePackedSeqParams.for_tree(layout, chunk_size=4, call_plan=name)
        assert len(psp.kda_schedule.calls) == n
    with pytest.raises(ValueError, match="--tree-kda-call-plan"):
        TreePackedSeqParams.for_tree(layout, chunk_size=4, call_plan="per-level")
    with pytest.raises(ValueError, match="--tree-kda-call-plan"):
        HybridConfig(num_layers=2, hidden_size=16, num_attention_heads=2, tree_kda_call_plan="per_depth")

    # sharing windows: producer and consumer layouts run harts only
    producer = build_layout(forest)
    roots = [s for s in range(forest.num_segments) if int(forest.seg_parent[s]) == 0]
    consumer = build_layout(forest, roots=roots, context=producer)
    spec = ExportSpec.for_consumers(producer, [consumer], chunk_size=4)
    exports = TreePackedSeqParams.for_tree(producer, chunk_size=4, export=spec).exports
    for name in PLANS:
        with pytest.raises(ValueError, match=f"--tree-kda-call-plan {name} needs --tree-sharing within"):
            TreePackedSeqParams.for_tree(producer, chunk_size=4, export=spec, call_plan=name)
        with pytest.raises(ValueError, match="consumer"):
            TreePackedSeqParams.for_tree(consumer, chunk_size=4, exports=exports, call_plan=name)


def test_flag_values_and_bad_combinations():
    from megatron_harts.training import arguments as A
    base = ("--num-layers 4 --hidden-size 32 --num-attention-heads 2 --vocab-size 64 --train-iters 2 "
            "--global-batch-size 4 --lr 1e-3 --seq-length 48 --fp64").split()
    assert A.parse_args(base, require_data=False).tree_kda_call_plan == "harts"
    for name in PLANS:
        args = A.parse_args(base + ["--tree-kda-call-plan", name], require_data=False)
        assert A.hybrid_config(args, device="cpu").tree_kda_call_plan == name
        for sharing in ("off", "windows"):
            with pytest.raises(A.ArgumentsError, match=f"--tree-kda-call-plan {name} needs --tree-sharing within"):
                A.parse_args(base + ["--tree-kda-call-plan", name, "--tree-sharing", sharing], require_data=False)
    with pytest.raises(A.ArgumentsError, match="--tree-kda-call-plan"):
        A.parse_args(base + ["--tree-kda-call-plan", "depth"], require_data=False)
    assert "--tree-kda-call-plan" in A.OWN_FLAGS and "--tree-kda-call-plan" in A.__doc__


def stepwise_rollouts(seed=0):
    """Two trees of step-wise rollouts: trajectories end inside others' paths (single-child chains)
    and fork at several depths, so harts < per-depth < node-wise in calls (chunk size 8)."""
    rng = np.random.default_rng(seed)
    trajs = []
    for task in range(2):
        prompt = rng.integers(0, 64, int(rng.integers(10, 14))).tolist()
        steps = rng.integers(0, 64, 24).tolist()
        for j, cut in enumerate((3, 5, 9, 9, 14, 17, 17, 24)):
            tail = [] if j in (1, 5) else rng.integers(0, 64, int(rng.integers(2, 6))).tolist()
            toks = prompt + steps[:cut] + tail
            n = len(toks)
            trajs.append(make_trajectory({
                "id": f"t{task}/{j}", "tokens": toks, "loss_mask": [0] * len(prompt) + [1] * (n - len(prompt)),
                "old_logprobs": (-np.abs(rng.normal(2.0, 0.5, n))).tolist(), "advantage": float(rng.normal())}))
    return trajs


def _driver_worker(rank, world, port, out):
    import os
    from megatron_harts.training.step import replica_microbatches
    from megatron_harts.training.trainer import Trainer
    from test_training_driver import MODEL

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    trajs = stepwise_rollouts()
    flags = MODEL + ["--global-batch-size", str(len(trajs)), "--train-iters", "2", "--seq-length", "48",
                     "--tree-microbatch-tokens", "64", "--tree-sharing", "within", "--lr", "3e-3", "--seed", "7",
                     "--rl-objective", "ppo", "--log-interval", "100"]
    runs = {}
    for name in ("harts", "per-depth", "node-wise"):
        with Trainer.from_args(flags + ["--tree-kda-call-plan", name]) as t:
            plan = t._plan(build_forest(trajs))
            expected = 0
            for mb in replica_microbatches(build_forest(trajs), plan, 0, t.settings):
                seg = (mb.layout.seg_parent, mb.layout.seg_start, mb.layout.seg_length)
                expected += (plan_calls(*seg, 8).num_calls if name == "harts"
                             else baselines.BASELINE_PLANS[name](*seg, 8).num_calls)
            steps = [t.step(trajs)]
            params = {k: v.detach().clone() for k, v in t.model[0].module.named_parameters()}
            runs[name] = (steps, params, expected)
    torch.distributed.destroy_process_group()
    torch.save(runs, out)


def test_driver_steps_with_each_call_plan_equal_harts(tmp_path):
    """A training step (tiny hybrid MoE model, fp64, CPU, world of one) per call plan: harts' loss,
    gradient norm and parameters to 1e-10; ``kda_calls`` reports the ablation's calls."""
    from megatron_cpu import free_port
    out = tmp_path / "runs.pt"
    run_ranks(_driver_worker, 1, (free_port(), str(out)), timeout=300)
    runs = torch.load(out, weights_only=False)
    steps_ref, params_ref, calls_ref = runs["harts"]
    assert steps_ref[0]["kda_calls"] == calls_ref
    for name in PLANS:
        steps, params, calls = runs[name]
        for i, (m, m_ref) in enumerate(zip(steps, steps_ref)):
            for key in ("loss", "grad_norm", "objective/pg_loss"):
                assert abs(m[key] - m_ref[key]) <= 1e-10 * abs(m_ref[key]), (name, i, key)
            assert m["kda_calls"] == calls, (name, m["kda_calls"], calls)
        for k, p in params_ref.items():
            torch.testing.assert_close(params[k], p, rtol=1e-10, atol=1e-12, msg=f"{name}: {k}")
    assert calls_ref < runs["per-depth"][2] < runs["node-wise"][2]
