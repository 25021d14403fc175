"""Compaction in the synthetic generator: events exactly where the live context would pass the
budget, shared by rollouts that share a history, seeded; ``none`` unchanged."""
import hashlib

import numpy as np
import pytest

from megatron_harts.tree_data import build_forest, write_jsonl
from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe

BUDGET = 1024
KNOBS = dict(context_budget=BUDGET, keep_prefix=64, keep_last=200, evict_chunk=128, summary_tokens=48)
SMALL = dict(num_tasks=2, samples_per_task=2, prompt_median=300, action_median=100, observation_median=200,
             max_tokens=5000, branch_prob=0.5, seed=2, **KNOBS)
STRATEGIES = ["sliding-window", "markovian", "summary"]


def evicted_before(t, j, upto):
    """bool[j]: positions [0, j) evicted by the events of ``t`` with at <= ``upto``."""
    out = np.zeros(j, dtype=bool)
    for at, a, b in events(t):
        if at <= upto:
            out[a:min(b, j)] = True
    return out


def events(t):
    return [] if t.compactions is None else [tuple(e) for e in t.compactions.tolist()]


def event_times(t):
    return sorted({e[0] for e in events(t)})


def live_counts(t):
    """Per position j: the keys it attends to (itself included) under the events with at <= j,
    and under those with at < j (an event's span ends at or before its ``at``)."""
    times = event_times(t)
    union = [0] + [int(evicted_before(t, p, p).sum()) for p in times]   # after 0, 1, ... event times
    k = np.searchsorted(np.asarray(times, dtype=np.int64), np.arange(len(t)), side="right")
    j1 = np.arange(1, len(t) + 1)
    before = np.searchsorted(np.asarray(times, dtype=np.int64), np.arange(len(t)), side="left")
    return j1 - np.asarray(union)[k], j1 - np.asarray(union)[before]


