"""Compact layout: every field against brute force over the expanded trajectories."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_harts.layout import (Visibility, build_layout, scatter_targets_to_expanded,
                                   scatter_to_expanded, scatter_to_expanded_padded)
from megatron_harts.tree_data import build_forest, make_trajectory
from test_forest import trajectory_sets


def forest_of(records):
    return build_forest([make_trajectory(r, line=i + 1) for i, r in enumerate(records)])


def expanded(forest, layout):
    """Per layout trajectory: (Trajectory as given, its forest rows for all positions)."""
    out = []
    for t, tid in enumerate(layout.traj_ids):
        out.append((forest.expand(tid), forest.trajectory_rows(forest.trajectory_index(tid))))
    return out


def brute_targets(forest, layout):
    """Sorted (row, token, traj, position, weight, old_logprob, advantage) from the trajectories."""
    frow_to_row = {int(r): i for i, r in enumerate(layout.forest_rows.tolist())}
    got = []
    for t, (tr, frows) in enumerate(expanded(forest, layout)):
        s = int(layout.traj_start[t])
        for j in range(s + 1, len(tr)):
            if tr.loss_mask[j] != 1:
                continue
            old = float(tr.old_logprobs[j]) if tr.old_logprobs is not None else math.nan
            if isinstance(tr.advantage, np.ndarray):
                adv = float(tr.advantage[j])
            elif tr.advantage is None:
                adv = math.nan
            else:
                adv = float(tr.advantage)
            w = 1.0 if tr.weight is None else tr.weight
            got.append((frow_to_row[int(frows[j - 1])], int(tr.tokens[j]), t, j, w, old, adv))
    return sorted(got, key=lambda x: (x[0], x[1], x[2]))


def same_float(a, b):
    return (math.isnan(a) and math.isnan(b)) or a == b


def check_layout(forest, layout, tree_rows=None):
    """Every field of a layout of whole trees or subtrees (with context) against brute force."""
    R = layout.num_rows
    fr = layout.forest_rows.numpy()
    assert np.all(np.diff(fr) > 0)
    np.testing.assert_array_equal(layout.tokens.numpy(), forest.tokens[fr])
    if tree_rows is not None:
        np.testing.assert_array_equal(fr, tree_rows)
    local = {int(r): i for i, r in enumerate(fr)}
    ctx_fr = layout.ctx_forest_rows.numpy()
    ctx = {int(r): i for i, r in enumerate(ctx_fr)}
    occurrence = np.zeros(R, dtype=np.int64)
    ancestors = [set() for _ in range(R)]        # local rows on each row's path
    ctx_ancestors = [set() for _ in range(R)]    # context rows on each row's path
    exp = expanded(forest, layout)
    for t, (tr, frows) in enumerate(exp):
        s = int(layout.traj_start[t])
        assert int(layout.traj_length[t]) == len(tr)
        rows = layout.trajectory_rows(t).numpy()
        # the expanded -> compact map and what it implies for tokens, positions, prev
        assert all(int(f) in ctx for f in frows[:s]) and all(int(f) in local for f in frows[s:])
        np.testing.assert_array_equal(rows, [local[int(f)] for f in frows[s:]])
        np.testing.assert_array_equal(layout.tokens[rows].numpy(), tr.tokens[s:])
        np.testing.assert_array_equal(layout.position_ids[rows].numpy(), np.arange(s, len(tr)))
        np.testing.assert_array_equal(layout.prev[rows[1:]].numpy(), rows[:-1])
        assert int(layout.prev[rows[0]]) == -1
        expect_ext = ctx[int(frows[s - 1])] if s > 0 else -1
        assert int(layout.prev_external[rows[0]]) == expect_ext
        # the context chain reproduces the trajectory's prefix, root first
        c = expect_ext
        chain = []
        while c >= 0:
            chain.append(c)
            c = int(layout.ctx_prev[c])
        np.testing.assert_array_equal(ctx_fr[chain[::-1]], frows[:s])
        np.testing.assert_array_equal(layout.ctx_position_ids.numpy()[chain[::-1]], np.arange(s))
        occurrence[np.unique(rows)] += 1
        for j, r in enumerate(rows):
            ancestors[r].update(rows[:j + 1].tolist())
            ctx_ancestors[r].update(chain)
    assert set(layout.prev_external.numpy()[layout.prev.numpy() >= 0].tolist()) <= {-1}
    np.testing.assert_array_equal(layout.occurrence.numpy(), occurrence)
    assert occurrence.min() >= 1
    # visibility: k sees q iff k is on q's path; for whole subtrees one interval [k, end[k])
    vis = layout.visibility.validate()
    dense = np.zeros((R, R), dtype=bool)
    for q in range(R):
        dense[q, sorted(ancestors[q])] = True
    np.testing.assert_array_equal(vis.dense().numpy(), dense)
    np.testing.assert_array_equal(layout.vis_offsets.numpy(), np.arange(R + 1))
    np.testing.assert_array_equal(layout.vis_start.numpy(), np.arange(R))
    cvis = layout.context_visibility.validate("context_visibility")
    cdense = np.zeros((R, layout.num_context_rows), dtype=bool)
    for q in range(R):
        cdense[q, sorted(ctx_ancestors[q])] = True
    np.testing.assert_array_equal(cvis.dense().numpy(), cdense)
    # targets and pairs
    want = brute_targets(forest, layout)
    got = list(zip(layout.target_row.tolist(), layout.target_token.tolist(), layout.target_traj.tolist(),
                   layout.target_position.tolist(), layout.target_weight.tolist(),
                   layout.target_old_logprob.tolist(), layout.target_advantage.tolist()))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g[:5] == w[:5] and same_float(g[5], w[5]) and same_float(g[6], w[6]), (g, w)
    pairs = sorted({(g[0], g[1]) for g in got})
    assert list(zip(layout.pair_row.tolist(), layout.pair_token.tolist())) == pairs
    tp = layout.target_pair
    np.testing.assert_array_equal(layout.pair_row[tp].numpy(), layout.target_row.numpy())
    np.testing.assert_array_equal(layout.pair_token[tp].numpy(), layout.target_token.numpy())
    np.testing.assert_array_equal(layout.target_position.numpy(), layout.position_ids[layout.target_row].numpy() + 1)
    # segment table (layout-local) and row <-> segment <-> tree
    S = layout.num_segments
    assert np.all(layout.seg_parent < np.arange(S))
    np.testing.assert_array_equal(layout.seg_row, np.concatenate([[0], np.cumsum(layout.seg_length)[:-1]]))
    np.testing.assert_array_equal(np.repeat(np.arange(S), layout.seg_length), layout.row_segment.numpy())
    np.testing.assert_array_equal(layout.seg_start, layout.position_ids[layout.seg_row].numpy())
    np.testing.assert_array_equal(forest.seg_row[layout.seg_forest], fr[layout.seg_row])
    for s in range(S):
        p = layout.seg_parent[s]
        first = layout.seg_row[s]
        assert int(layout.prev[first]) == (-1 if p < 0 else layout.seg_row[p] + layout.seg_length[p] - 1)
        through = {t for t in range(layout.num_trajectories) if first in set(layout.trajectory_rows(t).tolist())}
        assert through == set(range(layout.seg_traj_lo[s], layout.seg_traj_hi[s]))
    roots = np.flatnonzero(layout.seg_parent < 0)
    np.testing.assert_array_equal(layout.tree_seg_offsets[:-1], roots)
    np.testing.assert_array_equal(layout.seg_forest[roots], layout.tree_roots)
    np.testing.assert_array_equal(layout.tree_row_offsets, np.append(layout.seg_row[roots], R))
    np.testing.assert_array_equal(np.repeat(np.arange(layout.num_trees), np.diff(layout.tree_row_offsets)),
                                  layout.row_tree.numpy())
    # expanded round trips
    flat, off = scatter_to_expanded(layout, layout.tokens)
    np.testing.assert_array_equal(flat.numpy(), np.concatenate([tr.tokens[int(layout.traj_start[t]):]
                                                                 for t, (tr, _) in enumerate(exp)]))
    np.testing.assert_array_equal(off.numpy(), np.concatenate([[0], np.cumsum(
        [len(tr) - int(layout.traj_start[t]) for t, (tr, _) in enumerate(exp)])]))
    padded = scatter_to_expanded_padded(layout, layout.position_ids.double(), pad=-1.0)
    for t, (tr, _) in enumerate(exp):
        s = int(layout.traj_start[t])
        np.testing.assert_array_equal(padded[t, :len(tr) - s].numpy(), np.arange(s, len(tr)))
        assert bool((padded[t, len(tr) - s:] == -1).all())
    vals = torch.arange(layout.num_targets, dtype=torch.float64) + 0.5
    tpad = scatter_targets_to_expanded(layout, vals, padded=True)
    for i, (row, tok, t, pos, *_rest) in enumerate(got):
        assert float(tpad[t, pos - int(layout.traj_start[t])]) == i + 0.5
    assert int((~torch.isnan(tpad)).sum()) == layout.num_targets
    tflat, _ = scatter_targets_to_expanded(layout, vals.numpy(), fill=-1.0)
    np.testing.assert_array_equal(np.sort(tflat[tflat >= 0]), vals.numpy())


@settings(max_examples=60, deadline=None)
@given(trajectory_sets())
def test_whole_forest_layout(trajs):
    f = build_forest(trajs)
    lay = build_layout(f)
    assert lay.num_trees == f.num_trees and lay.num_trajectories == f.num_trajectories
    np.testing.assert_array_equal(lay.seg_parent, f.seg_parent)
    np.testing.assert_array_equal(lay.seg_start, f.seg_start)
    np.testing.assert_array_equal(lay.seg_row, f.seg_row)
    check_layout(f, lay, tree_rows=np.arange(f.num_rows))


@settings(max_examples=40, deadline=None)
@given(trajectory_sets(), st.data())
def test_layout_of_some_trees(trajs, data):
    f = build_forest(trajs)
    trees = data.draw(st.lists(st.integers(0, f.num_trees - 1), min_size=1, max_size=f.num_trees, unique=True))
    lay = build_layout(f, trees)
    rows = np.concatenate([np.arange(f.seg_row[f.tree_offsets[i]],
                                     f.seg_row[f.tree_offsets[i + 1] - 1] + f.seg_length[f.tree_offsets[i + 1] - 1])
                           for i in sorted(trees)])
    check_layout(f, lay, tree_rows=rows)
    assert lay.num_context_rows == 0


def outermost(f, candidates):
    """The candidate segments that lie in no other candidate's subtree, in preorder."""
    size = f.seg_subtree_size
    roots = []
    for s in sorted(int(c) for c in candidates):
        if not roots or s >= roots[-1] + size[roots[-1]]:
            roots.append(s)
    return roots


