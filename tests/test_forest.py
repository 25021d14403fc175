"""Forest construction: round trips, compression, segment boundaries, layout invariants."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_harts.tree_data import Trajectory, build_forest, make_trajectory


@st.composite
def trajectory_sets(draw, max_traj=10, max_len=12, vocab=3):
    """Small random rollout sets: a tiny vocabulary makes shared prefixes and forks likely."""
    n = draw(st.integers(1, max_traj))
    use_groups = draw(st.booleans())
    base = draw(st.lists(st.integers(0, vocab - 1), min_size=max_len, max_size=max_len))
    trajs = []
    for i in range(n):
        # most trajectories start from a common base so that they share prefixes
        cut = draw(st.integers(0, max_len))
        tail = draw(st.lists(st.integers(0, vocab - 1), min_size=0, max_size=max_len - cut))
        tokens = base[:cut] + tail
        if not tokens:
            tokens = [draw(st.integers(0, vocab - 1))]
        rec = {"id": f"t{i}" if draw(st.booleans()) else i, "tokens": tokens}
        L = len(tokens)
        if draw(st.booleans()):
            rec["loss_mask"] = [0] + draw(st.lists(st.integers(0, 1), min_size=L - 1, max_size=L - 1))
        if draw(st.booleans()):
            # mostly position-determined values so shared rows agree, sometimes not
            jitter = draw(st.booleans())
            rec["old_logprobs"] = [-(j + 0.25) - (0.5 if jitter and j % 3 == 0 else 0.0) for j in range(L)]
        adv = draw(st.sampled_from(["none", "scalar", "token"]))
        if adv == "scalar":
            rec["advantage"] = draw(st.floats(-3, 3, allow_nan=False))
        elif adv == "token":
            rec["advantage"] = [float(j % 2) for j in range(L)]
        if draw(st.booleans()):
            rec["reward"] = draw(st.floats(0, 1, allow_nan=False))
        if draw(st.booleans()):
            rec["weight"] = 0.5
        if use_groups:
            rec["group"] = draw(st.sampled_from(["g0", "g1"]))
        trajs.append(make_trajectory(rec, file="mem.jsonl", line=i + 1))
    ids = [t.id for t in trajs]
    if len(set(map(repr, ids))) != len(ids) or len(set(ids)) != len(ids):
        for i, t in enumerate(trajs):
            t.id = f"u{i}"
    return trajs


def assert_same_trajectory(a: Trajectory, b: Trajectory):
    assert a.id == b.id
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
    assert (a.old_logprobs is None) == (b.old_logprobs is None)
    if a.old_logprobs is not None:
        assert a.old_logprobs.tobytes() == b.old_logprobs.tobytes()
    if isinstance(a.advantage, np.ndarray):
        assert a.advantage.tobytes() == b.advantage.tobytes()
    else:
        assert a.advantage == b.advantage
    assert (a.reward, a.weight, a.group, a.parent) == (b.reward, b.weight, b.group, b.parent)


def scope_of(t):
    return t.group


def check_forest_invariants(f, trajs):
    S = f.num_segments
    # preorder: parents first, subtrees contiguous, trees contiguous
    assert np.all(f.seg_parent < np.arange(S))
    size = f.seg_subtree_size
    for s in range(S):
        sub = np.arange(s + 1, s + size[s])
        # every segment in the range descends from s
        for c in sub:
            p = c
            while p > s:
                p = f.seg_parent[p]
            assert p == s
    roots = np.flatnonzero(f.seg_parent < 0)
    np.testing.assert_array_equal(f.tree_offsets[:-1], roots)
    # path positions are consistent
    for s in range(S):
        p = f.seg_parent[s]
        assert f.seg_start[s] == (0 if p < 0 else f.seg_start[p] + f.seg_length[p])
        assert f.seg_length[s] >= 1
    # trajectories through a segment: exactly the contiguous range
    for s in range(S):
        through = set(range(f.seg_traj_lo[s], f.seg_traj_hi[s]))
        expect = {t for t in range(f.num_trajectories) if s in f.segment_path(int(f.traj_leaf[t]))}
        assert through == expect


def check_segment_boundaries(f, trajs):
    """Segments split exactly at forks and at trajectory ends."""
    by_id = {t.id: t for t in trajs}

    def sharing(prefix, scope):
        return frozenset(t.id for t in trajs if scope_of(t) == scope and len(t) >= len(prefix)
                         and tuple(t.tokens[:len(prefix)]) == prefix)

    for s in range(f.num_segments):
        tid = f.traj_ids[f.seg_traj_lo[s]]
        t = by_id[tid]
        a, L = int(f.seg_start[s]), int(f.seg_length[s])
        first = sharing(tuple(t.tokens[:a + 1]), scope_of(t))
        last = sharing(tuple(t.tokens[:a + L]), scope_of(t))
        assert first == last == frozenset(f.segment_trajectories(s))
        # maximal: the next token on any path changes the sharing set (fork or end)
        kids = f.children(s)
        ends_here = any(f.traj_length[x] == a + L for x in range(f.seg_traj_lo[s], f.seg_traj_hi[s]))
        assert ends_here or len(kids) != 1
        # children start with distinct tokens (a fork, not a split run)
        heads = [int(f.segment_tokens(c)[0]) for c in kids]
        assert len(set(heads)) == len(heads)


@settings(max_examples=150, deadline=None)
@given(trajectory_sets())
def test_build_expand_round_trip(trajs):
    f = build_forest(trajs)
    for t in trajs:
        assert_same_trajectory(f.expand(t.id), t)
    for i in range(f.num_trees):
        tree = f.tree(i)
        for tid in tree.traj_ids:
            assert_same_trajectory(tree.expand(tid), next(t for t in trajs if t.id == tid))


@settings(max_examples=150, deadline=None)
@given(trajectory_sets())
def test_compression_and_unique_tokens(trajs):
    f = build_forest(trajs)
    st_ = f.stats()
    prefixes = {(scope_of(t), tuple(t.tokens[:j + 1])) for t in trajs for j in range(len(t))}
    assert st_["unique_tokens"] == len(prefixes)
    assert st_["expanded_tokens"] == sum(len(t) for t in trajs)
    assert st_["compression"] == st_["expanded_tokens"] / st_["unique_tokens"]
    assert st_["num_trajectories"] == len(trajs)
    assert st_["num_trees"] == len({(scope_of(t), int(t.tokens[0])) for t in trajs})
    assert st_["max_trajectory_tokens"] == max(len(t) for t in trajs)


@settings(max_examples=100, deadline=None)
@given(trajectory_sets())
def test_segments_split_exactly_at_forks_and_ends(trajs):
    f = build_forest(trajs)
    check_forest_invariants(f, trajs)
    check_segment_boundaries(f, trajs)


def test_hand_built_example():
    mk = lambda i, toks: make_trajectory({"id": i, "tokens": toks})  # noqa: E731
    f = build_forest([mk("a", [1, 2, 3, 4]), mk("b", [1, 2, 3, 5]), mk("c", [1, 2]), mk("d", [9])])
    assert f.num_trees == 2
    # [1,2] (c ends), [3] shared by a,b, then forks [4] and [5]; [9] its own tree
    assert [f.segment_tokens(s).tolist() for s in range(f.num_segments)] == [[1, 2], [3], [4], [5], [9]]
    assert f.seg_parent.tolist() == [-1, 0, 1, 1, -1]
    assert f.stats()["max_depth"] == 3
    assert f.stats()["compression"] == 11 / 6


def test_duplicate_token_sequences_share_everything():
    mk = lambda i: make_trajectory({"id": i, "tokens": [4, 5, 6], "advantage": float(i)})  # noqa: E731
    f = build_forest([mk(0), mk(1), mk(2)])
    assert f.num_segments == 1 and f.num_rows == 3
    assert [f.expand(i).advantage for i in range(3)] == [0.0, 1.0, 2.0]


def test_groups_do_not_merge():
    mk = lambda i, g: make_trajectory({"id": i, "tokens": [1, 2, 3], "group": g})  # noqa: E731
    f = build_forest([mk("a", "x"), mk("b", "y"), mk("c", "x")])
    assert f.num_trees == 2 and f.num_rows == 6


def test_explicit_parent_links_are_used_and_checked():
    recs = [{"id": "p", "tokens": [1, 2, 3, 4], "group": "g"},
            {"id": "c", "tokens": [1, 2, 7], "parent": {"id": "p", "at": 2}}]
    trajs = [make_trajectory(r) for r in recs]
    f = build_forest(trajs)
    # the child inherits the parent's group scope, so it shares the parent's prefix
    assert f.num_trees == 1 and f.num_rows == 5
    assert f.expand("c").parent == ("p", 2)


def test_step_wise_exceptions_stay_small():
    from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe

    trajs = synthesize_swe(SweConfig(scheme="step-wise", num_tasks=2, samples_per_task=2, prompt_median=200,
                                     max_tokens=4000))
    f = build_forest(trajs)
    # only each step's own action differs from the longest trajectory's context copy
    own_targets = sum(int(t.loss_mask.sum()) for t in trajs)
    assert len(f.exc_loss_mask.traj) <= own_targets
    for t in trajs:
        assert_same_trajectory(f.expand(t.id), t)
