"""Event-level simulator of the pipeline schedules of a windowed step (pure Python + numpy).

A *step* is a list of :class:`StepMicrobatch` entries in execution order (the order of a
replica's slots): each has a forward and a backward cost (seconds of the whole model, all
layers), a role and, for a producer, the bytes of its exports (all layers).  Roles
(docs/design.md: producer / consumer / sharing window):

- *consumer of p*: ``producer = p`` (an earlier entry) — it reads p's exports;
- *producer*: an entry some consumer names; it runs as PF (forward, exports kept) and PB (one
  backward, after every consumer's backward has accumulated the export gradients);
- *plain*: neither — an ordinary microbatch (forward F, backward B).

A producer is never itself a consumer (no nested producers), exactly as in
:mod:`megatron_harts.schedules.windows`.  :func:`step_from_plan` builds the step a replica runs
from a planner's ``MicrobatchPlan`` (the same roles and rows as ``windowed_microbatches``);
tests and benchmarks may also build steps by hand.

**Pipeline model.**  ``num_stages`` stages hold equal shares of the layers: every op costs
``1 / num_stages`` of its microbatch's forward (F, PF) or backward (B, PB), and a stage retains
``1 / num_stages`` of a producer's export bytes.  Each stage runs one op at a time, in its
order ``ops_per_stage[s]``, a list of ``(kind, microbatch)`` pairs with ``kind`` in
``"F", "B", "PF", "PB"`` and ``microbatch`` the entry's position in the step.  An op starts
when its stage is free and its prerequisites have ended (a prerequisite on another stage ends
``p2p_latency`` earlier than needed: the transfer):

- F of m on stage s: F of m on s-1; if m is a consumer of p, PF of p on s (the exports of
  stage s's layers);
- PF of p on s: PF of p on s-1;
- B of m on s: B of m on s+1 (on the last stage: F of m on s), and F of m on s;
- PB of p on s: PB of p on s+1 (on the last stage: PF of p on s), PF of p on s, and B of every
  consumer of p on s (their export gradients on stage s's layers).

**The three schedules** (:data:`SCHEDULES`).  :func:`schedule_ops` builds the per-stage orders;
the baselines from the roles alone, consumer 1F1B also from per-microbatch costs (``costs=``,
default forward 1 and backward 2 for every microbatch), export sizes and the transfer latency.
The orders are deterministic, so every pipeline rank builds the same ones from the same
inputs, and a real pipeline schedule executes exactly these lists:
``forward_backward_pipelining_windows`` (schedules/pipeline.py) runs them after its
``check_stage_orders`` (deadlock freedom under its blocking receives and deferred sends);
:func:`simulate` passes the step's costs and times the orders (or times orders built elsewhere:
``orders=``).  On every stage the forwards (F, PF) come in the same relative order and so do the
backwards (B, PB), so point-to-point messages between neighbouring stages match in FIFO order.
"1F1B over a list" means: ``num_stages - 1 - s`` warm-up forwards on stage s, then one forward
and one backward in turn, then the remaining backwards, both in list order.

- ``"non-overlap"``: windows run one after another, each drained before the next starts.  The
  step is cut into blocks: a window (its producer and all its consumers) with the plain
  microbatches that follow its producer in the step until the next producer; plain
  microbatches before the first producer form a block of their own.  A window block is PF,
  1F1B over its other members (step order), PB; a plain block is 1F1B.  Blocks run in the order
  of their first entry, every op of a block before any op of the next on every stage, so the
  pipeline empties between windows (a block's PB on stage 0 is its last op anywhere).
- ``"overlap"`` (overlapping windows, backward-first): forwards in step order (a producer's PF
  at its own position), backwards in step order with each PB right after its window's last
  consumer's B.  The interleaving comes from a unit-cost run (forward ops 1, backward ops 2, no
  latency): an idle stage starts its next backward if its prerequisites have ended, else its
  next forward if they have, else it waits.  There is no in-flight bound: a stage runs ahead
  with forwards whenever no backward is ready.
- ``"consumer-1f1b"``: a 1F1B-family schedule over the consumers and plain microbatches (the
  *items*); a producer is not a member of the stream: on every stage its PF runs immediately
  before its first consumer's F and its PB immediately after its last consumer's B (inside that
  consumer's backward turn), so exports live from the first consumer's forward to the last
  consumer's backward.  The forward order and the backward order of the items are the same
  list.  The orders are the best of timed candidates (the step's costs, export sizes and
  latency; all deterministic):

  * the *classic* order: 1F1B over the items in step order (at most ``num_stages - s`` items
    in flight on stage s);
  * timed runs (:func:`c1f1b_depths`, :data:`C1F1B_RULES`): a warm-up ``depth`` deeper on the
    stages before the last, ``depth`` from 0 to ``S - 1`` (at most ``S - s + min(depth, S - 1 - s)``
    items in flight on stage s: the run-ahead that fills the bubbles of uneven costs, bounded;
    runs whose export bytes or windows alive exceed overlap's on some stage are not taken); an
    idle stage starts its next forward or its next backward, whichever is ready, the rule's
    preference first (forward-first or backward-first), a producer's PF and PB glued to their
    consumers' ops;
  * over *units* in a cost-aware order: a unit is a plain microbatch or a window's consumers
    together (the consumer with the costliest backward last, so that the PB behind it waits
    least for the next stage's PB); the unit orders tried are the step order, the cheap-ends
    order (the unit with the cheapest first forward first, the one with the cheapest closing
    backward last: they set the pipeline's fill and drain) and the best order found so far,
    each improved by a local search of :data:`C1F1B_SEARCH_MOVES` seeded moves (move or swap
    two units, kept when the makespan drops);
  * *closing* variants: the closing (last) unit with its consumer of cheapest backward last,
    over every unit order when there are few units (at most :data:`C1F1B_TAIL_ORDERS` orders),
    else over the best order found; taken when it shortens the step by more than
    :data:`C1F1B_TAIL_GAIN` (0.1%).  The drain after the last stage's final PB is the longer of
    that window's last consumer backward and its PB on each stage before, so the costliest
    backward last, right for a window in the middle of the step, is wrong for the closing one.

  The choice is the smallest makespan among the candidates whose retained export bytes and
  windows alive are, on every stage, no more than the overlap schedule's on the same step (the
  issue's memory budget); the classic order is always a candidate.

What the comparisons guarantee (measured on many thousands of random steps; the tests pin each
point, with hypothesis where it holds and with a counterexample where it does not):

- equal costs (every microbatch the same forward f and backward b): consumer 1F1B <= overlap
  <= non-overlap in makespan;
- any costs: consumer 1F1B's makespan is no larger than its classic order's, and on every stage
  it retains no more export bytes and keeps no more windows alive than overlap (by choice);
  its microbatches in flight are bounded (``2 (S - s) - 1`` items on stage s, plus its
  windows), overlap's are not;
- uneven costs: no makespan order holds in general.  Overlap's unbounded run-ahead absorbs cost
  variance and can beat consumer 1F1B (on 6% of 300 very uneven random steps, by up to ~8%);
  on the planned SWE steps of benchmarks/bench_pp_schedule.py consumer 1F1B is ahead (by 0.03%
  to 0.2%).  Overlap's order, decided by the unit-cost run, can lose to plain 1F1B when costs
  are far from 1:2 (e.g. a few plain microbatches on many stages).

**How far from the optimum** (:func:`makespan_lower_bound`; why consumer 1F1B is barely above
overlap at 2 stages).  No order beats ``W / S + (S - 1) (f_min + b_min) / S`` (plus ``2 (S - 1)``
latencies): the last stage computes ``W / S``, cannot start before a producer's (or plain
microbatch's) forward has crossed the stages before it, and its last op, a PB (or a plain B),
still has to cross them backwards.  On the SWE steps of benchmarks/bench_pp_schedule.py (results
pp_schedule_20261129d) every overlapping schedule already sits on that bound: at 2 stages
overlap's makespan is 0.10% (Tree-Step, 67 microbatches in 8 windows) and 0.06% (Step-wise, 11
in 4) above it, consumer 1F1B's 0.07% and 0.02%; at 8 stages overlap is 0.63% / 0.25% above,
consumer 1F1B 0.44% / 0.07%.  The last stage hardly waits in the middle of the step (its idle
time is the fill and the drain of one window's producer), so whatever the order, consumer 1F1B
can gain at most that 0.1% on overlap at 2 stages, and over non-overlap at most 1.118x on
Tree-Step at 2 stages (non-overlap's makespan over the bound; the issue's 1.2x is out of reach
of any order: it drains once per window, 8 windows of ~8 consumers each).  The schedules differ
where the bound leaves room: steps of few microbatches, where the fill and the drain are a large
part of the step (the three 5-9 microbatch Step-wise steps of the 2 x H200 run: overlap 2.3%,
0.1%, 3.0% above the bound, consumer 1F1B 0.75%, 0.07%, 2.1%, i.e. 1.246x non-overlap against
overlap's 1.235x, in the simulator), and in memory: on 4 and 8 stages consumer 1F1B keeps
fewer windows, export bytes and microbatches in flight than overlap's unbounded run-ahead.
Overlap + backward-first as defined here is a strong baseline: its unbounded run-ahead keeps
the last stage fed, which is all an optimal order does once windows may overlap (the published
schedule's 9.5% over its overlap baseline is not reproduced by this model).

**Invariants** (tests/test_schedule_simulator.py pins them): on every stage each op of the step
appears exactly once in ``ops_per_stage[s]`` (F and B of every plain microbatch and consumer,
PF and PB of every producer); every op starts no earlier than its prerequisites end (plus
``p2p_latency`` across stages) and than the previous op of its stage ends; a producer's exports
are alive on stage s from its PF's end to its PB's end there (half-open intervals), and every
accounting figure (peak export bytes, peak windows alive, peak microbatches in flight) is the
maximum over time of those intervals.  Bubble fraction: idle time over ``num_stages x
makespan``.

``draw_timeline`` writes the timelines of several results as one PNG (a panel per schedule,
a row per stage, time on x, one box per op; see :func:`timeline_image`).
"""
from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..plotting import blank, draw_text, fill_rect, text_width, write_png

