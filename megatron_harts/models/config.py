"""``HybridConfig``: megatron's TransformerConfig plus the Kimi-Linear hybrid's fields.

Layer pattern: ``layer_types`` (a list of "kda"/"mla", one per layer) or, when
it is None, ``kda_mla_ratio`` r: layers ``r, 2r+1, ...`` (every (r+1)-th, 0-based
``(i + 1) % (r + 1) == 0``) are MLA, the others KDA (Kimi-Linear: r = 3).
MLP pattern: ``mlp_types`` ("dense"/"moe" per layer) or the first
``first_k_dense_replace`` layers dense and the rest MoE (when ``num_moe_experts``
is set; all dense otherwise).

Field names follow transformers' ``KimiLinearConfig`` where megatron has no
equivalent; MoE options keep megatron's names (``moe_router_num_groups`` =
``n_group``, ``moe_router_group_topk`` = ``topk_group``,
``moe_router_topk_scaling_factor`` = ``routed_scaling_factor``).

``tree_kda_call_plan`` picks how tree mode runs KDA over a microbatch's segments
(``--tree-kda-call-plan``): ``harts`` (default; the call planner's optimum,
``planner/calls.py``), or the ablations ``per-depth`` (one call per fork level) and
``node-wise`` (one call per segment depth, the paper's "Node-wise LA"), both without
replay (``planner/baselines.py``).  All three compute the same function; the ablations
run on layouts of whole trees only (no sharing windows).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from megatron.core.transformer.transformer_config import TransformerConfig

from ..planner.baselines import CALL_PLANS

LAYER_TYPES = ("kda", "mla")
MLP_TYPES = ("dense", "moe")
ATTENTION_BACKENDS = ("reference", "sdpa", "flex", "varlen", "interval", "fa4")


@dataclass
class HybridConfig(TransformerConfig):
    """TransformerConfig of a KDA/MLA hybrid MoE model (see module docstring)."""

    # KDA (linear attention) layers
    linear_num_heads: int = 4
    linear_head_dim: int = 32
    linear_conv_kernel_dim: int = 4
    kda_chunk_size: int = 64
    kda_backend: str = "reference"
    # the KDA layers' elementwise chains and the sigmoid router's top-k as fused Triton kernels where they
    # run (CUDA, 16/32-bit floats; ``ops.kda_elementwise``, ``ops.router_topk``); eager torch otherwise
    fused_kernels: bool = True
    # the KDA layers' short convs and q/k/v activations computed again in the backward instead of keeping
    # what they save (``models.cores.KDACore``; the same values, the gradients to rounding)
    kda_input_recompute: bool = True
    tree_kda_call_plan: str = "harts"   # one of CALL_PLANS (module docstring)
    # MLA (full attention) layers
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    mla_rope: bool = False            # False: NoPE (Kimi-Linear); True: RoPE on the rope dims
    mla_latent_norm_eps: float = 1e-6  # RMSNorm eps of the q/kv latents: Kimi-Linear fixes it at 1e-6,
                                       # whatever rms_norm_eps (layernorm_epsilon) says
    mla_rotary_base: float = 10000.0
    tree_attention_backend: str = "sdpa"
    # output layer: rows per logits chunk of the pair log-probs (None: ops.logprobs.default_chunk_rows);
    # the values do not depend on it
    logprob_chunk_rows: Optional[int] = None
    # patterns
    layer_types: Optional[List[str]] = None
    kda_mla_ratio: int = 3
    mlp_types: Optional[List[str]] = None
    first_k_dense_replace: int = 1
    # router: experts per group summed to score a group (DeepSeek-V3 / Kimi-Linear: 2)
    moe_router_group_score_topk: int = 2
    # sigmoid router: renormalize the top-k weights to sum 1 (transformers' norm_topk_prob), also for k = 1
    moe_router_norm_topk_prob: bool = True
    # the model will run rollout trees (tree mode): refuse options the tree path cannot honour
    tree_mode: bool = True

    def __post_init__(self):
        """megatron's checks, then: ``tree_kda_call_plan`` is one of ``CALL_PLANS`` and
        ``logprob_chunk_rows`` a positive integer or None."""
        super().__post_init__()
        if self.logprob_chunk_rows is not None and (isinstance(self.logprob_chunk_rows, bool)
                                                    or not isinstance(self.logprob_chunk_rows, int)
                                                    or self.logprob_chunk_rows < 1):
            raise ValueError(f"logprob_chunk_rows {self.logprob_chunk_rows!r} (--tree-logprob-chunk-rows) must be "
                             "a positive integer or None")
        if self.tree_kda_call_plan not in CALL_PLANS:
            raise ValueError(f"tree_kda_call_plan {self.tree_kda_call_plan!r} (--tree-kda-call-plan) must be one "
                             f"of {', '.join(CALL_PLANS)}")

    def resolved_layer_types(self) -> List[str]:
        if self.layer_types is not None:
            types = list(self.layer_types)
            if len(types) != self.num_layers:
                raise ValueError(f"layer_types has {len(types)} entries, --num-layers is {self.num_layers}")
            bad = [t for t in types if t not in LAYER_TYPES]
            if bad:
                raise ValueError(f"layer_types: unknown type {bad[0]!r}; expected one of {LAYER_TYPES}")
            return types
        r = self.kda_mla_ratio
        if not isinstance(r, int) or r < 0:
            raise ValueError(f"kda_mla_ratio must be a non-negative integer, got {r!r}")
        return ["mla" if (i + 1) % (r + 1) == 0 else "kda" for i in range(self.num_layers)]

    def resolved_mlp_types(self) -> List[str]:
        if self.mlp_types is not None:
            types = list(self.mlp_types)
            if len(types) != self.num_layers:
                raise ValueError(f"mlp_types has {len(types)} entries, --num-layers is {self.num_layers}")
            bad = [t for t in types if t not in MLP_TYPES]
            if bad:
                raise ValueError(f"mlp_types: unknown type {bad[0]!r}; expected one of {MLP_TYPES}")
            if "moe" in types and not self.num_moe_experts:
                raise ValueError("mlp_types has MoE layers but --num-experts is not set")
            return types
        if not self.num_moe_experts:
            return ["dense"] * self.num_layers
        k = self.first_k_dense_replace
        return ["dense" if i < k else "moe" for i in range(self.num_layers)]
