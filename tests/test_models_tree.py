"""Hybrid model (KDA + MLA + MoE on megatron-core): tree mode == expanded mode (docs/design.md invariant 1).

Tiny fp64 model on CPU (tests/megatron_cpu.py shim): per-target log-probs, the
loss (with the MoE aux loss attached), every parameter gradient, aux-loss
values, tokens per expert and expert-bias counts, with and without activation
recomputation; plus the configurations the tree path refuses.
"""
import pytest
import torch

from megatron_harts.models.model import build_hybrid_model

from hybrid_tiny import VOCAB, expanded_inputs, random_forest, randomize_, tiny_config, tiny_forest, tree_inputs


_CACHE = {}


def _run(model, inputs, coeffs):
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    # emptied, not zeroed: megatron sizes an entry by the layers of the model that first writes it, and an
    # earlier test's model may have had more
    get_moe_layer_wise_logging_tracker().clear()
    model.zero_grad(set_to_none=True)
    routers = [l.mlp.router for l in model.decoder.layers if l.is_moe_layer]
    for r in routers:
        if r.local_tokens_per_expert is not None:
            r.local_tokens_per_expert.zero_()
    ids, pos, psp, prow, ptok, select = inputs
    lp = model(ids, pos, packed_seq_params=psp, pair_row=prow, pair_token=ptok)
    lp = lp[select] if select is not None else lp
    loss = (coeffs * lp).sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    tracker = get_moe_layer_wise_logging_tracker()
    aux = torch.cat([tracker[k]["values"] for k in ("load_balancing_loss", "z_loss") if k in tracker])
    tpe = torch.stack([r.last_tokens_per_expert for r in routers])
    bias_counts = torch.stack([r.local_tokens_per_expert.clone() if r.local_tokens_per_expert is not None
                               else torch.zeros(r.config.num_moe_experts) for r in routers])
    return lp.detach(), loss.detach(), grads, aux, tpe, bias_counts


def _both_modes(cfg, seed=0, forest=None, replay=True):
    model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), seed)
    forest = tiny_forest(seed) if forest is None else forest
    lay, psp = tree_inputs(forest, cfg, replay=replay)
    ids, pos, epsp, erows, etok, _ = expanded_inputs(lay, forest)
    coeffs = torch.randn(lay.target_row.shape[0], generator=torch.Generator().manual_seed(seed + 7),
                         dtype=torch.float64)
    tree = _run(model, (lay.tokens[None], lay.position_ids[None], psp, lay.pair_row, lay.pair_token,
                        lay.target_pair), coeffs)
    expanded = _run(model, (ids, pos, epsp, erows, etok, None), coeffs)
    return lay, tree, expanded


def _assert_modes_equal(tree, expanded, rtol=1e-10, every_gradient=True):
    """Log-probs, loss, every gradient (relative to its largest entry), aux/z losses, counts.

    ``every_gradient``: every parameter must get a gradient (a hand-built batch reaches every expert);
    False for small random batches, where a parameter without one is compared as zero."""
    lp_t, loss_t, g_t, aux_t, tpe_t, bias_t = tree
    lp_e, loss_e, g_e, aux_e, tpe_e, bias_e = expanded
    torch.testing.assert_close(lp_t, lp_e, rtol=rtol, atol=1e-12)
    torch.testing.assert_close(loss_t, loss_e, rtol=rtol, atol=1e-12)
    assert set(g_t) == set(g_e)
    for name in g_e:
        scale = float(g_e[name].abs().max())
        assert scale > 0 or not every_gradient, f"{name} got no gradient: the test would not see a difference"
        torch.testing.assert_close(g_t[name], g_e[name], rtol=0, atol=rtol * scale, msg=f"gradient of {name}")
    assert float(aux_e.abs().sum()) > 0 or not every_gradient
    assert aux_t.shape == aux_e.shape
    torch.testing.assert_close(aux_t, aux_e, rtol=rtol, atol=0)
    assert torch.equal(tpe_t, tpe_e)
    assert torch.equal(bias_t, bias_e)


@pytest.mark.parametrize("overrides,forest_seed,replay", [
    ({}, None, True),                         # Kimi-Linear: NoPE MLA, no q LoRA, sigmoid group routing
    ({"mla_rope": True, "q_lora_rank": 12, "kda_chunk_size": 8, "kda_mla_ratio": 2, "moe_z_loss_coeff": 1e-2,
      "tree_attention_backend": "sdpa"}, 1, False),
    ({"mla_rope": True, "tree_attention_backend": "varlen"}, 2, True),
], ids=["kimi", "rope_qlora_zloss_sdpa_random_forest_no_replay", "rope_varlen_random_forest"])
def test_tree_equals_expanded_fp64(cpu_world, overrides, forest_seed, replay):
    cfg = tiny_config(**overrides)
    forest = None if forest_seed is None else random_forest(forest_seed)
    lay, tree, expanded = _both_modes(cfg, forest=forest, replay=replay)
    assert lay.num_trees >= 2 and lay.num_segments >= 5
    assert lay.num_rows < int(lay.traj_length.sum())                     # real sharing happened
    assert set(cfg.resolved_layer_types()) == {"kda", "mla"}
    assert cfg.resolved_mlp_types()[0] == "dense" and "moe" in cfg.resolved_mlp_types()
    _assert_modes_equal(tree, expanded)