__all__ = ["SCHEDULES", "OP_KINDS", "StepMicrobatch", "Event", "ScheduleResult", "step_windows",
           "schedule_ops", "simulate", "makespan_lower_bound", "step_from_plan", "op_color", "timeline_image",
           "draw_timeline"]

SCHEDULES = ("non-overlap", "overlap", "consumer-1f1b")
OP_KINDS = ("F", "B", "PF", "PB")
Op = Tuple[str, int]


@dataclass(frozen=True)
class StepMicrobatch:
    """One microbatch of a step.

    ``forward``/``backward``: seconds of the whole model (all layers), >= 0; ``producer``: the
    position in the step of the producer whose exports it reads (None: not a consumer);
    ``export_bytes``: bytes a producer retains for its consumers, all layers (0 unless some
    consumer names this entry); ``tokens``: tokens it trains (for throughput, e.g. expanded
    tokens); ``rows``: rows it computes and ``plan_index``: its microbatch in the plan (both
    informative).
    """
    forward: float
    backward: float
    producer: Optional[int] = None
    export_bytes: float = 0.0
    tokens: int = 0
    rows: int = 0
    plan_index: Optional[int] = None


@dataclass(frozen=True)
class Event:
    """One op run on a stage: ``kind`` in :data:`OP_KINDS`, ``microbatch`` its position in the step."""
    kind: str
    microbatch: int
    start: float
    end: float


@dataclass
class ScheduleResult:
    """A simulated step.

    ``ops_per_stage[s]``: the order stage s runs (:func:`schedule_ops`); ``events[s]``: the same
    ops, timed; ``makespan``: the last op's end; ``busy[s]``: the time stage s computes;
    ``bubble_fraction``: ``1 - sum(busy) / (num_stages * makespan)``; per stage,
    ``peak_export_bytes`` (retained exports), ``peak_windows_alive`` (windows whose exports are
    alive at once) and ``peak_in_flight`` (microbatches forwarded but not yet backwarded,
    producers included: what bounds activation memory); ``windows``: each producer's consumers;
    ``tokens``: tokens of the step.
    """
    schedule: str
    num_stages: int
    ops_per_stage: List[List[Op]]
    events: List[List[Event]]
    makespan: float
    busy: List[float]
    bubble_fraction: float
    peak_export_bytes: List[float]
    peak_windows_alive: List[int]
    peak_in_flight: List[int]
    windows: Dict[int, Tuple[int, ...]]
    tokens: int

    @property
    def tokens_per_second(self) -> float:
        """``tokens / makespan`` (0 for an empty makespan)."""
        return self.tokens / self.makespan if self.makespan > 0 else 0.0

    def export_intervals(self, stage: int) -> Dict[int, Tuple[float, float]]:
        """``{producer: (PF end, PB end)}`` on ``stage``: when its exports there are alive."""
        pf = {e.microbatch: e.end for e in self.events[stage] if e.kind == "PF"}
        return {e.microbatch: (pf[e.microbatch], e.end) for e in self.events[stage] if e.kind == "PB"}


# ---------------------------------------------------------------------------------------------
# input checks
# ---------------------------------------------------------------------------------------------

def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _number(x, what: str, positive: bool = False) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)) or not math.isfinite(x) \
            or x < 0 or (positive and x == 0):
        raise ValueError(f"{what} must be a finite number {'> 0' if positive else '>= 0'}, got {x!r}")
    return float(x)


