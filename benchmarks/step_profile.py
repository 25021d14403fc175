"""Where one training step's time goes: a profiled step split into attention forward, attention
backward, KDA (forward and backward), GEMMs, the pieces' extra forward, other device work and host.

The step runs under ``torch.profiler`` (CPU activities, and CUDA's on a GPU).  The device work is
the GPU's kernels, copies and fills on a GPU; on the CPU it is the aten operators' own time (each
operator's time less its nested operators'), so the same code path runs on both.  Each piece of
work is put in one bucket (``bucket``), first match wins:

1. ``pieces_extra_forward``: launched inside the range ``schedules.windows.PIECES_RANGE``, the
   exports-only forward a piece read by a later piece runs under ``no_grad`` (its forward runs
   again, with its graph, before its backward); or the forward a piece kept in part runs again in its
   backward: inside the backward of a checkpoint node (megatron's ``CheckpointFunction``) that the
   range ``schedules.windows.PIECES_KEPT_RANGE`` created, outside the backward nodes nested in it;
2. ``attention_forward``: inside ``models.cores.ATTENTION_RANGE`` (MLA's core attention);
3. ``attention_backward``: inside the backward of an autograd node that the attention range's
   forward created (the profiler links a backward node to its forward by sequence number);
4. ``kda``: inside ``models.cores.KDA_RANGE`` or the backward of a node created there;
5. by name where no range says (a kernel launched outside the model's cores, or a synthetic
   list): KDA kernel names, attention kernel names (``bwd``/``backward`` in the name: backward),
   then GEMMs (cuBLAS/CUTLASS kernels, ``aten::mm``-like operators);
6. ``other``: the rest of the device work.

``host`` is the step's wall time less the time the device was busy (the union of the kernels'
intervals on a GPU; on the CPU the operators' own time): Python, the planner, the layouts, launch
overhead and waits.  The device buckets sum to the device work, which exceeds the busy time only
where kernels overlap (several streams).

On a GPU the split also says what the device waited for (``idle_while``): the gaps between its busy
intervals, by length, and their time by what the host was running meanwhile (``idle_attribution``:
at points every ``IDLE_SAMPLE_US`` through each gap, the innermost host event alive on any thread,
under the innermost project range above it; no event: Python between operators), and the host's
synchronizations (runtime calls that wait for the device) with the seconds they waited.
"""
from __future__ import annotations

import re
import sys
import time
from collections import Counter
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

#: the split's buckets, in the order tables print them
BUCKETS = ("attention_forward", "attention_backward", "kda", "gemm", "pieces_extra_forward", "other", "host")
SCOPES = ("pieces_extra_forward", "attention_forward", "attention_backward", "kda")   # precedence order

KDA_NAMES = re.compile(r"kda|gated_delta|delta_rule|wy_|w_u|solve_tril|chunk_local|chunk_fwd|chunk_bwd|"
                       r"merge_16x16|chunk_scaled_dot|_kkt", re.I)
ATTENTION_NAMES = re.compile(r"flash|fmha|attention|sdpa|flex", re.I)
BACKWARD_NAMES = re.compile(r"bwd|backward", re.I)
GEMM_NAMES = re.compile(r"gemm|cutlass|cublas|xmma|nvjet|matmul|splitK|Kernel2|"
                        r"^aten::(mm|addmm|bmm|baddbmm|addbmm|_grouped_mm|mv|addmv|dot|linear|einsum)$")

#: (name, seconds) or (name, seconds, scopes): one piece of device work
Work = Tuple

#: where in a device gap the host's activity is looked up: every this many microseconds (at least once a gap)
IDLE_SAMPLE_US = 10.0
#: gap lengths the idle time is counted in (microseconds, upper bounds; the last open)
GAP_BOUNDS_US = (100.0, 1000.0, 10000.0)
#: runtime calls by which the host waits for the device
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def bucket(name: str, scopes: Iterable[str] = ()) -> str:
    """The bucket of one piece of device work named ``name`` launched inside ``scopes`` (module
    docstring)."""
    scopes = set(scopes)
    for scope in SCOPES:
        if scope in scopes:
            return scope
    if KDA_NAMES.search(name):
        return "kda"
    if ATTENTION_NAMES.search(name):
        return "attention_backward" if BACKWARD_NAMES.search(name) else "attention_forward"
    if GEMM_NAMES.search(name):
        return "gemm"
    return "other"


