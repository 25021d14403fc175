"""The sharing-window schedule: one step with windows == the same step with the
shared prefixes recomputed == expanded training (fp64, per-parameter gradients to 1e-10), and the
peak retained export memory follows the windows' overlap.
"""
import numpy as np
import pytest
import torch

from megatron_harts.layout import build_layout
from megatron_harts.models.model import build_hybrid_model
from megatron_harts.models.packed import TreePackedSeqParams
from megatron_harts.schedules.windows import WindowedMicrobatch, forward_backward_windows, microbatch_on

from hybrid_tiny import VOCAB, randomize_, tiny_config, tiny_forest


def coef_of(key):
    return float(np.random.default_rng([11, *key]).normal())


def forward_step(data_iterator, model):
    mb, psp = next(data_iterator)
    lay = mb.layout
    lp = model(lay.tokens[None], lay.position_ids[None], packed_seq_params=psp, pair_row=lay.pair_row,
               pair_token=lay.pair_token)[lay.target_pair]
    keys = list(zip(lay.traj_forest[lay.target_traj.numpy()].tolist(), lay.target_position.tolist()))
    owned = torch.ones(len(keys), dtype=torch.bool) if mb.owned is None else mb.owned
    coeffs = torch.tensor([coef_of(k) for k in keys], dtype=lp.dtype) * owned

    def loss_func(out):
        return (coeffs * out).sum(), {"lp": {k: v for k, v, o in zip(keys, out.detach().tolist(), owned) if o}}
    return lp, loss_func


def owned_outside(lay, others):
    taken = np.concatenate([o.forest_rows.numpy() for o in others])
    return torch.as_tensor(~np.isin(lay.forest_rows[lay.target_row].numpy(), taken))


def subtree_roots(forest, tree):
    """The children of the tree's root segment (tiny_forest: at 6 in tree 0, at 3 in tree 1, so with
    B=4 one window has a boundary state and replay, the other replay from the zero state)."""
    lo, hi = int(forest.tree_offsets[tree]), int(forest.tree_offsets[tree + 1])
    return [s for s in range(lo, hi) if forest.seg_parent[s] == lo]


def windowed_step(forest, overlap):
    """Per tree: producer (the whole tree, owning the targets outside its consumers) + one consumer
    per subtree of the first fork.  ``overlap``: both producers run before any consumer."""
    items = {}
    for t in range(forest.num_trees):
        prod = build_layout(forest, trees=[t])
        cons = [build_layout(forest, roots=[r], context=prod) for r in subtree_roots(forest, t)]
        items[t] = (prod, cons)
    order = []
    if overlap:
        for t in items:
            order.append(WindowedMicrobatch(items[t][0], owned_outside(*items[t])))
        for t in items:
            order += [WindowedMicrobatch(c, producer=t) for c in items[t][1]]
    else:
        for t in items:
            p = len(order)
            order.append(WindowedMicrobatch(items[t][0], owned_outside(*items[t])))
            order += [WindowedMicrobatch(c, producer=p) for c in items[t][1]]
    return order, items


def recomputed_step(forest, items):
    """The same microbatches with the shared prefix recomputed: every consumer runs its whole tree,
    owning only its own subtree's targets."""
    order = []
    for t, (prod, cons) in items.items():
        order.append(WindowedMicrobatch(prod, owned_outside(prod, cons)))
        for c in cons:
            whole = build_layout(forest, trees=[t])
            mine = torch.as_tensor(np.isin(whole.forest_rows[whole.target_row].numpy(), c.forest_rows.numpy()))
            order.append(WindowedMicrobatch(whole, mine))
    return order


