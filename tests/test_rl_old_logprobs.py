"""``--rl-old-logprobs current``: PPO on data without ``old_logprobs`` (on-policy rollouts, GRPO).

- objective level (the log-prob tables of tests/test_rl_objectives.py, fp64): with the old
  log-probs taken from the current ones (detached), every microbatch split of the step's targets
  sums to the expanded loss (value, terms, gradients); the clipped loss is the policy-gradient
  form at ratio 1 (value ``-sum c A``, gradient ``-sum c A grad logp``, nothing clipped) for any
  clip bounds, and the data's old log-probs, when present, are not read;
- the default (``data``) still refuses data without old log-probs, naming the flag to use;
  ``current`` refuses ``sft`` and ``--kl-coef > 0`` (a KL to the current policy is 0);
- driver level (a tiny hybrid MoE model, fp64, one process): one step on rollouts without
  old log-probs gives the same loss, terms and gradients in expanded mode (``off``) and tree
  mode (``within``, ``windows``) to 1e-10.
"""
import math

import pytest
import torch

from megatron_harts.layout import build_layout
from megatron_harts.rl.objectives import (LOSS_AGG_MODES, OLD_LOGPROBS_SOURCES, ObjectiveConfig, ObjectiveDataError,
                                          objective_loss, objective_loss_reference, target_scale)
from test_rl_objectives import (Case, _records, assert_rel, expanded_keys, microbatch_splits, reference_loss,
                                target_keys, tree_loss)


def _on_policy_records():
    """tests/test_rl_objectives.py's trees without any old log-probs."""
    recs = _records()
    for r in recs:
        r.pop("old_logprobs", None)
    return recs


@pytest.fixture(scope="module")
def on_policy():
    return Case(_on_policy_records())


@pytest.fixture(scope="module")
def with_old():
    return Case(_records())


CURRENT = [ObjectiveConfig(kind="ppo", loss_agg_mode=m, entropy_coef=ec, clip_ratio_low=lo, clip_ratio_high=hi,
                           old_logprobs="current", loss_norm_length=12)
           for m in LOSS_AGG_MODES for ec in (0.0, 0.05) for lo, hi in ((0.2, 0.2), (0.1, 0.28))]


@pytest.mark.parametrize("cfg", CURRENT, ids=lambda c: f"{c.loss_agg_mode}-ent{c.entropy_coef}-"
                                                       f"clip{c.clip_ratio_low}_{c.clip_ratio_high}")
def test_current_microbatch_sum_equals_expanded(on_policy, cfg):
    case = on_policy
    assert all(bool(torch.isnan(lay.target_old_logprob).all()) for lay, _ in microbatch_splits(case)["per-tree"])
    case.zero_grad()
    ref, ref_terms = reference_loss(case, cfg)
    ref_grads = case.grads()
    assert float(ref_grads[0].abs().max()) > 0
    assert float(ref_terms["clip_fraction"]) == 0.0
    for name, mbs in microbatch_splits(case).items():
        assert target_keys(case, mbs) == expanded_keys(case), name
        case.zero_grad()
        got, terms = tree_loss(case, mbs, cfg)
        assert_rel(got, ref, what=f"{name} loss")
        assert terms.keys() == ref_terms.keys(), name
        for k in terms:
            if k == "clip_fraction":
                assert float(terms[k]) == 0.0, name
            else:
                assert_rel(terms[k], ref_terms[k], what=f"{name} {k}")
        for g, rg in zip(case.grads(), ref_grads):
            torch.testing.assert_close(g, rg, rtol=1e-12, atol=1e-15, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("lo,hi", [(0.2, 0.2), (0.1, 0.28), (0.0, 0.0), (0.5, 0.0)])
def test_current_is_the_policy_gradient_at_ratio_one(on_policy, lo, hi):
    """Value ``-sum c A`` and gradient ``-sum c A grad logp`` (the PG form), also with a clip bound
    at 1 (``lo`` or ``hi`` 0), where the ratio sits on the bound."""
    case = on_policy
    lay = build_layout(case.forest)
    lp, _, old, adv, traj, weight = case.target_values(lay)
    c = target_scale(case.normalizer, traj, weight, "seq-mean-token-mean")
    cfg = ObjectiveConfig(kind="ppo", clip_ratio_low=lo, clip_ratio_high=hi, loss_agg_mode="seq-mean-token-mean",
                          old_logprobs="current")
    case.zero_grad()
    loss, terms = objective_loss(lp, old, adv, c, cfg)
    loss.backward()
    got = case.grads()[0]
    case.zero_grad()
    lp = case.target_values(lay)[0]
    pg = -(c * adv * lp).sum()
    pg.backward()
    want = case.grads()[0]
    assert float(want.abs().max()) > 0
    assert_rel(loss.detach(), -(c * adv).sum(), rtol=1e-14, what="value")
    assert_rel(terms["pg_loss"], -(c * adv).sum(), rtol=1e-14, what="pg_loss")
    assert float(terms["clip_fraction"]) == 0.0
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-16)


