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
back itself).  Invariant: the permuted tokens, probabilities, token counts and the mapping that
``combine_preprocess`` un-permutes with are exactly the parent's, so every output and gradient is
bitwise the parent's.  Other configurations run the parent's method.  After the combine the
dispatcher keeps nothing of the microbatch (:meth:`SyncFreeAllGatherDispatcher.combine_postprocess`).
"""
from __future__ import annotations

import torch

from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

__all__ = ["SyncFreeAllGatherDispatcher"]


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
        permuted = hidden_states.index_select(0, sorted_tokens)
        self.reversed_local_input_permutation_mapping = sorted_tokens
        self.local_probs = probs.T.contiguous().view(-1).index_select(0, position)
        self.routing_map = None
        return permuted, tokens_per_expert, self.local_probs

    def combine_postprocess(self, hidden_states):
        """The parent's, then the microbatch's routing state let go.

        Invariant: after a microbatch's MoE layer no dispatcher attribute reaches its autograd graph.
        The permuted probabilities would (and through its AccumulateGrad nodes the leaves it read:
        a sharing window's export views, kept alive into the producer's recomputation).
        """
        out = super().combine_postprocess(hidden_states)
        self.local_probs = self.local_map = self.reversed_local_input_permutation_mapping = None
        return out

