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


def test_fa4_yardsticks_band_and_unmasked_tiles(monkeypatch):
    """The fa4 yardsticks without a GPU: flash-attn-4's entry point replaced by a recorder. The band's
    pair count is a dense band mask's, its window is w - 1 keys back, and the unmasked tiles are the
    fa4 tiles' full and partial ones together, all full."""
    import types

    import numpy as np
    import torch

    from megatron_harts.layout import build_layout
    from megatron_harts.ops import fa4_blocks as fb

    calls = []
    iface = types.ModuleType("flash_attn.cute.interface")
    iface.flash_attn_func = lambda q, k, v, **kw: calls.append(kw) or q
    for name, mod in (("flash_attn", types.ModuleType("flash_attn")),
                      ("flash_attn.cute", types.ModuleType("flash_attn.cute")), ("flash_attn.cute.interface", iface)):
        monkeypatch.setitem(sys.modules, name, mod)
    args = bench_tree_attention.parse_args(_args("--rows", "2048", "--compaction", "markovian",
                                                 "--context-budget", "512"))
    layout = build_layout(bench_tree_attention.compaction_forest(args))
    blocks = fb.build_fa4_blocks(layout.visibility, dims=(192, 128), blocks=((128, 128), (128, 96)))
    pairs = bench_tree_attention.visible_pairs(layout.visibility)
    got = {name: (fn, p) for name, fn, p in bench_tree_attention.fa4_yardsticks(layout, blocks, 0.1, pairs)}
    R = layout.num_rows
    assert got["causal_fa4"][1] == R * (R + 1) // 2
    w = round(pairs / R)
    i = torch.arange(R)
    band = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < w)
    assert got["band_fa4"][1] == int(band.sum())
    x = torch.zeros(R, 1, 8)
    got["band_fa4"][0](x, x, x)
    assert calls[-1]["window_size"] == (w - 1, 0) and calls[-1]["causal"]
    assert got["tree_fa4_blocks_nomask"][1] == pairs

    def rows(lists):
        part_cnt, part_idx, full_cnt, full_idx = (t.numpy() for t in lists)
        return [(set(part_idx[r, :part_cnt[r]]), set(full_idx[r, :full_cnt[r]])) for r in range(len(part_cnt))]

    monkeypatch.setattr(fb, "fa4_block_attention", lambda q, k, v, blk, scale: calls.append(blk) or q)
    got = {name: fn for name, fn, _ in bench_tree_attention.fa4_yardsticks(layout, blocks, 0.1, pairs)}
    got["tree_fa4_blocks_nomask"](x, x, x)
    unmasked = calls[-1]
    for which in ("fwd_lists", "bwd_lists"):
        real, full = rows(getattr(blocks, which)), rows(getattr(unmasked, which))
        assert any(p for p, _ in real)       # the layout has partial tiles, and they all become full
        assert all(not p and f == rp | rf for (p, f), (rp, rf) in zip(full, real))
    assert np.array_equal(unmasked.starts.numpy(), blocks.starts.numpy())
