"""benchmarks/peer_hf.py on the CPU: the peer (transformers' Kimi-Linear, trajectory by trajectory)
optimizes our objective on the same batch.

Its first loss, at the initial weights, is the token-mean SFT loss computed from the model's logits
on every row (fp64; per trajectory the mean over its targets, weighted by its share of the batch's
targets): the rows it keeps (``logits_to_keep``) are the ones that predict the targets.  A second step moves the loss (the optimizer ran).  No wall time is asserted.
"""
import numpy as np
import pytest
import torch

from tool_runner import load_tool

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bench():
    return load_tool("bench_throughput", "benchmarks"), load_tool("peer_hf", "benchmarks")


def test_peer_first_loss_is_the_token_mean_of_transformers_own_loss(bench):
    bt, peer = bench
    p = bt.PRESETS["tiny"]
    forest = bt.synthesize("step-wise", 1, 192, p["vocab"], seed=0, samples_per_task=2)
    cfg = bt.driver_model_config(p, forest, 1024)
    res = peer.run_peer(cfg, p["vocab"], forest, iters=1, warmup=1, device="cpu", dtype=torch.float64)
    assert res["implementation"]["experts"] == "eager" and res["trajectories"] == forest.num_trajectories
    model, _ = peer.build_peer(cfg, p["vocab"], "cpu", torch.float64, recompute=False)   # same seed: same weights
    n_all, parts = 0, []
    for tid in forest.traj_ids:
        t = forest.expand(tid)
        mask = np.asarray(t.loss_mask, dtype=bool)
        mask[0] = False
        tokens = torch.as_tensor(np.asarray(t.tokens, dtype=np.int64))
        logits = model(input_ids=tokens[None], use_cache=False).logits[0]     # every row, fp64
        logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, tokens[1:, None])[:, 0]
        j = torch.as_tensor(mask[1:])
        parts.append((float(-logp[j].mean().detach()), int(j.sum())))
        n_all += int(j.sum())
    total = sum(loss * n for loss, n in parts) / n_all
    assert res["loss_per_step"][0] == pytest.approx(total, rel=1e-10)
    assert res["loss_per_step"][1] != res["loss_per_step"][0]
    assert res["trajectory_tokens_per_s"] > 0 and res["rows_computed"] == int(forest.traj_length.sum())
