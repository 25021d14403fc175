"""Compaction events (KV-streams eviction) in the data layer: read, validated, merged into trees
only where events agree, kept per segment and per trajectory, stored on disk, counted."""
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_harts.tree_data import TreeDataset, build_forest, read_trajectories, write_dataset
from megatron_harts.tree_data.errors import TreeFormatError
from megatron_harts.tree_data.trajectory import make_trajectory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def traj(tid, tokens, events=None, **kw):
    rec = {"id": tid, "tokens": tokens, **kw}
    if events is not None:
        rec["compactions"] = [{"at": p, "start": a, "end": b} for p, a, b in events]
    return make_trajectory(rec)


def brute_visible(n, events):
    """Per-trajectory mask from the definition: query i sees key j iff j <= i and no event with
    at <= i evicts j."""
    m = np.tril(np.ones((n, n), dtype=bool))
    for p, a, b in events:
        m[p:, a:b] = False
    return m


def shared_positions(f, t1, t2):
    """Number of leading positions two trajectories share (the same rows)."""
    r1 = f.trajectory_rows(f.trajectory_index(t1))
    r2 = f.trajectory_rows(f.trajectory_index(t2))
    m = min(len(r1), len(r2))
    ne = np.flatnonzero(r1[:m] != r2[:m])
    return int(ne[0]) if ne.size else m


@pytest.mark.parametrize("bad, message", [
    ([{"at": 3, "start": 2, "end": 2}], "must be greater than start"),
    ([{"at": 3, "start": 2, "end": 1}], "must be greater than start"),
    ([{"at": 2, "start": 0, "end": 3}], "is after at"),
    ([{"at": 6, "start": 0, "end": 1}], "not a token index"),
    ([{"at": 3, "start": -1, "end": 1}], "negative"),
    ([{"at": 3.0, "start": 0, "end": 1}], "not an integer"),
    ([{"at": True, "start": 0, "end": 1}], "not an integer"),
    ([{"at": 3, "start": 0}], "has no 'end'"),
    ([[3, 0, 1]], "not an object"),
    ({"at": 3, "start": 0, "end": 1}, "must be a list"),
    ([{"at": 3, "start": 0, "end": 1, "tokens_evicted": 1}], "unknown keys"),
])
def test_bad_events_name_file_line_trajectory_and_field(tmp_path, bad, message):
    path = tmp_path / "r.jsonl"
    good = {"id": "ok", "tokens": [1, 2, 3, 4, 5, 6]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({"id": "t7", "tokens": [1, 2, 3, 4, 5, 6],
                                                           "compactions": bad}) + "\n")
    with pytest.raises(TreeFormatError) as e:
        read_trajectories([str(path)])
    err = e.value
    assert (err.file, err.line, err.trajectory, err.field) == (str(path), 2, "t7", "compactions")
    assert message in str(err)


def test_bad_events_make_the_converter_exit_2_and_write_nothing(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"id": "t1", "tokens": [1, 2, 3], "compactions": [{"at": 1, "start": 0, "end": 2}]})
                    + "\n")
    out = tmp_path / "ds"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_trajectories.py"), "--input", str(path),
                        "--output", str(out)], capture_output=True, text=True)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error:")
    assert "'compactions'" in r.stderr and "t1" in r.stderr
    assert not any(p.name.startswith("ds") for p in tmp_path.iterdir())


def test_events_are_a_known_field_and_read_from_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": "a", "tokens": [1, 2, 3, 4], "compactions": [{"at": 3, "start": 0, "end": 2}]},
            {"id": "b", "tokens": [1, 2, 5], "compactions": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "r.parquet")
    jsonl = tmp_path / "r.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # no "ignored unknown fields" warning
        from_parquet = read_trajectories([str(tmp_path / "r.parquet")])
        from_jsonl = read_trajectories([str(jsonl)])
    for a, b in zip(from_parquet, from_jsonl):
        assert (a.compactions is None) == (b.compactions is None)
        if a.compactions is not None:
            assert a.compactions.tolist() == b.compactions.tolist() == [[3, 0, 2]]


