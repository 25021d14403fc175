"""tools/verify_fidelity.py and megatron_harts/testing/fidelity.py: tree vs expanded vs transformers."""
import json

import pytest
import torch

from megatron_harts.testing import fidelity
from megatron_harts.testing.fidelity import ModeRun, bf16_verdict, fidelity_report, pg_loss

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
    # every comparison: max, mean, median and targets over tolerance; the oracle in fp64 on the CPU
    assert report["oracle_device"] == "cpu" and report["oracle_dtype"] == "float64"
    for prefix in ("", "oracle_"):
        assert report[f"{prefix}logprob_targets_over_tolerance"] == 0
        for stat in ("median", "mean"):
            assert 0 <= report[f"{prefix}{stat}_logprob_abs_diff"] <= report[f"{prefix}max_logprob_abs_diff"]
    assert report["oracle_median_logprob_abs_diff"] > 0


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


def test_logprob_statistics_and_targets_over_tolerance():
    """Max, mean, median and the count of targets over tolerance, for tree vs expanded and for the oracle."""
    ref = _run()
    n = ref.logprobs.numel()
    scale = float(ref.logprobs.abs().max())
    bump = torch.zeros(n, dtype=torch.float64)
    bump[[2, 7]] = torch.tensor([3e-10, -5e-11], dtype=torch.float64) * scale    # over the fp64 tolerance, under
    oracle_diff = 2e-5 * scale * (torch.arange(n, dtype=torch.float64) + 0.5) / n  # half of them over 1e-5
    report = fidelity_report(_copy(ref, logprobs=ref.logprobs + bump), ref, "float64",
                             oracle_logprobs=ref.logprobs + oracle_diff)
    assert report["logprob_targets_over_tolerance"] == 1 and "max_logprob_rel_diff" in report["failed"]
    assert abs(report["max_logprob_abs_diff"] - 3e-10 * scale) < 1e-14            # log-prob rounding ~4e-16
    assert abs(report["mean_logprob_abs_diff"] - 3.5e-10 * scale / n) < 1e-14
    assert report["median_logprob_abs_diff"] == 0.0
    assert n == 12 and report["oracle_logprob_targets_over_tolerance"] == 6
    assert abs(report["oracle_median_logprob_abs_diff"] - 2e-5 * scale * 6 / n) < 1e-14   # between the 6th and 7th
    assert "oracle_max_logprob_rel_diff" in report["failed"]
    # bf16 has no per-target tolerance: no count
    bf16 = fidelity_report(_copy(ref), ref, "bfloat16", fp32_oracle=ref)
    assert bf16["logprob_targets_over_tolerance"] is None and bf16["median_logprob_abs_diff_tree_vs_fp32"] == 0.0


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
    from megatron_harts.testing.cpu_runtime import single_process_megatron
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
    assert abs(float(loss.detach()) - float(want)) < 1e-12
    assert abs(float(scale.detach()) - (1.0 + 4.0 + abs(float(third))) / 3) < 1e-12


def _last_line(out):
    return [line for line in out.splitlines() if line.strip()][-1]


def test_tree_run_on_one_perturbed_weight_fails(capsys, monkeypatch):
    """One weight off by 1e-6 in tree mode only (restored for the expanded run): exit 1, a FAIL
    line naming the log-prob, loss and gradient differences, and targets counted over tolerance."""
    real = fidelity.run_tree

    def tree_on_perturbed_weight(model, *args, **kwargs):
        w = model.decoder.layers[3].self_attention.linear_proj.weight
        with torch.no_grad():
            w[0, 0] += 1e-6
        try:
            return real(model, *args, **kwargs)
        finally:
            with torch.no_grad():
                w[0, 0] -= 1e-6

    monkeypatch.setattr(fidelity, "run_tree", tree_on_perturbed_weight)
    code, out, err = verify(capsys, "--synthetic")
    assert code == 1, err
    last = _last_line(out)
    assert last.startswith("FAIL: ") and "max_logprob_rel_diff" in last and "max_grad_rel_diff" in last, last
    summary = next(line for line in out.splitlines() if line.startswith("log-prob |difference|, tree vs expanded"))
    over = int(summary.split(", ")[-1].split()[0])
    assert over > 0, summary


def test_oracle_on_one_perturbed_weight_fails(capsys, monkeypatch):
    """The transformers oracle with one weight off by 1e-3: exit 1 and a FAIL line naming only the
    oracle comparison (tree vs expanded still exact; the right weights pass: the first test)."""
    pytest.importorskip("transformers")
    real = fidelity.hf_oracle_model

    def perturbed_oracle(*args, **kwargs):
        hf = real(*args, **kwargs)
        with torch.no_grad():
            hf.model.layers[1].self_attn.o_proj.weight[0, 0] += 1e-3
        return hf

    monkeypatch.setattr(fidelity, "hf_oracle_model", perturbed_oracle)
    code, out, err = verify(capsys, "--synthetic", "--oracle", "hf")
    assert code == 1, err
    assert _last_line(out) == "FAIL: oracle_max_logprob_rel_diff", out
    summary = next(line for line in out.splitlines() if "expanded vs transformers (cpu, float64)" in line)
    assert int(summary.split(", ")[-1].split()[0]) > 0, summary


def test_help_exits_0(capsys):
    code, out, err = verify(capsys, "--help")
    assert code == 0 and "--oracle-device" in out and "Exit status" in out and not err


