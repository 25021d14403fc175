"""Tree attention equals per-trajectory causal attention, forward and backward (fp64)."""
import dataclasses
import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_harts.layout import Visibility, build_layout
from megatron_harts.ops.key_paths import (FA4_VERSION, build_key_paths, default_kernel, fa4_available,
                                          gathered_key_count, path_attention, sequence_key_paths)
from megatron_harts.ops.tree_attention import build_tree_block_mask, tree_attention
from megatron_harts.tree_data import build_forest, make_trajectory
from test_forest import trajectory_sets
from test_layout import non_nested_roots

warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")

CUDA = torch.cuda.is_available()
TOL = dict(rtol=1e-10, atol=1e-12)


def joint_paths(forest, layout):
    """Per layout trajectory: its full path as indices into [context rows; layout rows]."""
    Rc = layout.num_context_rows
    ctx = {int(r): i for i, r in enumerate(layout.ctx_forest_rows.tolist())}
    loc = {int(r): Rc + i for i, r in enumerate(layout.forest_rows.tolist())}
    paths = []
    for tid in layout.traj_ids:
        frows = forest.trajectory_rows(forest.trajectory_index(tid))
        paths.append(torch.tensor([ctx[int(r)] if int(r) in ctx else loc[int(r)] for r in frows]))
    return paths


