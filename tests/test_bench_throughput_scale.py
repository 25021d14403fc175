"""benchmarks/bench_throughput.py at realistic scale, on the CPU: the kimi48b-layers preset's flags
give the driver Kimi-Linear-48B-A3B's per-layer shapes, the parameter count the FLOP and memory
formulas use is the built model's, model FLOPs count attention over the visible pairs each mode
executed, long-trajectory batches and --plan-only size a run, bad sizes are one error line."""
import json

import numpy as np
import pytest

from tool_runner import assert_one_error, load_tool, run_tool


@pytest.fixture(scope="module")
def bt():
    return load_tool("bench_throughput", "benchmarks")


def driver_flags(bt, p):
    return bt.model_flags(p, "") + ["--seq-length", "64", "--tree-microbatch-tokens", "64", "--global-batch-size", "1",
                                    "--train-iters", "10", "--lr", "1e-5", "--distributed-backend", "gloo"]


def test_kimi48b_preset_flags_give_the_driver_every_shape(bt):
    from megatron_harts.training.arguments import hybrid_config, parse_args
    p = bt.PRESETS["kimi48b-layers"]
    assert p["layers"] >= 4 and p["layers"] % 4 == 0
    cfg = hybrid_config(parse_args(driver_flags(bt, p), require_data=False), device="cpu")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.ffn_hidden_size) == (p["layers"], 2304, 32, 9216)
    assert (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.q_lora_rank) == \
        (512, 128, 64, 128, None)
    assert (cfg.linear_num_heads, cfg.linear_head_dim) == (32, 128)
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size,
            cfg.moe_shared_expert_intermediate_size) == (32, 8, 1024, 1024)
    assert cfg.resolved_layer_types() == ["kda", "kda", "kda", "mla"] * (p["layers"] // 4)
    assert cfg.resolved_mlp_types() == ["dense"] + ["moe"] * (p["layers"] - 1)
    assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == ("full", "uniform", 1)
    flags = bt.model_flags(p, "--bf16")
    assert flags[flags.index("--vocab-size") + 1] == "163840" and "--bf16" in flags
    # weights, gradients and Adam state at 18 bytes a parameter, 32k-row activations with recomputation:
    # under one H200's 141 GB with room for the allocator
    est = bt.memory_estimate(p, 32768, p["recompute"])
    assert est["total"] < 120e9 and est["weights_optimizer"] == 18 * est["parameters"]


@pytest.mark.parametrize("shape", [{}, {"lin_heads": 3, "shared_ffn": 48, "ffn": 96, "layers": 8, "recompute": "full"}])
def test_parameter_counts_equal_the_built_model(bt, shape):
    """The counts the FLOP and memory formulas use, against the driver's model of the same flags (KDA
    heads other than the attention heads, a shared expert of another width: both reach the model)."""
    from megatron_harts.training.trainer import Trainer
    p = dict(bt.PRESETS["tiny"], **shape)
    with Trainer.from_args(driver_flags(bt, p)) as t:
        model = t.model[0].module
        built = sum(q.numel() for q in model.parameters())
        per_layer = [sum(q.numel() for q in layer.parameters()) for layer in model.decoder.layers]
    c = bt.parameter_counts(p)
    assert c["total"] == built
    assert per_layer == [c[a] + c[m] for a, m in bt.layer_kinds(p)]


def test_model_flops_terms(bt):
    p = dict(bt.PRESETS["tiny"], layers=8)
    c = bt.parameter_counts(p)
    f = bt.model_flops(p, rows=1000, pairs=50_000, logits_rows=300)
    per_row = 6 * c["kda"] + 2 * c["mla"] + c["dense"] + 7 * c["moe_active"]
    assert f["dense"] == 6 * per_row * 1000
    assert f["attention"] == 3 * 2 * 50_000 * p["heads"] * (p["qk"] + p["rope"] + p["v"]) * 2
    assert f["kda"] == 3 * bt.kda_core_flops_per_token(p) * 1000 * 6
    assert f["output"] == 6 * p["hidden"] * p["vocab"] * 300
    assert f["total"] == pytest.approx(f["dense"] + f["attention"] + f["kda"] + f["output"])
    # the KDA core per token: 2 x heads x (3 dk dv + C (3 dk + 2 dv) + C^2 / 3)
    assert bt.kda_core_flops_per_token(p, chunk=64) == 2 * 2 * (3 * 256 + 64 * 80 + 4096 / 3)


def test_long_trajectory_flags_reach_the_generator(bt):
    short = bt.synthesize("step-wise", 1, 65536, 512, seed=0, samples_per_task=1)
    long = bt.synthesize("step-wise", 1, 65536, 512, seed=0, samples_per_task=1, max_turns=64,
                         observation_median=2000)
    assert int(short.traj_length.max()) < 32768 < int(long.traj_length.max()) <= 65536
    few = bt.synthesize("tree-step", 1, 8192, 512, seed=0, samples_per_task=1, max_turns=2, max_leaves=2)
    assert few.num_trajectories <= 2
    chain = bt.synthesize("tree-step", 1, 8192, 512, seed=0, samples_per_task=1, branch_prob=0.0)
    assert chain.num_trajectories == 1
    pairs = bt.synthesize("tree-step", 1, 8192, 512, seed=0, samples_per_task=1, branch_prob=1.0, branch_factor=2,
                          max_leaves=2)
    assert pairs.num_trajectories == 2 and pairs.num_segments == 3      # one fork into two children


def test_tiny_run_counts_model_flops_over_executed_pairs(bt, tmp_path):
    out = tmp_path / "t.json"
    bt.main(["--device", "cpu", "--preset", "tiny", "--schemes", "step-wise", "--num-tasks", "1", "--max-tokens", "256",
             "--microbatch-tokens", "1024", "--iters", "1", "--warmup", "0", "--no-cosine", "--kda-backend",
             "reference", "--attention-backend", "reference", "--out", str(out)])
    res = json.loads(out.read_text())
    p = res["model"]
    forest = bt.synthesize("step-wise", 1, 256, p["vocab"], seed=0)
    lengths = np.asarray(forest.traj_length, dtype=np.int64)
    row = res["schemes"]["step-wise"]
    exp, tree = row["expanded"], row["tree_within"]
    assert exp["visible_pairs"] == int((lengths * (lengths + 1) // 2).sum())        # causal per trajectory
    assert tree["visible_pairs"] < exp["visible_pairs"]
    for m in (exp, tree):
        want = bt.model_flops(p, m["rows_computed"], m["visible_pairs"], m["logits_rows"])
        assert m["model_flops"] == pytest.approx(want)
        assert m["model_tflops_per_s"] > 0 and m["mfu"] is None           # no peak figure for a CPU
    assert res["parameters"]["total"] == bt.parameter_counts(p)["total"]


def test_plan_only_and_bad_sizes(bt, tmp_path, capsys):
    out = tmp_path / "p.json"
    code, stdout, _ = run_tool(bt, capsys, "--device", "cpu", "--preset", "kimi48b-layers", "--layers", "4",
                               "--plan-only", "--schemes", "step-wise", "--num-tasks", "1", "--max-tokens", "8192",
                               "--microbatch-tokens", "16384", "--tree-sharing", "within", "windows", "--out", out)
    assert code in (0, None)
    res = json.loads(out.read_text())
    assert res["model"]["layers"] == 4 and res["preset_stands_for"]["model"] == "moonshotai/Kimi-Linear-48B-A3B"
    row = res["schemes"]["step-wise"]
    assert set(row) == {"forest", "tree_within", "tree_windows", "expanded"}
    assert row["expanded"]["rows"] == row["forest"]["expanded_tokens"] > row["tree_within"]["rows"]
    assert 0 < row["tree_within"]["memory_estimate_gib"]["total"] < 139
    code, _, err = run_tool(bt, capsys, "--device", "cpu", "--preset", "tiny", "--layers", "6", "--plan-only")
    assert_one_error(code, err, "--layers 6")
    code, _, err = run_tool(bt, capsys, "--device", "cpu", "--preset", "tiny", "--branch-prob", "1.5", "--plan-only")
    assert_one_error(code, err, "--branch-prob 1.5")
    # trajectories longer than the row budget are planned in pieces
    code, _, err = run_tool(bt, capsys, "--device", "cpu", "--preset", "tiny", "--plan-only", "--schemes", "step-wise",
                            "--num-tasks", "1", "--max-tokens", "4096", "--microbatch-tokens", "1024", "--out", out)
    assert code in (0, None), err
    row = json.loads(out.read_text())["schemes"]["step-wise"]
    assert row["forest"]["max_trajectory_tokens"] > 1024
    assert row["tree_within"]["rows"] >= row["forest"]["unique_tokens"]


def test_documented_plan_of_a_128k_batch(bt, tmp_path, capsys):
    """docs/benchmarks.md's --plan-only command, as written there (its --out under tmp), and the figures
    the text quotes: Step-wise in 4 pieces against 40 expanded microbatches."""
    import os
    import re
    import shlex
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(root, "docs", "benchmarks.md")).read()
    (cmd,) = [c for c in re.findall(r"```bash\n(.*?)```", text, re.S) if "--max-tokens 131072" in c and "--plan-only" in c]
    argv = shlex.split(cmd.replace("\\\n", " "))
    assert argv[:3] == ["python", "benchmarks/bench_throughput.py", "--preset"]
    argv = argv[2:]
    argv[argv.index("--out") + 1] = str(tmp_path / "plan.json")
    code, _, err = run_tool(bt, capsys, "--device", "cpu", *argv)
    assert code in (0, None), err
    row = json.loads((tmp_path / "plan.json").read_text())["schemes"]["step-wise"]
    assert row["forest"]["max_trajectory_tokens"] > 2 * 32768
    assert (row["tree_within"]["microbatches"], row["expanded"]["microbatches"]) == (4, 40)
    assert (row["tree_within"]["rows"], row["expanded"]["rows"]) == (126623, 1051113)
    assert row["tree_within"]["largest_microbatch_rows"] <= 32768


def test_warmup_forest_adds_a_fork_of_the_longest_trajectory(bt):
    forest = bt.synthesize("tree-step", 1, 2048, bt.PRESETS["tiny"]["vocab"], seed=0, samples_per_task=3)
    longest = int(np.argmax(forest.traj_length))
    warm = bt.warmup_forest(forest, 1)
    assert warm.num_trajectories == 2 and int(warm.traj_length.max()) == int(forest.traj_length[longest])
    assert warm.num_trees == 1 and any(len(warm.children(s)) == 2 for s in range(warm.num_segments))
    chain = bt.synthesize("step-wise", 1, 2048, bt.PRESETS["tiny"]["vocab"], seed=0, samples_per_task=1)
    assert chain.num_trajectories == 3
    assert bt.warmup_forest(chain, 1).num_trajectories == 1     # one sample's steps are prefixes: no fork to add


def test_warmup_trajectories_train_the_longest_then_the_whole_batch(bt, tmp_path, capsys):
    code, _, err = run_tool(bt, capsys, "--device", "cpu", "--preset", "tiny", "--warmup-trajectories", "0")
    assert_one_error(code, err, "--warmup-trajectories 0")
    forest = bt.synthesize("step-wise", 1, 2048, bt.PRESETS["tiny"]["vocab"], seed=0, samples_per_task=1)
    assert forest.num_trajectories == 3
    warm = bt.warmup_forest(forest, 1)
    assert warm.num_trajectories == 1 and int(warm.traj_length[0]) == int(forest.traj_length.max())
    assert bt.warmup_forest(forest, None) is forest and bt.warmup_forest(forest, 10 ** 6) is forest
    runs = {}
    for k in (None, 1):
        out = tmp_path / f"w{k}.json"
        bt.main(["--device", "cpu", "--preset", "tiny", "--schemes", "step-wise", "--num-tasks", "1", "--max-tokens",
                 "2048", "--samples-per-task", "1", "--microbatch-tokens", "1024", "--iters", "1", "--warmup", "1", "--no-cosine",
                 "--tree-sharing", "within", "--kda-backend", "reference", "--attention-backend", "reference",
                 "--out", str(out)] + ([] if k is None else ["--warmup-trajectories", str(k)]))
        runs[k] = json.loads(out.read_text())["schemes"]["step-wise"]
    for mode in ("tree_within", "expanded"):
        full, part = runs[None][mode]["loss_per_step"], runs[1][mode]["loss_per_step"]
        assert part[0] != pytest.approx(full[0])          # the warm-up step trained one trajectory
        assert runs[1][mode]["rows_computed"] == runs[None][mode]["rows_computed"]
