"""Multi-target log-probs (megatron_harts/ops/logprobs.py) against full-vocab references,
expanded per-trajectory computation, megatron-core's vocab_parallel_cross_entropy (TP=1)
and a real two-process vocab-parallel run (gloo).  docs/design.md invariant 1."""
import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_harts.ops.logprobs import multi_target_logprobs, multi_target_logprobs_reference
from megatron_harts.tree_data import build_forest, make_trajectory
from multiproc import run_ranks

TOL = 1e-10


def random_trajectories(seed, n_traj=7, alphabet=(0, 1, 2)):
    """Random rollout set: forks, trajectories that end inside others, duplicates,
    single-token segments (tiny alphabet, continuations of 0-3 tokens)."""
    rng = np.random.default_rng(seed)
    vocab = len(alphabet)
    seqs = [list(rng.integers(0, vocab, size=int(rng.integers(1, 6))))]
    while len(seqs) < n_traj:
        base = seqs[int(rng.integers(len(seqs)))]
        cut = int(rng.integers(0, len(base) + 1))
        seqs.append(base[:cut] + list(rng.integers(0, vocab, size=int(rng.integers(0, 4)))))
        if not seqs[-1]:
            seqs[-1] = [int(rng.integers(vocab))]
    trajs = []
    for i, s in enumerate(seqs):
        mask = (rng.random(len(s)) < 0.75).astype(int)
        mask[0] = 0
        trajs.append(make_trajectory({"id": i, "tokens": [int(alphabet[x]) for x in s], "loss_mask": mask.tolist()}))
    return trajs


def forest_targets(forest):
    """Targets of every trajectory: (trajectory, position j, row of j-1, token j)."""
    out = []
    for t in range(forest.num_trajectories):
        rows = forest.trajectory_rows(t)
        traj = forest.expand(forest.traj_ids[t])
        for j in range(1, len(rows)):
            if traj.loss_mask[j]:
                out.append((t, j, int(rows[j - 1]), int(traj.tokens[j])))
    return out


def unique_pairs(targets):
    keys = np.array([(r, tok) for _, _, r, tok in targets], dtype=np.int64).reshape(-1, 2)
    pairs, target_pair = np.unique(keys, axis=0, return_inverse=True)
    return (torch.from_numpy(pairs[:, 0].copy()), torch.from_numpy(pairs[:, 1].copy()),
            torch.from_numpy(target_pair.reshape(-1)))


def rel_err(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))