def causal_attention(q, k, v, scale):
    """Plain causal softmax attention of one sequence: q [Lq, H, D] are its last Lq positions."""
    Lq, Lk = q.shape[0], k.shape[0]
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(Lk - Lq, Lk)[:, None]
    s = s.masked_fill(torch.arange(Lk)[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


def compare_with_expanded(forest, layout, backend, H=2, Hk=1, Dqk=3, Dv=2, seed=0, grad=True, **kw):
    gen = torch.Generator().manual_seed(seed)
    R, Rc = layout.num_rows, layout.num_context_rows
    q = torch.randn(R, H, Dqk, dtype=torch.float64, generator=gen, requires_grad=grad)
    k_all = torch.randn(Rc + R, Hk, Dqk, dtype=torch.float64, generator=gen, requires_grad=grad)
    v_all = torch.randn(Rc + R, Hk, Dv, dtype=torch.float64, generator=gen, requires_grad=grad)
    scale = 0.7
    # expanded: every trajectory on its own, causal over its full path
    paths = joint_paths(forest, layout)
    cot, loss_e = [], 0.0
    out_e = torch.zeros(R, H, Dv, dtype=torch.float64)
    for t, path in enumerate(paths):
        s = int(layout.traj_start[t])
        rows = path[s:] - Rc
        o = causal_attention(q[rows], k_all[path], v_all[path], scale)
        g = torch.randn(o.shape, dtype=torch.float64, generator=gen)
        cot.append((rows, g))
        loss_e = loss_e + (o * g).sum()
        out_e[rows] = o.detach()       # every copy of a row must agree; checked below
    for t, path in enumerate(paths):
        s = int(layout.traj_start[t])
        rows = path[s:] - Rc
        torch.testing.assert_close(causal_attention(q[rows], k_all[path], v_all[path], scale).detach(),
                                   out_e[rows], **TOL)
    ctx_kv = (k_all[:Rc], v_all[:Rc]) if Rc else None
    out = tree_attention(q, k_all[Rc:], v_all[Rc:], layout, scale, backend=backend, context_kv=ctx_kv, **kw)
    torch.testing.assert_close(out.detach(), out_e, **TOL)
    if not grad:
        return
    g_c = torch.zeros(R, H, Dv, dtype=torch.float64)
    for rows, g in cot:
        g_c.index_add_(0, rows, g)
    want = torch.autograd.grad(loss_e, (q, k_all, v_all))
    got = torch.autograd.grad((out * g_c).sum(), (q, k_all, v_all))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)


@settings(max_examples=20, deadline=None)
@given(trajectory_sets(max_traj=6), st.sampled_from(["reference", "sdpa", "varlen"]),
       st.sampled_from([(2, 1), (2, 2)]))
def test_whole_trees_equal_expanded_fwd_bwd(trajs, backend, heads):
    f = build_forest(trajs)
    compare_with_expanded(f, build_layout(f), backend, H=heads[0], Hk=heads[1],
                          **({"query_block": 3} if backend == "sdpa" else {}))


@settings(max_examples=12, deadline=None)
@given(trajectory_sets(max_traj=6), st.data())
def test_subtree_with_context_equals_expanded(trajs, data):
    f = build_forest(trajs)
    producer = build_layout(f)
    roots = non_nested_roots(f, data, max_size=3)
    lay = build_layout(f, roots=roots, context=producer)
    for backend in ("reference", "sdpa", "varlen"):
        compare_with_expanded(f, lay, backend, **({"query_block": 2} if backend == "sdpa" else {}))
    compare_with_expanded(f, lay, "flex", grad=False)


@settings(max_examples=10, deadline=None)
@given(trajectory_sets(max_traj=6))
def test_flex_forward_equals_expanded_cpu(trajs):
    f = build_forest(trajs)
    compare_with_expanded(f, build_layout(f), "flex", grad=False, H=2, Hk=1, Dqk=4, Dv=3)


def test_mla_head_dims_and_fixed_forks():
    """q/k head dim differs from v's (MLA: 192/128, here scaled down); a fork and an end inside."""
    f = build_forest([make_trajectory(r) for r in [
        {"id": "a", "tokens": [5, 1, 2, 3]}, {"id": "b", "tokens": [5, 1, 2, 4]},
        {"id": "c", "tokens": [5, 1]}, {"id": "d", "tokens": [9]}]])
    lay = build_layout(f)
    for backend in ("reference", "sdpa", "varlen"):
        compare_with_expanded(f, lay, backend, H=4, Hk=4, Dqk=12, Dv=8)
    compare_with_expanded(f, lay, "flex", grad=False, H=4, Hk=4, Dqk=12, Dv=8)


# ---------------------------------------------------------------------------
# general interval visibility (KV eviction) and the block mask
# ---------------------------------------------------------------------------

def random_visibility(rng, R, max_intervals=3, causal=True, num_keys=None):
    """Per key: sorted disjoint intervals; causal ones start at the key itself."""
    K = R if causal else num_keys
    offsets, starts, ends = [0], [], []
    for k in range(K):
        lo = k if causal else 0
        if not causal and rng.random() < 0.3:
            offsets.append(offsets[-1])
            continue
        cuts = np.unique(rng.integers(lo + 1, R + 1, size=2 * max_intervals - 1)) if lo + 1 <= R else []
        pts = [lo] + [int(c) for c in cuts]
        if not causal:
            pts = sorted(set([int(rng.integers(0, R))] + [int(c) for c in cuts if c > 0]))
        n = 0
        for a, b in zip(pts[0::2], pts[1::2]):
            starts.append(a)
            ends.append(b)
            n += 1
        if causal and n == 0:
            starts.append(k)
            ends.append(k + 1)
            n = 1
        offsets.append(offsets[-1] + n)
    t = lambda x: torch.tensor(x, dtype=torch.int64)
    return Visibility(t(offsets), t(starts), t(ends), R, causal=causal).validate()


def check_block_mask(bm, dense, bs):
    """Full blocks are entirely visible, partial ones partly, skipped ones not at all."""
    R, K = dense.shape
    nq, nk = -(-R // bs), -(-K // bs)
    grid = torch.zeros(nq * bs, nk * bs, dtype=torch.bool)
    grid[:R, :K] = dense
    count = grid.view(nq, bs, nk, bs).sum((1, 3))
    kind = torch.zeros(nq, nk, dtype=torch.int64)            # 0 skipped, 1 partial, 2 full
    for num, idx, val in ((bm.kv_num_blocks, bm.kv_indices, 1), (bm.full_kv_num_blocks, bm.full_kv_indices, 2)):
        for i in range(nq):
            for j in idx[0, 0, i, :int(num[0, 0, i])].tolist():
                assert kind[i, j] == 0
                kind[i, j] = val
    tail = torch.zeros(nq, nk, dtype=torch.bool)
    if R % bs:
        tail[-1, :] = True
    if K % bs:
        tail[:, -1] = True
    assert bool(((kind == 2) == ((count == bs * bs) & ~tail)).all())
    assert bool(((kind == 0) == (count == 0)).all())


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2 ** 31), st.integers(1, 70), st.sampled_from([16, 32]))
def test_block_mask_classification_general_intervals(seed, R, bs):
    rng = np.random.default_rng(seed)
    vis = random_visibility(rng, R)
    bm = build_tree_block_mask(vis, block_size=bs)
    check_block_mask(bm, vis.dense(), bs)
    ctx = random_visibility(rng, R, causal=False, num_keys=int(rng.integers(0, 40)))
    bm = build_tree_block_mask(vis, context_visibility=ctx, block_size=bs)
    check_block_mask(bm, torch.cat([ctx.dense(), vis.dense()], 1), bs)


