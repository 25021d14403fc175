"""q-weighted MoE statistics (megatron_harts/ops/moe.py) equal megatron-core's on expanded rows.

Three levels of oracle: the module's expanded references (megatron's own loss
functions on replicated rows), a literal [seq, batch] reshape as
TopKRouter._apply_seq_aux_loss does it, and megatron's TopKRouter.routing run
on the expanded micro-batch (aux, seq_aux, global_aux, z-loss, expert-bias
token counts), forward and gradient.  fp64, 1e-10.  docs/design.md invariant 1.
"""
import os
import socket
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_harts.ops.moe import (
    GlobalAuxLossReference, QGlobalAuxLoss, aux_loss_reference, q_aux_loss, q_seq_aux_loss,
    q_tokens_per_expert, q_z_loss, routing_map_from_topk, seq_aux_loss_reference,
    tokens_per_expert_reference, trajectory_row_sums, validate_tree_moe_config, z_loss_reference)
from megatron_harts.tree_data import build_forest, make_trajectory
from multiproc import run_ranks

TOL = 1e-10
E, K = 6, 2
SEEDS = range(8)


def random_forest(seed, n_traj=7, vocab=3, equal_length=None):
    """Random rollout forest: forks, trajectories ending inside others, duplicates,
    single-token segments.  ``equal_length``: every trajectory has that many tokens."""
    rng = np.random.default_rng(seed)
    first = equal_length or int(rng.integers(1, 6))
    seqs = [list(rng.integers(0, vocab, size=first))]
    while len(seqs) < n_traj:
        base = seqs[int(rng.integers(len(seqs)))]
        cut = int(rng.integers(0, len(base) + (0 if equal_length else 1)))
        extra = (equal_length - cut) if equal_length else int(rng.integers(0, 4))
        s = base[:cut] + list(rng.integers(0, vocab, size=extra))
        seqs.append(s or [int(rng.integers(vocab))])
    return build_forest([make_trajectory({"id": i, "tokens": [int(x) for x in s]}) for i, s in enumerate(seqs)])


def membership(forest):
    """Plain tensors a layout would provide: q per row, trajectory row lists, row ranges."""
    rows = [forest.trajectory_rows(t) for t in range(forest.num_trajectories)]
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
    q = np.repeat(forest.seg_traj_hi - forest.seg_traj_lo, forest.seg_length)
    lo = np.repeat(forest.seg_traj_lo, forest.seg_length)
    hi = np.repeat(forest.seg_traj_hi, forest.seg_length)
    traj_rows = np.concatenate(rows)
    assert np.array_equal(np.bincount(traj_rows, minlength=forest.num_rows), q)  # helper self-check
    return SimpleNamespace(q=torch.from_numpy(q), traj_row_offsets=torch.from_numpy(offsets),
                           traj_rows=torch.from_numpy(traj_rows), row_traj_lo=torch.from_numpy(lo),
                           row_traj_hi=torch.from_numpy(hi), num_trajectories=forest.num_trajectories)


def csr(m):
    return {"traj_row_offsets": m.traj_row_offsets, "traj_rows": m.traj_rows}


def ranges(m):
    return {"row_traj_lo": m.row_traj_lo, "row_traj_hi": m.row_traj_hi, "num_trajectories": m.num_trajectories}


def rel_err(a, b):
    return float((a - b).abs().max() / max(1e-300, float(b.abs().max())))


def grad_of(fn, x0):
    x = x0.clone().requires_grad_()
    out = fn(x)
    (g,) = torch.autograd.grad(out.sum(), x)
    return out.detach(), g


