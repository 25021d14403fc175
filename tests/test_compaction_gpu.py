"""Tree attention with compaction events on the GPU: the fast backends against ``reference``.

Layouts of forests whose trajectories carry compaction events (synthetic SWE-like rollouts under
each strategy, and a hand-built forest with forks at, before and after events, overlapping spans
and a sibling without the event), a few hundred rows, realistic head dims.  On CUDA:

- ``varlen`` (key paths broken at event rows) with torch's flash kernel and, where installed,
  flash-attn-4, in bf16; the same key paths with the plain-torch run kernel in fp32;
- ``flex`` (FlexAttention, its block mask built from the eviction-aware visibility), bf16 and
  fp32, forward and backward;

each against the ``reference`` backend (dense eviction-aware mask) in fp64 on the same inputs.
The block mask skips fully evicted blocks: the blocks it marks non-empty are exactly the blocks
that hold a visible pair of the dense mask, fewer than without the events (that count runs on the
CPU too).
"""
import numpy as np
import pytest
import torch

from megatron_harts.layout import build_layout
from megatron_harts.ops.key_paths import FA4_VERSION, fa4_available
from megatron_harts.ops.tree_attention import build_tree_block_mask, tree_attention
from megatron_harts.tree_data import build_forest, make_trajectory
from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="the flash, fa4 and FlexAttention (backward) kernels need CUDA")


def traj(tid, tokens, events=None):
    rec = {"id": tid, "tokens": list(tokens)}
    if events:
        rec["compactions"] = [{"at": p, "start": a, "end": b} for p, a, b in events]
    return make_trajectory(rec)


def hand_forest():
    """Forks exactly at an event and just before and after it, a sibling without the event, a
    trajectory ending inside another's compacted path, overlapping spans and several events at one
    position, an event that evicts the token before it; a second tree without events."""
    base = list(range(1, 321))
    shared = [(96, 8, 64)]
    return build_forest([
        traj("a", base[:300], shared + [(160, 64, 128), (160, 100, 150), (224, 0, 200)]),
        traj("b", base[:180] + [900 + i for i in range(60)], shared + [(160, 64, 128), (160, 100, 150)]),
        traj("c", base[:96] + [700 + i for i in range(90)]),                 # without the event: fork at 96
        traj("d", base[:140], shared),                                       # ends inside a's compacted path
        traj("e", base[:96] + [800 + i for i in range(70)], shared + [(130, 40, 129)]),   # fork at the event
        traj("f", base[:95] + [600 + i for i in range(50)], [(120, 0, 119)]),             # fork just before it
        traj("g", base[:97] + [500 + i for i in range(40)], shared),                      # and just after it
        traj("h", [2000 + i for i in range(120)]),
    ])


def swe_forest(strategy, scheme="tree-step"):
    cfg = SweConfig(scheme=scheme, num_tasks=1, samples_per_task=1, prompt_median=60, action_median=12,
                    observation_median=24, min_turns=8, max_turns=12, max_tokens=420, branch_factor=2,
                    max_leaves=3, compaction=strategy, context_budget=128, keep_prefix=8, keep_last=24,
                    evict_chunk=32, summary_tokens=16, seed=3)
    return build_forest(synthesize_swe(cfg))


FORESTS = {"hand": hand_forest, "sliding-window": lambda: swe_forest("sliding-window"),
           "markovian": lambda: swe_forest("markovian"), "summary": lambda: swe_forest("summary"),
           "step-wise-sliding": lambda: swe_forest("sliding-window", "step-wise")}


def tree_causal(lay) -> torch.Tensor:
    """The layout's visibility without the events: every trajectory's causal mask over its rows."""
    R = lay.num_rows
    dense = np.zeros((R, R), dtype=bool)
    for t in range(lay.num_trajectories):
        rows = lay.trajectory_rows(t).numpy()
        dense[np.ix_(rows, rows)] |= np.tril(np.ones((rows.size, rows.size), dtype=bool))
    return torch.from_numpy(dense)


def layout_with_events(name):
    """The forest's layout: shared rows, events, and fewer visible pairs than without them."""
    f = FORESTS[name]()
    lay = build_layout(f)
    assert lay.num_events > 0 and lay.num_rows < int(lay.traj_length.sum())
    assert 100 <= lay.num_rows <= 1000
    assert int(lay.visibility.dense().sum()) < int(tree_causal(lay).sum())
    return f, lay


