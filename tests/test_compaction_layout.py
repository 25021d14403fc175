"""Compaction events in the layout, the expanded batch, the attention backends and the cost model:
every visibility against the per-trajectory definition ``j <= i and not any(start <= j < end and
at <= i)``, mapped through each trajectory's rows."""
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_harts.layout import build_expanded_batch, build_layout, sequence_visibility
from megatron_harts.ops.key_paths import build_key_paths
from megatron_harts.ops.tree_attention import tree_attention
from megatron_harts.planner.cost_model import CostModel, ForestIndex
from megatron_harts.tree_data import build_forest, make_trajectory

warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")

TOL = dict(rtol=1e-10, atol=1e-12)


def traj(tid, tokens, events=None):
    rec = {"id": tid, "tokens": list(tokens)}
    if events:
        rec["compactions"] = [{"at": p, "start": a, "end": b} for p, a, b in events]
    return make_trajectory(rec)


def brute_mask(n, events):
    m = np.tril(np.ones((n, n), dtype=bool))
    for p, a, b in ([] if events is None else np.asarray(events).tolist()):
        m[p:, a:b] = False
    return m


@st.composite
def trees_with_events(draw, max_traj=7, max_len=14, vocab=2):
    """Trajectories cut from a shared base plus tails (tiny vocabulary: forks everywhere), carrying the
    base's shared events below their length (dropped by some: a sibling without the event), events of
    their own (forks at an event), cuts exactly at, just before and after event positions."""
    base = draw(st.lists(st.integers(0, vocab - 1), min_size=max_len, max_size=max_len))
    shared = []
    for _ in range(draw(st.integers(1, 3))):
        p = draw(st.integers(1, max_len - 1))
        a = draw(st.integers(0, p - 1))
        b = draw(st.integers(a + 1, p))
        shared.append((p, a, b))
    trajs = []
    for i in range(draw(st.integers(1, max_traj))):
        if draw(st.booleans()):
            p = draw(st.sampled_from(shared))[0]
            cut = max(1, min(max_len, p + draw(st.integers(-1, 1))))
        else:
            cut = draw(st.integers(1, max_len))
        tail = draw(st.lists(st.integers(0, vocab - 1), min_size=0, max_size=4))
        tokens = base[:cut] + tail
        n = len(tokens)
        events = [e for e in shared if e[0] < n and not (draw(st.integers(0, 4)) == 0)]
        if draw(st.booleans()) and n >= 2:
            p = draw(st.integers(1, n - 1))
            a = draw(st.integers(0, p - 1))
            events.append((p, a, draw(st.integers(a + 1, p))))
        trajs.append(traj(f"t{i}", tokens, events))
    return trajs


def check_against_trajectories(forest, lay):
    """The layout's visibility is exactly the union of its trajectories' masks over their rows."""
    vis = lay.visibility.validate()
    dense = vis.dense().numpy()
    want = np.zeros_like(dense)
    for t, tid in enumerate(lay.traj_ids):
        tr = forest.expand(tid)
        rows = lay.trajectory_rows(t).numpy()
        n = rows.shape[0]                     # positions held here (a segments= layout may stop early)
        m = brute_mask(len(tr), tr.compactions)[:n, :n]
        np.testing.assert_array_equal(dense[np.ix_(rows, rows)], m, err_msg=f"trajectory {tid!r}")
        want[np.ix_(rows, rows)] |= m
    np.testing.assert_array_equal(dense, want)
    return dense


def check_key_paths(lay, dense):
    paths = build_key_paths(lay.visibility, prev=lay.prev)
    R = lay.num_rows
    got = np.zeros((R, R), dtype=bool)
    q_off, k_off = paths.q_offsets.tolist(), paths.k_offsets.tolist()
    for g in range(paths.num_runs):
        lq, lk = q_off[g + 1] - q_off[g], k_off[g + 1] - k_off[g]
        keys = paths.key_index[k_off[g]:k_off[g + 1]].numpy()
        assert list(keys[lk - lq:]) == list(range(q_off[g], q_off[g + 1]))
        assert len(set(keys.tolist())) == lk
        for i in range(lq):
            got[q_off[g] + i, keys[:lk - (lq - 1 - i)]] = True
    np.testing.assert_array_equal(got, dense)
    assert paths.pairs == int(dense.sum())