def _check_producers(producers: Sequence[Optional[int]]) -> Dict[int, List[int]]:
    """``{producer: [consumers in step order]}``; ValueError on a consumer before its producer,
    a producer out of range or a nested producer (a producer that is itself a consumer)."""
    windows: Dict[int, List[int]] = {}
    for i, p in enumerate(producers):
        if p is None:
            continue
        if not _is_int(p):
            raise ValueError(f"microbatch {i}: producer must be a step position (int) or None, got {p!r}")
        p = int(p)
        if not 0 <= p < len(producers):
            raise ValueError(f"microbatch {i}: producer {p} is not a microbatch of the step "
                             f"(positions 0..{len(producers) - 1})")
        if p >= i:
            raise ValueError(f"microbatch {i}: its producer {p} must come before it in the step (a consumer "
                             "cannot run before its producer)")
        if producers[p] is not None:
            raise ValueError(f"microbatch {i}: its producer {p} is itself a consumer of {producers[p]} "
                             "(nested producers are not supported)")
        windows.setdefault(p, []).append(i)
    return windows


def _check_stages(num_stages) -> int:
    if not _is_int(num_stages) or num_stages < 1:
        raise ValueError(f"num_stages must be an integer >= 1, got {num_stages!r}")
    return int(num_stages)


def _check_schedule(schedule) -> str:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    return schedule


def step_windows(step: Sequence[StepMicrobatch]) -> Dict[int, List[int]]:
    """Validate ``step``; return ``{producer: [its consumers in step order]}``.

    ValueError (naming the microbatch and the field) on: an entry that is not a
    :class:`StepMicrobatch`, a cost or export size that is not a finite number >= 0, a consumer
    before its producer, a nested producer, export bytes on an entry no consumer names.
    """
    if isinstance(step, (str, bytes)) or not isinstance(step, Sequence):
        raise ValueError(f"a step is a list of StepMicrobatch entries, got {type(step).__name__}")
    for i, m in enumerate(step):
        if not isinstance(m, StepMicrobatch):
            raise ValueError(f"microbatch {i}: expected a StepMicrobatch, got {type(m).__name__}")
        _number(m.forward, f"microbatch {i}: forward")
        _number(m.backward, f"microbatch {i}: backward")
        _number(m.export_bytes, f"microbatch {i}: export_bytes")
        if not _is_int(m.tokens) or m.tokens < 0:
            raise ValueError(f"microbatch {i}: tokens must be an integer >= 0, got {m.tokens!r}")
    windows = _check_producers([m.producer for m in step])
    for i, m in enumerate(step):
        if m.export_bytes > 0 and i not in windows:
            raise ValueError(f"microbatch {i}: export_bytes {m.export_bytes} but no consumer reads it "
                             "(only producers retain exports)")
    return windows


# ---------------------------------------------------------------------------------------------
# per-stage orders
# ---------------------------------------------------------------------------------------------

def _one_f_one_b(items: Sequence[int], warmup: int, fwd_ops: Mapping[int, List[Op]],
                 bwd_ops: Mapping[int, List[Op]]) -> List[Op]:
    """1F1B over ``items`` (forwards and backwards both in that order): ``min(warmup, n)``
    forwards, then one forward and one backward in turn, then the remaining backwards.  Each
    item contributes the ops ``fwd_ops[i]`` and ``bwd_ops[i]``."""
    n = len(items)
    w = min(warmup, n)
    order: List[Op] = []
    for i in items[:w]:
        order.extend(fwd_ops[i])
    for k in range(n):
        if k + w < n:
            order.extend(fwd_ops[items[k + w]])
        order.extend(bwd_ops[items[k]])
    return order


def _blocks(producers: Sequence[Optional[int]], windows: Mapping[int, List[int]]) -> List[Tuple[Optional[int], List[int]]]:
    """Non-overlap blocks: (producer or None, members in step order)."""
    blocks: List[Tuple[Optional[int], List[int]]] = []
    of_producer: Dict[int, List[int]] = {}
    for i, p in enumerate(producers):
        if i in windows:
            of_producer[i] = []
            blocks.append((i, of_producer[i]))
        elif p is not None:
            of_producer[int(p)].append(i)
        elif blocks:
            blocks[-1][1].append(i)
        else:
            blocks.append((None, [i]))
    return blocks


def schedule_ops(producers: Sequence[Optional[int]], num_stages: int, schedule: str, *,
                 costs: Optional[Sequence[Tuple[float, float]]] = None,
                 export_bytes: Optional[Sequence[float]] = None, p2p_latency: float = 0.0) -> List[List[Op]]:
    """The order of ops on every stage: ``ops[s] = [("PF", 0), ("F", 1), ...]``.

    ``producers[i]`` is the step position of microbatch i's producer (None: not a consumer), as
    in :attr:`StepMicrobatch.producer`; the orders depend on the roles only (never on costs), so
    a real pipeline schedule can run them as they are (schedules/pipeline.py does).  See the
    module docstring for the three schedules.  Every op appears exactly once per stage; every
    stage runs its forwards (F and PF) in the same relative order and its backwards (B and PB) in
    the same relative order; and the orders never wait on each other in a cycle (1F1B-based: a
    stage never runs more forwards before a given backward than the stage before it; overlap:
    the orders are those of an actual run).
    """
    windows = _check_producers(list(producers))
    producers = [None if p is None else int(p) for p in producers]
    S = _check_stages(num_stages)
    schedule = _check_schedule(schedule)
    if schedule == "overlap":
        return _backward_first(producers, windows, S)
    n = len(producers)
    fwd, bwd = _check_costs(costs, n)
    if export_bytes is None:
        export = [1.0 if i in windows else 0.0 for i in range(n)]
    else:
        if isinstance(export_bytes, (str, bytes)) or not isinstance(export_bytes, Sequence) or len(export_bytes) != n:
            raise ValueError(f"export_bytes must be a list of {n} numbers, one per microbatch")
        export = [_number(e, f"export_bytes[{i}]") for i, e in enumerate(export_bytes)]
    lat = _number(p2p_latency, "p2p_latency")
    if schedule == "consumer-1f1b":
        return _consumer_1f1b(producers, windows, S, fwd, bwd, export, lat)
    plain_f = {i: [("F", i)] for i in range(n)}
    plain_b = {i: [("B", i)] for i in range(n)}
    out: List[List[Op]] = []
    for s in range(S):
        order: List[Op] = []
        for p, members in _blocks(producers, windows):
            if p is not None:
                order.append(("PF", p))
            order.extend(_one_f_one_b(members, S - 1 - s, plain_f, plain_b))
            if p is not None:
                order.append(("PB", p))
        out.append(order)
    return out


