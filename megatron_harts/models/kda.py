"""Kimi Delta Attention layer (KDA) as a megatron-core attention module, tree-aware.

Parameterization is transformers' ``KimiLinearDeltaAttention`` (one-to-one
mapping in :mod:`megatron_harts.models.hf_convert`), with the heads split over
tensor-parallel ranks (H heads of dimension D, ``Hl = H / tp`` per rank):

=====================  ===================  ===================================
ours                   shape (per rank)     transformers
=====================  ===================  ===================================
linear_q/k/v.weight    [Hl*D, hidden]       q_proj / k_proj / v_proj.weight
conv_q/k/v_weight      [Hl*D, Kc]           conv1d.weight[C, 1, Kc], C = [q; k; v]
linear_f_a.weight      [D, hidden] (repl.)  forget_gate.f_a_proj.weight
linear_f_b.weight      [Hl*D, D]            forget_gate.f_b_proj.weight
A_log                  [1, 1, Hl, 1]        forget_gate.A_log
dt_bias                [Hl*D]               forget_gate.dt_bias
linear_beta.weight     [Hl, hidden]         b_proj.weight
linear_g_a.weight      [D, hidden] (repl.)  g_a_proj.weight
linear_g_b.weight      [Hl*D, D]            g_b_proj.weight
out_norm_weight        [D] (repl.)          o_norm.weight
linear_proj.weight     [hidden, Hl*D]       o_proj.weight
=====================  ===================  ===================================

Forward, per token (x = the layer's normed input):
q, k, v = SiLU(short causal conv of their projections, kernel Kc); q, k
L2-normalized per head (``x / sqrt(|x|^2 + 1e-6)``);
g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias) (per channel, <= 0);
beta = sigmoid(linear_beta(x)); o = KDA(q, k, v, g, beta) with scale D^-1/2;
out = linear_proj(RMSNorm_D(o) * out_norm_weight * sigmoid(g_b(g_a(x)))).

The sequence mixing (conv, q/k L2 norm, KDA recurrence) is the layer's core, the spec slot
``KDASubmodules.core`` (:class:`~megatron_harts.models.cores.KDACore`), which reads the row mode from
the packed-sequence params: tree mode runs the conv along ``prev`` (ops.path_conv) and the KDA core
through ``ops.tree_kda`` on the layout's call schedule; expanded (packed or batched) mode runs the
conv causally per sequence and the same KDA backend (``config.kda_backend`` from
``ops.tree_kda.KDA_BACKENDS``; "reference" = ``ops.kda.kda_chunked_varlen``) in one varlen call over
the packed sequences.  Both run chunks at multiples of the chunk size from each trajectory's
position 0, so tree == expanded to rounding (bitwise in fp32 with replay on the reference backend).
This module's forward is the same in every mode.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron.core import tensor_parallel
from megatron.core.parallel_state import get_tensor_model_parallel_group
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint,
                                             sharded_state_dict_default)

from ..ops.kda_elementwise import gated_rms_norm, kda_gate, kda_gate_reference
from ..ops.tree_kda import get_kda_backend
from .common import (check_divisible, local_column_linear, rows_linear, shared_input_linears, tp_input,
                     tp_replicated, tp_size, use_fused_kernels)
from .cores import KDACore
from .norm import rms_normalize


@dataclass
class KDASubmodules:
    """Submodules of the KDA module: the output projection (any RowParallelLinear-compatible class) and
    the core (conv, q/k norm and KDA recurrence in the row mode of the packed-sequence params,
    ``models.cores.KDACore``'s interface)."""
    linear_proj: Union[ModuleSpec, type] = tensor_parallel.RowParallelLinear
    core: Union[ModuleSpec, type] = KDACore


class KimiDeltaAttention(MegatronModule):
    """KDA self-attention, tensor-parallel over heads; called like megatron's SelfAttention.

    ``forward(hidden_states [s, b, h], attention_mask, packed_seq_params=...)``
    returns ``(output [s, b, h], None)``.
    """

    def __init__(self, config, submodules: KDASubmodules, layer_number: int, attn_mask_type=None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, **kwargs):
        super().__init__(config)
        self.config = config
        self.layer_number = layer_number
        self.tp_group = pg_collection.tp if pg_collection is not None else get_tensor_model_parallel_group()
        tp = tp_size(self.tp_group)
        H, D = config.linear_num_heads, config.linear_head_dim
        self.num_heads_local = check_divisible(H, tp, "linear_num_heads")
        self.head_dim = D
        self.kernel = config.linear_conv_kernel_dim
        hid = config.hidden_size
        C = self.num_heads_local * D
        dt = config.params_dtype
        try:
            get_kda_backend(config.kda_backend)
        except ValueError as e:
            raise ValueError(f"kda_backend {config.kda_backend!r}: {e}") from None
        dev = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()

        self.linear_q = local_column_linear(hid, H * D, config, self.tp_group)
        self.linear_k = local_column_linear(hid, H * D, config, self.tp_group)
        self.linear_v = local_column_linear(hid, H * D, config, self.tp_group)
        self.linear_beta = local_column_linear(hid, H, config, self.tp_group)
        self.linear_f_b = local_column_linear(D, H * D, config, self.tp_group)
        self.linear_g_b = local_column_linear(D, H * D, config, self.tp_group)
        # TP-replicated low-rank down projections (same values on every TP rank: default generator)
        self.linear_f_a = torch.nn.Linear(hid, D, bias=False, dtype=dt, device=dev)
        self.linear_g_a = torch.nn.Linear(hid, D, bias=False, dtype=dt, device=dev)
        self.linear_proj = build_module(
            submodules.linear_proj, H * D, hid, config=config, init_method=config.output_layer_init_method,
            bias=False, input_is_parallel=True, skip_bias_add=True, is_expert=False, tp_group=self.tp_group)
        self.core = build_module(submodules.core, config=config, layer_number=layer_number)
        self.conv_q_weight = torch.nn.Parameter(torch.empty(C, self.kernel, dtype=dt, device=dev))
        self.conv_k_weight = torch.nn.Parameter(torch.empty(C, self.kernel, dtype=dt, device=dev))
        self.conv_v_weight = torch.nn.Parameter(torch.empty(C, self.kernel, dtype=dt, device=dev))
        self.A_log = torch.nn.Parameter(torch.empty(1, 1, self.num_heads_local, 1, dtype=dt, device=dev))
        self.dt_bias = torch.nn.Parameter(torch.empty(C, dtype=dt, device=dev))
        self.out_norm_weight = torch.nn.Parameter(torch.ones(D, dtype=dt, device=dev))
        for name, dim in self.TP_SHARDED.items():
            set_tensor_model_parallel_attributes(getattr(self, name), True, dim, 1)
        self.reset_kda_parameters()

    # parameters split over TP ranks (head-major), and their split axis
    TP_SHARDED = {"conv_q_weight": 0, "conv_k_weight": 0, "conv_v_weight": 0, "A_log": 2, "dt_bias": 0}

    def reset_kda_parameters(self):
        """fla's initialization: A ~ U[1, 16] (A_log = log A), dt ~ logU[1e-3, 1e-1], dt_bias = softplus^-1(dt).

        Head-sharded tensors draw from megatron's model-parallel RNG (different per TP rank),
        the replicated down projections from the default generator (equal on all TP ranks).
        """
        if not self.config.perform_initialization:
            return
        with torch.no_grad():
            with tp_random.get_cuda_rng_tracker().fork():
                for w in (self.conv_q_weight, self.conv_k_weight, self.conv_v_weight):
                    bound = 1.0 / math.sqrt(self.kernel)
                    w.uniform_(-bound, bound)
                self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
                lo, hi = math.log(1e-3), math.log(1e-1)
                dt = torch.empty_like(self.dt_bias).uniform_(lo, hi).exp().clamp_min(1e-4)
                self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            for lin in (self.linear_f_a, self.linear_g_a):
                self.config.init_method(lin.weight)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Distributed-checkpoint view: head-sharded tensors split along TP_SHARDED's axes."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        own = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        out = make_sharded_tensors_for_checkpoint(own, prefix, dict(self.TP_SHARDED), sharded_offsets,
                                                  tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
        for name, module in self.named_children():
            out.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata,
                                                  tp_group=self.tp_group))
        return out

    def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, **kwargs):
        if inference_context is not None:
            raise ValueError("KimiDeltaAttention: inference (KV/state cache) is not supported")
        x = tp_input(hidden_states, self.config, self.tp_group)      # [s, b, h], full rows
        s, b, hid = x.shape
        rows = x.reshape(s * b, hid)
        H, D = self.num_heads_local, self.head_dim
        g_tp = self.tp_group
        q, k, v, beta, fa, ga = shared_input_linears(rows, (
            self.linear_q, self.linear_k, self.linear_v, self.linear_beta,
            tp_replicated(self.linear_f_a.weight, g_tp), tp_replicated(self.linear_g_a.weight, g_tp)))
        fused = use_fused_kernels(self.config, rows)
        gate_of = kda_gate if fused else kda_gate_reference
        g = gate_of(rows_linear(self.linear_f_b, fa), self.dt_bias, self.A_log, H)
        beta = torch.sigmoid(beta)
        o = self.core(q, k, v, g, beta, (self.conv_q_weight, self.conv_k_weight, self.conv_v_weight),
                      packed_seq_params, shape=(s, b))
        gate = rows_linear(self.linear_g_b, ga).view(-1, H, D)
        w_norm = tp_replicated(self.out_norm_weight, g_tp)
        eps = self.config.layernorm_epsilon
        if fused:
            o = gated_rms_norm(o, w_norm, gate, eps)
        else:
            o = rms_normalize(o, eps) * w_norm * torch.sigmoid(gate)
        o = o.reshape(s, b, H * D)
        out, bias = self.linear_proj(o)
        return out, bias
