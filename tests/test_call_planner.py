"""The KDA call planner against the brute-force judge, the model's rules, and bad input."""
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_harts.planner import baselines
from megatron_harts.planner.calls import CallPlan, plan_calls
from megatron_harts.planner.calls_bruteforce import (
    _min_calls_longest_path,
    brute_force_optimum,
    sequences_of_choice,
)

try:
    from megatron_harts import _C  # noqa: F401

    BACKENDS = ["python", "cpp"]
except ImportError:  # the extension is built by setup.py; without it only the reference runs
    BACKENDS = ["python"]


def forest_from_parents(parents, lengths):
    """(parent, start, length) lists; ``parents`` in preorder with parent < index."""
    start = []
    for i, p in enumerate(parents):
        start.append(0 if p < 0 else start[p] + lengths[p])
    return list(parents), start, list(lengths)


def random_forest(rng, n, B, new_root=0.1):
    """A random forest in DFS preorder with forks just before, at and after chunk boundaries.

    Each new segment hangs below a node of the current rightmost path (keeps preorder).  Half
    of the segments end at ``m*B + {-1, 0, +1, random}``, the rest get short or near-B lengths.
    """
    parent, start, length = [], [], []
    path = []
    for i in range(n):
        if not path or rng.random() < new_root:
            p, path = -1, []
        else:
            j = rng.randrange(len(path))
            p, path = path[j], path[: j + 1]
        s = 0 if p < 0 else start[p] + length[p]
        if rng.random() < 0.5:
            end = (s // B + rng.randint(0, 2)) * B + rng.choice([-1, 0, 1, rng.randint(1 - B, B - 1)])
            ln = max(1, end - s)
        else:
            ln = max(1, rng.choice([1, 1, 2, 3, B - 1, B, B + 1, rng.randint(1, 3 * B)]))
        parent.append(p)
        start.append(s)
        length.append(ln)
        path.append(i)
    return parent, start, length


def check_against_brute_force(parent, start, length, B, replay):
    expected = brute_force_optimum(parent, start, length, B, replay=replay)
    plans = []
    for backend in BACKENDS:
        plan = plan_calls(parent, start, length, B, backend=backend, replay=replay)
        plan.validate(parent, start, length, B)
        assert (plan.num_calls, plan.replay_tokens) == expected, (backend, parent, start, length, B)
        plans.append(plan)
    for other in plans[1:]:
        assert plans[0].same_as(other)


def test_random_small_forests_match_brute_force():
    rng = random.Random(20261129)
    for _ in range(4000):
        B = rng.choice([2, 4, 8])
        parent, start, length = random_forest(rng, rng.randint(1, 12), B)
        for replay in (True, False):
            check_against_brute_force(parent, start, length, B, replay)


@st.composite
def small_forests(draw):
    B = draw(st.sampled_from([1, 2, 3, 4, 8]))
    n = draw(st.integers(1, 9))
    parents = []
    path = []
    for i in range(n):
        if path and draw(st.integers(0, 9)) > 0:
            j = draw(st.integers(0, len(path) - 1))
            p, path = path[j], path[: j + 1]
        else:
            p, path = -1, []
        parents.append(p)
        path.append(i)
    lengths = draw(st.lists(st.integers(1, 2 * B + 1), min_size=n, max_size=n))
    return forest_from_parents(parents, lengths) + (B,)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_forests(), st.booleans())
def test_hypothesis_forests_match_brute_force(forest, replay):
    parent, start, length, B = forest
    check_against_brute_force(parent, start, length, B, replay)


def test_longest_path_equals_exhaustive_call_search():
    """The judge's shortcut (fewest calls = longest producer chain) against trying every call
    assignment, on tiny forests."""
    rng = random.Random(7)
    for _ in range(150):
        B = rng.choice([2, 4])
        parent, start, length = random_forest(rng, rng.randint(1, 6), B)
        a = brute_force_optimum(parent, start, length, B, exhaustive_calls=True)
        assert a == brute_force_optimum(parent, start, length, B)


