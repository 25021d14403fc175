"""Tiny hybrid models and rollout forests shared by tests/test_models_*.py (test helpers only)."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from megatron_harts.layout import build_layout
from megatron_harts.models.config import HybridConfig
from megatron_harts.models.packed import TreePackedSeqParams
from megatron_harts.tree_data import build_forest, make_trajectory

VOCAB = 32


def tiny_config(dtype=torch.float64, **overrides) -> HybridConfig:
    """4 layers KDA, MLA, KDA, MLA; dense first layer then MoE (8 experts, top-2, shared expert)."""
    kw = dict(num_layers=4, hidden_size=32, num_attention_heads=2, ffn_hidden_size=48,
              normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
              hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype, layernorm_epsilon=1e-5,
              linear_num_heads=2, linear_head_dim=8, kda_chunk_size=4, kv_lora_rank=16, qk_nope_head_dim=8,
              qk_rope_head_dim=4, v_head_dim=8, kda_mla_ratio=1, first_k_dense_replace=1,
              num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
              moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
              moe_router_topk_scaling_factor=2.5, moe_router_num_groups=4, moe_router_group_topk=2,
              moe_aux_loss_coeff=0.01, moe_router_dtype="fp64" if dtype == torch.float64 else "fp32",
              moe_token_dispatcher_type="allgather", use_cpu_initialization=True,
              tree_attention_backend="reference")
    kw.update(overrides)
    return HybridConfig(**kw)


def randomize_(model, seed=0):
    """Random weights everywhere (norm weights near 1, expert bias small), deterministic in ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            r = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if "norm" in name and "weight" in name:
                p.copy_(1.0 + 0.1 * r)
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape, dtype=torch.float64).uniform_(0.0, 1.0, generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(-2.0 + 0.5 * r)
            else:
                p.copy_(0.2 * r)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen, dtype=torch.float64))
    return model


def tiny_forest(seed=0, n=5, vocab=VOCAB):
    """Trajectories sharing prefixes, forks at and off chunk boundaries, a prefix trajectory, two trees."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, vocab, 14).tolist()
    other = rng.integers(0, vocab, 6).tolist()
    toks = [base[:14] + rng.integers(0, vocab, 3).tolist(),
            base[:9] + rng.integers(0, vocab, 5).tolist(),
            base[:9] + rng.integers(0, vocab, 2).tolist(),
            base[:6],
            other + rng.integers(0, vocab, 4).tolist(),
            other[:3] + rng.integers(0, vocab, 3).tolist()][:n + 1]
    trajs = [make_trajectory({"id": i, "tokens": t}) for i, t in enumerate(toks)]
    return build_forest(trajs)


def random_forest(seed=0, n=7, vocab=VOCAB):
    """Random cuts of a shared base plus random tails: forks anywhere (inside, at and after chunk
    boundaries), trajectories that end inside others, and a second tree."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, vocab, 24).tolist()
    toks = []
    for i in range(n):
        cut = int(rng.integers(0, 25))
        tail = rng.integers(0, vocab, int(rng.integers(0 if cut else 1, 8))).tolist()
        toks.append(base[:cut] + tail)
    toks.append(rng.integers(0, vocab, 9).tolist())
    return build_forest([make_trajectory({"id": i, "tokens": t}) for i, t in enumerate(toks) if t])


def tree_inputs(forest, cfg, replay=True):
    lay = build_layout(forest)
    psp = TreePackedSeqParams.for_tree(lay, config=cfg, replay=replay)
    return lay, psp


def expanded_inputs(lay, forest):
    """Packed expanded batch: every trajectory of the layout on its own; rows of the layout's targets."""
    toks = [forest.expand(tid).tokens for tid in lay.traj_ids]
    lengths = [len(t) for t in toks]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids = torch.as_tensor(np.concatenate(toks))[None]
    psp = TreePackedSeqParams.for_sequences(lengths)
    # target i (trajectory t, position p) is predicted by expanded row offsets[t] + p - 1
    rows = torch.as_tensor(offsets[lay.target_traj.numpy()] + lay.target_position.numpy() - 1)
    return ids, psp.position_ids[None], psp, rows, lay.target_token, lengths
