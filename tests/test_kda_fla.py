"""The fla GPU backend of the KDA executor (ops/kda_fla.py) and its state-gradient kernel.

GPU tests need fla-core 0.6.0, Triton and CUDA and skip without them (CI is CPU-only):
scripts/device_check_kda_fla.sh runs them on the GPU machine.  What they hold:

(a) the Triton state-gradient kernel (ops/kda_state_grad.py) == its torch reference, with
    and without injected boundary gradients, varlen; and == fla's own recurrence
    (``chunk_gated_delta_rule_bwd_dhu``) when only the final states get gradients;
(b) backend "fla" == backend "reference" through tree_kda on random forests (replay on and
    off, producer exports after arbitrary rows, a consumer layout from external states),
    forward and every input gradient within 1e-4 relative in fp32;
(c) one call exporting a state inside a sequence == two calls split there (first exports its
    final state, second starts from it): outputs and gradients;
(d) bf16: finite, tree mode as close to the fp32 oracle as expanded mode (figures reported).

fp32 agreement needs ``TRITON_F32_DEFAULT=ieee`` before any Triton kernel compiles (Triton's
default computes fp32 dot products in tf32); the ``gpu`` fixture sets it for this module's tests
when unset.  Figures
go to the JSON-lines file named by ``KDA_FLA_REPORT`` when set.  CPU-only: the kernel test
also runs under Triton's interpreter when Triton is installed (skipped otherwise), and the
argument checks run everywhere.
"""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from megatron_harts.layout import build_layout  # noqa: E402
from megatron_harts.ops.kda_fla import CHUNK, kda_fla, kda_fla_varlen  # noqa: E402
from megatron_harts.ops.triton_tuning import limit_autotuning  # noqa: E402
from megatron_harts.ops.tree_kda import (KdaExternal, build_kda_schedule, consumer_kda_sources,  # noqa: E402
                                         get_kda_backend, plan_subtree_calls, tree_kda)
from megatron_harts.planner.calls import plan_calls  # noqa: E402
from megatron_harts.tree_data import build_forest, make_trajectory  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# one (H, K, V) per dtype: fla autotunes every kernel per shape, so fewer shapes compile less
FP32_SHAPE = (2, 128, 128)
BF16_SHAPE = (16, 128, 128)   # the shape benchmarks/bench_kda_backends.py times


def _limit_autotuning():
    """``KDA_FLA_TEST_MAX_CONFIGS=n``: every Triton autotuner tries at most n configs
    (ops/triton_tuning.py).  Accuracy does not depend on the config; compile time does (fla tunes ~150)."""
    n = int(os.environ.get("KDA_FLA_TEST_MAX_CONFIGS", "0"))
    if n > 0:
        limit_autotuning(n)


@pytest.fixture(scope="module")
def gpu():
    pytest.importorskip("fla")
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from megatron_harts.ops.kda_fla import fla_available
    if not fla_available():
        pytest.skip("fla-core 0.6.0 is not importable here")
    get_kda_backend("fla")
    _limit_autotuning()
    with pytest.MonkeyPatch.context() as mp:
        if not os.environ.get("TRITON_F32_DEFAULT"):
            mp.setenv("TRITON_F32_DEFAULT", "ieee")
        yield torch.device("cuda")


def report(name, **figures):
    path = os.environ.get("KDA_FLA_REPORT")
    line = json.dumps({"test": name, **figures})
    print(line)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------
# (a) the state-gradient kernel
# ---------------------------------------------------------------------------

