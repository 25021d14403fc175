"""Hybrid transformer layer and block spec (KDA / MLA attention, dense MLP / MoE).

``HybridTransformerLayer`` is megatron's TransformerLayer; the only addition is
that in tree mode it hands the layout's occurrence counts (from the
``TreePackedSeqParams`` it receives like every layer does) to its MoE router
for the duration of its forward, sliced to this rank's rows under sequence
parallelism.  ``HybridMoELayer`` is megatron's MoELayer whose selective
recomputation (``--recompute-modules moe``) re-enters the occurrence counts
captured at forward time, so the recomputed router (run during backward,
outside the layer's forward) attaches the same q-weighted aux loss, and whose
all-gather token dispatcher is ``models.dispatcher.SyncFreeAllGatherDispatcher``.  ``hybrid_block_spec(config)`` builds the per-layer specs from the
config's layer and MLP patterns; everything else (norms, bias-dropout-add,
MLP, MoE layer, the dispatchers' communication) is megatron-core's.
"""
from __future__ import annotations

import dataclasses
from typing import List

from megatron.core import tensor_parallel
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules, get_default_pg_collection
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from .cores import row_mode
from .dispatcher import SyncFreeAllGatherDispatcher
from .experts import GroupedSequentialMLP
from .kda import KDASubmodules, KimiDeltaAttention
from .mla import MLASubmodules, TreeMLA
from .norm import RMSNorm
from .router import HybridRouter


class HybridMoELayer(MoELayer):
    """MoELayer whose own activation recomputation keeps the router's tree occurrence counts, and
    whose all-gather dispatcher permutes without host synchronization (``models.dispatcher``)."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None):
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        super().__init__(config, submodules, layer_number=layer_number, pg_collection=pg_collection)
        if config.moe_token_dispatcher_type == "allgather":
            self.token_dispatcher = SyncFreeAllGatherDispatcher(self.num_local_experts, self.local_expert_indices,
                                                                config=self.config, pg_collection=pg_collection)
            if isinstance(self.experts, GroupedSequentialMLP):   # fc1 keeps the dispatch's source, not its copies
                self.experts.dispatcher = self.token_dispatcher

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        weights = self.router.token_weight_state()
        if not self.moe_layer_recompute or weights[0] is None:
            return super().forward(hidden_states, intermediate_tensors, padding_mask)

        def run(h):
            # the recomputation runs during backward: re-enter the counts captured now
            with self.router.token_weights(*weights):
                self.moe_layer_recompute = False
                try:
                    return MoELayer.forward(self, h, intermediate_tensors, padding_mask)
                finally:
                    self.moe_layer_recompute = True

        return tensor_parallel.checkpoint(run, False, hidden_states)


class HybridTransformerLayer(TransformerLayer):
    """TransformerLayer that passes tree occurrence counts to its MoE router (see module docstring)."""

    def __init__(self, config, submodules: TransformerLayerSubmodules, layer_number: int = 1,
                 hidden_dropout=None, pg_collection=None, vp_stage=None, **kwargs):
        mlp = submodules.mlp
        if (isinstance(mlp, ModuleSpec) and isinstance(mlp.module, type) and issubclass(mlp.module, MoELayer)
                and mlp.module is not MoELayer and pg_collection is not None):
            # megatron passes pg_collection to MoELayer itself only, not to subclasses
            submodules = dataclasses.replace(
                submodules, mlp=dataclasses.replace(mlp, params={**mlp.params, "pg_collection": pg_collection}))
        super().__init__(config, submodules, layer_number=layer_number, hidden_dropout=hidden_dropout,
                         pg_collection=pg_collection, vp_stage=vp_stage, **kwargs)

    def forward(self, *args, **kwargs):
        packed = kwargs.get("packed_seq_params")
        router = getattr(self.mlp, "router", None) if self.is_moe_layer else None
        if router is None or packed is None or getattr(packed, "token_weight", None) is None:
            # expanded mode without padding: megatron's own statistics
            return super().forward(*args, **kwargs)
        w = packed.token_weight
        if not row_mode(packed).tree:
            lb = self.config.moe_router_load_balancing_type
            bad = [t for t in (lb if isinstance(lb, (list, tuple)) else [lb]) if t not in ("aux_loss", "none")]
            if bad:
                raise ValueError(f"--moe-router-load-balancing-type {bad[0]!r}: padded expanded microbatches "
                                 "(--sequence-parallel) support 'aux_loss' or 'none'")
        group = router.tp_cp_group
        n = group.size()
        total = packed.token_weight_sum() / n
        if self.config.sequence_parallel and n > 1:
            rank = group.rank()
            if w.shape[0] % n:
                raise ValueError(f"sequence parallelism: {w.shape[0]} rows are not divisible by {n} ranks")
            m = w.shape[0] // n
            w = w[rank * m:(rank + 1) * m]
        with router.token_weights(w, total):
            return super().forward(*args, **kwargs)


def _mlp_submodules() -> MLPSubmodules:
    return MLPSubmodules(linear_fc1=tensor_parallel.ColumnParallelLinear,
                         linear_fc2=tensor_parallel.RowParallelLinear)


def moe_spec() -> ModuleSpec:
    """HybridMoELayer with GroupedSequentialMLP experts, a shared expert and the HybridRouter."""
    return ModuleSpec(module=HybridMoELayer, submodules=MoESubmodules(
        experts=ModuleSpec(module=GroupedSequentialMLP, submodules=_mlp_submodules()),
        shared_experts=ModuleSpec(module=SharedExpertMLP, submodules=_mlp_submodules()),
        router=HybridRouter))


def dense_mlp_spec() -> ModuleSpec:
    return ModuleSpec(module=MLP, submodules=_mlp_submodules())


def attention_spec(kind: str) -> ModuleSpec:
    if kind == "kda":
        return ModuleSpec(module=KimiDeltaAttention, submodules=KDASubmodules())
    if kind == "mla":
        return ModuleSpec(module=TreeMLA, submodules=MLASubmodules())
    raise ValueError(f"unknown attention kind {kind!r}: expected 'kda' or 'mla'")


def layer_spec(attention: str, mlp: str) -> ModuleSpec:
    """One hybrid layer: RMSNorm -> attention (KDA or MLA) -> RMSNorm -> dense MLP or MoE."""
    return ModuleSpec(module=HybridTransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=RMSNorm,
        self_attention=attention_spec(attention),
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=RMSNorm,
        mlp=moe_spec() if mlp == "moe" else dense_mlp_spec(),
        mlp_bda=get_bias_dropout_add))


def hybrid_block_spec(config) -> TransformerBlockSubmodules:
    """Per-layer specs from ``config.resolved_layer_types()`` / ``resolved_mlp_types()``, final RMSNorm."""
    attn: List[str] = config.resolved_layer_types()
    mlps: List[str] = config.resolved_mlp_types()
    return TransformerBlockSubmodules(layer_specs=[layer_spec(a, m) for a, m in zip(attn, mlps)],
                                      layer_norm=RMSNorm)