def non_nested_roots(f, data, max_size=4):
    """A drawn set of segments none of which lies in another's subtree (consumer subtree roots)."""
    cand = data.draw(st.lists(st.integers(0, f.num_segments - 1), min_size=1, max_size=max_size, unique=True))
    return outermost(f, cand)


@settings(max_examples=60, deadline=None)
@given(trajectory_sets(), st.data())
def test_subtree_layout_with_producer_context(trajs, data):
    f = build_forest(trajs)
    producer = build_layout(f)
    roots = non_nested_roots(f, data)
    lay = build_layout(f, roots=roots[::-1], context=producer)
    size = f.seg_subtree_size
    rows = np.concatenate([np.arange(f.seg_row[s], f.seg_row[s + size[s] - 1] + f.seg_length[s + size[s] - 1])
                           for s in roots])
    check_layout(f, lay, tree_rows=rows)
    np.testing.assert_array_equal(producer.forest_rows[lay.ctx_source_rows].numpy(), lay.ctx_forest_rows.numpy())
    # the consumer's targets are the producer's targets on the same rows
    mine = set(lay.forest_rows.tolist())
    pt = [(int(producer.forest_rows[r]), int(tok), producer.traj_ids[t])
          for r, tok, t in zip(producer.target_row, producer.target_token, producer.target_traj)
          if int(producer.forest_rows[r]) in mine]
    ct = [(int(lay.forest_rows[r]), int(tok), lay.traj_ids[t])
          for r, tok, t in zip(lay.target_row, lay.target_token, lay.target_traj)]
    assert sorted(pt, key=repr) == sorted(ct, key=repr)