def test_current_ignores_the_datas_old_logprobs(on_policy, with_old):
    """With old log-probs in the data, ``current`` gives what it gives without them; ``data`` differs."""
    cfg = ObjectiveConfig(kind="ppo", old_logprobs="current", entropy_coef=0.05)
    results = []
    for case in (on_policy, with_old):
        case.zero_grad()
        loss, _ = tree_loss(case, microbatch_splits(case)["owned-segments"], cfg)
        results.append((loss, case.grads()))
    assert_rel(results[1][0], results[0][0], rtol=1e-14)
    for g, rg in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(g, rg, rtol=1e-14, atol=1e-16)
    with_old.zero_grad()
    data, _ = tree_loss(with_old, [(build_layout(with_old.forest), None)], ObjectiveConfig(kind="ppo",
                                                                                       entropy_coef=0.05))
    assert abs(float(data) - float(results[0][0])) > 1e-3


def test_data_without_old_logprobs_names_the_flag(on_policy):
    case = on_policy
    lay = build_layout(case.forest)
    lp, _, old, adv, traj, weight = case.target_values(lay)
    scale = target_scale(case.normalizer, traj, weight, "token-mean")
    with pytest.raises(ObjectiveDataError, match=r"`old_logprobs`.*--rl-old-logprobs current") as e:
        objective_loss(lp, old, adv, scale, ObjectiveConfig(kind="ppo"))
    assert e.value.field == "old_logprobs"
    lps, _ = case.expanded_values()
    with pytest.raises(ValueError, match=r"`old_logprobs`.*--rl-old-logprobs current"):
        objective_loss_reference(lps, case.trajs, ObjectiveConfig(kind="ppo"))
    # with a KL penalty the flag would not help: no hint
    with pytest.raises(ObjectiveDataError) as e:
        objective_loss(lp, old, adv, scale, ObjectiveConfig(kind="ppo", kl_coef=0.1))
    assert "--rl-old-logprobs" not in str(e.value)


@pytest.mark.parametrize("kw,msg", [
    ({"old_logprobs": "behaviour"}, "--rl-old-logprobs must be one of data, current, recompute, got 'behaviour'"),
    ({"kind": "sft", "old_logprobs": "current"}, "--rl-old-logprobs current only applies to --rl-objective ppo"),
    ({"kl_coef": 0.1, "old_logprobs": "current", "kl_to": "old"}, "--kl-coef 0.1 --kl-to old with --rl-old-logprobs current"),
])
def test_bad_config(kw, msg):
    with pytest.raises(ValueError) as e:
        ObjectiveConfig(**kw)
    assert msg in str(e.value) and "ObjectiveConfig.old_logprobs" in str(e.value)
    assert ObjectiveConfig.flag("old_logprobs") == "--rl-old-logprobs"


