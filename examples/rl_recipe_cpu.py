#!/usr/bin/env python3
"""A GRPO recipe on the CPU: reference KL, recomputed old log-probs, rollout correction, 4 mini-batches.

A tiny hybrid KDA/MLA MoE policy trains on 8 groups of 4 completions that share their prompt (one
tree per group).  The reward of a completion is the fraction of its tokens that are even ids, the
advantages are group-normalised (GRPO), and the "inference engine's" log-probs (``rollout_logprobs``)
are the policy's own plus a little noise, as a rollout engine's differ from the trainer's.  Every
iteration is one ``Trainer.step``: a forward-only pass recomputes the old log-probs, the frozen
reference (the initial weights, exported as a transformers directory and read back by
``--ref-load``) gives the KL target, truncated importance sampling corrects for the engine gap, and
four mini-batches of two whole groups each make four optimizer steps.  It prints the loss curve and
the mean log-prob of the completions with a positive advantage, which rises as the policy learns.
Files go under ``--out`` (default out/rl_recipe).
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = ("--num-layers 4 --hidden-size 32 --num-attention-heads 2 --ffn-hidden-size 48 --swiglu "
         "--disable-bias-linear --multi-latent-attention --kv-lora-rank 16 --qk-head-dim 8 "
         "--qk-pos-emb-head-dim 4 --v-head-dim 8 --linear-attention-freq 2 --linear-key-head-dim 8 "
         "--linear-value-head-dim 8 --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 16 "
         "--moe-shared-expert-intermediate-size 16 "
         "--moe-layer-freq ([0]+[1]*3) --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
         "--moe-aux-loss-coeff 0 "
         "--vocab-size 64 --make-vocab-size-divisible-by 1 --norm-epsilon 1e-6 "
         "--distributed-backend gloo --tree-chunk-size 8 --seq-length 64 --tree-microbatch-tokens 64 "
         "--global-batch-size 32 --train-iters 1000 --lr 3e-3 --seed 5 --log-interval 1000").split()

RECIPE = ["--rl-objective", "ppo", "--clip-ratio-low", "0.2", "--clip-ratio-high", "0.28",
          "--loss-agg-mode", "seq-mean-token-mean", "--rl-old-logprobs", "recompute",
          "--kl-coef", "0.02", "--kl-to", "ref", "--kl-estimator", "k3",
          "--rl-tis-cap", "2.0", "--rl-tis-level", "token", "--rl-mini-batches", "4", "--rl-epochs", "1"]


def rollouts(seed: int = 0):
    """8 groups x 4 completions sharing a prompt; rewards, GRPO advantages."""
    rng = np.random.default_rng(seed)
    recs = []
    for g in range(8):
        prompt = rng.integers(0, 64, 10).tolist()
        comps = [rng.integers(0, 64, int(rng.integers(6, 12))).tolist() for _ in range(4)]
        rewards = np.array([np.mean([t % 2 == 0 for t in c]) for c in comps])
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for k, (c, a) in enumerate(zip(comps, adv)):
            recs.append({"id": f"g{g}/c{k}", "group": f"g{g}", "tokens": prompt + c,
                         "loss_mask": [0] * len(prompt) + [1] * len(c), "advantage": float(a)})
    return recs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=6, help="RL iterations (default 6)")
    ap.add_argument("--out", default="out/rl_recipe", help="directory for the reference weights")
    args = ap.parse_args(argv)
    from megatron_harts.training.trainer import Trainer
    os.makedirs(args.out, exist_ok=True)
    ref_dir = os.path.join(args.out, "reference-hf")
    with Trainer.from_args(MODEL) as t:                 # the initial weights, the frozen reference
        t.export_hf(ref_dir)
    recs = rollouts()
    positive = [i for i, r in enumerate(recs) if r["advantage"] > 0]
    rng = np.random.default_rng(1)
    print("iteration  loss        pg_loss      kl          rollout_kl  steps  mean logp (advantage > 0)")
    with Trainer.from_args(MODEL + RECIPE + ["--ref-load", ref_dir]) as t:
        for it in range(1, args.iterations + 1):
            lps = t.logprobs(recs)                       # the engine's log-probs: the policy's, perturbed
            for r, lp in zip(recs, lps):
                noisy = lp + rng.normal(0.0, 0.05, lp.shape)
                r["rollout_logprobs"] = [None] + noisy[1:].tolist()
            mean_pos = float(np.mean([np.mean(lps[i][np.array(recs[i]["loss_mask"]) == 1]) for i in positive]))
            m = t.step(recs)
            print(f"{it:9d}  {m['loss']:+.6f}  {m['objective/pg_loss']:+.6f}  {m['objective/kl']:.3e}  "
                  f"{m['rollout/kl']:.3e}  {m['optimizer_steps']:5d}  {mean_pos:+.5f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