def split_step(work: Sequence[Work], wall_seconds: float, busy_seconds: Optional[float] = None) -> dict:
    """The split of a step of ``wall_seconds``: ``work`` its device work, each ``(name, seconds)`` or
    ``(name, seconds, scopes)``; ``busy_seconds`` the time the device was busy (default the work's
    sum).  Returns ``wall_seconds``, ``device_seconds`` (the work's sum), ``busy_seconds``,
    ``seconds`` (per bucket of ``BUCKETS``, host = wall less busy, at least 0) and ``fraction``
    (each bucket's share of the wall time)."""
    if wall_seconds <= 0:
        raise ValueError(f"wall_seconds must be > 0, got {wall_seconds}")
    seconds = {b: 0.0 for b in BUCKETS}
    total = 0.0
    for w in work:
        name, s = w[0], float(w[1])
        if s < 0:
            raise ValueError(f"{name}: negative time {s}")
        seconds[bucket(name, w[2] if len(w) > 2 else ())] += s
        total += s
    busy = total if busy_seconds is None else float(busy_seconds)
    seconds["host"] = max(0.0, wall_seconds - busy)
    return {"wall_seconds": wall_seconds, "device_seconds": total, "busy_seconds": busy, "seconds": seconds,
            "fraction": {b: v / wall_seconds for b, v in seconds.items()}}


