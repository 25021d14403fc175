"""bench_tree_attention on compaction traces (CPU smoke run): the pairs it divides by are the
visible ones, in tree and expanded form, and tree attention agrees with expanded attention."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_tree_attention  # noqa: E402



def _args(*extra):
    return ["--device", "cpu", "--rows", "1024", "--dtype", "fp32", "--heads", "2", "--head-dim", "16",
            "--repeats", "1", "--warmup", "0", "--json", *extra]


@pytest.mark.parametrize("scheme", ["step-wise", "tree-step"])
def test_compaction_pairs_are_the_visible_ones(scheme, capsys):
    argv = _args("--scheme", scheme, "--compaction", "sliding-window", "--context-budget", "256")
    report = bench_tree_attention.main(argv)
    forest = bench_tree_attention.compaction_forest(bench_tree_attention.parse_args(argv))
    stats = forest.stats()
    assert report["compaction_events"] == stats["compaction_events"] > 0
    assert report["pairs"]["tree"] == stats["visible_pairs_tree"] < report["pairs"]["causal"]
    assert report["pairs"]["expanded"] == stats["visible_pairs_expanded"]
    for name in ("tree_flex", "tree_varlen", "expanded_flex"):
        key = "expanded" if name.startswith("expanded") else "tree"
        assert report["methods"][name]["pairs"] == report["pairs"][key]
    assert report["check"]["out_cosine"] > 0.9999 and report["check"]["varlen_out_cosine"] > 0.9999
    assert report["check"]["out_max_abs_err"] < 1e-4


def test_plain_trees_count_ancestor_pairs(capsys):
    report = bench_tree_attention.main(_args("--rows", "512"))
    assert report["compaction_events"] == 0
    assert report["pairs"]["tree"] < report["pairs"]["expanded"]


def test_expanded_loop_refused_with_compaction():
    with pytest.raises(SystemExit) as e:
        bench_tree_attention.main(_args("--compaction", "markovian", "--expanded-loop"))
    assert e.value.code == 2


@pytest.mark.parametrize("flag", [["--context-budget", "0"], ["--max-tokens", "1"]])
def test_bad_sizes_are_one_error(flag, capsys):
    with pytest.raises(SystemExit) as e:
        bench_tree_attention.main(_args("--compaction", "sliding-window", *flag))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert flag[0] in err[-1] and "Traceback" not in "".join(err)


def test_tune_interval_workloads_and_refusals(capsys, tmp_path):
    """tune_interval.py: its workloads are bench_tree_attention's (a plain Tree-Step batch, compaction
    traces with events); bad options and a machine without CUDA/Triton are one error line each;
    docs/tree_ops.md's command parses."""
    import re
    import shlex

    import tune_interval
    from tool_runner import assert_one_error, run_tool
    from megatron_harts.ops.interval_attention import interval_available
    plain = tune_interval.workload("tree-step", 2048)
    evicting = tune_interval.workload("tree-step:sliding-window:256", 2048)
    assert plain.num_events == 0 and evicting.num_events > 0 and plain.num_rows <= 2048
    for argv, needle in ((["--tiles", "64"], "--tiles"), (["--fwd", "4xx"], "--fwd"), (["--bwd", "0x1"], "--bwd"),
                         (["--out", str(tmp_path / "no_dir" / "t.json")], "--out")):
        code, out, err = run_tool(tune_interval, capsys, *argv)
        assert_one_error(code, err, needle)
    text = open(os.path.join(ROOT, "docs", "tree_ops.md")).read()
    (cmd,) = [c for c in re.findall(r"```bash\n(.*?)```", text, re.S) if "tune_interval" in c]
    argv = shlex.split(cmd)[2:]
    argv[argv.index("--out") + 1] = str(tmp_path / "t.json")
    assert argv[:2] == ["--sets", "tree-step"]
    if interval_available("cuda") is None and __import__("torch").cuda.is_available():
        return          # a GPU: the sweep would run (minutes)
    code, out, err = run_tool(tune_interval, capsys, *argv)
    assert_one_error(code, err, "needs CUDA and Triton")
