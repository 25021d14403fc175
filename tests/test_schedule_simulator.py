"""megatron_harts/schedules/simulator.py (pipeline schedules of sharing windows, simulated),
megatron_harts/plotting.py (PNG writer) and tools/simulate_schedule.py.

Hand-timed steps, the invariants of every schedule on random steps (hypothesis), what the
comparisons between schedules do and do not guarantee, steps built from plans against
``windowed_microbatches``, input errors, the PNG writer and the CLI.
"""
import json
import math
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_harts.plotting import blank, draw_text, fill_rect, text_width, write_png
from megatron_harts.schedules.simulator import (SCHEDULES, Event, ScheduleResult, StepMicrobatch,
                                                _classic_1f1b, c1f1b_depths, draw_timeline,
                                                makespan_lower_bound, schedule_ops, simulate,
                                                step_from_plan, step_windows, timeline_image)
from megatron_harts.tree_data import build_forest, write_jsonl
from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe

from tool_runner import assert_one_error, load_tool, run_tool


def mb(f, b, producer=None, export=0.0, tokens=0):
    return StepMicrobatch(float(f), float(b), producer=producer, export_bytes=float(export), tokens=tokens)


def window_step(S, consumers=3, export=10.0):
    """A producer and ``consumers`` consumers; every op costs 1 (forward) or 2 (backward) per stage."""
    return [mb(S, 2 * S, export=export)] + [mb(S, 2 * S, producer=0) for _ in range(consumers)]


# ---------------------------------------------------------------------------------------------
# hand-timed steps
# ---------------------------------------------------------------------------------------------