def _backward_first(producers: Sequence[Optional[int]], windows: Mapping[int, List[int]], S: int) -> List[List[Op]]:
    """Overlap orders: a unit-cost run (forward ops 1, backward ops 2, no latency) in which an idle
    stage starts its next backward when its prerequisites have ended, else its next forward."""
    n = len(producers)
    last = {cs[-1]: p for p, cs in windows.items()}
    forwards = [("PF" if i in windows else "F", i) for i in range(n)]
    backwards: List[Op] = []
    for i in range(n):
        if i not in windows:
            backwards.append(("B", i))
            if i in last:
                backwards.append(("PB", last[i]))
    end: Dict[Tuple[int, str, int], int] = {}
    orders: List[List[Op]] = [[] for _ in range(S)]
    fi, bi, free = [0] * S, [0] * S, [0] * S
    t, left = 0, 2 * n * S
    while left:
        for s in range(S):
            if free[s] > t:
                continue
            for seq, k, cost in ((backwards, bi, 2), (forwards, fi, 1)):
                if k[s] == len(seq):
                    continue
                kind, m = seq[k[s]]
                if all(end.get(d, t + 1) <= t for d in _prerequisites(kind, m, s, S, producers, windows)):
                    end[(s, kind, m)] = free[s] = t + cost
                    orders[s].append((kind, m))
                    k[s] += 1
                    left -= 1
                    break
        busy = [f for f in free if f > t]
        if left and not busy:     # nothing runs and nothing can start
            raise AssertionError(f"overlap: the unit-cost run stalls at time {t}")
        t = min(busy, default=t)
    return orders


# ---------------------------------------------------------------------------------------------
# consumer 1F1B: cost-aware orders
# ---------------------------------------------------------------------------------------------

def c1f1b_depths(num_stages: int) -> range:
    """Extra warm-up forwards (beyond 1F1B's ``S - 1 - s``) the consumer-1F1B candidates take: 0 to
    ``S - 1`` (deeper is the same order: stage s runs at most ``S - 1 - s`` ahead)."""
    return range(max(int(num_stages), 1))


#: what an idle stage prefers when both its next forward and its next backward can start
C1F1B_RULES = ("forward-first", "backward-first")
#: unit-order moves tried per (depth, rule) by the local search
C1F1B_SEARCH_MOVES = 64
#: unit orders up to this many are all tried with the closing unit's cheapest backward last
C1F1B_TAIL_ORDERS = 120
#: a closing variant replaces the order found only when it shortens the step by more than this
#: fraction (smaller gains are below real op-time noise and may retain more exports)
C1F1B_TAIL_GAIN = 1e-3
#: the search's pseudo-random moves (deterministic: every pipeline rank builds the same orders)
_SEARCH_SEED = 20261129


def _check_costs(costs, n: int) -> Tuple[List[float], List[float]]:
    if costs is None:
        return [1.0] * n, [2.0] * n
    if isinstance(costs, (str, bytes)) or not isinstance(costs, Sequence) or len(costs) != n:
        raise ValueError(f"costs must be a list of {n} (forward, backward) pairs, one per microbatch")
    fwd, bwd = [], []
    for i, c in enumerate(costs):
        if isinstance(c, (str, bytes)) or not isinstance(c, Sequence) or len(c) != 2:
            raise ValueError(f"costs[{i}] must be a (forward, backward) pair, got {c!r}")
        fwd.append(_number(c[0], f"costs[{i}] forward"))
        bwd.append(_number(c[1], f"costs[{i}] backward"))
    return fwd, bwd


class _Timing:
    """Times per-stage orders (the simulator's model) and measures what consumer 1F1B's choice
    needs: makespan and, per stage, peak export bytes, windows alive and microbatches in flight."""

    def __init__(self, producers, windows, S: int, fwd, bwd, export, lat: float):
        self.producers, self.windows, self.S, self.lat = producers, windows, S, lat
        self.fwd = [f / S for f in fwd]
        self.bwd = [b / S for b in bwd]
        self.export = [e / S for e in export]
        self.deps: Dict[Tuple[int, str, int], List[Tuple[int, str, int]]] = {}

    def prerequisites(self, s: int, kind: str, m: int) -> List[Tuple[int, str, int]]:
        key = (s, kind, m)
        d = self.deps.get(key)
        if d is None:
            d = self.deps[key] = _prerequisites(kind, m, s, self.S, self.producers, self.windows)
        return d

    def ready_time(self, s: int, kind: str, m: int, end) -> Optional[float]:
        """When ``kind`` of ``m`` may start on ``s`` (None: a prerequisite has not run)."""
        t = 0.0
        for d in self.prerequisites(s, kind, m):
            e = end.get(d)
            if e is None:
                return None
            if d[0] != s:
                e += self.lat
            if e > t:
                t = e
        return t

    def duration(self, kind: str, m: int) -> float:
        return self.fwd[m] if kind in ("F", "PF") else self.bwd[m]

    def measure(self, ops: List[List[Op]], end) -> Tuple[float, List[float], List[int], List[int]]:
        makespan = max((end[(s, k, m)] for s in range(self.S) for k, m in ops[s]), default=0.0)
        peak_bytes, peak_windows, peak_flight = [], [], []
        n = len(self.producers)
        for s in range(self.S):
            fe = {m: end[(s, k, m)] for k, m in ops[s] if k in ("F", "PF")}
            be = {m: end[(s, k, m)] for k, m in ops[s] if k in ("B", "PB")}
            peak_bytes.append(_peak([(fe[p], be[p], self.export[p]) for p in self.windows]))
            peak_windows.append(int(round(_peak([(fe[p], be[p], 1.0) for p in self.windows]))))
            peak_flight.append(int(round(_peak([(fe[i], be[i], 1.0) for i in range(n)]))))
        return makespan, peak_bytes, peak_windows, peak_flight

    def time(self, ops: List[List[Op]]):
        """Each stage runs its order as early as its prerequisites allow (None on a deadlock)."""
        end: Dict[Tuple[int, str, int], float] = {}
        free = [0.0] * self.S
        nxt = [0] * self.S
        left = sum(len(o) for o in ops)
        while left:
            progressed = False
            for s in range(self.S):
                while nxt[s] < len(ops[s]):
                    kind, m = ops[s][nxt[s]]
                    r = self.ready_time(s, kind, m, end)
                    if r is None:
                        break
                    t0 = max(r, free[s])
                    end[(s, kind, m)] = free[s] = t0 + self.duration(kind, m)
                    nxt[s] += 1
                    left -= 1
                    progressed = True
            if not progressed:
                return None
        return self.measure(ops, end)

    def greedy(self, items: Sequence[int], depth: int, rule: str):
        """The orders of a timed run over ``items`` (consumers and plain microbatches, the forward
        and the backward order): on stage s, a forward may start while fewer than ``S - s +
        depth`` items are in flight there; a producer's PF is glued in front of its first
        consumer's F and its PB behind its last consumer's B (the stage runs the pair back to
        back, waiting if the second op is not ready).  An idle stage starts the next forward or
        backward that is ready, the one ``rule`` names first.  None if the run stalls."""
        S, producers = self.S, self.producers
        last_of: Dict[int, int] = {}
        for i in items:
            if producers[i] is not None:
                last_of[producers[i]] = i
        closes = {c: p for p, c in last_of.items()}
        seen: set = set()
        fgroups: List[List[Op]] = []
        bgroups: List[List[Op]] = []
        for i in items:
            p = producers[i]
            fgroups.append(([("PF", p)] if p is not None and p not in seen else []) + [("F", i)])
            if p is not None:
                seen.add(p)
            bgroups.append([("B", i)] + ([("PB", closes[i])] if i in closes else []))
        end: Dict[Tuple[int, str, int], float] = {}
        ops: List[List[Op]] = [[] for _ in range(S)]
        fi, bi, flight = [0] * S, [0] * S, [0] * S
        free = [0.0] * S
        glued: List[Optional[Op]] = [None] * S
        limits = [S - s + min(depth, S - 1 - s) for s in range(S)]
        backward_first = rule == "backward-first"
        known: Dict[Tuple[int, str, int], float] = {}     # ready times of ops whose prerequisites have all ended (final)
        lat = self.lat

        def ready(s: int, kind: str, m: int) -> Optional[float]:
            key = (s, kind, m)
            r = known.get(key)
            if r is None:
                r = self.ready_time(s, kind, m, end)
                if r is not None:
                    known[key] = r
            return r

        # visits (time, sweep, stage): a stage is looked at when it frees up or an op ends that one of
        # its ops may wait for (on it or a neighbouring stage, a stage apart after the latency); at one
        # time the stages are swept in order, and a visit the sweep has passed goes into the next one
        visits = [(0.0, 0, s) for s in range(S)]
        left = 2 * len(producers) * S
        while left:
            if not visits:
                return None
            t, sweep, s = heapq.heappop(visits)
            while visits and visits[0] == (t, sweep, s):
                heapq.heappop(visits)
            if free[s] > t:
                continue
            while True:     # the stage may run a glued pair's second op right away
                if glued[s] is not None:
                    kind, m = glued[s]
                    r = ready(s, kind, m)
                    if r is None or r > t:
                        break
                    choice = glued[s]
                    glued[s] = None
                else:
                    cand = []
                    if bi[s] < len(bgroups):
                        cand.append((False, bgroups[bi[s]]))
                    if fi[s] < len(fgroups) and flight[s] < limits[s]:
                        cand.append((True, fgroups[fi[s]]))
                    if not backward_first:
                        cand.reverse()
                    choice = None
                    for is_fwd, group in cand:
                        r = ready(s, group[0][0], group[0][1])
                        if r is not None and r <= t:
                            choice = group[0]
                            if is_fwd:
                                fi[s] += 1
                                flight[s] += 1
                            else:
                                bi[s] += 1
                                flight[s] -= 1
                            glued[s] = group[1] if len(group) > 1 else None
                            break
                    if choice is None:
                        break
                kind, m = choice
                t1 = t + self.duration(kind, m)
                end[(s, kind, m)] = free[s] = t1
                ops[s].append(choice)
                left -= 1
                for s2, t2 in ((s, t1), (s - 1, t1 + lat), (s + 1, t1 + lat)):
                    if 0 <= s2 < S:
                        heapq.heappush(visits, (t2, sweep + (s2 <= s) if t2 == t else 0, s2))
                if t1 > t:
                    break
        return ops, self.measure(ops, end)


