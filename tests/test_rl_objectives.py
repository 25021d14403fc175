"""RL objectives: the sum over any microbatch partition of a step's targets equals the expanded loss.

The "model" is a table of log-probs indexed by (forest row, token): a target predicted by row r
reads ``table[r, token]``, so trajectories that share a prefix share the values, exactly as a
real model computes one row once for every trajectory through it.  The oracle,
``objective_loss_reference``, sees only the original trajectories and per-position arrays
gathered along each trajectory's own path.
"""
import argparse
import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_harts.layout import build_layout
from megatron_harts.rl import (LOSS_AGG_MODES, ObjectiveConfig, ObjectiveDataError, batch_normalizer,
                               forest_normalizer, layout_target_scale, objective_loss, objective_loss_reference,
                               target_scale)
from megatron_harts.tree_data import Trajectory, build_forest, make_trajectory
from test_forest import trajectory_sets

VOCAB = 6
RNG_SEED = 1234


def _records():
    """Three trees: shared prompts, a fork, a trajectory ending inside another's path, loss masks
    that differ on a shared segment, scalar and per-token advantages, weights, and a trajectory
    without any target (and without advantage / old log-probs)."""
    P, Q = [1, 2, 3, 4], [0, 0, 1]
    recs = [
        {"id": "a0", "group": "a", "tokens": P + [5, 1, 2, 0, 3], "loss_mask": [0] * 4 + [1] * 5, "advantage": 1.5},
        {"id": "a1", "group": "a", "tokens": P + [5, 1, 4, 4], "loss_mask": [0] * 4 + [1, 0, 1, 1],
         "advantage": [0.0] * 4 + [0.9, -0.4, 2.0, -1.1]},
        {"id": "a2", "group": "a", "tokens": P + [5, 1], "loss_mask": [0] * 4 + [1, 1], "advantage": -0.7,
         "weight": 2.0},
        {"id": "a3", "group": "a", "tokens": P + [2] * 6, "loss_mask": [0] * 4 + [1] * 6, "advantage": -1.2,
         "weight": 0.5},
        {"id": "a4", "group": "a", "tokens": P + [3], "loss_mask": [0] * 5},
        {"id": "b0", "group": "b", "tokens": Q + [2, 3, 4, 5, 0, 1, 2, 3], "loss_mask": [0, 1, 0] + [1] * 4 + [0] + [1] * 3,
         "advantage": [0.0, 1.0, 0.0, -2.0, 0.5, 1.3, -0.2, 0.0, 0.8, -0.9, 1.7]},
        {"id": "b1", "group": "b", "tokens": Q + [2, 3, 5], "loss_mask": [0, 1, 0, 1, 1, 1], "advantage": 0.6,
         "weight": 1.5},
        {"id": "b2", "group": "b", "tokens": Q + [4], "loss_mask": [0, 1, 0, 1], "advantage": -0.3},
        {"id": "c0", "group": "c", "tokens": [3, 1, 4, 1, 5], "advantage": 0.3, "weight": 1.0},
    ]
    # old log-probs: a function of the prefix, so shared positions mostly agree ...
    rng = np.random.default_rng(RNG_SEED)
    by_prefix = {}
    for r in recs:
        if r["id"] == "a4":
            continue
        toks = r["tokens"]
        r["old_logprobs"] = [by_prefix.setdefault(tuple(toks[:j + 1]), float(rng.uniform(-2.0, -0.2)))
                             for j in range(len(toks))]
    # ... but not always: a1 disagrees with a0/a2 on the shared token at position 4
    recs[1]["old_logprobs"][4] -= 0.35
    return recs


