"""tools/plan_calls.py: per-tree and whole-microbatch call figures."""
import json
import os
import subprocess
import sys

from megatron_harts.planner.calls import plan_calls
from megatron_harts.tree_data import build_forest, write_jsonl
from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tool(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan_calls.py"), *args],
                          capture_output=True, text=True, cwd=ROOT)


def test_help():
    r = tool("--help")
    assert r.returncode == 0 and "--chunk-size" in r.stdout


def test_json_figures(tmp_path):
    trajs = synthesize_swe(SweConfig(num_tasks=3, samples_per_task=2, prompt_median=150, max_tokens=3000,
                                     branch_prob=0.6))
    path = str(tmp_path / "r.jsonl")
    write_jsonl(trajs, path)
    r = tool("--input", path, "--chunk-size", "16", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    forest = build_forest(trajs)
    assert out["segments"] == forest.num_segments and len(out["per_tree"]) == forest.num_trees
    per_tree_calls = [plan_calls(forest.tree(i).seg_parent, forest.tree(i).seg_start, forest.tree(i).seg_length,
                                 16).num_calls for i in range(forest.num_trees)]
    assert [t["calls"] for t in out["per_tree"]] == per_tree_calls
    assert out["calls"] == max(per_tree_calls)
    assert out["replay_tokens"] == sum(t["replay_tokens"] for t in out["per_tree"])
    assert out["per_depth_calls"] == max(t["per_depth_calls"] for t in out["per_tree"])
    assert all(t["calls"] <= t["node_wise_calls"] for t in out["per_tree"])
    r = tool("--input", path, "--chunk-size", "16")
    assert r.returncode == 0 and "per-depth" in r.stdout


def test_bad_input(tmp_path):
    r = tool("--input", str(tmp_path / "missing.jsonl"))
    assert r.returncode == 2 and "missing.jsonl" in r.stderr and "Traceback" not in r.stderr
    r = tool("--input", str(tmp_path / "missing.jsonl"), "--chunk-size", "0")
    assert r.returncode == 2 and "--chunk-size" in r.stderr