def test_fork_end_inside_and_single_token_segments():
    f = forest_of([
        {"id": "a", "tokens": [5, 1, 2, 3], "loss_mask": [0, 1, 1, 1], "advantage": [0, 1, 2, 3.0],
         "old_logprobs": [0, -1, -2, -3.0]},
        {"id": "b", "tokens": [5, 1, 2, 4], "loss_mask": [0, 0, 1, 1], "advantage": 7.0, "weight": 0.5},
        {"id": "c", "tokens": [5, 1], "loss_mask": [0, 1]},             # ends inside a's and b's path
        {"id": "d", "tokens": [9]},                                   # a one-token tree
    ])
    lay = build_layout(f)
    check_layout(f, lay)
    # rows: 5 1 | 2 | 3 | 4 | 9 ; segment [5 1] splits at c's end: [5 1] [2] [3] [4]
    assert lay.tokens.tolist() == [5, 1, 2, 3, 4, 9]
    assert lay.occurrence.tolist() == [3, 3, 2, 1, 1, 1]
    assert lay.vis_end.tolist() == [5, 5, 5, 4, 5, 6]
    # the fork row 2 predicts 3 for a and 4 for b: two pairs on one row
    row2 = [(int(tk), lay.traj_ids[int(t)]) for r, tk, t in zip(lay.target_row, lay.target_token, lay.target_traj)
            if int(r) == 2]
    assert row2 == [(3, "a"), (4, "b")]
    # row 0 -> 1 for a and c (b's mask is 0 there), row 1 -> 2 for a and b, row 2 -> 3 and 4
    assert lay.pair_row.tolist() == [0, 1, 2, 2]
    assert sorted(zip(lay.pair_row.tolist(), lay.pair_token.tolist())) == [(0, 1), (1, 2), (2, 3), (2, 4)]


