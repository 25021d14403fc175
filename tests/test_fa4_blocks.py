"""The ``fa4`` tree-attention backend (ops/fa4_blocks.py) against its definitions.

(a) CPU, always: the forward's per-query-block lists and the backward's per-key-block lists built
    from the intervals equal the brute-force tiles of the dense mask (:func:`block_lists_reference`),
    at the block shapes flash-attn-4 uses on Hopper (128 x 128, and 128 x 96 for MLA's backward),
    and the padded interval table reproduces the mask; on random visibilities, synthetic rollouts
    with and without compaction, consumer layouts with context keys and random trees.
(b) A Hopper GPU with the pinned flash-attn-4: the kernels' output and every input gradient (q, k,
    v, context k and v) in bf16 against the fp64 ``reference`` backend, within the bf16 rule of the
    other kernels (the varlen fa4 path measured on the same inputs), on trees, compaction layouts,
    consumer layouts and MLA head dims; skipped with the reason elsewhere.
"""
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from megatron_harts.layout import build_layout
from megatron_harts.ops.fa4_blocks import block_lists, block_lists_reference, build_fa4_blocks
from megatron_harts.ops.key_paths import fa4_available
from megatron_harts.ops.tree_attention import tree_attention
from megatron_harts.tree_data import build_forest
from test_forest import trajectory_sets
from test_interval_attention import check_table, full_mask, swe
from test_tree_attention import random_visibility

BLOCKS = ((128, 128), (128, 96))


def unpack(lists):
    part_cnt, part_idx, full_cnt, full_idx = (t.cpu().numpy() for t in lists)
    part = [list(map(int, part_idx[i, :part_cnt[i]])) for i in range(part_cnt.shape[0])]
    full = [list(map(int, full_idx[i, :full_cnt[i]])) for i in range(full_cnt.shape[0])]
    return part, full


