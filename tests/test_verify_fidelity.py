"""tools/verify_fidelity.py and megatron_harts/models/fidelity.py: tree vs expanded vs transformers."""
import json

import pytest
import torch

from megatron_harts.models import fidelity
from megatron_harts.models.fidelity import ModeRun, bf16_verdict, fidelity_report, pg_loss

from tool_runner import assert_one_error, load_tool, run_tool

KEYS = {"max_logprob_abs_diff", "max_grad_rel_diff", "loss_abs_diff", "aux_loss_abs_diff", "tokens_per_expert_equal",
        "logit_cosine", "oracle_max_logprob_abs_diff"}
BF16_KEYS = {f"{m}_{who}_vs_fp32" for m in ("logit_cosine", "max_logprob_abs_diff", "mean_logprob_abs_diff",
                                            "loss_abs_diff", "max_grad_rel_diff", "worst_grad", "sign_step_alignment")
             for who in ("tree", "expanded")} | \
    {"loss_fp32", "bf16_min_logit_cosine", "bf16_max_mean_logprob_abs_diff"}


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
    # bf16 needs the fp32 oracle run
    with pytest.raises(ValueError, match="fp32 oracle"):
        fidelity_report(_copy(ref), ref, "bfloat16")


def _noisy(run, logits=0.0, logprobs=0.0, seed=1):
    g = torch.Generator().manual_seed(seed)
    r = lambda t: torch.randn(t.shape, generator=g, dtype=torch.float64)  # noqa: E731
    return _copy(run, logits=run.logits + logits * r(run.logits), logprobs=run.logprobs + logprobs * r(run.logprobs))


def test_bf16_verdict_against_the_fp32_oracle():
    """bf16: tree's deviation from the fp32 oracle against expanded's own, with the stated slack."""
    oracle = _run()
    expanded = _noisy(oracle, logits=1e-2, logprobs=1e-2, seed=1)
    e = 1 - fidelity.logit_cosine(expanded.logits, oracle.logits)
    e_lp = float((expanded.logprobs - oracle.logprobs).abs().mean())
    assert e > 1e-6 and e_lp > 1e-4
    # a tree run with rounding of the same size (other draws) passes, also when it is exactly the oracle
    for tree in (_noisy(oracle, logits=1e-2, logprobs=1e-2, seed=2), _copy(oracle)):
        report = fidelity_report(tree, expanded, "bfloat16", fp32_oracle=oracle)
        assert report["pass"] and BF16_KEYS <= set(report), report["failed"]
    report = fidelity_report(_copy(oracle), expanded, "bfloat16", fp32_oracle=oracle)
    assert report["logit_cosine_tree_vs_fp32"] == 1.0 and report["mean_logprob_abs_diff_tree_vs_fp32"] == 0.0
    assert abs(report["logit_cosine_expanded_vs_fp32"] - (1 - e)) < 1e-12
    assert abs(report["bf16_min_logit_cosine"] - (1 - (fidelity.BF16_COSINE_FACTOR * e + fidelity.BF16_COSINE_FLOOR))) \
        < 1e-12
    # twice expanded's logit error: the cosine deficit is ~4x expanded's -> fails, log-probs still pass
    report = fidelity_report(_noisy(oracle, logits=2e-2, seed=3), expanded, "bfloat16", fp32_oracle=oracle)
    assert report["failed"] == ["logit_cosine_tree_vs_fp32"]
    assert report["logit_cosine_tree_vs_fp32"] < report["bf16_min_logit_cosine"] < report["logit_cosine_expanded_vs_fp32"]
    # log-prob error 3x expanded's -> fails on log-probs only
    verdict = bf16_verdict(_noisy(oracle, logprobs=3e-2, seed=4), expanded, oracle)
    assert verdict["failed"] == ["mean_logprob_abs_diff_tree_vs_fp32"]
    assert verdict["mean_logprob_abs_diff_tree_vs_fp32"] > verdict["bf16_max_mean_logprob_abs_diff"]
    # an exact expanded run leaves only the floors: below them passes (1 - cos ~5e-9), above fails (~5e-5)
    verdict = bf16_verdict(_noisy(oracle, logits=1e-4, logprobs=1e-6, seed=5), _copy(oracle), oracle)
    assert verdict["failed"] == [] and verdict["bf16_min_logit_cosine"] == 1 - fidelity.BF16_COSINE_FLOOR
    verdict = bf16_verdict(_noisy(oracle, logits=1e-2, logprobs=1e-4, seed=5), _copy(oracle), oracle)
    assert verdict["failed"] == ["logit_cosine_tree_vs_fp32", "mean_logprob_abs_diff_tree_vs_fp32"]


def test_sign_step_alignment_and_worst_gradient():
    """A run's gradients against the oracle's: the first-order decrease of a sign step along them
    relative to the oracle's own (1 for the same signs), and the tensor of the largest deviation."""
    oracle = _run()
    report = bf16_verdict(_copy(oracle), _copy(oracle), oracle)
    assert report["sign_step_alignment_tree_vs_fp32"] == 1.0
    a, b = oracle.grads["a"], oracle.grads["b"]
    flipped = _copy(oracle, grads={"a": a, "b": -b})       # every sign of "b" wrong
    report = bf16_verdict(flipped, _copy(oracle), oracle)
    want = float((a.abs().sum() - b.abs().sum()) / (a.abs().sum() + b.abs().sum()))
    assert abs(report["sign_step_alignment_tree_vs_fp32"] - want) < 1e-12
    assert report["worst_grad_tree_vs_fp32"] == "b" and report["max_grad_rel_diff_tree_vs_fp32"] == 2.0


