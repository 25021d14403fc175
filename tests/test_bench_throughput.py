"""benchmarks/bench_throughput.py on the CPU: its fidelity sample and a tiny run's record.

The logit-cosine sample (``cosine_sample``) stays within its token cap and keeps shared tokens,
a branch point and targets: the first trajectories of the smallest tree when they fit, else the first trajectory
and the one leaving its path earliest, cut to half the cap each (the fork survives when their
shared prefix is shorter than that: the SWE-like prompts, ~3k tokens, under an 8k cap).  A tiny CPU run records, per
mode, the loss and gradient norm of every step (the first at the same initial weights in every
mode) and each mode's gradients against the fp32 oracle.  No wall-clock time is asserted.
"""
import json
import re

import numpy as np
import pytest
import torch

from tool_runner import assert_one_error, load_tool, run_tool


@pytest.fixture(scope="module")
def bt():
    return load_tool("bench_throughput", "benchmarks")


@pytest.mark.parametrize("scheme,samples,max_tokens,cap", [("tree-step", 8, 8192, 8192), ("tree-step", 2, 512, 4096),
                                                           ("step-wise", 2, 2048, 1024)])
def test_cosine_sample_within_cap_with_a_fork_and_targets(bt, scheme, samples, max_tokens, cap):
    forest = bt.synthesize(scheme, 1, max_tokens, 512, seed=0, samples_per_task=samples)
    sample = bt.cosine_sample(forest, cap)
    stats = sample.stats()
    # shared tokens and a branch point: a fork (Tree-Step) or a trajectory ending inside another's path
    assert sample.num_trajectories >= 2 and stats["num_segments"] >= 2 and stats["compression"] > 1
    if scheme == "tree-step":
        assert stats["num_segments"] >= 3
    assert all(np.asarray(sample.expand(t).loss_mask)[1:].any() for t in sample.traj_ids)
    if stats["expanded_tokens"] > cap:       # only where cutting would drop a trajectory's targets
        assert scheme == "step-wise" and sample.num_trajectories == 2
    first = forest.expand(forest.traj_ids[0])
    assert np.array_equal(sample.expand(sample.traj_ids[0]).tokens, first.tokens[:len(sample.expand(
        sample.traj_ids[0]).tokens)])


def test_tiny_cpu_run_records_losses_norms_and_gradient_fidelity(bt, tmp_path):
    out = tmp_path / "t.json"
    bt.main(["--device", "cpu", "--preset", "tiny", "--schemes", "step-wise", "--num-tasks", "1",
             "--max-tokens", "256", "--microbatch-tokens", "1024", "--iters", "1", "--tree-sharing", "within",
             "--kda-backend", "reference", "--attention-backend", "reference", "--peer", "--out", str(out)])
    row = json.loads(out.read_text())["schemes"]["step-wise"]
    tree, exp = row["tree_within"], row["expanded"]
    peer = row["peer_transformers"]                 # the peer trained the same batch, from its own weights
    assert peer["rows_computed"] == exp["rows_computed"] and len(peer["loss_per_step"]) == 2
    assert peer["implementation"]["experts"] == "eager"
    for m in (tree, exp):
        assert m["tokens_per_s_over_peer"] == m["trajectory_tokens_per_s"] / peer["trajectory_tokens_per_s"]
    for m in (tree, exp):
        assert len(m["loss_per_step"]) == len(m["grad_norm_per_step"]) == 2
        assert all(g > 0 for g in m["grad_norm_per_step"])
    assert abs(tree["loss_per_step"][0] - exp["loss_per_step"][0]) < 1e-5           # the same initial weights
    assert abs(tree["grad_norm_per_step"][0] - exp["grad_norm_per_step"][0]) < 1e-4 * exp["grad_norm_per_step"][0]
    for who in ("tree", "expanded"):           # fp32 on the CPU: gradients are the oracle's to rounding
        assert row[f"sign_step_alignment_{who}_vs_fp32"] > 0.999
        assert row[f"max_grad_rel_diff_{who}_vs_fp32"] < 1e-3
    assert row["bf16_rule_failed"] == [] and row["logit_cosine_tree_vs_fp32"] >= row["bf16_min_logit_cosine"]
    per_layer = row["bf16_per_layer"]       # fp32 here: every layer at the oracle to rounding, no routing flip
    for who in ("tree", "expanded"):
        assert [e["layer"] for e in per_layer[who]] == [0, 1, 2, 3, "logits"]
        assert all(e["output"] < 1e-4 and e.get("routing_flips", 0.0) == 0.0 for e in per_layer[who])