def test_1f1b_four_plain_microbatches_on_two_stages():
    step = [mb(2, 4) for _ in range(4)]          # per stage: forward 1, backward 2
    one_f_one_b = [[("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)],
                   [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]]
    run_ahead = [[("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("B", 1), ("B", 2), ("B", 3)], one_f_one_b[1]]
    for name in SCHEDULES:
        r = simulate(step, 2, name)
        assert r.ops_per_stage == (run_ahead if name == "overlap" else one_f_one_b)
        assert r.makespan == pytest.approx(15.0)           # (m + S - 1) (f + b)
        assert r.bubble_fraction == pytest.approx(1 / 5)   # (S - 1) / (m + S - 1)
        assert r.peak_windows_alive == [0, 0] and r.peak_export_bytes == [0.0, 0.0]
    r = simulate(step, 2, "consumer-1f1b")
    assert [(e.start, e.end) for e in r.events[1]] == [(1, 2), (2, 4), (4, 5), (5, 7), (7, 8), (8, 10), (10, 11),
                                                      (11, 13)]
    assert [(e.start, e.end) for e in r.events[0]] == [(0, 1), (1, 2), (4, 6), (6, 7), (7, 9), (9, 10), (10, 12),
                                                      (13, 15)]
    assert r.peak_in_flight == [2, 1] and r.busy == [12.0, 12.0]


@pytest.mark.parametrize("m,S", [(1, 1), (1, 4), (3, 4), (4, 2), (8, 4), (16, 3)])
def test_1f1b_bubble_formula(m, S):
    step = [mb(S, 2 * S, tokens=10) for _ in range(m)]
    for name in ("non-overlap", "consumer-1f1b"):
        r = simulate(step, S, name)
        assert r.makespan == pytest.approx(3 * (m + S - 1))
        assert r.bubble_fraction == pytest.approx((S - 1) / (m + S - 1))
        assert r.tokens == 10 * m and r.tokens_per_second == pytest.approx(10 * m / r.makespan)
        assert max(r.peak_in_flight) == min(S, m)


def test_one_window_orders_times_and_exports():
    step = window_step(2)
    nonov, over, c1 = (simulate(step, 2, name) for name in SCHEDULES)
    expected = [[("PF", 0), ("F", 1), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3), ("PB", 0)],
                [("PF", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3), ("PB", 0)]]
    assert nonov.ops_per_stage == expected and c1.ops_per_stage == expected
    # backward-first with run-ahead: stage 0 forwards everything before the first backward comes back
    assert over.ops_per_stage == [[("PF", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 1), ("B", 2), ("B", 3), ("PB", 0)],
                                  expected[1]]
    for r in (nonov, over, c1):
        assert r.makespan == pytest.approx(15.0)
        # stage 1: PF [1, 2) ... B3 [9, 11), PB [11, 13); stage 0: PB waits for stage 1's PB: [13, 15)
        assert r.export_intervals(0) == {0: (1.0, 15.0)} and r.export_intervals(1) == {0: (2.0, 13.0)}
        assert r.peak_export_bytes == [5.0, 5.0]          # each stage holds half the layers' exports
        assert r.peak_windows_alive == [1, 1]
        assert r.windows == {0: (1, 2, 3)}
    assert c1.peak_in_flight == [3, 2] and over.peak_in_flight == [4, 2]
    pb = c1.events[0][-1]
    assert (pb.kind, pb.start, pb.end) == ("PB", 13.0, 15.0)


def test_consumer_1f1b_pf_and_pb_hug_their_consumers():
    # plain, producer A, plain, consumers of A, producer B, its consumers, more consumers of A
    producers = [None, None, None, 1, 1, None, 5, 1, 5, None]
    for S in (1, 2, 4):
        ops = schedule_ops(producers, S, "consumer-1f1b")
        for order in ops:
            pos = {op: k for k, op in enumerate(order)}
            assert pos[("PF", 1)] + 1 == pos[("F", 3)] and pos[("PF", 5)] + 1 == pos[("F", 6)]
            assert pos[("PB", 1)] == pos[("B", 7)] + 1 and pos[("PB", 5)] == pos[("B", 8)] + 1
        # the producer is no member of the 1F1B stream: stage 0 warms up with S-1 non-producers
        warm = [op for op in ops[0][:ops[0].index(("B", 0))] if op[0] == "F"]
        assert len(warm) == min(S, 8)


def test_non_overlap_drains_each_window_and_attaches_plain_microbatches():
    #        plain  A     cA    plain  B     cB    cA    plain
    prods = [None, None, 1, None, None, 4, 1, None]
    ops = schedule_ops(prods, 1, "non-overlap")[0]
    assert ops == [("F", 0), ("B", 0),                                     # plain block before any window
                   ("PF", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3), ("F", 6), ("B", 6), ("PB", 1),
                   ("PF", 4), ("F", 5), ("B", 5), ("F", 7), ("B", 7), ("PB", 4)]
    step = [mb(2, 4, producer=p, export=(8.0 if i in (1, 4) else 0.0)) for i, p in enumerate(prods)]
    nonov, c1 = simulate(step, 2, "non-overlap"), simulate(step, 2, "consumer-1f1b")
    for s in range(2):     # window B starts on a stage only after window A is done everywhere
        a_end = max(e.end for st_ in range(2) for e in nonov.events[st_] if e.microbatch in (1, 2, 3, 6))
        b_start = min(e.start for e in nonov.events[s] if e.microbatch in (4, 5, 7))
        assert b_start >= a_end
    assert nonov.peak_windows_alive == [1, 1] and c1.peak_windows_alive == [2, 2]
    assert nonov.makespan > c1.makespan


def test_p2p_latency_delays_cross_stage_dependencies():
    step = [mb(2, 4) for _ in range(2)]
    r0 = simulate(step, 2, "consumer-1f1b")
    r1 = simulate(step, 2, "consumer-1f1b", p2p_latency=0.5)
    f1 = [e for e in r1.events[1] if e.kind == "F"][0]
    assert f1.start == pytest.approx(1.5)                     # F0 ends on stage 0 at 1, plus the transfer
    # critical path F0@0 -> F0@1 -> B0@1 -> F1@1 -> B1@1 -> B1@0 crosses stages twice
    assert r0.makespan == pytest.approx(9.0) and r1.makespan == pytest.approx(9.0 + 2 * 0.5)


def test_orders_from_elsewhere_are_timed_with_producers_read_as_pf_pb():
    step = window_step(2)
    mine = simulate(step, 2, "consumer-1f1b")
    plain_kinds = [[(k[-1], m) for k, m in order] for order in mine.ops_per_stage]   # ("F", 0) for PF 0
    other = simulate(step, 2, "theirs", orders=plain_kinds)
    assert other.schedule == "theirs" and other.ops_per_stage == mine.ops_per_stage
    assert other.makespan == mine.makespan and other.events == mine.events


# ---------------------------------------------------------------------------------------------
# invariants on random steps
# ---------------------------------------------------------------------------------------------

@st.composite
def steps(draw, max_n=14, equal_costs=False):
    n = draw(st.integers(1, max_n))
    producers, open_ = [], []
    for i in range(n):
        p = draw(st.sampled_from([None] + open_)) if open_ else None
        producers.append(p)
        if p is None and draw(st.booleans()):
            open_.append(i)
    used = {p for p in producers if p is not None}
    if equal_costs:
        f = draw(st.floats(0.5, 4.0))
        b = f * draw(st.floats(0.5, 4.0))
        costs = [(f, b)] * n
    else:
        costs = [(draw(st.floats(0.0, 5.0)), draw(st.floats(0.0, 8.0))) for _ in range(n)]
    return [StepMicrobatch(f, b, producer=p, export_bytes=float(draw(st.integers(1, 100))) if i in used else 0.0,
                           tokens=draw(st.integers(0, 50)))
            for i, ((f, b), p) in enumerate(zip(costs, producers))]


def prerequisites(kind, m, s, S, step):
    """The documented dependency rules, written out again."""
    cons = [c for c, x in enumerate(step) if x.producer == m]
    if kind == "F":
        return ([(s - 1, "F", m)] if s else []) + ([(s, "PF", step[m].producer)] if step[m].producer is not None else [])
    if kind == "PF":
        return [(s - 1, "PF", m)] if s else []
    if kind == "B":
        return [(s, "F", m), (s + 1, "B", m) if s + 1 < S else (s, "F", m)]
    return [(s, "PF", m), (s + 1, "PB", m) if s + 1 < S else (s, "PF", m)] + [(s, "B", c) for c in cons]


def level_at(t, intervals):
    return sum(w for a, b, w in intervals if a <= t < b)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step=steps(), S=st.integers(1, 5), name=st.sampled_from(SCHEDULES),
       lat=st.sampled_from([0.0, 0.0, 0.25]))
def test_every_schedule_respects_dependencies_and_accounts_exactly(step, S, name, lat):
    r = simulate(step, S, name, p2p_latency=lat)
    windows = step_windows(step)
    want = sorted([("PF" if i in windows else "F", i) for i in range(len(step))]
                  + [("PB" if i in windows else "B", i) for i in range(len(step))])
    end, start = {}, {}
    fwd_orders, bwd_orders = set(), set()
    for s in range(S):
        assert sorted(r.ops_per_stage[s]) == want                     # each op exactly once per stage
        assert [(e.kind, e.microbatch) for e in r.events[s]] == r.ops_per_stage[s]
        fwd_orders.add(tuple(m for k, m in r.ops_per_stage[s] if k in ("F", "PF")))
        bwd_orders.add(tuple(m for k, m in r.ops_per_stage[s] if k in ("B", "PB")))
        prev = 0.0
        for e in r.events[s]:
            cost = step[e.microbatch].forward if e.kind in ("F", "PF") else step[e.microbatch].backward
            assert e.end - e.start == pytest.approx(cost / S)
            assert e.start >= prev - 1e-12                              # one op at a time, in order
            prev = e.end
            end[(s, e.kind, e.microbatch)], start[(s, e.kind, e.microbatch)] = e.end, e.start
    assert len(fwd_orders) == 1 and len(bwd_orders) == 1               # P2P messages match in FIFO order
    for (s, kind, m), t0 in start.items():
        for d in prerequisites(kind, m, s, S, step):
            assert end[d] + (lat if d[0] != s else 0.0) <= t0 + 1e-9, (name, (s, kind, m), d)
    assert r.makespan == pytest.approx(max(end.values()))
    assert r.makespan >= makespan_lower_bound(step, S, p2p_latency=lat) * (1 - 1e-9)   # no order beats it
    assert r.bubble_fraction == pytest.approx(1 - sum(r.busy) / (S * r.makespan) if r.makespan > 0 else 0.0)
    assert r.tokens == sum(x.tokens for x in step)
    for s in range(S):
        alive = r.export_intervals(s)
        assert alive == {p: (end[(s, "PF", p)], end[(s, "PB", p)]) for p in windows}
        flight = [(end[(s, "PF" if i in windows else "F", i)], end[(s, "PB" if i in windows else "B", i)], 1)
                  for i in range(len(step))]
        exports = [(a, b, step[p].export_bytes / S) for p, (a, b) in alive.items()]
        times = sorted({t for a, b, _ in flight for t in (a, b)})
        assert r.peak_export_bytes[s] == pytest.approx(max([level_at(t, exports) for t in times], default=0.0))
        assert r.peak_windows_alive[s] == max([level_at(t, [(a, b, 1) for a, b, _ in exports]) for t in times],
                                              default=0)
        assert r.peak_in_flight[s] == max([level_at(t, flight) for t in times], default=0)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step=steps(max_n=20, equal_costs=True), S=st.integers(1, 6))
def test_equal_costs_consumer_1f1b_then_overlap_then_non_overlap(step, S):
    c, o, n = (simulate(step, S, name).makespan for name in ("consumer-1f1b", "overlap", "non-overlap"))
    assert c <= o * (1 + 1e-9) and o <= n * (1 + 1e-9)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step=steps(max_n=20), S=st.integers(1, 6), lat=st.sampled_from([0.0, 0.3]))
def test_consumer_1f1b_never_retains_more_than_overlap(step, S, lat):
    c, o = (simulate(step, S, name, p2p_latency=lat) for name in ("consumer-1f1b", "overlap"))
    for s in range(S):
        assert c.peak_export_bytes[s] <= o.peak_export_bytes[s] * (1 + 1e-12)
        assert c.peak_windows_alive[s] <= o.peak_windows_alive[s]


def items_in_flight(order, windows):
    live, peak = 0, 0
    for kind, m in order:
        if m not in windows:
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
    return peak


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step=steps(max_n=16), S=st.integers(1, 6), lat=st.sampled_from([0.0, 0.3]))
def test_consumer_1f1b_is_a_bounded_1f1b_never_slower_than_the_classic_order(step, S, lat):
    """Whatever order the costs choose: PF right before its first consumer and PB right after its
    last one on every stage, the same item order forward and backward, at most
    S - s + min(max depth, S - 1 - s) items in flight on stage s, and a makespan no larger than
    the classic order's (1F1B over the items in step order)."""
    c = simulate(step, S, "consumer-1f1b", p2p_latency=lat)
    windows = step_windows(step)
    classic = simulate(step, S, "classic", p2p_latency=lat, orders=_classic_1f1b([m.producer for m in step],
                                                                                 windows, S))
    assert c.makespan <= classic.makespan * (1 + 1e-9)
    depth = max(c1f1b_depths(S))
    for s, order in enumerate(c.ops_per_stage):
        pos = {op: k for k, op in enumerate(order)}
        for p, cs in windows.items():
            firsts = [m for k, m in order if k == "F" and m in cs]
            lasts = [m for k, m in order if k == "B" and m in cs]
            assert pos[("PF", p)] + 1 == pos[("F", firsts[0])]
            assert pos[("PB", p)] == pos[("B", lasts[-1])] + 1
        assert [m for k, m in order if k == "F"] == [m for k, m in order if k == "B"]
        assert items_in_flight(order, windows) <= S - s + min(depth, S - 1 - s)


