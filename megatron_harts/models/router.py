"""Kimi-Linear's router as a megatron-core ``TopKRouter`` subclass, occurrence-weighted in tree mode.

Routing (transformers ``KimiLinearTopkRouter``, DeepSeek-V3 style), with
``score_function="sigmoid"``:

    s = sigmoid(x W^T);  c = s + expert_bias (selection only)
    groups (moe_router_num_groups, moe_router_group_topk): a group's score is the
        sum of its top ``moe_router_group_score_topk`` (2) values of c; experts
        outside the best ``group_topk`` groups are excluded
    experts = top-k of c;  weights = s[experts], normalized to sum 1 when
        ``moe_router_norm_topk_prob`` (norm_topk_prob), times
        ``moe_router_topk_scaling_factor`` (routed_scaling_factor)

(megatron's own group-limited top-k scores a group by its top ``k / group_topk``
experts, which differs from Kimi-Linear unless that equals 2.)  The softmax
score function keeps megatron's routing unchanged.  The sigmoid routing is
``ops.router_topk``: one fused Triton kernel each way where the model's fused
kernels run (``models.common.use_fused_kernels``), its plain torch reference elsewhere.

Tree mode: a compact row stands for ``q(r)`` expanded tokens (its occurrence
count).  Routing is a deterministic per-row function, so each copy routes the
same way, and every statistic megatron computes over expanded tokens is the
q-weighted statistic over rows (``megatron_harts.ops.moe``): the load-balancing
aux loss (value and gradient), the z-loss, the expert-bias token counts
(``local_tokens_per_expert``) and ``last_tokens_per_expert``.  The weights
reach the router through :meth:`HybridRouter.token_weights`, which the hybrid
transformer layer enters with the layout's occurrence counts for the duration
of its forward (no globals).  Without weights (expanded mode) every statistic
is megatron's own.

Settings the tree path cannot honour (token dropping, sinkhorn, jitter, ...)
are refused when the model is built (``ops.moe.validate_tree_moe_config``).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from megatron.core.transformer.moe.moe_utils import (compute_routing_scores_for_aux_loss,
                                                      topk_routing_with_score_function)
from megatron.core.transformer.moe.router import TopKRouter

from ..ops.moe import q_aux_loss, q_tokens_per_expert, q_z_loss
from ..ops.router_topk import sigmoid_topk, sigmoid_topk_reference
from .common import use_fused_kernels

TREE_LOAD_BALANCING_TYPES = ("aux_loss", "none")


class HybridRouter(TopKRouter):
    """TopKRouter with Kimi-Linear's sigmoid group routing and occurrence-weighted statistics."""

    def __init__(self, config, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        self._token_weight: Optional[torch.Tensor] = None
        self._token_weight_total: Optional[float] = None
        self.last_tokens_per_expert: Optional[torch.Tensor] = None

    @contextlib.contextmanager
    def token_weights(self, weight: Optional[torch.Tensor], total: Optional[float] = None):
        """Occurrence counts of the rows this rank routes during the block (None: expanded mode).

        ``total``: the expanded token count of the whole microbatch on the tp_cp group
        divided by its size (megatron's local token count); defaults to ``weight.sum()``.
        """
        saved = (self._token_weight, self._token_weight_total)
        self._token_weight, self._token_weight_total = weight, total
        try:
            yield
        finally:
            self._token_weight, self._token_weight_total = saved

    def token_weight_state(self):
        """The (weights, total) pair in force now, for re-entering it later (recomputation)."""
        return self._token_weight, self._token_weight_total

    def _topk(self, logits):
        cfg = self.config
        if self.score_function != "sigmoid":
            return topk_routing_with_score_function(
                logits, self.topk, use_pre_softmax=cfg.moe_router_pre_softmax,
                num_groups=cfg.moe_router_num_groups, group_topk=cfg.moe_router_group_topk,
                scaling_factor=cfg.moe_router_topk_scaling_factor, score_function=self.score_function,
                expert_bias=self.expert_bias, fused=False)
        route = sigmoid_topk if use_fused_kernels(cfg, logits) else sigmoid_topk_reference
        return route(logits, self.topk, num_groups=cfg.moe_router_num_groups, group_topk=cfg.moe_router_group_topk,
                     group_score_topk=getattr(cfg, "moe_router_group_score_topk", 2),
                     scaling_factor=cfg.moe_router_topk_scaling_factor, expert_bias=self.expert_bias,
                     normalize=getattr(cfg, "moe_router_norm_topk_prob", self.topk > 1))

    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        w = self._token_weight
        if w is None:
            return self._routing_expanded(logits, padding_mask)
        if padding_mask is not None:
            raise ValueError("HybridRouter: tree mode takes occurrence counts, not a padding mask")
        cfg = self.config
        logits = logits.view(-1, cfg.num_moe_experts)
        if w.shape[0] != logits.shape[0]:
            raise ValueError(f"HybridRouter: {w.shape[0]} occurrence counts for {logits.shape[0]} routed rows")
        w = w.to(logits.device)
        local = self._token_weight_total
        # rows that count for nothing (an idle slot's placeholder): no loss term to normalize
        counts_any = local is None or local > 0
        if cfg.moe_z_loss_coeff is not None and self.training and torch.is_grad_enabled() and counts_any:
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, save_to_aux_losses_tracker
            coeff = cfg.moe_z_loss_coeff / self.tp_cp_group.size()
            z = q_z_loss(logits, w, coeff, local_num_tokens=local)
            # as megatron's apply_z_loss: under per-token loss scaling the autoscaler's scale is
            # 1/tokens, so the microbatch's mean z-loss enters times its (q-weighted) token count
            z_scaled = z * (local if local is not None else w.sum()) if self.calculate_per_token_loss else z
            logits = MoEAuxLossAutoScaler.apply(logits, z_scaled)
            save_to_aux_losses_tracker("z_loss", z / coeff, self.layer_number,
                                       cfg.num_layers + (cfg.mtp_num_layers or 0))
        probs, rmap = self._topk(logits)
        if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled() and counts_any:
            coeff = self.get_aux_loss_coeff("aux_loss")
            rmap_aux, scores_aux = compute_routing_scores_for_aux_loss(logits, self.topk, self.score_function,
                                                                       fused=False)
            aux = q_aux_loss(scores_aux, rmap_aux, w, topk=self.topk, coeff=coeff, group=self.tp_cp_group,
                             local_num_tokens=local)
            probs = self.attach_and_log_load_balancing_loss(
                probs, coeff, aux, "load_balancing_loss", self.tp_cp_group,
                valid_token_count=local if local is not None else w.sum())
        # megatron counts for the expert-bias update only in grad mode (not in eval or recompute passes)
        count_for_bias = self.enable_expert_bias and torch.is_grad_enabled()
        with torch.no_grad():
            counts = q_tokens_per_expert(rmap, w, cfg.num_moe_experts)
            self.last_tokens_per_expert = counts.detach()
            if count_for_bias:
                self.local_tokens_per_expert += counts.to(self.local_tokens_per_expert.dtype)
        return probs, rmap

    def _routing_expanded(self, logits, padding_mask):
        """megatron's TopKRouter.routing with the Kimi top-k (aux losses, z-loss, expert bias unchanged)."""
        cfg = self.config
        seq_length, bsz = logits.shape[:2]
        logits = logits.view(-1, cfg.num_moe_experts)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        logits = self.apply_z_loss(logits, padding_mask=padding_mask)
        probs, rmap = self._topk(logits)
        if cfg.moe_expert_capacity_factor is not None:
            from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping
            probs, rmap = apply_router_token_dropping(
                probs, rmap, router_topk=self.topk, capacity_factor=cfg.moe_expert_capacity_factor,
                drop_policy=cfg.moe_token_drop_policy, pad_to_capacity=cfg.moe_pad_expert_input_to_capacity)
        if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
            rmap_aux, scores_aux = compute_routing_scores_for_aux_loss(
                logits, self.topk, self.score_function, fused=False, padding_mask=padding_mask)
            wp = padding_mask is not None
            probs = self._apply_aux_loss(probs, scores_aux, rmap_aux, with_padding_mask=wp)
            probs = self._apply_seq_aux_loss(probs, scores_aux, rmap_aux, seq_length, bsz, with_padding_mask=wp)
            probs = self._apply_global_aux_loss(probs, scores_aux, rmap_aux, with_padding_mask=wp)
        with torch.no_grad():
            valid = rmap if padding_mask is None else rmap & (~padding_mask)[:, None]
            self.last_tokens_per_expert = valid.sum(0).to(torch.float64)
        self._apply_expert_bias(rmap, padding_mask=padding_mask)
        return probs, rmap

    def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """Adds the non-padding tokens each expert received to ``local_tokens_per_expert`` (the
        expert-bias update's counts), only with expert bias on and in grad mode (not in eval or
        recompute passes): megatron's ``TopKRouter._apply_expert_bias`` as plain eager code.

        megatron-core 0.16.1 decorates its own with ``megatron.core.jit.jit_fuser``, which is
        ``torch.compile``: every expanded-mode router call then went through dynamo, which fails on
        CPU tensors on a machine with CUDA and fla (torch 2.11), i.e. ``--device cpu`` there.
        ``padding_mask``: ``[tokens]``, True at padding (as :meth:`_routing_expanded` passes it).
        """
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & (~padding_mask.reshape(-1))[:, None]
                self.local_tokens_per_expert += routing_map.sum(dim=0)