def test_expert_bias_counts_without_torch_compile():
    """Expanded mode counts tokens per expert for the expert-bias update in eager code: megatron's
    own ``_apply_expert_bias`` is torch.compile'd (it failed under dynamo on CPU tensors on a
    machine with CUDA and fla), so the router overrides it and nothing on the path compiles."""
    import megatron_harts.patches as patches
    from megatron_harts.layout import build_layout
    from megatron_harts.models import build_hybrid_model
    from megatron_harts.testing.cpu_runtime import single_process_megatron
    from megatron_harts.models.router import HybridRouter
    from megatron_harts.tree_data import build_forest
    assert not hasattr(HybridRouter._apply_expert_bias, "_torchdynamo_orig_callable")
    forest = build_forest(TOOL.synthetic_trajectories(32, 0))
    layout = build_layout(forest)
    cfg, vocab = fidelity.preset_config("tiny", torch.float64)
    patches.apply()
    try:
        with single_process_megatron("cpu", seed=0), torch.compiler.set_stance("fail_on_recompile"):
            model = build_hybrid_model(cfg, vocab_size=vocab)
            fidelity.run_expanded(model, forest, layout, cfg)
            routers = [l.mlp.router for l in model.decoder.layers if getattr(l, "is_moe_layer", False)]
            assert routers and all(r.enable_expert_bias for r in routers)
            for r in routers:       # every expanded token, top-2, counted once (the grad-mode forward)
                assert int(r.local_tokens_per_expert.sum()) == layout.num_expanded_tokens * cfg.moe_router_topk
                assert torch.equal(r.local_tokens_per_expert.double(), r.last_tokens_per_expert)
            r = routers[0]
            r.local_tokens_per_expert.zero_()
            rmap = torch.rand(6, cfg.num_moe_experts, generator=torch.Generator().manual_seed(0)) < 0.3
            pad = torch.tensor([False, True, False, False, True, False])
            with torch.no_grad():
                r._apply_expert_bias(rmap, padding_mask=pad)             # not in no-grad passes
            assert int(r.local_tokens_per_expert.sum()) == 0
            r._apply_expert_bias(rmap, padding_mask=pad)
            assert torch.equal(r.local_tokens_per_expert, (rmap & ~pad[:, None]).sum(0).to(
                r.local_tokens_per_expert.dtype))
    finally:
        patches.undo()


@pytest.mark.parametrize("strategy", ["sliding-window", "markovian", "summary"])
def test_compaction_traces_tree_equals_expanded_and_transformers(capsys, strategy):
    pytest.importorskip("transformers")
    code, out, err = verify(capsys, "--synthetic", "--compaction", strategy, "--oracle", "hf", "--json")
    report = json.loads(out)
    assert code == 0, (report, err)
    assert report["compaction_events"] > 0
    assert report["visible_pairs_tree"] < report["visible_pairs_expanded"]
    assert report["max_logprob_rel_diff"] <= 1e-10 and report["max_grad_rel_diff"] <= 1e-10
    assert report["oracle_logprob_targets_over_tolerance"] == 0


def test_compaction_ignored_by_one_mode_fails(capsys, monkeypatch):
    """Expanded mode without its eviction masks (plain causal sequences) no longer matches tree mode."""
    import megatron_harts.layout as layout_mod
    monkeypatch.setattr(layout_mod, "sequence_visibility", lambda lengths, compactions: None)
    code, out, err = verify(capsys, "--synthetic", "--compaction", "sliding-window")
    assert code == 1 and _last_line(out).startswith("FAIL"), (out, err)


def bad_path(tmp_path):
    p = tmp_path / "one.jsonl"
    p.write_text('{"id": "a", "tokens": [1, 2, 3]}\n')
    return p


def test_bad_input_exit_2(tmp_path, capsys):
    assert_one_error(*verify(capsys, "--input", tmp_path / "missing.jsonl")[::2], "missing.jsonl")
    assert_one_error(*verify(capsys, "--synthetic", "--no-such-flag")[::2], "--no-such-flag")
    assert_one_error(*verify(capsys, "--synthetic", "--seed", "abc")[::2], "--seed", "abc")
    assert_one_error(*verify(capsys, "--dtype", "float64")[::2], "--input", "--synthetic")
    assert_one_error(*verify(capsys, "--synthetic", "--preset", "huge")[::2], "--preset", "huge")
    assert_one_error(*verify(capsys, "--synthetic", "--dtype", "float16")[::2], "--dtype", "float16")
    assert_one_error(*verify(capsys, "--synthetic", "--oracle", "vllm")[::2], "--oracle")
    assert_one_error(*verify(capsys, "--synthetic", "--oracle-device", "cpu")[::2], "--oracle-device", "--oracle hf")
    assert_one_error(*verify(capsys, "--synthetic", "--oracle", "hf", "--oracle-device", "tpu")[::2],
                     "--oracle-device", "tpu")
    assert_one_error(*verify(capsys, "--synthetic", "--init", "xavier")[::2], "--init", "xavier")
    assert_one_error(*verify(capsys, "--synthetic", "--per-layer")[::2], "--per-layer", "bfloat16")
    assert_one_error(*verify(capsys, "--synthetic", "--compaction", "lru")[::2], "--compaction", "lru")
    assert_one_error(*verify(capsys, "--input", bad_path(tmp_path), "--compaction", "summary")[::2], "--compaction",
                     "--synthetic")
    assert_one_error(*verify(capsys, "--synthetic", "--init", "random", "--hf-checkpoint", tmp_path)[::2], "--init",
                     "--hf-checkpoint")
    assert_one_error(*verify(capsys, "--synthetic", "--hf-checkpoint", tmp_path)[::2], "config.json")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "tokens": [1, 2, 3]}\n{"id": "b", "tokens": [1, 99]}\n')     # tiny vocab is 32
    assert_one_error(*verify(capsys, "--input", bad)[::2], "bad.jsonl:2", "'b'", "tokens")
