"""The hybrid Kimi-Linear-style model on megatron-core's GPTModel, in tree or expanded mode.

``build_hybrid_model(config, vocab_size)`` validates the config (options the
tree path cannot honour are refused with the flag's name) and returns a
``HybridModel``: megatron's GPTModel (embedding, TransformerBlock of
``HybridTransformerLayer``s, final RMSNorm, vocab-parallel output layer) with
no position embedding (MLA is NoPE unless ``mla_rope``).

One model, two modes, same weights (``packed_seq_params`` selects):

- tree: ``input_ids`` = the layout's row tokens [1, R],
  ``packed_seq_params = TreePackedSeqParams.for_tree(layout, chunk_size=config.kda_chunk_size)``;
- expanded: trajectories packed back to back [1, sum L] with
  ``TreePackedSeqParams.for_sequences(lengths)``, or batched [b, s] with no
  packed params.

``forward(..., pair_row=, pair_token=)`` returns the log-probabilities of the
(row, token) pairs from the vocab-parallel output layer
(``ops.logprobs.multi_target_logprobs``: logits once per row, several targets
per row, ``config.logprob_chunk_rows`` rows of logits at a time; with ``return_entropy`` also
each row's softmax entropy); rows are numbered batch-major (``b * s + position``; for [R, 1] or
packed inputs simply the token index).  Without pairs it returns the logits
[s, b, V/tp].  Under sequence parallelism the token count must be divisible by
the TP size (megatron scatters the embeddings along the sequence): with packed-sequence
params (one row of tokens) the model pads the rows itself (``TreePackedSeqParams.padded``).
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from ..megatron_lm import config_refusal
from ..ops.logprobs import multi_target_logprobs
from ..ops.moe import validate_tree_moe_config
from .config import ATTENTION_BACKENDS, HybridConfig
from .layer import hybrid_block_spec


def validate_config(config: HybridConfig) -> None:
    """Refuse configurations the hybrid model (or, with ``tree_mode``, the tree path) cannot honour."""
    if not isinstance(config, HybridConfig):
        raise ValueError(f"build_hybrid_model needs a HybridConfig, got {type(config).__name__}")
    config.resolved_layer_types()
    mlps = config.resolved_mlp_types()
    if config.tree_attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"tree_attention_backend {config.tree_attention_backend!r} has no tree path; "
                         f"expected one of {ATTENTION_BACKENDS}")
    # options set by Megatron-LM flags that the hybrid model has no path for (one table: megatron_lm.py)
    refusal = config_refusal(config)
    if refusal:
        raise ValueError(refusal)
    if config.tree_mode:
        validate_tree_moe_config(config)
        lb = config.moe_router_load_balancing_type
        lbs = lb if isinstance(lb, (list, tuple)) else [lb]
        bad = [t for t in lbs if t not in ("aux_loss", "none")]
        if "moe" in mlps and bad:
            raise ValueError(f"--moe-router-load-balancing-type {bad[0]!r} is not supported with tree sharing: "
                             "use 'aux_loss' or 'none'")
        if config.hidden_dropout or config.attention_dropout:
            raise ValueError("--hidden-dropout / --attention-dropout must be 0 with tree sharing: dropout masks "
                             "differ between a shared row and its per-trajectory copies")


class HybridModel(GPTModel):
    """GPTModel with the hybrid block; forward returns pair log-probs or logits (module docstring)."""

    def _set_attention_backend(self):
        """Nothing to set: megatron's LanguageModule writes Transformer Engine's NVTE_*_ATTN
        variables into the process environment here, to steer TE's attention, which this model never
        runs (its MLA and KDA cores are its own); an embedding process keeps its environment."""

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, decoder_input: Optional[torch.Tensor] = None,
                labels=None, packed_seq_params=None, pair_row: Optional[torch.Tensor] = None,
                pair_token: Optional[torch.Tensor] = None, return_hidden: bool = False,
                return_entropy: bool = False, **kwargs):
        tp = self.pg_collection.tp.size()
        real = None
        if self.config.sequence_parallel and tp > 1:
            if packed_seq_params is not None and not packed_seq_params.pad_rows \
                    and packed_seq_params.num_tokens % tp:
                # pad the rows to a multiple of the TP size: the pad rows are read by nothing
                # (models/packed.py); every pipeline stage pads its params the same way
                real = packed_seq_params.num_tokens
                pad = (-real) % tp
                packed_seq_params = packed_seq_params.padded(pad)
                if input_ids is not None:
                    input_ids = torch.cat([input_ids, input_ids.new_zeros(1, pad)], dim=1)
                if position_ids is not None:
                    position_ids = torch.cat([position_ids, position_ids.new_zeros(1, pad)], dim=1)
            elif input_ids is not None and input_ids.shape[1] % tp:
                raise ValueError(f"--sequence-parallel: {input_ids.shape[1]} tokens/rows are not divisible by "
                                 f"--tensor-model-parallel-size {tp}; pad the batch")
        if decoder_input is None and self.pre_process:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)
        hidden = self.decoder(hidden_states=decoder_input, attention_mask=attention_mask,
                              packed_seq_params=packed_seq_params)
        if not self.post_process or return_hidden:
            return hidden
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights \
            else self.output_layer.weight
        if pair_row is None:
            logits, _ = self.output_layer(hidden, weight=weight if self.share_embeddings_and_output_weights else None)
            return logits if real is None else logits[:real]
        tp_group = self.pg_collection.tp
        reduce_hidden = True
        if self.config.sequence_parallel and tp > 1:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=tp_group)
            reduce_hidden = False
        rows = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])     # [b*s, h], batch-major
        return multi_target_logprobs(rows, weight, pair_row, pair_token, tp_group=tp_group if tp > 1 else None,
                                     reduce_hidden_grad=reduce_hidden, return_entropy=return_entropy,
                                     chunk_rows=self.config.logprob_chunk_rows)


def build_hybrid_model(config: HybridConfig, vocab_size: int, *, max_sequence_length: int = 1 << 20,
                       pre_process: bool = True, post_process: bool = True,
                       share_embeddings_and_output_weights: bool = False, pg_collection=None,
                       vp_stage: Optional[int] = None) -> HybridModel:
    """Validate ``config`` and build the hybrid model (megatron's parallel state must be initialized)."""
    validate_config(config)
    return HybridModel(config=config, transformer_layer_spec=hybrid_block_spec(config), vocab_size=vocab_size,
                       max_sequence_length=max_sequence_length, pre_process=pre_process,
                       post_process=post_process, share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                       position_embedding_type="none", pg_collection=pg_collection, vp_stage=vp_stage)