@pytest.fixture(scope="module", params=[(s, c) for s in ("tree-step", "step-wise") for c in STRATEGIES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def generated(request):
    scheme, comp = request.param
    return scheme, comp, synthesize_swe(SweConfig(scheme=scheme, compaction=comp, **SMALL))


def test_live_context_within_budget_and_every_event_needed(generated):
    scheme, comp, trajs = generated
    assert sum(len(event_times(t)) for t in trajs) > 0
    for t in trajs:
        seen, seen_before = live_counts(t)
        assert seen.max() <= BUDGET, t.id
        times = event_times(t)
        for k, p in enumerate(times):
            nxt = times[k + 1] if k + 1 < len(times) else len(t)
            # under the earlier events only, the last token before the next event would see too many
            assert seen_before[p] + (nxt - 1 - p) > BUDGET, (t.id, p)
            if comp == "sliding-window":  # exactly at the first token that would see budget + 1
                assert seen_before[p] == BUDGET + 1 and seen[p] == BUDGET + 1 - KNOBS["evict_chunk"]


def test_strategy_keeps_what_it_says(generated):
    scheme, comp, trajs = generated
    kp = KNOBS["keep_prefix"]
    for t in trajs:
        for p in event_times(t):
            kept = np.flatnonzero(~evicted_before(t, p, p))
            if comp == "markovian":
                expect = np.concatenate([np.arange(kp), np.arange(p - KNOBS["keep_last"], p)])
            elif comp == "summary":
                expect = np.arange(kp)
                bridge = slice(p, p + KNOBS["summary_tokens"])
                assert len(t) >= bridge.stop
                if scheme == "tree-step":  # a bridge is policy output: targets
                    assert t.loss_mask[bridge].all() and (t.old_logprobs[bridge] < 0).all()
            else:
                continue
            assert np.array_equal(kept, expect), (t.id, p)


def _lcp(a, b):
    m = min(len(a), len(b))
    ne = np.flatnonzero(a.tokens[:m] != b.tokens[:m])
    return int(ne[0]) if ne.size else m


@pytest.mark.parametrize("comp", STRATEGIES)
def test_rollouts_sharing_a_history_share_its_events(comp):
    trajs = synthesize_swe(SweConfig(scheme="tree-step", compaction=comp, **SMALL))
    shared_events = 0
    for i, a in enumerate(trajs):
        for b in trajs[i + 1:]:
            if a.group != b.group:
                continue
            n = _lcp(a, b)
            ea = sorted(e for e in events(a) if e[0] < n)
            assert ea == sorted(e for e in events(b) if e[0] < n), (a.id, b.id)
            shared_events += len(ea)
            if comp == "summary":  # both compact after the same history: the same bridge follows
                for p in set(event_times(a)) & set(event_times(b)):
                    if p <= n:
                        assert n >= p + KNOBS["summary_tokens"], (a.id, b.id, p)
    assert shared_events > 0
    st = build_forest(trajs).stats()
    assert st["compression"] > 1.5
    assert st["compaction_events_tree"] < st["compaction_events"]
    # a fork below an event: some segment after the first event of its path has two children
    f = build_forest(trajs)
    fork_after_event = [s for s in range(f.num_segments) if f.children(s).size >= 2
                        and any(f.seg_evt_offsets[q + 1] > f.seg_evt_offsets[q] for q in f.segment_path(s))]
    assert fork_after_event


def test_step_wise_steps_nest_with_their_events():
    trajs = synthesize_swe(SweConfig(scheme="step-wise", compaction="summary", **SMALL))
    by_sample = {}
    for t in trajs:
        by_sample.setdefault(t.id.rsplit("/", 1)[0], []).append(t)
    bridges_trained = 0
    for steps in by_sample.values():
        for a, b in zip(steps, steps[1:]):
            assert np.array_equal(b.tokens[: len(a)], a.tokens) and b.loss_mask[: len(a)].sum() == 0
            assert [e for e in events(b) if e[0] < len(a)] == events(a)
        for t in steps:  # a bridge is a target in the step that generated it
            for p in event_times(t):
                if t.loss_mask[p]:
                    bridges_trained += 1
                    assert t.loss_mask[p: p + KNOBS["summary_tokens"]].all()
    assert bridges_trained > 0
    assert build_forest(trajs).stats()["compression"] > 3


def _bytes(tmp_path, name, cfg):
    path = tmp_path / name
    write_jsonl(synthesize_swe(cfg), str(path))
    return path.read_bytes()


@pytest.mark.parametrize("comp", STRATEGIES)
def test_seeded(tmp_path, comp):
    cfg = dict(SMALL, scheme="tree-step", compaction=comp, num_tasks=1)
    a = _bytes(tmp_path, "a.jsonl", SweConfig(**cfg))
    assert a == _bytes(tmp_path, "b.jsonl", SweConfig(**cfg))
    assert a != _bytes(tmp_path, "c.jsonl", SweConfig(**dict(cfg, seed=3)))


# sha256 of the JSONL the generator wrote before compaction existed (same config, same writer)
NONE_SHA256 = {
    "tree-step": "96ad34a36879a70c37f1f06ab2521f1d3e1d81114dc36f72bfd8a694576d12c6",
    "step-wise": "89bae1bbde492d9bd0c2e12d7d80b11b166106786f26e06d0af5afdc3416f51a",
}


@pytest.mark.parametrize("scheme", sorted(NONE_SHA256))
def test_none_is_the_generator_without_compaction(tmp_path, scheme):
    cfg = SweConfig(scheme=scheme, num_tasks=2, samples_per_task=2, prompt_median=200, max_tokens=2500,
                    branch_prob=0.5, seed=5, context_budget=64)  # the budget is unused without compaction
    data = _bytes(tmp_path, "n.jsonl", cfg)
    assert hashlib.sha256(data).hexdigest() == NONE_SHA256[scheme]
    assert b"compactions" not in data


@pytest.mark.parametrize("bad, match", [
    (dict(compaction="bogus"), "compaction must be one of"),
    (dict(context_budget=0), "context_budget must be >= 1"),
    (dict(compaction="sliding-window", context_budget=300, keep_prefix=200, evict_chunk=128), "evict_chunk"),
    (dict(compaction="markovian", context_budget=300, keep_prefix=100, keep_last=200), "keep_last"),
    (dict(compaction="summary", context_budget=300, keep_prefix=200, summary_tokens=100), "summary_tokens"),
    (dict(keep_prefix=-1), "keep_prefix must be >= 0"),
])
def test_invalid_compaction_config(bad, match):
    with pytest.raises(ValueError, match=match):
        SweConfig(**bad).validate()


FORKS = dict(num_tasks=3, samples_per_task=4, prompt_median=300, action_median=100, observation_median=200,
             max_tokens=6000, max_turns=200, seed=3, **KNOBS)


def common_prefix(a, b):
    n = min(len(a), len(b))
    d = np.flatnonzero(a.tokens[:n] != b.tokens[:n])
    return int(d[0]) if len(d) else n


def test_forking_groups_mix_strategies_and_fork_after_events():
    """synthesize_forks: each group under its strategy (the live context within the budget, the
    strategy's own events), every later trace forking from an earlier one of its group and sharing
    the events before its fork, some forks after events; seeded."""
    from megatron_harts.tree_data.synthetic import synthesize_forks
    trajs = synthesize_forks(SweConfig(**FORKS), STRATEGIES)
    groups = {}
    for t in trajs:
        groups.setdefault(t.group, []).append(t)
    assert list(groups) == ["task0", "task1", "task2"] and all(len(g) == 4 for g in groups.values())
    after = 0
    for g, (name, members) in enumerate(groups.items()):
        strategy = STRATEGIES[g]
        for t in members:
            assert len(t) <= FORKS["max_tokens"] and live_counts(t)[0].max() <= BUDGET, t.id
            for at, a, b in events(t):
                if strategy == "sliding-window":
                    assert b - a == KNOBS["evict_chunk"]
                elif strategy == "markovian":
                    assert at - b == KNOBS["keep_last"]
                else:                       # summary: everything after the prefix up to the event
                    assert b == at and t.loss_mask[at:at + KNOBS["summary_tokens"]].all()
        for j in range(1, len(members)):
            t = members[j]
            fork = max(common_prefix(t, m) for m in members[:j])
            assert 0 < fork < len(t), t.id                     # forks from its group, then runs on
            parent = max(members[:j], key=lambda m: common_prefix(t, m))
            inherited = [e for e in events(t) if e[0] < fork]
            assert inherited == [e for e in events(parent) if e[0] < fork]
            after += bool(inherited)
    assert after >= 2
    again = synthesize_forks(SweConfig(**FORKS), STRATEGIES)
    assert [t.tokens.tobytes() for t in again] == [t.tokens.tobytes() for t in trajs]
    assert [events(t) for t in again] == [events(t) for t in trajs]
    # a strategy's knobs are checked: markovian cannot keep more than the budget holds
    with pytest.raises(ValueError, match="keep_last"):
        synthesize_forks(SweConfig(**{**FORKS, "keep_last": BUDGET}), ["summary", "markovian"])
