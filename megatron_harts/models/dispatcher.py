"""MoE token dispatch without host synchronization (megatron-core's all-gather dispatcher, subclassed).

megatron-core 0.16.1's ``MoEAllGatherTokenDispatcher.dispatch_postprocess`` reads three
data-dependent sizes back to the host on every MoE layer of every microbatch: the tokens per
expert (``.cpu()``), and the output sizes of two ``masked_select`` calls (the permutation of the
tokens and of their probabilities).  Each read stalls the host until the GPU has drained its
queue, so the GPU then idles while the host queues the next kernels.

When every expert is local (expert parallel size 1) and no token is dropped (no capacity
factor), each token is routed to exactly ``topk`` experts, so the number of (expert, token)
pairs is ``tokens * topk``, known on the host.  :class:`SyncFreeAllGatherDispatcher` then builds
the same permutation with fixed sizes: the positions of the routing map's ones in expert-major
order (a stable descending sort of the flattened [experts, tokens] map, of which the first
``tokens * topk`` entries are exactly the ones, in the order ``masked_select`` visits them), the
tokens and probabilities gathered through them, and the tokens per expert left on the device
(the grouped experts, ``models.experts``, read them there; megatron's ``SequentialMLP`` reads them
back itself).

With that fixed fan-out every token owns exactly ``topk`` rows of the permuted tensor, so both
directions are gathers (:class:`_GatherRows`): the dispatch gathers each permuted row's token, its
backward sums each token's ``topk`` row gradients; the combine sums each token's ``topk`` expert
outputs, its backward gathers each row's token gradient.  The parent instead scatter-adds
(``index_add_`` in the dispatch's backward, ``scatter_add_`` in the combine): atomic, in no fixed
order.  Invariant: the permuted tokens, probabilities and token counts are exactly the parent's;
the combined outputs and every gradient are the parent's sums in a fixed order (equal up to
rounding order, and the same from run to run).  Where ``models.common.use_fused_kernels`` says so,
the two gathers that sum (the combine, the dispatch's backward) run as one Triton kernel each
(``ops.moe_gather``): each gathered row read once, no ``tokens x topk`` intermediate.  Other
configurations run the parent's method.
After the combine the dispatcher keeps nothing of the microbatch
(:meth:`SyncFreeAllGatherDispatcher.combine_postprocess`).

The permuted tokens are ``top-k`` copies of the tokens: kept for the experts' backward (fc1's weight
gradient reads its input), they would hold ``top-k x hidden`` elements a token.
``SyncFreeAllGatherDispatcher.permuted_from`` (the permuted tokens, their source and the gather's
index, for the microbatch in flight) lets the grouped experts (which the MoE layer hands this dispatcher) keep the source and index instead
and gather again in their backward (``models.experts``): the same values, bitwise; the source is the MoE
input, which the router keeps anyway.
"""
from __future__ import annotations

import torch

from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

from ..ops.moe_gather import gather_sum, gather_sum_reference
from .common import use_fused_kernels

__all__ = ["SyncFreeAllGatherDispatcher"]


class _GatherRows(torch.autograd.Function):
    """``out = x.index_select(0, rows)`` summed over groups of ``group`` consecutive output rows, with a
    gather for a backward: ``back`` lists, per row of ``x``, the output rows (before the sum) it feeds,
    ``group`` of them each in ascending order, so the gradient of ``x`` is
    ``g.index_select(0, back)`` summed over each group.  Both directions read their rows once and
    write each result once (no atomic scatter).  Dispatch: rows = each permuted row's token, group 1,
    back = each token's ``topk`` permuted rows.  Combine: rows = each token's permuted rows, group
    ``topk``, back = each permuted row's token.  ``fused``: a gather that sums runs as one kernel
    (``ops.moe_gather.gather_sum``) instead of a gather and a sum."""

    @staticmethod
    def forward(ctx, x, rows, back, group: int, back_group: int, fused: bool):
        ctx.save_for_backward(back)
        ctx.back_group, ctx.fused = back_group, fused
        return (gather_sum if fused else gather_sum_reference)(x, rows, group)

    @staticmethod
    def backward(ctx, g):
        (back,) = ctx.saved_tensors
        gx = (gather_sum if ctx.fused else gather_sum_reference)(g.contiguous(), back, ctx.back_group)
        return gx, None, None, None, None, None


class SyncFreeAllGatherDispatcher(MoEAllGatherTokenDispatcher):
    """``MoEAllGatherTokenDispatcher`` whose post-dispatch permutation never reads the device
    (module docstring); falls back to the parent where the routed pair count is not fixed."""

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
        super().__init__(num_local_experts, local_expert_indices, config=config, pg_collection=pg_collection)
        self.fixed_fanout = (self.ep_size == 1 and config.moe_expert_capacity_factor is None
                             and not config.moe_permute_fusion
                             and self.num_local_experts == config.num_moe_experts)

    def dispatch_postprocess(self, hidden_states, probs):
        if not self.fixed_fanout:
            return super().dispatch_postprocess(hidden_states, probs)
        self.hidden_shape_before_permute = hidden_states.shape
        self.local_map = self.routing_map                      # [tokens, experts], every expert local
        num_tokens, num_experts = self.local_map.shape
        pairs = num_tokens * self.router_topk
        expert_major = self.local_map.T.contiguous()           # [experts, tokens]
        if expert_major.device.type == "cpu" and int(expert_major.sum()) != pairs:
            raise ValueError(f"MoE dispatch: the routing map holds {int(expert_major.sum())} (expert, token) pairs, "
                             f"expected tokens x topk = {pairs} (dropless routing)")
        flat = expert_major.view(-1).to(torch.int8)
        position = flat.argsort(descending=True, stable=True)[:pairs]     # e * tokens + t, expert-major
        sorted_tokens = position % num_tokens
        tokens_per_expert = expert_major.sum(dim=1).long()
        # each token's topk permuted rows, ascending: sorted_tokens holds every token exactly topk times
        self.token_rows = sorted_tokens.argsort(stable=True)
        self.fused = use_fused_kernels(self.config, hidden_states)
        permuted = _GatherRows.apply(hidden_states, sorted_tokens, self.token_rows, 1, self.router_topk, self.fused)
        self.permuted_from = (permuted, hidden_states.detach(), sorted_tokens)
        self.reversed_local_input_permutation_mapping = sorted_tokens
        self.local_probs = probs.T.contiguous().view(-1).index_select(0, position)
        self.routing_map = None
        return permuted, tokens_per_expert, self.local_probs

    def combine_preprocess(self, hidden_states):
        """Each token's ``topk`` expert outputs summed (the parent's un-permutation, as a gather)."""
        if not self.fixed_fanout:
            return super().combine_preprocess(hidden_states)
        out = _GatherRows.apply(hidden_states, self.token_rows, self.reversed_local_input_permutation_mapping,
                                self.router_topk, 1, self.fused)
        return out.view(self.hidden_shape_before_permute)

    def combine_postprocess(self, hidden_states):
        """The parent's, then the microbatch's routing state let go.

        Invariant: after a microbatch's MoE layer no dispatcher attribute reaches its autograd graph.
        The permuted probabilities would (and through its AccumulateGrad nodes the leaves it read:
        a sharing window's export views, kept alive into the producer's recomputation).
        """
        out = super().combine_postprocess(hidden_states)
        self.local_probs = self.local_map = self.reversed_local_input_permutation_mapping = self.token_rows = None
        self.permuted_from = None
        return out