class Case:
    """The forest, its trajectories as given, and differentiable per-(row, token) tables."""

    def __init__(self, records, seed=RNG_SEED):
        self.trajs = [make_trajectory(r, file="mem.jsonl", line=i + 1) for i, r in enumerate(records)]
        self.forest = build_forest(self.trajs)
        g = torch.Generator().manual_seed(seed)
        R = self.forest.num_rows
        self.table = (-0.2 - 1.8 * torch.rand(R, VOCAB, generator=g, dtype=torch.float64)).requires_grad_()
        self.ent_table = (0.5 + 1.5 * torch.rand(R, generator=g, dtype=torch.float64)).requires_grad_()
        self.normalizer = forest_normalizer(self.forest)

    def zero_grad(self):
        self.table.grad = None
        self.ent_table.grad = None

    def grads(self):
        return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in (self.table, self.ent_table)]

    # tree mode: per-target values read at the predicting row
    def target_values(self, lay, idx=None):
        frow = lay.forest_rows[lay.target_row]
        lp, ent = self.table[frow, lay.target_token], self.ent_table[frow]
        old, adv = lay.target_old_logprob, lay.target_advantage
        traj = torch.from_numpy(lay.traj_forest)[lay.target_traj]
        weight = lay.target_weight
        if idx is not None:
            lp, ent, old, adv, traj, weight = (x[idx] for x in (lp, ent, old, adv, traj, weight))
        return lp, ent, old, adv, traj, weight

    # expanded mode: per-position arrays along each trajectory's own path
    def expanded_values(self):
        lps, ents = [], []
        for tr in self.trajs:
            rows = torch.from_numpy(self.forest.trajectory_rows(self.forest.trajectory_index(tr.id)))
            toks = torch.from_numpy(tr.tokens)
            nan = torch.full((1,), math.nan, dtype=torch.float64)
            lps.append(torch.cat([nan, self.table[rows[:-1], toks[1:]]]))
            ents.append(torch.cat([nan, self.ent_table[rows[:-1]]]))
        return lps, ents


@pytest.fixture(scope="module")
def case():
    return Case(_records())


def microbatch_splits(case):
    """Several ways to split the step's targets over microbatches: lists of (layout, target index or None)."""
    f = case.forest
    rng = np.random.default_rng(7)
    whole = build_layout(f)
    splits = {"whole": [(whole, None)],
              "per-tree": [(build_layout(f, trees=[i]), None) for i in range(f.num_trees)]}
    owned = []
    for i in range(f.num_trees):
        segs = list(range(int(f.tree_offsets[i]), int(f.tree_offsets[i + 1])))
        part = rng.integers(0, 2, size=len(segs))
        for k in range(2):
            owned.append((build_layout(f, segments=segs, owned=[s for s, p in zip(segs, part) if p == k]), None))
    splits["owned-segments"] = owned
    pc = []
    for i in range(f.num_trees):
        root = int(f.tree_offsets[i])
        kids = f.children(root).tolist()
        if not kids:
            pc.append((build_layout(f, trees=[i]), None))
            continue
        producer = build_layout(f, segments=[root])
        pc.append((producer, None))
        pc += [(build_layout(f, roots=[c], context=producer), None) for c in kids]
    splits["producer-consumers"] = pc
    perm = torch.from_numpy(rng.permutation(whole.num_targets))
    splits["random-targets"] = [(whole, chunk) for chunk in torch.tensor_split(perm, 3)]
    return splits


def target_keys(case, mbs):
    keys = []
    for lay, idx in mbs:
        pos = lay.target_position if idx is None else lay.target_position[idx]
        traj = torch.from_numpy(lay.traj_forest)[lay.target_traj]
        traj = traj if idx is None else traj[idx]
        keys += list(zip(traj.tolist(), pos.tolist()))
    return sorted(keys)


def expanded_keys(case):
    keys = []
    for tr in case.trajs:
        t = case.forest.trajectory_index(tr.id)
        keys += [(t, j) for j in range(1, len(tr)) if tr.loss_mask[j] == 1]
    return sorted(keys)


