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