def strahler_greedy(parent, start, length, B):
    """Continue the child of highest Strahler rank (ignores chunk boundaries)."""
    n = len(parent)
    kids = [[] for _ in range(n)]
    for i, p in enumerate(parent):
        if p >= 0:
            kids[p].append(i)
    rank = [1] * n
    for i in range(n - 1, -1, -1):
        if kids[i]:
            m = max(rank[c] for c in kids[i])
            rank[i] = m + (sum(rank[c] == m for c in kids[i]) >= 2)
    cont = [max(k, key=lambda c: (rank[c], -c)) if k else -1 for k in kids]
    seqs, seq_of = sequences_of_choice(parent, start, length, B, cont)
    return _min_calls_longest_path(seqs, seq_of), sum(r for _, r, _ in seqs)


def test_producer_above_parent_case_where_strahler_greedy_fails():
    # B = 8. Segment 1 = [9, 12) lies inside chunk [8, 16): its children's boundary state (at 8)
    # comes from the root, so they can run in call 1 even if segment 1 runs in call 1 as well.
    parent, start, length = forest_from_parents([-1, 0, 1, 1, 0, 4, 4], [9, 3, 1, 1, 7, 1, 8])
    assert brute_force_optimum(parent, start, length, 8) == (2, 5)
    assert strahler_greedy(parent, start, length, 8) == (3, 5)
    check_against_brute_force(parent, start, length, 8, True)
    for backend in BACKENDS:
        plan = plan_calls(parent, start, length, 8, backend=backend)
        calls = plan.segment_call.tolist()
        assert calls[0] == 0 and calls[1] == 1 and sorted(calls[2:4]) == [1, 1]


