"""RL updates (training/rl_update.py, the new objective flags), exact tree vs expanded and vs plain references.

- objective level (fp64 log-prob tables of tests/test_rl_objectives.py): KL estimators k1/k2/k3 to
  reference log-probs, GSPO's sequence-level ratio, token/sequence truncated or masked rollout
  weights, seq-mean-token-sum-norm and recomputed old log-probs: every microbatch split of the
  targets sums to the plain per-trajectory reference (value, terms, gradients); hand-computed values;
- driver level (tiny hybrid MoE model, fp64): a recipe update (recompute, reference model from
  --ref-load, TIS, 2 mini-batches x 2 epochs, sequence-level ratio) gives the same per-step losses,
  gradients and weights in expanded mode and both tree modes; ``recompute`` with one mini-batch is
  ``current``; a reference equal to the policy gives KL 0, the data's ``ref_logprobs`` from
  ``Trainer.logprobs`` equal ``--ref-load``'s; ``Trainer.logprobs`` is the same in every mode and
  equals transformers on the exported checkpoint; mini-batches keep groups whole; refusals; data
  parallel 2 and pipeline size 2 give the single-process numbers;
- tools/score_logprobs.py, examples/rl_recipe_cpu.py (the command docs/training.md shows) and
  benchmarks/bench_throughput.py --rl-recipe run.
"""
import itertools
import math

import numpy as np
import pytest
import torch

from megatron_harts.layout import build_layout
from megatron_harts.rl.objectives import (KL_ESTIMATORS, ObjectiveConfig, kl_penalty, objective_loss,
                                          objective_loss_reference, sequence_log_ratio, target_scale, tis_weights)
from test_rl_objectives import Case, _records, assert_rel, microbatch_splits

NORM = 12


# ---------------------------------------------------------------------------
# objective level
# ---------------------------------------------------------------------------

def _per_position(case, seed, spread):
    """Per-trajectory per-position arrays near the data's old log-probs (a function of the prefix)."""
    rng = np.random.default_rng(seed)
    by_prefix, out = {}, []
    for tr in case.trajs:
        base = np.full(len(tr), -1.0) if tr.old_logprobs is None else np.nan_to_num(tr.old_logprobs, nan=-1.0)
        out.append(np.array([base[j] + by_prefix.setdefault((tuple(tr.tokens[:j + 1]), j), rng.normal(0, spread))
                             for j in range(len(tr))]))
    return out


@pytest.fixture(scope="module")
def case():
    return Case(_records())


@pytest.fixture(scope="module")
def arrays(case):
    return {"ref": _per_position(case, 1, 0.3), "rollout": _per_position(case, 2, 0.4),
            "recomputed": _per_position(case, 3, 0.25)}


def _target_lookup(case, lay, idx, per_traj):
    """Per-target values of per-trajectory per-position arrays (by forest trajectory and position)."""
    by_id = {tr.id: torch.as_tensor(a, dtype=torch.float64) for tr, a in zip(case.trajs, per_traj)}
    ids = [case.forest.traj_ids[int(t)] for t in torch.from_numpy(lay.traj_forest)[lay.target_traj]]
    vals = torch.stack([by_id[i][int(p)] for i, p in zip(ids, lay.target_position)]) if ids else \
        torch.zeros(0, dtype=torch.float64)
    return vals if idx is None else vals[idx]


def _tree_loss(case, mbs, cfg, arrays):
    """Sum over microbatches, the per-target inputs an RL update computes before the step."""
    whole = build_layout(case.forest)
    traj_all = torch.from_numpy(whole.traj_forest)[whole.target_traj]
    old_all = _target_lookup(case, whole, None, arrays["recomputed"]) if cfg.old_logprobs == "recompute" \
        else whole.target_old_logprob
    lp_all = case.table[whole.forest_rows[whole.target_row], whole.target_token].detach()
    key = {(int(t), int(p)): i for i, (t, p) in enumerate(zip(traj_all, whole.target_position))}
    # the forward-only pass of the step: each trajectory's mean (logp - old); rollout weights from old
    seq_all = sequence_log_ratio(lp_all - old_all, traj_all, case.forest.num_trajectories, mean=True)
    roll_all = _target_lookup(case, whole, None, arrays["rollout"])
    d = old_all - roll_all
    if cfg.tis_level == "sequence":
        d = sequence_log_ratio(d, traj_all, case.forest.num_trajectories, mean=False)
    tis_all = tis_weights(d, cfg.tis_cap, cfg.tis_mode) if cfg.tis_cap is not None else None
    total, terms = 0.0, {}
    for lay, idx in mbs:
        lp, ent, old, adv, traj, weight = case.target_values(lay, idx)
        pos = lay.target_position if idx is None else lay.target_position[idx]
        at = torch.tensor([key[(int(t), int(p))] for t, p in zip(traj, pos)], dtype=torch.int64)
        if cfg.old_logprobs == "recompute":
            old = old_all[at]
        kw = {"ref_logprobs": _target_lookup(case, lay, idx, arrays["ref"])}
        if cfg.ratio_level == "sequence":
            kw["seq_log_ratio"] = seq_all[at]
        if tis_all is not None:
            kw["tis_weight"] = tis_all[at]
        scale = target_scale(case.normalizer, traj, weight, cfg.loss_agg_mode, cfg.loss_norm_length)
        loss, t = objective_loss(lp, old, adv, scale, cfg, entropy=ent, **kw)
        loss.backward()
        total = total + loss.detach()
        for k, v in t.items():
            terms[k] = terms.get(k, 0.0) + v
    return total, terms


