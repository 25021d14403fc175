"""The chunked multi-target log-prob path (megatron_harts/ops/logprobs.py) at any chunk size:
values and gradients equal the plain reference and unchunked ``log_softmax`` in fp64 (chunk sizes
that divide the rows and ones that do not), its largest tensor is a chunk's logits, never the
[rows, vocab] logits, and ``--tree-logprob-chunk-rows`` reaches it from the driver in tree and
expanded mode alike."""
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_harts.ops import logprobs as LP
from megatron_harts.ops.logprobs import default_chunk_rows, multi_target_logprobs, multi_target_logprobs_reference

TOL = 1e-12


def problem(rows=23, vocab=31, hidden=5, seed=0):
    """Random fp64 rows and output weight; pairs: 0-3 tokens per row (some rows carry none), out of
    order, duplicates included."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, dtype=torch.float64, generator=g)
    w = torch.randn(vocab, hidden, dtype=torch.float64, generator=g) * 0.8
    rng = np.random.default_rng(seed)
    pr, pt = [], []
    for r in range(rows):
        for _ in range(int(rng.integers(0, 4))):
            pr.append(r)
            pt.append(int(rng.integers(0, vocab)))
    pr += pr[:3]
    pt += pt[:3]
    perm = rng.permutation(len(pr))
    return h, w, torch.tensor(pr)[perm], torch.tensor(pt)[perm]


def unchunked(h, w, pair_row, pair_token):
    """Full logits, ``log_softmax``, gather; entropy of every row that carries a pair (0 elsewhere)."""
    logp = torch.log_softmax(h @ w.t(), dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    has = torch.zeros(h.shape[0], dtype=torch.bool)
    has[pair_row] = True
    return logp[pair_row, pair_token], torch.where(has, ent, torch.zeros_like(ent))


def run(fn, h0, w0, pair_row, pair_token, entropy, seed=3):
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(pair_row.shape[0], dtype=torch.float64, generator=g)
    b = torch.randn(h0.shape[0], dtype=torch.float64, generator=g)
    if entropy:
        lp, ent = fn(h, w, pair_row, pair_token)
        (lp @ a + ent @ b).backward()
        return lp.detach(), ent.detach(), h.grad, w.grad
    lp = fn(h, w, pair_row, pair_token)
    (lp @ a).backward()
    return lp.detach(), h.grad, w.grad


def rel(a, b):
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))


@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("chunk_rows", [1, 2, 4, 5, 7, 16, 22, 23, 40, None])
def test_chunked_equals_reference_and_unchunked_log_softmax(chunk_rows, entropy):
    """23 rows that carry pairs at most (rows without pairs are skipped before chunking): chunk sizes
    dividing none, some or all of them, one chunk and a chunk larger than the rows."""
    h0, w0, pr, pt = problem()

    def chunked(h, w, r, t):
        return multi_target_logprobs(h, w, r, t, chunk_rows=chunk_rows, return_entropy=entropy)

    def ref(h, w, r, t):
        return multi_target_logprobs_reference(h, w, r, t, return_entropy=entropy)

    def plain(h, w, r, t):
        lp, ent = unchunked(h, w, r, t)
        return (lp, ent) if entropy else lp
    got = run(chunked, h0, w0, pr, pt, entropy)
    for other in (run(ref, h0, w0, pr, pt, entropy), run(plain, h0, w0, pr, pt, entropy)):
        for x, y in zip(got, other):
            assert x.shape == y.shape and rel(x, y) < TOL


class LargestTensor(TorchDispatchMode):
    """Records the largest element count of any tensor with a ``vocab``-sized dimension that an
    operator returns (forward and backward: logits, softmax, their gradients, the weight's)."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab
        self.largest = 0
        self.shape = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and self.vocab in t.shape and t.numel() > self.largest:
                self.largest, self.shape = t.numel(), tuple(t.shape)
        return out


def largest_tensor(fn, h0, w0, pr, pt):
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    with LargestTensor(w0.shape[0]) as mode:
        lp, ent = fn(h, w, pr, pt)
        (lp.sum() + ent.sum()).backward()
    return mode.largest, mode.shape


@pytest.mark.parametrize("chunk_rows", [3, 8])
def test_no_rows_by_vocab_tensor_is_ever_allocated(chunk_rows, monkeypatch):
    """Every vocabulary-wide tensor of the forward and the backward (entropy on) holds at most
    chunk_rows x vocab elements; the reference, tracked the same way, does build the [rows, vocab]
    logits (the tracker sees them).  The hidden size is small, so the [vocab, hidden] weight and
    its gradient stay under a chunk's logits."""
    rows, vocab = 64, 37
    h0, w0, pr, pt = problem(rows=rows, vocab=vocab, hidden=3, seed=5)
    assert int(torch.unique(pr).numel()) > chunk_rows * 4
    ref_largest, ref_shape = largest_tensor(
        lambda h, w, r, t: multi_target_logprobs_reference(h, w, r, t, return_entropy=True), h0, w0, pr, pt)
    assert ref_largest >= rows * vocab and ref_shape == (rows, vocab)
    largest, shape = largest_tensor(
        lambda h, w, r, t: multi_target_logprobs(h, w, r, t, chunk_rows=chunk_rows, return_entropy=True),
        h0, w0, pr, pt)
    assert largest <= chunk_rows * vocab, shape
    # the default chunk: capped by _CHUNK_BYTES of fp64 statistics-dtype logits
    monkeypatch.setattr(LP, "_CHUNK_BYTES", chunk_rows * vocab * 8)
    assert default_chunk_rows(vocab, torch.float64) == chunk_rows
    largest, shape = largest_tensor(
        lambda h, w, r, t: multi_target_logprobs(h, w, r, t, return_entropy=True), h0, w0, pr, pt)
    assert largest <= chunk_rows * vocab, shape


def test_default_chunk_rows_at_the_kimi_vocabulary():
    """4096 rows (the speed choice at V = 163,840), at any input dtype and vocabulary shard up to 4 GiB
    of statistics-dtype logits a chunk; past that the most rows that fit; never 0."""
    assert default_chunk_rows(163840, torch.bfloat16) == default_chunk_rows(163840, torch.float32) == 4096
    assert default_chunk_rows(163840, torch.float64) == (4 << 30) // (163840 * 8) == 3276
    assert default_chunk_rows(32000, torch.bfloat16) == default_chunk_rows(163840 // 8, torch.bfloat16) == 4096
    assert default_chunk_rows(1 << 20, torch.float32) == 1024
    assert default_chunk_rows(1 << 40, torch.float32) == 1


def test_default_chunk_holds_to_the_h200_measurement():
    """The default chunk at V = 163,840 against benchmarks/results/scale-h200/logprobs-h200.json (one H200,
    hidden 2304, bf16, forward + backward): at 16k and 32k rows within 10% of the fastest chunking's
    time, at no more than a quarter of the unchunked form's peak (whose 59 GiB at 32k rows a training
    step cannot spare), and the chunkings measured there all grow in memory with the chunk."""
    import json
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results",
                        "scale-h200", "logprobs-h200.json")
    res = json.load(open(path))
    assert res["args"]["vocab"] == 163840 and res["args"]["dtype"] == "bf16"
    chunk = default_chunk_rows(163840, torch.bfloat16)
    for run in res["runs"]:
        v = run["variants"]
        chunked = {int(k.split("_")[1]): x for k, x in v.items() if k.startswith("chunk_")}
        assert chunk in chunked, run["rows"]
        fastest = min(x["ms"] for x in chunked.values())
        assert chunked[chunk]["ms"] <= 1.1 * fastest, run["rows"]
        assert chunked[chunk]["peak_gib_above_start"] <= v["unchunked"]["peak_gib_above_start"] / 4, run["rows"]
        peaks = [chunked[c]["peak_gib_above_start"] for c in sorted(chunked)]
        assert peaks == sorted(peaks), run["rows"]


def test_driver_flag_reaches_the_log_prob_op_in_tree_and_expanded_mode(monkeypatch):
    """``--tree-logprob-chunk-rows`` lands in the model config and in every call of the output layer's
    log-prob op, in tree mode (within) and expanded mode (off) alike: both compute their log-probs
    through ``multi_target_logprobs``.  The loss and gradient norm do not depend on the chunk."""
    from megatron_harts.models import model as M
    from megatron_harts.training.arguments import hybrid_config, parse_args
    from megatron_harts.training.trainer import Trainer
    from megatron_harts.tree_data import build_forest
    from test_training_driver import MODEL, rollouts

    forest = build_forest(rollouts(0))
    calls = []
    real = M.multi_target_logprobs

    def spy(*args, **kw):
        calls.append(kw.get("chunk_rows"))
        return real(*args, **kw)
    monkeypatch.setattr(M, "multi_target_logprobs", spy)

    def flags(sharing, *extra):
        return list(MODEL) + ["--global-batch-size", str(forest.num_trajectories), "--train-iters", "10",
                              "--seq-length", "64", "--lr", "1e-3", "--log-interval", "1000", "--rl-objective",
                              "sft", "--tree-sharing", sharing, "--tree-microbatch-tokens", "64", *extra]
    assert hybrid_config(parse_args(flags("within", "--tree-logprob-chunk-rows", "3"), require_data=False),
                         device="cpu").logprob_chunk_rows == 3
    results = {}
    for sharing in ("within", "off"):
        for chunk in ("3", None):
            calls.clear()
            with Trainer.from_args(flags(sharing, *(["--tree-logprob-chunk-rows", chunk] if chunk else []))) as t:
                m = t.step(forest)
            assert calls and all(c == (int(chunk) if chunk else None) for c in calls), (sharing, chunk, calls)
            results[sharing, chunk] = (m["loss"], m["grad_norm"])
        a, b = results[sharing, "3"], results[sharing, None]
        assert abs(a[0] - b[0]) <= 1e-12 * abs(b[0]) and abs(a[1] - b[1]) <= 1e-10 * abs(b[1])