def make_problem(seed, hidden_size=6, vocab=13, dtype=torch.float64, min_targets=1):
    for s in range(seed, seed + 100):
        # an alphabet spread over both halves of the vocabulary (vocab-parallel shards)
        forest = build_forest(random_trajectories(s, alphabet=(1, vocab // 2, vocab - 1)))
        targets = forest_targets(forest)
        if len(targets) >= min_targets:
            break
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(forest.num_rows, hidden_size, dtype=dtype, generator=g)
    weight = torch.randn(vocab, hidden_size, dtype=dtype, generator=g) * 0.7
    return forest, targets, hidden, weight


@pytest.mark.parametrize("seed", range(6))
def test_equals_expanded_per_trajectory_forward_and_backward(seed):
    forest, targets, hidden0, weight0 = make_problem(seed)
    pair_row, pair_token, target_pair = unique_pairs(targets)
    g = torch.Generator().manual_seed(100 + seed)
    w_lp = torch.randn(len(targets), dtype=torch.float64, generator=g)
    w_ent = torch.randn(len(targets), dtype=torch.float64, generator=g)
    target_row = torch.tensor([r for _, _, r, _ in targets])

    # tree mode: logits once per row, every target reads its pair
    hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
    lp, ent = multi_target_logprobs(hidden, weight, pair_row, pair_token, return_entropy=True, chunk_rows=2)
    tree_lp, tree_ent = lp[target_pair], ent[target_row]
    (tree_lp @ w_lp + tree_ent @ w_ent).backward()

    # expanded mode: each trajectory's rows in its own order, full log_softmax
    he, we = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
    exp_lp, exp_ent = [], []
    cache = {}
    for t, j, _, tok in targets:
        if t not in cache:
            logp = torch.log_softmax(he[torch.from_numpy(forest.trajectory_rows(t))] @ we.t(), dim=-1)
            cache[t] = logp
        logp = cache[t]
        exp_lp.append(logp[j - 1, tok])
        exp_ent.append(-(logp[j - 1].exp() * logp[j - 1]).sum())
    exp_lp, exp_ent = torch.stack(exp_lp), torch.stack(exp_ent)
    (exp_lp @ w_lp + exp_ent @ w_ent).backward()

    assert rel_err(tree_lp, exp_lp) < TOL
    assert rel_err(tree_ent, exp_ent) < TOL
    assert rel_err(hidden.grad, he.grad) < TOL
    assert rel_err(weight.grad, we.grad) < TOL


@pytest.mark.parametrize("chunk_rows", [1, 3, None])
def test_equals_reference_for_any_chunking(chunk_rows):
    forest, targets, hidden0, weight0 = make_problem(11, vocab=29)
    pair_row, pair_token, _ = unique_pairs(targets)
    # add duplicate pairs out of order: they must read the same value, gradients add up
    pair_row = torch.cat([pair_row.flip(0), pair_row[:2]])
    pair_token = torch.cat([pair_token.flip(0), pair_token[:2]])
    g = torch.Generator().manual_seed(5)
    w = torch.randn(pair_row.shape[0], dtype=torch.float64, generator=g)
    u = torch.randn(forest.num_rows, dtype=torch.float64, generator=g)
    results = []
    for fn, kw in ((multi_target_logprobs, {"chunk_rows": chunk_rows}), (multi_target_logprobs_reference, {})):
        hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        lp, ent = fn(hidden, weight, pair_row, pair_token, return_entropy=True, **kw)
        (lp @ w + ent @ u).backward()
        results.append((lp, ent, hidden.grad, weight.grad))
    for a, b in zip(*results):
        assert rel_err(a, b) < TOL
    # rows without any pair: entropy 0 and no gradient
    lonely = torch.ones(forest.num_rows, dtype=torch.bool)
    lonely[pair_row] = False
    assert torch.all(results[0][1][lonely] == 0)
    assert torch.all(results[0][2][lonely] == 0)


def test_only_entropy_gradient_and_no_pairs():
    forest, targets, hidden0, weight0 = make_problem(3)
    pair_row, pair_token, _ = unique_pairs(targets)
    hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
    _, ent = multi_target_logprobs(hidden, weight, pair_row, pair_token, return_entropy=True, chunk_rows=2)
    ent.sum().backward()
    h2, w2 = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
    _, ent_ref = multi_target_logprobs_reference(h2, w2, pair_row, pair_token, return_entropy=True)
    ent_ref.sum().backward()
    assert rel_err(hidden.grad, h2.grad) < TOL and rel_err(weight.grad, w2.grad) < TOL

    hidden = hidden0.clone().requires_grad_()
    empty = torch.zeros(0, dtype=torch.int64)
    lp = multi_target_logprobs(hidden, weight0, empty, empty)
    assert lp.shape == (0,)
    (lp.sum() + 0 * hidden.sum()).backward()
    assert torch.all(hidden.grad == 0)


def test_bad_input_names_the_argument():
    h = torch.randn(4, 3, dtype=torch.float64)
    w = torch.randn(5, 3, dtype=torch.float64)
    ok_r, ok_t = torch.tensor([0, 3]), torch.tensor([1, 4])
    cases = [
        ((h, w, torch.tensor([0, 4]), ok_t), {}, "pair_row"),
        ((h, w, ok_r, torch.tensor([1, 5])), {}, "pair_token"),
        ((h, w, ok_r, torch.tensor([1, 2, 3])), {}, "pair_token"),
        ((h, w, ok_r.double(), ok_t), {}, "pair_row"),
        ((h[0], w, ok_r, ok_t), {}, "hidden"),
        ((h, torch.randn(5, 2, dtype=torch.float64), ok_r, ok_t), {}, "weight"),
        ((h, w.float(), ok_r, ok_t), {}, "dtype"),
        ((h, w, ok_r, ok_t), {"chunk_rows": 0}, "chunk_rows"),
    ]
    for args, kw, word in cases:
        with pytest.raises(ValueError, match=word):
            multi_target_logprobs(*args, **kw)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def megatron_world_of_one():
    """gloo world of size 1 with megatron's parallel state (TP=1, PP=1); undone afterwards."""
    from megatron.core import parallel_state
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        yield parallel_state
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_equals_megatron_vocab_parallel_cross_entropy_tp1(megatron_world_of_one):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    forest, targets, hidden0, weight0 = make_problem(7, dtype=torch.float32, vocab=17)
    pair_row, pair_token, target_pair = unique_pairs(targets)
    w = torch.randn(len(targets), generator=torch.Generator().manual_seed(1))

    hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
    lp = multi_target_logprobs(hidden, weight, pair_row, pair_token, tp_group=dist.group.WORLD)
    (lp[target_pair] @ w).backward()

    # megatron on the expanded microbatch: every trajectory's rows, [seq, batch=1, vocab]
    he, we = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
    src_rows = torch.tensor([r for _, _, r, _ in targets])
    tgt = torch.tensor([tok for _, _, _, tok in targets])
    logits = (he[src_rows] @ we.t()).unsqueeze(1)
    neg_lp = vocab_parallel_cross_entropy(logits.clone(), tgt.unsqueeze(1)).squeeze(1)
    (-neg_lp @ w).backward()

    assert lp.dtype == torch.float32
    assert rel_err(lp[target_pair], -neg_lp) < 1e-5
    assert rel_err(hidden.grad, he.grad) < 1e-5
    assert rel_err(weight.grad, we.grad) < 1e-5


def _tp_worker(rank, world, init_file, inputs_path, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        d = torch.load(inputs_path)
        v_local = d["weight"].shape[0] // world
        shard = d["weight"][rank * v_local:(rank + 1) * v_local]
        hidden, weight = d["hidden"].clone().requires_grad_(), shard.clone().requires_grad_()
        lp, ent = multi_target_logprobs(hidden, weight, d["pair_row"], d["pair_token"], tp_group=dist.group.WORLD,
                                        return_entropy=True, chunk_rows=3)
        (lp @ d["w"] + ent @ d["u"]).backward()
        out = {"lp": lp.detach(), "ent": ent.detach(), "gh": hidden.grad, "gw": weight.grad}

        # megatron-core's own vocab-parallel cross entropy on the expanded targets (TP=2)
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
        parallel_state.initialize_model_parallel(world, 1)
        try:
            he, we = d["hidden"].clone().requires_grad_(), shard.clone().requires_grad_()
            logits = (he[d["target_row"]] @ we.t()).unsqueeze(1)
            neg_lp = vocab_parallel_cross_entropy(logits.clone(), d["target_token"].unsqueeze(1)).squeeze(1)
            (-neg_lp.double() @ d["w_target"]).backward()
            gh = he.grad.clone()
            dist.all_reduce(gh, group=parallel_state.get_tensor_model_parallel_group())
            out.update(megatron_lp=-neg_lp.detach(), megatron_gh=gh, megatron_gw=we.grad)
            hidden.grad = None
            weight.grad = None
            lp = multi_target_logprobs(hidden, weight, d["pair_row"], d["pair_token"],
                                       tp_group=parallel_state.get_tensor_model_parallel_group())
            (lp[d["target_pair"]] @ d["w_target"]).backward()
            out.update(tree_lp=lp[d["target_pair"]].detach(), tree_gh=hidden.grad, tree_gw=weight.grad)
        finally:
            parallel_state.destroy_model_parallel()
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_two_ranks_equals_full_vocab_and_megatron(tmp_path):
    forest, targets, hidden0, weight0 = make_problem(21, vocab=14)
    pair_row, pair_token, target_pair = unique_pairs(targets)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(pair_row.shape[0], dtype=torch.float64, generator=g)
    u = torch.randn(forest.num_rows, dtype=torch.float64, generator=g)
    # both halves of the vocabulary must hold targets for the test to mean something
    assert (pair_token < 7).any() and (pair_token >= 7).any(), pair_token
    inputs = tmp_path / "inputs.pt"
    torch.save({"hidden": hidden0, "weight": weight0, "pair_row": pair_row, "pair_token": pair_token,
                "w": w, "u": u, "target_pair": target_pair,
                "target_row": torch.tensor([r for _, _, r, _ in targets]),
                "target_token": torch.tensor([tok for _, _, _, tok in targets]),
                "w_target": torch.randn(len(targets), dtype=torch.float64, generator=g)}, inputs)
    run_ranks(_tp_worker, 2, (str(tmp_path / "store"), str(inputs), str(tmp_path)), timeout=90)
    out = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
    lp, ent = multi_target_logprobs_reference(hidden, weight, pair_row, pair_token, return_entropy=True)
    (lp @ w + ent @ u).backward()
    for o in out:
        assert rel_err(o["lp"], lp) < TOL
        assert rel_err(o["ent"], ent) < TOL
        assert rel_err(o["gh"], hidden.grad) < TOL  # all-reduced over the two ranks
    assert rel_err(torch.cat([out[0]["gw"], out[1]["gw"]]), weight.grad) < TOL
    # against megatron's vocab_parallel_cross_entropy with TP=2 (it computes in fp32: .float())
    for o in out:
        assert rel_err(o["tree_lp"], o["megatron_lp"]) < 1e-5
        assert rel_err(o["tree_gh"], o["megatron_gh"]) < 1e-5
        assert rel_err(o["tree_gw"], o["megatron_gw"]) < 1e-5