def _reference(case, cfg, arrays):
    lps, ents = case.expanded_values()
    old = arrays["recomputed"] if cfg.old_logprobs == "recompute" else None
    loss, terms = objective_loss_reference(lps, case.trajs, cfg, ents, old_logprobs=old, ref_logprobs=arrays["ref"],
                                           rollout_logprobs=arrays["rollout"])
    loss.backward()
    return loss.detach(), terms


CONFIGS = (
    [ObjectiveConfig(kind=k, kl_coef=0.2, kl_estimator=e, entropy_coef=0.03, loss_agg_mode="seq-mean-token-mean")
     for k, e in itertools.product(("sft", "ppo"), KL_ESTIMATORS)]
    + [ObjectiveConfig(ratio_level="sequence", loss_agg_mode=m, clip_ratio_low=lo, clip_ratio_high=hi,
                       old_logprobs=o, loss_norm_length=NORM)
       for m, (lo, hi), o in itertools.product(("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"),
                                               ((0.2, 0.28), (0.003, 0.004)), ("data", "recompute"))]
    + [ObjectiveConfig(tis_cap=cap, tis_level=lvl, tis_mode=mode, old_logprobs=o, kl_coef=0.1, kl_estimator="k2",
                       loss_agg_mode="seq-mean-token-sum-norm", loss_norm_length=NORM)
       for cap, lvl, mode, o in itertools.product((1.2, 5.0), ("token", "sequence"), ("truncate", "mask"),
                                                  ("data", "recompute"))]
    + [ObjectiveConfig(tis_cap=2.0, ratio_level="sequence", old_logprobs="recompute", kl_coef=0.05, kl_to="old")])


def _cfg_id(c):
    return (f"{c.kind}-{c.loss_agg_mode}-{c.old_logprobs}-kl{c.kl_coef}{c.kl_estimator}{c.kl_to}-r{c.ratio_level}-"
            f"tis{c.tis_cap}{c.tis_level}{c.tis_mode}-clip{c.clip_ratio_low}")


@pytest.mark.parametrize("cfg", CONFIGS, ids=_cfg_id)
def test_new_flags_microbatch_sum_equals_reference(case, arrays, cfg):
    case.zero_grad()
    ref, ref_terms = _reference(case, cfg, arrays)
    ref_grads = case.grads()
    assert float(ref_grads[0].abs().max()) > 0
    for name, mbs in microbatch_splits(case).items():
        case.zero_grad()
        got, terms = _tree_loss(case, mbs, cfg, arrays)
        assert_rel(got, ref, what=f"{name} loss")
        assert terms.keys() == ref_terms.keys()
        for k in terms:
            assert abs(float(terms[k]) - float(ref_terms[k])) <= 1e-12 * max(abs(float(ref_terms[k])), 1.0), (name, k)
        for g, rg in zip(case.grads(), ref_grads):
            torch.testing.assert_close(g, rg, rtol=1e-12, atol=1e-15, msg=lambda m: f"{name}: {m}")


def test_flags_change_the_loss(case, arrays):
    """Not vacuous: each new flag moves the loss (the clip bounds of the tight GSPO config bind)."""
    def value(cfg):
        case.zero_grad()
        return float(_reference(case, cfg, arrays)[0])
    base = ObjectiveConfig()
    for kw in ({"ratio_level": "sequence"}, {"tis_cap": 1.2}, {"tis_cap": 1.2, "tis_mode": "mask"},
               {"tis_cap": 1.2, "tis_level": "sequence"}, {"old_logprobs": "recompute"}):
        assert abs(value(ObjectiveConfig(**kw)) - value(base)) > 1e-6, kw
    k = [value(ObjectiveConfig(kl_coef=0.2, kl_estimator=e)) for e in KL_ESTIMATORS]
    assert len({round(v, 9) for v in k}) == 3
    case.zero_grad()
    _, terms = _reference(case, ObjectiveConfig(ratio_level="sequence", clip_ratio_low=0.003, clip_ratio_high=0.004),
                          arrays)
    assert 0.0 < float(terms["clip_fraction"]) < 1.0


