"""Multi-head latent attention (MLA) on megatron-core linears with the tree core attention.

Parameterization is transformers' ``KimiLinearAttention`` (DeepSeek-V2 MLA;
Kimi-Linear applies no rotary embedding, "NoPE", but keeps the shared key
part of ``qk_rope_head_dim`` channels).  Heads are split over TP ranks.

======================  ======================================  ==========================
ours                    shape (per rank)                        transformers
======================  ======================================  ==========================
linear_q_proj           [Hl*(dn+dr), hidden]  (no q LoRA)       q_proj
linear_q_down_proj      [q_lora, hidden] (repl.)                q_a_proj
q_layernorm.weight      [q_lora] (repl.)                        q_a_layernorm.weight
linear_q_up_proj        [Hl*(dn+dr), q_lora]                    q_b_proj
linear_kv_down_proj     [kv_lora+dr, hidden] (repl.)            kv_a_proj_with_mqa
kv_layernorm.weight     [kv_lora] (repl.)                       kv_a_layernorm.weight
linear_kv_up_proj       [Hl*(dn+dv), kv_lora]                   kv_b_proj
linear_proj             [hidden, Hl*dv]                         o_proj
======================  ======================================  ==========================

Per head: q = [q_nope, q_rope], k = [k_nope, k_rope (shared by all heads)],
attention scale (dn + dr)^-1/2.  With ``config.mla_rope`` the rope parts are
rotated (rotate-half convention, base ``mla_rotary_base``) by each row's
position id: the path depth in tree mode, the position in the sequence in
expanded mode, so tree rows get exactly their trajectories' rotations.

Core attention is the spec slot ``MLASubmodules.core_attention``
(:class:`~megatron_harts.models.cores.MLACoreAttention`), which reads the row mode from the
packed-sequence params: ``ops.tree_attention`` (a key row is visible to the rows of its subtree, less
the keys compaction events evict) in tree mode; causal attention per sequence in expanded (packed or
batched) mode: packed sequences go through flash-attn-4's varlen kernel where it runs
(``ops.key_paths``: the kernel of tree mode's ``varlen`` backend, so that both modes time the same
attention kernel), else through SDPA over the sequences zero-padded to the longest.  Packed
sequences with compaction events (``TreePackedSeqParams.visibility``) take fa4 over their key paths,
else ``ops.tree_attention`` over that visibility with the model's tree-attention backend.  The core
gets the latents and :meth:`TreeMLA.keys_values` (the up projection) rather than keys and values
alone: a sharing-window producer exports the latents, a consumer up-projects the exported ones.
This module's forward is the same in every mode.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron.core import tensor_parallel
from megatron.core.parallel_state import get_tensor_model_parallel_group
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from .common import (check_divisible, local_column_linear, rows_linear, shared_input_linears, tp_input, tp_replicated,
                     tp_size)
from .cores import MLACoreAttention, row_positions
from .norm import rms_normalize


def rotate_half_rope(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary embedding (rotate-half convention) of x [N, heads, d] at integer positions pos [N]."""
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d))
    ang = pos.to(torch.float64)[:, None] * inv[None]
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


@dataclass
class MLASubmodules:
    """Submodules of the MLA module: the output projection (any RowParallelLinear-compatible class) and
    the core attention (``models.cores.MLACoreAttention``'s interface: the row mode of the
    packed-sequence params is read there)."""
    linear_proj: Union[ModuleSpec, type] = tensor_parallel.RowParallelLinear
    core_attention: Union[ModuleSpec, type] = MLACoreAttention