def _classic_1f1b(producers: Sequence[Optional[int]], windows: Mapping[int, List[int]], S: int) -> List[List[Op]]:
    """1F1B over the consumers and plain microbatches in step order, each PF right before its
    first consumer's F, each PB right after its last consumer's B (consumer 1F1B's classic order)."""
    first = {p: cs[0] for p, cs in windows.items()}
    last = {cs[-1]: p for p, cs in windows.items()}
    items = [i for i in range(len(producers)) if i not in windows]
    fops = {i: ([("PF", producers[i])] if producers[i] is not None and first[producers[i]] == i else [])
            + [("F", i)] for i in items}
    bops = {i: [("B", i)] + ([("PB", last[i])] if i in last else []) for i in items}
    return [_one_f_one_b(items, S - 1 - s, fops, bops) for s in range(S)]


def _consumer_1f1b(producers: Sequence[Optional[int]], windows: Mapping[int, List[int]], S: int,
                   fwd: Sequence[float], bwd: Sequence[float], export: Sequence[float],
                   lat: float) -> List[List[Op]]:
    """Consumer-1F1B orders: the best timed candidate (module docstring)."""
    n = len(producers)
    first = {p: cs[0] for p, cs in windows.items()}
    items = [i for i in range(n) if i not in windows]
    classic = _classic_1f1b(producers, windows, S)
    if S == 1 or not items:
        return classic
    timing = _Timing(producers, windows, S, fwd, bwd, export, lat)
    measured = timing.time(classic)
    if measured is None:     # cannot happen for 1F1B over a list; keep the documented order
        return classic
    overlap = timing.time(_backward_first(producers, windows, S))
    budget = None if overlap is None else overlap[1:]

    def within(m) -> bool:
        if budget is None:
            return True
        return all(m[1][s] <= budget[0][s] * (1 + 1e-12) and m[2][s] <= budget[1][s] for s in range(S))

    best_ops, best = classic, measured
    # units: a plain microbatch, or a window's consumers (its costliest backward last, so that the
    # PB glued behind it finds the next stage's PB done)
    units: List[List[int]] = []
    for i in items:
        p = producers[i]
        if p is None:
            units.append([i])
        elif first[p] == i:
            cs = list(windows[p])
            k = max(range(len(cs)), key=lambda j: (bwd[cs[j]], j))
            units.append(cs[:k] + cs[k + 1:] + [cs[k]])

    def head(u: List[int]) -> float:
        p = producers[u[0]]
        return fwd[p] if p is not None else fwd[u[0]]

    def tail(u: List[int]) -> float:
        p = producers[u[0]]
        return bwd[p] if p is not None else bwd[u[-1]]

    step_order = list(range(len(units)))
    ends = list(step_order)
    if len(ends) >= 2:
        a = min(ends, key=lambda k: (head(units[k]), k))
        ends.remove(a)
        z = min(ends, key=lambda k: (tail(units[k]), k))
        ends.remove(z)
        ends = [a] + ends + [z]
    rng = random.Random(_SEARCH_SEED)
    best_order = step_order
    # the closing unit's variant: its cheapest backward last (the drain after the last stage's last PB
    # is the longer of that consumer's and the producer's backwards on the stages before)
    tails: Dict[int, List[int]] = {}
    for k, u in enumerate(units):
        if len(u) > 1:
            j = min(range(len(u)), key=lambda j: (bwd[u[j]], j))
            if j != len(u) - 1:
                tails[k] = u[:j] + u[j + 1:] + [u[j]]

    timed: Dict[Tuple[Tuple[int, ...], int, str], Optional[tuple]] = {}     # the search revisits orders

    def run(order, depth, rule, tail=False):
        key = (tuple(i for k in order for i in (tails[k] if tail and k == order[-1] else units[k])), depth, rule)
        if key not in timed:
            got = timing.greedy(list(key[0]), depth, rule)
            timed[key] = None if got is None or not within(got[1]) else got
        return timed[key]

    for depth in c1f1b_depths(S):
        for rule in C1F1B_RULES:
            cur = None
            for order in (step_order, ends, best_order):
                got = run(order, depth, rule)
                if got is not None and (cur is None or got[1][0] < cur[2][0]):
                    cur = (list(order), got[0], got[1])
            if cur is None:
                continue
            for _ in range(C1F1B_SEARCH_MOVES if len(units) > 1 else 0):
                order = list(cur[0])
                a, b = rng.sample(range(len(order)), 2)
                if rng.random() < 0.5:
                    order.insert(b, order.pop(a))
                else:
                    order[a], order[b] = order[b], order[a]
                got = run(order, depth, rule)
                if got is not None and got[1][0] < cur[2][0] * (1 - 1e-12):
                    cur = (order, got[0], got[1])
            # closing variants: the unit orders with few units all (C1F1B_TAIL_ORDERS at most), else the
            # best order found, with the closing unit's cheapest backward last
            if tails:
                if math.factorial(len(units)) <= C1F1B_TAIL_ORDERS:
                    closing = [list(o) for o in itertools.permutations(range(len(units))) if o[-1] in tails]
                else:
                    closing = [cur[0]] if cur[0][-1] in tails else []
                for order in closing:
                    got = run(order, depth, rule, tail=True)
                    if got is not None and got[1][0] < cur[2][0] * (1 - C1F1B_TAIL_GAIN):
                        cur = (order, got[0], got[1])
            if cur[2][0] < best[0] * (1 - 1e-12):
                best_order, best_ops, best = cur[0], cur[1], cur[2]
    return best_ops


