"""Hybrid model across a sharing window: producer + consumers == the whole-tree run.

A producer layout records per-layer exports (MLA keys/values, KDA conv inputs, KDA core inputs and
boundary states); consumer layouts (subtrees whose ancestors are producer rows) read them.
Consumers run forward+backward into detached export leaves (gradients accumulate over the window's
consumers), then one producer backward closes the window.  fp64 on CPU: per-(trajectory, position)
log-probs and every parameter gradient equal the whole-tree run's to 1e-10 (docs/design.md,
invariant 1; the whole-tree run is pinned against expanded mode by tests/test_models_tree.py).
"""
import numpy as np
import pytest
import torch

from megatron_harts.layout import build_layout
from megatron_harts.models.model import build_hybrid_model
from megatron_harts.models.packed import ExportSpec, TreePackedSeqParams

from hybrid_tiny import VOCAB, random_forest, randomize_, tiny_config, tiny_forest
from test_layout import outermost


def _config(**kw):
    # the MoE aux loss is a per-microbatch statistic (a window splits the batch): off here
    return tiny_config(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none", **kw)


def _keys(lay, own_rows=None):
    """(forest trajectory, position) of each target, and a mask of the targets this layout owns."""
    keys = list(zip(lay.traj_forest[lay.target_traj.numpy()].tolist(), lay.target_position.tolist()))
    own = np.ones(len(keys), dtype=bool) if own_rows is None else \
        ~np.isin(lay.forest_rows[lay.target_row].numpy(), own_rows)
    return keys, own


def _logprobs(model, lay, psp):
    lp = model(lay.tokens[None], lay.position_ids[None], packed_seq_params=psp, pair_row=lay.pair_row,
               pair_token=lay.pair_token)
    return lp[lay.target_pair]


def _whole(model, forest, cfg, coef_of, replay=True):
    model.zero_grad(set_to_none=True)
    lay = build_layout(forest)
    lp = _logprobs(model, lay, TreePackedSeqParams.for_tree(lay, config=cfg, replay=replay))
    keys, _ = _keys(lay)
    coeffs = torch.tensor([coef_of(k) for k in keys], dtype=lp.dtype)
    (coeffs * lp).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return dict(zip(keys, lp.detach().tolist())), grads


def _window(model, forest, cfg, consumer_roots, coef_of, replay=True):
    """Producer forward; each consumer forward+backward into shared export leaves; window close."""
    model.zero_grad(set_to_none=True)
    producer = build_layout(forest)
    consumers = [build_layout(forest, roots=r, context=producer) for r in consumer_roots]
    spec = ExportSpec.for_consumers(producer, consumers, config=cfg, replay=replay)
    # KDA exports only what is read: conv inputs within the conv's reach, replay rows (< B per root)
    n_roots = sum(len(r) for r in consumer_roots)
    assert 0 < spec.conv_rows.numel() <= (cfg.linear_conv_kernel_dim - 1) * n_roots
    assert spec.replay_rows.numel() <= (cfg.kda_chunk_size - 1) * n_roots
    assert set(spec.conv_rows.tolist()) <= set(spec.rows.tolist()) >= set(spec.replay_rows.tolist())
    psp = TreePackedSeqParams.for_tree(producer, config=cfg, export=spec, replay=replay)
    lp_p = _logprobs(model, producer, psp)
    taken = np.concatenate([c.forest_rows.numpy() for c in consumers])
    keys_p, own = _keys(producer, taken)
    coeffs = torch.tensor([coef_of(k) if o else 0.0 for k, o in zip(keys_p, own)], dtype=lp_p.dtype)
    loss_p = (coeffs * lp_p).sum()
    out = {k: v for k, v, o in zip(keys_p, lp_p.detach().tolist(), own) if o}
    leaves = psp.exports.detached()
    for c in consumers:
        lp_c = _logprobs(model, c, TreePackedSeqParams.for_tree(c, config=cfg, exports=leaves, replay=replay))
        keys_c, _ = _keys(c)
        coeffs_c = torch.tensor([coef_of(k) for k in keys_c], dtype=lp_c.dtype)
        (coeffs_c * lp_c).sum().backward()
        for k, v in zip(keys_c, lp_c.detach().tolist()):
            assert k not in out, f"target {k} computed twice"
            out[k] = v
    if spec.state_rows.size:   # the boundary states do carry gradient back to the producer
        assert any(t.grad is not None and float(t.grad.abs().sum()) > 0
                   for d in leaves.layers.values() for n, t in d.items() if n == "states")
    psp.exports.close(leaves, loss=loss_p)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads, psp.exports.nbytes()


def _coef(seed):
    table = {}

    def coef_of(key):
        if key not in table:
            table[key] = float(np.random.default_rng([seed, *key]).normal())
        return table[key]
    return coef_of


def _roots(forest, depth_min):
    """Non-nested, non-root segments starting at >= depth_min (their ancestors stay in the producer)."""
    return outermost(forest, [s for s in range(forest.num_segments)
                              if forest.seg_parent[s] >= 0 and forest.seg_start[s] >= depth_min])


@pytest.mark.parametrize("seed,depth,split,replay", [(0, 1, False, True), (1, 5, True, True),
                                                     (2, 5, True, False)])
def test_window_equals_whole_tree_fp64(cpu_world, seed, depth, split, replay):
    cfg = _config()
    model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), seed)
    forest = random_forest(seed) if seed else tiny_forest(seed)
    roots = _roots(forest, depth)
    assert roots
    groups = [roots[0::2], roots[1::2]] if split and len(roots) > 1 else [roots]
    coef_of = _coef(seed)
    lp_w, g_w = _whole(model, forest, cfg, coef_of, replay)
    lp_x, g_x, nbytes = _window(model, forest, cfg, groups, coef_of, replay)
    assert nbytes > 0
    # the cases cover: replay rows (a root off the chunk grid), boundary states (a root at >= B)
    if seed == 1:
        assert any(int(forest.seg_start[r]) % cfg.kda_chunk_size for r in roots)
        assert all(int(forest.seg_start[r]) >= cfg.kda_chunk_size for r in roots)
    assert set(lp_x) == set(lp_w)
    for k in lp_w:
        assert abs(lp_x[k] - lp_w[k]) <= 1e-10 * max(1.0, abs(lp_w[k])), f"log-prob of {k}"
    assert set(g_x) == set(g_w)
    for name in g_w:
        scale = float(g_w[name].abs().max())
        assert scale > 0, f"{name} got no gradient"
        torch.testing.assert_close(g_x[name], g_w[name], rtol=0, atol=1e-10 * scale, msg=f"gradient of {name}")