def test_expand_returns_the_events_exactly_as_given():
    events = [(5, 1, 3), (3, 0, 1), (5, 1, 3), (5, 0, 2)]       # out of order, a repeat, a shared `at`
    f = build_forest([traj("a", list(range(1, 9)), events), traj("b", list(range(1, 9)) + [9], events[::-1]),
                      traj("c", [4, 4])])
    assert f.expand("a").compactions.tolist() == [list(e) for e in events]
    assert f.expand("b").compactions.tolist() == [list(e) for e in events[::-1]]
    assert f.expand("c").compactions is None
    # the same set of events: a and b share their whole common prefix
    assert shared_positions(f, "a", "b") == 8
    seg = f.traj_leaf[f.trajectory_index("a")]
    stored = np.concatenate([f.segment_events(s) for s in f.segment_path(int(seg))])
    assert stored.tolist() == [[3, 0, 1], [5, 0, 2], [5, 1, 3]]


def test_sharing_rule_forks_where_events_differ():
    base = [1, 2, 3, 4, 5, 6, 7, 8]
    f = build_forest([
        traj("ev", base, [(4, 0, 2)]),
        traj("same", base[:6] + [9, 9], [(4, 0, 2)]),     # same event, forks later: shares 6 positions
        traj("none", base),                               # sibling without the event: forks at the event
        traj("other", base, [(4, 1, 2)]),                 # another span at the same position
        traj("later", base, [(5, 0, 2)]),                 # the event one position later
        traj("earlier", base, [(3, 0, 2)]),               # one position earlier
        traj("short", base[:4]),                          # ends just before the event: shares all of itself
        traj("inside", base[:6], [(4, 0, 2)]),            # ends inside the compacted path
        traj("inside-none", base[:6]),                    # ends inside it, without the event
    ])
    assert shared_positions(f, "ev", "same") == 6
    assert shared_positions(f, "ev", "none") == 4
    assert shared_positions(f, "ev", "other") == 4
    assert shared_positions(f, "ev", "later") == 4
    assert shared_positions(f, "none", "later") == 5
    assert shared_positions(f, "ev", "earlier") == 3
    assert shared_positions(f, "ev", "short") == 4
    assert shared_positions(f, "ev", "inside") == 6
    assert shared_positions(f, "none", "inside-none") == 6
    assert shared_positions(f, "inside", "inside-none") == 4
    # each segment holds exactly the events at its positions, and every trajectory expands exactly
    for s in range(f.num_segments):
        ev = f.segment_events(s)
        assert ((ev[:, 0] >= f.seg_start[s]) & (ev[:, 0] < f.seg_start[s] + f.seg_length[s])).all()
    for tid in f.traj_ids:
        t = f.expand(tid)
        assert t.tokens.tolist()[:4] == base[:4]


def test_dataset_round_trip_keeps_events_and_its_checksums_cover_them(tmp_path):
    f = build_forest([traj("a", [1, 2, 3, 4, 5], [(3, 0, 2)]), traj("b", [1, 2, 3, 4, 6], [(3, 0, 2), (4, 1, 2)]),
                      traj("c", [7, 8, 9])])
    write_dataset(f, str(tmp_path / "ds"))
    ds = TreeDataset(str(tmp_path / "ds"))
    assert ds.version == 2
    g = ds.forest()
    for tid in f.traj_ids:
        assert g.expand(tid).compactions is None if f.expand(tid).compactions is None else \
            g.expand(tid).compactions.tolist() == f.expand(tid).compactions.tolist()
    assert g.stats() == f.stats()
    tree = ds[0] if ds[0].num_trajectories == 2 else ds[1]
    assert tree.num_events == 2 and tree.stats()["compaction_events"] == 3
    # flip one byte of the events: the tree's checksum names it
    evt_at_offset = ds.header["bin"]["evt_at"][0]
    data = bytearray((tmp_path / "ds.bin").read_bytes())
    data[evt_at_offset] ^= 1
    (tmp_path / "ds.bin").write_bytes(bytes(data))
    with pytest.raises(TreeFormatError, match="corrupt"):
        TreeDataset(str(tmp_path / "ds")).forest()


