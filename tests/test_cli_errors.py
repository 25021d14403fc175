"""Every command-line entry point (tools, benchmarks, examples, the training driver) refuses bad
input the same way: exit status 2, the last line on stderr an ``error:`` line, no traceback, and
nothing written.

Each entry point runs as a subprocess, as a user runs it, once with an unknown flag and, where it
reads a file or folder, once with that input missing.  The runs start together (a thread pool
waits on the processes) in a fresh working folder each, which must hold afterwards exactly what it
held before.
"""
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
DATA = os.path.join(ROOT, "tests", "data", "format_v1")      # a small committed dataset prefix
MISSING = "missing.jsonl"                                    # relative to the run's working folder
BAD_FLAG = "--no-such-flag"


def py(folder: str, name: str, *argv):
    return [PY, os.path.join(ROOT, folder, f"{name}.py"), *argv]


def sh(name: str, *argv):
    return ["bash", os.path.join(ROOT, "examples", f"{name}.sh"), *argv]


# cpu_tiny.sh's driver flags minus the data: enough for the driver to reach its data checks
DRIVER = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "512",
          "--train-iters", "1", "--global-batch-size", "2", "--lr", "1e-3", "--seq-length", "64",
          "--distributed-backend", "gloo"]

#: name -> (argv with an unknown flag, argv with its input missing or None); paths are relative to
#: the run's working folder, which holds nothing
CASES = {
    "tools/compare_runs": (py("tools", "compare_runs", "a.jsonl", "b.jsonl", BAD_FLAG),
                           py("tools", "compare_runs", MISSING, "b.jsonl")),
    "tools/convert_hf_checkpoint": (
        py("tools", "convert_hf_checkpoint", "--direction", "hf-to-megatron", "--input", "hf", "--output", "o",
           BAD_FLAG),
        py("tools", "convert_hf_checkpoint", "--direction", "hf-to-megatron", "--input", "hf", "--output", "o")),
    "tools/convert_trajectories": (py("tools", "convert_trajectories", "--input", DATA, "--output", "o", BAD_FLAG),
                                   py("tools", "convert_trajectories", "--input", MISSING, "--output", "o")),
    "tools/plan_calls": (py("tools", "plan_calls", "--input", DATA, BAD_FLAG),
                         py("tools", "plan_calls", "--input", MISSING)),
    "tools/plan_report": (py("tools", "plan_report", "--input", DATA, "--dp", "1", "--microbatch-tokens", "64",
                             BAD_FLAG),
                          py("tools", "plan_report", "--input", MISSING, "--dp", "1", "--microbatch-tokens", "64")),
    "tools/simulate_schedule": (
        py("tools", "simulate_schedule", "--input", DATA, "--microbatch-tokens", "64", "--stages", "2", BAD_FLAG),
        py("tools", "simulate_schedule", "--input", DATA, "--microbatch-tokens", "64", "--stages", "2",
           "--calibration", MISSING)),
    "tools/synthesize_rollouts": (py("tools", "synthesize_rollouts", "--output", "r.jsonl", BAD_FLAG),
                                  py("tools", "synthesize_rollouts", "--output", os.path.join("no_dir", "r.jsonl"))),
    "tools/tree_stats": (py("tools", "tree_stats", "--input", DATA, BAD_FLAG),
                         py("tools", "tree_stats", "--input", MISSING)),
    "tools/verify_fidelity": (py("tools", "verify_fidelity", "--preset", "tiny", "--synthetic", BAD_FLAG),
                              py("tools", "verify_fidelity", "--preset", "tiny", "--input", MISSING)),
    "benchmarks/bench_call_planner": (py("benchmarks", "bench_call_planner", BAD_FLAG), None),
    "benchmarks/bench_convert": (py("benchmarks", "bench_convert", BAD_FLAG), None),
    "benchmarks/bench_kda_backends": (py("benchmarks", "bench_kda_backends", BAD_FLAG), None),
    "benchmarks/bench_planner": (py("benchmarks", "bench_planner", BAD_FLAG),
                                 py("benchmarks", "bench_planner", "--calibration", MISSING)),
    "benchmarks/bench_pp_schedule": (py("benchmarks", "bench_pp_schedule", BAD_FLAG), None),
    "benchmarks/bench_throughput": (py("benchmarks", "bench_throughput", BAD_FLAG), None),
    "benchmarks/bench_tree_attention": (py("benchmarks", "bench_tree_attention", BAD_FLAG), None),
    "benchmarks/bench_verl": (py("benchmarks", "bench_verl", BAD_FLAG),
                              py("benchmarks", "bench_verl", "--out", os.path.join("no_dir", "v.json"))),
    "benchmarks/calibrate_cost": (py("benchmarks", "calibrate_cost", "--preset", "tiny", BAD_FLAG),
                                  py("benchmarks", "calibrate_cost", "--preset", "tiny", "--device", "cpu", "--out",
                                     os.path.join("no_dir", "c.json"))),
    "benchmarks/step_fidelity": (py("benchmarks", "step_fidelity", BAD_FLAG), None),
    "benchmarks/validate_parallel": (py("benchmarks", "validate_parallel", "--preset", "cpu-tiny", "--nproc", "1",
                                        "--out", "o", BAD_FLAG), None),
    "examples/inspect_rollouts": (py("examples", "inspect_rollouts", DATA, BAD_FLAG),
                                  py("examples", "inspect_rollouts", MISSING)),
    "benchmarks/bench_compaction": (py("benchmarks", "bench_compaction", BAD_FLAG),
                                    py("benchmarks", "bench_compaction", "--out", os.path.join("no_dir", "c.json"))),
    "examples/summarize_run": (py("examples", "summarize_run", "report.jsonl", BAD_FLAG),
                               py("examples", "summarize_run", MISSING)),
    "examples/cpu_tiny.sh": (sh("cpu_tiny", BAD_FLAG), None),
    "examples/gpu_single_kimi.sh": (sh("gpu_single_kimi", BAD_FLAG), None),
    "examples/multi_gpu_templates.sh": (sh("multi_gpu_templates", "dp", DATA, BAD_FLAG),
                                        sh("multi_gpu_templates", "dp", MISSING)),
    "pretrain_tree_gpt": ([PY, os.path.join(ROOT, "pretrain_tree_gpt.py"), *DRIVER, "--data-path", DATA, BAD_FLAG],
                          [PY, os.path.join(ROOT, "pretrain_tree_gpt.py"), *DRIVER, "--data-path", MISSING]),
}
RUNS = [(name, kind) for name, (flag, missing) in CASES.items()
        for kind, argv in (("unknown-flag", flag), ("missing-input", missing)) if argv is not None]


