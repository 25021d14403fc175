"""tools/verify_fidelity.py and megatron_harts/models/fidelity.py: tree vs expanded vs transformers."""
import json

import pytest
import torch

from megatron_harts.models.fidelity import ModeRun, fidelity_report, pg_loss

from tool_runner import assert_one_error, load_tool, run_tool

KEYS = {"max_logprob_abs_diff", "max_grad_rel_diff", "loss_abs_diff", "aux_loss_abs_diff", "tokens_per_expert_equal",
        "logit_cosine", "oracle_max_logprob_abs_diff"}


TOOL = load_tool("verify_fidelity")


def verify(capsys, *argv):
    return run_tool(TOOL, capsys, *argv)


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 1e-5)])
def test_synthetic_tree_equals_expanded_and_transformers(capsys, dtype, tol):
    pytest.importorskip("transformers")
    code, out, err = verify(capsys, "--synthetic", "--dtype", dtype, "--oracle", "hf", "--json")
    report = json.loads(out)
    assert code == 0, (report, err)
    assert KEYS <= set(report) and report["pass"] is True and report["failed"] == []
    assert report["num_trajectories"] >= 4 and report["rows"] < report["expanded_tokens"]     # real sharing
    assert report["num_grads"] > 80 and report["num_targets"] > 20
    assert report["max_logprob_rel_diff"] <= tol and report["max_grad_rel_diff"] <= tol
    assert report["tokens_per_expert_equal"] is True and report["logit_cosine"] > 1 - 10 * tol
    assert 0 < report["oracle_max_logprob_abs_diff"] < 1e-4
    assert report["loss_expanded"] != 0


def test_input_file_with_weights_and_token_advantages(tmp_path, capsys):
    """--input: shared prefixes, a per-token advantage, a weight, old log-probs (PPO-clip) and none."""
    rows = [{"id": "a", "tokens": [1, 2, 3, 4, 5, 6, 7, 8, 9], "advantage": 0.5, "weight": 2.0},
            {"id": "b", "tokens": [1, 2, 3, 4, 5, 9, 9, 2], "advantage": [0, 1, 2, 3, 4, 5, -1, -2]},
            {"id": "c", "tokens": [1, 2, 3, 4, 5, 6, 30], "advantage": -1.0,
             "old_logprobs": [0, -1, -2, -3, -1, -2, -0.5]}]
    src = tmp_path / "t.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, err = verify(capsys, "--input", src, "--json")
    report = json.loads(out)
    assert code == 0, (report, err)
    assert report["num_trajectories"] == 3 and report["rows"] == 13 and report["max_logprob_rel_diff"] <= 1e-10
    assert report["oracle_max_logprob_abs_diff"] is None


def _run(seed=0, n=12, e=3):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    lp = -r(n).abs()
    loss, scale = pg_loss(lp, torch.ones(n), r(n), torch.full((n,), float("nan")))
    return ModeRun(logprobs=lp, loss=loss, loss_scale=scale, grads={"a": r(4, 4), "b": r(3)}, aux=r(e).abs(),
                   tokens_per_expert=torch.tensor([[3.0, 5.0, 4.0]]), logits=r(n, 7))


def _copy(m, **changes):
    fields = {k: getattr(m, k) for k in ("logprobs", "loss", "loss_scale", "grads", "aux", "tokens_per_expert", "logits")}
    fields.update(changes)
    return ModeRun(**fields)


def test_report_verdicts_on_perturbed_runs():
    """The comparison function itself: equal runs pass, each kind of perturbation fails."""
    ref = _run()
    assert fidelity_report(_copy(ref), ref, "float64")["pass"]
    cases = {
        "max_logprob_rel_diff": _copy(ref, logprobs=ref.logprobs + 1e-8),
        "loss_rel_diff": _copy(ref, loss=ref.loss + 1e-6),
        "max_grad_rel_diff": _copy(ref, grads={**ref.grads, "b": ref.grads["b"] * (1 + 1e-7)}),
        "aux_loss_rel_diff": _copy(ref, aux=ref.aux * (1 + 1e-8)),
        "tokens_per_expert_equal": _copy(ref, tokens_per_expert=torch.tensor([[3.0, 4.0, 5.0]])),
    }
    for key, bad in cases.items():
        report = fidelity_report(bad, ref, "float64")
        assert not report["pass"] and key in report["failed"], (key, report["failed"])
    # fp32 tolerates what fp64 does not
    assert fidelity_report(cases["max_logprob_rel_diff"], ref, "float32")["pass"]
    # a missing gradient is a failure, not a skip
    assert "max_grad_rel_diff" in fidelity_report(_copy(ref, grads={"a": ref.grads["a"]}), ref, "float64")["failed"]
    # oracle
    report = fidelity_report(_copy(ref), ref, "float32", oracle_logprobs=ref.logprobs + 1e-3)
    assert report["failed"] == ["oracle_max_logprob_rel_diff"] and report["oracle_max_logprob_abs_diff"] > 9e-4
    # bf16: the tree's logit cosine against expanded's run-to-run cosine
    noisy = _copy(ref, logits=ref.logits + 1e-3 * torch.randn(ref.logits.shape, generator=torch.Generator().manual_seed(1),
                                                               dtype=torch.float64))
    assert fidelity_report(_copy(ref), ref, "bfloat16", expanded_rerun=noisy)["pass"]
    report = fidelity_report(noisy, ref, "bfloat16", expanded_rerun=_copy(ref))
    assert report["failed"] == ["logit_cosine"] and report["logit_cosine"] < report["expanded_self_cosine"] == 1.0


def test_pg_loss_plain_and_ppo_clip():
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    w = torch.tensor([1.0, 2.0, 1.0], dtype=torch.float64)
    adv = torch.tensor([1.0, float("nan"), -2.0], dtype=torch.float64)
    old = torch.tensor([float("nan"), float("nan"), -1.0], dtype=torch.float64)
    loss, scale = pg_loss(lp, w, adv, old)
    ratio = torch.exp(torch.tensor(0.5, dtype=torch.float64))          # > 1 + clip, negative advantage
    third = -1.0 * min(ratio * -2.0, min(ratio, 1.2) * -2.0)
    want = (1.0 * 1.0 * 1.0 + 2.0 * 1.0 * 2.0 + third) / 3
    assert abs(float(loss) - float(want)) < 1e-12
    assert abs(float(scale) - (1.0 + 4.0 + abs(float(third))) / 3) < 1e-12


def test_bad_input_exit_2(tmp_path, capsys):
    assert_one_error(*verify(capsys, "--input", tmp_path / "missing.jsonl")[::2], "missing.jsonl")
    assert_one_error(*verify(capsys, "--synthetic", "--preset", "huge")[::2], "--preset", "huge")
    assert_one_error(*verify(capsys, "--synthetic", "--dtype", "float16")[::2], "--dtype", "float16")
    assert_one_error(*verify(capsys, "--synthetic", "--oracle", "vllm")[::2], "--oracle")
    assert_one_error(*verify(capsys, "--synthetic", "--hf-checkpoint", tmp_path)[::2], "config.json")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "tokens": [1, 2, 3]}\n{"id": "b", "tokens": [1, 99]}\n')     # tiny vocab is 32
    assert_one_error(*verify(capsys, "--input", bad)[::2], "bad.jsonl:2", "'b'", "tokens")