def test_tree_equals_expanded_softmax_router(cpu_world):
    """megatron's softmax routing computes its probabilities in fp32 even for fp64 models, so the
    two modes agree to fp32 rounding there (a q-weighting error would be O(1))."""
    cfg = tiny_config(moe_router_score_function="softmax", moe_router_enable_expert_bias=False,
                      moe_router_num_groups=None, moe_router_group_topk=None, moe_router_topk_scaling_factor=None)
    _, tree, expanded = _both_modes(cfg, seed=2)
    _assert_modes_equal(tree, expanded, rtol=1e-6)


@pytest.mark.parametrize("recompute", [
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(recompute_granularity="selective", recompute_modules=["moe", "layernorm"]),
], ids=["full", "selective_moe_layernorm"])
def test_activation_recomputation_gives_equal_gradients(cpu_world, recompute):
    if "no_recompute" not in _CACHE:
        _CACHE["no_recompute"] = _both_modes(tiny_config(), seed=1)
    _, tree, expanded = _CACHE["no_recompute"]
    _, tree_r, expanded_r = _both_modes(tiny_config(**recompute), seed=1)
    _assert_modes_equal(tree_r, tree, rtol=1e-12)
    _assert_modes_equal(expanded_r, expanded, rtol=1e-12)
    _assert_modes_equal(tree_r, expanded_r)


def test_batched_expanded_equals_packed(cpu_world):
    """The [s, b] batched form (no packed params) is expanded mode too: same numbers as THD packing."""
    from megatron_harts.models.packed import TreePackedSeqParams
    cfg = tiny_config(moe_aux_loss_coeff=0.0)
    model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 2)
    gen = torch.Generator().manual_seed(0)
    seqs = torch.randint(0, VOCAB, (3, 11), generator=gen)
    pos = torch.arange(11).repeat(3, 1)
    with torch.no_grad():
        batched = model(seqs, pos)                                           # [s, b, V]
        psp = TreePackedSeqParams.for_sequences([11, 11, 11])
        packed = model(seqs.reshape(1, -1), psp.position_ids[None], packed_seq_params=psp)   # [3*11, 1, V]
    torch.testing.assert_close(batched.transpose(0, 1).reshape(-1, VOCAB), packed[:, 0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("overrides,flag", [
    ({"moe_expert_capacity_factor": 1.0}, "--moe-expert-capacity-factor"),
    ({"moe_router_load_balancing_type": "seq_aux_loss"}, "--moe-router-load-balancing-type"),
    ({"moe_input_jitter_eps": 0.01}, "--moe-input-jitter-eps"),
    ({"tree_attention_backend": "flash"}, "tree_attention_backend"),
    ({"hidden_dropout": 0.1}, "--hidden-dropout"),
    ({"layer_types": ["kda", "gdn", "kda", "mla"]}, "layer_types"),
    ({"mlp_types": ["dense", "moe"]}, "mlp_types"),
    ({"window_size": (8, 0)}, "--window-size"),
    ({"qk_layernorm": True}, "--qk-layernorm"),
    ({"softmax_type": "learnable"}, "--softmax-type"),
    ({"normalization": "LayerNorm"}, "--normalization"),
    ({"recompute_granularity": "selective", "recompute_modules": ["layernorm", "core_attn"]}, "--recompute-modules"),
])
def test_build_refuses_what_the_tree_path_cannot_honour(cpu_world, overrides, flag):
    cfg = tiny_config(**overrides)
    with pytest.raises(ValueError, match=flag.replace("-", r"\-")):
        build_hybrid_model(cfg, vocab_size=VOCAB)


def test_expanded_only_model_accepts_capacity_factor(cpu_world):
    """With tree_mode=False the same options build: the refusal is about the tree path only."""
    cfg = tiny_config(moe_expert_capacity_factor=1.0, tree_mode=False)
    build_hybrid_model(cfg, vocab_size=VOCAB)


def test_sharded_state_dict_covers_every_parameter(cpu_world):
    model = build_hybrid_model(tiny_config(), vocab_size=VOCAB)
    sd = model.sharded_state_dict()
    assert {n for n, _ in model.named_parameters()} <= set(sd)


def test_expanded_params_hold_their_sequences_as_key_paths():
    """Expanded mode's key paths (the fa4 attention of packed sequences) are its sequences, built
    once per microbatch; padded params get their own, with the padding as one more sequence."""
    from megatron_harts.models import TreePackedSeqParams
    psp = TreePackedSeqParams.for_sequences([3, 1, 2])
    paths = psp.sequence_key_paths("cpu")
    assert psp.sequence_key_paths("cpu") is paths
    assert (paths.num_runs, paths.num_queries, paths.pairs) == (3, 6, 6 + 1 + 3)
    assert paths.q_offsets.tolist() == [0, 3, 4, 6] == paths.k_offsets.tolist()
    padded = psp.padded(2).sequence_key_paths("cpu")
    assert (padded.num_runs, padded.num_queries, padded.q_lengths.tolist()) == (4, 8, [3, 1, 2, 2])