def _union_seconds(intervals: List[Tuple[float, float]]) -> float:
    """Seconds covered by ``intervals`` (microseconds), overlaps counted once."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total / 1e6


def profile_work(events, device: str, attention_range: str, kda_range: str, pieces_range: str,
                 kept_range: str = ""):
    """The device work of a profile's events (``prof.events()``) as ``(name, seconds, scopes)``, the
    seconds the device was busy (module docstring), and how many kernels the profile does not link
    to the host operator that launched them (bucketed by name alone).  ``kept_range``: the range of
    the pieces kept in part, whose checkpoint nodes' backward runs the pieces' forward again."""
    from torch.autograd import DeviceType
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    ranges = {attention_range: "attention_forward", kda_range: "kda", pieces_range: "pieces_extra_forward"}
    if kept_range:
        ranges[kept_range] = "pieces_kept"
    memo: Dict[int, frozenset] = {}

    def own(e) -> frozenset:         # the ranges ``e`` is or lies in, its ancestors first
        key = id(e)
        if key not in memo:
            parent = own(e.cpu_parent) if e.cpu_parent is not None else frozenset()
            memo[key] = parent | {ranges[e.name]} if e.name in ranges else parent
        return memo[key]

    # (thread, sequence number) of forward nodes
    created = {"attention_forward": set(), "kda": set(), "pieces_kept": set()}
    for e in cpu:
        if e.sequence_nr >= 0 and not e.name.startswith("autograd::engine"):
            for scope in own(e) & created.keys():
                created[scope].add((e.thread, e.sequence_nr))
    backward_of = {"attention_forward": "attention_backward", "kda": "kda"}
    full: Dict[int, frozenset] = {}

    def scopes(e) -> frozenset:
        key = id(e)
        if key not in full:
            up = scopes(e.cpu_parent) if e.cpu_parent is not None else frozenset()
            mine = {ranges[e.name]} if e.name in ranges else set()
            if e.name.startswith("autograd::engine::evaluate_function"):
                up = up - {"pieces_extra_forward"}         # a backward inside a checkpoint's forward again
                node = (e.fwd_thread, e.sequence_nr)
                if e.sequence_nr >= 0:
                    mine |= {backward_of[s] for s in backward_of if node in created[s]}
                    if "CheckpointFunction" in e.name and node in created["pieces_kept"]:
                        mine.add("pieces_extra_forward")
            full[key] = up | mine
        return full[key]

    if device == "cuda":
        # each operator lists the kernels it launched (torch links them by correlation id when it builds
        # the events, in every version; the kernel events themselves carry the link only in some): the
        # work is those kernels in their operator's scopes; the kernel events give the busy intervals
        # (range annotations left out: they span a range, they are not work)
        device_events = _device_work(events, ranges)
        work = [(k.name, k.duration / 1e6, scopes(e)) for e in cpu for k in (getattr(e, "kernels", None) or ())]
        ran = Counter(e.name for e in device_events)
        listed = Counter(w[0] for w in work)
        # a kernel some version lists under two operators (a copy under its op and its runtime call): the
        # listings of that name share the device's count of it, so no kernel is counted twice
        share = {n: ran[n] / c for n, c in listed.items() if c > ran[n]}
        if share:
            work = [(n, sec * share.get(n, 1.0), sc) for n, sec, sc in work]
        left = ran - listed
        unlinked = []
        for e in device_events:                  # kernels no operator lists: bucketed by name alone
            if left[e.name] > 0:
                left[e.name] -= 1
                unlinked.append((e.name, (e.time_range.end - e.time_range.start) / 1e6, frozenset()))
        spans = [(e.time_range.start, e.time_range.end) for e in device_events]
        return work + unlinked, _union_seconds(spans), len(unlinked)
    work = [(e.name, e.self_cpu_time_total / 1e6, scopes(e)) for e in cpu if e.name.startswith("aten::")]
    return work, sum(w[1] for w in work), 0


def project_ranges() -> Tuple[str, ...]:
    """The ``record_function`` ranges the project's code opens (attention, KDA, the pieces' extra forward and
    the pieces kept in part)."""
    from megatron_harts.models.cores import ATTENTION_RANGE, KDA_RANGE
    from megatron_harts.schedules.windows import PIECES_KEPT_RANGE, PIECES_RANGE
    return (ATTENTION_RANGE, KDA_RANGE, PIECES_RANGE, PIECES_KEPT_RANGE)


def annotation(e, ranges) -> bool:
    """Whether a device event of a profile (an event, or an averaged one, named by its key) is a range's span
    on the GPU's timeline rather than work: marked a user annotation, or named as one of ``ranges`` (profilers
    that do not mark them)."""
    return bool(getattr(e, "is_user_annotation", False)) or (e.key if hasattr(e, "key") else e.name) in ranges


def _device_work(events, ranges) -> list:
    """A CUDA profile's device events that are work: kernels, copies and fills (the device annotations of the
    ``ranges``, names of ``record_function`` ranges, span a range: they are not work)."""
    from torch.autograd import DeviceType
    return [e for e in events if e.device_type == DeviceType.CUDA and not annotation(e, ranges)]


def _gaps(intervals: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """The holes between ``intervals`` (microseconds) once merged, from the first start to the last end."""
    out: List[Tuple[float, float]] = []
    end = None
    for a, b in sorted(intervals):
        if end is not None and a > end:
            out.append((end, a))
        end = b if end is None else max(end, b)
    return out


def idle_attribution(host_events, gaps: List[Tuple[float, float]], label, top: int = 12) -> dict:
    """What the host ran while the device idled (module docstring): ``host_events`` CPU events with
    ``time_range`` (microseconds), ``gaps`` the device's idle intervals, ``label(e)`` an event's name in
    the table (its range and its own name).  Returns ``gaps`` (per length class: count and seconds) and
    ``by_host`` (the ``top`` labels by idle seconds, then the rest as one line)."""
    import heapq
    classes = [f"< {b / 1000:g} ms" for b in GAP_BOUNDS_US] + [f">= {GAP_BOUNDS_US[-1] / 1000:g} ms"]
    counted = {c: [0, 0.0] for c in classes}
    points: List[Tuple[float, float]] = []        # (time, seconds it stands for)
    for a, b in gaps:
        length = b - a
        cls = next((c for c, bound in zip(classes, GAP_BOUNDS_US) if length < bound), classes[-1])
        counted[cls][0] += 1
        counted[cls][1] += length / 1e6
        n = max(1, int(length // IDLE_SAMPLE_US))
        points += [(a + (i + 0.5) * length / n, length / n / 1e6) for i in range(n)]
    points.sort()
    events = sorted(host_events, key=lambda e: e.time_range.start)
    alive: list = []                               # heap of (-start, index): the latest started on top
    by: Counter = Counter()
    i = 0
    for t, sec in points:
        while i < len(events) and events[i].time_range.start <= t:
            heapq.heappush(alive, (-events[i].time_range.start, i))
            i += 1
        while alive and events[alive[0][1]].time_range.end <= t:   # ended: the top is the innermost alive
            heapq.heappop(alive)
        by[label(events[alive[0][1]]) if alive else "(no operator: Python)"] += sec
    ranked = by.most_common()
    rows = [[name, sec] for name, sec in ranked[:top]]
    if len(ranked) > top:
        rows.append([f"({len(ranked) - top} more)", sum(sec for _, sec in ranked[top:])])
    return {"gaps": counted, "by_host": rows}


def idle_while(events, ranges: Sequence[str], top: int = 12) -> dict:
    """``idle_attribution`` of a CUDA profile's events (``prof.events()``): the device's gaps from its
    work (``_device_work``), the host's CPU events named by the innermost of the project's ``ranges`` or
    backward node above them; with ``synchronizations``, the count and host seconds of the runtime calls in
    ``SYNC_CALLS``."""
    from torch.autograd import DeviceType
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    spans = [(e.time_range.start, e.time_range.end) for e in _device_work(events, ranges)]
    memo: Dict[int, str] = {}

    def context(e) -> str:          # the innermost project range or backward node at or above ``e``
        key = id(e)
        if key not in memo:
            if e.name in ranges:
                memo[key] = e.name
            elif e.name.startswith("autograd::engine::evaluate_function: "):
                memo[key] = e.name.split(": ", 1)[1]
            else:
                memo[key] = context(e.cpu_parent) if e.cpu_parent is not None else ""
        return memo[key]

    def label(e) -> str:
        up = context(e.cpu_parent) if e.cpu_parent is not None else ""
        return f"{up} > {e.name}" if up and up != e.name else e.name

    out = idle_attribution(cpu, _gaps(spans), label, top)
    syncs = [e for e in cpu if e.name in SYNC_CALLS]
    out["synchronizations"] = {"count": len(syncs),
                               "seconds": sum(e.time_range.end - e.time_range.start for e in syncs) / 1e6}
    return out


def idle_table(rows: Dict[str, dict], top: int = 8) -> str:
    """Per mode (``rows``: key -> a split with ``idle_while``): the device's gaps by length and the
    ``top`` host activities by the idle seconds they stand beside."""
    out = []
    for key, s in rows.items():
        idle = s.get("idle_while")
        if not idle:
            continue
        gaps = ", ".join(f"{c}: {n} gaps {sec:.3f} s" for c, (n, sec) in idle["gaps"].items())
        sy = idle["synchronizations"]
        out.append(f"{key}: device idle {sum(sec for _, sec in idle['gaps'].values()):.3f} s ({gaps}); "
                   f"{sy['count']} host synchronizations waiting {sy['seconds']:.3f} s")
        out += [f"    {sec:>8.3f} s  {name}" for name, sec in idle["by_host"][:top]]
    return "\n".join(out) + ("\n" if out else "")


def profiled_split(step, device: str) -> dict:
    """Run ``step()`` (one training step) under ``torch.profiler`` and return its split
    (``split_step``), with ``launches`` (the device work's pieces) and ``unlinked_launches`` (kernels
    bucketed by name alone: the profile does not say which operator launched them; said once on
    stderr when there are any)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        step()
        if device == "cuda":
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    ranges = project_ranges()
    work, busy, unlinked = profile_work(prof.events(), device, *ranges)
    if unlinked and not _SAID:
        _SAID.append(True)
        print(f"step_profile: {unlinked} of {len(work)} kernels have no launching operator in the profile; "
              f"they are bucketed by kernel name alone", file=sys.stderr, flush=True)
    out = {**split_step(work, wall, busy), "launches": len(work), "unlinked_launches": unlinked}
    if device == "cuda":
        out["idle_while"] = idle_while(prof.events(), ranges)
    return out


_SAID: list = []      # the unlinked-kernels note is said once a process


def split_table(rows: Dict[str, dict]) -> str:
    """A text table of splits (``split_step``'s), one line per key of ``rows``: seconds per bucket and
    the share of the wall time."""
    head = ["attn fwd", "attn bwd", "KDA", "GEMM", "pieces fwd", "other", "host"]
    out = [f"{'mode':<24}{'wall s':>9}" + "".join(f"{h:>15}" for h in head)]
    for key, s in rows.items():
        cells = "".join(f"{s['seconds'][b]:>8.3f} ({100 * s['fraction'][b]:>3.0f}%)" for b in BUCKETS)
        out.append(f"{key:<24}{s['wall_seconds']:>9.3f}" + cells)
    return "\n".join(out) + "\n"
