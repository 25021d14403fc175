"""Logit probes and run comparison: training/probe.py, training/compare.py,
tools/compare_runs.py.

- end to end (DP=2 gloo, fp64): expanded and windowed tree runs of the driver probe the same tokens;
  their logits agree at iteration 0 and after the last step, their losses agree per iteration, and the
  upcast oracle's probe agrees with both; the probes are not vacuous (the weights moved);
- the sample depends on (trajectory, position) only; shards of a tensor-parallel probe join into
  full vocabulary rows; mismatched runs are refused with the file named.
"""
import json
import os

import numpy as np
import pytest
import torch

from test_training_driver import _world, argv, spawn
from tool_runner import assert_one_error, load_tool, run_tool

from megatron_harts.training.compare import compare_reports, compare_runs, read_report
from megatron_harts.training.probe import (ORACLE_DIR, ProbeError, compare_probes, load_probe, oracle_dtype,
                                           sample_mask, sample_stride)


def _probe_worker(rank, world, port, data, root, out):
    from megatron_harts.training.trainer import Trainer
    _world(rank, world, port)
    for sharing in ("off", "windows"):
        extra = ["--tree-logit-probe", os.path.join(root, sharing), "--tree-logit-probe-tokens", "40",
                 "--tree-plan-report", os.path.join(root, f"{sharing}.jsonl")]
        if sharing == "off":
            extra.append("--tree-logit-probe-oracle")
        with Trainer.from_args(argv(data, sharing, *extra), require_data=True) as t:
            t.train()
    if rank == 0:
        torch.save({}, out)


@pytest.fixture(scope="module")
def probed_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probe")
    root = tmp / "runs"
    root.mkdir()
    spawn(_probe_worker, tmp, str(root))
    return {s: {"report": str(root / f"{s}.jsonl"), "probe": str(root / s)} for s in ("off", "windows")}


def test_tree_and_expanded_probes_agree(probed_runs):
    res = compare_runs(probed_runs["off"], probed_runs["windows"])
    assert sorted(res["probes"]) == [0, 3]
    for it, p in res["probes"].items():
        assert p["tokens"] > 10, (it, p)
        assert 1.0 - p["logit_cosine_min"] <= 1e-12 and p["logit_abs_diff_max"] <= 1e-9, (it, p)
    los = res["losses"]
    assert los["iterations"] == [1, 2, 3] and los["loss_abs_diff_max"] <= 1e-10
    # not vacuous: training moved the logits between the two probes
    a = load_probe(os.path.join(probed_runs["off"]["probe"], "iter_0000000"))
    b = load_probe(os.path.join(probed_runs["off"]["probe"], "iter_0000003"))
    assert set(a) == set(b) and max(float((a[k] - b[k]).abs().max()) for k in a) > 1e-4
    # a sample of the targets, each once, full vocabulary rows
    n_targets = sum(r["target_tokens"] for r in read_report(probed_runs["off"]["report"])[:1])
    assert len(a) < n_targets and all(v.shape == (64,) for v in a.values())


def test_oracle_probe(probed_runs):
    oracle = os.path.join(probed_runs["off"]["probe"], ORACLE_DIR, "iter_0000000")
    assert os.path.isdir(oracle)
    assert not os.path.isdir(os.path.join(probed_runs["windows"]["probe"], ORACLE_DIR))
    for run in ("off", "windows"):
        c = compare_probes(os.path.join(probed_runs[run]["probe"], "iter_0000000"), oracle)
        assert 1.0 - c["logit_cosine_min"] <= 1e-12, c
    assert oracle_dtype(torch.bfloat16) == torch.float32 and oracle_dtype(torch.float32) == torch.float64


def test_compare_runs_cli(probed_runs, capsys):
    tool = load_tool("compare_runs")
    a = f"{probed_runs['off']['report']}:{probed_runs['off']['probe']}"
    b = f"{probed_runs['windows']['report']}:{probed_runs['windows']['probe']}"
    code, out, _ = run_tool(tool, capsys, a, b, "--json")
    assert code == 0
    res = json.loads(out)
    assert res["losses"]["loss_abs_diff_max"] <= 1e-10 and set(res["probes"]) == {"0", "3"}
    code, out, _ = run_tool(tool, capsys, a, b)
    assert code == 0 and "logit cosine mean" in out and "max |loss difference|" in out
    code, _, err = run_tool(tool, capsys, a, "/nonexistent/report.jsonl")
    assert_one_error(code, err, "/nonexistent/report.jsonl")