def test_consumer_1f1b_uses_the_costs():
    """Unit costs give the classic order; uneven costs may reorder the items (a cheap microbatch
    first shortens the fill) and deepen the warm-up, within the bounds."""
    prods = [None, 0, 0, None, None]
    assert schedule_ops(prods, 2, "consumer-1f1b") == _classic_1f1b(prods, step_windows(
        [mb(1, 2, producer=p, export=(1.0 if i == 0 else 0.0)) for i, p in enumerate(prods)]), 2)
    ahead = [mb(8, 8), mb(6, 3), mb(6, 3)]
    ops = schedule_ops([None] * 3, 2, "consumer-1f1b", costs=[(8, 8), (6, 3), (6, 3)])
    assert ops == simulate(ahead, 2, "consumer-1f1b").ops_per_stage
    assert [m for k, m in ops[0] if k == "F"] == [1, 0, 2]
    with pytest.raises(ValueError, match="costs"):
        schedule_ops([None] * 3, 2, "consumer-1f1b", costs=[(1, 2)])
    with pytest.raises(ValueError, match="costs\\[1\\] backward"):
        schedule_ops([None] * 2, 2, "consumer-1f1b", costs=[(1, 2), (1, -2)])
    with pytest.raises(ValueError, match="export_bytes"):
        schedule_ops([None] * 2, 2, "consumer-1f1b", export_bytes=[1.0])