@settings(max_examples=40, deadline=None)
@given(trees_with_events(), st.data())
def test_visibility_equals_every_trajectorys_mask(trajs, data):
    f = build_forest(trajs)
    lay = build_layout(f)
    dense = check_against_trajectories(f, lay)
    assert lay.num_events == f.num_events
    check_key_paths(lay, dense)
    stats = f.stats()
    assert stats["visible_pairs_tree"] == int(dense.sum())
    # the dense rows' counts are the forest's per-row view and the cost model's per-segment pairs
    np.testing.assert_array_equal(dense.sum(1), lay.position_ids.numpy() + 1 - f.row_evicted())
    seg_of_row = lay.row_segment.numpy()
    per_seg = np.bincount(seg_of_row, weights=dense.sum(1), minlength=f.num_segments).astype(np.int64)
    for compiled in (True, False):
        ix = ForestIndex(f, compiled_core=compiled)
        np.testing.assert_array_equal(ix.seg_pairs, per_seg)
        # the expanded-mode cost features count each trajectory's own visible pairs
        feats = CostModel().expanded_features(ix, np.arange(f.num_trajectories))
        assert feats.attention_pairs == stats["visible_pairs_expanded"]
    # expanded batch: each trajectory's own mask, nothing across trajectories
    eb = build_expanded_batch(f, range(f.num_trajectories))
    T = sum(eb.lengths)
    if eb.visibility is None:                  # no event at all: plain causal sequences
        assert not f.has_compactions
        ev = np.zeros((T, T), dtype=bool)
        o = 0
        for n in eb.lengths:
            ev[o:o + n, o:o + n] = np.tril(np.ones((n, n), dtype=bool))
            o += n
    else:
        ev = eb.visibility.validate().dense().numpy()
    want = np.zeros_like(ev)
    o = 0
    for tid, n in zip(eb.traj_ids, eb.lengths):
        want[o:o + n, o:o + n] = brute_mask(n, f.expand(tid).compactions)
        o += n
    np.testing.assert_array_equal(ev, want)
    assert stats["visible_pairs_expanded"] == int(ev.sum())
    # a microbatch's segment set closed under parents (within-mode layouts): same rule on its rows
    keep = np.zeros(f.num_segments, dtype=bool)
    for s in range(f.num_segments):
        p = int(f.seg_parent[s])
        keep[s] = (p < 0 or keep[p]) and data.draw(st.booleans())
    if keep.any():
        sub = build_layout(f, segments=np.flatnonzero(keep).tolist())
        check_key_paths(sub, check_against_trajectories(f, sub))


def fixed_forest():
    """Forks exactly at an event, just before and after it, a sibling without the event, a trajectory
    ending inside another's compacted path, and events that evict the previous token."""
    base = list(range(20))
    return build_forest([
        traj("a", base[:14], [(6, 1, 4), (10, 0, 2), (10, 5, 10)]),
        traj("b", base[:9] + [50, 51], [(6, 1, 4)]),                 # leaves a after a's event at 6
        traj("c", base[:6] + [60, 61], None),                         # sibling without the event (fork at 6)
        traj("d", base[:8], [(6, 1, 4)]),                             # ends inside a's compacted path
        traj("e", base[:7] + [70], [(6, 1, 4), (7, 0, 7)]),           # own event, evicts the previous token
        traj("f", base[:6] + [80, 81, 82], [(6, 1, 4)]),              # fork exactly at the event position
        traj("g", base[:5] + [90], [(5, 0, 5)]),                      # fork just before it, own event
        traj("h", list(range(100, 108)), [(3, 0, 3), (3, 1, 2), (5, 2, 4)]),   # overlapping spans, second tree
    ])