class TreeMLA(MegatronModule):
    """MLA self-attention, TP over heads, tree core attention; called like megatron's SelfAttention."""

    def __init__(self, config, submodules: MLASubmodules, layer_number: int, attn_mask_type=None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, **kwargs):
        super().__init__(config)
        self.config = config
        self.layer_number = layer_number
        self.tp_group = pg_collection.tp if pg_collection is not None else get_tensor_model_parallel_group()
        tp = tp_size(self.tp_group)
        H = config.num_attention_heads
        self.num_heads_local = check_divisible(H, tp, "num_attention_heads")
        dn, dr, dv = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.dn, self.dr, self.dv = dn, dr, dv
        hid = config.hidden_size
        dt = config.params_dtype
        dev = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.q_lora_rank = config.q_lora_rank
        if self.q_lora_rank is None:
            self.linear_q_proj = local_column_linear(hid, H * (dn + dr), config, self.tp_group)
        else:
            self.linear_q_down_proj = torch.nn.Linear(hid, self.q_lora_rank, bias=False, dtype=dt, device=dev)
            self.q_layernorm_weight = torch.nn.Parameter(torch.ones(self.q_lora_rank, dtype=dt, device=dev))
            self.linear_q_up_proj = local_column_linear(self.q_lora_rank, H * (dn + dr), config, self.tp_group)
        # TP-replicated (same values on every TP rank): latent down projections and their norms
        self.linear_kv_down_proj = torch.nn.Linear(hid, config.kv_lora_rank + dr, bias=False, dtype=dt, device=dev)
        self.kv_layernorm_weight = torch.nn.Parameter(torch.ones(config.kv_lora_rank, dtype=dt, device=dev))
        self.linear_kv_up_proj = local_column_linear(config.kv_lora_rank, H * (dn + dv), config, self.tp_group)
        self.linear_proj = build_module(
            submodules.linear_proj, H * dv, hid, config=config, init_method=config.output_layer_init_method,
            bias=False, input_is_parallel=True, skip_bias_add=True, is_expert=False, tp_group=self.tp_group)
        if config.perform_initialization:
            with torch.no_grad():
                for lin in ([self.linear_q_down_proj] if self.q_lora_rank else []) + [self.linear_kv_down_proj]:
                    config.init_method(lin.weight)
        self.scale = (dn + dr) ** -0.5
        self.core_attention = build_module(submodules.core_attention, config=config, layer_number=layer_number,
                                           softmax_scale=self.scale)

    def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, **kwargs):
        if inference_context is not None:
            raise ValueError("TreeMLA: inference (KV cache) is not supported")
        cfg = self.config
        x = tp_input(hidden_states, cfg, self.tp_group)
        s, b, hid = x.shape
        rows = x.reshape(s * b, hid)
        H, dn, dr, dv = self.num_heads_local, self.dn, self.dr, self.dv
        g = self.tp_group
        q_in = self.linear_q_proj if self.q_lora_rank is None else tp_replicated(self.linear_q_down_proj.weight, g)
        q, ckv = shared_input_linears(rows, (q_in, tp_replicated(self.linear_kv_down_proj.weight, g)))
        if self.q_lora_rank is not None:
            qa = rms_normalize(q, cfg.mla_latent_norm_eps) * tp_replicated(self.q_layernorm_weight, g)
            q = rows_linear(self.linear_q_up_proj, qa)
        q = q.view(-1, H, dn + dr)
        kv_lat, k_rope = ckv.split([cfg.kv_lora_rank, dr], dim=-1)
        kv_lat = rms_normalize(kv_lat, cfg.mla_latent_norm_eps) * tp_replicated(self.kv_layernorm_weight, g)
        k_rope = k_rope.view(-1, 1, dr)
        if cfg.mla_rope and dr:
            pos = row_positions(packed_seq_params, s, b, rows.device)
            q = torch.cat([q[..., :dn], rotate_half_rope(q[..., dn:], pos, cfg.mla_rotary_base)], dim=-1)
            k_rope = rotate_half_rope(k_rope, pos, cfg.mla_rotary_base)
        o = self.core_attention(q, kv_lat, k_rope, self.keys_values, packed_seq_params, shape=(s, b))
        out, bias = self.linear_proj(o.reshape(s, b, H * dv))
        return out, bias

    def keys_values(self, kv_latent: torch.Tensor, k_rope: torch.Tensor):
        """Keys [n, Hl, dn+dr] and values [n, Hl, dv] of rows from their normalized latents [n, kv_lora_rank]
        and rotated shared rope keys [n, 1, dr] (``linear_kv_up_proj``)."""
        H, dn, dr, dv = self.num_heads_local, self.dn, self.dr, self.dv
        kv = rows_linear(self.linear_kv_up_proj, kv_latent).view(-1, H, dn + dv)
        k_nope, v = kv.split([dn, dv], dim=-1)
        return torch.cat([k_nope, k_rope.expand(-1, H, dr)], dim=-1), v
