"""Expanded mode == transformers' KimiLinearForCausalLM per trajectory (docs/design.md invariant 4), and the
weight mapping both ways."""
import pytest
import torch

from megatron_harts.models.hf_convert import (hf_to_megatron, hybrid_config_from_hf, kimi_linear_hf_config,
                                              load_hf_weights, megatron_to_hf)
from megatron_harts.models.model import build_hybrid_model

from hybrid_tiny import VOCAB, expanded_inputs, randomize_, tiny_config, tiny_forest, tree_inputs

transformers = pytest.importorskip("transformers")


def _state(model):
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": 12, "moe_router_topk": 1},
                                       {"moe_router_norm_topk_prob": False}], ids=["kimi", "qlora_top1", "no_norm"])
def test_expanded_matches_transformers_kimi_linear_fp32(cpu_world, overrides):
    cfg = tiny_config(dtype=torch.float32, **overrides)
    model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 3).eval()
    hf = transformers.KimiLinearForCausalLM(kimi_linear_hf_config(cfg, VOCAB)).float().eval()
    missing, unexpected = hf.load_state_dict(megatron_to_hf(_state(model), cfg), strict=False)
    assert not missing and not unexpected
    forest = tiny_forest(3)
    lay, psp = tree_inputs(forest, cfg)
    ids, pos, epsp, erows, etok, _ = expanded_inputs(lay, forest)
    with torch.no_grad():
        ours = model(ids, pos, packed_seq_params=epsp, pair_row=erows, pair_token=etok)
        tree = model(lay.tokens[None], lay.position_ids[None], packed_seq_params=psp, pair_row=lay.pair_row,
                     pair_token=lay.pair_token)[lay.target_pair]
        ref = torch.empty_like(ours)
        for t, tid in enumerate(lay.traj_ids):
            logp = hf(torch.as_tensor(forest.expand(tid).tokens)[None]).logits[0].double().log_softmax(-1)
            sel = torch.nonzero(lay.target_traj == t)[:, 0]
            ref[sel] = logp[lay.target_position[sel] - 1, lay.target_token[sel]].to(ref.dtype)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    # invariant 2 through the whole model: with replay, fp32 tree KDA is bitwise expanded KDA;
    # attention, MoE and the logits differ by reduction order only
    torch.testing.assert_close(tree, ours, rtol=1e-5, atol=1e-5)


def test_weight_mapping_round_trip_and_load(cpu_world):
    cfg = tiny_config(q_lora_rank=12)
    model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 4)
    state = _state(model)
    hf_state = megatron_to_hf(state, cfg)
    back = hf_to_megatron(hf_state, cfg)
    assert set(back) >= {n for n, _ in model.named_parameters()}
    for name, value in back.items():
        assert torch.equal(value, state[name]), name
    fresh = build_hybrid_model(cfg, vocab_size=VOCAB)
    load_hf_weights(fresh, hf_state, cfg)
    fresh_state = _state(fresh)
    for name, _ in model.named_parameters():
        assert torch.equal(fresh_state[name], state[name]), name
    hf_state.pop("model.layers.1.mlp.experts.down_proj")
    with pytest.raises(KeyError, match="experts.down_proj"):
        hf_to_megatron(hf_state, cfg)


def test_config_from_transformers_round_trip(cpu_world):
    cfg = tiny_config(q_lora_rank=12)
    hf_cfg = kimi_linear_hf_config(cfg, VOCAB)
    back = hybrid_config_from_hf(hf_cfg, params_dtype=torch.float64)
    for field in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "linear_num_heads",
                  "linear_head_dim", "linear_conv_kernel_dim", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                  "qk_rope_head_dim", "v_head_dim", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
                  "moe_shared_expert_intermediate_size", "moe_router_topk_scaling_factor", "moe_router_num_groups",
                  "moe_router_group_topk", "layernorm_epsilon"):
        assert getattr(back, field) == getattr(cfg, field), field
    assert back.resolved_layer_types() == cfg.resolved_layer_types()
    assert back.resolved_mlp_types() == cfg.resolved_mlp_types()
    model = build_hybrid_model(back, vocab_size=VOCAB)        # the converted config builds
    assert model.decoder.layers[1].mlp.router.expert_bias is not None
    hf_cfg.norm_topk_prob = False
    assert hybrid_config_from_hf(hf_cfg).moe_router_norm_topk_prob is False