def test_hand_computed():
    d = torch.tensor([0.5, -0.25], dtype=torch.float64)
    logp, target = d - 1.0, torch.full((2,), -1.0, dtype=torch.float64)
    torch.testing.assert_close(kl_penalty(logp, target, "k1"), d)
    torch.testing.assert_close(kl_penalty(logp, target, "k2"), 0.5 * d * d)
    torch.testing.assert_close(kl_penalty(logp, target, "k3"), torch.exp(-d) + d - 1.0)
    r = torch.log(torch.tensor([0.5, 1.5, 3.0], dtype=torch.float64))
    torch.testing.assert_close(tis_weights(r, 2.0, "truncate"), torch.tensor([0.5, 1.5, 2.0], dtype=torch.float64))
    torch.testing.assert_close(tis_weights(r, 2.0, "mask"), torch.tensor([0.5, 1.5, 0.0], dtype=torch.float64))
    # GSPO: one trajectory, targets logp - old = (0.2, -0.1, 0.5): ratio exp(0.2) for all three, A = 1,
    # clip 0.1 / 0.1 -> every token at 1.1 (no gradient); seq-mean-token-mean: -1.1
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    old = logp.detach() - torch.tensor([0.2, -0.1, 0.5], dtype=torch.float64)
    seq = torch.full((3,), 0.2, dtype=torch.float64)
    cfg = ObjectiveConfig(ratio_level="sequence", clip_ratio_low=0.1, clip_ratio_high=0.1,
                          loss_agg_mode="seq-mean-token-mean")
    scale = torch.full((3,), 1 / 3, dtype=torch.float64)
    loss, terms = objective_loss(logp, old, torch.ones(3, dtype=torch.float64), scale, cfg, seq_log_ratio=seq)
    assert math.isclose(float(loss.detach()), -1.1, rel_tol=1e-14) and math.isclose(float(terms["clip_fraction"]), 1.0)
    loss.backward()
    assert float(logp.grad.abs().max()) == 0.0
    # unclipped: gradient exp(0.2) * A * scale per token
    logp.grad = None
    cfg = ObjectiveConfig(ratio_level="sequence", clip_ratio_low=0.5, clip_ratio_high=0.5)
    loss, _ = objective_loss(logp, old, torch.ones(3, dtype=torch.float64), scale, cfg, seq_log_ratio=seq)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.full((3,), -math.exp(0.2) / 3, dtype=torch.float64))


@pytest.mark.parametrize("kw,msg", [
    ({"kl_estimator": "k4"}, "--kl-estimator must be one of k1, k2, k3"),
    ({"tis_cap": 0.0}, "--rl-tis-cap must be > 0.0"),
    ({"tis_cap": 2.0, "old_logprobs": "current"}, "use --rl-old-logprobs recompute"),
    ({"kind": "sft", "ratio_level": "sequence"}, "--rl-ratio-level only applies to --rl-objective ppo"),
    ({"loss_agg_mode": "seq-mean-token-sum-norm"}, "needs --rl-loss-norm-length"),
    ({"loss_norm_length": 0}, "--rl-loss-norm-length must be >= 1"),
    ({"loss_norm_length": 2.5}, "--rl-loss-norm-length must be an integer"),
    ({"kind": "sft", "old_logprobs": "recompute"}, "--rl-old-logprobs recompute only applies"),
])
def test_bad_config(kw, msg):
    with pytest.raises(ValueError, match="ObjectiveConfig") as e:
        ObjectiveConfig(**kw)
    assert msg in str(e.value)


def test_kl_to_ref_needs_reference(case):
    lay = build_layout(case.forest)
    lp, ent, old, adv, traj, weight = case.target_values(lay)
    scale = target_scale(case.normalizer, traj, weight, "token-mean")
    with pytest.raises(ValueError, match="--kl-to ref needs reference log-probs"):
        objective_loss(lp, old, adv, scale, ObjectiveConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="ref_logprobs.*score_logprobs"):
        objective_loss(lp, old, adv, scale, ObjectiveConfig(kl_coef=0.1), ref_logprobs=torch.full_like(lp, math.nan))


# ---------------------------------------------------------------------------
# driver level
# ---------------------------------------------------------------------------

def _driver_records(seed=3):
    from test_training_driver import rollouts
    rng = np.random.default_rng(seed)
    out = []
    for t in rollouts():
        n = len(t.tokens)
        out.append({"id": t.id, "tokens": t.tokens.tolist(), "loss_mask": t.loss_mask.tolist(),
                    "advantage": t.advantage, "weight": t.weight, "old_logprobs": t.old_logprobs.tolist(),
                    "group": t.id.split("/")[0],
                    "rollout_logprobs": (-4.1 + rng.normal(0, 0.3, n)).tolist()})
    return out


def _argv(sharing, *extra, n=8):
    from test_training_driver import MODEL
    planner = {"off": "ffd", "within": "l1", "windows": "l1l2"}[sharing]
    return MODEL + ["--global-batch-size", str(n), "--train-iters", "1", "--seq-length", "48",
                    "--tree-microbatch-tokens", "48", "--tree-sharing", sharing, "--tree-planner", planner,
                    "--lr", "1e-3", "--seed", "7", "--log-interval", "1000", "--rl-objective", "ppo", *extra]


