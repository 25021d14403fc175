"""KDA core and the tree executor against expanded per-trajectory KDA (invariants 1 and 2)."""
import inspect

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_harts.ops.kda import kda_chunked, kda_chunked_varlen, kda_recurrent
from megatron_harts.ops.tree_kda import build_kda_schedule, tree_kda
from megatron_harts.planner.calls import plan_calls
from megatron_harts.tree_data import build_forest, make_trajectory


def random_inputs(n, t, h, kd, vd, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, t, h, kd, dtype=dtype, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(n, t, h, kd, dtype=dtype, generator=gen), dim=-1)
    v = torch.randn(n, t, h, vd, dtype=dtype, generator=gen)
    g = -torch.rand(n, t, h, kd, dtype=dtype, generator=gen) * 0.7
    beta = torch.rand(n, t, h, dtype=dtype, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("T,B", [(1, 4), (8, 4), (37, 8), (16, 16), (5, 64)])
def test_chunked_equals_recurrent(T, B):
    q, k, v, g, beta = random_inputs(2, T, 2, 5, 3, torch.float64)
    s0 = torch.randn(2, 2, 5, 3, dtype=torch.float64)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, initial_state=s0)
    offsets = sorted({1, T, max(1, T // 2), min(T, B)})
    o, states = kda_chunked(q, k, v, g, beta, chunk_size=B, initial_state=s0,
                            state_index=[1] * len(offsets), state_offset=offsets)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    for m, s in zip(offsets, states):
        _, s_m = kda_recurrent(*(x[1:, :m] for x in (q, k, v, g, beta)), initial_state=s0[1:])
        torch.testing.assert_close(s, s_m[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(states[offsets.index(T)], s_ref[1], rtol=1e-12, atol=1e-12)


def test_intra_chunk_recompute_same_bits_less_saved(monkeypatch):
    """Above RECOMPUTE_INTRA_CHUNK_ELEMENTS the chunk products are recomputed in the backward:
    outputs, states and every input gradient are the same bits, and autograd keeps less."""
    import megatron_harts.ops.kda as kda_mod

    def run(threshold):
        monkeypatch.setattr(kda_mod, "RECOMPUTE_INTRA_CHUNK_ELEMENTS", threshold)
        inputs = [x.clone().requires_grad_() for x in random_inputs(2, 40, 2, 8, 4, torch.float32, seed=3)]
        saved = []

        def pack(t):
            saved.append(t.numel() * t.element_size())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            o, st = kda_chunked(*inputs, chunk_size=8, state_index=[0, 1], state_offset=[40, 13])
        (o.square().sum() + st.sum()).backward()
        return o, st, [x.grad for x in inputs], sum(saved)

    kept, recomputed = run(1 << 62), run(0)
    for a, b in zip(kept[:2] + tuple(kept[2]), recomputed[:2] + tuple(recomputed[2])):
        assert torch.equal(a, b)
    assert recomputed[3] < 0.5 * kept[3]


def test_varlen_equals_each_sequence_on_its_own():
    """The packed (varlen) form every backend implements: outputs, exported states (inside a
    chunk, on a boundary, at a sequence's end) and gradients equal one call per sequence."""
    lens, B = [5, 1, 12, 8], 4
    H, Kd, Vd = 2, 3, 2
    gen = torch.Generator().manual_seed(5)
    leaves = [x.reshape((-1,) + tuple(x.shape[2:])).requires_grad_()
              for x in random_inputs(1, sum(lens), H, Kd, Vd, torch.float64, seed=5)]
    s0 = torch.randn(len(lens), H, Kd, Vd, dtype=torch.float64, generator=gen, requires_grad=True)
    exports = [(0, 5), (2, 4), (2, 7), (1, 1), (3, 8), (2, 12)]
    o, st = kda_chunked_varlen(*leaves, torch.tensor(lens), chunk_size=B, initial_state=s0,
                               state_index=[n for n, _ in exports], state_offset=[m for _, m in exports])
    want_o, want_st, start = [], [None] * len(exports), 0
    for n, L in enumerate(lens):
        xs = [x[start:start + L].unsqueeze(0) for x in leaves]
        mine = [i for i, (m, _) in enumerate(exports) if m == n]
        on, sn = kda_chunked(*xs, chunk_size=B, initial_state=s0[n:n + 1], state_index=[0] * len(mine),
                             state_offset=[exports[i][1] for i in mine])
        want_o.append(on[0])
        for i, s_ in zip(mine, sn):
            want_st[i] = s_
        start += L
    want_o, want_st = torch.cat(want_o), torch.stack(want_st)
    torch.testing.assert_close(o, want_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st, want_st, rtol=1e-12, atol=1e-12)
    wo, ws = torch.randn(o.shape, dtype=torch.float64, generator=gen), torch.randn(st.shape, dtype=torch.float64,
                                                                                   generator=gen)
    got = torch.autograd.grad((o * wo).sum() + (st * ws).sum(), leaves + [s0])
    want = torch.autograd.grad((want_o * wo).sum() + (want_st * ws).sum(), leaves + [s0])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="lengths"):
        kda_chunked_varlen(*leaves, [5, 1, 12], chunk_size=B)
    with pytest.raises(ValueError, match="offsets"):
        kda_chunked_varlen(*leaves, lens, chunk_size=B, state_index=[1], state_offset=[2])


def test_varlen_distinct_initial_states_equal_one_per_sequence():
    """``initial_state_index``: M distinct starting states shared by N sequences give the outputs,
    states and gradients of the N per-sequence states (a shared state's gradient is the sum over
    the sequences starting from it); a bad index is refused."""
    lens, B, index = [5, 7, 3, 9], 4, [1, 0, 1, 1]
    leaves = [x.reshape((-1,) + tuple(x.shape[2:])).requires_grad_()
              for x in random_inputs(1, sum(lens), 2, 3, 2, torch.float64, seed=8)]
    distinct = torch.randn(2, 2, 3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(9),
                           requires_grad=True)
    per_seq = distinct.detach()[index].clone().requires_grad_()
    kw = dict(chunk_size=B, state_index=[0, 3, 2], state_offset=[5, 6, 3])
    o1, s1 = kda_chunked_varlen(*leaves, lens, initial_state=distinct, initial_state_index=index, **kw)
    o2, s2 = kda_chunked_varlen(*leaves, lens, initial_state=per_seq, **kw)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)
    g1 = torch.autograd.grad(o1.sum() + s1.square().sum(), leaves + [distinct])
    g2 = torch.autograd.grad(o2.sum() + s2.square().sum(), leaves + [per_seq])
    for a, b in zip(g1[:5], g2[:5]):
        assert torch.equal(a, b)
    want = torch.zeros_like(distinct).index_add_(0, torch.tensor(index), g2[5])
    torch.testing.assert_close(g1[5], want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="initial_state_index"):
        kda_chunked_varlen(*leaves, lens, initial_state=distinct, initial_state_index=[0, 1, 2, 0], **kw)
    with pytest.raises(ValueError, match="initial_state_index"):
        kda_chunked_varlen(*leaves, lens, initial_state=distinct, initial_state_index=[0, 1], **kw)


def test_forks_pass_each_distinct_state_once(monkeypatch):
    """Siblings forking from one state in one call: the backend gets that state once, with an index
    (what a GPU backend keeps for backward shrinks by the fan-out), and the outputs are unchanged."""
    import megatron_harts.ops.tree_kda as tk
    forest = build_forest([make_trajectory({"id": i, "tokens": [1] * 8 + [2 + i] * (5 + i)}) for i in range(4)])
    B = 4
    plan = plan_calls(forest.seg_parent, forest.seg_start, forest.seg_length, B, replay=True)
    sched = build_kda_schedule(forest.seg_parent, forest.seg_start, forest.seg_length, forest.seg_row, plan)
    x = [t.reshape((-1,) + tuple(t.shape[2:])) for t in random_inputs(1, forest.num_rows, 2, 3, 2,
                                                                      torch.float64, seed=2)]
    seen = []

    def recording(*args, **kw):
        if kw.get("initial_state") is not None:
            seen.append((kw["initial_state"].shape[0], kw.get("initial_state_index")))
        return kda_chunked_varlen(*args, **kw)
    monkeypatch.setitem(tk.KDA_BACKENDS, "recording", recording)
    got = tree_kda(*x, sched, backend="recording")
    assert any(idx is not None and m < len(idx) for m, idx in seen), seen
    assert torch.equal(got, tree_kda(*x, sched, backend="reference"))


def test_recurrent_matches_transformers_kimi_linear():
    """Our recurrence is Kimi-Linear's (transformers' pure-torch fallback, an external oracle)."""
    mod = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    q, k, v, g, beta = random_inputs(2, 19, 2, 8, 4, torch.float32)
    o, s = kda_recurrent(q, k, v, g, beta)
    # the torch function under transformers' kernel wrapper (with fla installed the wrapper calls fla's
    # GPU kernel, which takes no CPU tensors)
    torch_path = inspect.unwrap(mod.chunk_kimi_delta_attention)
    o_hf, s_hf = torch_path(q, k, v, g, beta, chunk_size=8, output_final_state=True)
    torch.testing.assert_close(o, o_hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, s_hf, rtol=1e-5, atol=1e-5)
    o_c, _ = kda_chunked(q, k, v, g, beta, chunk_size=8)
    torch.testing.assert_close(o_c, o_hf, rtol=1e-6, atol=1e-6)


@st.composite
def forests(draw):
    """Random forests with forks before, at and after chunk boundaries, and prefix trajectories."""
    vocab = draw(st.integers(2, 3))
    n = draw(st.integers(1, 7))
    base = draw(st.lists(st.integers(0, vocab - 1), min_size=30, max_size=30))
    trajs = []
    for i in range(n):
        cut = draw(st.integers(0, 30))
        tail = draw(st.lists(st.integers(0, vocab - 1), min_size=0 if cut else 1, max_size=20))
        group = draw(st.sampled_from(["a", "b"]))
        trajs.append(make_trajectory({"id": i, "tokens": base[:cut] + tail, "group": group}))
    return build_forest(trajs), draw(st.sampled_from([2, 4, 8]))


def expanded_and_tree(forest, B, dtype, replay=True, seed=0, grad=False):
    R = forest.num_rows
    H, K, V = 2, 4, 3
    leaves = [x[0].requires_grad_(grad) for x in random_inputs(1, R, H, K, V, dtype, seed)]
    plan = plan_calls(forest.seg_parent, forest.seg_start, forest.seg_length, B, replay=replay)
    sched = build_kda_schedule(forest.seg_parent, forest.seg_start, forest.seg_length, forest.seg_row, plan)
    o_tree = tree_kda(*leaves, sched)
    outs = []
    for t in range(forest.num_trajectories):
        rows = torch.as_tensor(forest.trajectory_rows(t))
        o, _ = kda_chunked(*(x[rows][None] for x in leaves), chunk_size=B)
        outs.append((rows, o[0]))
    return leaves, o_tree, outs, plan


@settings(max_examples=40, deadline=None)
@given(forests())
def test_tree_equals_expanded_fp64_forward_and_gradients(fb):
    forest, B = fb
    leaves, o_tree, outs, _ = expanded_and_tree(forest, B, torch.float64, grad=True)
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(o.shape, dtype=torch.float64, generator=gen) for _, o in outs]
    loss_tree = sum((w * o_tree[rows]).sum() for (rows, _), w in zip(outs, weights))
    loss_exp = sum((w * o).sum() for (_, o), w in zip(outs, weights))
    for (rows, o) in outs:
        torch.testing.assert_close(o_tree[rows], o, rtol=1e-10, atol=1e-12)
    g_tree = torch.autograd.grad(loss_tree, leaves)
    g_exp = torch.autograd.grad(loss_exp, leaves)
    for name, a, b in zip("q k v g beta".split(), g_tree, g_exp):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"gradient of {name}")


@settings(max_examples=40, deadline=None)
@given(forests())
def test_replay_is_bitwise_expanded_fp32(fb):
    """Invariant 2: with replay every chunk is an expanded chunk, so fp32 outputs are bitwise equal."""
    forest, B = fb
    _, o_tree, outs, _ = expanded_and_tree(forest, B, torch.float32)
    for rows, o in outs:
        assert torch.equal(o_tree[rows], o)


def test_no_replay_differs_by_rounding_only():
    """Without replay, chunks start at forks: same function, different rounding (~1e-7 in fp32)."""
    rng = np.random.default_rng(5)
    base = rng.integers(0, 50, 200).tolist()
    trajs = [make_trajectory({"id": i, "tokens": base[: 13 + 29 * i] + rng.integers(50, 99, 60).tolist()})
             for i in range(6)]
    forest = build_forest(trajs)
    _, o_tree, outs, plan = expanded_and_tree(forest, 16, torch.float32, replay=False)
    assert plan.replay_tokens == 0
    diffs = [float((o_tree[rows] - o).abs().max()) for rows, o in outs]
    assert max(diffs) > 0
    assert max(diffs) < 1e-4
    _, o_tree64, outs64, _ = expanded_and_tree(forest, 16, torch.float64, replay=False)
    for rows, o in outs64:
        torch.testing.assert_close(o_tree64[rows], o, rtol=1e-10, atol=1e-12)


def test_schedule_rejects_mismatched_rows():
    forest = build_forest([make_trajectory({"id": 0, "tokens": [1, 2, 3]})])
    plan = plan_calls(forest.seg_parent, forest.seg_start, forest.seg_length, 4)
    sched = build_kda_schedule(forest.seg_parent, forest.seg_start, forest.seg_length, forest.seg_row, plan)
    x = torch.zeros(5, 1, 2)
    with pytest.raises(ValueError, match="rows"):
        tree_kda(x, x, x, x, torch.zeros(5, 1), sched)
    with pytest.raises(ValueError, match="backend"):
        tree_kda(x[:3], x[:3], x[:3], x[:3], torch.zeros(3, 1), sched, backend="nope")


@settings(max_examples=25, deadline=None)
@given(forests(), st.booleans())
def test_gather_shortcuts_same_bits(fb, replay):
    """The calls' row flags are right, and the shortcuts they allow (scatter-back backward, no gather
    for a call of every row in order) give the index_add path's outputs and gradients bit for bit."""
    import dataclasses
    forest, B = fb
    R = forest.num_rows
    plan = plan_calls(forest.seg_parent, forest.seg_start, forest.seg_length, B, replay=replay)
    sched = build_kda_schedule(forest.seg_parent, forest.seg_start, forest.seg_length, forest.seg_row, plan)
    named = set()
    for c in sched.calls:
        rows = c.rows.numpy()
        assert c.rows_fresh == (np.unique(rows).size == rows.size and not named & set(rows.tolist()))
        named |= set(rows.tolist())
        assert c.out_identity == (np.array_equal(c.out_pos.numpy(), np.arange(c.out_pos.numel()))
                                  and np.array_equal(c.out_rows.numpy(), np.arange(c.out_rows.numel())))
    rows0 = sched.calls[0].rows.numpy()
    assert (sched.call_rows is None) == (len(sched.calls) == 1 and np.array_equal(rows0, np.arange(rows0.size))
                                         and rows0.size == R)
    plain = dataclasses.replace(sched, call_rows=torch.cat([c.rows for c in sched.calls]),
                                calls=[dataclasses.replace(c, rows_fresh=False, out_identity=False)
                                       for c in sched.calls])
    leaves = [x[0].requires_grad_(True) for x in random_inputs(1, R, 2, 4, 3, torch.float32, 3)]
    w = torch.randn(R, 2, 3, generator=torch.Generator().manual_seed(4))
    got, want = tree_kda(*leaves, sched), tree_kda(*leaves, plain)
    assert torch.equal(got, want)
    for a, b in zip(torch.autograd.grad((got * w).sum(), leaves), torch.autograd.grad((want * w).sum(), leaves)):
        assert torch.equal(a, b)


def test_one_call_in_row_order_runs_without_gathers():
    forest = build_forest([make_trajectory({"id": 0, "tokens": list(range(1, 11))})])
    plan = plan_calls(forest.seg_parent, forest.seg_start, forest.seg_length, 4, replay=True)
    sched = build_kda_schedule(forest.seg_parent, forest.seg_start, forest.seg_length, forest.seg_row, plan)
    assert len(sched.calls) == 1 and sched.call_rows is None and sched.calls[0].out_identity


def test_call_outputs_are_not_kept_for_the_backward():
    """Assembling the rows' outputs from several calls saves no tensor of the calls' outputs (only
    index tensors on the context): peak memory holds the rows' outputs once, as one call does.
    Outputs and gradients are those of a plain out-of-place index_copy chain, bit for bit."""
    from megatron_harts.ops.tree_kda import _ScatterCallOutputs
    rng = np.random.default_rng(2)
    base = rng.integers(0, 50, 90).tolist()
    forest = build_forest([make_trajectory({"id": i, "tokens": base[:20 + 30 * i] + rng.integers(50, 99, 25).tolist()})
                           for i in range(3)])
    plan = plan_calls(forest.seg_parent, forest.seg_start, forest.seg_length, 8, replay=True)
    sched = build_kda_schedule(forest.seg_parent, forest.seg_start, forest.seg_length, forest.seg_row, plan)
    assert len(sched.calls) > 1 and any(not c.out_identity for c in sched.calls)
    R = forest.num_rows
    outs = [torch.randn(int(c.lengths.sum()), 2, 3, dtype=torch.float64, requires_grad=True) for c in sched.calls]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        got = _ScatterCallOutputs.apply(sched.calls, sched.out_index, *outs)
    assert saved == []
    want = torch.zeros(R, 2, 3, dtype=torch.float64)
    for c, o in zip(sched.calls, outs):
        want = want.index_copy(0, c.out_rows, o.index_select(0, c.out_pos))
    assert torch.equal(got, want)
    w = torch.randn(R, 2, 3, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((got * w).sum(), outs), torch.autograd.grad((want * w).sum(), outs)):
        assert torch.equal(a, b)


def test_call_inputs_come_from_one_gather_and_one_buffer_per_input():
    """All calls' inputs come from one gather per input; the backward fills one zero buffer per input
    (not one per call, summed): the values and fp64 gradients of a per-call index_select."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from megatron_harts.ops.tree_kda import _call_inputs, calls_rows
    rng = np.random.default_rng(5)
    root, a, b, *ends = (rng.integers(1, 99, 13).tolist() for _ in range(7))
    forest = build_forest([make_trajectory({"id": i, "tokens": root + (a if i < 2 else b) + ends[i]})
                           for i in range(4)])
    plan = plan_calls(forest.seg_parent, forest.seg_start, forest.seg_length, 4, replay=True)
    sched = build_kda_schedule(forest.seg_parent, forest.seg_start, forest.seg_length, forest.seg_row, plan)
    R = forest.num_rows
    sizes = [c.rows.numel() for c in sched.calls]
    assert len(sched.calls) == 3 and R not in sizes
    assert not all(c.rows_fresh for c in sched.calls) and sched.calls[0].rows_fresh   # replay rows repeat
    x = torch.randn(R, 2, 3, dtype=torch.float64, requires_grad=True)
    ws = [torch.randn(n, 2, 3, dtype=torch.float64) for n in sizes]

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.ops.append((func.__name__.split(".")[0], tuple(out.shape) if isinstance(out, torch.Tensor) else None))
            return out

    with Count() as fwd:
        got = _call_inputs(calls_rows(x, sched), sched)
    assert [op for op, _ in fwd.ops].count("index_select") == 1
    loss = sum((o * w).sum() for o, w in zip(got, ws))
    with Count() as bwd:
        (gx,) = torch.autograd.grad(loss, [x])
    full = [op for op, shape in bwd.ops if shape == (R, 2, 3)]
    assert sum(op in ("new_zeros", "zeros", "zeros_like") for op in full) == 1 and "add" not in full
    want = [x.index_select(0, c.rows) for c in sched.calls]
    for a, b in zip(got, want):
        assert torch.equal(a, b) and a.is_contiguous()
    (gw,) = torch.autograd.grad(sum((o * w).sum() for o, w in zip(want, ws)), [x])
    torch.testing.assert_close(gx, gw, rtol=1e-14, atol=1e-14)


def test_handed_off_states_reach_later_calls_through_one_gather_per_source(monkeypatch):
    """States exported by a call reach the calls that start from them through one row gather of
    that call's states (no per-state select, whose backward writes a zero tensor of all the call's
    states for each state), planned once per schedule; the outputs, exported states and gradients
    are those of per-state indexing, bit for bit."""
    import megatron_harts.ops.tree_kda as tk
    rng = np.random.default_rng(3)
    root, a, b, *ends = (rng.integers(1, 99, 10).tolist() for _ in range(7))   # a binary tree of depth 3
    forest = build_forest([make_trajectory({"id": i, "tokens": root + (a if i < 2 else b) + ends[i]})
                           for i in range(4)])
    B = 4
    plan = plan_calls(forest.seg_parent, forest.seg_start, forest.seg_length, B, replay=True)
    sched = build_kda_schedule(forest.seg_parent, forest.seg_start, forest.seg_length, forest.seg_row, plan,
                               export_rows=np.array([20, 3, 40], dtype=np.int64))
    assert len(sched.calls) == 3 and all((c.init_slot >= 0).all() for c in sched.calls[1:])
    leaves = [x[0].requires_grad_(True) for x in random_inputs(1, forest.num_rows, 2, 3, 2, torch.float64, 6)]
    handed = []

    def recording(*args, **kw):
        if kw.get("initial_state") is not None:
            handed.append(type(kw["initial_state"].grad_fn).__name__)
        return kda_chunked_varlen(*args, **kw)
    monkeypatch.setitem(tk.KDA_BACKENDS, "recording", recording)
    out, exported = tree_kda(*leaves, sched, backend="recording", return_exports=True)
    assert handed == ["IndexSelectBackward0", "IndexSelectBackward0"]
    assert type(exported.grad_fn).__name__ in ("CatBackward0", "IndexSelectBackward0")
    assert list(sched.state_gathers) == ["cpu"]
    again = tree_kda(*leaves, sched)
    assert torch.equal(again, out) and list(sched.state_gathers) == ["cpu"]

    # the same calls with the states handed on one by one (what the gathers replace)
    slots = [None] * sched.num_slots
    outs = []
    for call in sched.calls:
        init, index = None, None
        keys = list(zip(call.init_slot.tolist(), call.init_external.tolist()))
        if any(s >= 0 for s, _ in keys):
            init = torch.stack([slots[s] if s >= 0 else torch.zeros(2, 3, 2, dtype=torch.float64) for s, _ in keys])
        o, st = kda_chunked_varlen(*(x[call.rows] for x in leaves), call.lengths, chunk_size=B, initial_state=init,
                                   state_index=call.export_seq, state_offset=call.export_offset)
        for p, s in enumerate(call.export_slot.tolist()):
            slots[s] = st[p]
        outs.append(o)
    want = torch.zeros_like(out)
    for call, o in zip(sched.calls, outs):
        want = want.index_copy(0, call.out_rows, o[call.out_pos])
    want_exported = torch.stack([slots[int(s)] for s in sched.export_slots])
    assert torch.equal(out, want) and torch.equal(exported, want_exported)
    w = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    got_g = torch.autograd.grad((out * w).sum() + exported.square().sum(), leaves)
    want_g = torch.autograd.grad((want * w).sum() + want_exported.square().sum(), leaves)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_schedule_to_device_keeps_every_field():
    """``KdaSchedule.to`` (one host-to-device copy for all index tensors) keeps every call's and the
    schedule's fields; what only the host reads stays the same objects."""
    rng = np.random.default_rng(7)
    base = rng.integers(0, 50, 70).tolist()
    forest = build_forest([make_trajectory({"id": i, "tokens": base[:15 + 20 * i] + rng.integers(50, 99, 9).tolist()})
                           for i in range(3)])
    plan = plan_calls(forest.seg_parent, forest.seg_start, forest.seg_length, 8, replay=True)
    sched = build_kda_schedule(forest.seg_parent, forest.seg_start, forest.seg_length, forest.seg_row, plan,
                               export_rows=np.array([5, 30], dtype=np.int64))
    moved = sched.to("cpu")
    assert len(sched.calls) > 1 and moved.state_gathers == {}
    for name in ("call_rows", "out_index"):
        assert torch.equal(getattr(moved, name), getattr(sched, name))
    for a, b in zip(moved.calls, sched.calls):
        for f in a.__dataclass_fields__:
            x, y = getattr(a, f), getattr(b, f)
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, f
    for f in ("chunk_size", "num_rows", "num_slots", "replay_tokens", "replay", "num_external_rows"):
        assert getattr(moved, f) == getattr(sched, f)
    for f in ("export_rows", "export_slots", "external_state_root"):
        assert np.array_equal(getattr(moved, f), getattr(sched, f))