# ---------------------------------------------------------------------------------------------
# timing and accounting
# ---------------------------------------------------------------------------------------------

def _prerequisites(kind: str, m: int, s: int, S: int, producers: Sequence[Optional[int]],
                   windows: Mapping[int, List[int]]) -> List[Tuple[int, str, int]]:
    """(stage, kind, microbatch) of the ops that must end before ``kind`` of ``m`` on stage ``s``."""
    if kind == "F":
        deps = [(s - 1, "F", m)] if s > 0 else []
        if producers[m] is not None:
            deps.append((s, "PF", int(producers[m])))
        return deps
    if kind == "PF":
        return [(s - 1, "PF", m)] if s > 0 else []
    if kind == "B":
        return [(s, "F", m)] + ([(s + 1, "B", m)] if s < S - 1 else [])
    return ([(s, "PF", m)] + ([(s + 1, "PB", m)] if s < S - 1 else [])
            + [(s, "B", c) for c in windows[m]])


def _peak(intervals: Sequence[Tuple[float, float, float]]) -> float:
    """Maximum over time of the summed weights of half-open intervals ``[start, end)``."""
    points = []
    for a, b, w in intervals:
        if b > a:
            points.append((a, 1, w))
            points.append((b, 0, -w))      # at equal times, releases before acquisitions
    level = best = 0.0
    for _, _, w in sorted(points):
        level += w
        best = max(best, level)
    return best


def _given_orders(orders, producers: Sequence[Optional[int]], windows: Mapping[int, List[int]],
                  S: int) -> List[List[Op]]:
    """Check per-stage orders built elsewhere; ``("F", p)``/``("B", p)`` of a producer read as PF/PB."""
    if isinstance(orders, (str, bytes)) or not isinstance(orders, Sequence) or len(orders) != S:
        raise ValueError(f"orders must be a list of {S} per-stage op lists")
    want = sorted([("PF" if i in windows else "F", i) for i in range(len(producers))]
                  + [("PB" if i in windows else "B", i) for i in range(len(producers))])
    out: List[List[Op]] = []
    for s, ops in enumerate(orders):
        got: List[Op] = []
        for op in ops:
            if not isinstance(op, (tuple, list)) or len(op) != 2 or op[0] not in OP_KINDS or not _is_int(op[1]):
                raise ValueError(f"orders[{s}]: {op!r} is not a (kind, microbatch) pair with kind in {OP_KINDS}")
            kind, m = op[0], int(op[1])
            if m in windows and kind in ("F", "B"):
                kind = "P" + kind
            got.append((kind, m))
        if sorted(got) != want:
            raise ValueError(f"orders[{s}] must hold every op of the step exactly once (F/B of plain microbatches "
                             "and consumers, PF/PB of producers)")
        out.append(got)
    return out