def test_uneven_costs_break_the_makespan_order():
    """The documented limits: no makespan order holds for uneven costs (smallest cases found)."""
    ahead = [mb(8, 8), mb(6, 3), mb(6, 3)]        # overlap's run-ahead hides the long first backward
    r = {name: simulate(ahead, 2, name).makespan for name in SCHEDULES}
    assert r["overlap"] == pytest.approx(22.5) and r["non-overlap"] == pytest.approx(25.0)
    assert r["consumer-1f1b"] == pytest.approx(21.5)     # the costs order the cheap microbatch first
    skewed = [mb(1, 6), mb(2, 12), mb(8, 6)]      # the unit-cost order misjudges 1:6 backward ratios
    r = {name: simulate(skewed, 3, name).makespan for name in SCHEDULES}
    assert r["overlap"] > r["non-overlap"] == r["consumer-1f1b"]


def test_consumer_1f1b_closes_with_the_cheapest_backward():
    """The closing window runs its consumer of cheapest backward last: after the last stage's final
    PB (both orders end it at 17) stage 0 still runs that consumer's backward and the PB, and
    the PB there waits for the consumer's (3 time units of drain against the costliest-last
    order's 4), so consumer 1F1B beats overlap and its own costliest-last order on 2 stages,
    keeping fewer windows alive."""
    prods = [None, None, 0, 1, 1]
    step = [mb(f, 2 * f, producer=p, export=(1.0 if p is None else 0.0)) for f, p in zip((1, 2, 1, 3, 4), prods)]
    r = {name: simulate(step, 2, name) for name in SCHEDULES}
    assert r["consumer-1f1b"].ops_per_stage == [
        [("PF", 0), ("F", 2), ("PF", 1), ("F", 4), ("B", 2), ("PB", 0), ("F", 3), ("B", 4), ("B", 3), ("PB", 1)],
        [("PF", 0), ("F", 2), ("B", 2), ("PB", 0), ("PF", 1), ("F", 4), ("B", 4), ("F", 3), ("B", 3), ("PB", 1)]]
    costliest_last = [[(k, {3: 4, 4: 3}.get(m, m)) for k, m in o] for o in r["consumer-1f1b"].ops_per_stage]
    assert simulate(step, 2, "x", orders=costliest_last).makespan == pytest.approx(21.0)
    assert r["consumer-1f1b"].makespan == pytest.approx(20.0) and r["overlap"].makespan == pytest.approx(21.5)
    assert r["consumer-1f1b"].peak_windows_alive == [2, 1] and r["overlap"].peak_windows_alive == [2, 2]
    assert r["consumer-1f1b"].events[1][-1] == Event("PB", 1, 15.0, 17.0)
    tail = r["consumer-1f1b"].events[0][-2:]          # stage 0 after the last stage's final PB
    assert [(e.kind, e.microbatch, e.start, e.end) for e in tail] == [("B", 3, 15.0, 18.0), ("PB", 1, 18.0, 20.0)]