def _grads(t):
    return {n: p.main_grad.detach().clone() for n, p in t.model[0].module.named_parameters()}


def _params(t):
    return {n: p.detach().clone() for n, p in t.model[0].module.named_parameters()}


@pytest.fixture(scope="module")
def initial_checkpoint(tmp_path_factory):
    """The initial weights of the driver model (seed 7), saved by the driver: a reference model."""
    from megatron_harts.training.trainer import Trainer
    d = tmp_path_factory.mktemp("ref") / "ckpt"
    with Trainer.from_args(_argv("within", "--save", str(d), "--save-interval", "1")) as t:
        t.save(announce=False)
    return str(d)


RECIPE = ["--rl-old-logprobs", "recompute", "--kl-coef", "0.05", "--kl-estimator", "k3", "--rl-tis-cap", "1.5",
          "--rl-mini-batches", "2", "--rl-epochs", "2", "--rl-ratio-level", "sequence", "--entropy-coef", "0.01",
          "--loss-agg-mode", "seq-mean-token-mean", "--clip-ratio-high", "0.28"]


OTHER = ["--rl-old-logprobs", "data", "--kl-coef", "0.05", "--kl-to", "old", "--kl-estimator", "k1",
         "--rl-tis-cap", "1.2", "--rl-tis-level", "sequence", "--rl-tis-mode", "mask", "--rl-mini-batches", "2",
         "--rl-epochs", "2", "--loss-agg-mode", "seq-mean-token-sum-norm", "--rl-loss-norm-length", "20"]


@pytest.mark.parametrize("flags", ["recipe", "other"])
def test_recipe_update_tree_equals_expanded(initial_checkpoint, flags):
    """recipe: recompute + reference + TIS + 2 mini-batches x 2 epochs + GSPO; other: the data's old
    log-probs, k1 KL to them, sequence-level masked TIS, Dr.GRPO aggregation, 2 x 2: 4 optimizer steps,
    the same losses, objective terms, last gradients and final weights in every mode."""
    from megatron_harts.training.trainer import Trainer
    recs = _driver_records()
    if flags == "other":      # engine log-probs near the data's old ones, so that masking leaves some sequences
        rng = np.random.default_rng(9)
        recs = [dict(r, rollout_logprobs=(np.array(r["old_logprobs"]) + rng.normal(0, 0.02, len(r["tokens"])))
                     .tolist()) for r in recs]
    extra = RECIPE + ["--ref-load", initial_checkpoint] if flags == "recipe" else OTHER
    runs = {}
    for sharing in ("off", "within", "windows"):
        with Trainer.from_args(_argv(sharing, *extra)) as t:
            m = t.step(recs)
            steps = t.last_update.steps
            runs[sharing] = (m, [s.loss for s in steps], [s.terms for s in steps], _grads(t), _params(t),
                             [s.computed_tokens for s in steps], t.last_update.minibatch_trees)
    m0, losses0, terms0, g0, p0, comp0, trees0 = runs["off"]
    assert m0["optimizer_steps"] == 4 and len(losses0) == 4 and all(math.isfinite(v) for v in losses0)
    assert {"rollout/abs_diff_mean", "rollout/abs_diff_max", "rollout/kl"} <= set(m0)
    assert m0["rollout/abs_diff_max"] >= m0["rollout/abs_diff_mean"] > 0 and m0["rollout/kl"] > 0
    if flags == "recipe":
        assert abs(terms0[0]["kl"]) < 1e-12          # the reference is the initial policy
        assert terms0[1]["kl"] > 0                   # after one update it is not
    assert any(float(g.abs().max()) > 0 for g in g0.values())
    for sharing in ("within", "windows"):
        m, losses, terms, g, p, comp, trees = runs[sharing]
        assert trees == trees0
        for a, b in zip(losses, losses0):
            assert abs(a - b) <= 1e-10 * abs(b), (sharing, losses, losses0)
        for ta, tb in zip(terms, terms0):
            for k in tb:
                assert abs(ta[k] - tb[k]) <= 1e-10 * max(abs(tb[k]), 1e-3), (sharing, k)
        for k in ("rollout/abs_diff_mean", "rollout/abs_diff_max", "rollout/kl"):
            assert abs(m[k] - m0[k]) <= 1e-10 * abs(m0[k])
        for name, rg in g0.items():
            torch.testing.assert_close(g[name], rg, rtol=1e-10, atol=1e-10 * float(rg.abs().max()) + 1e-300,
                                       msg=lambda s: f"{sharing} grad {name}: {s}")
            torch.testing.assert_close(p[name], p0[name], rtol=1e-10, atol=1e-12)
        assert sum(comp) < sum(comp0)        # trees computed fewer rows