def simulate(step: Sequence[StepMicrobatch], num_stages: int, schedule: str, *,
             p2p_latency: float = 0.0, orders: Optional[Sequence[Sequence[Op]]] = None) -> ScheduleResult:
    """Run ``step`` on ``num_stages`` pipeline stages under ``schedule`` (one of
    :data:`SCHEDULES`); see the module docstring for the model and the invariants.

    ``orders``: time these per-stage orders instead (e.g. a real schedule's); ``schedule`` is
    then only the result's name.  ValueError on a bad step (:func:`step_windows`), an empty
    step, an unknown schedule, a stage count < 1, a negative latency, orders that miss or repeat
    an op or that deadlock.
    """
    windows = step_windows(step)
    S = _check_stages(num_stages)
    if orders is None:
        schedule = _check_schedule(schedule)
    elif not isinstance(schedule, str) or not schedule:
        raise ValueError(f"schedule must name the orders (a non-empty string), got {schedule!r}")
    lat = _number(p2p_latency, "p2p_latency")
    if not step:
        raise ValueError("the step has no microbatches")
    producers = [m.producer for m in step]
    if orders is None:
        ops = schedule_ops(producers, S, schedule, costs=[(m.forward, m.backward) for m in step],
                           export_bytes=[m.export_bytes for m in step], p2p_latency=lat)
    else:
        ops = _given_orders(orders, producers, windows, S)

    def duration(kind: str, m: int) -> float:
        return (step[m].forward if kind in ("F", "PF") else step[m].backward) / S

    end: Dict[Tuple[int, str, int], float] = {}
    events: List[List[Event]] = [[] for _ in range(S)]
    free = [0.0] * S
    nxt = [0] * S
    left = sum(len(o) for o in ops)
    while left:
        progressed = False
        for s in range(S):
            while nxt[s] < len(ops[s]):
                kind, m = ops[s][nxt[s]]
                ready = free[s]
                for d in _prerequisites(kind, m, s, S, producers, windows):
                    if d not in end:
                        break
                    ready = max(ready, end[d] + (lat if d[0] != s else 0.0))
                else:
                    t1 = ready + duration(kind, m)
                    end[(s, kind, m)] = t1
                    events[s].append(Event(kind, m, ready, t1))
                    free[s] = t1
                    nxt[s] += 1
                    left -= 1
                    progressed = True
                    continue
                break
        if not progressed:   # the orders wait on each other in a cycle
            stuck = {s: ops[s][nxt[s]] for s in range(S) if nxt[s] < len(ops[s])}
            raise (ValueError if orders is not None else AssertionError)(
                f"{schedule}: the stage orders deadlock (next op per stage: {stuck})")
    makespan = max(free)
    busy = [sum(e.end - e.start for e in ev) for ev in events]
    bubble = 1.0 - sum(busy) / (S * makespan) if makespan > 0 else 0.0
    peak_bytes, peak_windows, peak_flight = [], [], []
    for s in range(S):
        fwd_end = {(e.microbatch): e.end for e in events[s] if e.kind in ("F", "PF")}
        bwd_end = {(e.microbatch): e.end for e in events[s] if e.kind in ("B", "PB")}
        alive = [(fwd_end[p], bwd_end[p]) for p in windows]
        peak_bytes.append(_peak([(a, b, step[p].export_bytes / S) for (a, b), p in zip(alive, windows)]))
        peak_windows.append(int(round(_peak([(a, b, 1.0) for a, b in alive]))))
        peak_flight.append(int(round(_peak([(fwd_end[i], bwd_end[i], 1.0) for i in range(len(step))]))))
    return ScheduleResult(schedule=schedule, num_stages=S, ops_per_stage=ops, events=events, makespan=makespan,
                          busy=busy, bubble_fraction=bubble, peak_export_bytes=peak_bytes,
                          peak_windows_alive=peak_windows, peak_in_flight=peak_flight,
                          windows={p: tuple(cs) for p, cs in windows.items()},
                          tokens=int(sum(m.tokens for m in step)))


def makespan_lower_bound(step: Sequence[StepMicrobatch], num_stages: int, *, p2p_latency: float = 0.0) -> float:
    """A makespan no order of ``step`` on ``num_stages`` stages can beat (module docstring, "How
    far from the optimum"): ``W / S + (S - 1) (f_min / S + b_min / S + 2 p2p_latency)``, ``W``
    the step's forward and backward costs summed, ``f_min`` / ``b_min`` the smallest forward /
    backward of a microbatch that is not a consumer (a producer or a plain microbatch).

    The last stage computes ``W / S``; its first op is a forward of a non-consumer (a consumer's F
    waits for its producer's PF on the same stage), which has crossed the ``S - 1`` stages before;
    its last op is a backward of a non-consumer (a consumer's B comes before its producer's PB on
    the same stage), which still has to cross the ``S - 1`` stages before it.  ValueError as
    :func:`simulate` (a bad or empty step, a bad stage count or latency).
    """
    step_windows(step)
    S = _check_stages(num_stages)
    lat = _number(p2p_latency, "p2p_latency")
    if not step:
        raise ValueError("the step has no microbatches")
    work = sum(m.forward + m.backward for m in step)
    starters = [m for m in step if m.producer is None]      # producers and plain microbatches
    return work / S + (S - 1) * (min(m.forward for m in starters) / S + min(m.backward for m in starters) / S
                                 + 2 * lat)


# ---------------------------------------------------------------------------------------------
# steps from plans
# ---------------------------------------------------------------------------------------------

def step_from_plan(plan, replica: int, *, forest=None, index=None, backward_ratio: float = 2.0,
                   export_bytes_per_row: float = 0.0) -> List[StepMicrobatch]:
    """The step replica ``replica`` of ``plan`` (a ``MicrobatchPlan``) runs, slot by slot (idle
    slots skipped).

    Forward cost: the microbatch's modelled ``cost`` (the plan's cost model); backward:
    ``backward_ratio * cost``.  Tree-mode plans need their ``forest`` (``index``: its
    ``ForestIndex``, optional, to reuse one): the roles are those of
    ``schedules.windows.windowed_microbatches`` — a microbatch consumes a window when all its
    external segments are rows of one earlier microbatch of this replica that is not itself a
    consumer and no computed segment lies above an external one; otherwise its external context
    is recomputed, and its cost is the cost model's for those extra rows.  A producer's
    ``export_bytes`` is ``export_bytes_per_row`` times the rows its consumers in this step read.
    ``tokens``: the expanded tokens the microbatch trains (owned segments' rows times the
    trajectories through them; the packed trajectories' tokens in an expanded-mode plan), so
    over all replicas they sum to ``plan.expanded_tokens``.
    """
    mode = getattr(plan, "mode", None)
    if mode not in ("tree", "expanded"):
        raise ValueError(f"step_from_plan: a MicrobatchPlan is expected, got {type(plan).__name__}")
    if not _is_int(replica) or not 0 <= replica < plan.num_replicas:
        raise ValueError(f"step_from_plan: replica must be an integer in [0, {plan.num_replicas}), got {replica!r}")
    ratio = _number(backward_ratio, "backward_ratio", positive=True)
    per_row = _number(export_bytes_per_row, "export_bytes_per_row")
    mbs = [m for m in plan.schedule(int(replica)) if m is not None]
    if mode == "expanded":
        return [StepMicrobatch(m.cost, ratio * m.cost, tokens=int(m.features.rows), rows=int(m.features.rows),
                               plan_index=m.index) for m in mbs]
    if forest is None:
        raise ValueError("step_from_plan: a tree-mode plan needs its forest (forest=...) to decide the windows")
    if forest.num_segments != sum(len(m.owned) for m in plan.microbatches):
        raise ValueError("step_from_plan: the plan does not own every segment of this forest exactly once "
                         "(was it planned for another forest?)")
    if index is None:
        from ..planner.cost_model import ForestIndex
        index = ForestIndex(forest)
    elif index.num_segments != forest.num_segments:
        raise ValueError("step_from_plan: index is the ForestIndex of another forest")
    from ..planner.microbatch import replica_windows
    length = np.asarray(forest.seg_length, dtype=np.int64)
    through = np.asarray(forest.seg_traj_hi, dtype=np.int64) - np.asarray(forest.seg_traj_lo, dtype=np.int64)
    model = plan.cost_model
    entries = replica_windows(forest, plan, int(replica))
    roles: List[Optional[int]] = [e.producer for e in entries]
    costs: List[float] = []
    rows: List[int] = []
    exported: Dict[int, set] = {}
    for e in entries:
        m = e.microbatch
        cost, nrows = float(m.cost), int(m.rows)
        if e.external.size and e.producer is None:      # context recomputed here
            feats = model.features(index, e.computed, m.owned)
            cost, nrows = float(model.cost(feats)), int(feats.rows)
        if e.producer is not None:
            exported.setdefault(e.producer, set()).update(e.external.tolist())
        costs.append(cost)
        rows.append(nrows)
    out = []
    for i, m in enumerate(mbs):
        segs = np.array(sorted(exported.get(i, ())), dtype=np.int64)
        out.append(StepMicrobatch(costs[i], ratio * costs[i], producer=roles[i],
                                  export_bytes=per_row * float(length[segs].sum()),
                                  tokens=int((length[m.owned] * through[m.owned]).sum()), rows=rows[i],
                                  plan_index=m.index))
    return out