def test_makespan_lower_bound():
    """Tight on one stage and when the last stage never waits; a plain microbatch may open and close
    the step; latency crosses 2 (S - 1) links; bad input as simulate."""
    step = [mb(2, 4) for _ in range(4)]                # per stage: forward 1, backward 2
    assert makespan_lower_bound(step, 1) == pytest.approx(24.0) == simulate(step, 1, "overlap").makespan
    assert makespan_lower_bound(step, 2) == pytest.approx(12.0 + 1.0 + 2.0)
    assert simulate(step, 2, "consumer-1f1b").makespan == pytest.approx(15.0)     # 1F1B reaches it
    assert makespan_lower_bound(step, 2, p2p_latency=0.5) == pytest.approx(16.0)
    win = window_step(2, consumers=3)                  # the producer opens and closes: PF 1 + PB 2 per stage
    assert makespan_lower_bound(win, 2) == pytest.approx(12.0 + 3.0)
    plain = win + [mb(0.2, 0.4)]                       # a cheap plain microbatch lowers the bound
    assert makespan_lower_bound(plain, 2) == pytest.approx(12.3 + 0.3)
    with pytest.raises(ValueError, match="no microbatches"):
        makespan_lower_bound([], 2)
    with pytest.raises(ValueError, match="num_stages"):
        makespan_lower_bound(step, 0)
    with pytest.raises(ValueError, match="producer"):
        makespan_lower_bound([mb(1, 2, producer=0)], 2)


def test_several_windows_consumer_1f1b_beats_non_overlap():
    rng = np.random.default_rng(0)
    prods = [None, 0, 0, 0, None, 4, 4, 0, 4, None, 9, 9, None, 12, 12, 12, 9]
    step = [mb(1 + 0.2 * rng.random(), 2 + 0.4 * rng.random(), producer=p,
               export=(5.0 if i in (0, 4, 9, 12) else 0.0)) for i, p in enumerate(prods)]
    for S in (2, 4):
        r = {name: simulate(step, S, name) for name in SCHEDULES}
        assert r["consumer-1f1b"].makespan < r["non-overlap"].makespan
        assert r["overlap"].makespan < r["non-overlap"].makespan
        assert max(r["consumer-1f1b"].peak_export_bytes) <= max(r["overlap"].peak_export_bytes)
        assert r["non-overlap"].peak_windows_alive == [1] * S