def test_recompute_with_one_minibatch_is_current():
    """With one mini-batch and one epoch the recomputed old log-probs are the current ones: the update equals
    --rl-old-logprobs current (another code path: a forward-only pass, then the step)."""
    from megatron_harts.training.trainer import Trainer
    recs = _driver_records()
    out = {}
    for src in ("current", "recompute"):
        with Trainer.from_args(_argv("within", "--rl-old-logprobs", src, "--entropy-coef", "0.01")) as t:
            m = t.step(recs)
            out[src] = (m, _grads(t))
    (mc, gc), (mr, gr) = out["current"], out["recompute"]
    assert abs(mr["loss"] - mc["loss"]) <= 1e-12 * abs(mc["loss"]) and mr["objective/clip_fraction"] == 0.0
    for name in gc:
        torch.testing.assert_close(gr[name], gc[name], rtol=1e-10, atol=1e-14)


def test_logprobs_modes_reference_and_data_ref(initial_checkpoint):
    """Trainer.logprobs: the same in every mode, entropies too; the reference pass of --ref-load equals
    ref_logprobs in the records (scored by Trainer.logprobs at the same weights), also offloaded."""
    from megatron_harts.training.trainer import Trainer
    recs = _driver_records()[:10]
    got = {}
    for sharing in ("off", "within", "windows"):
        with Trainer.from_args(_argv(sharing, "--load", initial_checkpoint, "--finetune")) as t:
            got[sharing] = t.logprobs(recs, entropy=True)
    lp0, ent0 = got["off"]
    assert [len(a) for a in lp0] == [len(r["tokens"]) for r in recs]
    assert all(math.isnan(a[0]) and not np.isnan(a[1:]).any() and (a[1:] < 0).all() for a in lp0)
    for sharing in ("within", "windows"):
        lp, ent = got[sharing]
        for a, b in zip(lp, lp0):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
        for a, b in zip(ent, ent0):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    scored = [dict(r, ref_logprobs=[None] + a[1:].tolist()) for r, a in zip(recs, lp0)]
    flags = ["--kl-coef", "0.1", "--kl-estimator", "k2", "--rl-old-logprobs", "recompute"]
    results = {}
    for how, extra, data in (("data", [], scored),
                             ("device", ["--ref-load", initial_checkpoint], recs),
                             ("offload", ["--ref-load", initial_checkpoint, "--ref-placement", "offload"], recs)):
        with Trainer.from_args(_argv("within", *flags, *extra)) as t:
            m = t.step(data)
            results[how] = (m, _grads(t))
            if how != "data":
                assert m["ref_model_gib"] > 0
    m_data, g_data = results["data"]
    assert abs(m_data["objective/kl"]) < 1e-20        # the reference is the policy before the step
    for how in ("device", "offload"):
        m, g = results[how]
        assert abs(m["loss"] - m_data["loss"]) <= 1e-12 * abs(m_data["loss"])
        for name in g:
            torch.testing.assert_close(g[name], g_data[name], rtol=1e-10, atol=1e-14)


def test_logprobs_equal_transformers(tmp_path):
    """Trainer.logprobs of the driver model against transformers' KimiLinearForCausalLM on the exported
    checkpoint, and a second trainer (expanded mode, another seed) loading that transformers directory gives
    the same log-probs."""
    transformers = pytest.importorskip("transformers")
    from megatron_harts.training.trainer import Trainer
    recs = _driver_records()[:4]
    with Trainer.from_args(_argv("within", "--norm-epsilon", "1e-6")) as t:
        t.export_hf(str(tmp_path / "hf"))
        ours = t.logprobs(recs)
    with Trainer.from_args(_argv("off", "--norm-epsilon", "1e-6", "--seed", "11")) as t:
        t.load_weights(str(tmp_path / "hf"))
        again = t.logprobs(recs)
    # float64 weights, the experts through the eager loop (transformers' default grouped GEMM takes no float64);
    # transformers' Kimi-Linear code still computes some parts in float32 whatever the weights' dtype (RMSNorm,
    # the KDA core, its gate and output norm, the router, the attention softmax; the router weight, dt_bias and
    # e_score_correction_bias are kept in float32): measured max |difference| 1.5e-7, hence the tolerance 1e-6
    hf = transformers.KimiLinearForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float64,
                                                            experts_implementation="eager").eval()
    assert hf.model.embed_tokens.weight.dtype == torch.float64
    with torch.no_grad():
        for rec, a, b in zip(recs, ours, again):
            toks = torch.tensor(rec["tokens"])[None]
            logp = hf(toks).logits[0].double().log_softmax(-1)
            want = logp[torch.arange(len(rec["tokens"]) - 1), toks[0, 1:]].numpy()
            np.testing.assert_allclose(a[1:], want, rtol=1e-6, atol=1e-6)
            # transformers keeps dt_bias and the router in float32: the reloaded weights differ there by rounding
            np.testing.assert_allclose(b, a, rtol=1e-7, atol=1e-7)


