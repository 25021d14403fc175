"""benchmarks/validate_parallel.py's pure parts: which configurations fit a process count, flag
values, and the log excerpt a failed launch reports."""

import pytest

from tool_runner import load_tool


@pytest.fixture(scope="module")
def vp():
    return load_tool("validate_parallel", "benchmarks")


def test_configs_fit_process_counts(vp):
    fits = {n: [c for c in vp.CONFIGS if vp.config_flags(c, n) is not None] for n in (1, 2, 3, 4)}
    assert fits[1] == ["dp"]
    assert fits[2] == ["dp", "tp-sp", "ep", "tp-sp-ep", "pp"]
    assert fits[3] == ["dp"]
    assert fits[4] == list(vp.CONFIGS)
    flags, mode = vp.config_flags("tp-sp-pp", 4)
    assert (vp.flag_value(flags, "--tensor-model-parallel-size"), vp.flag_value(flags, "--pipeline-model-parallel-size"),
            mode) == (2, 2, "windows")
    assert vp.flag_value(vp.config_flags("pp4", 4)[0], "--pipeline-model-parallel-size") == 4
    assert vp.flag_value("", "--pipeline-model-parallel-size") == 1
    assert vp.config_flags("ep", 4)[1] == "within"          # expert parallelism runs replicas in lockstep


def test_log_excerpt_starts_at_first_error(vp):
    lines = ["launch cmd", "/x/clip_grads.py:29: UserWarning: Apex", "  warnings.warn(", "iteration 1 ok",
             "Traceback (most recent call last):", '  File "a.py", line 1', "RuntimeError: NCCL boom",
             "[worker] run tree failed: later"]
    assert vp.log_excerpt(lines) == lines[4:]
    assert vp.log_excerpt(lines, limit=2) == lines[4:6]
    quiet = ["a", "b", "c"]
    assert vp.log_excerpt(quiet, limit=2) == ["b", "c"]      # no error: the tail


def test_presets_fp32_asks_for_ieee_triton_dots(vp):
    assert "--bf16" not in vp.PRESETS["h200-fp32"]["model"]
    assert vp.PRESETS["h200-fp32"]["env"] == {"TRITON_F32_DEFAULT": "ieee"}
    assert "env" not in vp.PRESETS["h200"]


def test_repacked_budget_halves_but_keeps_whole_trajectories(vp):
    assert vp.repacked_budget("--seq-length 2048 --tree-microbatch-tokens 8192") == 4096
    assert vp.repacked_budget("--seq-length 600 --tree-microbatch-tokens 1024") == 600
    assert vp.repacked_budget("--seq-length 1024 --tree-microbatch-tokens 1024") is None


def test_judge_measures_tree_against_rerun_and_repacked(vp):
    def probe(start, end, dloss=0.0):
        return {"logit_cosine_start": start, "logit_cosine_end": end, "loss_abs_diff_max": dloss}
    out = vp.judge({"expanded_rerun": probe(1.0, 0.999), vp.REPACKED: probe(0.99996, 0.9989),
                    "tree": probe(0.99997, 0.99895, 3e-4)})
    tree = out["tree"]
    assert tree["cosine_below_rerun"] == pytest.approx(5e-5)       # the end probe falls further
    assert not tree["meets_cosine_target"] and not tree["meets_loss_target"]
    assert tree["cosine_below_repacked"] == pytest.approx(-1e-5)
    assert tree["meets_cosine_target_repacked"]
    assert "cosine_below_rerun" not in out[vp.REPACKED]
