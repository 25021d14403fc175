"""Path convolution equals each trajectory's own causal short convolution (fp64, fwd and bwd)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_harts.layout import build_layout
from megatron_harts.ops.path_conv import (_fla_causal_conv1d, build_conv_taps, path_conv, row_order_conv,
                                         sequence_conv_taps)
from megatron_harts.tree_data import build_forest, make_trajectory
from test_forest import trajectory_sets
from test_layout import non_nested_roots
from test_tree_attention import joint_paths

TOL = dict(rtol=1e-10, atol=1e-12)


def causal_conv(x, weight, bias, activation):
    """One sequence x [L, C], written as Kimi-Linear's conv: Conv1d(groups=C, padding=K-1), cut to L."""
    L, C = x.shape
    K = weight.shape[1]
    y = F.conv1d(x.T[None], weight[:, None, :], bias, padding=K - 1, groups=C)[0, :, :L].T
    return F.silu(y) if activation == "silu" else y


def compare_with_expanded(forest, layout, backend, C=3, K=4, activation="silu", use_bias=True, seed=0,
                          prebuilt_taps=False):
    gen = torch.Generator().manual_seed(seed)
    R, Rc = layout.num_rows, layout.num_context_rows
    x_all = torch.randn(Rc + R, C, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(C, K, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(C, dtype=torch.float64, generator=gen, requires_grad=True) if use_bias else None
    loss_e = 0.0
    g_c = torch.zeros(R, C, dtype=torch.float64)
    out_e = torch.zeros(R, C, dtype=torch.float64)
    for t, path in enumerate(joint_paths(forest, layout)):
        s = int(layout.traj_start[t])
        y = causal_conv(x_all[path], w, b, activation)[s:]
        g = torch.randn(y.shape, dtype=torch.float64, generator=gen)
        rows = path[s:] - Rc
        g_c.index_add_(0, rows, g)
        loss_e = loss_e + (y * g).sum()
        out_e[rows] = y.detach()
    ctx = x_all[:Rc] if Rc else None
    taps = build_conv_taps(layout, K) if prebuilt_taps else None
    out = path_conv(x_all[Rc:], w, b, layout, activation=activation, context=ctx, backend=backend, taps=taps)
    torch.testing.assert_close(out.detach(), out_e, **TOL)
    params = (x_all, w) + ((b,) if use_bias else ())
    want = torch.autograd.grad(loss_e, params)
    got = torch.autograd.grad((out * g_c).sum(), params)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, **TOL)


@settings(max_examples=40, deadline=None)
@given(trajectory_sets(max_traj=8), st.sampled_from(["conv", "reference"]), st.sampled_from([4, 2, 1]),
       st.sampled_from(["silu", None]), st.booleans())
def test_whole_trees_equal_expanded(trajs, backend, K, activation, use_bias):
    f = build_forest(trajs)
    compare_with_expanded(f, build_layout(f), backend, K=K, activation=activation, use_bias=use_bias,
                          prebuilt_taps=use_bias)


@settings(max_examples=30, deadline=None)
@given(trajectory_sets(max_traj=8), st.data())
def test_subtree_with_context_equals_expanded(trajs, data):
    f = build_forest(trajs)
    producer = build_layout(f)
    roots = non_nested_roots(f, data, max_size=3)
    lay = build_layout(f, roots=roots, context=producer)
    for backend in ("conv", "reference"):
        compare_with_expanded(f, lay, backend)


@settings(max_examples=30, deadline=None)
@given(trajectory_sets(max_traj=8), st.data())
def test_taps_reading_a_table_equal_the_context_rows(trajs, data):
    """A consumer's conv reading its producer's exported rows through ``ConvTaps.reading_table``
    equals the conv over the assembled context rows, forward and every gradient, bitwise; the
    table rows no tap reads get no gradient."""
    f = build_forest(trajs)
    producer = build_layout(f)
    roots = non_nested_roots(f, data, max_size=3)
    lay = build_layout(f, roots=roots, context=producer)
    R, Rc, C = lay.num_rows, lay.num_context_rows, 3
    taps = build_conv_taps(lay, 4)
    hit = taps.taps[(taps.taps >= R) & (taps.taps < R + Rc)] - R
    reached = torch.unique(hit)
    extra = data.draw(st.integers(0, 3))            # table rows nobody reads, spread among the read ones
    n = int(reached.numel()) + extra
    order = torch.randperm(n, generator=torch.Generator().manual_seed(len(trajs)))
    position = torch.full((Rc,), -1, dtype=torch.int64)
    position[reached] = order[:reached.numel()]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(R, C, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(C, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    table = torch.randn(n, C, dtype=torch.float64, generator=gen, requires_grad=True)
    ctx = torch.randn(Rc, C, dtype=torch.float64, generator=gen)
    ctx[reached] = table.detach()[position[reached]]
    ctx.requires_grad_(True)
    g = torch.randn(R, C, dtype=torch.float64, generator=gen)
    want = path_conv(x, w, None, lay, context=ctx if Rc else None, taps=taps)
    got = path_conv(x, w, None, None, context=table if n else None, taps=taps.reading_table(position, n))
    assert torch.equal(got, want)
    gw = torch.autograd.grad((want * g).sum(), (x, w) + ((ctx,) if Rc else ()))
    gg = torch.autograd.grad((got * g).sum(), (x, w) + ((table,) if n else ()), allow_unused=True)
    assert torch.equal(gg[0], gw[0]) and torch.equal(gg[1], gw[1])
    if n:
        expect = torch.zeros_like(table)
        if reached.numel():
            expect[position[reached]] = gw[2][reached]
        assert torch.equal(gg[2] if gg[2] is not None else torch.zeros_like(table), expect)
    # every context row some tap reads needs a place in the table
    if reached.numel():
        bad = position.clone()
        bad[reached[0]] = -1
        with pytest.raises(ValueError, match="position is -1"):
            taps.reading_table(bad, n)
        with pytest.raises(ValueError, match="context"):
            path_conv(x, w, None, None, taps=taps.reading_table(position, n))


def test_single_token_segments_and_ends_inside():
    # chain of one-token segments: every token is a fork or an end
    f = build_forest([make_trajectory({"id": i, "tokens": [1, 2, 3, 4, 5][:i + 1] + [9]}) for i in range(5)]
                     + [make_trajectory({"id": "e", "tokens": [1, 2]})])
    lay = build_layout(f)
    assert int((torch.from_numpy(lay.seg_length) == 1).sum()) >= 5
    for backend in ("conv", "reference"):
        compare_with_expanded(f, lay, backend)
    # taps: row of token 4 reads 3, 2, 1; the root reads the zero pad row (index R)
    taps = build_conv_taps(lay)
    R = lay.num_rows
    r4 = int(torch.nonzero(lay.tokens == 4)[0])
    assert lay.tokens[taps.taps[r4]].tolist() == [3, 2, 1]
    assert taps.taps[0].tolist() == [R, R, R]


def test_fix_rows_are_the_rows_off_the_straight_line():
    """ConvTaps.fix_rows: exactly the rows whose K-1 taps are not the rows right above (or the pad
    row above row 0): a chain has none; a second tree's first K-1 rows and a fork's later child's
    first K-1 rows do; a row reading a context row does."""
    chain = build_layout(build_forest([make_trajectory({"id": "a", "tokens": [1, 2, 3, 4, 5]})]))
    assert build_conv_taps(chain).fix_rows.tolist() == []
    f = build_forest([make_trajectory({"id": "a", "tokens": [1, 2, 3, 4, 5, 6]}),
                      make_trajectory({"id": "b", "tokens": [1, 2, 7, 8, 9, 10]}),
                      make_trajectory({"id": "c", "tokens": [11, 12]})])
    lay = build_layout(f)
    taps = build_conv_taps(lay)
    tok = lay.tokens.tolist()
    # DFS preorder: 1 2 | 3 4 5 6 | 7 8 9 10 || 11 12 (children in either order)
    later_child = max(tok.index(3), tok.index(7))
    first_other_tree = tok.index(11)
    want = sorted(set(range(later_child, later_child + 3)) | {first_other_tree, first_other_tree + 1})
    assert taps.fix_rows.tolist() == want
    assert build_conv_taps(lay, 2).fix_rows.tolist() == [later_child, first_other_tree]
    assert build_conv_taps(lay, 1).fix_rows.tolist() == []
    sub = build_layout(f, roots=[int(np.flatnonzero(f.seg_parent >= 0)[-1])], context=lay)
    assert build_conv_taps(sub).fix_rows.tolist()[:1] == [0]      # the subtree root reads its context


@pytest.mark.parametrize("lens,K", [([5, 1, 2, 7], 4), ([3], 4), ([1, 1, 6], 2), ([4, 4], 1)])
def test_packed_sequences_equal_each_sequence(lens, K):
    """Expanded mode's conv: sequences packed back to back, rows described by their taps alone,
    equal each sequence's own causal conv (fwd and bwd)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(sum(lens), 3, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(3, K, dtype=torch.float64, generator=gen, requires_grad=True)
    taps = sequence_conv_taps(lens, K)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    # the first K-1 rows from each later sequence's start on would otherwise read the sequence before
    assert taps.fix_rows.tolist() == sorted({int(s) + j for s in starts[1:] for j in range(K - 1)
                                             if s + j < sum(lens)})
    out = path_conv(x, w, None, None, taps=taps)
    want = torch.cat([causal_conv(x[s:s + n], w, None, "silu") for s, n in zip(starts, lens)])
    torch.testing.assert_close(out, want, **TOL)
    g = torch.randn(out.shape, dtype=torch.float64, generator=gen)
    for a, b in zip(torch.autograd.grad((out * g).sum(), (x, w)), torch.autograd.grad((want * g).sum(), (x, w))):
        torch.testing.assert_close(a, b, **TOL)
    with pytest.raises(ValueError, match="taps"):
        path_conv(x, w, None, None)


def test_matches_transformers_kimi_linear_conv():
    """Our expanded oracle is Kimi-Linear's own causal_conv1d_fn (weight [C, K], SiLU)."""
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 5, dtype=torch.float64, generator=gen)
    w = torch.randn(5, 4, dtype=torch.float64, generator=gen)
    b = torch.randn(5, dtype=torch.float64, generator=gen)
    theirs = kimi.causal_conv1d_fn(x.T[None], w, b, activation="silu")[0].T
    torch.testing.assert_close(causal_conv(x, w, b, "silu"), theirs, **TOL)
    # and one chain of rows in compact form is that sequence
    prev = torch.arange(7) - 1
    torch.testing.assert_close(path_conv(x, w, b, prev), theirs, **TOL)


def test_gradcheck_tiny():
    f = build_forest([make_trajectory({"id": "a", "tokens": [1, 2, 3, 4]}),
                      make_trajectory({"id": "b", "tokens": [1, 2, 5]}), make_trajectory({"id": "c", "tokens": [1]})])
    producer = build_layout(f)
    lay = build_layout(f, roots=[int(np.flatnonzero(f.seg_parent >= 0)[-1])], context=producer)
    gen = torch.Generator().manual_seed(1)
    for L in (producer, lay):
        x = torch.randn(L.num_rows, 2, dtype=torch.float64, generator=gen, requires_grad=True)
        c = torch.randn(L.num_context_rows, 2, dtype=torch.float64, generator=gen, requires_grad=True)
        w = torch.randn(2, 4, dtype=torch.float64, generator=gen, requires_grad=True)
        b = torch.randn(2, dtype=torch.float64, generator=gen, requires_grad=True)
        for backend in ("conv", "reference"):
            fn = lambda x, c, w, b: path_conv(x, w, b, L, context=c if L.num_context_rows else None, backend=backend)
            assert torch.autograd.gradcheck(fn, (x, c, w, b))


def test_bad_input_names_the_argument():
    f = build_forest([make_trajectory({"id": "a", "tokens": [1, 2, 3]}), make_trajectory({"id": "b", "tokens": [1, 2, 4]})])
    lay = build_layout(f)
    x = torch.randn(lay.num_rows, 2)
    w = torch.randn(2, 4)
    with pytest.raises(ValueError, match="weight"):
        path_conv(x, torch.randn(3, 4), None, lay)
    with pytest.raises(ValueError, match="bias"):
        path_conv(x, w, torch.randn(3), lay)
    with pytest.raises(ValueError, match="prev"):
        path_conv(x, w, None, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="prev"):
        build_conv_taps(torch.tensor([0, 1, 2]))              # a row cannot precede itself
    with pytest.raises(ValueError, match="activation"):
        path_conv(x, w, None, lay, activation="gelu")
    with pytest.raises(ValueError, match="backend"):
        path_conv(x, w, None, lay, backend="fast")
    with pytest.raises(ValueError, match="taps"):
        path_conv(x, w, None, lay, taps=torch.zeros(lay.num_rows, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="taps"):
        path_conv(x, w, None, lay, taps=build_conv_taps(lay, 3))
    sub = build_layout(f, roots=[1], context=lay)
    with pytest.raises(ValueError, match="context"):
        path_conv(torch.randn(sub.num_rows, 2), w, None, sub)
    with pytest.raises(ValueError, match="context"):
        path_conv(torch.randn(sub.num_rows, 2), w, None, sub, context=torch.randn(sub.num_context_rows + 1, 2))


def test_row_order_conv_kernels_and_their_errors():
    """The torch kernel is the causal conv of the rows as one sequence; asking for fla off the GPU
    (or an unknown kernel) is refused by name."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(9, 3, dtype=torch.float64, generator=gen)
    w = torch.randn(3, 4, dtype=torch.float64, generator=gen)
    torch.testing.assert_close(row_order_conv(x, w, "torch"), causal_conv(x, w, None, None), **TOL)
    torch.testing.assert_close(row_order_conv(x, w), causal_conv(x, w, None, None), **TOL)   # auto on the CPU
    with pytest.raises(ValueError, match="fla"):
        row_order_conv(x, w, "fla")
    with pytest.raises(ValueError, match="kernel"):
        row_order_conv(x, w, "cuda")



def test_without_fla_the_cuda_conv_says_so_once(monkeypatch):
    """fla's conv kernel missing: the lookup (made for CUDA rows only) warns once per process, then is quiet."""
    import sys
    import warnings

    monkeypatch.setitem(sys.modules, "fla.modules.causal_conv1d.ops", None)  # cannot be imported
    _fla_causal_conv1d.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="fla-core is not installed"):
            assert _fla_causal_conv1d() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert _fla_causal_conv1d() is None
    finally:
        _fla_causal_conv1d.cache_clear()

FLA_CONV = torch.cuda.is_available() and _fla_causal_conv1d() is not None


@pytest.mark.skipif(not FLA_CONV, reason="needs CUDA and fla-core (the GPU kernel of row_order_conv)")
@pytest.mark.parametrize("R,C,K", [(1, 8, 4), (67, 40, 4), (4099, 4096, 4), (300, 96, 2)])
def test_fla_row_order_conv_equals_torch_kernel(R, C, K):
    """fla's Triton causal conv == torch's conv1d down the row order: output and both gradients
    (fp32, 1e-5 relative), and in bf16 within bf16 rounding."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    for dtype, tol in ((torch.float32, dict(rtol=1e-5, atol=1e-5)), (torch.bfloat16, dict(rtol=2e-2, atol=2e-2))):
        x = torch.randn(R, C, device="cuda", generator=gen).to(dtype).requires_grad_()
        w = torch.randn(C, K, device="cuda", generator=gen).to(dtype).requires_grad_()
        g = torch.randn(R, C, device="cuda", generator=gen).to(dtype)
        got = row_order_conv(x, w, "fla")
        want = row_order_conv(x, w, "torch")
        torch.testing.assert_close(got, want, **tol)
        for a, b in zip(torch.autograd.grad((got * g).sum(), (x, w)), torch.autograd.grad((want * g).sum(), (x, w))):
            torch.testing.assert_close(a.float(), b.float(), **(tol if a.shape != w.shape else
                                                                dict(rtol=tol["rtol"], atol=tol["atol"] * R)))


@pytest.mark.skipif(not FLA_CONV, reason="needs CUDA and fla-core (the GPU kernel of row_order_conv)")
def test_path_conv_on_the_gpu_equals_expanded():
    """On the GPU path_conv's conv backend (fla's kernel for the straight rows) equals each
    trajectory's own conv, whole trees and a subtree reading context rows (fp64 oracle, fp32 run)."""
    trajs = [make_trajectory({"id": i, "tokens": [1, 2, 3, 4, 5, 6][:3 + i % 4] + [20 + i, 30 + i, 40 + i]})
             for i in range(6)]
    f = build_forest(trajs)
    lay = build_layout(f)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(lay.num_rows, 64, dtype=torch.float64, generator=gen)
    w = torch.randn(64, 4, dtype=torch.float64, generator=gen)
    want = path_conv(x, w, None, lay, backend="reference")
    got = path_conv(x.float().cuda(), w.float().cuda(), None, lay.to("cuda"))
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5)
