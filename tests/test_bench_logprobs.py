"""benchmarks/bench_logprobs.py on the CPU (a smoke run): one JSON object with every variant per row
count, the chunked variants' log-probs equal to the unchunked form's to rounding, the fastest named,
bad sizes refused with one error line.  No wall-clock time is asserted."""
import json

from tool_runner import assert_one_error, load_tool, run_tool


def test_cpu_smoke_run_records_every_variant(tmp_path, capsys):
    bl = load_tool("bench_logprobs", "benchmarks")
    out = tmp_path / "lp.json"
    res = bl.main(["--device", "cpu", "--rows", "40", "67", "--vocab", "300", "--hidden", "16", "--chunks", "8", "13",
                   "80", "--dtype", "fp64", "--iters", "1", "--warmup", "0", "--entropy", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert res["default_chunk_rows"] == 4096
    for rows, run in zip((40, 67), res["runs"]):
        assert run["rows"] == rows and run["pairs"] >= rows
        assert list(run["variants"]) == ["unchunked", "chunk_8", "chunk_13", "chunk_80"]
        for name, v in run["variants"].items():
            assert v["ms"] > 0 and v["peak_gib_above_start"] is None      # no CUDA peak on the CPU
            assert v["max_abs_logprob_diff"] < 1e-12, name                # fp64: rounding only
        assert run["reference_for_diff"] == "unchunked"
        assert run["fastest"] in run["variants"] and run["fastest_chunked"] != "unchunked"


def test_bad_sizes_are_one_error_line(capsys):
    bl = load_tool("bench_logprobs", "benchmarks")
    code, _, err = run_tool(bl, capsys, "--device", "cpu", "--chunks", "0")
    assert_one_error(code, err, "--chunks 0")
    code, _, err = run_tool(bl, capsys, "--device", "cpu", "--extra-pairs", "1.5")
    assert_one_error(code, err, "--extra-pairs")