def test_minibatches_keep_groups_whole():
    from megatron_harts.training.rl_update import minibatch_trees
    from megatron_harts.tree_data import build_forest, make_trajectory
    recs = _driver_records()
    # two prompts of task 0 in one group "g": their trees must stay in one mini-batch
    recs = [dict(r, group="g") if r["id"].startswith(("t0/", "t1/")) else r for r in recs]
    forest = build_forest([make_trajectory(r) for r in recs])
    traj_tree = forest.seg_tree[forest.traj_leaf]
    for m in (1, 2):
        parts = minibatch_trees(forest, m)
        assert sorted(sum(parts, [])) == list(range(forest.num_trees)) and len(parts) == m
        for part in parts:
            groups = {forest.traj_group[t] for t in range(forest.num_trajectories) if traj_tree[t] in part}
            others = {forest.traj_group[t] for t in range(forest.num_trajectories) if traj_tree[t] not in part}
            assert not groups & others
    with pytest.raises(ValueError, match="--rl-mini-batches 3: the global batch has 2 group"):
        minibatch_trees(forest, 3)


def test_driver_refusals(tmp_path):
    from test_arguments import parse, refused
    from megatron_harts.training import arguments as A
    # the data may carry rollout_logprobs and ref_logprobs: these parse, the data is checked when read
    parse("--rl-tis-cap 2 --rl-old-logprobs recompute --kl-coef 0.1")
    refused(f"--kl-coef 0.1 --ref-load {tmp_path / 'nope'}", "--ref-load", "no such directory")
    refused(f"--ref-load {tmp_path}", "--ref-load", "--kl-coef > 0")
    refused("--rl-mini-batches 0", "--rl-mini-batches")
    refused("--rl-tis-cap 0", "--rl-tis-cap")
    refused("--rl-ratio-level seq", "--rl-ratio-level")
    refused("--rl-objective sft --rl-ratio-level sequence", "--rl-ratio-level only applies to --rl-objective ppo")
    help_text = A.build_parser().format_help()
    for f in ("--kl-estimator {k1,k2,k3}", "--rl-ratio-level {token,sequence}", "--ref-placement {device,offload}",
              "--rl-mini-batches INT", "--rl-loss-norm-length INT"):
        assert f in help_text
    args = parse("--loss-agg-mode seq-mean-token-sum-norm --rl-mini-batches 4 --rl-epochs 2")
    assert args.rl_loss_norm_length == args.seq_length
    assert A.rl_update_kwargs(args) == {"mini_batches": 4, "epochs": 2, "ref_load": None, "ref_placement": "device"}


def test_trainer_step_data_errors():
    from megatron_harts.training.trainer import Trainer
    recs = _driver_records()[:6]
    bad = [dict(r) for r in recs]
    bad[2]["rollout_logprobs"] = bad[2]["rollout_logprobs"][:-1]
    with Trainer.from_args(_argv("within", "--rl-old-logprobs", "recompute", "--rl-tis-cap", "2")) as t:
        with pytest.raises(ValueError, match=r"line 3: trajectory 't0/b1/s0': field 'rollout_logprobs': has \d+ "
                                             r"entries but 'tokens' has \d+"):
            t.step(bad)
        with pytest.raises(ValueError, match=r"--rl-tis-cap 2.0: the trajectories carry no `rollout_logprobs`"):
            t.step([{k: v for k, v in r.items() if k != "rollout_logprobs"} for r in recs])
        some = [dict(r) for r in recs]
        del some[4]["rollout_logprobs"]
        with pytest.raises(ValueError, match=r"trajectory 't0/b2/s0': --rl-tis-cap 2.0 needs `rollout_logprobs` at "
                                             r"every trained token"):
            t.step(some)


# ---------------------------------------------------------------------------
# tools/score_logprobs.py
# ---------------------------------------------------------------------------

