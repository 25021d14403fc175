"""Megatron modules and layer specs of the hybrid KDA/MLA MoE model, tree-aware.

Public API:

- :class:`HybridConfig` (config.py): megatron TransformerConfig + KDA/MLA/pattern fields.
- :func:`build_hybrid_model` (model.py) -> :class:`HybridModel` (a GPTModel).
- :class:`TreePackedSeqParams` (packed.py): ``for_tree(layout, ...)`` (tree mode) and
  ``for_sequences(lengths)`` (expanded mode), passed as ``packed_seq_params``.
- building blocks: :class:`RMSNorm` (SP-aware), :class:`KimiDeltaAttention`, :class:`TreeMLA`,
  :class:`HybridRouter`, :class:`HybridTransformerLayer`, :func:`hybrid_block_spec`.
- cores (cores.py): :class:`KDACore` and :class:`MLACoreAttention`, the spec slots
  ``KDASubmodules.core`` / ``MLASubmodules.core_attention``, the only modules that read the
  packed-sequence params; :func:`row_mode` decides the mode (tree, with producer/consumer roles
  and padding; packed sequences; batched).
- transformers conversion (hf_convert.py): :func:`hf_to_megatron`, :func:`megatron_to_hf`,
  :func:`load_hf_weights`, :func:`kimi_linear_hf_config`, :func:`hybrid_config_from_hf`,
  :func:`shard_full_state` (TP/EP shards of a full state dict); checkpoint files:
  :func:`~.hf_convert.load_hf_checkpoint` / :func:`~.hf_convert.save_hf_checkpoint` (transformers
  directories, stored dtypes kept), :func:`~.hf_convert.shard_for_tp` / :func:`~.hf_convert.merge_tp_shards`
  (tools/convert_hf_checkpoint.py).
- tree/expanded comparison and the CPU megatron world live in ``megatron_harts.testing``.

Call ``megatron_harts.patches.apply()`` before building (megatron-core 0.16.1 without TE).

Usage (megatron's parallel state initialized)::

    cfg = HybridConfig(num_layers=..., hidden_size=..., num_attention_heads=..., ffn_hidden_size=...,
                       normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                       add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                       kda_mla_ratio=3, num_moe_experts=..., moe_router_score_function="sigmoid", ...)
    model = build_hybrid_model(cfg, vocab_size)
    # tree mode: one row per unique prefix token
    layout = build_layout(forest)
    psp = TreePackedSeqParams.for_tree(layout, config=cfg)
    lp = model(layout.tokens[None], layout.position_ids[None], packed_seq_params=psp,
               pair_row=layout.pair_row, pair_token=layout.pair_token)        # [pairs]
    target_logprobs = lp[layout.target_pair]
    # expanded mode: the same model on trajectories packed back to back
    psp = TreePackedSeqParams.for_sequences(lengths)
    lp = model(tokens[None], psp.position_ids[None], packed_seq_params=psp, pair_row=rows, pair_token=next_tokens)
"""
from .config import HybridConfig
from .cores import KDACore, MLACoreAttention, RowMode, row_mode
from .hf_convert import (hf_to_megatron, hybrid_config_from_hf, kimi_linear_hf_config, load_hf_weights,
                         megatron_to_hf, shard_full_state)
from .kda import KimiDeltaAttention
from .layer import HybridTransformerLayer, hybrid_block_spec
from .mla import TreeMLA
from .model import HybridModel, build_hybrid_model, validate_config
from .norm import RMSNorm
from .packed import TreePackedSeqParams
from .router import HybridRouter

__all__ = ["HybridConfig", "HybridModel", "build_hybrid_model", "validate_config", "TreePackedSeqParams",
           "RMSNorm", "KimiDeltaAttention", "TreeMLA", "HybridRouter", "HybridTransformerLayer",
           "hybrid_block_spec", "hf_to_megatron", "megatron_to_hf", "load_hf_weights", "kimi_linear_hf_config",
           "hybrid_config_from_hf", "shard_full_state", "KDACore", "MLACoreAttention", "RowMode", "row_mode"]