def test_fixed_scenarios_share_rows_and_evict_exactly():
    f = fixed_forest()
    lay = build_layout(f)
    dense = check_against_trajectories(f, lay)
    check_key_paths(lay, dense)
    assert lay.num_rows < int(lay.traj_length.sum())                 # rows are shared
    assert lay.visibility.num_intervals > lay.num_rows                 # some key has a hole
    rows = {tid: lay.trajectory_rows(i).numpy() for i, tid in enumerate(lay.traj_ids)}
    assert np.array_equal(rows["a"][:9], rows["b"][:9]) and np.array_equal(rows["a"][:8], rows["d"])
    assert rows["c"][6] != rows["a"][6] and np.array_equal(rows["c"][:6], rows["a"][:6])
    assert rows["f"][6] != rows["a"][6] and np.array_equal(rows["f"][:6], rows["a"][:6])   # token fork at the event
    assert not dense[rows["f"][8], rows["f"][3]] and dense[rows["f"][8], rows["f"][4]]
    assert not dense[rows["a"][6], rows["a"][2]] and dense[rows["c"][6], rows["c"][2]]
    assert not dense[rows["e"][7], rows["e"][6]] and dense[rows["a"][7], rows["a"][6]]


def test_without_events_nothing_changes():
    f = build_forest([traj("a", [1, 2, 3, 4]), traj("b", [1, 2, 5])])
    lay = build_layout(f)
    assert lay.num_events == 0 and lay.visibility.num_intervals == lay.num_rows
    assert build_expanded_batch(f, [0, 1]).visibility is None
    assert sequence_visibility([4, 3], [None, None]) is None
    with pytest.raises(ValueError, match="needs 0 <= start < end <= at"):
        sequence_visibility([4], [np.array([[4, 0, 1]])])


def attention_against_trajectories(f, lay, backend, grad=True, H=2, Hk=1, seed=0, **kw):
    """Tree attention of the layout == each trajectory's attention under its own mask, fp64."""
    gen = torch.Generator().manual_seed(seed)
    R = lay.num_rows
    q = torch.randn(R, H, 3, dtype=torch.float64, generator=gen, requires_grad=grad)
    k = torch.randn(R, Hk, 3, dtype=torch.float64, generator=gen, requires_grad=grad)
    v = torch.randn(R, Hk, 2, dtype=torch.float64, generator=gen, requires_grad=grad)
    out_e = torch.zeros(R, H, 2, dtype=torch.float64)
    loss_e, cot = 0.0, torch.zeros(R, H, 2, dtype=torch.float64)
    for t, tid in enumerate(lay.traj_ids):
        rows = lay.trajectory_rows(t)
        m = torch.from_numpy(brute_mask(rows.numel(), f.expand(tid).compactions))
        s = torch.einsum("qhd,khd->hqk", q[rows], k[rows].repeat_interleave(H // Hk, 1)) * 0.7
        o = torch.einsum("hqk,khd->qhd", torch.softmax(s.masked_fill(~m, float("-inf")), -1),
                         v[rows].repeat_interleave(H // Hk, 1))
        g = torch.randn(o.shape, dtype=torch.float64, generator=gen)
        loss_e = loss_e + (o * g).sum()
        cot.index_add_(0, rows, g)
        out_e[rows] = o.detach()
    out = tree_attention(q, k, v, lay, 0.7, backend=backend, **kw)
    torch.testing.assert_close(out.detach(), out_e, **TOL)
    if grad:
        want = torch.autograd.grad(loss_e, (q, k, v))
        got = torch.autograd.grad((out * cot).sum(), (q, k, v))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **TOL)


@settings(max_examples=25, deadline=None)
@given(trees_with_events(max_traj=5), st.sampled_from([(2, 1), (2, 2)]))
def test_backends_equal_the_trajectories_masks_fwd_bwd(trajs, heads):
    f = build_forest(trajs)
    lay = build_layout(f)
    for backend, kw in (("reference", {}), ("sdpa", {"query_block": 3}), ("varlen", {"varlen_kernel": "reference"})):
        attention_against_trajectories(f, lay, backend, H=heads[0], Hk=heads[1], **kw)
    attention_against_trajectories(f, lay, "flex", grad=False, H=heads[0], Hk=heads[1])


def test_backends_on_the_fixed_scenarios():
    f = fixed_forest()
    lay = build_layout(f)
    for backend, kw in (("reference", {}), ("sdpa", {"query_block": 5}), ("varlen", {"varlen_kernel": "reference"})):
        attention_against_trajectories(f, lay, backend, **kw)
    attention_against_trajectories(f, lay, "flex", grad=False)