def test_depth_one_forest():
    f = forest_of([{"id": i, "tokens": [i]} for i in range(4)])
    lay = build_layout(f)
    check_layout(f, lay)
    assert lay.num_targets == 0 and lay.num_pairs == 0
    assert lay.prev.tolist() == [-1] * 4 and lay.vis_end.tolist() == [1, 2, 3, 4]


def test_to_device_moves_tensors_only():
    f = forest_of([{"id": "a", "tokens": [1, 2, 3]}, {"id": "b", "tokens": [1, 2, 4]}])
    lay = build_layout(f)
    meta = lay.to("meta")
    assert meta.tokens.device.type == "meta" and meta.vis_end.device.type == "meta"
    assert meta.target_advantage.device.type == "meta" and meta.ctx_prev.device.type == "meta"
    assert isinstance(meta.seg_parent, np.ndarray) and meta.traj_ids == lay.traj_ids
    assert lay.tokens.device.type == "cpu"


def test_bad_input_names_the_argument():
    f = forest_of([{"id": "a", "tokens": [1, 2, 3]}, {"id": "b", "tokens": [1, 2, 4]}, {"id": "c", "tokens": [7]}])
    with pytest.raises(ValueError, match="trees"):
        build_layout(f, [5])
    with pytest.raises(ValueError, match="trees"):
        build_layout(f, [0, 0])
    with pytest.raises(ValueError, match="trees"):
        build_layout(f, [])
    with pytest.raises(ValueError, match="trees and roots"):
        build_layout(f, [0], roots=[0])
    with pytest.raises(ValueError, match="roots"):
        build_layout(f, roots=[0, 1])             # nested
    with pytest.raises(ValueError, match="context"):
        build_layout(f, roots=[1])                # has ancestors, no producer
    with pytest.raises(ValueError, match="context"):
        build_layout(f, roots=[1], context=build_layout(f, [1]))   # producer lacks the rows
    with pytest.raises(ValueError, match="context"):
        build_layout(f, roots=[1], context="producer")
    with pytest.raises(ValueError, match="forest"):
        build_layout([1, 2])
    lay = build_layout(f)
    with pytest.raises(ValueError, match="values"):
        scatter_to_expanded(lay, torch.zeros(lay.num_rows + 1))
    with pytest.raises(ValueError, match="values"):
        scatter_targets_to_expanded(lay, torch.zeros(lay.num_targets + 1))
    bad = Visibility(torch.tensor([0, 1, 2]), torch.tensor([0, 0]), torch.tensor([2, 2]), 2)
    with pytest.raises(ValueError, match="vis: row 1's first interval"):
        bad.validate("vis")
    overlap = Visibility(torch.tensor([0, 2]), torch.tensor([0, 1]), torch.tensor([2, 3]), 3, causal=False)
    with pytest.raises(ValueError, match="sorted and disjoint"):
        overlap.validate()
    with pytest.raises(ValueError, match="empty"):
        Visibility(torch.tensor([0, 1]), torch.tensor([1]), torch.tensor([1]), 3, causal=False).validate()