# ---------------------------------------------------------------------------------------------
# input errors
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("step,needle", [
    ([mb(1, 1, producer=0)], "must come before it"),
    ([mb(1, 1), mb(1, 1, producer=2), mb(1, 1)], "must come before it"),
    ([mb(1, 1), mb(1, 1, producer=0), mb(1, 1, producer=1)], "nested producers"),
    ([mb(1, 1, producer=5)], "not a microbatch of the step"),
    ([mb(1, 1, producer=-1)], "not a microbatch of the step"),
    ([StepMicrobatch(1.0, 1.0, producer=0.0)], "step position"),
    ([mb(-1, 1)], "forward"),
    ([mb(1, float("nan"))], "backward"),
    ([StepMicrobatch(True, 1.0)], "forward"),
    ([mb(1, 1, export=3.0)], "no consumer reads it"),
    ([StepMicrobatch(1.0, 1.0, tokens=-1)], "tokens"),
    ([(1.0, 2.0)], "StepMicrobatch"),
    ([], "no microbatches"),
])
def test_bad_steps_are_refused(step, needle):
    with pytest.raises(ValueError, match=needle):
        simulate(step, 2, "consumer-1f1b")


def test_bad_schedules_stages_orders_and_latency_are_refused():
    step = window_step(2)
    with pytest.raises(ValueError, match="unknown schedule 'zero-bubble'"):
        simulate(step, 2, "zero-bubble")
    with pytest.raises(ValueError, match="unknown schedule"):
        schedule_ops([None], 2, "1f1b")
    for S in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="num_stages"):
            simulate(step, S, "overlap")
    with pytest.raises(ValueError, match="p2p_latency"):
        simulate(step, 2, "overlap", p2p_latency=-0.1)
    good = simulate(step, 2, "consumer-1f1b").ops_per_stage
    with pytest.raises(ValueError, match="list of 2"):
        simulate(step, 2, "x", orders=good[:1])
    with pytest.raises(ValueError, match="exactly once"):
        simulate(step, 2, "x", orders=[good[0], good[1][:-1]])
    with pytest.raises(ValueError, match="kind"):
        simulate(step, 2, "x", orders=[good[0], [("Z", 0)] + good[1][1:]])
    swapped = [good[0], [good[1][1], good[1][0]] + good[1][2:]]     # consumer F before its PF: a deadlock
    with pytest.raises(ValueError, match="deadlock"):
        simulate(step, 2, "x", orders=swapped)
    with pytest.raises(ValueError, match="no results"):
        timeline_image({})


# ---------------------------------------------------------------------------------------------
# steps from plans
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    trajs = synthesize_swe(SweConfig(num_tasks=3, samples_per_task=4, prompt_median=400, max_tokens=2500,
                                     action_median=60, observation_median=100, branch_prob=0.5, seed=7))
    path = str(tmp_path_factory.mktemp("sim") / "r.jsonl")
    write_jsonl(trajs, path)
    return path, build_forest(trajs)


def test_step_from_plan_matches_windowed_microbatches(rollouts):
    from megatron_harts.planner import plan_harts
    from megatron_harts.schedules.windows import windowed_microbatches
    _, forest = rollouts
    M = int(forest.traj_length.max()) + 100
    for dp in (1, 2):
        _, plan = plan_harts(forest, dp, M)
        tokens, consumers = 0, 0
        for r in range(dp):
            step = step_from_plan(plan, r, forest=forest, backward_ratio=3.0, export_bytes_per_row=2.0)
            items = windowed_microbatches(forest, plan, r)
            assert [m.producer for m in step] == [it.producer for it in items]
            assert [m.rows for m in step] == [it.layout.num_rows for it in items]
            assert [m.plan_index for m in step] == [m.index for m in plan.schedule(r) if m is not None]
            windows = step_windows(step)
            for i, m in enumerate(step):
                assert m.backward == pytest.approx(3.0 * m.forward) and m.forward > 0
                pm = plan.microbatches[m.plan_index]
                if m.producer is not None or not pm.external:     # as planned: the plan's cost
                    assert m.forward == pytest.approx(pm.cost)
                else:                                              # context recomputed: more rows, more cost
                    assert m.rows > pm.rows and m.forward > pm.cost
                if i in windows:
                    read = {s for c in windows[i] for e in plan.microbatches[step[c].plan_index].external
                            for s in e.segments.tolist()}
                    assert m.export_bytes == 2.0 * int(forest.seg_length[sorted(read)].sum()) > 0
                else:
                    assert m.export_bytes == 0
            tokens += sum(m.tokens for m in step)
            consumers += sum(len(c) for c in windows.values())
        assert tokens == plan.expanded_tokens          # each trajectory token trained once over the replicas
        if dp == 1:
            assert consumers > 0                       # the planned step has windows to schedule