def run_step(model, mbs, recompute_producers=False, memory_budget=None):
    """One window-schedule step of ``mbs``: (log-prob per owned target, gradients, window stats)."""
    model.zero_grad(set_to_none=True)
    stats = {}
    store = forward_backward_windows(forward_step_func=forward_step, data_iterator=iter(mbs), model=model,
                                     num_microbatches=len(mbs), seq_length=0, micro_batch_size=1,
                                     window_stats=stats, recompute_producers=recompute_producers,
                                     memory_budget=memory_budget)
    lp = {}
    for s in store:
        for k, v in s["lp"].items():
            assert k not in lp, f"target {k} owned twice"
            lp[k] = v
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp, grads, stats


def expanded_step(model, forest):
    model.zero_grad(set_to_none=True)
    lay = build_layout(forest)
    toks = [forest.expand(tid).tokens for tid in lay.traj_ids]
    lengths = [len(t) for t in toks]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    psp = TreePackedSeqParams.for_sequences(lengths)
    rows = torch.as_tensor(offsets[lay.target_traj.numpy()] + lay.target_position.numpy() - 1)
    lp = model(torch.as_tensor(np.concatenate(toks))[None], psp.position_ids[None], packed_seq_params=psp,
               pair_row=rows, pair_token=lay.target_token)
    keys = list(zip(lay.traj_forest[lay.target_traj.numpy()].tolist(), lay.target_position.tolist()))
    (torch.tensor([coef_of(k) for k in keys], dtype=lp.dtype) * lp).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return dict(zip(keys, lp.detach().tolist())), grads


def assert_same(a, b, what):
    lp_a, g_a = a[:2]
    lp_b, g_b = b[:2]
    assert set(lp_a) == set(lp_b), what
    for k in lp_b:
        assert abs(lp_a[k] - lp_b[k]) <= 1e-10 * max(1.0, abs(lp_b[k])), f"{what}: log-prob of {k}"
    assert set(g_a) == set(g_b), what
    for name in g_b:
        scale = float(g_b[name].abs().max())
        assert scale > 0, f"{name} got no gradient"
        torch.testing.assert_close(g_a[name], g_b[name], rtol=0, atol=1e-10 * scale, msg=f"{what}: {name}")


def test_windowed_step_equals_recomputed_and_expanded(cpu_world):
    cfg = tiny_config(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 0)
    forest = tiny_forest(0)
    assert forest.num_trees == 2
    seq, items = windowed_step(forest, overlap=False)
    assert sum(mb.producer is not None for mb in seq) >= 3
    win = run_step(model, seq)
    ovl, _ = windowed_step(forest, overlap=True)
    win_overlap = run_step(model, ovl)
    rec = run_step(model, recomputed_step(forest, items))
    exp = expanded_step(model, forest)
    assert_same(win, rec, "windows vs recomputed")
    assert_same(win, exp, "windows vs expanded")
    assert_same(win_overlap, exp, "overlapping windows vs expanded")
    # retained exports: sequential windows hold one producer's exports at a time, overlapping both
    assert rec[2]["peak_export_bytes"] == 0 and rec[2]["windows"] == 0
    assert win[2]["windows"] == win_overlap[2]["windows"] == 2
    assert 0 < win[2]["peak_export_bytes"] < win_overlap[2]["peak_export_bytes"]


def test_windowed_step_with_varlen_attention_equals_expanded(cpu_world):
    """Consumers read their producer's keys as context through the key-path (varlen) backend."""
    cfg = tiny_config(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
                      tree_attention_backend="varlen")
    model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 0)
    forest = tiny_forest(0)
    seq, _ = windowed_step(forest, overlap=False)
    assert any(mb.producer is not None for mb in seq)
    assert_same(run_step(model, seq), expanded_step(model, forest), "windows (varlen) vs expanded")