def tree_loss(case, mbs, cfg, with_entropy=True):
    """Sum of objective_loss over the microbatches; backward per microbatch (grads accumulate)."""
    total, terms = 0.0, {}
    for lay, idx in mbs:
        lp, ent, old, adv, traj, weight = case.target_values(lay, idx)
        scale = target_scale(case.normalizer, traj, weight, cfg.loss_agg_mode, cfg.loss_norm_length)
        loss, t = objective_loss(lp, old, adv, scale, cfg, entropy=ent if with_entropy else None)
        loss.backward()
        total = total + loss.detach()
        for k, v in t.items():
            terms[k] = terms.get(k, 0.0) + v
    return total, terms


def reference_loss(case, cfg, with_entropy=True):
    lps, ents = case.expanded_values()
    loss, terms = objective_loss_reference(lps, case.trajs, cfg, ents if with_entropy else None)
    loss.backward()
    return loss.detach(), terms


def assert_rel(a, b, rtol=1e-12, what=""):
    a, b = float(a), float(b)
    assert abs(a - b) <= rtol * max(abs(b), 1e-300), f"{what}: {a!r} != {b!r}"


CLIPS = [(0.2, 0.2), (0.1, 0.28)]
#: the constant of seq-mean-token-sum-norm in these tests
NORM_LENGTH = 12
CONFIGS = [ObjectiveConfig(kind=k, loss_agg_mode=m, kl_coef=kl, entropy_coef=ec, clip_ratio_low=lo, clip_ratio_high=hi,
                           kl_to="old", loss_norm_length=NORM_LENGTH)
           for k, m, kl, ec, (lo, hi) in itertools.product(("sft", "ppo"), LOSS_AGG_MODES, (0.0, 0.3), (0.0, 0.05), CLIPS)
           if not (k == "sft" and (lo, hi) != CLIPS[0])]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.kind}-{c.loss_agg_mode}-kl{c.kl_coef}-ent{c.entropy_coef}-"
                                                        f"clip{c.clip_ratio_low}_{c.clip_ratio_high}")