def test_score_logprobs_tool(initial_checkpoint, tmp_path, capsys):
    """JSONL and Parquet out, the records unchanged but the field, values equal to Trainer.logprobs at the
    checkpoint's weights; progress on stderr; --help; bad input is one error line."""
    import json

    import pyarrow.parquet as pq
    from test_training_driver import MODEL
    from tool_runner import assert_one_error, load_tool, run_tool
    from megatron_harts.training.trainer import Trainer
    tool = load_tool("score_logprobs")
    recs = _driver_records()[:7]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    flags = MODEL + ["--seq-length", "48", "--tree-microbatch-tokens", "48", "--seed", "3"]
    code, out, err = run_tool(tool, capsys, "--input", src, "--output", tmp_path / "out.jsonl", "--checkpoint",
                              initial_checkpoint, "--batch-trajectories", "4", *flags)
    assert code == 0, err
    assert "scored 4/7 trajectories" in err and "scored 7/7 trajectories" in err
    got = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    with Trainer.from_args(_argv("off", "--load", initial_checkpoint, "--finetune")) as t:
        want = t.logprobs(recs)
    assert [g["id"] for g in got] == [r["id"] for r in recs]
    for g, r, w in zip(got, recs, want):
        assert {k: v for k, v in g.items() if k != "old_logprobs"} == {k: v for k, v in r.items()
                                                                        if k != "old_logprobs"}
        assert g["old_logprobs"][0] is None
        np.testing.assert_allclose(np.array(g["old_logprobs"][1:]), w[1:], rtol=1e-12, atol=1e-12)
    code, _, err = run_tool(tool, capsys, "--input", src, "--output", tmp_path / "out.parquet", "--checkpoint",
                            initial_checkpoint, "--field", "ref_logprobs", *flags)
    assert code == 0, err
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    np.testing.assert_allclose(np.array(rows[2]["ref_logprobs"][1:]), want[2][1:], rtol=1e-12, atol=1e-12)
    code, out, _ = run_tool(tool, capsys, "--help")
    assert code == 0 and "--checkpoint" in out and "--field" in out
    assert_one_error(*run_tool(tool, capsys, "--input", tmp_path / "nope.jsonl", "--output", tmp_path / "o.jsonl",
                               "--checkpoint", initial_checkpoint, *flags)[::2], "--input", "nope.jsonl")
    assert_one_error(*run_tool(tool, capsys, "--input", src, "--output", tmp_path / "o.csv", "--checkpoint",
                               initial_checkpoint, *flags)[::2], "--output", ".parquet")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(recs[0]) + "\n" + json.dumps({"id": "x", "tokens": [1, -2]}) + "\n")
    assert_one_error(*run_tool(tool, capsys, "--input", bad, "--output", tmp_path / "o.jsonl", "--checkpoint",
                               initial_checkpoint, *flags)[::2], "bad.jsonl", "tokens")
    assert_one_error(*run_tool(tool, capsys, "--input", src, "--output", tmp_path / "o.jsonl", "--checkpoint",
                               tmp_path, *flags)[::2], "--checkpoint", "no checkpoint")
    assert not (tmp_path / "o.jsonl").exists()


# ---------------------------------------------------------------------------
# examples/rl_recipe_cpu.py (docs/training.md shows this command)
# ---------------------------------------------------------------------------

DOC_COMMAND = "python examples/rl_recipe_cpu.py --iterations 3"


