"""KDA over a rollout tree: run a call plan, hand boundary states on differentiably.

Given the compact rows of a microbatch (segments laid out as ``seg_row``,
``seg_start``, ``seg_length``, ``seg_parent``) and a ``CallPlan`` of the
packed chunkwise-call model (planner/calls.py), ``build_kda_schedule``
precomputes, once per microbatch, for every call: which row feeds each
position of each sequence (replay positions read ancestor rows), which
positions are semantic and where their outputs go, which exported state
starts each sequence, and which states it must export.  ``tree_kda`` then
runs the calls in order with a KDA backend; exported states stay in the
autograd graph, so consumers' gradients reach the producing call.

Invariants kept:

- every row's output is written by exactly one sequence (the one in which its
  segment is semantic);
- a sequence starting at position s>0 gets the state its source sequence had
  after its token s-1, computed in an earlier call; with replay s is aligned
  and its chunks are [s, s+B), [s+B, s+2B)..., which are the chunks of
  expanded per-trajectory training, so the reference backend reproduces
  expanded outputs bitwise (docs/design.md, invariant 2).  Without replay
  (``--no-tree-replay``, and the per-depth / node-wise baseline plans of
  ``planner/baselines.py``) s is the fork position, often unaligned, and the
  state is read inside or at the end of the source sequence (for the
  baselines always its final state): same function, other chunking.

Consumer layouts (cross-microbatch sharing windows): a layout may hold subtrees
whose ancestor rows live in a producer layout.  A subtree root starting at path
position ``p`` starts its sequence at ``s = floor(p/B)*B`` (``s = p`` without
replay) from the producer's boundary state at ``s`` (the zero state when
``s == 0``); the replay tokens ``[s, p)`` are producer rows whose inputs come
with that state (``KdaExternal``).  ``plan_subtree_calls`` plans such layouts
with the unchanged call planner through a thin adapter: every subtree is
shifted by ``-s`` (chunk boundaries stay at multiples of B) and, when ``s <
p``, gets a *stub* root segment of length ``p - s`` standing for the replay
rows, so the root's sequence runs on from the stub exactly as expanded
training runs on from the producer's tokens.  Stub outputs are discarded.  The
producer side exports, differentiably, the state after any of its rows
(``export_rows``), taken from the chunk recurrence of the sequence in which
that row is semantic (at an aligned position this is a chunk-boundary state).

Backends share one interface, the varlen form of ``kda_chunked`` (sequences packed
back to back, host lengths): ``reference`` (ops/kda.py ``kda_chunked_varlen``, any
device); a GPU backend plugs in through ``KDA_BACKENDS``; ``fla`` (ops/kda_fla.py
``kda_fla_varlen``, fla-core's GPU kernels) registers itself on first use
(``get_kda_backend``).  All calls' inputs come from one gather per input (``index_select`` of
the calls' rows back to back, split per call) and the rows' outputs from one gather of the calls'
outputs back to back: launches per layer do not grow with the number of calls.  The inputs'
backward fills one buffer per input, call by call: a plain scatter (``index_copy``, no atomic adds)
where a call is the first to name its rows, each once; where one call reads every row in order
there is no gather at all.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..layout import host_to_device_many
from .kda import kda_chunked_varlen

KDA_BACKENDS: Dict[str, Callable] = {"reference": kda_chunked_varlen}


def get_kda_backend(name: str) -> Callable:
    """The KDA backend ``name`` from ``KDA_BACKENDS``; ``"fla"`` registers itself on first use."""
    if name == "fla" and name not in KDA_BACKENDS:
        from .kda_fla import register_fla_backend
        try:
            register_fla_backend()
        except RuntimeError as e:
            raise ValueError(f"backend 'fla': {e}") from None
    if name not in KDA_BACKENDS:
        raise ValueError(f"backend must be one of {sorted(KDA_BACKENDS)}, got {name!r}")
    return KDA_BACKENDS[name]


def _register_installed_backends() -> None:
    """``"fla"`` is listed when fla-core is installed (found, not imported: CPU machines have no Triton)."""
    import importlib.util
    if importlib.util.find_spec("fla") is not None:
        from .kda_fla import register_fla_backend
        register_fla_backend()


_register_installed_backends()


@dataclass
class KdaCall:
    """One packed call: N sequences back to back, ``lengths[n]`` positions each (replay, then semantic).

    The gather/scatter indices live on the compute device; what only the host reads to drive
    the call (states in and out, sequence lengths) stays on the CPU, so running a call never
    waits for the GPU to answer a question the schedule already knows.
    """
    rows: torch.Tensor          # long [sum(lengths)]: row feeding each packed position
    out_pos: torch.Tensor       # long [M]: packed positions of the semantic outputs
    out_rows: torch.Tensor      # long [M]: rows those outputs belong to
    grad_rows: torch.Tensor     # long [sum(lengths)]: the output row of each packed position, num_rows for
    #                             a position whose output is dropped (replay)
    init_slot: torch.Tensor     # CPU long [N]: exported-state slot starting each sequence, -1 = zero state
    init_external: torch.Tensor  # CPU long [N]: external (producer) state starting each sequence, -1 = none
    export_seq: torch.Tensor    # CPU long [P]: sequence (in this call) of each export
    export_offset: torch.Tensor  # CPU long [P]: tokens of that sequence before the exported state
    export_slot: torch.Tensor   # CPU long [P]: global slot of each export
    lengths: torch.Tensor       # CPU long [N]: positions of each sequence
    rows_fresh: bool = False    # ``rows`` names each row at most once, none named by an earlier call
    out_identity: bool = False  # ``out_pos`` and ``out_rows`` are both 0, 1, ..., M - 1

    #: the fields on the compute device (``KdaSchedule.to`` moves them); the others stay on the host
    DEVICE_FIELDS = ("rows", "out_pos", "out_rows", "grad_rows")


_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass
class KdaSchedule:
    """The calls of one microbatch and what crosses its boundary.

    Rows ``[0, num_rows)`` are the layout's; rows ``[num_rows, num_rows + num_external_rows)``
    are the external replay rows (``external_replay_root``/``external_replay_position``: the
    layout root segment and path position of each, root by root in path order).  Sequences
    with ``init_external >= 0`` start from external state ``init_external`` (the producer's
    boundary state at ``external_state_position`` above root ``external_state_root``).
    ``export_rows[j]`` is the layout row after which the state ``j`` is exported.
    """
    calls: List[KdaCall]
    chunk_size: int
    num_rows: int
    num_slots: int
    replay_tokens: int
    replay: bool
    #: the calls' ``rows`` back to back (None: one call reading every row, external rows included, in
    #: order), on the compute device
    call_rows: Optional[torch.Tensor] = None
    #: [num_rows]: where each row's output sits in the calls' outputs back to back, on the compute device
    out_index: Optional[torch.Tensor] = None
    num_external_rows: int = 0
    external_state_root: np.ndarray = field(default_factory=lambda: _EMPTY)
    external_state_position: np.ndarray = field(default_factory=lambda: _EMPTY)
    external_replay_root: np.ndarray = field(default_factory=lambda: _EMPTY)
    external_replay_position: np.ndarray = field(default_factory=lambda: _EMPTY)
    export_rows: np.ndarray = field(default_factory=lambda: _EMPTY)
    export_slots: np.ndarray = field(default_factory=lambda: _EMPTY)
    #: ``_state_gathers``' plans by device, built on the first run
    state_gathers: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_external_states(self) -> int:
        return int(self.external_state_root.size)

    def to(self, device) -> "KdaSchedule":
        """This schedule with its index tensors on ``device`` (one host-to-device copy for all of them)."""
        n = len(KdaCall.DEVICE_FIELDS)
        moved = host_to_device_many([getattr(c, f) for c in self.calls for f in KdaCall.DEVICE_FIELDS]
                                    + [self.call_rows, self.out_index], device)
        calls = [dataclasses.replace(c, **dict(zip(KdaCall.DEVICE_FIELDS, moved[i * n:(i + 1) * n])))
                 for i, c in enumerate(self.calls)]
        return dataclasses.replace(self, calls=calls, call_rows=moved[-2], out_index=moved[-1], state_gathers={})


@dataclass
class KdaExternal:
    """What a consumer's KDA reads from its producer, in the order its schedule lists.

    ``initial_states`` [E, H, K, V]: the producer's boundary states (``external_state_*``);
    ``q, k, g`` [X, H, K], ``v`` [X, H, V], ``beta`` [X, H]: the replay rows' KDA inputs
    (``external_replay_*``).  Gradients flow into all of them.
    """
    initial_states: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor


@dataclass
class SubtreeCallPlan:
    """A call plan of a layout whose roots may start at p > 0 (``plan_subtree_calls``).

    ``plan`` is a ``CallPlan`` over the augmented segment table (``parent``, ``start``,
    ``length``, ``row``): every layout root block shifted by ``-root_state_position``, with a
    stub root segment (``real_segment == -1``) of ``p - s`` external replay rows (rows
    ``num_rows + ...``) in front of the block when ``s < p``.
    """
    plan: Any
    parent: np.ndarray
    start: np.ndarray
    length: np.ndarray
    row: np.ndarray
    real_segment: np.ndarray
    block: np.ndarray               # layout root block of every augmented segment
    root_segment: np.ndarray        # layout root segments, in order
    root_state_position: np.ndarray  # s of every root (true path position)
    num_rows: int
    replay_tokens: int              # the layout's own replay (external replay included)


def plan_subtree_calls(seg_parent, seg_start, seg_length, seg_row, chunk_size: int, *, replay: bool = True,
                       backend: str = "auto") -> SubtreeCallPlan:
    """Plan the calls of a layout of whole trees and/or subtrees with true start positions.

    Adapter over ``planner.calls.plan_calls`` (whose roots start at 0): see the module
    docstring.  For a layout of whole trees the augmented table is the layout's own and the
    plan is ``plan_calls``'s.  The stub always continues into its only child (the planner
    continues one child of every segment); this is checked.
    """
    from ..planner.calls import plan_calls

    seg_parent, seg_start, seg_length, seg_row = (np.asarray(x, dtype=np.int64)
                                                  for x in (seg_parent, seg_start, seg_length, seg_row))
    B = int(chunk_size)
    if B < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    S = seg_parent.size
    num_rows = int((seg_row + seg_length).max()) if S else 0
    roots = np.flatnonzero(seg_parent < 0)
    if S and (roots.size == 0 or roots[0] != 0):
        raise ValueError("segment table: segment 0 must be a root (segments in DFS preorder)")
    bounds = np.append(roots, S)
    parent, start, length, row, real, block = [], [], [], [], [], []
    state_pos = np.zeros(roots.size, dtype=np.int64)
    ext_row = num_rows
    for i, r in enumerate(roots.tolist()):
        p = int(seg_start[r])
        s = (p // B) * B if replay else p
        state_pos[i] = s
        base = len(parent)
        if p > s:
            parent.append(-1)
            start.append(0)
            length.append(p - s)
            row.append(ext_row)
            real.append(-1)
            block.append(i)
            ext_row += p - s
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        offset = base + (1 if p > s else 0)
        for j in range(lo, hi):
            pj = int(seg_parent[j])
            parent.append((base if p > s else -1) if pj < 0 else pj - lo + offset)
            start.append(int(seg_start[j]) - s)
            length.append(int(seg_length[j]))
            row.append(int(seg_row[j]))
            real.append(j)
            block.append(i)
    a = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    parent, start, length, row, real, block = map(a, (parent, start, length, row, real, block))
    plan = plan_calls(parent, start, length, B, replay=replay, backend=backend)
    for t in np.flatnonzero(real < 0).tolist():
        q = int(plan.segment_sequence[t])
        segs = plan.seq_segments[plan.seq_segments_offsets[q]:plan.seq_segments_offsets[q + 1]]
        if segs.size < 2 or int(segs[0]) != t or int(segs[1]) != t + 1:
            raise ValueError(f"plan_subtree_calls: the replay stub of root segment {int(real[t + 1])} does not "
                             "run on into it")
    stub_tokens = int(length[real < 0].sum())
    return SubtreeCallPlan(plan=plan, parent=parent, start=start, length=length, row=row, real_segment=real,
                           block=block, root_segment=roots.astype(np.int64), root_state_position=state_pos,
                           num_rows=num_rows, replay_tokens=int(plan.replay_tokens) + stub_tokens)


def _path_rows(seg_parent, seg_start, seg_length, seg_row, first_seg: int, lo: int) -> np.ndarray:
    """Rows of path positions [lo, start[first_seg]) above ``first_seg`` (the replay rows)."""
    parts = []
    p = int(seg_parent[first_seg])
    end = int(seg_start[first_seg])
    while end > lo:
        if p < 0:
            raise ValueError(f"segment {first_seg}: replay from {lo} reaches above the root")
        a = max(lo, int(seg_start[p]))
        off = a - int(seg_start[p])
        parts.append(np.arange(int(seg_row[p]) + off, int(seg_row[p]) + off + (end - a)))
        end = a
        p = int(seg_parent[p])
    return np.concatenate(parts[::-1]) if parts else np.zeros(0, dtype=np.int64)


def build_kda_schedule(seg_parent, seg_start, seg_length, seg_row, plan, *,
                       export_rows: Optional[Sequence[int]] = None,
                       device: Optional[torch.device] = None) -> KdaSchedule:
    """Index tensors of every call of ``plan`` over rows laid out by ``seg_row``.

    ``plan``: a ``CallPlan`` of the segment table (whole trees, roots at 0), or a
    ``SubtreeCallPlan`` from ``plan_subtree_calls`` (subtrees whose ancestors live in a
    producer: external initial states and replay rows).  ``export_rows``: layout rows after
    which the state is exported (a producer's boundary states for its consumers), in order.
    """
    seg_parent, seg_start, seg_length, seg_row = (np.asarray(x, dtype=np.int64)
                                                  for x in (seg_parent, seg_start, seg_length, seg_row))
    num_rows = int((seg_row + seg_length).max()) if seg_row.size else 0
    if isinstance(plan, SubtreeCallPlan):
        sp = plan
        if sp.real_segment[sp.real_segment >= 0].size != seg_parent.size or sp.num_rows != num_rows:
            raise ValueError("plan: the subtree call plan was made for another segment table")
        plan = sp.plan
        a_parent, a_start, a_length, a_row = sp.parent, sp.start, sp.length, sp.row
        real, block, state_pos = sp.real_segment, sp.block, sp.root_state_position
        roots, replay_tokens = sp.root_segment, sp.replay_tokens
    else:
        if seg_start[seg_parent < 0].any():
            raise ValueError("plan: a CallPlan covers whole trees only (roots at position 0); plan a layout "
                             "with subtree roots with plan_subtree_calls")
        a_parent, a_start, a_length, a_row = seg_parent, seg_start, seg_length, seg_row
        real = np.arange(seg_parent.size, dtype=np.int64)
        roots = np.flatnonzero(seg_parent < 0)
        block = np.cumsum(seg_parent < 0) - 1
        state_pos = np.zeros(roots.size, dtype=np.int64)
        replay_tokens = int(plan.replay_tokens)
    if plan.num_sequences and int(plan.segment_sequence.size) != a_parent.size:
        raise ValueError(f"plan covers {int(plan.segment_sequence.size)} segments, the table {a_parent.size}")
    B = int(plan.chunk_size)
    # external states (one per root with s > 0) and replay rows (stub rows, root by root)
    ext_state_of_block = np.full(roots.size, -1, dtype=np.int64)
    ext_state_of_block[state_pos > 0] = np.arange(int((state_pos > 0).sum()))
    stubs = np.flatnonzero(real < 0)
    rep_root = np.repeat(roots[block[stubs]], a_length[stubs]) if stubs.size else _EMPTY
    rep_pos = (np.concatenate([state_pos[block[t]] + np.arange(a_length[t]) for t in stubs.tolist()])
               if stubs.size else _EMPTY)
    num_ext_rows = int(a_length[stubs].sum())
    # slot of every export, and the slot each sequence starts from
    num_plan_slots = int(plan.seq_exports_offsets[-1]) if plan.num_sequences else 0
    slot_of = {}
    extra = {}  # sequence -> [(offset, slot)]
    for q in range(plan.num_sequences):
        for e in range(int(plan.seq_exports_offsets[q]), int(plan.seq_exports_offsets[q + 1])):
            slot_of[(q, int(plan.seq_export_positions[e]))] = e
    export_rows = _EMPTY if export_rows is None else np.asarray(list(export_rows), dtype=np.int64).reshape(-1)
    if export_rows.size and (export_rows.min() < 0 or export_rows.max() >= num_rows):
        raise ValueError(f"export_rows must be layout rows in [0, {num_rows})")
    aug_of_real = np.full(seg_parent.size, -1, dtype=np.int64)
    aug_of_real[real[real >= 0]] = np.flatnonzero(real >= 0)
    row_seg = np.searchsorted(seg_row, export_rows, side="right") - 1
    export_slots = np.arange(num_plan_slots, num_plan_slots + export_rows.size, dtype=np.int64)
    for j, (r, sg) in enumerate(zip(export_rows.tolist(), row_seg.tolist())):
        t = int(aug_of_real[sg])
        q = int(plan.segment_sequence[t])
        end = int(a_start[t]) + (r - int(seg_row[sg])) + 1
        extra.setdefault(q, []).append((end - int(plan.seq_start[q]), int(export_slots[j])))
    calls, host_calls = [], []
    for c in range(int(plan.num_calls)):
        seqs = range(int(plan.call_offsets[c]), int(plan.call_offsets[c + 1]))
        row_lists, init, init_ext, exp_seq, exp_off, exp_slot = [], [], [], [], [], []
        for n, q in enumerate(seqs):
            s = int(plan.seq_start[q])
            first = int(plan.seq_first_segment[q])
            segs = plan.seq_segments[plan.seq_segments_offsets[q]:plan.seq_segments_offsets[q + 1]]
            replay_rows = _path_rows(a_parent, a_start, a_length, a_row, first, s)
            sem = [np.arange(a_row[i], a_row[i] + a_length[i]) for i in segs]
            out_mask = np.concatenate([np.full(int(a_length[i]), real[i] >= 0) for i in segs])
            row_lists.append((replay_rows, np.concatenate(sem), out_mask))
            src = int(plan.seq_source[q])
            if src < 0:
                init.append(-1)
                init_ext.append(int(ext_state_of_block[block[first]]))
            else:
                key = (src, s)
                if key not in slot_of:
                    raise ValueError(f"plan: sequence {q} starts at {s} from sequence {src}, which does not "
                                     "export that state")
                init.append(slot_of[key])
                init_ext.append(-1)
            for e in range(int(plan.seq_exports_offsets[q]), int(plan.seq_exports_offsets[q + 1])):
                exp_seq.append(n)
                exp_off.append(int(plan.seq_export_positions[e]) - s)
                exp_slot.append(e)
            for off, sl in extra.get(q, []):
                exp_seq.append(n)
                exp_off.append(off)
                exp_slot.append(sl)
        lengths = np.array([len(r) + len(m) for r, m, _ in row_lists], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        rows = np.concatenate([np.concatenate([rr, sr]) for rr, sr, _ in row_lists])
        out_pos = np.concatenate([(st + len(rr) + np.arange(len(sr)))[om]
                                  for st, (rr, sr, om) in zip(starts, row_lists)])
        out_rows = np.concatenate([sr[om] for rr, sr, om in row_lists])
        host_calls.append((rows, out_pos, out_rows, init, init_ext, exp_seq, exp_off, exp_slot, lengths))
    out_rows_all = [c[2] for c in host_calls]
    covered = np.sort(np.concatenate(out_rows_all)) if out_rows_all else np.zeros(0, dtype=np.int64)
    if not np.array_equal(covered, np.arange(num_rows)):
        raise ValueError(f"plan's calls output {covered.size} rows ({np.unique(covered).size} distinct), the "
                         f"layout has {num_rows}: every row must be output by exactly one call")
    h = lambda x: torch.as_tensor(np.asarray(x, dtype=np.int64))  # noqa: E731
    in_order = lambda x: bool(np.array_equal(x, np.arange(x.size)))  # noqa: E731
    named = np.zeros(num_rows + num_ext_rows, dtype=bool)      # rows named by an earlier call
    out_index = np.zeros(num_rows, dtype=np.int64)
    offset = 0
    for rows, out_pos, out_rows, init, init_ext, exp_seq, exp_off, exp_slot, lengths in host_calls:
        fresh = bool(rows.size == 0 or (np.bincount(rows).max() <= 1 and not named[rows].any()))
        named[rows] = True
        grad_rows = np.full(rows.size, num_rows, dtype=np.int64)
        grad_rows[out_pos] = out_rows
        out_index[out_rows] = offset + out_pos
        offset += rows.size
        call = KdaCall(rows=h(rows), out_pos=h(out_pos), out_rows=h(out_rows), grad_rows=h(grad_rows),
                       init_slot=h(init), init_external=h(init_ext), export_seq=h(exp_seq),
                       export_offset=h(exp_off), export_slot=h(exp_slot), lengths=h(lengths),
                       rows_fresh=fresh, out_identity=in_order(out_pos) and in_order(out_rows))
        calls.append(call)
    every_row_in_order = len(host_calls) == 1 and in_order(host_calls[0][0]) and \
        host_calls[0][0].size == num_rows + num_ext_rows
    call_rows = None if every_row_in_order else \
        h(np.concatenate([c[0] for c in host_calls]) if host_calls else _EMPTY)
    has_state = state_pos > 0
    schedule = KdaSchedule(calls=calls, chunk_size=B, num_rows=num_rows, call_rows=call_rows,
                           out_index=h(out_index), num_slots=num_plan_slots + int(export_rows.size),
                           replay_tokens=replay_tokens, replay=bool(plan.replay), num_external_rows=num_ext_rows,
                           external_state_root=roots[has_state].astype(np.int64),
                           external_state_position=state_pos[has_state].astype(np.int64),
                           external_replay_root=rep_root.astype(np.int64),
                           external_replay_position=rep_pos.astype(np.int64),
                           export_rows=export_rows, export_slots=export_slots)
    return schedule if device is None else schedule.to(device)


class _GatherCallRows(torch.autograd.Function):
    """The calls' packed inputs from the rows' ``x``: one ``index_select`` of the calls' rows back to
    back (``schedule.call_rows``), one buffer that :func:`_call_inputs` splits into one contiguous view
    per call.

    The backward fills one zero buffer with each call's gradient at the call's rows, in call order:
    ``index_copy_`` where the call is the first to name its rows, each once (``rows_fresh``), else
    ``index_add_``.  A row's gradient is thus its calls' gradients summed in call order, with no
    full-size buffer per call and no adds of such buffers (what one ``index_select`` per call costs)."""

    @staticmethod
    def forward(ctx, x, calls, call_rows):
        ctx.calls, ctx.num_rows = calls, x.shape[0]
        return x.index_select(0, call_rows)

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_zeros((ctx.num_rows,) + tuple(grad.shape[1:]))
        parts = grad.split([c.rows.numel() for c in ctx.calls])
        for call, g in zip(ctx.calls, parts):
            (out.index_copy_ if call.rows_fresh else out.index_add_)(0, call.rows, g)
        return out, None, None


def calls_rows(x: torch.Tensor, schedule: KdaSchedule, replay: Optional[torch.Tensor] = None) -> torch.Tensor:
    """What the schedule's calls read of ``x`` [R, ...] (and of ``replay``, the producer's replay rows a
    consumer's calls read after the rows: ``KdaExternal``), back to back in call order: one tensor, ``x``
    itself where one call reads every row in order.  :func:`tree_kda` takes it for q, k and v
    (``calls_inputs``), so that a caller may compute it where it computes them."""
    if replay is not None:
        x = torch.cat([x, replay.to(x.dtype)])
    if schedule.call_rows is None:            # one call reading every row in order
        return x.contiguous()
    return _GatherCallRows.apply(x, schedule.calls, schedule.call_rows)


def _call_inputs(rows: torch.Tensor, schedule: KdaSchedule) -> tuple:
    """Each call's packed rows (``x.index_select(0, call.rows)`` per call, the same values) from
    :func:`calls_rows`' tensor."""
    if not schedule.calls:
        return ()
    if schedule.call_rows is None:
        return (rows,)
    return rows.split([c.rows.numel() for c in schedule.calls])


def _outputs_in_order(call: KdaCall, positions: int) -> bool:
    """A call's ``positions`` packed outputs are its output rows' values in order (no replay
    position before them, nothing to gather)."""
    return call.out_identity and positions == call.out_rows.numel()


class _ScatterCallOutputs(torch.autograd.Function):
    """The rows' outputs ``out[R, ...]`` from the calls' packed outputs: ``out[call.out_rows] =
    o[call.out_pos]`` for every call (their ``out_rows`` partition 0..R-1, which the schedule
    checks), as one gather of the outputs back to back (``schedule.out_index``).  Only index tensors
    are kept for the backward, which hands each call the gradient at its positions' rows (zero at its
    replay positions: ``grad_rows`` names the zero row appended to the gradient); an out-of-place
    ``index_copy`` chain would keep every call's output alive until the backward instead."""

    @staticmethod
    def forward(ctx, calls, out_index, *outputs):
        ctx.calls = calls
        return (outputs[0] if len(outputs) == 1 else torch.cat(outputs)).index_select(0, out_index)

    @staticmethod
    def backward(ctx, grad):
        padded = torch.cat([grad, grad.new_zeros((1,) + tuple(grad.shape[1:]))])
        return (None, None, *(padded.index_select(0, call.grad_rows) for call in ctx.calls))


@dataclass
class _StateGather:
    """How a list of states is assembled from where the states live: ``parts`` concatenated in
    order, each ``(source, rows)`` with source ``("call", c)`` (the states call c exported, in its
    export order), ``("external", 0)`` (the producer's states) or ``("zero", 0)`` (one zero state),
    and ``rows`` the device index of the rows taken (None: all of the source's rows, in order).
    Entry i of the list is row ``index[i]`` of the concatenation (``index`` None: row i).  Every
    distinct state is taken once, so a state's gradient arrives through one gather of its source."""
    parts: List[tuple]
    index: Optional[List[int]]
    host_rows: List[Optional[np.ndarray]] = field(default_factory=list, repr=False)
    order: Optional[torch.Tensor] = None    # ``index`` on the device (the exported states' gather)

    def assemble(self, call_states: List[torch.Tensor], ext_states: Optional[torch.Tensor],
                 like: torch.Tensor) -> torch.Tensor:
        pieces = []
        for (kind, c), rows in self.parts:
            if kind == "zero":
                pieces.append(like.new_zeros((1,) + tuple(like.shape[1:])))
                continue
            src = call_states[c] if kind == "call" else ext_states
            pieces.append(src if rows is None else src.index_select(0, rows))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _plan_state_gather(keys, slot_source, source_sizes) -> _StateGather:
    """``keys`` (slot, external) per entry, as a call names its starting states (slot -1 and external
    -1: the zero state); ``slot_source[s] = (call, row)``: where slot s was exported;
    ``source_sizes[source]``: the rows a source holds.  Rows are grouped by source, each group in
    first-appearance order."""
    def locate(s, e):
        if s >= 0:
            return ("call", slot_source[s][0]), slot_source[s][1]
        return (("external", 0), e) if e >= 0 else (("zero", 0), 0)

    located = [locate(s, e) for s, e in keys]
    distinct: Dict[tuple, Dict[int, None]] = {}      # source -> its rows, an ordered set
    for src, r in located:
        distinct.setdefault(src, {})[r] = None
    groups = {src: list(rows) for src, rows in distinct.items()}
    offset, position = 0, {}
    for src, rows in groups.items():
        position.update({(src, r): offset + i for i, r in enumerate(rows)})
        offset += len(rows)
    index = [position[entry] for entry in located]
    host_rows = [None if src[0] == "zero" or rows == list(range(source_sizes[src])) else np.asarray(rows, np.int64)
                 for src, rows in groups.items()]
    return _StateGather(parts=[(src, None) for src in groups], host_rows=host_rows,
                        index=None if index == list(range(len(keys))) else index)


def _state_gathers(schedule: KdaSchedule, device):
    """Per call, its starting states as a ``_StateGather`` (None: every sequence starts from zero),
    and the exported states' (``schedule.export_slots``); built once per schedule and device (every
    KDA layer of a microbatch runs the same schedule), index tensors copied in one transfer."""
    key = str(device)
    cached = schedule.state_gathers.get(key)
    if cached is not None:
        return cached
    slot_source = {}
    sizes = {("external", 0): schedule.num_external_states}
    for c, call in enumerate(schedule.calls):
        slots = call.export_slot.tolist()
        sizes[("call", c)] = len(slots)
        slot_source.update({s: (c, p) for p, s in enumerate(slots)})
    per_call = []
    for call in schedule.calls:
        keys = list(zip(call.init_slot.tolist(), call.init_external.tolist()))
        starts_from_zero = all(s < 0 and e < 0 for s, e in keys)
        per_call.append(None if starts_from_zero else _plan_state_gather(keys, slot_source, sizes))
    exported = (_plan_state_gather([(int(s), -1) for s in schedule.export_slots], slot_source, sizes)
                if schedule.export_slots.size else None)
    plans = [g for g in per_call + [exported] if g is not None]
    order = None if exported is None or exported.index is None else torch.as_tensor(exported.index)
    *rows, order = host_to_device_many([torch.from_numpy(r) if r is not None else None
                                        for g in plans for r in g.host_rows] + [order], device)
    i = 0
    for g in plans:
        g.parts = [(src, rows[i + j]) for j, (src, _) in enumerate(g.parts)]
        i += len(g.parts)
    if exported is not None:
        exported.order = order
    schedule.state_gathers[key] = (per_call, exported)
    return per_call, exported


def tree_kda(q, k, v, g, beta, schedule: KdaSchedule, *, scale: Optional[float] = None,
             backend: str = "reference", external: Optional[KdaExternal] = None,
             return_exports: bool = False, calls_inputs: Optional[Tuple[torch.Tensor, ...]] = None):
    """KDA outputs [R, H, V] of every row; inputs are per row: q, k, g [R, H, K], v [R, H, V], beta [R, H].

    ``external``: the producer's states and replay inputs when the schedule has any (a
    consumer layout).  With ``return_exports`` returns ``(outputs, states)``, ``states``
    [len(schedule.export_rows), H, K, V] (compute dtype) the states after
    ``schedule.export_rows``, in the autograd graph.  ``calls_inputs``: the calls' rows of q, k and v
    as :func:`calls_rows` gives them (with ``external``'s replay rows), computed by the caller; the
    rows q, k, v then only give the shapes.
    """
    run = get_kda_backend(backend)
    R, H, K = q.shape
    if R != schedule.num_rows:
        raise ValueError(f"inputs have {R} rows, the schedule {schedule.num_rows}")
    V = v.shape[-1]
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    needs_external = schedule.num_external_rows > 0 or schedule.num_external_states > 0
    ext_states = None
    if needs_external:
        if external is None:
            raise ValueError("this schedule's subtrees start from producer states: pass external=KdaExternal(...)")
        X, E = schedule.num_external_rows, schedule.num_external_states
        if external.q.shape[0] != X or external.initial_states.shape[0] != E:
            raise ValueError(f"external: the schedule needs {E} states and {X} replay rows, got "
                             f"{external.initial_states.shape[0]} and {external.q.shape[0]}")
        ext_states = external.initial_states.to(cdt)
    elif external is not None and (external.q.shape[0] or external.initial_states.shape[0]):
        raise ValueError("external: this schedule reads no producer state (a layout of whole trees), got "
                         f"{external.initial_states.shape[0]} states and {external.q.shape[0]} replay rows")
    per_call, export_gather = _state_gathers(schedule, q.device)
    zero_like = q.new_empty((0, H, K, V), dtype=cdt)
    call_states: List[torch.Tensor] = []
    outputs = []
    replay = (external.q, external.k, external.v, external.g, external.beta) if needs_external else (None,) * 5
    if calls_inputs is None:
        calls_inputs = tuple(calls_rows(x, schedule, e) for x, e in zip((q, k, v), replay))
    elif len(calls_inputs) != 3:
        raise ValueError(f"calls_inputs: the calls' rows of q, k and v, got {len(calls_inputs)} tensors")
    per_input = [*calls_inputs, *(calls_rows(x, schedule, e) for x, e in zip((g, beta), replay[3:]))]
    inputs = list(zip(*(_call_inputs(x, schedule) for x in per_input)))
    for call, gather, xs in zip(schedule.calls, per_call, inputs):
        init = None if gather is None else gather.assemble(call_states, ext_states, zero_like)
        o, states = run(*xs, call.lengths, chunk_size=schedule.chunk_size, scale=scale, initial_state=init,
                        state_index=call.export_seq, state_offset=call.export_offset,
                        initial_state_index=None if gather is None else gather.index)
        call_states.append(states)
        outputs.append(o)
    if len(outputs) == 1 and outputs[0].shape[0] == R and _outputs_in_order(schedule.calls[0], R):
        out = outputs[0]                        # the one call holds every row, in order
    elif outputs:
        out = _ScatterCallOutputs.apply(schedule.calls, schedule.out_index, *outputs)
    else:
        out = v.new_zeros(R, H, V)
    if not return_exports:
        return out
    if export_gather is None:
        return out, zero_like
    exported = export_gather.assemble(call_states, ext_states, zero_like)
    return out, (exported if export_gather.order is None else exported.index_select(0, export_gather.order))


def consumer_kda_sources(layout, schedule: KdaSchedule):
    """Producer rows feeding a consumer layout's KDA: ``(state_rows, replay_rows)`` (int64 numpy).

    ``state_rows[e]``: the producer row after which the producer exports external state e
    (the row at position ``external_state_position[e] - 1`` on root ``external_state_root[e]``'s
    path); ``replay_rows[x]``: the producer row of replay row x.  Both come from the layout's
    context rows (``prev_external``, ``ctx_prev``, ``ctx_source_rows``).
    """
    prev_ext = layout.prev_external.cpu().numpy()
    ctx_prev = layout.ctx_prev.cpu().numpy()
    ctx_pos = layout.ctx_position_ids.cpu().numpy()
    ctx_src = layout.ctx_source_rows.cpu().numpy()

    def row_at(root: int, pos: int) -> int:
        c = int(prev_ext[int(layout.seg_row[root])])
        while c >= 0 and int(ctx_pos[c]) > pos:
            c = int(ctx_prev[c])
        if c < 0 or int(ctx_pos[c]) != pos:
            raise ValueError(f"consumer layout: root segment {root} has no context row at position {pos}")
        return int(ctx_src[c])

    state_rows = np.array([row_at(r, p - 1) for r, p in zip(schedule.external_state_root.tolist(),
                                                            schedule.external_state_position.tolist())],
                          dtype=np.int64)
    replay_rows = np.array([row_at(r, p) for r, p in zip(schedule.external_replay_root.tolist(),
                                                         schedule.external_replay_position.tolist())],
                           dtype=np.int64)
    return state_rows, replay_rows