# ---------------------------------------------------------------------------------------------
# drawing
# ---------------------------------------------------------------------------------------------

BASE_COLORS = {"F": (52, 120, 198), "B": (39, 150, 80), "PF": (230, 126, 34), "PB": (192, 57, 43)}
PLAIN_COLORS = {"F": (160, 185, 215), "B": (160, 205, 170)}
IDLE = (232, 232, 232)
SHADES = 4


def op_color(kind: str, window: Optional[int]) -> Tuple[int, int, int]:
    """Box color: the hue says the kind (F blue, B green, PF orange, PB red), the shade the
    window (``window % SHADES``: a producer's PF/PB and its consumers' F/B share it); plain
    microbatches (``window`` None) are pale."""
    if window is None:
        return PLAIN_COLORS[kind]
    c = np.array(BASE_COLORS[kind], dtype=np.float64)
    j = window % SHADES
    if j == 1:
        c = c * 0.55                      # dark
    elif j == 2:
        c = c + (255 - c) * 0.4           # light
    elif j == 3:
        c = c * 0.78                      # medium
    return tuple(int(round(v)) for v in np.clip(c, 0, 255))


def _nice_step(span: float, target: int = 8) -> float:
    raw = span / target
    if raw <= 0:
        return 1.0
    mag = 10.0 ** math.floor(math.log10(raw))
    for k in (1, 2, 5, 10):
        if k * mag >= raw:
            return k * mag
    return 10 * mag


def _fmt(t: float) -> str:
    return f"{t:.3g}" if abs(t) < 1000 else f"{t:,.0f}"


def timeline_image(results: Mapping[str, ScheduleResult], *, width: int = 1200) -> np.ndarray:
    """The picture :func:`draw_timeline` writes: one panel per result (in mapping order), titled
    with its name, makespan, bubble fraction and peak windows alive; a row per stage (light grey
    = idle, up to the panel's makespan); one box per op from its start to its end on a time axis shared by all panels,
    colored by :func:`op_color` and numbered with its microbatch where it fits; a legend below."""
    if not results:
        raise ValueError("draw_timeline: no results to draw")
    for name, r in results.items():
        if not isinstance(r, ScheduleResult):
            raise ValueError(f"draw_timeline: {name!r} is not a ScheduleResult")
    width = max(int(width), 400)
    left, right, top = 34, 12, 10
    plot_w = width - left - right
    tmax = max(r.makespan for r in results.values()) or 1.0
    step = _nice_step(tmax)
    rows_max = max(r.num_stages for r in results.values())
    rh = max(3, min(26, 320 // rows_max))
    gap = 1 if rh < 8 else 2
    title_h, axis_h, panel_gap = 22, 14, 12

    def panel_height(r: ScheduleResult) -> int:
        return title_h + r.num_stages * (rh + gap) + axis_h

    legend_h = 26
    height = top + sum(panel_height(r) + panel_gap for r in results.values()) + legend_h
    img = blank(height, width)

    def x_of(t: float) -> int:
        return left + int(round(t / tmax * plot_w))

    y = top
    for name, r in results.items():
        shade = {p: k for k, p in enumerate(sorted(r.windows))}
        window_of = {c: shade[p] for p, cs in r.windows.items() for c in cs}
        window_of.update(shade)
        title = (f"{name}   makespan {_fmt(r.makespan)}   bubble {100 * r.bubble_fraction:.1f}%   "
                 f"peak windows {max(r.peak_windows_alive, default=0)}")
        draw_text(img, left, y + 2, title, (0, 0, 0), scale=2)
        y += title_h
        for s in range(r.num_stages):
            y0, y1 = y + s * (rh + gap), y + s * (rh + gap) + rh
            fill_rect(img, left, y0, x_of(r.makespan), y1, IDLE)    # idle up to this step's end
            if rh >= 7:
                draw_text(img, 4, y0 + (rh - 7) // 2, f"S{s}", (60, 60, 60))
            for e in r.events[s]:
                x0, x1 = x_of(e.start), max(x_of(e.end), x_of(e.start) + (1 if e.end > e.start else 0))
                color = op_color(e.kind, window_of.get(e.microbatch))
                fill_rect(img, x0, y0, x1, y1, color)
                if x1 - x0 >= 4:      # a dark edge marks where the op ends
                    fill_rect(img, x1 - 1, y0, x1, y1, tuple(int(v * 0.55) for v in color))
                label = str(e.microbatch)
                if rh >= 9 and x1 - x0 - 3 >= text_width(label):   # the microbatch, where it fits
                    ink = (255, 255, 255) if sum(color) < 400 else (0, 0, 0)
                    draw_text(img, (x0 + x1 - 1 - text_width(label)) // 2, y0 + (rh - 7) // 2, label, ink)
        y += r.num_stages * (rh + gap)
        fill_rect(img, left, y, x_of(tmax) + 1, y + 1, (0, 0, 0))
        t = 0.0
        while t <= tmax * (1 + 1e-9):
            x = x_of(t)
            fill_rect(img, x, y, x + 1, y + 4, (0, 0, 0))
            label = _fmt(t)
            lx = min(max(left, x - text_width(label) // 2), width - right - text_width(label))
            draw_text(img, lx, y + 5, label, (60, 60, 60))
            t += step
        y += axis_h + panel_gap
    x = left
    legend = [("F", op_color("F", 0)), ("B", op_color("B", 0)), ("PF", op_color("PF", 0)),
              ("PB", op_color("PB", 0)), ("plain F", PLAIN_COLORS["F"]), ("plain B", PLAIN_COLORS["B"]),
              ("idle", IDLE)]
    for label, color in legend:
        fill_rect(img, x, y + 4, x + 14, y + 14, color)
        x = draw_text(img, x + 18, y + 5, label, (0, 0, 0)) + 14
    draw_text(img, x + 10, y + 5, "shades: windows   time in seconds", (90, 90, 90))
    return img


def draw_timeline(results: Mapping[str, ScheduleResult], path: str, *, width: int = 1200) -> None:
    """Write :func:`timeline_image` of ``results`` (``{name: ScheduleResult}``) as a PNG file."""
    write_png(path, timeline_image(results, width=width))