def test_tiny_cpu_run_with_recomputed_producers(bt, tmp_path):
    out = tmp_path / "t.json"
    bt.main(["--device", "cpu", "--preset", "tiny", "--schemes", "tree-step", "--num-tasks", "1", "--samples-per-task",
             "4", "--max-tokens", "512", "--microbatch-tokens", "512", "--iters", "1", "--tree-sharing", "windows",
             "--recompute-producers", "--keep-producers", "--no-cosine", "--kda-backend", "reference",
             "--attention-backend", "reference", "--out", str(out)])
    row = json.loads(out.read_text())["schemes"]["tree-step"]
    win, rec, keep = row["tree_windows"], row["tree_windows_recompute_producers"], row["tree_windows_keep_producers"]
    assert win["windows"] > 0 and rec["windows"] == win["windows"] == keep["windows"]
    for other in (rec, keep):
        assert other["loss_per_step"] == win["loss_per_step"] and other["grad_norm_per_step"] == win["grad_norm_per_step"]
        assert other["kda_calls"] == win["kda_calls"] and "speedup" in other
    # the memory figures of every mode: predicted from the model, measured only on CUDA
    assert (rec["recomputed_windows"], keep["recomputed_windows"]) == (win["windows"], 0)
    assert 0 <= win["recomputed_windows"] <= win["windows"] and win["memory_budget_gib"] > 0
    assert rec["predicted_peak_gib"] <= win["predicted_peak_gib"] <= keep["predicted_peak_gib"]
    assert all(row[k]["measured_peak_gib"] is None and row[k]["alloc_retries"] is None
               and row[k]["predicted_peak_gib"] > 0 for k in ("tree_windows", "expanded"))


def test_kernel_categories_count_each_kernel_once(bt):
    """A host-side record carrying its kernels' device time (a custom Function, FlexAttention's
    launcher under the kernel's own name) is not counted beside the kernels themselves, nor a
    ``record_function`` range's annotation on the GPU's timeline (``harts.kda`` would land in the KDA
    category by its name, ``harts.pieces_extra_forward`` in ``other``)."""
    from types import SimpleNamespace
    from torch.autograd import DeviceType

    def ev(key, device, us, count=1, annotation=False):
        return SimpleNamespace(key=key, device_type=device, self_device_time_total=us, count=count,
                               is_user_annotation=annotation)
    events = [ev("harts.kda", DeviceType.CUDA, 9000.0, 2, annotation=True),
              ev("harts.pieces_extra_forward", DeviceType.CUDA, 4000.0, 1, annotation=True),
              ev("harts.attention", DeviceType.CUDA, 800.0),          # an older profiler without the flag
              ev("triton_tem_fused_flex_attention_backward_1", DeviceType.CPU, 5000.0),
              ev("triton_tem_fused_flex_attention_backward_1", DeviceType.CUDA, 5000.0, 2),
              ev("_ChunkKdaExportBackward", DeviceType.CPU, 3000.0),
              ev("chunk_kda_bwd_kernel_intra", DeviceType.CUDA, 3000.0, 3),
              ev("aten::mm", DeviceType.CPU, 700.0),
              ev("nvjet_sm90_tst_128x256", DeviceType.CUDA, 700.0, 4),
              ev("cudaLaunchKernel", DeviceType.CPU, 0.0, 9)]
    cats = bt.kernel_categories(events)
    assert cats == {"attention": {"seconds": 0.005, "launches": 2}, "kda": {"seconds": 0.003, "launches": 3},
                    "gemm": {"seconds": 0.0007, "launches": 4}}


def test_live_at_peak_sums_the_blocks_alive_at_the_trace_peak_by_site(bt):
    """The peak is the trace's highest point above its start; the blocks alive there are summed by
    their innermost project frames (megatron-core's named with the model code that called it);
    a free of a block from before the trace and blocks freed before the peak do not count."""
    def fr(path, line, name):
        return {"filename": path, "line": line, "name": name}
    kda = [fr("/x/torch/functional.py", 9, "f"), fr("/s/site/megatron_harts/ops/kda.py", 10, "fwd")]
    lin = [fr("/s/site/megatron/core/layers.py", 5, "linear"), fr("/s/site/megatron_harts/models/mla.py", 7, "q")]
    trace = [{"action": "free_requested", "addr": 99, "size": 1000},        # allocated before the trace
             {"action": "alloc", "addr": 1, "size": 100, "frames": kda},
             {"action": "alloc", "addr": 2, "size": 300, "frames": lin},
             {"action": "free_requested", "addr": 2, "size": 300},
             {"action": "alloc", "addr": 3, "size": 50, "frames": lin},
             {"action": "alloc", "addr": 4, "size": 200, "frames": []},
             {"action": "free_requested", "addr": 1, "size": 100},
             {"action": "alloc", "addr": 5, "size": 10, "frames": kda}]
    out = bt.live_at_peak(trace, top=2)
    assert out["peak_bytes"] == 400 and out["peak_event"] == 2 and out["peak_site"] == next(iter(out["sites"]))
    assert out["blocks"]["megatron_harts/ops/kda.py:10 (fwd)"] == {100: 1}
    assert out["sites"] == {"megatron/core/layers.py:5 (linear) via megatron_harts/models/mla.py:7 (q)": 300,
                            "megatron_harts/ops/kda.py:10 (fwd)": 100}
    later = bt.live_at_peak(trace[:2] + trace[3:], top=1)      # block 2 never allocated: peak after block 4
    assert later["peak_bytes"] == 350 and later["peak_event"] == 4
    assert later["sites"] == {"(no project frame)": 200, "(other sites)": 150}
    deeper = bt.live_at_peak(trace, top=2, depth=2)            # a helper's site names its caller
    assert set(deeper["sites"]) == {"megatron/core/layers.py:5 (linear) < megatron_harts/models/mla.py:7 (q)",
                                    "megatron_harts/ops/kda.py:10 (fwd)"}