def test_replay_started_child_shares_its_parents_call():
    # B = 4: root [0, 5) forks at 5 into 1 = [5, 13) (children 2, 3 at 13) and 4 = [5, 6),
    # which lies inside chunk [4, 8) and forks at 6 into 5, 6.  Segment 1 continues the root
    # (call 0); segment 4 starts from the root's state at 4 in call 1, and its child that is
    # not continued takes the same state at 4 (produced in call 0), so it runs in call 1 too,
    # beside its own parent.
    parent, start, length = forest_from_parents([-1, 0, 1, 1, 0, 4, 4], [5, 8, 3, 3, 1, 3, 3])
    for backend in BACKENDS:
        plan = plan_calls(parent, start, length, 4, backend=backend)
        plan.validate(parent, start, length, 4)
        assert plan.num_calls == 2 and plan.replay_tokens == 1 + 1 + 2
        assert plan.segment_call.tolist() == [0, 0, 0, 1, 1, 1, 1]
        fresh = plan.segment_sequence[6]
        assert plan.seq_first_segment[fresh] == 6
        assert plan.seq_start[fresh] == 4 and plan.seq_semantic_start[fresh] == 6
        assert plan.seq_source[fresh] == plan.segment_sequence[0]
    assert brute_force_optimum(parent, start, length, 4) == (2, 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_path_is_one_call_without_replay(backend):
    parent, start, length = forest_from_parents([-1, 0, 1, 2], [5, 64, 3, 100])
    plan = plan_calls(parent, start, length, 64, backend=backend)
    plan.validate(parent, start, length, 64)
    assert plan.num_calls == 1 and plan.replay_tokens == 0 and plan.num_sequences == 1
    assert plan.seq_segments.tolist() == [0, 1, 2, 3]
    assert plan.seq_end.tolist() == [172]


@pytest.mark.parametrize("backend", BACKENDS)
def test_forest_trees_share_calls(backend):
    rng = random.Random(3)
    trees = []
    while len(trees) < 3:
        t = random_forest(rng, 9, 4, new_root=0.0)
        calls = plan_calls(*t, 4, backend=backend).num_calls
        if not trees or calls != trees[-1][1]:
            trees.append((t, calls))
    parent, start, length = [], [], []
    for (p, s, l), _ in trees:
        off = len(parent)
        parent += [x + off if x >= 0 else -1 for x in p]
        start += s
        length += l
    plan = plan_calls(parent, start, length, 4, backend=backend)
    plan.validate(parent, start, length, 4)
    assert plan.num_calls == max(c for _, c in trees)
    assert plan.replay_tokens == sum(plan_calls(*t, 4, backend=backend).replay_tokens for t, _ in trees)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_replay_starts_at_fork(backend):
    rng = random.Random(11)
    for _ in range(50):
        parent, start, length = random_forest(rng, 30, 8)
        plan = plan_calls(parent, start, length, 8, backend=backend, replay=False)
        plan.validate(parent, start, length, 8)
        assert plan.replay_tokens == 0
        assert np.array_equal(plan.seq_start, plan.seq_semantic_start)
        with_replay = plan_calls(parent, start, length, 8, backend=backend)
        assert with_replay.num_calls <= plan.num_calls


@pytest.mark.parametrize("backend", BACKENDS)
def test_deep_chain_no_recursion(backend):
    n = 100_000
    parent = np.arange(-1, n - 1, dtype=np.int64)
    length = np.full(n, 3, dtype=np.int64)
    start = np.arange(n, dtype=np.int64) * 3
    plan = plan_calls(parent, start, length, 64, backend=backend)
    assert plan.num_calls == 1 and plan.num_sequences == 1 and plan.replay_tokens == 0
    plan.validate(parent, start, length, 64)
    # a deep caterpillar: every spine segment also has a leaf child
    parent = np.empty(2 * n, dtype=np.int64)
    parent[0::2] = np.arange(-2, 2 * n - 2, 2)
    parent[0] = -1
    parent[1::2] = np.arange(0, 2 * n, 2)
    length = np.full(2 * n, 5, dtype=np.int64)
    start = np.zeros(2 * n, dtype=np.int64)
    start[0::2] = np.arange(n) * 5
    start[1::2] = np.arange(1, n + 1) * 5
    plan = plan_calls(parent, start, length, 4, backend=backend)
    assert plan.num_calls == 2
    plan.validate(parent, start, length, 4)


def test_large_random_tree_backends_agree():
    rng = random.Random(5)
    parent, start, length = random_forest(rng, 100_000, 64, new_root=0.0005)
    plans = [plan_calls(parent, start, length, 64, backend=b) for b in BACKENDS]
    plans[0].validate(parent, start, length, 64)
    for other in plans[1:]:
        assert plans[0].same_as(other)
    assert 1 < plans[0].num_calls < 20


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "parent,start,length,B,match",
    [
        ([-1, 1], [0, 4], [4, 2], 4, r"segment 1: parent 1 must be -1 or a segment index < 1"),
        ([-1, -2], [0, 0], [4, 2], 4, r"segment 1: parent -2"),
        ([-1, 0], [0, 4], [4, 0], 4, r"segment 1: length must be >= 1, got 0"),
        ([-1, 0], [0, 5], [4, 2], 4, r"segment 1: start 5 must equal start\[parent\] \+ length\[parent\] = 4"),
        ([-1, 0, -1], [0, 4, 3], [4, 2, 1], 4, r"segment 2: start must be 0 for a root, got 3"),
        ([-1, 0], [0, 4], [4, 2], 0, r"chunk_size must be >= 1, got 0"),
        ([-1, 0, 0, 5], [0, 9, 4, 0], [4, 2, 2, 1], 4, r"segment 3: parent 5"),  # parents first
        ([-1, 0], [0, 4, 5], [4, 2], 4, r"same size, got 2, 3, 2"),
    ],
)
def test_bad_input_errors(backend, parent, start, length, B, match):
    with pytest.raises(ValueError, match=match):
        if backend == "python":
            plan_calls(parent, start, length, B, backend=backend)
        else:  # the compiled core checks by itself, with the same messages
            as64 = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
            _C.plan_calls(as64(parent), as64(start), as64(length), B, True)
    with pytest.raises(ValueError, match=match):
        plan_calls(parent, start, length, B, backend=backend, replay=False)