def test_step_from_expanded_plan_and_errors(rollouts):
    from megatron_harts.planner import plan_harts
    from megatron_harts.planner.packing_baselines import plan_ffd
    _, forest = rollouts
    M = int(forest.traj_length.max()) + 100
    ffd = plan_ffd(forest, 2, M)
    step = step_from_plan(ffd, 1)
    assert all(m.producer is None and m.tokens == m.rows for m in step)
    assert sum(m.tokens for m in step_from_plan(ffd, 0)) + sum(m.tokens for m in step) == ffd.expanded_tokens
    _, plan = plan_harts(forest, 2, M)
    with pytest.raises(ValueError, match="needs its forest"):
        step_from_plan(plan, 0)
    with pytest.raises(ValueError, match="replica"):
        step_from_plan(plan, 2, forest=forest)
    with pytest.raises(ValueError, match="backward_ratio"):
        step_from_plan(plan, 0, forest=forest, backward_ratio=0)
    with pytest.raises(ValueError, match="export_bytes_per_row"):
        step_from_plan(plan, 0, forest=forest, export_bytes_per_row=-1)
    with pytest.raises(ValueError, match="MicrobatchPlan"):
        step_from_plan(object(), 0)
    other = build_forest(synthesize_swe(SweConfig(num_tasks=1, samples_per_task=2, prompt_median=50,
                                                  max_tokens=400, seed=1)))
    with pytest.raises(ValueError, match="another forest"):
        step_from_plan(plan, 0, forest=other)


# ---------------------------------------------------------------------------------------------
# pictures
# ---------------------------------------------------------------------------------------------

