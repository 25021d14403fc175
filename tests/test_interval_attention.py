"""The ``interval`` tree-attention backend (ops/interval_attention.py) against its definitions.

(a) CPU, always: the tile lists built from the intervals equal the brute-force classification of
    the dense mask (:func:`blocks_reference`), their transposes list the same tiles, full tiles come
    first, and the interval table reproduces the mask; on random interval visibilities, random trees,
    compaction layouts (keys with holes in their intervals) and layouts with context keys.
(b) The Triton kernels: forward and every input gradient equal the ``reference`` backend (fp64
    oracle of fp32 inputs) on random trees, compaction layouts, context keys, query blocks and
    rows that see nothing, GQA, MLA head dims (192/128, 96/64) and dims that are no power of two.
    On CUDA in this process (plus a bf16 run against the fp32 oracle); on the CPU under Triton's
    interpreter in a fresh process (``TRITON_INTERPRET=1`` is read when Triton is imported) when
    Triton is importable; skipped with the reason otherwise.
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_harts.layout import Visibility, build_layout
from megatron_harts.ops.interval_attention import (blocks_reference, build_interval_blocks, interval_attention,
                                                   interval_available)
from megatron_harts.ops.tree_attention import tree_attention
from megatron_harts.tree_data import build_forest
from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe
from test_compaction_layout import fixed_forest, trees_with_events
from test_forest import trajectory_sets
from test_layout import non_nested_roots
from test_tree_attention import random_visibility

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA = torch.cuda.is_available()


# ---------------------------------------------------------------------------
# (a) host side: tile lists
# ---------------------------------------------------------------------------

def full_mask(vis, ctx=None):
    m = vis.dense()
    return m if ctx is None else torch.cat([ctx.dense(), m], dim=1)


def check_blocks(vis, ctx=None, bm=16, bn=16):
    b = build_interval_blocks(vis, ctx, block_m=bm, block_n=bn)
    mask = full_mask(vis, ctx)
    R, K = mask.shape
    want = blocks_reference(mask, bm, bn)
    nq, nk = want.shape
    assert (b.num_queries, b.num_keys, b.num_query_blocks, b.num_key_blocks) == (R, K, nq, nk)
    got = np.zeros((nq, nk), dtype=np.int8)
    q_off, q_full, q_blk = (t.numpy() for t in (b.q_offsets, b.q_num_full, b.q_blocks))
    for i in range(nq):
        blocks = q_blk[q_off[i]:q_off[i + 1]]
        full, part = blocks[:q_full[i]], blocks[q_full[i]:]
        assert list(full) == sorted(full) and list(part) == sorted(part)
        got[i, full] = 2
        got[i, part] = 1
    np.testing.assert_array_equal(got, want)
    got_t = np.zeros((nk, nq), dtype=np.int8)
    k_off, k_full, k_blk = (t.numpy() for t in (b.k_offsets, b.k_num_full, b.k_blocks))
    for j in range(nk):
        blocks = k_blk[k_off[j]:k_off[j + 1]]
        got_t[j, blocks[:k_full[j]]] = 2
        got_t[j, blocks[k_full[j]:]] = 1
    np.testing.assert_array_equal(got_t, want.T)
    assert (b.num_full, b.num_partial) == (int((want == 2).sum()), int((want == 1).sum()))
    assert b.starts.shape[0] == nk * bn
    check_table(b.starts, b.ends, mask)
    assert b.pairs == int(mask.sum())
    return b


def check_table(starts, ends, mask):
    """The padded interval table ``[K_pad, M]`` (or ``[K_pad]``) reproduces the dense ``[R, K]`` mask;
    padded keys see nothing."""
    s, e = starts.long(), ends.long()
    if s.dim() == 1:
        s, e = s[:, None], e[:, None]
    R, K = mask.shape
    qi = torch.arange(R)[:, None, None]
    table = ((s[None] <= qi) & (qi < e[None])).any(-1)
    torch.testing.assert_close(table[:, :K], mask)
    assert not table[:, K:].any()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("bm,bn", [(16, 16), (32, 16), (16, 64)])
def test_blocks_of_random_intervals(seed, bm, bn):
    rng = np.random.default_rng(seed)
    R = int(rng.integers(1, 120))
    check_blocks(random_visibility(rng, R), bm=bm, bn=bn)
    check_blocks(random_visibility(rng, R, causal=False, num_keys=int(rng.integers(1, 90))), bm=bm, bn=bn)


def swe(seed, compaction="none", max_tokens=160, budget=64):
    """A small SWE-like rollout tree (2 samples, <= 3 leaves each; 300-600 rows)."""
    cfg = dict(num_tasks=1, samples_per_task=2, max_leaves=3, prompt_median=30, action_median=8,
               observation_median=12, min_turns=3, max_turns=12, max_tokens=max_tokens, seed=seed,
               compaction=compaction)
    if compaction != "none":
        cfg.update(context_budget=budget, keep_prefix=8, keep_last=16, evict_chunk=16, summary_tokens=8)
    return build_forest(synthesize_swe(SweConfig(**cfg)))


@pytest.mark.parametrize("compaction", ["none", "sliding-window", "markovian", "summary"])
def test_blocks_of_synthetic_layouts(compaction):
    f = swe(3, compaction)
    lay = build_layout(f)
    assert compaction == "none" or lay.num_events > 0
    b = check_blocks(lay.visibility)
    assert b.num_full > 0 and b.num_partial > 0
    check_blocks(lay.visibility, bm=32, bn=16)
    # a consumer subtree: context keys first on the key axis
    child = int(np.flatnonzero(f.seg_parent >= 0)[0])
    sub = build_layout(f, roots=[child], context=lay)
    assert sub.num_context_rows > 0
    check_blocks(sub.visibility, sub.context_visibility)


@settings(max_examples=25, deadline=None)
@given(trees_with_events(max_len=40, vocab=2), st.data())
def test_blocks_of_compaction_trees(trajs, data):
    f = build_forest(trajs)
    lay = build_layout(f)
    check_blocks(lay.visibility)
    roots = non_nested_roots(f, data, max_size=3)
    sub = build_layout(f, roots=roots, context=lay)
    check_blocks(sub.visibility, sub.context_visibility if sub.num_context_rows else None)


@settings(max_examples=25, deadline=None)
@given(trajectory_sets(max_traj=6))
def test_blocks_of_random_trees(trajs):
    check_blocks(build_layout(build_forest(trajs)).visibility)


def test_block_sizes_and_availability_are_checked():
    vis = random_visibility(np.random.default_rng(0), 20)
    for bad in (8, 48, 0, 16.0):
        with pytest.raises(ValueError, match="block_m must be a power of two"):
            build_interval_blocks(vis, block_m=bad)
    q = torch.zeros(20, 1, 16)
    reason = interval_available("cpu")
    if reason is not None:          # no Triton, or no interpreter: one clear error, no fallback
        with pytest.raises(ValueError, match="backend 'interval': .*use backend"):
            tree_attention(q, q, q, vis, backend="interval")
    b = build_interval_blocks(vis)
    if reason is None:
        with pytest.raises(ValueError, match=r"interval blocks are for \(queries, keys\) = \(20, 20\)"):
            interval_attention(q[:10], q[:10], q[:10], b)


# ---------------------------------------------------------------------------
# (b) the kernels against the reference
# ---------------------------------------------------------------------------

def dense_oracle(q, k, v, mask, scale):
    """fp64 softmax attention under ``mask``; a row that sees nothing gets 0 (the kernels' rule)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    s = s.masked_fill(~mask, -1e300)
    p = torch.softmax(s, -1) * mask.any(-1, keepdim=True)
    return torch.einsum("hqk,khd->qhd", p, v)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def run_case(vis, ctx, device, H, Hk, dqk, dv, block, seed=0, dtype=torch.float32, tol=1e-5):
    """Kernel vs fp64 oracle: output and gradients of q, k, v (and context k, v); returns errors."""
    R = vis.num_queries
    Rc = ctx.num_keys if ctx is not None else 0
    gen = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    q, k, v, ck, cv = make(R, H, dqk), make(vis.num_keys, Hk, dqk), make(vis.num_keys, Hk, dv), \
        make(Rc, Hk, dqk), make(Rc, Hk, dv)
    g = make(R, H, dv)
    scale = dqk ** -0.5
    ref_in = [t.clone().requires_grad_() for t in (q, k, v, ck, cv)]
    if vis.causal:           # the project's definition: tree_attention's reference backend
        ctx_kv = (ref_in[3], ref_in[4]) if Rc else None
        ref = tree_attention(ref_in[0], ref_in[1], ref_in[2], vis, scale, backend="reference", context_kv=ctx_kv,
                             context_visibility=ctx)
    else:
        ref = dense_oracle(ref_in[0], torch.cat([ref_in[3], ref_in[1]]), torch.cat([ref_in[4], ref_in[2]]),
                           full_mask(vis, ctx), scale)
    ref_grads = torch.autograd.grad(ref, ref_in, g, allow_unused=True)
    ins = [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v, ck, cv)]
    blocks = build_interval_blocks(vis, ctx, block_m=block, block_n=block, device=device)
    if vis.causal:
        out = tree_attention(ins[0], ins[1], ins[2], vis, scale, backend="interval", interval_blocks=blocks,
                             context_kv=(ins[3], ins[4]) if Rc else None, context_visibility=ctx)
    else:
        out = interval_attention(ins[0], torch.cat([ins[3], ins[1]]), torch.cat([ins[4], ins[2]]), blocks, scale)
    grads = torch.autograd.grad(out, ins, g.to(device=device, dtype=dtype), allow_unused=True)
    errs = {"out": rel(out.detach().cpu(), ref.detach())}
    for name, a, b in zip(("dq", "dk", "dv", "dck", "dcv"), grads, ref_grads):
        if b is None or b.numel() == 0:
            continue
        errs[name] = rel(a.cpu(), b)
    assert max(errs.values()) < tol, errs
    return errs