def test_recipe_example_prints_its_loss_curve(tmp_path, capsys):
    import os
    from tool_runner import ROOT, load_tool
    with open(os.path.join(ROOT, "docs", "training.md")) as f:
        assert DOC_COMMAND in f.read()
    example = load_tool("rl_recipe_cpu", folder="examples")
    assert example.main(DOC_COMMAND.split()[2:] + ["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    i = next(k for k, line in enumerate(out) if line.startswith("iteration"))
    rows = [line.split() for line in out[i + 1:] if line.strip() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2, 3]
    values = np.array([[float(x) for x in r[1:]] for r in rows])
    assert np.isfinite(values).all()
    assert (values[:, 4] == 4).all()                           # 4 mini-batches: 4 optimizer steps per iteration
    assert (values[:, 3] > 0).all()                            # the engine gap is measured
    assert values[-1, 5] > values[0, 5]                        # completions with a positive advantage gain log-prob


# ---------------------------------------------------------------------------
# benchmarks/bench_throughput.py --rl-recipe (the GPU measurement of a recipe update runs this)
# ---------------------------------------------------------------------------

def test_bench_throughput_runs_a_recipe_update(tmp_path):
    import json
    from tool_runner import load_tool
    bt = load_tool("bench_throughput", folder="benchmarks")
    out = tmp_path / "t.json"
    bt.main(["--device", "cpu", "--preset", "tiny", "--schemes", "tree-step", "--num-tasks", "4",
             "--samples-per-task", "2", "--max-tokens", "256", "--microbatch-tokens", "1024", "--iters", "1",
             "--warmup", "0", "--tree-sharing", "within", "--kda-backend", "reference", "--attention-backend",
             "reference", "--no-cosine", "--rl-recipe", "--rl-mini-batches", "4", "--out", str(out)])
    row = json.loads(out.read_text())["schemes"]["tree-step"]
    tree, exp = row["tree_within"], row["expanded"]
    for m in (tree, exp):
        assert m["microbatches"] >= 4 and math.isfinite(m["loss"])
    # the same update in both modes (fp32 on the CPU: to rounding)
    assert abs(tree["loss"] - exp["loss"]) <= 1e-5 * max(abs(exp["loss"]), 1e-3)
    assert tree["rows_computed"] < exp["rows_computed"]


# ---------------------------------------------------------------------------
# data parallel 2: the forward-only passes sum their replicas' targets
# ---------------------------------------------------------------------------

def _dp2_worker(rank, world, port, ref, out):
    from test_training_driver import _params as full_params, _world
    from megatron_harts.training.trainer import Trainer
    _world(rank, world, port)
    recs = _driver_records()
    runs = {}
    for sharing in ("off", "within"):
        with Trainer.from_args(_argv(sharing, *RECIPE, "--ref-load", ref, n=len(recs))) as t:
            lps = t.logprobs(recs[:9])
            t.step(recs)
            runs[sharing] = ([s.loss for s in t.last_update.steps], full_params(t), lps)
    if rank == 0:
        torch.save(runs, out)


def test_dp2_recipe_update_and_logprobs(initial_checkpoint, tmp_path):
    from megatron_cpu import free_port
    from multiproc import run_ranks
    from megatron_harts.training.trainer import Trainer
    out = tmp_path / "out.pt"
    run_ranks(_dp2_worker, 2, (free_port(), initial_checkpoint, str(out)), timeout=600)
    runs = torch.load(out, weights_only=False)
    with Trainer.from_args(_argv("within", "--load", initial_checkpoint, "--finetune")) as t:
        single = t.logprobs(_driver_records()[:9])
    (l_off, p_off, lp_off), (l_in, p_in, lp_in) = runs["off"], runs["within"]
    assert len(l_off) == 4
    for a, b in zip(l_in, l_off):
        assert abs(a - b) <= 1e-10 * abs(b)
    for k in p_off:
        torch.testing.assert_close(p_in[k], p_off[k], rtol=1e-10, atol=1e-12)
    for a, b, c in zip(lp_in, lp_off, single):
        np.testing.assert_allclose(a, c, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(b, c, rtol=1e-12, atol=1e-12)


def test_rollout_metrics_without_correction_and_on_policy():
    """rollout_logprobs without --rl-tis-cap: the metrics only (the loss is the one without them); with
    --rl-old-logprobs current there are no trainer old log-probs to compare: no metrics."""
    from megatron_harts.training.trainer import Trainer
    recs = _driver_records()[:10]
    plain = [{k: v for k, v in r.items() if k != "rollout_logprobs"} for r in recs]
    out = {}
    for name, data, src in (("with", recs, "data"), ("without", plain, "data"), ("current", recs, "current")):
        with Trainer.from_args(_argv("within", "--rl-old-logprobs", src)) as t:
            out[name] = t.step(data)
    assert "rollout/kl" in out["with"] and "rollout/kl" not in out["without"] and "rollout/kl" not in out["current"]
    assert out["with"]["loss"] == out["without"]["loss"]
    d = np.concatenate([(np.array(r["old_logprobs"]) - np.array(r["rollout_logprobs"]))[1:][np.array(r["loss_mask"][1:]) == 1]
                        for r in recs])
    assert math.isclose(out["with"]["rollout/abs_diff_mean"], float(np.abs(d).mean()), rel_tol=1e-12)
    assert math.isclose(out["with"]["rollout/abs_diff_max"], float(np.abs(d).max()), rel_tol=1e-12)
    assert math.isclose(out["with"]["rollout/kl"], float((np.exp(d) - d - 1).mean()), rel_tol=1e-12)


def _pp2_worker(rank, world, port, ref, out):
    from test_training_driver import _world
    from megatron_harts.training.trainer import Trainer
    _world(rank, world, port)
    recs = _driver_records()[:12]
    flags = ["--pipeline-model-parallel-size", "2", "--rl-old-logprobs", "recompute", "--kl-coef", "0.05",
             "--ref-load", ref, "--rl-mini-batches", "2", "--load", ref, "--finetune"]
    with Trainer.from_args(_argv("within", *flags, n=len(recs))) as t:
        lps = t.logprobs(recs[:5])
        t.step(recs)
        losses = [s.loss for s in t.last_update.steps]
    if rank == 0:
        torch.save((lps, losses), out)


def test_pp2_logprobs_and_recipe_update(initial_checkpoint, tmp_path):
    """Pipeline size 2 (both runs start from the saved initial weights): the forward-only passes run through
    the pipeline schedule; the log-probs and the update's losses are the single-stage run's."""
    from megatron_cpu import free_port
    from multiproc import run_ranks
    from megatron_harts.training.trainer import Trainer
    out = tmp_path / "out.pt"
    run_ranks(_pp2_worker, 2, (free_port(), initial_checkpoint, str(out)), timeout=600)
    lps, losses = torch.load(out, weights_only=False)
    recs = _driver_records()[:12]
    with Trainer.from_args(_argv("within", "--rl-old-logprobs", "recompute", "--kl-coef", "0.05", "--ref-load",
                                 initial_checkpoint, "--rl-mini-batches", "2", "--load", initial_checkpoint,
                                 "--finetune", n=len(recs))) as t:
        want = t.logprobs(recs[:5])
        t.step(recs)
        want_losses = [s.loss for s in t.last_update.steps]
    for a, b in zip(lps, want):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)
    for a, b in zip(losses, want_losses):
        assert abs(a - b) <= 1e-10 * abs(b)