def decode_png(data: bytes) -> np.ndarray:
    """Check the signature, IHDR and every CRC of an 8-bit RGB PNG; return its pixels."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        chunks.append((kind, body))
        pos += 12 + n
    assert chunks[0][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    w, h, depth, color, _, _, _ = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, color) == (8, 2)
    raw = np.frombuffer(zlib.decompress(b"".join(b for k, b in chunks if k == b"IDAT")), dtype=np.uint8)
    raw = raw.reshape(h, 1 + 3 * w)
    assert np.all(raw[:, 0] == 0)                  # filter type 0 on every row
    return raw[:, 1:].reshape(h, w, 3)


def test_png_writer_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    img = rng.integers(0, 256, size=(7, 13, 3), dtype=np.uint8)
    path = tmp_path / "x.png"
    write_png(str(path), img)
    assert np.array_equal(decode_png(path.read_bytes()), img)
    assert [p.name for p in tmp_path.iterdir()] == ["x.png"]          # no temporary file left
    for bad in (np.zeros((2, 2), np.uint8), np.zeros((2, 2, 3), np.float32), [[0, 0, 0]]):
        with pytest.raises(ValueError, match="uint8"):
            write_png(str(tmp_path / "bad.png"), bad)


def test_rectangles_and_text():
    img = blank(10, 20, (1, 2, 3))
    assert img.shape == (10, 20, 3) and np.all(img == (1, 2, 3))
    fill_rect(img, -5, 8, 3, 50, (9, 9, 9))                   # clipped
    assert np.all(img[8:, :3] == 9) and np.all(img[:8] == (1, 2, 3)) and np.all(img[8:, 3:] == (1, 2, 3))
    fill_rect(img, 5, 5, 5, 9, (7, 7, 7))                     # empty: nothing
    assert not np.any(img == 7)
    canvas = blank(20, 60)
    x = draw_text(canvas, 2, 3, "Ab%?", (0, 0, 0), scale=2)
    ink = np.argwhere(np.all(canvas == 0, axis=2))
    assert x == 2 + 4 * 12 and text_width("Ab%?", 2) == 4 * 12 - 2
    assert ink[:, 1].min() >= 2 and ink[:, 1].max() < 2 + text_width("Ab%?", 2) and ink[:, 0].max() < 3 + 14
    a, b = blank(9, 8), blank(9, 8)
    draw_text(a, 0, 0, "~")
    draw_text(b, 0, 0, "?")
    assert np.array_equal(a, b)                               # no glyph: drawn as '?'


def test_timeline_picture(tmp_path):
    step = window_step(2) + [mb(1, 2), mb(3, 6, export=4.0), mb(2, 4, producer=5), mb(2, 4, producer=5)]
    results = {name: simulate(step, 3, name) for name in SCHEDULES}
    img = timeline_image(results, width=900)
    assert img.shape[1] == 900
    path = tmp_path / "t.png"
    draw_timeline(results, str(path))
    pixels = decode_png(path.read_bytes())
    assert pixels.shape[1] == 1200
    colors = {tuple(c) for c in pixels.reshape(-1, 3).tolist()}
    from megatron_harts.schedules.simulator import IDLE, PLAIN_COLORS, op_color
    for kind in ("F", "B", "PF", "PB"):
        assert op_color(kind, 0) in colors and op_color(kind, 1) in colors   # two windows, two shades
    assert op_color("PF", 0) != op_color("PF", 1)
    assert PLAIN_COLORS["F"] in colors and IDLE in colors
    assert isinstance(results["overlap"], ScheduleResult)


# ---------------------------------------------------------------------------------------------
# the CLI
# ---------------------------------------------------------------------------------------------

def test_cli_json_table_and_plot(rollouts, capsys, tmp_path):
    path, forest = rollouts
    tool = load_tool("simulate_schedule")
    M = int(forest.traj_length.max()) + 100
    png = tmp_path / "timeline.png"
    code, out, err = run_tool(tool, capsys, "--input", path, "--dp", 1, "--microbatch-tokens", M, "--stages", 4,
                              "--json", "--plot", png, "--export-bytes-per-row", 3)
    assert code == 0, err
    data = json.loads(out)
    for key in ("input", "dp", "stages", "replica", "microbatches", "windows", "consumers", "tokens",
                "backward_ratio", "export_bytes_per_row", "p2p_latency", "schedules"):
        assert key in data
    assert data["tokens"] == int(forest.traj_length.sum())      # dp 1: the replica trains every token
    assert set(data["schedules"]) == set(SCHEDULES)
    for name, r in data["schedules"].items():
        assert set(r) == {"makespan", "bubble_fraction", "tokens_per_second", "relative_throughput",
                          "peak_windows_alive", "peak_export_bytes", "peak_in_flight"}
        assert len(r["peak_windows_alive"]) == len(r["peak_export_bytes"]) == len(r["peak_in_flight"]) == 4
        assert 0 <= r["bubble_fraction"] < 1
        assert r["tokens_per_second"] == pytest.approx(data["tokens"] / r["makespan"])
        assert r["relative_throughput"] == pytest.approx(data["schedules"]["non-overlap"]["makespan"] / r["makespan"])
    assert data["schedules"]["non-overlap"]["relative_throughput"] == 1.0
    pixels = decode_png(png.read_bytes())
    w, h = struct.unpack(">II", png.read_bytes()[16:24])
    assert pixels.shape == (h, w, 3) and w == 1200 and h > 100
    code, out, err = run_tool(tool, capsys, "--input", path, "--dp", 2, "--replica", 1, "--microbatch-tokens", M,
                              "--stages", 2)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["schedule", "makespan_s", "bubble"]
    assert [ln.split()[0] for ln in lines[2:5]] == list(SCHEDULES)
    assert lines[5].startswith("replica 1 of 2:")
    assert all(math.isfinite(float(ln.split()[1])) for ln in lines[2:5])


@pytest.mark.parametrize("argv,needles", [
    (["--stages", "0"], ["--stages"]),
    (["--stages", "2", "--dp", "0"], ["--dp"]),
    (["--stages", "2", "--dp", "2", "--replica", "2"], ["--replica", "[0, 2)"]),
    (["--stages", "2", "--backward-ratio", "0"], ["--backward-ratio"]),
    (["--stages", "2", "--backward-ratio", "nan"], ["--backward-ratio"]),
    (["--stages", "2", "--export-bytes-per-row", "-1"], ["--export-bytes-per-row"]),
    (["--stages", "2", "--p2p-latency", "-1"], ["--p2p-latency"]),
    (["--stages", "2", "--plot", "t.jpg"], ["--plot", ".png"]),
    (["--stages", "2", "--plot", "/no/such/dir/t.png"], ["--plot", "does not exist"]),
])
def test_cli_bad_flags(rollouts, capsys, argv, needles):
    path, forest = rollouts
    tool = load_tool("simulate_schedule")
    code, out, err = run_tool(tool, capsys, "--input", path, "--microbatch-tokens", 99999, *argv)
    assert out == ""
    assert_one_error(code, err, *needles)


def test_cli_bad_input(rollouts, capsys, tmp_path):
    path, forest = rollouts
    tool = load_tool("simulate_schedule")
    longest = int(forest.traj_length.max())
    code, out, err = run_tool(tool, capsys, "--input", path, "--microbatch-tokens", longest - 1, "--stages", 2)
    assert out == ""
    assert_one_error(code, err, path, "tree", f"budget {longest - 1}")
    code, out, err = run_tool(tool, capsys, "--input", str(tmp_path / "missing.jsonl"), "--microbatch-tokens", 99,
                              "--stages", 2)
    assert_one_error(code, err, "missing.jsonl")
    code, out, err = run_tool(tool, capsys, "--input", path, "--microbatch-tokens", longest, "--stages", 2,
                              "--dp", 512, "--replica", 511)
    assert_one_error(code, err, "replica 511 runs no microbatch")
    assert not list(tmp_path.glob("*.png"))