def test_bf16_tree_matches_expanded_within_bf16_rounding(capsys):
    """--dtype bfloat16 on the CPU (tiny preset, megatron init): both bf16 runs against the fp32 oracle."""
    code, out, err = verify(capsys, "--synthetic", "--dtype", "bfloat16", "--json")
    report = json.loads(out)
    assert code == 0, (report, err)
    assert KEYS <= set(report) and BF16_KEYS <= set(report) and report["pass"] is True and report["failed"] == []
    assert report["init"] == "megatron" and report["dtype"] == "bfloat16"
    # real bf16 rounding (not a bitwise rerun), of the size measured for this preset (1 - cosine ~5e-5)
    for who in ("tree", "expanded"):
        assert 1e-6 < 1 - report[f"logit_cosine_{who}_vs_fp32"] < 1e-3
        assert 1e-5 < report[f"mean_logprob_abs_diff_{who}_vs_fp32"] < 1e-2
        assert report[f"max_logprob_abs_diff_{who}_vs_fp32"] >= report[f"mean_logprob_abs_diff_{who}_vs_fp32"]
    assert report["logit_cosine_tree_vs_fp32"] >= report["bf16_min_logit_cosine"]
    assert abs(report["loss_fp32"] - report["loss_expanded"]) == report["loss_abs_diff_expanded_vs_fp32"] < 1e-3
    assert 0.999 < report["logit_cosine"] < 1.0


def test_bf16_per_layer_errors(capsys):
    """--per-layer: every decoder layer's attention, MLP and output error and each MoE layer's routing
    flips against the fp32 oracle, tree and expanded side by side, then the logits."""
    code, out, err = verify(capsys, "--synthetic", "--dtype", "bfloat16", "--per-layer", "--json")
    per_layer = json.loads(out)["per_layer"]
    assert code == 0, err
    for mode in ("tree", "expanded"):
        rows = per_layer[mode]
        assert [e["layer"] for e in rows] == [0, 1, 2, 3, "logits"]
        for e in rows[:-1]:
            assert all(1e-5 < e[k] < 1.0 for k in ("attention", "mlp", "output"))      # bf16-sized, not exact
            assert ("routing_flips" in e) == (e["layer"] >= 1)                        # first_k_dense_replace=1
            assert 0.0 <= e.get("routing_flips", 0.0) <= 1.0
        assert 1e-5 < rows[-1]["output"] < 0.1
    code, out, err = verify(capsys, "--synthetic", "--dtype", "bfloat16", "--per-layer")
    assert code == 0 and "routing flips" in out and "logits" in out


def test_layer_errors_of_an_fp32_model_are_rounding_only():
    """An fp32 model against its own fp32 oracle: tree rows land on their trajectories' positions
    (an error there would be of order 1) and no expert set differs."""
    import megatron_harts.patches as patches
    from megatron_harts.layout import build_layout
    from megatron_harts.models import build_hybrid_model
    from megatron_harts.models.cpu_runtime import single_process_megatron
    from megatron_harts.tree_data import build_forest
    forest = build_forest(TOOL.synthetic_trajectories(32, 0))
    cfg, vocab = fidelity.preset_config("tiny", torch.float32)
    patches.apply()
    try:
        with single_process_megatron("cpu", seed=0):
            model = build_hybrid_model(cfg, vocab_size=vocab)
            fidelity.initialize_weights(model, "megatron", 0)
            errors = fidelity.layer_errors(model, forest, build_layout(forest), cfg)
    finally:
        patches.undo()
    for mode in ("tree", "expanded"):
        for e in errors[mode]:
            assert all(e[k] < 1e-5 for k in ("attention", "mlp", "output") if k in e), (mode, e)
            assert e.get("routing_flips", 0.0) == 0.0


def test_bf16_perturbed_tree_fails(capsys, monkeypatch):
    """A tree run with errors well above bf16 rounding (noise on its logits and log-probs): exit 1."""
    real = fidelity.run_tree

    def noisy_tree(*args, **kwargs):
        run = real(*args, **kwargs)
        g = torch.Generator().manual_seed(0)
        noise = lambda t, s: s * torch.randn(t.shape, generator=g).to(t.dtype)  # noqa: E731
        logits = run.logits.float()
        return _copy(run, logits=(logits + noise(logits, 0.05 * float(logits.std()))).to(run.logits.dtype),
                     logprobs=run.logprobs + noise(run.logprobs, 0.01))

    monkeypatch.setattr(fidelity, "run_tree", noisy_tree)
    code, out, err = verify(capsys, "--synthetic", "--dtype", "bfloat16", "--json")
    report = json.loads(out)
    assert code == 1, (report, err)
    assert report["pass"] is False
    assert report["failed"] == ["logit_cosine_tree_vs_fp32", "mean_logprob_abs_diff_tree_vs_fp32"]
    assert report["logit_cosine_tree_vs_fp32"] < report["bf16_min_logit_cosine"]


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
    assert_one_error(*verify(capsys, "--synthetic", "--init", "xavier")[::2], "--init", "xavier")
    assert_one_error(*verify(capsys, "--synthetic", "--per-layer")[::2], "--per-layer", "bfloat16")
    assert_one_error(*verify(capsys, "--synthetic", "--init", "random", "--hf-checkpoint", tmp_path)[::2], "--init",
                     "--hf-checkpoint")
    assert_one_error(*verify(capsys, "--synthetic", "--hf-checkpoint", tmp_path)[::2], "config.json")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "tokens": [1, 2, 3]}\n{"id": "b", "tokens": [1, 99]}\n')     # tiny vocab is 32
    assert_one_error(*verify(capsys, "--input", bad)[::2], "bad.jsonl:2", "'b'", "tokens")