def check(vis, ctx=None, blocks=BLOCKS):
    b = build_fa4_blocks(vis, ctx, dims=(192, 128), blocks=blocks)
    mask = full_mask(vis, ctx)
    R, K = mask.shape
    assert (b.num_queries, b.num_keys) == (R, K)
    assert unpack(b.fwd_lists) == block_lists_reference(mask, *blocks[0])
    assert unpack(b.bwd_lists) == block_lists_reference(mask, *blocks[1], by_keys=True)
    assert (b.starts.dim() == 1) == (b.width == 1)
    assert b.starts.shape[0] >= max(-(-K // bl[1]) * bl[1] for bl in blocks)
    check_table(b.starts, b.ends, mask)
    assert b.pairs == int(mask.sum())
    return b


def test_block_lists_pad_and_order():
    kinds = np.array([[2, 0, 1, 2], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=np.int8)
    part_cnt, part_idx, full_cnt, full_idx = block_lists(kinds)
    assert part_cnt.tolist() == [1, 0, 2] and full_cnt.tolist() == [2, 0, 0]
    assert part_idx.tolist() == [[2, 0], [0, 0], [0, 1]] and full_idx.tolist() == [[0, 3], [0, 0], [0, 0]]
    assert part_idx.dtype == np.int32


@pytest.mark.parametrize("seed", range(4))
def test_lists_of_random_intervals(seed):
    rng = np.random.default_rng(seed)
    R = int(rng.integers(1, 400))
    small = ((32, 32), (32, 16))
    check(random_visibility(rng, R), blocks=small)
    check(random_visibility(rng, R, causal=False, num_keys=int(rng.integers(1, 300))), blocks=small)


@pytest.mark.parametrize("compaction", ["none", "sliding-window", "markovian", "summary"])
def test_lists_of_synthetic_layouts(compaction):
    f = swe(3, compaction, max_tokens=400, budget=128)
    lay = build_layout(f)
    b = check(lay.visibility)
    assert b.num_full + b.num_partial > 0
    check(lay.visibility, blocks=((32, 32), (32, 16)))
    child = int(np.flatnonzero(f.seg_parent >= 0)[0])
    sub = build_layout(f, roots=[child], context=lay)
    assert sub.num_context_rows > 0
    check(sub.visibility, sub.context_visibility, blocks=((32, 32), (32, 16)))


@pytest.mark.parametrize("compaction", ["sliding-window", "summary"])
def test_keys_with_several_intervals(compaction):
    # a rollout forking after a compaction event: keys the event evicts in one branch stay visible in
    # the other, so in preorder they see two query intervals (the table's width 2, the 2-D mask)
    lay = build_layout(swe(1, compaction, max_tokens=1500, budget=384))
    b = check(lay.visibility)
    assert b.width == 2 and b.starts.dim() == 2


@settings(max_examples=20, deadline=None)
@given(trajectory_sets(max_traj=6))
def test_lists_of_random_trees(trajs):
    check(build_layout(build_forest(trajs)).visibility, blocks=((16, 16), (16, 32)))


def test_unavailable_is_one_clear_error():
    if fa4_available("cuda" if torch.cuda.is_available() else "cpu"):
        pytest.skip("flash-attn-4 runs here")
    vis = random_visibility(np.random.default_rng(0), 20)
    q = torch.zeros(20, 1, 16)
    with pytest.raises(ValueError, match="backend 'fa4' needs flash-attn-4 on a Hopper GPU"):
        tree_attention(q, q, q, vis, backend="fa4",
                       fa4_blocks=build_fa4_blocks(vis, dims=(16, 16), blocks=((16, 16), (16, 16))))


# ---------------------------------------------------------------------------
# (b) the kernels (Hopper GPU with flash-attn-4)
# ---------------------------------------------------------------------------

GPU = torch.cuda.is_available() and fa4_available("cuda")


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def errors(lay, backend, dqk, dv, H=4, seed=0, ctx=None):
    R = lay.num_rows
    Rc = lay.num_context_rows
    gen = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    ins = [make(R, H, dqk), make(R, H, dqk), make(R, H, dv), make(Rc, H, dqk), make(Rc, H, dv)]
    g = make(R, H, dv)
    scale = dqk ** -0.5
    ref_in = [t.clone().requires_grad_() for t in ins]
    ref = tree_attention(*ref_in[:3], lay, scale, backend="reference",
                         context_kv=(ref_in[3], ref_in[4]) if Rc else None)
    ref_g = torch.autograd.grad(ref, ref_in, g, allow_unused=True)
    dev = [t.cuda().bfloat16().requires_grad_() for t in ins]
    out = tree_attention(*dev[:3], lay.to("cuda"), scale, backend=backend,
                         context_kv=(dev[3], dev[4]) if Rc else None)
    got_g = torch.autograd.grad(out, dev, g.cuda().bfloat16(), allow_unused=True)
    errs = {"out": rel(out.detach().cpu(), ref.detach())}
    for name, a, b in zip(("dq", "dk", "dv", "dck", "dcv"), got_g, ref_g):
        if b is not None and b.numel():
            errs[name] = rel(a.cpu(), b)
    return errs


@pytest.mark.skipif(not GPU, reason="needs a Hopper GPU with flash-attn-4 (the pinned release)")
@pytest.mark.parametrize("seed", [5, 1])          # seed 1: keys with two intervals (see above)
@pytest.mark.parametrize("compaction", ["none", "sliding-window", "summary"])
@pytest.mark.parametrize("dims", [(128, 128), (192, 128), (96, 64)])
def test_kernels_match_the_reference(compaction, dims, seed):
    if seed == 1 and (compaction == "none" or dims != (192, 128)):
        pytest.skip("keys with several intervals: compaction layouts, at MLA's head dims")
    f = swe(seed, compaction, max_tokens=1500, budget=384)
    lay = build_layout(f)
    child = int(np.flatnonzero(f.seg_parent >= 0)[0])
    sub = build_layout(f, roots=[child], context=lay)
    for layout in (lay, sub):
        got = errors(layout, "fa4", *dims)
        # the bf16 rule: no worse than another bf16 kernel of the project on the same inputs
        # (flex: FlexAttention, bf16 in, fp32 accumulation), with a floor for round-off
        base = errors(layout, "flex", *dims)
        for name, e in got.items():
            assert e <= max(2 * base[name], 2e-2), (name, e, base[name], layout.num_rows)