def empty_rows_visibility():
    """Non-causal: 100 query rows x 70 keys; keys 0-19 see nothing, the rest see rows in [0, 40) or
    [70, 90) only: query blocks 40-69 and 90-99 visit no tile, key block 0 has no query block."""
    rng = np.random.default_rng(7)
    offsets, starts, ends = [0], [], []
    for key in range(70):
        ivs = [] if key < 20 else [(int(rng.integers(0, 20)), int(rng.integers(20, 41))), (70, int(rng.integers(71, 91)))]
        for a, b in ivs:
            starts.append(a)
            ends.append(b)
        offsets.append(len(starts))
    t = lambda x: torch.tensor(x, dtype=torch.int64)
    return Visibility(t(offsets), t(starts), t(ends), 100, causal=False).validate()


def kernel_cases(device, block=16, big_dims=True):
    """Every kernel case (run in this process on CUDA, or under the interpreter)."""
    errs = {}
    f = swe(1)
    lay = build_layout(f)
    child = int(np.flatnonzero(f.seg_parent >= 0)[0])
    sub = build_layout(f, roots=[child], context=lay)
    fc = swe(2, "sliding-window")
    lay_c = build_layout(fc)
    child_c = int(np.flatnonzero(fc.seg_parent >= 0)[-1])
    sub_c = build_layout(fc, roots=[child_c], context=lay_c)
    fixed = build_layout(fixed_forest())
    cases = {
        "tree": (lay.visibility, None, 2, 1, 20, 12),
        "tree_context": (sub.visibility, sub.context_visibility, 2, 2, 16, 16),
        "compaction": (lay_c.visibility, None, 4, 2, 24, 8),
        "compaction_context": (sub_c.visibility, sub_c.context_visibility, 2, 1, 32, 16),
        "compaction_fixed": (fixed.visibility, None, 1, 1, 16, 16),
        "random_intervals": (random_visibility(np.random.default_rng(5), 90), None, 2, 1, 16, 16),
        "empty_rows": (empty_rows_visibility(), None, 2, 1, 16, 16),
    }
    if big_dims:
        cases["mla_192_128"] = (lay_c.visibility, None, 2, 2, 192, 128)
        cases["mla_96_64"] = (sub_c.visibility, sub_c.context_visibility, 2, 1, 96, 64)
    assert sub.num_context_rows and sub_c.num_context_rows and lay_c.num_events and fixed.num_events
    for name, (vis, ctx, H, Hk, dqk, dv) in cases.items():
        errs[name] = run_case(vis, ctx, device, H, Hk, dqk, dv, block)
    return errs