def test_construction_is_vectorized_on_a_swe_forest():
    """A realistic forest builds, and its layout passes the cheap structural checks."""
    from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe
    cfg = SweConfig(num_tasks=2, samples_per_task=3, prompt_median=60, action_median=8, observation_median=12,
                    min_turns=2, max_turns=4, max_tokens=400, seed=3)
    f = build_forest(synthesize_swe(cfg))
    lay = build_layout(f)
    assert lay.num_rows == f.num_rows and int(lay.occurrence.sum()) == int(f.traj_length.sum())
    assert lay.num_expanded_tokens == int(f.traj_length.sum())
    flat, _ = scatter_to_expanded(lay, lay.tokens)
    np.testing.assert_array_equal(flat.numpy(), np.concatenate([f.expand(t).tokens for t in lay.traj_ids]))
    lm = np.concatenate([f.expand(t).loss_mask[1:] for t in lay.traj_ids])
    assert lay.num_targets == int(lm.sum())


def _ancestors(f, s):
    out = []
    a = int(f.seg_parent[s])
    while a >= 0:
        out.append(a)
        a = int(f.seg_parent[a])
    return out


def _seg_rows(f, segs):
    return np.concatenate([np.arange(f.seg_row[s], f.seg_row[s] + f.seg_length[s]) for s in sorted(segs)]) \
        if len(segs) else np.zeros(0, dtype=np.int64)


def check_segment_layout(f, lay, segs, owned):
    """A ``segments=`` layout against brute force over every forest trajectory."""
    fr = lay.forest_rows.numpy()
    np.testing.assert_array_equal(fr, _seg_rows(f, segs))
    local = {int(r): i for i, r in enumerate(fr)}
    ctx = {int(r): i for i, r in enumerate(lay.ctx_forest_rows.numpy())}
    owned_rows = set(_seg_rows(f, owned).tolist())
    row_seg = np.searchsorted(f.seg_row, np.arange(f.tokens.shape[0]), side="right") - 1
    occ = (f.seg_traj_hi - f.seg_traj_lo)[row_seg]
    np.testing.assert_array_equal(lay.occurrence.numpy(), occ[fr])
    np.testing.assert_array_equal(lay.tokens.numpy(), f.tokens[fr])
    want, trajs = [], []
    R = lay.num_rows
    dense = np.zeros((R, R), dtype=bool)
    cdense = np.zeros((R, lay.num_context_rows), dtype=bool)
    for ti, tid in enumerate(f.traj_ids):
        tr = f.expand(tid)
        frows = f.trajectory_rows(ti)
        held = [j for j, r in enumerate(frows) if int(r) in local]
        for j in range(1, len(tr)):
            if tr.loss_mask[j] == 1 and int(frows[j - 1]) in owned_rows:
                old = float(tr.old_logprobs[j]) if tr.old_logprobs is not None else math.nan
                adv = float(tr.advantage[j]) if isinstance(tr.advantage, np.ndarray) else \
                    (math.nan if tr.advantage is None else float(tr.advantage))
                want.append((local[int(frows[j - 1])], int(tr.tokens[j]), tid, j,
                             1.0 if tr.weight is None else tr.weight, old, adv))
        if not held:
            continue
        s, n = held[0], len(held)
        assert held == list(range(s, s + n)), "a trajectory's held positions are one run"
        assert all(int(r) in ctx for r in frows[:s])
        trajs.append(tid)
        t = lay.traj_ids.index(tid)
        rows = lay.trajectory_rows(t).numpy()
        assert int(lay.traj_start[t]) == s and int(lay.traj_length[t]) == len(tr)
        np.testing.assert_array_equal(rows, [local[int(r)] for r in frows[s:s + n]])
        np.testing.assert_array_equal(lay.position_ids[rows].numpy(), np.arange(s, s + n))
        np.testing.assert_array_equal(lay.prev[rows].numpy(), np.concatenate([[-1], rows[:-1]]))
        assert int(lay.prev_external[rows[0]]) == (ctx[int(frows[s - 1])] if s else -1)
        for j, r in enumerate(rows):
            dense[r, rows[:j + 1]] = True
            cdense[r, [ctx[int(x)] for x in frows[:s]]] = True
    assert sorted(lay.traj_ids, key=repr) == sorted(trajs, key=repr)
    np.testing.assert_array_equal(lay.visibility.validate().dense().numpy(), dense)
    np.testing.assert_array_equal(lay.context_visibility.validate("cv").dense().numpy(), cdense)
    got = [(int(r), int(tok), lay.traj_ids[int(t)], int(p), w, o, a) for r, tok, t, p, w, o, a in zip(
        lay.target_row, lay.target_token, lay.target_traj, lay.target_position, lay.target_weight.tolist(),
        lay.target_old_logprob.tolist(), lay.target_advantage.tolist())]
    key = lambda x: (x[0], x[1], repr(x[2]))
    assert len(got) == len(want)
    for g, w in zip(sorted(got, key=key), sorted(want, key=key)):
        assert g[:4] == w[:4] and all(same_float(a, b) for a, b in zip(g[4:], w[4:])), (g, w)
    np.testing.assert_array_equal(lay.pair_row[lay.target_pair].numpy(), lay.target_row.numpy())