def state_grad_case(lengths, H, K, V, device, dtype=torch.float32, seed=0, inject=True, want_dh0=True):
    """Random inputs of kda_state_grad in fla's varlen layout; injected gradients at some chunk ends."""
    gen = torch.Generator().manual_seed(seed)
    L = np.asarray(lengths)
    nch = (L + CHUNK - 1) // CHUNK
    cu = torch.as_tensor(np.concatenate([[0], np.cumsum(L)]), device=device)
    co = torch.as_tensor(np.concatenate([[0], np.cumsum(nch)]), device=device)
    T, NT = int(L.sum()), int(nch.sum())
    mk = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    q, k, w = mk(1, T, H, K) * 0.3, mk(1, T, H, K) * 0.3, mk(1, T, H, K) * 0.3
    gk = (-torch.rand(1, T, H, K, generator=gen) * 2).to(device)   # in-chunk cumulative log2 decay (only its
    do, dv = mk(1, T, H, V), mk(1, T, H, V)                          # chunk-last values matter)
    inj_map = torch.full((NT,), -1, dtype=torch.int32)
    rows = 0
    if inject:
        pick = np.random.default_rng(seed).permutation(NT)[: max(1, NT // 2)]
        for j, c in enumerate(sorted(pick.tolist())):
            inj_map[c] = j
        rows = len(pick)
        inj_map[int(co[1]) - 1] = 0          # the first sequence's final state shares row 0
    inj = torch.randn(rows, H, K, V, generator=gen).to(device)
    return (q, k, w, gk, do, dv, inj, inj_map.to(device), cu, co), dict(scale=K ** -0.5, num_chunks=NT,
                                                                         want_dh0=want_dh0)


@pytest.mark.parametrize("inject", [True, False])
@pytest.mark.parametrize("H,K,V", [(3, 128, 128), (2, 64, 32)])
def test_state_grad_kernel_equals_reference(gpu, inject, H, K, V):
    from megatron_harts.ops.kda_state_grad import kda_state_grad
    args, kw = state_grad_case([1, 63, 64, 65, 200, 128, 7], H, K, V, gpu, inject=inject, seed=H + K)
    got = kda_state_grad(*args, **kw, impl="triton")
    ref = kda_state_grad(*args, **kw, impl="reference")
    errs = {n: rel(a, b) for n, a, b in zip(("dh", "dh0", "dv2"), got, ref)}
    report("state_grad_kernel_fp32", H=H, K=K, V=V, inject=inject, **errs)
    assert all(e < 1e-5 for e in errs.values()), errs
    # without dh0 the other outputs are the same
    got2 = kda_state_grad(*args, **dict(kw, want_dh0=False), impl="triton")
    assert got2[1] is None and torch.equal(got2[0], got[0]) and torch.equal(got2[2], got[2])


def test_state_grad_kernel_bf16_close_to_reference(gpu):
    from megatron_harts.ops.kda_state_grad import kda_state_grad
    args, kw = state_grad_case([100, 64, 300], *BF16_SHAPE, gpu, dtype=torch.bfloat16, seed=3)
    got = kda_state_grad(*args, **kw, impl="triton")
    ref = kda_state_grad(*args, **kw, impl="reference")
    errs = {n: rel(a, b) for n, a, b in zip(("dh", "dh0", "dv2"), got, ref)}
    report("state_grad_kernel_bf16", **errs)
    assert all(torch.isfinite(x).all() for x in got)
    assert all(e < 3e-2 for e in errs.values()), errs


def test_state_grad_kernel_equals_fla_recurrence(gpu):
    """No inner injections, final-state gradients only: fla's own chunk_gated_delta_rule_bwd_dhu."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu
    from megatron_harts.ops.kda_state_grad import kda_state_grad
    H, K, V = FP32_SHAPE
    lengths = [70, 64, 257, 1]
    args, kw = state_grad_case(lengths, H, K, V, gpu, inject=False, seed=11)
    q, k, w, gk, do, dv, _, inj_map, cu, co = args
    dht = torch.randn(len(lengths), H, K, V, generator=torch.Generator().manual_seed(5)).to(gpu)
    inj_map = inj_map.clone()
    inj_map[co[1:] - 1] = torch.arange(len(lengths), dtype=torch.int32, device=gpu)
    dh, dh0, dv2 = kda_state_grad(q, k, w, gk, do, dv, dht, inj_map, cu, co, **kw)
    h0 = torch.zeros(len(lengths), H, K, V, device=gpu)
    dh_f, dh0_f, dv2_f = chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, do=do, dv=dv, gk=gk, h0=h0, dht=dht,
                                                        scale=kw["scale"], cu_seqlens=cu, chunk_size=CHUNK)
    errs = {"dh": rel(dh, dh_f), "dh0": rel(dh0, dh0_f), "dv2": rel(dv2, dv2_f)}
    report("state_grad_kernel_vs_fla_dhu", **errs)
    assert all(e < 1e-5 for e in errs.values()), errs


_INTERPRETER_CASE = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, {root!r}); sys.path.insert(0, os.path.join({root!r}, "tests"))
    import torch
    from test_kda_fla import state_grad_case, rel
    from megatron_harts.ops.kda_state_grad import kda_state_grad
    for inject in (True, False):
        args, kw = state_grad_case([5, 64, 70], 2, 32, 16, torch.device("cpu"), inject=inject)
        got = kda_state_grad(*args, **kw, impl="triton")
        ref = kda_state_grad(*args, **kw, impl="reference")
        errs = [rel(a, b) for a, b in zip(got, ref)]
        assert max(errs) < 1e-5, errs
    print("ok")
""")


def test_state_grad_kernel_under_triton_interpreter():
    """CPU: the kernel under TRITON_INTERPRET=1 (a fresh process: the mode is fixed at import)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the GPU tests run the compiled kernel")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", _INTERPRETER_CASE.format(root=ROOT)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout + res.stderr


# ---------------------------------------------------------------------------
# (b) backend fla == backend reference through tree_kda
# ---------------------------------------------------------------------------

def random_forest(seed, n_traj=7, base_len=330):
    """Trajectories sharing prefixes of a base sequence, cut before, at and after chunk boundaries."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 1000, base_len).tolist()
    cuts = [0, 1, 63, 64, 65, 100, 128, 129, 191, 200, 256, 300]
    trajs = []
    for i in range(n_traj):
        cut = int(rng.choice(cuts))
        tail = int(rng.integers(0 if cut else 1, 150))
        toks = base[:cut] + rng.integers(1000, 5000, tail).tolist()
        trajs.append(make_trajectory({"id": i, "tokens": toks, "group": "ab"[i % 2]}))
    return build_forest(trajs)


def row_inputs(R, H, K, V, device, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(R, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(R, H, K, generator=gen), dim=-1)
    v = torch.randn(R, H, V, generator=gen)
    g = -torch.rand(R, H, K, generator=gen) * 0.7
    beta = torch.rand(R, H, generator=gen)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, g, beta)]