def test_sample_depends_on_trajectory_and_position_only():
    ids = ["a", "b", "c/1"]
    traj = np.array([0, 0, 1, 2, 2, 2])
    pos = np.array([3, 4, 7, 1, 2, 9])
    m = sample_mask(ids, traj, pos, 3)
    # the same targets listed in another order, under other local trajectory indices
    perm = np.array([5, 2, 0, 4, 1, 3])
    m2 = sample_mask(ids[::-1], (2 - traj)[perm], pos[perm], 3)
    assert np.array_equal(m[perm], m2)
    assert sample_mask(ids, traj, pos, 1).all()
    big = sample_mask([f"t{i}" for i in range(50)], np.repeat(np.arange(50), 200), np.tile(np.arange(200), 50), 10)
    assert 700 < big.sum() < 1300
    assert sample_stride(10_000, 1000) == 10 and sample_stride(5, 1000) == 1


def _write_shard(path, keys, logits, tp_rank, tp_size):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"keys": keys, "logits": logits, "tp_rank": tp_rank, "tp_size": tp_size}, path)


def test_tensor_parallel_shards_join(tmp_path):
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(5, 12, generator=gen, dtype=torch.float64)
    keys = [("t0", 1), ("t0", 2), ("t1", 1), ("t2", 5), ("t2", 6)]
    d = tmp_path / "iter_0000000"
    # data-parallel rank 1 holds keys 0-2, rank 0 keys 3-4; each has both vocabulary halves
    for rank, (rows, tp_rank) in enumerate([([3, 4], 0), ([3, 4], 1), ([0, 1, 2], 0), ([0, 1, 2], 1)]):
        part = full[rows][:, tp_rank * 6:(tp_rank + 1) * 6]
        _write_shard(str(d / f"rank_{rank:05d}.pt"), [keys[r] for r in rows], part, tp_rank, 2)
    got = load_probe(str(d))
    assert set(got) == set(keys)
    for i, k in enumerate(keys):
        assert torch.equal(got[k], full[i])
    c = compare_probes(str(d), str(d))
    assert c["tokens"] == 5 and c["logit_cosine_min"] == pytest.approx(1.0) and c["logit_abs_diff_max"] == 0.0


def test_mismatched_probes_and_reports_are_refused(tmp_path):
    a, b = tmp_path / "a" / "iter_0000000", tmp_path / "b" / "iter_0000000"
    _write_shard(str(a / "rank_00000.pt"), [("t", 1), ("t", 2)], torch.zeros(2, 4), 0, 1)
    _write_shard(str(b / "rank_00000.pt"), [("t", 1), ("u", 2)], torch.zeros(2, 4), 0, 1)
    with pytest.raises(ProbeError, match="probe different tokens"):
        compare_probes(str(a), str(b))
    _write_shard(str(b / "rank_00000.pt"), [("t", 1), ("t", 2)], torch.zeros(2, 4), 0, 2)
    with pytest.raises(ProbeError, match="tensor-parallel ranks"):
        load_probe(str(b))
    (b / "rank_00000.pt").write_bytes(b"not a probe")
    with pytest.raises(ProbeError, match="rank_00000.pt: not a probe file"):
        load_probe(str(b))
    with pytest.raises(ProbeError, match="no probe files"):
        load_probe(str(tmp_path))
    row = {"loss": 1.0, "trajectory_tokens_per_s": 1.0, "step_seconds": 1.0, "computed_tokens_per_s": 1.0,
           "compression": 1.0, "peak_memory_gib": 0.0}
    ra, rb = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    ra.write_text("".join(json.dumps({**row, "iteration": i}) + "\n" for i in (1, 2, 3)))
    rb.write_text("".join(json.dumps({**row, "iteration": i, "loss": 1.5}) + "\n" for i in (1, 2)))
    with pytest.raises(ProbeError, match="not the same run length"):
        compare_reports(str(ra), str(rb))
    rb.write_text(json.dumps({**row, "iteration": 1}) + "\n{oops\n")
    with pytest.raises(ProbeError, match="b.jsonl:2: not JSON"):
        read_report(str(rb))
    rb.write_text("".join(json.dumps({**row, "iteration": i, "loss": 1.5}) + "\n" for i in (1, 2, 3)))
    assert compare_reports(str(ra), str(rb))["loss_abs_diff"] == [0.5, 0.5, 0.5]
