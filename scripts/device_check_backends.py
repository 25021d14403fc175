#!/usr/bin/env python3
"""Which GPU fast path moves tree mode away from expanded mode?  Tree vs expanded on the same
weights (``testing.fidelity.run_tree`` / ``run_expanded``) for every combination of KDA backend
(reference, fla), MoE experts (grouped GEMM on / off) and tree attention (sdpa, flex, varlen), in one
dtype; prints the logit cosine and the largest per-target log-prob difference of each.
Usage: python3 scripts/device_check_backends.py [--dtype bf16|fp32] [--device cuda|cpu]
"""
import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kda", nargs="+", default=["reference", "fla"])
    ap.add_argument("--attention", nargs="+", default=["sdpa", "flex", "varlen"])
    a = ap.parse_args()
    from megatron_harts import patches
    from megatron_harts.layout import build_layout
    from megatron_harts.testing.cpu_runtime import single_process_megatron
    from megatron_harts.models.experts import GroupedSequentialMLP
    from megatron_harts.testing.fidelity import (logit_cosine, preset_config, randomize_parameters, run_expanded,
                                                run_tree)
    from megatron_harts.models.model import build_hybrid_model
    from megatron_harts.tree_data import build_forest
    from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    with single_process_megatron(a.device, seed=0):
        patches.apply()
        cfg, vocab = preset_config("small", dtype, a.device)
        cfg.kda_chunk_size, cfg.linear_head_dim = 64, 64
        model = build_hybrid_model(cfg, vocab).to(a.device)
        randomize_parameters(model, seed=0)
        forest = build_forest(synthesize_swe(SweConfig(num_tasks=1, samples_per_task=2, prompt_median=300, max_leaves=4,
                                                       action_median=40, observation_median=80, max_tokens=1500,
                                                       vocab_size=vocab, seed=0)))
        lay = build_layout(forest)
        experts = [m for m in model.modules() if isinstance(m, GroupedSequentialMLP)]
        print(f"{a.dtype} {a.device}: {forest.num_trajectories} trajectories, {lay.num_rows} rows", flush=True)
        for kda, grouped, attn in itertools.product(a.kda, (False, True), a.attention):
            cfg.kda_backend, cfg.tree_attention_backend = kda, attn
            for e in experts:
                e.use_grouped_mm = grouped
            try:
                t = run_tree(model, lay, cfg, device=a.device)
                x = run_expanded(model, forest, lay, cfg, device=a.device)
                d = (t.logprobs.double() - x.logprobs.double()).abs().max().item()
                print(f"kda={kda:9s} grouped={grouped!s:5s} attention={attn:5s} | logit cosine "
                      f"{logit_cosine(t.logits, x.logits):.6f} | max |dlogprob| {d:.3e}", flush=True)
            except Exception as err:     # report and go on: the point is the table
                print(f"kda={kda:9s} grouped={grouped!s:5s} attention={attn:5s} | failed: "
                      f"{type(err).__name__}: {str(err).splitlines()[0][:200]}", flush=True)


if __name__ == "__main__":
    main()