def test_window_refusals():
    cfg = _config()
    forest = tiny_forest(0)
    producer = build_layout(forest)
    roots = _roots(forest, 5)
    consumer = build_layout(forest, roots=roots, context=producer)
    with pytest.raises(ValueError, match="pass exports="):
        TreePackedSeqParams.for_tree(consumer, config=cfg)
    spec = ExportSpec.for_consumers(producer, [consumer], config=cfg)
    with pytest.raises(ValueError, match="nested producers"):
        ExportSpec.for_consumers(consumer, [consumer], config=cfg)
    with pytest.raises(ValueError, match="no context rows"):
        ExportSpec.for_consumers(producer, [producer], config=cfg)
    psp = TreePackedSeqParams.for_tree(producer, config=cfg, export=spec)
    with pytest.raises(ValueError, match="another producer layout"):   # a consumer exports its own rows only
        TreePackedSeqParams.for_tree(consumer, config=cfg, exports=psp.exports, export=spec)
    with pytest.raises(ValueError, match="chunk size"):
        TreePackedSeqParams.for_tree(consumer, config=cfg, exports=psp.exports, replay=False)
    with pytest.raises(ValueError, match="consumer layouts"):
        TreePackedSeqParams.for_tree(producer, config=cfg, exports=psp.exports)
    other = build_layout(forest, trees=[0])
    with pytest.raises(ValueError, match="another producer"):
        TreePackedSeqParams.for_tree(other, config=cfg, export=spec)
    # a consumer whose context rows the spec was not built for
    import dataclasses
    from megatron_harts.models.packed import WindowExports
    assert consumer.num_context_rows > 1
    small = dataclasses.replace(spec, rows=spec.rows[:1])
    with pytest.raises(ValueError, match="lack context rows"):
        TreePackedSeqParams.for_tree(consumer, config=cfg, exports=WindowExports(small, {}))