def test_block_mask_on_a_swe_tree_has_full_blocks():
    from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe
    cfg = SweConfig(num_tasks=1, samples_per_task=3, prompt_median=200, action_median=20, observation_median=30,
                    min_turns=2, max_turns=4, max_tokens=600, seed=1)
    f = build_forest(synthesize_swe(cfg))
    lay = build_layout(f)
    bm = build_tree_block_mask(lay, block_size=16)
    assert int(bm.full_kv_num_blocks.sum()) > 0
    check_block_mask(bm, lay.visibility.dense(), 16)


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 2 ** 31), st.integers(1, 30))
def test_general_intervals_backends_agree(seed, R):
    """Multi-interval (evicting) visibility with context keys: sdpa and flex equal the reference."""
    rng = np.random.default_rng(seed)
    vis = random_visibility(rng, R)
    Rc = int(rng.integers(0, 6))
    ctx = random_visibility(rng, R, causal=False, num_keys=Rc)
    gen = torch.Generator().manual_seed(seed % 1000)
    q = torch.randn(R, 2, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(R, 1, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(R, 1, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    ck = torch.randn(Rc, 1, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    cv = torch.randn(Rc, 1, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    g = torch.randn(R, 2, 2, dtype=torch.float64, generator=gen)
    kw = dict(context_kv=(ck, cv), context_visibility=ctx)
    ref = tree_attention(q, k, v, vis, backend="reference", **kw)
    # the reference itself against an explicit per-query loop
    dense = torch.cat([ctx.dense(), vis.dense()], 1)
    K_all, V_all = torch.cat([ck, k]), torch.cat([cv, v])
    for i in range(R):
        sel = dense[i].nonzero()[:, 0]
        s = torch.einsum("hd,khd->hk", q[i], K_all[sel]) / math.sqrt(3)
        torch.testing.assert_close(ref[i].detach(), torch.einsum("hk,khd->hd", torch.softmax(s, -1), V_all[sel]).detach(),
                                   **TOL)
    want = torch.autograd.grad((ref * g).sum(), (q, k, v, ck, cv))
    out = tree_attention(q, k, v, vis, backend="sdpa", query_block=4, **kw)
    torch.testing.assert_close(out, ref, **TOL)
    for a, b in zip(torch.autograd.grad((out * g).sum(), (q, k, v, ck, cv)), want):
        torch.testing.assert_close(a, b, **TOL)
    with torch.no_grad():
        bm = build_tree_block_mask(vis, context_visibility=ctx, block_size=16)
        torch.testing.assert_close(tree_attention(q, k, v, vis, backend="flex", block_mask=bm, **kw), ref.detach(), **TOL)


def swe_cuda_layouts():
    """A small SWE-like forest's whole-tree layout and a consumer layout of one of its subtrees
    (context rows from the first), on the GPU."""
    from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe
    cfg = SweConfig(num_tasks=2, samples_per_task=3, prompt_median=200, action_median=20, observation_median=30,
                    min_turns=2, max_turns=4, max_tokens=700, seed=2)
    f = build_forest(synthesize_swe(cfg))
    producer = build_layout(f)
    child = int(np.flatnonzero(f.seg_parent >= 0)[0])
    return [lay.to("cuda") for lay in (producer, build_layout(f, roots=[child], context=producer))]


@pytest.mark.skipif(not CUDA, reason="FlexAttention's backward needs CUDA (torch has none on CPU)")
def test_flex_forward_backward_cuda():
    for lay in swe_cuda_layouts():
        R, Rc = lay.num_rows, lay.num_context_rows
        gen = torch.Generator(device="cuda").manual_seed(0)
        make = lambda *s: torch.randn(*s, device="cuda", generator=gen, requires_grad=True)
        q, k, v = make(R, 4, 64), make(R, 2, 64), make(R, 2, 32)
        ck, cv = make(Rc, 2, 64), make(Rc, 2, 32)
        g = torch.randn(R, 4, 32, device="cuda", generator=gen)
        ctx = (ck, cv) if Rc else None
        bm = build_tree_block_mask(lay)
        out = tree_attention(q, k, v, lay, backend="flex", block_mask=bm, context_kv=ctx)
        ref = tree_attention(q, k, v, lay, backend="reference", context_kv=ctx)
        inputs = (q, k, v) + ((ck, cv) if Rc else ())
        got = torch.autograd.grad((out * g).sum(), inputs)
        want = torch.autograd.grad((ref * g).sum(), inputs)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@settings(max_examples=20, deadline=None)
@given(trajectory_sets(max_traj=6), st.data())
def test_key_paths_hold_exactly_the_visible_pairs(trajs, data):
    """Every run's gathered keys, bottom-right causal, are each row's visible keys (with context)."""
    f = build_forest(trajs)
    producer = build_layout(f)
    roots = non_nested_roots(f, data, max_size=3)
    for lay in (producer, build_layout(f, roots=roots, context=producer)):
        Rc, R = lay.num_context_rows, lay.num_rows
        paths = build_key_paths(lay.visibility, lay.context_visibility if Rc else None)
        dense = lay.visibility.dense()
        if Rc:
            dense = torch.cat([lay.context_visibility.dense(), dense], dim=1)
        got = torch.zeros(R, Rc + R, dtype=torch.bool)
        q_off, k_off = paths.q_offsets.tolist(), paths.k_offsets.tolist()
        for g in range(paths.num_runs):
            lq, lk = q_off[g + 1] - q_off[g], k_off[g + 1] - k_off[g]
            keys = paths.key_index[k_off[g]:k_off[g + 1]]
            assert torch.equal(keys[lk - lq:], torch.arange(q_off[g], q_off[g + 1]) + Rc)
            for i in range(lq):
                got[q_off[g] + i, keys[:lk - (lq - 1 - i)]] = True
        assert torch.equal(got, dense)
        assert paths.pairs == int(dense.sum())
        assert gathered_key_count(lay.visibility, lay.context_visibility if Rc else None) == paths.gathered_keys


def test_key_paths_worth_gathering_rejects_many_short_runs():
    """A chain of long segments gathers little; a deep comb of one-row branches gathers a key per
    visible pair (the model then takes the block-mask backend for that microbatch)."""
    long_f = build_forest([make_trajectory({"id": f"t{i}", "tokens": [1] * 400 + [2 + i] * 400})
                           for i in range(3)])
    assert build_key_paths(build_layout(long_f).visibility).worth_gathering()
    trunk = [1, 2, 3, 4, 5, 6, 7, 8] * 20
    comb = build_forest([make_trajectory({"id": f"t{i}", "tokens": trunk[:i + 1] + [200]}) for i in range(160)])
    paths = build_key_paths(build_layout(comb).visibility)
    assert not paths.worth_gathering()
    from megatron_harts.models.packed import TreePackedSeqParams
    psp = TreePackedSeqParams.for_tree(build_layout(comb), attention_backend="varlen")
    assert psp.attention_backend == "sdpa" and psp.key_paths is None
    psp = TreePackedSeqParams.for_tree(build_layout(long_f), attention_backend="varlen")
    assert psp.attention_backend == "varlen" and psp.key_paths is not None


def test_key_paths_refuse_non_tree_visibility():
    vis = Visibility(offsets=torch.tensor([0, 2, 3, 4]), start=torch.tensor([0, 2, 1, 2]),
                     end=torch.tensor([1, 3, 3, 3]), num_queries=3).validate()
    with pytest.raises(ValueError, match="one visible interval per key"):
        build_key_paths(vis)
    # one interval per key, but row 2 sees key 0 without seeing key 1 (not a tree's ancestry)
    odd = Visibility(offsets=torch.tensor([0, 1, 2, 3]), start=torch.tensor([0, 1, 2]),
                     end=torch.tensor([3, 2, 3]), num_queries=3).validate()
    assert build_key_paths(odd).pairs == 5           # still a tree: 1 is a leaf under 0, 2 is its sibling
    bad = Visibility(offsets=torch.tensor([0, 1, 2, 3]), start=torch.tensor([0, 1, 2]),
                     end=torch.tensor([2, 3, 3]), num_queries=3).validate()
    with pytest.raises(ValueError, match="not a tree's"):
        build_key_paths(bad)


@pytest.mark.skipif(not CUDA, reason="the flash varlen kernels need CUDA")
@pytest.mark.parametrize("kernel", ["flash", "fa4"])
@pytest.mark.parametrize("dims", [(64, 64), (96, 64), (192, 128), (12, 8), (64, 128)])
def test_varlen_fast_kernels_equal_reference_cuda(dims, kernel):
    D, Dv = dims
    if kernel == "fa4" and not fa4_available("cuda", dims):
        pytest.skip(f"flash-attn-4=={FA4_VERSION} not installed, not a Hopper GPU, or dims {dims} out of its range")
    for lay in swe_cuda_layouts():
        R, Rc = lay.num_rows, lay.num_context_rows
        gen = torch.Generator(device="cuda").manual_seed(0)
        make = lambda *s: torch.randn(*s, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
        q, k, v = make(R, 4, D), make(R, 2, D), make(R, 2, Dv)
        ck, cv = make(Rc, 2, D), make(Rc, 2, Dv)
        g = torch.randn(R, 4, Dv, device="cuda", generator=gen).to(torch.bfloat16)
        ctx = (ck, cv) if Rc else None
        inputs = (q, k, v) + ((ck, cv) if Rc else ())
        out = tree_attention(q, k, v, lay, backend="varlen", context_kv=ctx, varlen_kernel=kernel)
        got = torch.autograd.grad((out.float() * g).sum(), inputs)
        up = [t.detach().double().requires_grad_() for t in inputs]
        ref = tree_attention(up[0], up[1], up[2], lay, backend="reference",
                             context_kv=(up[3], up[4]) if Rc else None)
        want = torch.autograd.grad((ref * g.double()).sum(), up)
        rel = lambda a, b: float((a.double() - b).norm() / b.norm())
        assert rel(out, ref) < 1e-2
        for a, b in zip(got, want):
            assert rel(a, b) < 2e-2


def test_varlen_kernel_choice_and_refusals_on_cpu():
    """CPU tensors take the reference kernel; the fast kernels refuse them with a message naming
    the kernel, and fa4 is never reported available without a Hopper GPU."""
    lay = build_layout(build_forest([make_trajectory({"id": f"t{i}", "tokens": [1, 2, 3, 4 + i]})
                                     for i in range(2)]))
    q = torch.randn(lay.num_rows, 2, 8, dtype=torch.float64)
    assert default_kernel(q, 8) == "reference"
    assert not fa4_available("cpu")
    paths = build_key_paths(lay.visibility)
    for kernel in ("flash", "fa4"):
        with pytest.raises(ValueError, match=f"kernel '{kernel}' needs CUDA"):
            path_attention(q, q, q, paths, 0.5, kernel=kernel)
    with pytest.raises(ValueError, match="kernel must be one of"):
        path_attention(q, q, q, paths, 0.5, kernel="fa3")
    ref = tree_attention(q, q, q, lay, backend="reference")
    torch.testing.assert_close(tree_attention(q, q, q, lay, backend="varlen"), ref)


def test_unusable_fa4_is_reported_once(monkeypatch):
    """flash-attn-4 absent: no word; another release, or one that does not import: one warning
    naming it, and the kernels fall back (no entry points)."""
    import importlib.metadata
    import sys

    from megatron_harts.ops import key_paths

    def installed(release):
        def version(name):
            if name == "flash-attn-4" and release:
                return release
            raise importlib.metadata.PackageNotFoundError(name)
        return version

    monkeypatch.setattr(importlib.metadata, "version", installed(None))
    monkeypatch.setattr(key_paths, "_FA4", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert key_paths._fa4_entry_points() is None
    monkeypatch.setattr(importlib.metadata, "version", installed("4.0.0b1"))
    monkeypatch.setattr(key_paths, "_FA4", None)
    with pytest.warns(UserWarning, match=f"flash-attn-4 4.0.0b1 is installed; .* {FA4_VERSION}"):
        assert key_paths._fa4_entry_points() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert key_paths._fa4_entry_points() is None            # reported once
    monkeypatch.setattr(importlib.metadata, "version", installed(FA4_VERSION))
    monkeypatch.setattr(key_paths, "_FA4", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", None)     # an import that fails
    with pytest.warns(UserWarning, match="does not import"):
        assert key_paths._fa4_entry_points() is None


def test_sequence_key_paths_are_causal_sequences():
    """Expanded mode's packed sequences as key-path runs: the reference kernel over them is causal
    attention within each sequence, and the runs count each sequence's causal pairs."""
    lengths = [5, 1, 3]
    paths = sequence_key_paths(lengths)
    assert (paths.num_runs, paths.num_queries, paths.num_keys, paths.pairs) == (3, 9, 9, 15 + 1 + 6)
    assert paths.key_index.tolist() == list(range(9))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(9, 2, d, dtype=torch.float64, generator=gen) for d in (4, 4, 3))
    got = path_attention(q, k, v, paths, 0.5, kernel="reference")
    a = 0
    for n in lengths:
        s = slice(a, a + n)
        want = F.scaled_dot_product_attention(q[s].transpose(0, 1), k[s].transpose(0, 1), v[s].transpose(0, 1),
                                              is_causal=True, scale=0.5).transpose(0, 1)
        torch.testing.assert_close(got[s], want)
        a += n
    with pytest.raises(ValueError, match="at least one token"):
        sequence_key_paths([3, 0])


@pytest.mark.skipif(not CUDA, reason="flash-attn-4 needs CUDA")
def test_fa4_over_sequences_equals_sdpa_cuda():
    """The expanded-mode use of fa4 (MLA's packed sequences): equal to SDPA per sequence."""
    if not fa4_available("cuda", (96, 64)):
        pytest.skip(f"flash-attn-4=={FA4_VERSION} not installed or not a Hopper GPU")
    lengths = [700, 1, 129, 2048]
    paths = sequence_key_paths(lengths, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    make = lambda d: torch.randn(sum(lengths), 4, d, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    q, k, v = make(96), make(96), make(64)
    out = path_attention(q, k, v, paths, 96 ** -0.5, kernel="fa4")
    g = torch.randn_like(out)
    got = torch.autograd.grad((out.float() * g).sum(), (q, k, v))
    up = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = path_attention(*up, paths, 96 ** -0.5, kernel="reference")
    want = torch.autograd.grad((ref * g.double()).sum(), up)
    rel = lambda a, b: float((a.double() - b).norm() / b.norm())
    assert rel(out, ref) < 1e-2
    for a, b in zip(got, want):
        assert rel(a, b) < 2e-2


def test_flex_backward_on_cpu_is_refused_clearly():
    f = build_forest([make_trajectory({"id": "a", "tokens": [1, 2, 3]})])
    lay = build_layout(f)
    q = torch.randn(3, 1, 2, requires_grad=True)
    with pytest.raises(ValueError, match="no backward on CPU"):
        tree_attention(q, q.detach(), q.detach(), lay, backend="flex")


def test_bad_input_names_the_argument():
    f = build_forest([make_trajectory({"id": "a", "tokens": [1, 2, 3]})])
    lay = build_layout(f)
    q = torch.randn(3, 2, 4)
    k = torch.randn(3, 1, 4)
    v = torch.randn(3, 1, 5)
    with pytest.raises(ValueError, match="backend"):
        tree_attention(q, k, v, lay, backend="dense")
    with pytest.raises(ValueError, match="rows"):
        tree_attention(q, k[:2], v, lay)
    with pytest.raises(ValueError, match="head dim"):
        tree_attention(q, torch.randn(3, 1, 3), v, lay)
    with pytest.raises(ValueError, match="multiple"):
        tree_attention(torch.randn(3, 3, 4), torch.randn(3, 2, 4), torch.randn(3, 2, 5), lay)
    with pytest.raises(ValueError, match="visibility"):
        tree_attention(q, k, v, "tree")
    with pytest.raises(ValueError, match="visibility"):
        tree_attention(q[:2], k[:2], v[:2], lay)
    with pytest.raises(ValueError, match="context_kv"):
        tree_attention(q, k, v, lay, context_kv=(k,))
    with pytest.raises(ValueError, match="context_visibility"):
        tree_attention(q, k, v, lay.visibility, context_kv=(k[:0], v[:0]))
    with pytest.raises(ValueError, match="block_mask"):
        tree_attention(q, k, v, lay, backend="flex", block_mask=build_tree_block_mask(
            build_layout(build_forest([make_trajectory({"id": "b", "tokens": [1, 2]})]))))
    with pytest.raises(ValueError, match="block_size"):
        build_tree_block_mask(lay, block_size=10)
    f2 = build_forest([make_trajectory({"id": "a", "tokens": [1, 2, 3]}), make_trajectory({"id": "b", "tokens": [1, 2, 4]})])
    sub = build_layout(f2, roots=[1], context=build_layout(f2))
    x = torch.randn(sub.num_rows, 1, 4)
    with pytest.raises(ValueError, match="context_kv: this layout's rows also see 2 context rows"):
        tree_attention(x, x, x, sub)


def test_sum_back_widens_a_chunk_at_a_time_to_the_same_sums(monkeypatch):
    """The varlen kernels' key/value gradient sum: chunked widening gives the one-shot fp32 sums, bitwise."""
    from megatron_harts.ops import key_paths as kp
    g = torch.Generator().manual_seed(0)
    k_all, v_all = torch.randn(9, 2, 6, dtype=torch.bfloat16), torch.randn(9, 2, 4, dtype=torch.bfloat16)
    index = torch.randint(0, 9, (23,), generator=g)
    paths = type("Paths", (), {"key_index": index, "in_place": False})()
    dkg = torch.randn(23, 2, 8, generator=g).to(torch.bfloat16)[..., :6]      # a padded kernel's slice
    dvg = torch.randn(23, 2, 4, generator=g).to(torch.bfloat16)
    whole_k = torch.zeros(9, 2, 6).index_add_(0, index, dkg.float()).to(torch.bfloat16)
    whole_v = torch.zeros(9, 2, 4).index_add_(0, index, dvg.float()).to(torch.bfloat16)
    monkeypatch.setattr(kp, "SUM_BACK_BYTES", 5 * 2 * 6 * 4)          # 5 key rows, 3 value rows a chunk
    dk, dv = kp._sum_back(k_all, v_all, paths, dkg, dvg)
    assert dk.dtype == dv.dtype == torch.bfloat16
    assert torch.equal(dk, whole_k) and torch.equal(dv, whole_v)


def test_packed_sequences_read_their_keys_in_place():
    """Expanded mode's key paths (packed causal sequences) read the keys where they are: no gather,
    and each key's gradient taken as it comes, bitwise what the fp32 sum of one term gives; tree
    paths gather.  The reference kernel gives the same attention either way."""
    from megatron_harts.ops import key_paths as kp
    g = torch.Generator().manual_seed(1)
    lengths = [5, 3, 7]
    paths = sequence_key_paths(lengths)
    assert paths.in_place and torch.equal(paths.key_index, torch.arange(15))
    k_all, v_all = torch.randn(15, 2, 6, generator=g), torch.randn(15, 2, 4, generator=g)
    assert kp._gathered(k_all, paths) is k_all
    dkg = torch.randn(15, 2, 8, generator=g).to(torch.bfloat16)[..., :6]        # a padded kernel's slice
    dvg = torch.randn(15, 2, 4, generator=g).to(torch.bfloat16)
    kb, vb = k_all.to(torch.bfloat16), v_all.to(torch.bfloat16)
    dk, dv = kp._sum_back(kb, vb, paths, dkg, dvg)
    gathered = dataclasses.replace(paths, in_place=False)
    sk, sv = kp._sum_back(kb, vb, gathered, dkg, dvg)
    assert dk.is_contiguous() and torch.equal(dk, sk) and torch.equal(dv, sv)
    q = torch.randn(15, 2, 6, generator=g, dtype=torch.float64)
    k64, v64 = k_all.double(), v_all.double()
    torch.testing.assert_close(path_attention(q, k64, v64, paths, 0.4, kernel="reference"),
                               path_attention(q, k64, v64, gathered, 0.4, kernel="reference"), rtol=0, atol=0)
    f = build_forest([make_trajectory({"id": "a", "tokens": [1, 2, 3]}), make_trajectory({"id": "b", "tokens": [1, 2, 4]})])
    assert not build_key_paths(build_layout(f).visibility).in_place


def test_interval_backend_params_carry_the_tiles():
    """With backend interval the tree params carry the microbatch's interval tiles (built once on the
    host, shared by every MLA layer), the same tiles build_interval_blocks gives; expanded params with
    compaction events build theirs for the packed sequences' visibility on first use."""
    import numpy as np

    from megatron_harts.models.packed import TreePackedSeqParams
    from megatron_harts.ops.interval_attention import build_interval_blocks
    f = build_forest([make_trajectory({"id": f"t{i}", "tokens": [1] * 150 + [2 + i] * (90 + 40 * i)})
                      for i in range(3)])
    lay = build_layout(f)
    psp = TreePackedSeqParams.for_tree(lay, attention_backend="interval")
    want = build_interval_blocks(lay.visibility)
    assert psp.attention_backend == "interval" and psp.key_paths is None and psp.block_mask is None
    got = psp.interval_blocks
    assert (got.num_full, got.num_partial) == (want.num_full, want.num_partial) and got.num_full + got.num_partial > 0
    for name in ("q_offsets", "q_num_full", "q_blocks", "k_offsets", "k_num_full", "k_blocks", "starts", "ends"):
        assert np.array_equal(getattr(got, name).cpu().numpy(), getattr(want, name).cpu().numpy()), name
    vis = Visibility(offsets=torch.arange(6), start=torch.tensor([0, 1, 2, 3, 4]), end=torch.tensor([3, 3, 3, 5, 5]),
                     num_queries=5, causal=True)
    seq = TreePackedSeqParams.for_sequences([3, 2], visibility=vis)
    kw = seq.sequence_attention("interval", "cpu")
    assert kw["backend"] == "interval" and kw["interval_blocks"].num_queries == 5
    assert seq.sequence_attention("interval", "cpu") is kw