def test_driver_flag():
    from megatron_harts.training import arguments as A
    from test_arguments import parse, refused
    assert "--rl-old-logprobs" in A.OWN_FLAGS
    assert parse().rl_old_logprobs == "data"
    args = parse("--rl-old-logprobs current --entropy-coef 0.01")
    assert ObjectiveConfig.from_args(args) == ObjectiveConfig(**A.objective_kwargs(args)) == \
        ObjectiveConfig(kind="ppo", entropy_coef=0.01, old_logprobs="current")
    refused("--rl-old-logprobs current --kl-coef 0.1 --kl-to old", "--kl-coef 0.1 --kl-to old", "--rl-old-logprobs current")
    refused("--rl-objective sft --rl-old-logprobs current", "--rl-old-logprobs current", "--rl-objective ppo")
    refused("--rl-old-logprobs old", "--rl-old-logprobs")
    assert "--rl-old-logprobs {data,current,recompute}" in A.build_parser().format_help()


# ---------------------------------------------------------------------------
# driver: tree mode equals expanded mode on a real model
# ---------------------------------------------------------------------------

def _driver_records():
    from test_training_driver import rollouts
    return [{"id": t.id, "tokens": t.tokens.tolist(), "loss_mask": t.loss_mask.tolist(), "advantage": t.advantage,
             "weight": t.weight} for t in rollouts()]


def _driver_argv(sharing, n, *extra):
    from test_training_driver import MODEL
    planner = {"off": "ffd", "within": "l1", "windows": "l1l2"}[sharing]
    return MODEL + ["--global-batch-size", str(n), "--train-iters", "1", "--seq-length", "48",
                    "--tree-microbatch-tokens", "48", "--tree-sharing", sharing, "--tree-planner", planner,
                    "--lr", "1e-3", "--seed", "7", "--log-interval", "1000", "--rl-objective", "ppo",
                    "--clip-ratio-high", "0.28", "--entropy-coef", "0.01", "--loss-agg-mode", "seq-mean-token-mean",
                    *extra]


def test_driver_tree_modes_equal_expanded_with_current():
    from megatron_harts.training.trainer import Trainer
    records = _driver_records()
    runs = {}
    for sharing in ("off", "within", "windows"):
        with Trainer.from_args(_driver_argv(sharing, len(records), "--rl-old-logprobs", "current")) as t:
            m = t.step(records)
            grads = {n: p.main_grad.detach().clone() for n, p in t.model[0].module.named_parameters()}
        runs[sharing] = (m, grads)
    ref_m, ref_g = runs["off"]
    assert ref_m["objective/clip_fraction"] == 0.0 and math.isfinite(ref_m["loss"])
    assert any(float(g.abs().max()) > 0 for g in ref_g.values())
    for sharing in ("within", "windows"):
        m, g = runs[sharing]
        for k in ("loss", "objective/pg_loss", "objective/entropy"):
            assert abs(m[k] - ref_m[k]) <= 1e-10 * abs(ref_m[k]), f"{sharing}: {k} {m[k]!r} != {ref_m[k]!r}"
        assert m["objective/clip_fraction"] == 0.0
        assert g.keys() == ref_g.keys()
        for name, rg in ref_g.items():
            torch.testing.assert_close(g[name], rg, rtol=1e-10, atol=1e-10 * float(rg.abs().max()),
                                       msg=lambda s: f"{sharing}: {name}: {s}")
    # not vacuous: tree modes shared rows, and windows computed fewer rows than within
    computed = {k: runs[k][0]["computed_tokens"] for k in runs}
    assert computed["windows"] < computed["within"] < computed["off"], computed
    # the default reads the data's old log-probs: these rollouts have none
    with Trainer.from_args(_driver_argv("within", len(records))) as t:
        with pytest.raises(ObjectiveDataError, match=r"old_logprobs.*--rl-old-logprobs current"):
            t.step(records)
