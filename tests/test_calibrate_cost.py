"""benchmarks/calibrate_cost.py: the GPU calibration run of the planner's cost model, on the CPU.

Pinned here: a real (tiny, CPU) run writes a calibration file that ``load_calibration`` reads,
with finite non-negative coefficients and, per sample, the plan's features of the microbatch
that ran; with the timer replaced by a synthetic linear cost computed from each executed
microbatch's own layout (independently of the plan), the fit recovers the cost's
coefficients, which holds only if every time is paired with the features of the microbatch
that produced it; bad input is one ``error:`` line and exit status 2.  No wall-clock time is
asserted.
"""
import json
import math
import os
from dataclasses import asdict
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest

from megatron_harts.planner.cost_model import COEFFICIENT_NAMES, CostFeatures, CostModel, load_calibration
from tool_runner import load_tool, run_tool


@pytest.fixture(scope="module")
def cc():
    return load_tool("calibrate_cost", "benchmarks")


def executed_vector(item) -> np.ndarray:
    """The six cost features of an executed microbatch, from its layout alone (not the plan):
    rows, attention pairs (a row at position p sees p + 1 keys), KDA calls and replay of the
    call planner on the layout's segments (packed trajectories: one call, no replay), rows
    that carry a target."""
    from megatron_harts.layout import ExpandedBatch
    from megatron_harts.planner.calls import plan_calls
    lay = item.layout
    if isinstance(lay, ExpandedBatch):
        calls, replay = 1, 0
    else:
        p = plan_calls(lay.seg_parent, lay.seg_start, lay.seg_length, 64)
        calls, replay = p.num_calls, p.replay_tokens
    return np.array([1, int(lay.num_rows), int((lay.position_ids.long() + 1).sum()), calls, replay,
                     int(np.unique(lay.target_row.numpy()).size)], dtype=np.float64)


def one_error(code, err, *needles):
    """Exit status 2, exactly one ``error:`` line naming every needle, no traceback (megatron's
    import-time warnings may precede it on stderr)."""
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in errors[0], (n, errors[0])


def test_cpu_smoke_run_writes_a_calibration_the_planner_reads(cc, tmp_path, capsys):
    from megatron_harts.training.step import SharingSettings, plan_step
    out = tmp_path / "cal.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--schemes", "step-wise", "--num-tasks", "1", "--max-tokens", "128",
            "--budgets", "128", "256", "512", "--repeat", "1", "--out", out, "--json"]
    code, stdout, _ = run_tool(cc, capsys, *argv)
    assert code == 0
    res = json.loads(stdout)
    model = load_calibration(str(out))
    assert model.chunk_size == 64 == res["chunk_size"]
    coef = asdict(model.coefficients)
    assert set(coef) == set(COEFFICIENT_NAMES) and coef == res["coefficients"]
    assert all(math.isfinite(v) and v >= 0 for v in coef.values()) and coef["row"] > 0
    src = model.source
    assert src["preset"] == "tiny" and src["budgets"] == [128, 256, 512] and src["schemes"] == ["step-wise"]
    assert {"device", "torch", "megatron_core", "fla", "r2"} <= set(src)
    ms = src["measurements"]
    assert src["samples"] == len(ms) >= 6
    # each sample: the plan's features of the microbatch run, replica 0's slot order, per step
    forest = cc.synthesize("step-wise", 1, 128, cc.PRESETS["tiny"]["vocab"], seed=0)
    for budget in (128, 256, 512):
        for sharing in ("within", "off"):
            plan = plan_step(forest, SharingSettings(sharing=sharing, microbatch_tokens=budget,
                                                     cost_model=CostModel(chunk_size=64)), 1)
            want = [(m.index, asdict(m.features)) for m in plan.schedule(0) if m is not None]
            got = [(m["microbatch"], m["features"]) for m in ms if m["budget"] == budget and m["sharing"] == sharing]
            assert got == want and want
    assert all(m["features_from_plan"] for m in ms)
    for m in ms:
        assert len(m["runs"]) == 1 and m["seconds"] == m["runs"][0] > 0
        assert m["predicted"] == pytest.approx(model.cost(CostFeatures(**m["features"])))


def test_fit_recovers_a_synthetic_linear_cost(cc, tmp_path, capsys):
    truth = np.array([2e-2, 4.5e-5, 1.4e-9, 6e-3, 9e-6, 5.7e-6])
    seen = []

    def synthetic(run_once, item):       # no model run: the cost of what the item's layout holds
        v = executed_vector(item)
        seen.append(v)
        return float(truth @ v)

    out = tmp_path / "cal.json"
    tool = SimpleNamespace(main=partial(cc.main, timer=synthetic))
    code, stdout, _ = run_tool(tool, capsys, "--preset", "tiny", "--device", "cpu", "--schemes", "tree-step",
                               "--num-tasks", "1", "--max-tokens", "4096", "--budgets", "4096", "8192",
                               "--repeat", "2", "--out", out)
    assert code == 0 and "R^2" in stdout and str(out) in stdout
    model = load_calibration(str(out))
    ms = model.source["measurements"]
    assert len(seen) == 3 * len(ms)                  # one warm-up and two timed runs each
    X = np.array([[1] + [m["features"][k] for k in ("rows", "attention_pairs", "kda_calls", "replay_tokens",
                                                     "logits_rows")] for m in ms], dtype=np.float64)
    assert np.linalg.matrix_rank(X / np.maximum(X.max(axis=0), 1)) == 6     # every coefficient identifiable
    np.testing.assert_array_equal(np.array(seen[::3]), X)                   # time k is microbatch k's
    np.testing.assert_allclose(model.coefficients.vector(), truth, rtol=1e-6)
    assert model.source["r2"] == pytest.approx(1.0)
    for m in ms:
        assert m["predicted"] == pytest.approx(m["seconds"], rel=1e-9)


def test_bad_input_is_one_error_line(cc, tmp_path, capsys):
    base = ["--preset", "tiny", "--device", "cpu", "--schemes", "step-wise", "--num-tasks", "1", "--max-tokens", "128"]
    code, _, err = run_tool(cc, capsys, *base, "--budgets", "64", "--out", tmp_path / "a.json")
    one_error(code, err, "--budgets 64", "longest step-wise trajectory")
    code, _, err = run_tool(cc, capsys, *base, "--repeat", "0")
    one_error(code, err, "--repeat")
    code, _, err = run_tool(cc, capsys, *base, "--out", tmp_path / "missing" / "a.json")
    one_error(code, err, "--out", "does not exist")
    tool = SimpleNamespace(main=partial(cc.main, timer=lambda run_once, item: 1e-3 * item.layout.num_rows))
    code, _, err = run_tool(tool, capsys, *base, "--budgets", "256", "--out", tmp_path / "b.json")
    one_error(code, err, "microbatches were measured", "at least 6")
    assert not os.path.exists(tmp_path / "a.json") and not os.path.exists(tmp_path / "b.json")