@settings(max_examples=60, deadline=None)
@given(trajectory_sets(), st.data())
def test_segment_set_layout(trajs, data):
    """Computed segment sets: recomputed ancestors, owned subsets, context from a producer."""
    f = build_forest(trajs)
    S = f.num_segments
    producer = build_layout(f)
    pick = lambda: data.draw(st.lists(st.integers(0, S - 1), max_size=4, unique=True))
    ctx = set()                                  # ancestor-closed context set
    for s in pick():
        ctx.update([s] + _ancestors(f, s))
    base = [s for s in pick() + [data.draw(st.integers(0, S - 1))] if s not in ctx]
    if not base:
        return
    segs = set(base)
    for s in base:
        segs.update(a for a in _ancestors(f, s) if a not in ctx)
    owned = data.draw(st.lists(st.sampled_from(sorted(segs)), unique=True))
    lay = build_layout(f, segments=sorted(segs)[::-1], owned=owned, context=producer if ctx else None)
    check_segment_layout(f, lay, segs, owned)
    whole = build_layout(f, segments=range(S))   # all segments, all owned: the whole-forest layout
    ref = build_layout(f)
    for name in ("forest_rows", "prev", "target_row", "target_token", "target_traj", "traj_rows", "vis_end"):
        assert torch.equal(getattr(whole, name), getattr(ref, name)), name


@settings(max_examples=40, deadline=None)
@given(trajectory_sets(), st.data())
def test_segment_partition_covers_every_target_once(trajs, data):
    """Owned segments partitioned over layouts (ancestors recomputed): every target exactly once."""
    f = build_forest(trajs)
    group = [data.draw(st.integers(0, 2)) for _ in range(f.num_segments)]
    ref = build_layout(f)
    want = sorted(zip(ref.forest_rows[ref.target_row].tolist(), ref.target_token.tolist(),
                      [repr(ref.traj_ids[t]) for t in ref.target_traj.tolist()], ref.target_position.tolist()))
    got = []
    for g in range(3):
        owned = [s for s in range(f.num_segments) if group[s] == g]
        if not owned:
            continue
        segs = set(owned)
        for s in owned:
            segs.update(_ancestors(f, s))
        lay = build_layout(f, segments=sorted(segs), owned=owned)
        got += zip(lay.forest_rows[lay.target_row].tolist(), lay.target_token.tolist(),
                   [repr(lay.traj_ids[t]) for t in lay.target_traj.tolist()], lay.target_position.tolist())
    assert sorted(got) == want


def test_segment_set_refusals():
    f = forest_of([{"id": "a", "tokens": [1, 2, 3, 4]}, {"id": "b", "tokens": [1, 2, 5, 6]},
                   {"id": "c", "tokens": [1, 2, 5, 7]}])
    # segments: 0 = [1, 2], 1 = [3, 4], 2 = [5], 3 = [6], 4 = [7]
    assert f.num_segments == 5 and list(f.seg_parent) == [-1, 0, 0, 2, 2]
    producer = build_layout(f)
    with pytest.raises(ValueError, match="owned: segment 1 is not in segments"):
        build_layout(f, segments=[0], owned=[1])
    with pytest.raises(ValueError, match="owned applies"):
        build_layout(f, owned=[0])
    with pytest.raises(ValueError, match="roots and segments"):
        build_layout(f, roots=[0], segments=[0])
    with pytest.raises(ValueError, match="segments"):
        build_layout(f, segments=[9])
    with pytest.raises(ValueError, match="context"):
        build_layout(f, segments=[1, 3])              # parents 0 and 2 are context, no producer
    with pytest.raises(ValueError, match="above external context"):
        build_layout(f, segments=[0, 3], context=producer)   # 2 external below the computed 0
    lay = build_layout(f, segments=[1, 3], context=producer)
    check_segment_layout(f, lay, {1, 3}, {1, 3})