def router_scores(logits, score_function):
    """Scores and routing map for aux losses as megatron computes them (fp64-preserving)."""
    if score_function == "sigmoid":
        from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss
        rmap, scores = compute_routing_scores_for_aux_loss(logits, K, "sigmoid")
        return scores, rmap
    # megatron's softmax variant upcasts to fp32 only; same formula kept in fp64 here
    scores = torch.softmax(logits, dim=-1)
    return scores, routing_map_from_topk(torch.topk(scores.detach(), K, dim=1).indices, E)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def megatron_cpu(monkeypatch):
    """gloo world of 1, megatron parallel state (TP=1, PP=1), the CPU shims of docs/design.md; undone after."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(moe_utils.MoEAuxLossAutoScaler, "main_loss_backward_scale", torch.tensor(1.0))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        yield dist.group.WORLD
    finally:
        moe_utils.get_moe_layer_wise_logging_tracker().clear()   # sized per model: drop, not zero
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_random_forests_cover_the_hard_shapes():
    """The seeds used below include forks, trajectories ending inside another's path,
    identical trajectories and single-token segments."""
    fork = ends_inside = single = dup = False
    for seed in SEEDS:
        f = random_forest(seed)
        children = np.bincount(f.seg_parent[f.seg_parent >= 0], minlength=f.num_segments)
        fork |= bool((children >= 2).any())
        ends_inside |= bool((children[f.traj_leaf] >= 1).any())
        single |= bool((f.seg_length == 1).any())
        dup |= len(set(f.traj_leaf.tolist())) < f.num_trajectories
    assert fork and ends_inside and single and dup


@pytest.mark.parametrize("seed", SEEDS)
def test_trajectory_row_sums_both_forms(seed):
    f = random_forest(seed)
    m = membership(f)
    vals = torch.randn(f.num_rows, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    naive = torch.stack([vals[torch.from_numpy(f.trajectory_rows(t))].sum(0) for t in range(f.num_trajectories)])
    w = torch.randn(f.num_trajectories, 3, dtype=torch.float64)
    for form in (csr(m), ranges(m)):
        out, g = grad_of(lambda v: trajectory_row_sums(v, **form) * w, vals)
        assert rel_err(out, naive * w) < TOL
        # d/dvalues[r] = sum of w over the trajectories through r
        expected = torch.stack([w[m.row_traj_lo[r]:m.row_traj_hi[r]].sum(0) for r in range(f.num_rows)])
        assert rel_err(g, expected) < TOL
    ints = torch.randint(0, 5, (f.num_rows, 2))
    assert torch.equal(trajectory_row_sums(ints, **csr(m)), trajectory_row_sums(ints, **ranges(m)))


@pytest.mark.parametrize("score_function", ["sigmoid", "softmax"])
@pytest.mark.parametrize("seed", SEEDS)
def test_q_weighted_equals_expanded_megatron(seed, score_function, megatron_cpu):
    group = megatron_cpu
    f = random_forest(seed)
    m = membership(f)
    logits0 = torch.randn(f.num_rows, E, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    _, rmap = router_scores(logits0, score_function)
    topk_idx = torch.topk(rmap.to(torch.int8), K, dim=1).indices

    def s(x):
        return router_scores(x, score_function)[0]

    pairs = [
        (lambda x: q_aux_loss(s(x), topk_idx, m.q, topk=K, coeff=0.3, group=group),
         lambda x: aux_loss_reference(s(x), rmap, m.traj_rows, topk=K, coeff=0.3, group=group)),
        (lambda x: q_aux_loss(s(x), rmap, m.q, topk=K, coeff=0.3),
         lambda x: aux_loss_reference(s(x), topk_idx, m.traj_rows, topk=K, coeff=0.3, group=group)),
        (lambda x: q_z_loss(x, m.q, 0.05), lambda x: z_loss_reference(x, m.traj_rows, 0.05)),
    ]
    for reduction in ("mean", "sum", "none"):
        ref = (lambda red: lambda x: seq_aux_loss_reference(s(x), rmap, m.traj_row_offsets, m.traj_rows, topk=K,
                                                            coeff=0.2, group=group, reduction=red))(reduction)
        for form in (csr(m), ranges(m)):
            pairs.append(((lambda fm, red: lambda x: q_seq_aux_loss(s(x), topk_idx, topk=K, coeff=0.2, group=group,
                                                                   reduction=red, **fm))(form, reduction), ref))
    for fast, reference in pairs:
        v_fast, g_fast = grad_of(fast, logits0)
        v_ref, g_ref = grad_of(reference, logits0)
        assert rel_err(v_fast, v_ref) < TOL
        assert rel_err(g_fast, g_ref) < TOL
        assert g_ref.abs().max() > 0
    tpe = q_tokens_per_expert(topk_idx, m.q, E)
    assert torch.equal(tpe, tokens_per_expert_reference(topk_idx, m.traj_rows, E))
    assert int(tpe.sum()) == K * int(m.traj_row_offsets[-1])


@pytest.mark.parametrize("seed", range(4))
def test_seq_aux_loss_equals_megatron_batch_reshape(seed):
    """Equal-length trajectories as one [seq, batch] micro-batch: TopKRouter._apply_seq_aux_loss's
    reshape to [seq, batch * E] and division by batch, written out with megatron's loss function."""
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func
    f = random_forest(seed, equal_length=5)
    m = membership(f)
    n, L = f.num_trajectories, 5
    logits0 = torch.randn(f.num_rows, E, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    index = m.traj_rows.view(n, L).t().reshape(-1)  # [seq, batch] order of the expanded rows

    def megatron_seq(x):
        scores, rmap = router_scores(x, "sigmoid")
        sc, rm = scores[index].reshape(L, -1), rmap[index].reshape(L, -1)
        return switch_load_balancing_loss_func(sc, rm.sum(0).double(), L, K, E, 0.2) / n

    def ours(x):
        scores, rmap = router_scores(x, "sigmoid")
        return q_seq_aux_loss(scores, rmap, topk=K, coeff=0.2, **ranges(m))

    (v1, g1), (v2, g2) = grad_of(ours, logits0), grad_of(megatron_seq, logits0)
    assert rel_err(v1, v2) < TOL and rel_err(g1, g2) < TOL


def test_global_aux_loss_accumulates_over_microbatches(megatron_cpu):
    group = megatron_cpu
    fast, ref = QGlobalAuxLoss(E, dtype=torch.float64), GlobalAuxLossReference(E, dtype=torch.float64)
    for step, seed in enumerate([3, 4, 5, 6]):
        if step == 2:  # a new global batch
            fast.reset()
            ref.reset()
        f = random_forest(seed)
        m = membership(f)
        logits0 = torch.randn(f.num_rows, E, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        _, rmap = router_scores(logits0, "sigmoid")
        v1, g1 = grad_of(lambda x: fast(router_scores(x, "sigmoid")[0], rmap, m.q, topk=K, coeff=0.4,
                                        group=group), logits0)
        v2, g2 = grad_of(lambda x: ref(router_scores(x, "sigmoid")[0], rmap, m.traj_rows, topk=K, coeff=0.4,
                                       group=group), logits0)
        assert rel_err(v1, v2) < TOL and rel_err(g1, g2) < TOL
        assert torch.equal(fast.global_tokens_per_expert, ref.global_tokens_per_expert)
    assert float(fast.ga_steps) == 2.0


def test_topk_router_on_expanded_microbatches(megatron_cpu):
    """megatron's TopKRouter.routing on expanded [seq, batch] logits (aux + seq_aux + global_aux
    + z-loss, expert bias on) against the q-weighted forms on compact rows: every loss value,
    the summed gradient on the compact logits, expert-bias token counts, global counts."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import router as router_mod
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from megatron.core.transformer.transformer_config import TransformerConfig
    coeffs = {"aux_loss": 0.1, "seq_aux_loss": 0.2, "global_aux_loss": 0.3}
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=E,
                            moe_router_topk=K, moe_router_load_balancing_type=list(coeffs),
                            moe_aux_loss_coeff=list(coeffs.values()), moe_z_loss_coeff=0.05,
                            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                            params_dtype=torch.float64)
    validate_tree_moe_config(cfg)
    router = router_mod.TopKRouter(cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    router.set_layer_number(1)
    router.train()
    seen = {}
    attach = router.attach_and_log_load_balancing_loss

    def recording_attach(act, coeff, loss, name, *a, **kw):
        seen[name] = loss.detach()
        return attach(act, coeff, loss, name, *a, **kw)

    router.attach_and_log_load_balancing_loss = recording_attach
    z_func = router_mod.z_loss_func

    def recording_z(*a, **kw):
        z = z_func(*a, **kw)
        seen["z_loss"] = z.detach()
        return z

    orig_z, router_mod.z_loss_func = router_mod.z_loss_func, recording_z
    try:
        glob = QGlobalAuxLoss(E)
        tpe_total = torch.zeros(E, dtype=torch.int64)
        for seed in (10, 11):
            f = random_forest(seed, equal_length=4)
            m = membership(f)
            n, L = f.num_trajectories, 4
            logits0 = torch.randn(f.num_rows, E, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
            index = m.traj_rows.view(n, L).t().reshape(-1)

            x = logits0.clone().requires_grad_()
            probs, _ = router.routing(x[index].view(L, n, E))
            (probs * 0).sum().backward()  # only the attached aux/z losses produce gradient
            g_megatron = x.grad

            x2 = logits0.clone().requires_grad_()
            scores, rmap = router_scores(x2, "sigmoid")
            ours = {
                "load_balancing_loss": q_aux_loss(scores, rmap, m.q, topk=K, coeff=coeffs["aux_loss"]),
                "seq_load_balancing_loss": q_seq_aux_loss(scores, rmap, topk=K, coeff=coeffs["seq_aux_loss"],
                                                          **csr(m)),
                "global_load_balancing_loss": glob(scores, rmap, m.q, topk=K, coeff=coeffs["global_aux_loss"]),
                "z_loss": q_z_loss(x2, m.q, 0.05),
            }
            sum(ours.values()).backward()
            for name, value in ours.items():
                assert rel_err(value.detach(), seen[name]) < TOL, name
            assert rel_err(x2.grad, g_megatron) < TOL

            _, dispatch_map = topk_routing_with_score_function(logits0, K, score_function="sigmoid",
                                                               expert_bias=router.expert_bias)
            tpe_total += q_tokens_per_expert(dispatch_map, m.q, E)
            assert torch.equal(router.local_tokens_per_expert.long(), tpe_total)
            assert torch.equal(router.global_tokens_per_expert, glob.global_tokens_per_expert)
    finally:
        router_mod.z_loss_func = orig_z


def _split_rows_worker(rank, world, init_file, inputs_path, out_dir):
    """One rank of a row-split (sequence-parallel-like) micro-batch: rows r with r % world == rank."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        d = torch.load(inputs_path)
        mine = torch.arange(d["scores"].shape[0]) % world == rank
        scores = d["scores"][mine].clone().requires_grad_()
        rmap, q = d["rmap"][mine], d["q"][mine]
        local = float(d["q"].sum()) / world  # expanded tokens per rank, as megatron splits them evenly
        group = dist.group.WORLD
        glob = QGlobalAuxLoss(E, dtype=torch.float64)
        losses = torch.stack([
            q_aux_loss(scores, rmap, q, topk=K, coeff=0.3, group=group, local_num_tokens=local),
            q_seq_aux_loss(scores, rmap, topk=K, coeff=0.2, group=group, row_traj_lo=d["lo"][mine],
                           row_traj_hi=d["hi"][mine], num_trajectories=d["n"], reduction="sum"),
            glob(scores, rmap, q, topk=K, coeff=0.4, group=group, local_num_tokens=local),
        ])
        (losses @ d["w"]).backward()
        torch.save({"losses": losses.detach(), "grad": scores.grad, "rows": torch.nonzero(mine)[:, 0],
                    "global_tpe": glob.global_tokens_per_expert}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_rows_split_over_two_ranks_sum_to_the_whole(tmp_path):
    """With a reduce group the counts are all-reduced and score sums stay local (megatron's
    distributed formula): the per-rank losses of a row split add up to the one-rank loss."""
    f = random_forest(5)
    m = membership(f)
    logits = torch.randn(f.num_rows, E, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    scores, rmap = router_scores(logits, "softmax")
    w = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    inputs = tmp_path / "inputs.pt"
    torch.save({"scores": scores.detach(), "rmap": rmap, "q": m.q, "lo": m.row_traj_lo, "hi": m.row_traj_hi,
                "n": m.num_trajectories, "w": w}, inputs)
    run_ranks(_split_rows_worker, 2, (str(tmp_path / "store"), str(inputs), str(tmp_path)), timeout=90)
    out = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    x = scores.detach().clone().requires_grad_()
    whole = torch.stack([
        q_aux_loss(x, rmap, m.q, topk=K, coeff=0.3),
        q_seq_aux_loss(x, rmap, topk=K, coeff=0.2, reduction="sum", **ranges(m)),
        QGlobalAuxLoss(E, dtype=torch.float64)(x, rmap, m.q, topk=K, coeff=0.4),
    ])
    (whole @ w).backward()
    assert rel_err(out[0]["losses"] + out[1]["losses"], whole.detach()) < TOL
    grad = torch.zeros_like(x)
    for o in out:
        grad[o["rows"]] = o["grad"]
        assert torch.equal(o["global_tpe"], q_tokens_per_expert(rmap, m.q, E).double())
    assert rel_err(grad, x.grad) < TOL


def test_validate_tree_moe_config_refuses_token_dropping():
    from megatron.core.transformer.transformer_config import TransformerConfig
    validate_tree_moe_config(SimpleNamespace())
    validate_tree_moe_config({"moe_expert_capacity_factor": None, "moe_token_drop_policy": "probs"})
    validate_tree_moe_config(SimpleNamespace(moe_expert_capacity_factor=-1.0))  # megatron: -1 means none
    validate_tree_moe_config(TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                                               num_moe_experts=4, moe_router_topk=2))
    refused = [
        ({"moe_expert_capacity_factor": 1.25}, "--moe-expert-capacity-factor"),
        ({"moe_expert_capacity_factor": 0.0}, "--moe-expert-capacity-factor"),
        ({"moe_pad_expert_input_to_capacity": True}, "--moe-pad-expert-input-to-capacity"),
        ({"moe_token_drop_policy": "position"}, "--moe-token-drop-policy"),
        ({"moe_router_load_balancing_type": "sinkhorn"}, "--moe-router-load-balancing-type"),
        ({"moe_router_load_balancing_type": ["aux_loss", "sinkhorn"]}, "--moe-router-load-balancing-type"),
        ({"moe_input_jitter_eps": 0.01}, "--moe-input-jitter-eps"),
        ({"moe_router_force_load_balancing": True}, "--moe-router-force-load-balancing"),
    ]
    for fields, flag in refused:
        for cfg in (fields, SimpleNamespace(**fields)):
            with pytest.raises(ValueError, match=flag):
                validate_tree_moe_config(cfg)
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=4,
                            moe_router_topk=2, moe_expert_capacity_factor=1.5)
    with pytest.raises(ValueError, match="--moe-expert-capacity-factor"):
        validate_tree_moe_config(cfg)


def test_bad_input_names_the_argument():
    f = random_forest(1)
    m = membership(f)
    R = f.num_rows
    scores = torch.rand(R, E, dtype=torch.float64)
    idx = torch.topk(scores, K, dim=1).indices
    dup = idx.clone()
    dup[0, 1] = dup[0, 0]
    cases = [
        (lambda: q_aux_loss(scores, idx, m.q[:-1], topk=K, coeff=1.0), "q"),
        (lambda: q_aux_loss(scores, idx, -m.q, topk=K, coeff=1.0), "q"),
        (lambda: q_aux_loss(scores, idx, m.q.double() + 0.5, topk=K, coeff=1.0), "q"),
        (lambda: q_aux_loss(scores, dup, m.q, topk=K, coeff=1.0), "routing"),
        (lambda: q_aux_loss(scores, idx + E, m.q, topk=K, coeff=1.0), "routing"),
        (lambda: q_aux_loss(scores, idx[1:], m.q, topk=K, coeff=1.0), "routing"),
        (lambda: q_aux_loss(scores, idx, m.q, topk=0, coeff=1.0), "topk"),
        (lambda: q_aux_loss(scores[0], idx, m.q, topk=K, coeff=1.0), "scores"),
        (lambda: q_aux_loss(scores, idx, torch.zeros_like(m.q), topk=K, coeff=1.0), "local_num_tokens"),
        (lambda: q_seq_aux_loss(scores, idx, topk=K, coeff=1.0), "membership"),
        (lambda: q_seq_aux_loss(scores, idx, topk=K, coeff=1.0, **csr(m), **ranges(m)), "membership"),
        (lambda: q_seq_aux_loss(scores, idx, topk=K, coeff=1.0, traj_row_offsets=m.traj_row_offsets + 1,
                                traj_rows=m.traj_rows), "traj_row_offsets"),
        (lambda: q_seq_aux_loss(scores, idx, topk=K, coeff=1.0, traj_row_offsets=m.traj_row_offsets,
                                traj_rows=m.traj_rows + R), "traj_rows"),
        (lambda: q_seq_aux_loss(scores, idx, topk=K, coeff=1.0, row_traj_lo=m.row_traj_hi,
                                row_traj_hi=m.row_traj_lo, num_trajectories=m.num_trajectories), "row_traj_lo"),
        (lambda: q_seq_aux_loss(scores, idx, topk=K, coeff=1.0, reduction="avg", **csr(m)), "reduction"),
        (lambda: q_z_loss(scores, m.q, "big"), "coeff"),
        (lambda: QGlobalAuxLoss(E + 1)(scores, idx, m.q, topk=K, coeff=1.0), "experts"),
        (lambda: q_tokens_per_expert(idx, m.q, 0), "num_experts"),
    ]
    for call, word in cases:
        with pytest.raises(ValueError, match=word):
            call()