@pytest.mark.skipif("cpp" not in BACKENDS, reason="extension not built")
def test_cpp_module_validates_by_itself():
    with pytest.raises(ValueError, match=r"segment 2: length must be >= 1, got -3"):
        _C.plan_calls(np.array([-1, 0, 1]), np.array([0, 4, 6]), np.array([4, 2, -3]), 4, True)


def test_bad_backend_and_non_integer_input():
    with pytest.raises(ValueError, match="backend"):
        plan_calls([-1], [0], [1], 4, backend="gpu")
    with pytest.raises(ValueError, match="length must hold integers"):
        plan_calls([-1], [0], [1.5], 4)


def test_empty_forest():
    for backend in BACKENDS:
        plan = plan_calls([], [], [], 64, backend=backend)
        plan.validate([], [], [], 64)
        assert plan.num_calls == 0 and plan.num_sequences == 0


def test_validate_rejects_broken_plans():
    parent, start, length = forest_from_parents([-1, 0, 0], [6, 2, 3])
    plan = plan_calls(parent, start, length, 4, backend="python")
    plan.validate(parent, start, length, 4)
    arrays = {f: np.array(getattr(plan, f)) for f in CallPlan.ARRAY_FIELDS}
    same_call = dict(arrays, seq_call=np.zeros_like(arrays["seq_call"]))
    same_call["call_offsets"] = np.array([0, plan.num_sequences])
    broken = CallPlan.from_arrays(1, plan.replay_tokens, 4, True, same_call)
    with pytest.raises(AssertionError, match="earlier call"):
        broken.validate(parent, start, length, 4)
    no_export = dict(arrays, seq_exports_offsets=np.zeros_like(arrays["seq_exports_offsets"]),
                     seq_export_positions=np.zeros(0, np.int64), seq_export_segment=np.zeros(0, np.int64))
    broken = CallPlan.from_arrays(plan.num_calls, plan.replay_tokens, 4, True, no_export)
    with pytest.raises(AssertionError, match="exports differ"):
        broken.validate(parent, start, length, 4)
    wrong_replay = CallPlan.from_arrays(plan.num_calls, plan.replay_tokens + 1, 4, True, arrays)
    with pytest.raises(AssertionError, match="replay_tokens"):
        wrong_replay.validate(parent, start, length, 4)
    with pytest.raises(ValueError):
        plan.seq_call[0] = 5  # plans are read-only


def test_plan_fields_on_a_known_tree():
    # B = 4: root [0, 6) forks at 6 into [6, 9) and [6, 7); the second forks at 7 into two.
    parent, start, length = forest_from_parents([-1, 0, 0, 2, 2], [6, 3, 1, 2, 2])
    plan = plan_calls(parent, start, length, 4, backend="python")
    plan.validate(parent, start, length, 4)
    assert plan.num_calls == 2
    assert plan.replay_tokens == 2 + 3
    assert plan.call_offsets.tolist() == [0, 1, 3]
    assert plan.seq_first_segment.tolist() == [0, 2, 4]
    assert plan.seq_segments_offsets.tolist() == [0, 2, 4, 5]
    assert plan.seq_segments.tolist() == [0, 1, 2, 3, 4]
    assert plan.seq_start.tolist() == [0, 4, 4]
    assert plan.seq_semantic_start.tolist() == [0, 6, 7]
    assert plan.seq_end.tolist() == [9, 9, 9]
    assert plan.seq_source.tolist() == [-1, 0, 0]
    assert plan.seq_exports_offsets.tolist() == [0, 1, 1, 1]
    assert plan.seq_export_positions.tolist() == [4] and plan.seq_export_segment.tolist() == [0]