def _mixed_tensors():
    base = torch.arange(24, dtype=torch.int64).view(4, 6)
    return [base[:, ::2],                                      # not contiguous
            torch.tensor(7, dtype=torch.int32),                # 0-d
            torch.zeros(0, 3, dtype=torch.float64),            # empty
            torch.tensor([True, False, True]),
            torch.tensor([1.5, float("nan"), -0.0], dtype=torch.float64),
            torch.arange(5, dtype=torch.int16),
            torch.randn(3, 2, dtype=torch.bfloat16)]


def _bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_staged_bytes_give_the_tensors_back_bit_for_bit():
    """``stage_bytes`` puts tensors of any dtype, shape and stride at aligned offsets of one buffer;
    ``unstage_bytes`` views them back: the same dtypes, shapes and bits (NaN and -0.0 included)."""
    from megatron_harts.layout import _STAGE_ALIGN, stage_bytes, unstage_bytes
    ts = _mixed_tensors()
    buf, offsets = stage_bytes(ts)
    assert buf.dtype == torch.uint8 and all(o % _STAGE_ALIGN == 0 for o in offsets)
    assert offsets == sorted(offsets) and buf.numel() >= sum(t.numel() * t.element_size() for t in ts)
    back = unstage_bytes(buf, offsets, ts)
    for t, b in zip(ts, back):
        assert b.dtype == t.dtype and b.shape == t.shape and b.is_contiguous()
        assert torch.equal(_bits(b), _bits(t))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_to_device_many_equals_one_copy_each():
    from megatron_harts.layout import host_to_device, host_to_device_many
    ts = _mixed_tensors() + [torch.ones(2, device="cuda")]
    many = host_to_device_many(ts + [None], "cuda")
    assert len(many) == len(ts) + 1 and many[-1] is None
    for t, m in zip(ts, many):
        one = host_to_device(t, "cuda")
        assert m.device.type == "cuda" and m.dtype == one.dtype and m.shape == one.shape
        assert torch.equal(_bits(m.cpu()), _bits(one.cpu()))


def test_host_to_device_many_passes_none_through():
    from megatron_harts.layout import host_to_device_many
    a, b = torch.arange(3), torch.ones(2, dtype=torch.bool)
    out = host_to_device_many([a, None, b, None], "cpu")
    assert out[1] is None and out[3] is None and torch.equal(out[0], a) and torch.equal(out[2], b)


def test_target_order_is_lexsorted_with_or_without_the_combined_key():
    """Targets sort by (row, token, trajectory): the one-key sort where the key fits 63 bits, the
    three-key lexsort where it would not; both give lexsort's order."""
    from megatron_harts.layout import _target_order
    rng = np.random.default_rng(0)
    for hi_tok in (50, 2 ** 40):            # the second overflows the combined key
        row = rng.integers(0, 30, 500)
        token = rng.integers(0, hi_tok, 500)
        traj = rng.permutation(500)
        want = np.lexsort((traj, token, row))
        np.testing.assert_array_equal(_target_order(row, token, traj), want)
    assert _target_order(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)).size == 0


def test_overlay_at_some_positions_equals_the_whole_overlay_there():
    from megatron_harts.layout import _overlay
    from megatron_harts.tree_data.forest import Exceptions
    rng = np.random.default_rng(1)
    lengths = np.array([5, 0, 7, 3])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    start = np.array([2, 0, 0, 4])
    traj_local = np.array([1, 3, 4, 9])
    exc = Exceptions(traj=np.array([0, 1, 1, 4, 4, 4, 9, 9]), pos=np.array([3, 2, 6, 0, 6, 9, 4, 6]),
                     value=np.arange(8, dtype=np.float64) + 100)
    values = rng.normal(size=int(offsets[-1]))
    whole = _overlay(values, exc, traj_local, offsets, start, lengths)
    assert (whole != values).sum() == 6           # all but trajectory 0's (not ours) and (4, 9) (past the run)
    at = np.array([0, 4, 5, 9, 11, 12])
    np.testing.assert_array_equal(_overlay(values[at], exc, traj_local, offsets, start, lengths, at=at), whole[at])
