"""KDA across a sharing window: producer + consumer equal whole-tree KDA.

A consumer layout holds subtrees whose ancestors live in a producer layout.  Its sequences start
at aligned positions from the producer's exported boundary states, replaying producer rows
(docs/design.md: sequence, replay, boundary state).  Oracle: the whole-tree executor, itself
pinned against expanded KDA by tests/test_tree_kda.py.
"""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_harts.layout import build_layout
from megatron_harts.ops.kda import kda_chunked
from megatron_harts.ops.tree_kda import (KdaExternal, build_kda_schedule, consumer_kda_sources,
                                         plan_subtree_calls, tree_kda)
from megatron_harts.planner.calls import plan_calls
from megatron_harts.tree_data import build_forest, make_trajectory

from test_layout import outermost

H, K, V = 2, 3, 2


@st.composite
def windows(draw):
    """A forest, a chunk size and non-nested consumer roots (subtree roots, maybe a tree root)."""
    vocab = draw(st.integers(2, 3))
    base = draw(st.lists(st.integers(0, vocab - 1), min_size=24, max_size=24))
    trajs = []
    for i in range(draw(st.integers(2, 6))):
        cut = draw(st.integers(0, 24))
        tail = draw(st.lists(st.integers(0, vocab - 1), min_size=0 if cut else 1, max_size=12))
        trajs.append(make_trajectory({"id": i, "tokens": base[:cut] + tail, "group": draw(st.sampled_from("ab"))}))
    forest = build_forest(trajs)
    pick = draw(st.lists(st.booleans(), min_size=forest.num_segments, max_size=forest.num_segments))
    roots = outermost(forest, [s for s in range(forest.num_segments) if pick[s]])
    if not roots:
        roots = [forest.num_segments - 1]
    return forest, roots, draw(st.sampled_from([2, 4, 8]))