def test_schedule_refusals(cpu_world):
    cfg = tiny_config(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    model = build_hybrid_model(cfg, vocab_size=VOCAB)
    forest = tiny_forest(0)
    prod = build_layout(forest, trees=[0])
    cons = build_layout(forest, roots=[subtree_roots(forest, 0)[0]], context=prod)

    def go(mbs, **kw):
        return forward_backward_windows(forward_step_func=forward_step, data_iterator=iter(mbs), model=model,
                                        num_microbatches=len(mbs), seq_length=0, micro_batch_size=1, **kw)
    with pytest.raises(ValueError, match="must run before"):
        go([WindowedMicrobatch(cons, producer=1), WindowedMicrobatch(prod)])
    with pytest.raises(ValueError, match="itself a consumer"):
        go([WindowedMicrobatch(prod), WindowedMicrobatch(cons, producer=0), WindowedMicrobatch(cons, producer=1)])
    with pytest.raises(ValueError, match="model chunks"):
        forward_backward_windows(forward_step_func=forward_step, data_iterator=iter([]), model=[model, model],
                                 num_microbatches=0, seq_length=0, micro_batch_size=1)
    with pytest.raises(ValueError, match="WindowedMicrobatch"):
        go([prod])


def test_recomputed_producers_same_step(cpu_world):
    """``recompute_producers``: the producers' first forwards run without a graph (exports only), their
    forwards and backwards at window close; log-probs and every gradient are the plain schedule's bits."""
    cfg = tiny_config(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 0)
    forest = tiny_forest(0)
    seq, _ = windowed_step(forest, overlap=True)
    plain = run_step(model, seq)
    calls = []

    def watched(data_iterator, model):
        mb, psp = next(data_iterator)
        out, loss_func = forward_step(iter([(mb, psp)]), model)
        calls.append((psp.preview, torch.is_grad_enabled(), out.grad_fn is not None))
        return out, loss_func
    model.zero_grad(set_to_none=True)
    stats = {}
    store = forward_backward_windows(forward_step_func=watched, data_iterator=iter(seq), model=model,
                                     num_microbatches=len(seq), window_stats=stats, recompute_producers=True)
    lp = {k: v for s in store for k, v in s["lp"].items()}
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert lp == plain[0] and set(grads) == set(plain[1])
    assert all(torch.equal(grads[n], plain[1][n]) for n in grads)
    producers = sum(mb.producer is None for mb in seq)
    for k in ("peak_export_bytes", "windows"):
        assert stats[k] == plain[2][k], k
    assert (stats["recomputed_windows"], plain[2]["recomputed_windows"]) == (producers, 0)
    # a recomputed producer's graph is not alive while its consumers run
    assert stats["predicted_peak_bytes"] < plain[2]["predicted_peak_bytes"]
    # each producer: one graph-free preview, then (at its window close) one forward with its graph
    assert calls.count((True, False, False)) == producers and len(calls) == len(seq) + producers
    assert all(grad and out for prev, grad, out in calls if not prev)


class _MetaModel(torch.nn.Module):
    """A model chunk whose parameters live on the meta device (the schedule reads only its device and config)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.weight = torch.nn.Parameter(torch.empty(1, device="meta"))


def test_schedule_moves_each_microbatch_to_the_model_device_as_it_runs(cpu_world):
    """Host microbatches reach ``forward_step_func`` on the model's device, each moved as it runs (its
    host layout kept as ``host_copy``); the step's host items are left on the host."""
    forest = tiny_forest(0)
    seq, _ = windowed_step(forest, overlap=False)
    assert any(mb.producer is not None for mb in seq)
    model = _MetaModel(tiny_config(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none"))
    seen = []

    def step(data_iterator, model):
        mb, psp = next(data_iterator)
        seen.append(mb.layout)
        return torch.zeros((), device="meta"), lambda out: (out, {})
    forward_backward_windows(forward_step_func=step, data_iterator=iter(seq), model=model,
                             num_microbatches=len(seq), forward_only=True)
    assert [lay.host_copy for lay in seen] == [mb.layout for mb in seq]
    assert all(lay.tokens.device.type == "meta" and lay.traj_rows.device.type == "meta" for lay in seen)
    assert all(mb.layout.tokens.device.type == "cpu" and mb.layout.host_copy is None for mb in seq)
    on_cpu = seq[0]
    assert microbatch_on(on_cpu, "cpu") is on_cpu