def test_baselines_on_a_known_tree():
    # root [0,10) -> a [10,20) (one child: a trajectory ends there) -> b [20,30);
    # root -> c [10,12) which forks into d [12,15) and e [12,40)
    parent, start, length = forest_from_parents([-1, 0, 1, 0, 3, 3], [10, 10, 10, 2, 3, 28])
    res = baselines.all_baselines(parent, start, length, 8)
    assert res["node_wise"] == {"calls": 3, "replay_tokens": 0, "tokens_computed": 63}
    assert res["per_depth"] == {"calls": 3, "replay_tokens": 0, "tokens_computed": 63}
    assert res["expanded"] == {"calls": 1, "replay_tokens": 0, "tokens_computed": 20 + 30 + 15 + 40}
    assert res["harts_no_replay"] == {"calls": 2, "replay_tokens": 0, "tokens_computed": 63}
    assert res["harts"] == {"calls": 2, "replay_tokens": 2 + 4, "tokens_computed": 69}
    chain = forest_from_parents([-1, 0, 1, 1], [4, 4, 4, 4])
    assert baselines.per_depth_bucketing(*chain)["calls"] == 2
    assert baselines.node_wise(*chain)["calls"] == 3


def test_baselines_order_on_random_forests():
    rng = random.Random(9)
    for _ in range(100):
        B = rng.choice([4, 8, 64])
        f = random_forest(rng, 40, B)
        r = baselines.all_baselines(*f, B)
        assert r["harts"]["calls"] <= r["harts_no_replay"]["calls"] <= r["per_depth"]["calls"]
        assert r["per_depth"]["calls"] <= r["node_wise"]["calls"]
        assert r["harts"]["tokens_computed"] <= r["expanded"]["tokens_computed"] + r["harts"]["replay_tokens"]


def strahler_numbers(parent):
    n = len(parent)
    best = [0] * n
    ties = [0] * n
    rank = [1] * n
    for i in range(n - 1, -1, -1):
        if best[i]:
            rank[i] = best[i] + (ties[i] >= 2)
        p = parent[i]
        if p >= 0:
            if rank[i] > best[p]:
                best[p], ties[p] = rank[i], 1
            elif rank[i] == best[p]:
                ties[p] += 1
    return rank


def test_no_replay_calls_equal_strahler_number_on_large_forests():
    """Without replay every fork state comes from the parent, and the fewest calls is the
    largest Strahler number of a root (an independent check beyond brute-force sizes)."""
    rng = random.Random(13)
    for _ in range(20):
        B = rng.choice([4, 64])
        parent, start, length = random_forest(rng, 2000, B, new_root=0.002)
        rank = strahler_numbers(parent)
        want = max(rank[i] for i in range(len(parent)) if parent[i] < 0)
        for backend in BACKENDS:
            assert plan_calls(parent, start, length, B, backend=backend, replay=False).num_calls == want


def test_random_legal_plans_never_beat_the_planner():
    """Random continuation choices (legal plans, evaluated by the judge's own rules) on forests
    too large for brute force never need fewer calls or less replay at equal calls."""
    rng = random.Random(17)
    for _ in range(40):
        B = rng.choice([4, 8])
        parent, start, length = random_forest(rng, 60, B)
        plan = plan_calls(parent, start, length, B)
        kids = [[] for _ in parent]
        for i, p in enumerate(parent):
            if p >= 0:
                kids[p].append(i)
        for _ in range(30):
            cont = [rng.choice([-1] + k) if k else -1 for k in kids]
            seqs, seq_of = sequences_of_choice(parent, start, length, B, cont)
            key = (_min_calls_longest_path(seqs, seq_of), sum(r for _, r, _ in seqs))
            assert (plan.num_calls, plan.replay_tokens) <= key