def tree_run(leaves, sched, backend, weights):
    o, states = tree_kda(*leaves, sched, backend=backend, return_exports=True)
    wo, ws = weights
    loss = (wo * o.float()).sum() + (ws * states).sum()
    grads = torch.autograd.grad(loss, leaves)
    return o, states, grads


@pytest.mark.parametrize("replay", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_fla_equals_reference_fp32(gpu, replay, seed):
    H, K, V = FP32_SHAPE
    forest = random_forest(seed)
    R = forest.num_rows
    plan = plan_calls(forest.seg_parent, forest.seg_start, forest.seg_length, CHUNK, replay=replay)
    rng = np.random.default_rng(seed + 10)
    export_rows = sorted(rng.choice(R, size=min(R, 6), replace=False).tolist())
    sched = build_kda_schedule(forest.seg_parent, forest.seg_start, forest.seg_length, forest.seg_row, plan,
                               export_rows=export_rows, device=gpu)
    gen = torch.Generator().manual_seed(seed + 20)
    weights = (torch.randn(R, H, V, generator=gen).to(gpu),
               torch.randn(len(export_rows), H, K, V, generator=gen).to(gpu))
    base = row_inputs(R, H, K, V, gpu, seed=seed)
    ref = tree_run([x.clone().requires_grad_() for x in base], sched, "reference", weights)
    got = tree_run([x.clone().requires_grad_() for x in base], sched, "fla", weights)
    errs = {"o": rel(got[0], ref[0]), "states": rel(got[1], ref[1])}
    errs.update({f"d{n}": rel(a, b) for n, a, b in zip(("q", "k", "v", "g", "beta"), got[2], ref[2])})
    offsets = torch.cat([c.export_offset for c in sched.calls]).cpu()
    report("tree_fla_vs_reference_fp32", seed=seed, replay=replay, rows=R, calls=len(sched.calls),
           unaligned_exports=int((offsets % CHUNK != 0).sum()), **errs)
    assert all(e < 1e-4 for e in errs.values()), errs


@pytest.mark.parametrize("call_plan", ["per-depth", "node-wise"])
def test_ablation_plans_fla_equal_reference_fp32(gpu, call_plan):
    """The --tree-kda-call-plan ablations: sequences start at unaligned fork positions from the final
    state of their parent's sequence (an export at a sequence's end), no replay."""
    from megatron_harts.planner.baselines import BASELINE_PLANS
    H, K, V = FP32_SHAPE
    forest = random_forest(3)
    R = forest.num_rows
    plan = BASELINE_PLANS[call_plan](forest.seg_parent, forest.seg_start, forest.seg_length, CHUNK)
    sched = build_kda_schedule(forest.seg_parent, forest.seg_start, forest.seg_length, forest.seg_row, plan,
                               device=gpu)
    gen = torch.Generator().manual_seed(30)
    weights = (torch.randn(R, H, V, generator=gen).to(gpu), torch.zeros(0, H, K, V, device=gpu))
    base = row_inputs(R, H, K, V, gpu, seed=3)
    ref = tree_run([x.clone().requires_grad_() for x in base], sched, "reference", weights)
    got = tree_run([x.clone().requires_grad_() for x in base], sched, "fla", weights)
    errs = {"o": rel(got[0], ref[0])}
    errs.update({f"d{n}": rel(a, b) for n, a, b in zip(("q", "k", "v", "g", "beta"), got[2], ref[2])})
    offsets = torch.cat([c.export_offset for c in sched.calls]).cpu()
    report("ablation_plan_fla_vs_reference_fp32", call_plan=call_plan, rows=R, calls=len(sched.calls),
           unaligned_exports=int((offsets % CHUNK != 0).sum()), **errs)
    assert len(sched.calls) > 1 and int((offsets % CHUNK != 0).sum()) > 0
    assert all(e < 1e-4 for e in errs.values()), errs


def test_consumer_window_fla_equals_reference_fp32(gpu):
    """A consumer layout from a producer's exported states (external initial states): their gradients too."""
    H, K, V = FP32_SHAPE
    forest = random_forest(5, n_traj=6)
    roots = []   # non-nested subtree roots starting past the first chunk (so they read producer states)
    for s in range(forest.num_segments):
        a = int(forest.seg_parent[s])
        while a >= 0 and a not in roots:
            a = int(forest.seg_parent[a])
        if a < 0 and int(forest.seg_parent[s]) >= 0 and int(forest.seg_start[s]) >= CHUNK and len(roots) < 3:
            roots.append(s)
    producer = build_layout(forest)
    consumer = build_layout(forest, roots=roots, context=producer)
    sp = plan_subtree_calls(consumer.seg_parent, consumer.seg_start, consumer.seg_length, consumer.seg_row, CHUNK)
    csched = build_kda_schedule(consumer.seg_parent, consumer.seg_start, consumer.seg_length, consumer.seg_row, sp,
                                device=gpu)
    state_rows, replay_rows = consumer_kda_sources(consumer, csched)
    pplan = plan_calls(producer.seg_parent, producer.seg_start, producer.seg_length, CHUNK)
    psched = build_kda_schedule(producer.seg_parent, producer.seg_start, producer.seg_length, producer.seg_row,
                                pplan, export_rows=state_rows, device=gpu)
    base = row_inputs(forest.num_rows, H, K, V, gpu, seed=7)
    prow, crow = producer.forest_rows.to(gpu), consumer.forest_rows.to(gpu)
    wc = torch.randn(len(crow), H, V, generator=torch.Generator().manual_seed(8)).to(gpu)
    rrows = torch.as_tensor(replay_rows, device=gpu)

    def run(backend):
        leaves = [x.clone().requires_grad_() for x in base]
        pin = [x[prow] for x in leaves]
        o_p, states = tree_kda(*pin, psched, backend=backend, return_exports=True)
        ext_states = states.detach().requires_grad_()
        ext = KdaExternal(ext_states, *(x[rrows] for x in pin))
        o_c = tree_kda(*[x[crow] for x in leaves], csched, backend=backend, external=ext)
        loss = (wc * o_c.float()).sum()
        grads = torch.autograd.grad(loss, leaves + [ext_states])
        return o_c, grads

    o_ref, g_ref = run("reference")
    o_got, g_got = run("fla")
    errs = {"o": rel(o_got, o_ref)}
    errs.update({f"d{n}": rel(a, b) for n, a, b in zip(("q", "k", "v", "g", "beta", "initial_states"), g_got, g_ref)})
    report("consumer_window_fla_vs_reference_fp32", external_states=csched.num_external_states, **errs)
    assert csched.num_external_states > 0
    assert all(e < 1e-4 for e in errs.values()), errs


def test_padded_equals_varlen(gpu):
    """The padded form (every sequence runs all T positions, zero padded) and the varlen form on
    the valid tokens only: same outputs at valid positions, same states."""
    (H, K, V), N, T = FP32_SHAPE, 3, 200
    lens = [200, 77, 129]
    gen = torch.Generator().manual_seed(4)
    x = [t.view(N, T, *t.shape[1:]) for t in row_inputs(N * T, H, K, V, torch.device("cpu"), seed=4)]
    for n, L in enumerate(lens):
        for t in x:
            t[n, L:] = 0
    x = [t.to(gpu) for t in x]
    h0 = torch.randn(N, H, K, V, generator=gen).to(gpu)
    kw = dict(chunk_size=CHUNK, initial_state=h0, state_index=[0, 1, 2, 2], state_offset=[128, 77, 64, 100])
    o1, s1 = kda_fla(*x, **kw)
    o2, s2 = kda_fla_varlen(*(torch.cat([t[n, :L] for n, L in enumerate(lens)]) for t in x), lens, **kw)
    start = 0
    for n, L in enumerate(lens):
        assert rel(o1[n, :L], o2[start:start + L]) < 1e-5
        start += L
    assert rel(s1, s2) < 1e-5


# ---------------------------------------------------------------------------
# (c) one call with an exported state == a split computation
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("cut", [128, 100])
def test_export_equals_split_calls(gpu, cut):
    """Sequences computed as [0, cut) then [cut, L) from the first part's final state, vs one call
    exporting the state at cut: same outputs, states and gradients (cut aligned: same chunks;
    unaligned: chunks differ, equal to fp32 rounding)."""
    H, K, V = FP32_SHAPE
    lens = [300, 250]
    N, T = len(lens), max(lens)
    base = [t.view(N, T, *t.shape[1:]) for t in row_inputs(N * T, H, K, V, gpu, seed=9)]
    h0 = torch.randn(N, H, K, V, generator=torch.Generator().manual_seed(3)).to(gpu)
    gen = torch.Generator().manual_seed(12)
    wo = torch.randn(sum(lens), H, V, generator=gen).to(gpu)
    ws = torch.randn(N, H, K, V, generator=gen).to(gpu)

    def pack(t, lo, his):
        """Positions [lo, hi_n) of every padded sequence n, packed back to back."""
        return torch.cat([t[n, lo:hi] for n, hi in enumerate(his)])

    def single():
        leaves = [t.clone().requires_grad_() for t in base + [h0]]
        o, s = kda_fla_varlen(*(pack(t, 0, lens) for t in leaves[:5]), lens, chunk_size=CHUNK,
                              initial_state=leaves[5], state_index=[0, 1], state_offset=[cut, cut])
        return o, s, leaves

    def split():
        leaves = [t.clone().requires_grad_() for t in base + [h0]]
        o1, s = kda_fla_varlen(*(pack(t, 0, [cut] * N) for t in leaves[:5]), [cut] * N, chunk_size=CHUNK,
                               initial_state=leaves[5], state_index=[0, 1], state_offset=[cut, cut])
        rest = [n - cut for n in lens]
        o2, _ = kda_fla_varlen(*(pack(t[:, cut:], 0, rest) for t in leaves[:5]), rest, chunk_size=CHUNK,
                               initial_state=s)
        o1s, o2s = o1.split([cut] * N), o2.split(rest)
        return torch.cat([x for n in range(N) for x in (o1s[n], o2s[n])]), s, leaves

    res = {}
    for name, fn in (("single", single), ("split", split)):
        o, s, leaves = fn()
        loss = (wo * o).sum() + (ws * s).sum()
        res[name] = (o, s, torch.autograd.grad(loss, leaves))
    (o_a, s_a, g_a), (o_b, s_b, g_b) = res["single"], res["split"]
    errs = {"o": rel(o_a, o_b), "state": rel(s_a, s_b)}
    errs.update({f"d{n}": rel(a, b) for n, a, b in zip(("q", "k", "v", "g", "beta", "h0"), g_a, g_b)})
    report("export_vs_split", cut=cut, **errs)
    # aligned: the same chunks, the same operations (measured 0); unaligned: the second part's
    # chunks start elsewhere, fp32 rounding over 200 more tokens (measured up to 2.6e-5 on an
    # H200), held to the fp32 bound of the issue (1e-4 relative)
    tol = 1e-6 if cut % CHUNK == 0 else 1e-4
    assert all(e < tol for e in errs.values()), errs


def test_distinct_initial_states_equal_per_sequence(gpu):
    """``initial_state_index`` (sequences forking from one state get it once): the outputs, states and
    input gradients of the per-sequence states, the shared state's gradient their sum, an export
    inside a chunk read from the right state, and less kept for backward."""
    H, K, V = FP32_SHAPE
    lens, index = [200, 77, 129, 64], [1, 0, 1, 1]
    x = row_inputs(sum(lens), H, K, V, gpu, seed=6)
    distinct = torch.randn(2, H, K, V, generator=torch.Generator().manual_seed(6)).to(gpu)
    kw = dict(chunk_size=CHUNK, state_index=[0, 2, 3, 1], state_offset=[128, 100, 64, 77])

    def run(h0, idx):
        leaves = [t.clone().requires_grad_() for t in x + [h0]]
        saved = []

        def pack(t):
            saved.append(t.numel() * t.element_size())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            o, st = kda_fla_varlen(*leaves[:5], lens, initial_state=leaves[5], initial_state_index=idx, **kw)
        grads = torch.autograd.grad(o.square().sum() + st.sum(), leaves)
        return o, st, grads, sum(saved)

    o1, s1, g1, kept1 = run(distinct, index)
    o2, s2, g2, kept2 = run(distinct[index], None)
    errs = {"o": rel(o1, o2), "states": rel(s1, s2)}
    errs.update({f"d{n}": rel(a, b) for n, a, b in zip(("q", "k", "v", "g", "beta"), g1[:5], g2[:5])})
    errs["dh0"] = rel(g1[5], torch.zeros_like(distinct).index_add_(0, torch.tensor(index, device=gpu), g2[5]))
    report("distinct_initial_states", kept_bytes=kept1, per_sequence_bytes=kept2, **errs)
    assert all(e < 1e-5 for e in errs.values()), errs
    assert kept2 - kept1 == 2 * H * K * V * 4          # two of the four states not kept


# ---------------------------------------------------------------------------
# (d) bf16
# ---------------------------------------------------------------------------

def test_bf16_tree_as_close_as_expanded(gpu):
    """bf16 tree mode (fla) vs the fp32 oracle, next to bf16 expanded mode (fla) vs the same oracle."""
    H, K, V = BF16_SHAPE
    forest = random_forest(21, n_traj=10, base_len=700)
    R = forest.num_rows
    plan = plan_calls(forest.seg_parent, forest.seg_start, forest.seg_length, CHUNK)
    sched = build_kda_schedule(forest.seg_parent, forest.seg_start, forest.seg_length, forest.seg_row, plan,
                               device=gpu)
    base16 = row_inputs(R, H, K, V, gpu, dtype=torch.bfloat16, seed=21)
    base32 = [x.float() for x in base16]
    trajs = [torch.as_tensor(np.asarray(forest.trajectory_rows(t)), device=gpu)
             for t in range(forest.num_trajectories)]
    lens = torch.tensor([len(r) for r in trajs])
    wo = torch.randn(sum(len(r) for r in trajs), H, V, generator=torch.Generator().manual_seed(1)).to(gpu)
    flat_rows = torch.cat(trajs)

    def expanded(leaves, backend):
        """Every trajectory on its own: one varlen call over all of them (what expanded training runs)."""
        return get_kda_backend(backend)(*(x[flat_rows] for x in leaves), lens, chunk_size=CHUNK)[0]

    def tree(leaves, backend):
        return tree_kda(*leaves, sched, backend=backend)[flat_rows]

    def run(fn, base, backend):
        leaves = [x.clone().requires_grad_() for x in base]
        o = fn(leaves, backend)
        grads = torch.autograd.grad((wo * o.float()).sum(), leaves)
        return [o] + list(grads)

    oracle = run(tree, base32, "reference")
    tree16 = run(tree, base16, "fla")
    exp16 = run(expanded, base16, "fla")
    exp16b = run(expanded, base16, "fla")
    names = ("o", "dq", "dk", "dv", "dg", "dbeta")
    figs = {}
    for n, a, b, c, d in zip(names, tree16, exp16, oracle, exp16b):
        assert torch.isfinite(a).all(), n
        figs[n] = {"tree_bf16": rel(a, c), "expanded_bf16": rel(b, c), "expanded_rerun": rel(d, b),
                   "tree_vs_expanded": rel(a, b)}
    report("bf16_tree_vs_expanded", rows=R, expanded_tokens=int(lens.sum()), calls=len(sched.calls), **figs)
    for n, f in figs.items():
        assert f["tree_bf16"] <= 1.25 * f["expanded_bf16"] + 1e-3, (n, f)


def test_fast_launches_equal_the_autotuners_path_bitwise(gpu):
    """ops/triton_launch.py: with the fast path installed (``_fla`` does it) a tuned key launches without
    the autotuners; outputs, exported states and every gradient are bitwise those of the full path."""
    from megatron_harts.ops import triton_launch
    H, K, V = BF16_SHAPE
    lens = [300, 64, 129]
    x0 = row_inputs(sum(lens), H, K, V, gpu, dtype=torch.bfloat16, seed=11)
    h0 = torch.randn(len(lens), H, K, V, generator=torch.Generator().manual_seed(11)).to(gpu)
    kw = dict(chunk_size=CHUNK, initial_state=h0, state_index=[0, 0, 2], state_offset=[128, 300, 100])

    def run():
        x = [t.clone().requires_grad_() for t in x0]
        o, st = kda_fla_varlen(*x, lens, **kw)
        ((o.float() ** 2).sum() + st.sum()).backward()
        return [o, st] + [t.grad for t in x]

    run()                                         # every key tuned
    triton_launch.FAST_LAUNCH_STATS["fast"] = 0
    fast = run()
    assert triton_launch.FAST_LAUNCH_STATS["fast"] >= 10      # forward and backward launches took it
    triton_launch.fast_autotuned_launches()()     # undone: every launch through the autotuners
    try:
        triton_launch.FAST_LAUNCH_STATS["fast"] = 0
        full = run()
        assert not triton_launch._PATCHED and triton_launch.FAST_LAUNCH_STATS["fast"] == 0
    finally:
        triton_launch.fast_autotuned_launches()
    for a, b in zip(fast, full):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------
# argument checks (CPU too)
# ---------------------------------------------------------------------------

def test_refuses_other_chunk_sizes_and_dtypes():
    x = torch.zeros(1, 8, 1, 4)
    b = torch.zeros(1, 8, 1)
    with pytest.raises(ValueError, match="--tree-chunk-size"):
        kda_fla(x, x, x, x, b, chunk_size=32)
    with pytest.raises(ValueError, match="float32, bfloat16"):
        kda_fla(*(t.double() for t in (x, x, x, x, b)), chunk_size=64)


def test_fla_backend_unavailable_is_a_clear_error():
    import importlib.util
    if importlib.util.find_spec("fla") is not None:
        pytest.skip("fla-core is installed here")
    with pytest.raises(ValueError, match="fla-core is not installed"):
        get_kda_backend("fla")