def listing(folder: str) -> list:
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)


def run_case(base: str, name: str, kind: str) -> dict:
    folder = os.path.join(base, name.replace("/", "_") + "-" + kind)
    os.makedirs(folder)
    flag, missing = CASES[name]
    argv = flag if kind == "unknown-flag" else missing
    # the examples write under OUT (default: inside the repository); here under the run's folder
    env = dict(os.environ, PYTHON=PY, OUT=os.path.join(folder, "out"), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    p = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    return {"code": p.returncode, "err": p.stderr, "files": listing(folder)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every run of RUNS, run concurrently (each a process of its own)."""
    base = str(tmp_path_factory.mktemp("cli_errors"))
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        futures = {case: pool.submit(run_case, base, *case) for case in RUNS}
        return {case: f.result() for case, f in futures.items()}


@pytest.mark.parametrize("name,kind", RUNS, ids=[f"{n}-{k}" for n, k in RUNS])
def test_bad_input_is_one_error_line_and_exit_2(results, name, kind):
    r = results[(name, kind)]
    lines = [line for line in r["err"].splitlines() if line.strip()]
    assert "Traceback" not in r["err"], r["err"]
    assert lines and lines[-1].startswith("error:"), r["err"]
    assert r["code"] == 2, (r["code"], r["err"])
    # the error names what is wrong: the unknown flag, or the missing path
    needle = BAD_FLAG if kind == "unknown-flag" else ("no_dir" if "no_dir" in " ".join(CASES[name][1]) else
                                                      ("hf" if name.endswith("convert_hf_checkpoint") else MISSING))
    assert needle in lines[-1], lines[-1]
    assert r["files"] == [], r["files"]