def test_op_sites_count_and_time_each_operator_at_its_innermost_project_frame(bt, tmp_path):
    """Operators are counted where project code (a megatron_harts or megatron file) called them, the
    operators an operator dispatches inside it not again; the text tables name each site's operators
    by count and the (site, operator) pairs by host time."""
    import torch
    pkg = tmp_path / "megatron_harts"
    pkg.mkdir()
    (pkg / "fake_step.py").write_text("def step(x):\n    y = x.index_select(0, x.new_zeros(2, dtype=int))\n"
                                      "    return (y * 2).sum()\n")
    import importlib.util
    spec = importlib.util.spec_from_file_location("fake_step", pkg / "fake_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    class Trainer:
        def step(self, forest):
            return mod.step(forest) + forest.sum()          # the last operator's frame is this test's
    sites = bt.op_sites(Trainer(), torch.ones(4))
    here = {op: v for (site, op), v in sites.items() if site.endswith("fake_step.py:2 (step)")}
    assert set(here) == {"new_zeros", "index_select"} and all(n == 1 and sec >= 0 for n, sec in here.values())
    assert {op for (site, op) in sites if site.endswith("fake_step.py:3 (step)")} == {"mul", "sum"}
    assert sites[("(no project frame)", "add")][0] == 1
    text = bt.op_site_tables(sites, top=2)
    lines = text.splitlines()
    assert lines[0].split()[0] == "2" and "fake_step.py" in lines[0] and lines[2] == "" and len(lines) == 6
    assert all(line.split()[1] == "ms" and line.split()[2] == "1" for line in lines[4:])


def test_op_stacks_group_an_operators_calls_by_python_stack(bt):
    """--profile-op-stacks' table: an operator's calls grouped by their Python frames (object addresses
    dropped, so repeated calls from one line group together), most frequent first."""
    import torch

    def inner(x):
        return x.index_select(0, torch.zeros(2, dtype=torch.long))

    def outer(x):
        return inner(x) + inner(x) + inner(x)      # one stack, three calls

    class Trainer:
        def step(self, forest):
            x = forest.clone().requires_grad_()
            torch.gather(x, 0, torch.zeros(1, 2, dtype=torch.long)).sum().backward()
            return outer(forest).sum() + forest.index_select(0, torch.ones(1, dtype=torch.long)).sum()

    text = bt.op_stacks(Trainer(), torch.ones(4, 2), ["aten::index_select", "aten::scatter_add_", "aten::cumsum"])
    lines = text.splitlines()
    assert lines[0] == "aten::index_select: 4 calls, 2 distinct stacks"
    assert lines[1].split()[0] == "3" and " at 0x" not in text
    assert "index_select" in lines[1] and lines[2].endswith(": inner") and lines[3].endswith(": outer")
    assert "shapes: [[4, 2], [], [2]]" in text
    # a backward's operator: the autograd node that runs it names the forward operator
    scatter = text[text.index("aten::scatter_add_:"):text.index("aten::cumsum:")].splitlines()
    assert scatter[0].startswith("aten::scatter_add_: 1 calls") and "GatherBackward0" in scatter[-2]
    assert "aten::cumsum: 0 calls, 0 distinct stacks" in text


def test_profile_op_stacks_needs_profile(bt):
    with pytest.raises(SystemExit):
        bt.main(["--device", "cpu", "--preset", "tiny", "--profile-op-stacks", "aten::gather"])


def test_out_of_gpu_memory_is_one_error_line(bt, tmp_path, capsys, monkeypatch):
    """A preset larger than the GPU (kimi48b-layers on an 80 GB card): the mode that runs out of memory is
    named in one error line, exit status 2, the modes measured before it kept in the output file."""
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 18.00 MiB.\nmore detail")
    monkeypatch.setattr(bt, "run_mode", out_of_memory)
    out = tmp_path / "t.json"
    code, _, err = run_tool(bt, capsys, "--device", "cpu", "--preset", "tiny", "--schemes", "step-wise",
                            "--num-tasks", "1", "--max-tokens", "256", "--microbatch-tokens", "1024", "--iters", "1",
                            "--tree-sharing", "within", "--no-cosine", "--out", out)
    assert_one_error(code, err, "--preset tiny: step-wise tree_within ran out of memory")
    assert "Tried to allocate 18.00 MiB" in err and str(out) in err
