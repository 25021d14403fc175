"""tools/plan_report.py: metrics of every planner, JSON keys, PNG plot, bad input, no OR-Tools, no matplotlib."""
import importlib.util
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from megatron_harts.tree_data import build_forest, write_jsonl
from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "plan_report.py")
PLANNERS = ("harts_l1", "harts_l1l2", "ffd", "tree_ffd", "ortools_ffd")


def load_tool():
    spec = importlib.util.spec_from_file_location("plan_report_tool", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    trajs = synthesize_swe(SweConfig(num_tasks=3, samples_per_task=3, prompt_median=400, max_tokens=2500,
                                     action_median=60, observation_median=100, branch_prob=0.5, seed=5))
    path = str(tmp_path_factory.mktemp("report") / "r.jsonl")
    write_jsonl(trajs, path)
    return path, build_forest(trajs)


def run_main(capsys, *args):
    code = load_tool().main(list(args))
    out = capsys.readouterr()
    return code, out.out


def test_json_every_planner(rollouts, capsys):
    path, forest = rollouts
    M = int(forest.traj_length.max()) + 200
    code, out = run_main(capsys, "--input", path, "--dp", "2", "--microbatch-tokens", str(M), "--json",
                         "--ortools-time-limit", "1")
    assert code == 0
    data = json.loads(out)
    assert set(data) == set(PLANNERS)
    for name in PLANNERS:
        r = data[name]
        if not r["available"]:
            assert name == "ortools_ffd"
            continue
        for key in ("compression", "balance_mean", "balance_p5", "step_min_balance", "microbatches",
                    "plan_seconds"):
            assert key in r
        assert 0 < r["balance_p5"] <= 1 and 0 < r["balance_mean"] <= 1 and r["peak_rows"] <= M
    assert data["ffd"]["compression"] == pytest.approx(1.0)
    assert data["harts_l1l2"]["compression"] >= data["harts_l1"]["compression"]
    assert data["harts_l1l2"]["compression"] <= forest.stats()["compression"]


def test_table_and_plot(rollouts, capsys, tmp_path):
    pytest.importorskip("matplotlib", reason='--plot needs matplotlib, the optional extra "plot"')
    from matplotlib.image import imread
    path, forest = rollouts
    png = str(tmp_path / "plan.png")
    M = int(forest.traj_length.max()) + 200
    code, out = run_main(capsys, "--input", path, "--dp", "3", "--microbatch-tokens", str(M), "--plot", png,
                         "--ortools-time-limit", "1")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["planner", "compression"]
    assert [ln.split()[0] for ln in lines[2:-1]] == list(PLANNERS)
    assert lines[-1] == f"wrote {png}"
    with open(png, "rb") as fh:
        data = fh.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    w, h = struct.unpack(">II", data[16:24])
    assert 600 <= w <= 4000 and 300 <= h <= 2000 and len(data) > 10_000, (w, h, len(data))
    assert not [f for f in os.listdir(tmp_path) if f != "plan.png"]        # no temporary file left
    img = np.rint(imread(png)[..., :3] * 255).astype(np.int64)
    assert img.shape[:2] == (h, w)
    colors = {tuple(c) for c in img.reshape(-1, 3).tolist()}
    tool = load_tool()
    assert tool.PRODUCER in colors and tool.CONSUMER in colors  # the L1+L2 plan shares prefixes
    # with --json, stdout stays one JSON document and the note goes to stderr
    code = load_tool().main(["--input", path, "--dp", "3", "--microbatch-tokens", str(M), "--plot", png, "--json",
                             "--ortools-time-limit", "0.2"])
    out = capsys.readouterr()
    assert code == 0 and set(json.loads(out.out)) == set(PLANNERS) and out.err.strip() == f"wrote {png}"


def test_plot_without_matplotlib(rollouts, capsys, monkeypatch, tmp_path):
    """One error line naming the extra to install, exit status 2, before any planning or output."""
    from megatron_harts.cli import run
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.patches"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    path, forest = rollouts
    png = str(tmp_path / "plan.png")
    with pytest.raises(SystemExit) as e:
        run(load_tool().main, ["--input", path, "--dp", "2", "--microbatch-tokens", "99999", "--plot", png])
    out = capsys.readouterr()
    assert e.value.code == 2 and out.out == ""
    err = out.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --plot ") and 'pip install -e ".[plot]"' in err[0], err
    assert "matplotlib" in err[0] and not os.path.exists(png)
    with pytest.raises(SystemExit) as e:
        run(load_tool().main, ["--input", path, "--dp", "2", "--microbatch-tokens", "99999", "--plot",
                               str(tmp_path / "no" / "plan.png")])
    assert e.value.code == 2 and "--plot" in capsys.readouterr().err


def test_budget_too_small_is_refused(rollouts):
    path, forest = rollouts
    longest = int(forest.traj_length.max())
    r = subprocess.run([sys.executable, TOOL, "--input", path, "--dp", "2", "--microbatch-tokens",
                        str(longest - 1)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and r.stdout == ""
    line = r.stderr.strip()
    assert line.startswith("error:") and "\n" not in line
    assert "tree" in line and f"budget {longest - 1}" in line and str(longest) in line


def test_bad_calibration_is_refused(rollouts, tmp_path):
    path, forest = rollouts
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"format": "megatron_harts.cost_calibration", "version": 1}))
    r = subprocess.run([sys.executable, TOOL, "--input", path, "--dp", "1", "--microbatch-tokens", "99999",
                        "--calibration", str(cal)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "error:" in r.stderr and str(cal) in r.stderr and "unit" in r.stderr


def test_without_ortools(rollouts, capsys, monkeypatch):
    path, forest = rollouts
    for name in ("ortools", "ortools.sat", "ortools.sat.python", "ortools.sat.python.cp_model"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    M = int(forest.traj_length.max())
    code, out = run_main(capsys, "--input", path, "--dp", "2", "--microbatch-tokens", str(M), "--json")
    assert code == 0
    data = json.loads(out)
    assert data["ortools_ffd"]["available"] is False and "OR-Tools" in data["ortools_ffd"]["reason"]
    assert data["tree_ffd"]["available"] is True
    code, out = run_main(capsys, "--input", path, "--dp", "2", "--microbatch-tokens", str(M))
    assert code == 0 and any(ln.split()[:2] == ["ortools_ffd", "unavailable"] for ln in out.splitlines())