def inputs(R, dtype, seed=0, grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(R, H, K, dtype=dtype, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(R, H, K, dtype=dtype, generator=gen), dim=-1)
    v = torch.randn(R, H, V, dtype=dtype, generator=gen)
    g = -torch.rand(R, H, K, dtype=dtype, generator=gen) * 0.7
    beta = torch.rand(R, H, dtype=dtype, generator=gen)
    return [x.requires_grad_(grad) for x in (q, k, v, g, beta)]


def schedules(forest, roots, B, replay):
    producer = build_layout(forest)
    consumer = build_layout(forest, roots=roots, context=producer)
    sp = plan_subtree_calls(consumer.seg_parent, consumer.seg_start, consumer.seg_length, consumer.seg_row, B,
                            replay=replay)
    csched = build_kda_schedule(consumer.seg_parent, consumer.seg_start, consumer.seg_length, consumer.seg_row, sp)
    state_rows, replay_rows = consumer_kda_sources(consumer, csched)
    pplan = plan_calls(producer.seg_parent, producer.seg_start, producer.seg_length, B, replay=replay)
    psched = build_kda_schedule(producer.seg_parent, producer.seg_start, producer.seg_length, producer.seg_row,
                                pplan, export_rows=state_rows)
    return producer, consumer, psched, csched, torch.as_tensor(replay_rows)


def window_run(leaves, producer, consumer, psched, csched, replay_rows, detach=False):
    """Producer forward (exports), consumer forward; with ``detach`` the exports are cut leaves."""
    pin = [x[producer.forest_rows] for x in leaves]
    o_p, states = tree_kda(*pin, psched, return_exports=True)
    exports = [states] + [x[replay_rows] for x in pin]
    used = [e.detach().requires_grad_(True) for e in exports] if detach else exports
    cin = [x[consumer.forest_rows] for x in leaves]
    o_c = tree_kda(*cin, csched, external=KdaExternal(*used))
    return o_p, o_c, exports, used


@settings(max_examples=25, deadline=None)
@given(windows(), st.booleans())
def test_consumer_equals_whole_tree_fp64_forward_and_gradients(w, replay):
    forest, roots, B = w
    producer, consumer, psched, csched, replay_rows = schedules(forest, roots, B, replay)
    leaves = inputs(forest.num_rows, torch.float64, grad=True)
    o_whole = tree_kda(*leaves, build_kda_schedule(forest.seg_parent, forest.seg_start, forest.seg_length,
                                                   forest.seg_row, plan_calls(forest.seg_parent, forest.seg_start,
                                                                              forest.seg_length, B, replay=replay)))
    rows = consumer.forest_rows
    wc = torch.randn(len(rows), H, V, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    g_whole = torch.autograd.grad((wc * o_whole[rows]).sum(), leaves)

    # one graph: consumer loss straight through the exported states into the producer's call
    _, o_c, _, _ = window_run(leaves, producer, consumer, psched, csched, replay_rows)
    torch.testing.assert_close(o_c, o_whole[rows], rtol=1e-10, atol=1e-12)
    g_one = torch.autograd.grad((wc * o_c).sum(), leaves)

    # window close: consumer backward into cut exports, then one producer backward from their grads
    _, o_c2, exports, used = window_run(leaves, producer, consumer, psched, csched, replay_rows, detach=True)
    (wc * o_c2).sum().backward()
    pairs = [(e, u.grad) for e, u in zip(exports, used) if u.grad is not None]
    torch.autograd.backward([e for e, _ in pairs], [gr for _, gr in pairs])
    for name, a, b, c in zip("q k v g beta".split(), g_one, [x.grad for x in leaves], g_whole):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12, msg=f"gradient of {name} (one graph)")
        b = torch.zeros_like(c) if b is None else b
        torch.testing.assert_close(b, c, rtol=1e-10, atol=1e-12, msg=f"gradient of {name} (window close)")
    if csched.num_external_states:
        assert any(u.grad is not None and bool(u.grad.abs().sum() > 0) for u in used[:1])


@settings(max_examples=25, deadline=None)
@given(windows())
def test_consumer_with_replay_is_bitwise_expanded_fp32(w):
    """Invariant 2 across microbatches: consumer chunks are expanded chunks, outputs bitwise equal."""
    forest, roots, B = w
    producer, consumer, psched, csched, replay_rows = schedules(forest, roots, B, True)
    leaves = inputs(forest.num_rows, torch.float32)
    _, o_c, _, _ = window_run(leaves, producer, consumer, psched, csched, replay_rows)
    row_of = {int(f): i for i, f in enumerate(consumer.forest_rows.tolist())}
    for t in range(forest.num_trajectories):
        frows = forest.trajectory_rows(t)
        held = [i for i, f in enumerate(np.asarray(frows).tolist()) if f in row_of]
        if not held:
            continue
        o, _ = kda_chunked(*(x[torch.as_tensor(np.asarray(frows))][None] for x in leaves), chunk_size=B)
        mine = torch.as_tensor([row_of[int(np.asarray(frows)[i])] for i in held])
        assert torch.equal(o_c[mine], o[0, held])


def test_replay_stub_and_external_state_positions():
    """Root at p=10, B=8: state at 8 from the producer row at 7, replay rows at 8 and 9."""
    a = make_trajectory({"id": 0, "tokens": list(range(10)) + [50, 51, 52]})
    b = make_trajectory({"id": 1, "tokens": list(range(10)) + [60, 61]})
    forest = build_forest([a, b])
    root = int(np.flatnonzero(forest.seg_start == 10)[0])
    producer, consumer, psched, csched, replay_rows = schedules(forest, [root], 8, True)
    assert csched.external_state_position.tolist() == [8]
    assert csched.external_replay_position.tolist() == [8, 9]
    assert csched.num_external_rows == 2 and csched.replay_tokens == 2
    assert producer.position_ids[torch.as_tensor(psched.export_rows)].tolist() == [7]
    assert producer.position_ids[replay_rows].tolist() == [8, 9]
    # without replay the consumer starts at p itself from the state after position 9
    _, _, psched0, csched0, replay_rows0 = schedules(forest, [root], 8, False)
    assert csched0.external_state_position.tolist() == [10] and replay_rows0.numel() == 0
    assert producer.position_ids[torch.as_tensor(psched0.export_rows)].tolist() == [9]


def test_refusals():
    forest = build_forest([make_trajectory({"id": 0, "tokens": list(range(12))}),
                           make_trajectory({"id": 1, "tokens": list(range(10)) + [70]})])
    root = int(np.flatnonzero(forest.seg_start == 10)[0])
    producer, consumer, psched, csched, replay_rows = schedules(forest, [root], 4, True)
    x = inputs(consumer.num_rows, torch.float64)
    with pytest.raises(ValueError, match="external"):
        tree_kda(*x, csched)
    plan = plan_calls(np.array([-1]), np.array([0]), np.array([2]), 4)
    with pytest.raises(ValueError, match="whole trees only"):
        build_kda_schedule(consumer.seg_parent, consumer.seg_start, consumer.seg_length, consumer.seg_row, plan)
    with pytest.raises(ValueError, match="export_rows"):
        build_kda_schedule(producer.seg_parent, producer.seg_start, producer.seg_length, producer.seg_row,
                           plan_calls(producer.seg_parent, producer.seg_start, producer.seg_length, 4),
                           export_rows=[producer.num_rows])
    p = inputs(producer.num_rows, torch.float64)
    with pytest.raises(ValueError, match="no producer state"):
        tree_kda(*p, psched, external=KdaExternal(torch.zeros(0, H, K, V), *p))