def rel(a, b):
    return float((a.detach().double() - b.detach()).norm() / b.detach().norm())


def against_reference(lay, backend, dtype, dims, heads=(4, 2), **kw):
    """(out, grads) relative errors of ``backend`` in ``dtype`` against ``reference`` in fp64 on the
    same (rounded) inputs; forward and backward."""
    D, Dv = dims
    H, Hk = heads
    R = lay.num_rows
    gen = torch.Generator(device="cuda").manual_seed(0)
    make = lambda *s: torch.randn(*s, device="cuda", generator=gen).to(dtype).requires_grad_()  # noqa: E731
    q, k, v = make(R, H, D), make(R, Hk, D), make(R, Hk, Dv)
    g = torch.randn(R, H, Dv, device="cuda", generator=gen).to(dtype)
    out = tree_attention(q, k, v, lay, backend=backend, **kw)
    got = torch.autograd.grad((out.float() * g.float()).sum(), (q, k, v))
    up = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = tree_attention(*up, lay, backend="reference")
    want = torch.autograd.grad((ref * g.double()).sum(), up)
    assert torch.isfinite(out).all() and all(torch.isfinite(a).all() for a in got)
    return rel(out, ref), [rel(a, b) for a, b in zip(got, want)]


LIMITS = {torch.bfloat16: (1e-2, 2e-2), torch.float32: (1e-4, 2e-4)}


@needs_cuda
@pytest.mark.parametrize("name", sorted(FORESTS))
@pytest.mark.parametrize("kernel,dtype", [("flash", torch.bfloat16), ("fa4", torch.bfloat16),
                                          ("reference", torch.float32)])
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (96, 64)])
def test_varlen_with_eviction_equals_reference_cuda(name, kernel, dtype, dims):
    if kernel == "fa4" and not fa4_available("cuda", dims):
        pytest.skip(f"flash-attn-4=={FA4_VERSION} not installed, not a Hopper GPU, or dims {dims} out of its range")
    _, lay = layout_with_events(name)
    out_err, grad_errs = against_reference(lay.to("cuda"), "varlen", dtype, dims, varlen_kernel=kernel)
    lo, hi = LIMITS[dtype]
    assert out_err < lo and max(grad_errs) < hi, (out_err, grad_errs)


@needs_cuda
@pytest.mark.parametrize("name", sorted(FORESTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dims", [(64, 64), (128, 128)])
def test_flex_with_eviction_equals_reference_cuda(name, dtype, dims):
    _, lay = layout_with_events(name)
    lay = lay.to("cuda")
    bm = build_tree_block_mask(lay)
    out_err, grad_errs = against_reference(lay, "flex", dtype, dims, block_mask=bm)
    lo, hi = LIMITS[dtype]
    assert out_err < lo and max(grad_errs) < hi, (out_err, grad_errs)


def blocks_with_pairs(dense: torch.Tensor, bs: int) -> int:
    """(query block, key block) pairs of the dense [R, K] mask holding at least one visible pair."""
    R, K = dense.shape
    nq, nk = -(-R // bs), -(-K // bs)
    grid = torch.zeros(nq * bs, nk * bs, dtype=torch.bool)
    grid[:R, :K] = dense.cpu()
    return int(grid.view(nq, bs, nk, bs).any(3).any(1).sum())


def marked_blocks(bm) -> int:
    """Blocks the FlexAttention block mask computes (partial or full)."""
    return int(bm.kv_num_blocks.sum()) + int(bm.full_kv_num_blocks.sum())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("name", ["hand", "sliding-window", "markovian", "summary"])
def test_block_mask_skips_fully_evicted_blocks(name, device):
    """The blocks the mask computes are exactly those holding a visible pair; the events empty
    some blocks entirely (against the same rows without the events), and those are skipped."""
    _, lay = layout_with_events(name)
    bs = 16
    bm = build_tree_block_mask(lay.to(device), block_size=bs, device=device)
    assert bm.kv_num_blocks.device.type == device
    dense, plain = lay.visibility.dense(), tree_causal(lay)
    assert not (dense & ~plain).any() and int(dense.sum()) < int(plain.sum())
    assert marked_blocks(bm) == blocks_with_pairs(dense, bs) < blocks_with_pairs(plain, bs)