def test_version_1_datasets_still_read():
    ds = TreeDataset(os.path.join(ROOT, "tests", "data", "format_v1"))
    assert ds.version == 1
    f = ds.forest()
    assert not f.has_compactions and f.num_trajectories == 3
    assert f.expand("a").tokens.tolist() == [1, 2, 3, 4] and f.expand("a").compactions is None
    assert f.stats()["visible_pairs_tree"] == (1 + 2 + 3 + 4) + 3 + (1 + 2)  # rows 1,2,3,4 | 5 (position 2) | 7,8


def test_select_keeps_each_trees_events():
    f = build_forest([traj("a", [1, 2, 3, 4], [(2, 0, 1)], group="x"), traj("b", [5, 6, 7], [(2, 1, 2)], group="y"),
                      traj("c", [5, 6, 8], group="y")])
    for i in range(f.num_trees):
        t = f.tree(i)
        for tid in t.traj_ids:
            assert (t.expand(tid).compactions is None) == (f.expand(tid).compactions is None)
    both = f.select([1, 0])
    assert both.num_events == f.num_events
    assert both.stats() == f.stats()


@st.composite
def forests_with_events(draw):
    n = draw(st.integers(1, 5))
    base = draw(st.lists(st.integers(0, 2), min_size=2, max_size=10))
    trajs = []
    for i in range(n):
        cut = draw(st.integers(1, len(base)))
        tail = draw(st.lists(st.integers(0, 2), max_size=4))
        tokens = base[:cut] + tail
        if len(tokens) < 2:
            tokens = tokens + [1]
        events = []
        for _ in range(draw(st.integers(0, 3))):
            p = draw(st.integers(1, len(tokens) - 1))
            a = draw(st.integers(0, p - 1))
            b = draw(st.integers(a + 1, p))
            events.append((p, a, b))
        trajs.append(traj(f"t{i}", tokens, events or None))
    return trajs


@settings(max_examples=40, deadline=None)
@given(forests_with_events())
def test_visible_pairs_and_evicted_counts_equal_brute_force(trajs):
    f = build_forest(trajs)
    evicted = f.row_evicted()
    pairs_expanded = 0
    for t in trajs:
        ev = [] if t.compactions is None else t.compactions.tolist()
        m = brute_visible(len(t), ev)
        pairs_expanded += int(m.sum())
        rows = f.trajectory_rows(f.trajectory_index(t.id))
        assert (np.arange(len(t)) + 1 - evicted[rows]).tolist() == m.sum(axis=1).tolist()
        back = f.expand(t.id)
        assert back.tokens.tolist() == t.tokens.tolist()
        assert (back.compactions is None) == (t.compactions is None)
        if t.compactions is not None:
            assert back.compactions.tolist() == t.compactions.tolist()
    # trajectories sharing a row agree on its tokens and events up to it (the sharing rule)
    for s in range(f.num_segments):
        lo, hi = int(f.seg_traj_lo[s]), int(f.seg_traj_hi[s])
        end = int(f.seg_start[s] + f.seg_length[s])
        sets = set()
        for t in range(lo, hi):
            tr = f.expand(f.traj_ids[t])
            ev = set() if tr.compactions is None else {tuple(e) for e in tr.compactions.tolist() if e[0] < end}
            sets.add((tuple(tr.tokens[:end].tolist()), frozenset(ev)))
        assert len(sets) == 1
    stats = f.stats()
    assert stats["visible_pairs_expanded"] == pairs_expanded
    seg_of_row = np.repeat(np.arange(f.num_segments), f.seg_length)
    pos = np.arange(f.num_rows) - np.repeat(f.seg_row, f.seg_length) + f.seg_start[seg_of_row]
    assert stats["visible_pairs_tree"] == int((pos + 1 - evicted).sum())
    assert stats["compaction_events"] == sum(0 if t.compactions is None else len(t.compactions) for t in trajs)
