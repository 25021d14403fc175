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
        device_events = [e for e in events if e.device_type == DeviceType.CUDA
                         and not getattr(e, "is_user_annotation", False) and e.name not in ranges]
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


def profiled_split(step, device: str) -> dict:
    """Run ``step()`` (one training step) under ``torch.profiler`` and return its split
    (``split_step``), with ``launches`` (the device work's pieces) and ``unlinked_launches`` (kernels
    bucketed by name alone: the profile does not say which operator launched them; said once on
    stderr when there are any)."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_harts.models.cores import ATTENTION_RANGE, KDA_RANGE
    from megatron_harts.schedules.windows import PIECES_KEPT_RANGE, PIECES_RANGE
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        step()
        if device == "cuda":
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    work, busy, unlinked = profile_work(prof.events(), device, ATTENTION_RANGE, KDA_RANGE, PIECES_RANGE,
                                         PIECES_KEPT_RANGE)
    if unlinked and not _SAID:
        _SAID.append(True)
        print(f"step_profile: {unlinked} of {len(work)} kernels have no launching operator in the profile; "
              f"they are bucketed by kernel name alone", file=sys.stderr, flush=True)
    return {**split_step(work, wall, busy), "launches": len(work), "unlinked_launches": unlinked}


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