def test_microbatch_sum_equals_expanded(case, cfg):
    """(a) loss and every term, (b) gradients w.r.t. the log-prob and entropy tables, for every split."""
    case.zero_grad()
    ref, ref_terms = reference_loss(case, cfg)
    ref_grads = case.grads()
    assert any(float(g.abs().max()) > 0 for g in ref_grads)
    want_keys = expanded_keys(case)
    for name, mbs in microbatch_splits(case).items():
        assert target_keys(case, mbs) == want_keys, name
        case.zero_grad()
        got, terms = tree_loss(case, mbs, cfg)
        assert_rel(got, ref, what=f"{name} loss")
        assert terms.keys() == ref_terms.keys(), name
        for k in terms:
            assert_rel(terms[k], ref_terms[k], what=f"{name} {k}")
        for g, rg in zip(case.grads(), ref_grads):
            torch.testing.assert_close(g, rg, rtol=1e-12, atol=1e-15, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("lo,hi", CLIPS)
def test_clipping_is_active_on_both_sides(case, lo, hi):
    """(c) the data has ratios above 1 + high with A > 0 and below 1 - low with A < 0 (both
    clipped), and unclipped ones, so a wrong clip bound would change the loss."""
    lay = build_layout(case.forest)
    lp, _, old, adv, _, _ = case.target_values(lay)
    ratio = torch.exp(lp.detach() - old)
    assert bool(((ratio > 1 + hi) & (adv > 0)).any())
    assert bool(((ratio < 1 - lo) & (adv < 0)).any())
    assert bool(((ratio > 1 - lo) & (ratio < 1 + hi)).any())
    cfg = ObjectiveConfig(kind="ppo", clip_ratio_low=lo, clip_ratio_high=hi)
    swapped = ObjectiveConfig(kind="ppo", clip_ratio_low=hi, clip_ratio_high=lo)
    case.zero_grad()
    loss, terms = tree_loss(case, [(lay, None)], cfg)
    other, _ = tree_loss(case, [(lay, None)], swapped)
    assert 0 < float(terms["clip_fraction"]) < 1
    if lo != hi:
        assert abs(float(loss - other)) > 1e-3


def test_local_normalization_differs_from_global(case):
    """The oracle tells global from per-microbatch normalization (the test above can fail)."""
    mbs = microbatch_splits(case)["per-tree"]
    for mode in LOSS_AGG_MODES:
        cfg = ObjectiveConfig(kind="ppo", loss_agg_mode=mode, loss_norm_length=NORM_LENGTH)
        case.zero_grad()
        ref, _ = reference_loss(case, cfg)
        local = 0.0
        for lay, _ in mbs:
            lp, ent, old, adv, traj, weight = case.target_values(lay)
            own = batch_normalizer(traj, case.forest.num_trajectories)
            local += float(objective_loss(lp, old, adv, target_scale(own, traj, weight, mode, NORM_LENGTH), cfg)[0].detach())
        assert abs(local - float(ref)) > 1e-3 * abs(float(ref))


def test_hand_computed_values():
    """Both the tree-mode loss and the reference against numbers worked out by hand."""
    lo, hi = 0.2, 0.28
    # trajectory 0: tokens [1, 2, 3], targets at 1 and 2, A = 2, weight 1
    # trajectory 1: tokens [1, 4], target at 1, A = -1, weight 3
    logp = torch.tensor([-0.5, -1.0, -1.5], dtype=torch.float64)
    old = torch.tensor([-1.0, -1.0, -1.0], dtype=torch.float64)
    adv = torch.tensor([2.0, 2.0, -1.0], dtype=torch.float64)
    traj = torch.tensor([0, 0, 1])
    weight = torch.tensor([1.0, 1.0, 3.0], dtype=torch.float64)
    # per token: ratio e^0.5 > 1.28 -> -1.28 * 2; ratio 1 -> -2; ratio e^-0.5 < 0.8 with A < 0 -> +0.8
    pg = [-2.56, -2.0, 0.8]
    want = {"token-mean": (pg[0] + pg[1] + 3 * pg[2]) / 3,
            "seq-mean-token-mean": ((pg[0] + pg[1]) / 2 + 3 * pg[2]) / 2,
            "seq-mean-token-sum": (pg[0] + pg[1] + 3 * pg[2]) / 2,
            "seq-mean-token-sum-norm": (pg[0] + pg[1] + 3 * pg[2]) / 2 / 4}
    want_clip = {"token-mean": 4 / 3, "seq-mean-token-mean": (1 / 2 + 3) / 2, "seq-mean-token-sum": 4 / 2,
                 "seq-mean-token-sum-norm": 4 / 2 / 4}
    norm = batch_normalizer(traj, 2)
    assert norm.traj_tokens.tolist() == [2, 1] and norm.num_tokens == 3 and norm.num_sequences == 2
    trajs = [make_trajectory({"id": 0, "tokens": [1, 2, 3], "old_logprobs": [0.0, -1.0, -1.0], "advantage": 2.0}),
             make_trajectory({"id": 1, "tokens": [1, 4], "old_logprobs": [0.0, -1.0], "advantage": -1.0,
                              "weight": 3.0})]
    per_pos = [torch.tensor([math.nan, -0.5, -1.0], dtype=torch.float64), torch.tensor([math.nan, -1.5],
                                                                                        dtype=torch.float64)]
    for mode in LOSS_AGG_MODES:
        cfg = ObjectiveConfig(kind="ppo", clip_ratio_low=lo, clip_ratio_high=hi, loss_agg_mode=mode, loss_norm_length=4)
        loss, terms = objective_loss(logp, old, adv, target_scale(norm, traj, weight, mode, 4), cfg)
        ref, ref_terms = objective_loss_reference(per_pos, trajs, cfg)
        for got in (loss, ref):
            assert math.isclose(float(got), want[mode], rel_tol=1e-14)
        for got in (terms["clip_fraction"], ref_terms["clip_fraction"]):
            assert math.isclose(float(got), want_clip[mode], rel_tol=1e-14)
    # k3 KL of one target: d = old - logp = -0.5 -> e^-0.5 + 0.5 - 1; entropy bonus subtracts
    cfg = ObjectiveConfig(kind="sft", kl_coef=0.5, entropy_coef=0.1, loss_agg_mode="seq-mean-token-sum", kl_to="old")
    one = torch.tensor([1.0], dtype=torch.float64)
    loss, terms = objective_loss(logp[:1], old[:1], adv[:1], one, cfg, entropy=torch.tensor([2.0], dtype=torch.float64))
    k3 = math.exp(-0.5) + 0.5 - 1.0
    assert math.isclose(float(terms["kl"]), k3, rel_tol=1e-14)
    assert math.isclose(float(loss), 0.5 + 0.5 * k3 - 0.1 * 2.0, rel_tol=1e-14)
    assert math.isclose(float(terms["sft_loss"]), 0.5, rel_tol=1e-14)


def test_normalizer_counts(case):
    f = case.forest
    want = np.zeros(f.num_trajectories, dtype=np.int64)
    for tr in case.trajs:
        want[f.trajectory_index(tr.id)] = int((tr.loss_mask[1:] == 1).sum())
    n = case.normalizer
    assert n.traj_tokens.tolist() == want.tolist()
    assert n.num_tokens == int(want.sum()) and n.num_sequences == int((want > 0).sum())
    assert n.num_sequences == len(case.trajs) - 1            # a4 has no target
    assert f.exc_loss_mask.traj.shape[0] > 0                  # a1's loss mask differs on a shared row
    # the same from the targets of any split of the step
    for mbs in microbatch_splits(case).values():
        traj = torch.cat([case.target_values(lay, idx)[4] for lay, idx in mbs])
        m = batch_normalizer(traj, f.num_trajectories)
        assert m.traj_tokens.tolist() == want.tolist() and m.num_sequences == n.num_sequences
    lay = build_layout(f)
    torch.testing.assert_close(layout_target_scale(n, lay, "seq-mean-token-sum"),
                               lay.target_weight / n.num_sequences, rtol=0, atol=0)


def test_first_position_is_never_a_target():
    """Position 0 has no predecessor: not a target even where an unvalidated loss mask says 1."""
    tr = Trajectory(id="x", tokens=np.array([2, 3, 4]), loss_mask=np.array([1, 1, 1], dtype=np.uint8))
    f = build_forest([tr])
    assert forest_normalizer(f).traj_tokens.tolist() == [2] == [build_layout(f).num_targets]


@settings(max_examples=40, deadline=None)
@given(trajectory_sets(), st.sampled_from(LOSS_AGG_MODES), st.integers(1, 4), st.integers(0, 2 ** 31 - 1))
def test_random_forests_sft(trajs, mode, parts, seed):
    """Random rollout sets: the forest's counts and the sum over a random target partition."""
    records = [{"id": t.id, "tokens": t.tokens, "loss_mask": t.loss_mask, "weight": t.weight, "group": t.group}
               for t in trajs]
    c = Case(records, seed=seed % 1000)
    want = [0] * c.forest.num_trajectories
    for tr in c.trajs:
        want[c.forest.trajectory_index(tr.id)] = int(tr.loss_mask[1:].sum())
    assert c.normalizer.traj_tokens.tolist() == want
    if sum(want) == 0:
        return
    cfg = ObjectiveConfig(kind="sft", loss_agg_mode=mode, entropy_coef=0.1, loss_norm_length=NORM_LENGTH)
    lay = build_layout(c.forest)
    perm = torch.from_numpy(np.random.default_rng(seed).permutation(lay.num_targets))
    got, _ = tree_loss(c, [(lay, chunk) for chunk in torch.tensor_split(perm, parts)], cfg)
    got_grads = c.grads()
    c.zero_grad()
    ref, _ = reference_loss(c, cfg)
    assert_rel(got, ref)
    for g, rg in zip(got_grads, c.grads()):
        torch.testing.assert_close(g, rg, rtol=1e-12, atol=1e-15)


def test_dtype_preserved(case):
    lay = build_layout(case.forest)
    lp, ent, old, adv, traj, weight = case.target_values(lay)
    scale = target_scale(case.normalizer, traj, weight, "token-mean")
    cfg = ObjectiveConfig(kind="ppo", kl_coef=0.1, entropy_coef=0.01, kl_to="old")
    loss64, terms64 = objective_loss(lp, old, adv, scale, cfg, entropy=ent)
    loss32, terms32 = objective_loss(lp.float(), old, adv, scale, cfg, entropy=ent.float())
    assert loss64.dtype == torch.float64 and all(v.dtype == torch.float64 for v in terms64.values())
    assert loss32.dtype == torch.float32 and all(v.dtype == torch.float32 for v in terms32.values())
    assert math.isclose(float(loss32.detach()), float(loss64.detach()), rel_tol=1e-5)
    assert all(not v.requires_grad for v in terms64.values()) and loss64.requires_grad
    empty = torch.zeros(0, dtype=torch.float64, requires_grad=True)
    z, t = objective_loss(empty, empty.detach(), empty.detach(),
                          target_scale(case.normalizer, torch.zeros(0, dtype=torch.int64), empty.detach(), "token-mean"),
                          cfg, entropy=empty.detach())
    z.backward()
    assert float(z.detach()) == 0.0 and set(t) == {"pg_loss", "clip_fraction", "kl", "entropy"}


# ---------------------------------------------------------------------------
# (d) bad input
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("kw,msg", [
    ({"kind": "grpo"}, "--rl-objective must be one of sft, ppo, got 'grpo'"),
    ({"clip_ratio_low": 1.5}, "--clip-ratio-low must be in [0, 1), got 1.5"),
    ({"clip_ratio_low": -0.1}, "--clip-ratio-low must be in [0, 1), got -0.1"),
    ({"clip_ratio_low": True}, "--clip-ratio-low must be a number"),
    ({"clip_ratio_high": -0.2}, "--clip-ratio-high must be >= 0, got -0.2"),
    ({"clip_ratio_high": float("nan")}, "--clip-ratio-high must be finite"),
    ({"kl_coef": -1}, "--kl-coef must be >= 0"),
    ({"kl_coef": "0.1"}, "--kl-coef must be a number"),
    ({"entropy_coef": float("inf")}, "--entropy-coef must be finite"),
    ({"loss_agg_mode": "seq-mean"}, "--loss-agg-mode must be one of token-mean, seq-mean-token-mean"),
])
def test_bad_config(kw, msg):
    with pytest.raises(ValueError) as e:
        ObjectiveConfig(**kw)
    assert msg in str(e.value)
    field = next(iter(kw))
    assert f"ObjectiveConfig.{field}" in str(e.value) and ObjectiveConfig.flag(field) in str(e.value)


def test_config_from_args():
    ns = argparse.Namespace(rl_objective="sft", clip_ratio_low=0.1, clip_ratio_high=0.28, kl_coef=1,
                            entropy_coef=None, loss_agg_mode="seq-mean-token-sum")
    cfg = ObjectiveConfig.from_args(ns)
    assert cfg == ObjectiveConfig(kind="sft", clip_ratio_low=0.1, clip_ratio_high=0.28, kl_coef=1.0,
                                  loss_agg_mode="seq-mean-token-sum")
    assert isinstance(cfg.kl_coef, float) and cfg.entropy_coef == 0.0
    with pytest.raises(ValueError, match="--clip-ratio-low"):
        ObjectiveConfig.from_args(argparse.Namespace(clip_ratio_low=2.0))
    with pytest.raises(ValueError, match="no field 'clip'"):
        ObjectiveConfig.flag("clip")


def _missing(field):
    recs = _records()
    del recs[5][field]                 # b0 has targets
    return Case(recs)


@pytest.mark.parametrize("field,layout_field", [("advantage", "target_advantage"),
                                                ("old_logprobs", "target_old_logprob")])
def test_ppo_needs_advantage_and_old_logprobs(field, layout_field):
    c = _missing(field)
    lay = build_layout(c.forest)
    lp, ent, old, adv, traj, weight = c.target_values(lay)
    scale = target_scale(c.normalizer, traj, weight, "token-mean")
    b0 = lay.traj_ids.index("b0")
    of_b0 = torch.nonzero(lay.target_traj == b0).flatten()
    with pytest.raises(ObjectiveDataError) as e:
        objective_loss(lp, old, adv, scale, ObjectiveConfig(kind="ppo"))
    err = e.value
    assert isinstance(err, ValueError) and err.field == field
    assert err.count == of_b0.numel() == int(torch.isnan(getattr(lay, layout_field)).sum())
    assert err.target_index == int(of_b0[0])
    assert lay.traj_ids[int(lay.target_traj[err.target_index])] == "b0"
    assert f"`{field}`" in str(err) and f"{err.count} of {lay.num_targets} targets" in str(err)
    with pytest.raises(ValueError, match=f"'b0'.*`{field}`"):
        objective_loss_reference(*_expanded_args(c), ObjectiveConfig(kind="ppo"))
    # SFT ignores both, unless it asks for a KL to the old log-probs
    sft = ObjectiveConfig(kind="sft")
    loss, _ = objective_loss(lp, old, adv, scale, sft)
    assert math.isfinite(float(loss.detach()))
    loss.backward()
    assert bool(torch.isfinite(c.table.grad).all())
    if field == "old_logprobs":
        with pytest.raises(ObjectiveDataError, match="--kl-coef 0.1"):
            objective_loss(lp, old, adv, scale, ObjectiveConfig(kind="sft", kl_coef=0.1, kl_to="old"))


def _expanded_args(c):
    lps, _ = c.expanded_values()
    return lps, c.trajs


def test_bad_arguments(case):
    lay = build_layout(case.forest)
    lp, ent, old, adv, traj, weight = case.target_values(lay)
    scale = target_scale(case.normalizer, traj, weight, "token-mean")
    with pytest.raises(ValueError, match="--entropy-coef 0.1 needs per-target entropies"):
        objective_loss(lp, old, adv, scale, ObjectiveConfig(entropy_coef=0.1))
    with pytest.raises(ValueError, match=r"advantage must be a tensor of shape \(\d+,\)"):
        objective_loss(lp, old, adv[:-1], scale, ObjectiveConfig())
    with pytest.raises(ValueError, match="logprobs must be a 1-D floating tensor"):
        objective_loss(lp[None], old, adv, scale, ObjectiveConfig())
    with pytest.raises(ValueError, match="config must be an ObjectiveConfig"):
        objective_loss(lp, old, adv, scale, {"kind": "ppo"})
    with pytest.raises(ValueError, match="--loss-agg-mode"):
        target_scale(case.normalizer, traj, weight, "mean")
    with pytest.raises(ValueError, match=r"trajectory 99 out of range"):
        target_scale(case.normalizer, torch.tensor([0, 99]), torch.ones(2, dtype=torch.float64), "token-mean")
    a4 = case.forest.trajectory_index("a4")
    with pytest.raises(ValueError, match=f"trajectory {a4} has targets here but no loss tokens"):
        target_scale(case.normalizer, torch.tensor([a4]), torch.ones(1, dtype=torch.float64), "token-mean")
    with pytest.raises(ValueError, match="out of range"):
        batch_normalizer([0, 5], 3)
    with pytest.raises(ValueError, match="weights must be finite"):
        target_scale(case.normalizer, traj[:1], torch.tensor([math.nan], dtype=torch.float64), "token-mean")