@pytest.mark.skipif(not CUDA, reason="needs CUDA (the CPU runs the interpreter test)")
@pytest.mark.parametrize("block", [16, 64])
def test_kernels_equal_reference_cuda(block):
    pytest.importorskip("triton")
    kernel_cases(torch.device("cuda"), block=block)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernels_bf16_close_to_fp32_oracle_cuda():
    pytest.importorskip("triton")
    lay = build_layout(swe(4, "markovian", max_tokens=2000, budget=512))
    for dims in ((192, 128), (96, 64)):
        run_case(lay.visibility, None, torch.device("cuda"), 4, 4, *dims, block=64, dtype=torch.bfloat16, tol=3e-2)


_INTERPRETER_CASE = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r}); sys.path.insert(0, os.path.join({root!r}, "tests"))
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch
    from test_interval_attention import kernel_cases
    errs = kernel_cases(torch.device("cpu"), block=16, big_dims={big!r})
    print(errs)
    print("ok")
""")


def test_kernels_under_triton_interpreter():
    """CPU: the kernels under TRITON_INTERPRET=1, in a fresh process (the mode is fixed at import)."""
    pytest.importorskip("triton")
    if CUDA:
        pytest.skip("the CUDA tests run the compiled kernels")
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = _INTERPRETER_CASE.format(root=ROOT, big=True)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout + res.stderr
