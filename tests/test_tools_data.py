"""The data CLIs: --help, --json, exit status 2 with one line and no partial output on bad input."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tool(name, *args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", name), *args], capture_output=True,
                          text=True, cwd=ROOT)


@pytest.mark.parametrize("name", ["convert_trajectories.py", "tree_stats.py", "synthesize_rollouts.py"])
def test_help(name):
    r = tool(name, "--help")
    assert r.returncode == 0 and "usage" in r.stdout


def test_synthesize_convert_stats(tmp_path):
    src = str(tmp_path / "r.jsonl")
    r = tool("synthesize_rollouts.py", "--output", src, "--num-tasks", "2", "--samples-per-task", "2",
             "--prompt-median", "200", "--max-tokens", "3000", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["trajectories"] > 0
    r = tool("convert_trajectories.py", "--input", src, "--output", str(tmp_path / "ds"), "--json", "--workers", "2")
    assert r.returncode == 0, r.stderr
    conv = json.loads(r.stdout)
    r1 = tool("tree_stats.py", "--input", src, "--json")
    r2 = tool("tree_stats.py", "--input", str(tmp_path / "ds"), "--json")
    assert r1.returncode == r2.returncode == 0
    assert json.loads(r1.stdout) == json.loads(r2.stdout) == conv
    assert set(conv) == {"num_trajectories", "num_trees", "num_segments", "expanded_tokens", "unique_tokens",
                         "compression", "max_depth", "max_trajectory_tokens", "compaction_events",
                         "compaction_events_tree", "visible_pairs_tree", "visible_pairs_expanded"}
    r = tool("tree_stats.py", "--input", src)
    assert r.returncode == 0 and "compression" in r.stdout


def test_bad_input_exit_2_no_output(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"id": "a", "tokens": [1, 2]}\n{"id": "b", "tokens": [1, 2], "loss_mask": [0]}\n')
    r = tool("convert_trajectories.py", "--input", str(src), "--output", str(tmp_path / "ds"))
    assert r.returncode == 2
    err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "bad.jsonl:2" in err[0] and "'b'" in err[0] and "loss_mask" in err[0]
    assert "Traceback" not in r.stderr
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]


def test_vocab_size_flag(tmp_path):
    src = tmp_path / "v.jsonl"
    src.write_text('{"id": "a", "tokens": [1, 200]}\n')
    r = tool("convert_trajectories.py", "--input", str(src), "--output", str(tmp_path / "ds"), "--vocab-size", "100")
    assert r.returncode == 2 and "--vocab-size 100" in r.stderr and "Traceback" not in r.stderr


def test_bad_flags(tmp_path):
    r = tool("convert_trajectories.py", "--input", "x.jsonl", "--output", str(tmp_path / "nodir" / "ds"))
    assert r.returncode == 2 and "--output" in r.stderr and "Traceback" not in r.stderr
    r = tool("synthesize_rollouts.py", "--output", str(tmp_path / "x.jsonl"), "--branch-prob", "2")
    assert r.returncode == 2 and "branch" in r.stderr and "Traceback" not in r.stderr


def test_missing_file(tmp_path):
    r = tool("tree_stats.py", "--input", str(tmp_path / "nope.jsonl"))
    assert r.returncode == 2 and "nope.jsonl" in r.stderr and "Traceback" not in r.stderr


def test_example_inspect_rollouts(tmp_path):
    src = str(tmp_path / "r.jsonl")
    assert tool("synthesize_rollouts.py", "--output", src, "--num-tasks", "1", "--samples-per-task", "2",
                "--prompt-median", "100", "--max-tokens", "2000").returncode == 0
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "inspect_rollouts.py"), src],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "trajectories in 1 trees" in r.stdout and "segment 0" in r.stdout


def test_compaction_synthesize_convert_stats(tmp_path):
    src = str(tmp_path / "c.jsonl")
    r = tool("synthesize_rollouts.py", "--output", src, "--scheme", "step-wise", "--num-tasks", "2",
             "--samples-per-task", "2", "--prompt-median", "200", "--max-tokens", "3000", "--compaction",
             "sliding-window", "--context-budget", "600", "--keep-prefix", "32", "--evict-chunk", "100", "--json")
    assert r.returncode == 0, r.stderr
    made = json.loads(r.stdout)
    assert made["compaction_events"] > 0 and made["config"]["compaction"] == "sliding-window"
    r = tool("tree_stats.py", "--input", src, "--reprefill", "--json")
    assert r.returncode == 0, r.stderr
    both = json.loads(r.stdout)
    assert set(both) == {"keep", "reprefill", "reprefilled_tokens"}
    keep, rep = both["keep"], both["reprefill"]
    assert keep["compaction_events"] == made["compaction_events"] and rep["compaction_events"] == 0
    assert rep["expanded_tokens"] == keep["expanded_tokens"] + both["reprefilled_tokens"]
    assert both["reprefilled_tokens"] > 0 and set(rep) == set(keep)
    r = tool("convert_trajectories.py", "--input", src, "--output", str(tmp_path / "rp"), "--compaction",
             "reprefill", "--json")
    assert r.returncode == 0, r.stderr
    conv = json.loads(r.stdout)
    assert conv.pop("reprefill") == {"input_trajectories": keep["num_trajectories"],
                                     "input_tokens": keep["expanded_tokens"],
                                     "reprefilled_tokens": both["reprefilled_tokens"]}
    assert conv == rep
    r = tool("tree_stats.py", "--input", str(tmp_path / "rp"), "--json")
    assert json.loads(r.stdout) == rep
    r = tool("convert_trajectories.py", "--input", src, "--output", str(tmp_path / "keep"))
    assert r.returncode == 0 and "compaction events" in r.stdout and "visible pairs" in r.stdout
    r = tool("tree_stats.py", "--input", str(tmp_path / "keep"), "--reprefill")  # a dataset, as a table
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines()[2:]}
    assert rows["reprefilled_tokens"] == ["0", f"{both['reprefilled_tokens']:,}"]
    assert rows["visible_pairs_tree"] == [f"{keep['visible_pairs_tree']:,}", f"{rep['visible_pairs_tree']:,}"]


@pytest.mark.parametrize("name, args, needle", [
    ("synthesize_rollouts.py", ["--context-budget", "0"], "--context-budget"),
    ("synthesize_rollouts.py", ["--compaction", "bogus"], "--compaction"),
    ("synthesize_rollouts.py", ["--compaction", "summary", "--context-budget", "300", "--keep-prefix", "200",
                                "--summary-tokens", "100"], "--summary-tokens"),
    ("convert_trajectories.py", ["--input", "missing.jsonl", "--compaction", "reprefill"], "missing.jsonl"),
    ("convert_trajectories.py", ["--input", "missing.jsonl", "--compaction", "bogus"], "--compaction"),
    ("tree_stats.py", ["--input", "missing.jsonl", "--reprefill"], "missing.jsonl"),
])
def test_compaction_bad_flags(tmp_path, name, args, needle):
    out = ["--output", str(tmp_path / ("o.jsonl" if name.startswith("synth") else "ds"))]
    r = tool(name, *args, *(out if name != "tree_stats.py" else []))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.stderr
    assert os.listdir(tmp_path) == []


def test_reprefill_impossible_target(tmp_path):
    src = tmp_path / "x.jsonl"
    src.write_text('{"id": "x", "tokens": [1, 2, 3], "loss_mask": [0, 0, 1], '
                   '"compactions": [{"at": 2, "start": 0, "end": 2}]}\n')
    r = tool("convert_trajectories.py", "--input", str(src), "--output", str(tmp_path / "ds"), "--compaction",
             "reprefill")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "'x'" in err[0] and "token 2" in err[0]
    assert sorted(os.listdir(tmp_path)) == ["x.jsonl"]


@pytest.mark.parametrize("name, needle", [("synthesize_rollouts.py", "--summary-tokens"),
                                          ("convert_trajectories.py", "ID/r0"), ("tree_stats.py", "--reprefill")])
def test_compaction_help(name, needle):
    r = tool(name, "--help")
    assert r.returncode == 0 and needle in r.stdout
    assert ("--compaction" in r.stdout) == (name != "tree_stats.py")
