"""Sharing windows on pipeline size 1: producers, consumers, window close.

``forward_backward_windows`` has megatron-core's schedule signature
(``forward_backward_no_pipelining``'s keywords) and runs one step of microbatches some of which
form sharing windows (docs/design.md: producer / consumer / sharing window):

- a *producer* (a microbatch that some later microbatch names as its producer) runs its
  forward with per-layer exports recorded (``TreePackedSeqParams.for_tree(export=...)``); its
  loss and graph stay alive, its backward is deferred;
- each *consumer* runs forward and backward at once, reading the producer's exports through
  detached leaves shared by all consumers of the window, so the export gradients accumulate;
- after the window's last consumer the window *closes*: one backward through the producer,
  from its own loss and the accumulated export gradients; its exports are freed.

Plain microbatches (no window) run forward+backward at once; a plain microbatch may also be an
expanded one (``layout`` an :class:`~megatron_harts.layout.ExpandedBatch`: trajectories packed
with no sharing, ``TreePackedSeqParams.for_sequences``), so expanded training runs through the
same schedule (:func:`expanded_microbatches`).  The parameter gradients of the
step are those of running every microbatch with its shared prefix recomputed (and so, with
the tree path, those of expanded training): tests/test_windows_schedule.py pins both.

Microbatches are :class:`WindowedMicrobatch` items (a layout of whole trees, of whole
subtrees or of a computed segment set, the mask of the targets it owns, its producer's position
in the step, and the rows its MoE statistics count); the data iterator yields them in execution
order, producers before their consumers.  :func:`windowed_microbatches` builds them from one
replica's share of a planner's ``MicrobatchPlan`` (tests/test_windows_plan.py pins that a
planned step equals the recomputed step and expanded training).
``forward_step_func(data_iterator, model)`` is called once per microbatch with an iterator
yielding ``(microbatch, packed_seq_params)`` and returns ``(output, loss_func)``;
``loss_func(output)`` returns ``(loss, stats)`` or ``(loss, num_tokens, stats)`` as in
megatron.  Microbatches may come on the host: each schedule moves a microbatch's layout to the
model's device as it runs it (:func:`microbatch_on`), so the device holds the layouts of the
microbatches in flight and of open windows' producers, not the whole step's.  Peak retained
export memory (bytes of live exports, maximum over the step) is reported in ``window_stats``
when a dict is passed.

Activation recomputation (``recompute_granularity="full"``): a producer that keeps its graph runs
its forward without it (:func:`producer_forward`: megatron's checkpointed forward runs under
``no_grad``, which would cut the exports' autograd link; its graph is kept until window close
anyway); consumers, plain microbatches, and the forwards that run again with their exports'
gradients (a recomputed producer at window close, a read piece once its readers are done) recompute as
configured: those gradients enter through the recording layer's output
(``TreePackedSeqParams.attach_injected``), which the recomputation runs again.  A read piece that
keeps its graph runs its forward once, recomputing as configured: its exports recorded inside a
recomputed layer (no graph) get their gradients the same way when its backward recomputes the layer
(:func:`kept_piece_backward`).  The pieces
(:func:`check_windows`, :func:`producer_params`, :func:`microbatch_params`, :func:`producer_forward`)
are shared with the pipeline schedules of ``schedules/pipeline.py``.

Limits (refused with ValueError): pipeline size > 1 (consumer 1F1B is a separate schedule),
model chunks (virtual pipeline), a consumer before its producer, a producer that is itself a
consumer (nested producers).  Gradient reduction across data-parallel replicas stays the
caller's (``finalize_model_grads``), as with megatron's schedules.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..layout import CompactLayout, host_to_device
from ..models.packed import ExportSpec, TreePackedSeqParams, WindowExports
from ..ops.key_paths import gathered_key_count
from ..planner.memory import (PIECE_KEEP, ModelShape, StepItem, WindowMemoryPlan, attention_bytes, export_bytes,
                              forward_end_bytes_per_row, graph_bytes_per_row, layer_graph_bytes_per_row,
                              layer_input_bytes_per_row, plan_window_memory,
                              saved_bytes_per_row)
from ..planner.microbatch import replica_windows
from ..planner.pieces import piece_backward_points

__all__ = ["WindowedMicrobatch", "check_windows", "expanded_microbatches", "forward_backward_windows",
           "kept_piece_backward", "leading_layers_recomputed", "microbatch_on", "microbatch_params", "model_device",
           "piece_choice", "piece_extra_forward_rows", "piece_microbatches", "producer_forward", "producer_params",
           "schedule_choice", "ScheduleChoice", "step_memory_plan", "windowed_microbatches"]


@dataclass
class WindowedMicrobatch:
    """One microbatch of a windowed step.

    ``layout``: its rows (whole trees, or whole subtrees built with ``context=`` the producer's
    layout); ``owned``: bool [num_targets] mask of the targets whose loss this microbatch
    carries (None: all; a producer leaves its consumers' targets unowned when its layout holds
    their rows too); ``producer``: position in the step of the producer whose exports it reads
    (None: not a consumer); ``replay``: KDA replay (the tree path's default); ``counted``: bool
    [num_rows] mask of the rows whose MoE statistics (tokens per expert, aux-loss token weights)
    count in this microbatch, with their occurrence count (None: all rows).  A row computed in
    several microbatches of a step (recomputed context) must be counted in exactly one of them
    for the step's tokens-per-expert to equal expanded training's.

    A *piece* of a long path (``planner.pieces``): ``reads`` are the positions in the step of the
    earlier pieces holding its root path, ``context`` their rows as one layout (the layout is built
    with ``context=`` it); a piece that some later piece reads exports its own rows to it.
    """
    layout: Any
    owned: Optional[torch.Tensor] = None
    producer: Optional[int] = None
    replay: bool = True
    counted: Optional[torch.Tensor] = None
    reads: Tuple[int, ...] = ()
    context: Any = None


def microbatch_on(mb: WindowedMicrobatch, device) -> WindowedMicrobatch:
    """``mb`` with its layout's tensors on ``device`` (``mb`` itself when they are there already).
    A layout moved from the host keeps it as ``host_copy``, which the packed params read their
    metadata from; the host microbatch is unchanged, so a schedule can move it again."""
    if mb.layout.tokens.device == torch.device(device):
        return mb
    return dataclasses.replace(mb, layout=mb.layout.to(device))


def model_device(model) -> torch.device:
    """The device of the model chunk's parameters (where a schedule moves its microbatches)."""
    return next(iter(model.parameters())).device


def _check_plan(plan, mode: str, replica, caller: str) -> None:
    if getattr(plan, "mode", None) != mode:
        raise ValueError(f"{caller}: a {mode}-mode MicrobatchPlan is expected, got mode {getattr(plan, 'mode', None)!r}")
    if isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < plan.num_replicas:
        raise ValueError(f"{caller}: replica must be an integer in [0, {plan.num_replicas}), got {replica!r}")


def expanded_microbatches(forest, plan, replica: int = 0) -> List[WindowedMicrobatch]:
    """A planned expanded step of one replica: each microbatch's trajectories packed with no sharing.

    ``plan`` is an expanded-mode ``MicrobatchPlan`` (e.g. ``planner.plan_ffd``); items come in
    slot order (idle slots skipped); every trajectory of the forest is in exactly one item over
    all replicas, so the step's targets are each computed once.
    """
    from ..layout import build_expanded_batch
    _check_plan(plan, "expanded", replica, "expanded_microbatches")
    return [WindowedMicrobatch(build_expanded_batch(forest, m.trajectories)) for m in plan.schedule(replica)
            if m is not None]


def windowed_microbatches(forest, plan, replica: int = 0, *, replay: bool = True,
                          windows: bool = True) -> List[WindowedMicrobatch]:
    """A planned step of one replica as :class:`WindowedMicrobatch` items, in execution order.

    ``plan`` is a tree-mode ``MicrobatchPlan`` of ``forest``; the items are replica
    ``replica``'s microbatches in slot order (idle slots skipped).  Each item's layout is
    ``build_layout(forest, segments=m.computed, owned=m.owned)``: its targets are exactly the
    owned segments' targets, so over the plan every target is computed once (``owned`` is None).

    Which external context runs as a sharing window and which is recomputed is
    ``planner.microbatch.replica_windows``' rule (an item whose microbatch has ``external``
    context but whose ``producer`` is None recomputed it: more rows than the plan's, same
    log-probs and gradients).  ``counted`` marks the rows of owned segments: every
    row of the forest is counted once over the plan (all replicas), so the step's MoE
    tokens-per-expert are expanded training's.
    """
    from ..layout import build_layout
    if getattr(plan, "mode", None) != "tree":
        raise ValueError(f"windowed_microbatches: a tree-mode MicrobatchPlan is expected, got mode "
                         f"{getattr(plan, 'mode', None)!r}")
    if isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < plan.num_replicas:
        raise ValueError(f"windowed_microbatches: replica must be an integer in [0, {plan.num_replicas}), "
                         f"got {replica!r}")
    try:
        entries = replica_windows(forest, plan, replica, windows=windows)
    except ValueError as e:
        raise ValueError(f"windowed_microbatches: {e}") from None
    items: List[WindowedMicrobatch] = []
    for e in entries:
        m, producer = e.microbatch, e.producer
        if producer is not None:
            lay = build_layout(forest, segments=e.computed, owned=m.owned, context=items[producer].layout)
        else:
            lay = build_layout(forest, segments=e.computed, owned=m.owned)
        counted = torch.as_tensor(np.isin(lay.seg_forest, m.owned)[lay.row_segment.numpy()])
        items.append(WindowedMicrobatch(lay, None, producer, replay, counted))
    return items


def piece_microbatches(plan, replica: int = 0, *, replay: bool = True, offset: int = 0) -> List[WindowedMicrobatch]:
    """The pieces of the long trees' chains (``plan.pieces``, ``planner.pieces``) that replica ``replica``
    runs, chain after chain, as :class:`WindowedMicrobatch` items whose ``reads`` are positions in a step
    where these items start at ``offset``, then (expanded mode) its groups of the long trees' fitting
    trajectories, one expanded batch each.  Each piece owns and counts all its rows' targets and MoE
    statistics (every row of a chain is in one piece); an expanded-mode chain's layouts name the
    step forest's trajectory."""
    from ..layout import build_expanded_batch, build_layout
    ps = getattr(plan, "pieces", None)
    items: List[WindowedMicrobatch] = []
    if ps is None:
        return items
    for c, (lo, hi) in enumerate(ps.chains):
        if ps.chain_replica[c] != replica:
            continue
        f, t = ps.chain_forest[c], ps.chain_trajectory[c]
        base = offset + len(items)
        for i in range(lo, hi):
            piece = ps.pieces[i]
            ctx = None
            if piece.reads:       # the root paths above the piece, held by the pieces it reads
                ctx = build_layout(f, segments=_root_paths(f, piece.segments))
            lay = build_layout(f, segments=piece.segments, context=ctx)
            if t >= 0:
                lay.traj_forest = np.full_like(lay.traj_forest, t)
            items.append(WindowedMicrobatch(lay, replay=replay, reads=tuple(base + r - lo for r in piece.reads),
                                            context=ctx))
    for g, r in zip(ps.groups, ps.group_replica):      # expanded mode: the long trees' fitting trajectories
        if r == replica:
            items.append(WindowedMicrobatch(build_expanded_batch(ps.forest, g)))
    return items


def _root_paths(forest, segments: np.ndarray) -> np.ndarray:
    """The ancestors of ``segments`` outside them (sorted): closed under parents, so a ``segments=``
    layout of them holds whole root paths, one block per tree."""
    inside = set(int(x) for x in segments)
    parent = forest.seg_parent
    above: set = set()
    for seg in segments.tolist():
        q = int(parent[seg])
        while q >= 0 and q not in inside and q not in above:
            above.add(q)
            q = int(parent[q])
    return np.array(sorted(above), dtype=np.int64)


_KINDS = ("rows", "conv_rows", "replay_rows", "state_rows")
#: ``torch.profiler.record_function`` name of a read piece's exports-only forward (its extra forward)
PIECES_RANGE = "harts.pieces_extra_forward"
#: ``torch.profiler.record_function`` name of a piece's forward kept with its leading layers checkpointed
#: (``leading_layers_recomputed``): the checkpoint nodes created inside it run those layers' forward again in
#: the backward, the rest of the piece's extra forward
PIECES_KEPT_RANGE = "harts.pieces_kept_in_part"


def _host_layout(layout):
    return layout.host_copy if getattr(layout, "host_copy", None) is not None else layout


def _as_np(x) -> np.ndarray:
    return x.cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


@dataclass
class _Pieces:
    """A step's pieces (host side): ``readers[i]`` (later pieces reading piece i), ``specs[i]`` (what piece
    i exports: every row some reader reads from it), ``reading[j] = (spec, gathers)`` (reader j's view of
    its earlier pieces as one producer: ``spec`` in its context layout's rows, ``gathers[kind]`` the index
    of each of the spec's rows in the concatenation of its read pieces' exports, in ``reads`` order),
    ``members``: the positions of the pieces, ``backward_after[j]``: the read pieces whose backwards run
    right after position j's forward (``planner.pieces.piece_backward_points``)."""
    readers: Dict[int, List[int]]
    specs: Dict[int, ExportSpec]
    reading: Dict[int, tuple]
    members: frozenset
    backward_after: Dict[int, List[int]]


def _plan_pieces(mbs: List[WindowedMicrobatch], cfg) -> _Pieces:
    readers: Dict[int, List[int]] = {}
    for j, mb in enumerate(mbs):
        for i in mb.reads:
            readers.setdefault(i, []).append(j)
    members = [i for i in range(len(mbs)) if mbs[i].reads or i in readers]
    combined = {j: ExportSpec.for_consumers(mbs[j].context, [mbs[j].layout], config=cfg, replay=mbs[j].replay)
                for j, mb in enumerate(mbs) if mb.reads}
    forest_rows = {i: _host_layout(mbs[i].layout).forest_rows.cpu().numpy() for i in members}
    local: Dict[int, Dict[str, List[np.ndarray]]] = {i: {k: [] for k in _KINDS} for i in readers}
    located: Dict[int, Dict[str, List[tuple]]] = {}
    for j, cs in combined.items():
        ctx_rows = _host_layout(mbs[j].context).forest_rows.cpu().numpy()
        located[j] = {}
        for kind in _KINDS:
            want = ctx_rows[_as_np(getattr(cs, kind)).astype(np.int64)]
            found = np.zeros(want.size, dtype=bool)
            parts = []
            for i in mbs[j].reads:
                pf = forest_rows[i]
                pos = np.searchsorted(pf, want)
                hit = (pos < pf.size) & (pf[np.minimum(pos, max(pf.size - 1, 0))] == want) if pf.size else found & False
                local[i][kind].append(pos[hit])
                parts.append((i, np.flatnonzero(hit), pos[hit]))
                found |= hit
            if not found.all():
                raise ValueError(f"microbatch {j}: its context row (forest row {int(want[~found][0])}) is in none of "
                                 f"the pieces it reads {mbs[j].reads}")
            located[j][kind] = parts
    specs: Dict[int, ExportSpec] = {}
    for i in readers:
        u = {k: np.unique(np.concatenate(v)).astype(np.int64) if v else np.zeros(0, dtype=np.int64)
             for k, v in local[i].items()}
        if u["rows"].size == 0:       # every consumer's row index must be valid (ExportSpec's invariant)
            u["rows"] = np.zeros(1, dtype=np.int64)
        cs = combined[readers[i][0]]
        specs[i] = ExportSpec(producer_rows=int(forest_rows[i].size), producer_forest_rows=torch.as_tensor(forest_rows[i]),
                              rows=torch.as_tensor(u["rows"]), conv_rows=torch.as_tensor(u["conv_rows"]),
                              replay_rows=torch.as_tensor(u["replay_rows"]), state_rows=u["state_rows"],
                              chunk_size=cs.chunk_size, replay=cs.replay, conv_kernel=cs.conv_kernel)
    reading = {}
    for j, cs in combined.items():
        gathers = {}
        for kind in _KINDS:
            n = _as_np(getattr(cs, kind)).size
            idx = np.zeros(n, dtype=np.int64)
            offset = 0
            for i, where, pos in located[j][kind]:
                table = _as_np(getattr(specs[i], kind)).astype(np.int64)
                idx[where] = offset + np.searchsorted(table, pos)
                offset += table.size
            gathers[kind] = torch.as_tensor(idx)
        reading[j] = (cs, gathers)
    return _Pieces(readers=readers, specs=specs, reading=reading, members=frozenset(members),
                   backward_after=piece_backward_points([mb.reads for mb in mbs]))


def _read_pieces(j: int, mb: WindowedMicrobatch, pieces: _Pieces, leaves: Dict[int, WindowExports]) -> WindowExports:
    """Piece ``j``'s view of the exports of the pieces it reads, as the exports of one producer (its
    context layout): gathered from their leaves, so its gradients accumulate in them."""
    cs, gathers = pieces.reading[j]
    first = leaves[mb.reads[0]]
    layers = {}
    for n, d in first.layers.items():
        kda = "states" in d
        out = {}
        for name in d:
            kind = "state_rows" if name == "states" else "conv_rows" if name.startswith("conv_") else \
                "replay_rows" if kda else "rows"
            parts = [leaves[i].layers[n][name] for i in mb.reads]
            cat = parts[0] if len(parts) == 1 else torch.cat(parts)
            out[name] = cat.index_select(0, host_to_device(gathers[kind], cat.device))
        layers[n] = out
    return WindowExports(cs, layers)


def _piece_params(j: int, mb: WindowedMicrobatch, cfg, pieces: _Pieces,
                  leaves: Dict[int, WindowExports]) -> TreePackedSeqParams:
    """Piece ``j``'s packed params: it records what its readers read (``pieces.specs[j]``, when some later
    piece reads it) and reads the ``leaves`` of the pieces it reads (shared by the schedules of pipeline
    size 1 and of ``schedules/pipeline.py``, where ``leaves`` hold this stage's layers only)."""
    psp = TreePackedSeqParams.for_tree(mb.layout, config=cfg, replay=mb.replay, export=pieces.specs.get(j),
                                       exports=_read_pieces(j, mb, pieces, leaves) if mb.reads else None)
    _count_rows(mb, psp)
    return psp


def kept_piece_backward(psp: TreePackedSeqParams, own: WindowExports, root: torch.Tensor) -> None:
    """The backward of a read piece that kept its graph (``psp``: the params of its one forward, ``root``:
    its loss, or on a pipeline stage before the last its output times the gradient received): one
    backward from ``root`` and the gradients its readers accumulated in its exports' leaves ``own``.  An
    export that is part of the graph receives its gradient directly (``WindowExports.close``); one
    recorded inside a layer that recomputes its forward in the backward (``--recompute-granularity
    full``: the checkpointed forward ran under ``no_grad``) receives it through that layer's output when
    the backward recomputes it (``inject_grads``, ``TreePackedSeqParams.attach_injected``)."""
    accumulated = own.gradients()
    outs, grads = [root], [torch.ones_like(root)]
    injected: Dict[int, Dict[str, torch.Tensor]] = {}
    for n, d in psp.recorded.layers.items():
        for k, t in d.items():
            g = accumulated.get(n, {}).get(k)
            if g is None:
                continue
            if t.requires_grad:
                outs.append(t)
                grads.append(g)
            else:
                injected.setdefault(n, {})[k] = g
    # a dict even when empty: the recomputed layers then keep no new exports (record_export)
    psp.inject_grads = injected
    try:
        torch.autograd.backward(outs, grads)
    finally:
        psp.inject_grads = None


def piece_choice(mbs: List[WindowedMicrobatch], pieces: "_Pieces", piece_keep, memory=None,
                 layers: Optional[int] = None) -> Dict[int, int]:
    """The read pieces of a step that keep their graph, each with the number of its first layers whose
    forward runs again in its backward (0: its whole graph kept): every one whole (``piece_keep`` "all"),
    none ("none"), the memory plan's (``memory.kept_pieces`` and ``memory.piece_layers``, for "auto"), the
    positions given (whole), or a mapping ``{position: layers}`` (fewer than ``layers``, this rank's)."""
    read = set(pieces.readers)
    if isinstance(piece_keep, str):
        if piece_keep not in PIECE_KEEP:
            raise ValueError(f"piece_keep must be one of {PIECE_KEEP} or a collection of positions, got {piece_keep!r}")
        if piece_keep == "auto":                 # no read piece: no memory plan needed
            return {i: memory.piece_layers.get(i, 0) for i in memory.kept_pieces} if read else {}
        return dict.fromkeys(sorted(read), 0) if piece_keep == "all" else {}
    chosen = {int(i): int(n) for i, n in piece_keep.items()} if isinstance(piece_keep, dict) \
        else dict.fromkeys((int(i) for i in piece_keep), 0)
    if not set(chosen) <= read:
        raise ValueError(f"piece_keep names microbatches that are no read piece: {sorted(set(chosen) - read)}")
    if any(n < 0 or (layers is not None and n >= layers) for n in chosen.values()):
        raise ValueError(f"piece_keep: a piece's recomputed layers must lie in [0, {layers}) (this rank's layers), "
                         f"got {chosen}")
    return chosen


@contextlib.contextmanager
def leading_layers_recomputed(cfg, layers: int):
    """A kept piece's forward with its first ``layers`` layers (of this rank's) checkpointed: megatron's
    block recomputation (``recompute_granularity`` "full", method "block") for the duration of the forward;
    their backward runs their forward again.  0: the forward as configured.  Needs a run without
    recomputation of its own."""
    if not layers:
        yield
        return
    names = ("recompute_granularity", "recompute_method", "recompute_num_layers")
    saved = tuple(getattr(cfg, n, None) for n in names)
    if saved[0] is not None:
        raise ValueError(f"a piece keeping part of its graph needs a run without --recompute-granularity "
                         f"(it is {saved[0]!r})")
    for n, v in zip(names, ("full", "block", int(layers))):
        setattr(cfg, n, v)
    try:
        with torch.profiler.record_function(PIECES_KEPT_RANGE):
            yield
    finally:
        for n, v in zip(names, saved):
            setattr(cfg, n, v)


def check_windows(mbs: List[WindowedMicrobatch]) -> Dict[int, List[int]]:
    """Validate a step's microbatches (module docstring's limits); ``{producer: [its consumers]}``."""
    from ..layout import ExpandedBatch
    consumers_of: Dict[int, List[int]] = {}
    for i, mb in enumerate(mbs):
        if not isinstance(mb, WindowedMicrobatch):
            raise ValueError(f"microbatch {i}: expected a WindowedMicrobatch, got {type(mb).__name__}")
        if isinstance(mb.layout, ExpandedBatch) and mb.producer is not None:
            raise ValueError(f"microbatch {i}: an expanded microbatch cannot read a producer")
        for r in mb.reads:
            if not 0 <= int(r) < i:
                raise ValueError(f"microbatch {i}: the piece {r} it reads must run before it in the step")
            if mbs[r].producer is not None or isinstance(mbs[r].layout, ExpandedBatch):
                raise ValueError(f"microbatch {i}: the piece {r} it reads is a window consumer or expanded")
        if mb.reads and (mb.producer is not None or mb.context is None):
            raise ValueError(f"microbatch {i}: a piece reads earlier pieces (with its context layout), not a producer")
        if mb.producer is not None:
            p = int(mb.producer)
            if not 0 <= p < i:
                raise ValueError(f"microbatch {i}: its producer {p} must run before it in the step")
            if isinstance(mbs[p].layout, ExpandedBatch):
                raise ValueError(f"microbatch {i}: its producer {p} is an expanded microbatch (no exports)")
            if mbs[p].producer is not None or mbs[p].reads:
                raise ValueError(f"microbatch {i}: its producer {p} is itself a consumer (a window producer holds "
                                 "whole trees; a long path's pieces read each other through reads=)")
            consumers_of.setdefault(p, []).append(i)
    return consumers_of


def producer_params(mb: WindowedMicrobatch, consumers: List[WindowedMicrobatch], cfg,
                    spec: Optional[ExportSpec] = None) -> TreePackedSeqParams:
    """A producer's packed params: its forward records what ``consumers`` read (``spec``, when given, is
    ``ExportSpec.for_consumers`` of them; rows counted per ``mb``)."""
    if spec is None:
        spec = ExportSpec.for_consumers(mb.layout, [c.layout for c in consumers], config=cfg, replay=mb.replay)
    psp = TreePackedSeqParams.for_tree(mb.layout, config=cfg, export=spec, replay=mb.replay)
    _count_rows(mb, psp)
    return psp


def microbatch_params(mb: WindowedMicrobatch, cfg, leaves=None) -> TreePackedSeqParams:
    """A non-producer's packed params: expanded, plain tree, or a consumer reading ``leaves``
    (its window's ``WindowExports.detached()``)."""
    from ..layout import ExpandedBatch
    if isinstance(mb.layout, ExpandedBatch):    # expanded: trajectories packed, no sharing
        host = mb.layout.host_copy if mb.layout.host_copy is not None else mb.layout
        psp = TreePackedSeqParams.for_sequences(mb.layout.lengths, device=mb.layout.tokens.device,
                                                visibility=host.visibility)   # None without compaction events
    elif mb.producer is not None:               # consumer: reads the window's shared leaves
        psp = TreePackedSeqParams.for_tree(mb.layout, config=cfg, exports=leaves, replay=mb.replay)
    else:
        psp = TreePackedSeqParams.for_tree(mb.layout, config=cfg, replay=mb.replay)
    _count_rows(mb, psp)
    return psp


@contextlib.contextmanager
def producer_forward(cfg):
    """A producer's forward runs without full activation recomputation: megatron's checkpointed
    forward runs under ``no_grad``, so the recorded exports would lose their autograd link to the
    producer (its graph is kept until window close anyway).  Consumers and plain microbatches
    recompute as configured."""
    saved = getattr(cfg, "recompute_granularity", None)
    if saved != "full":
        yield
        return
    cfg.recompute_granularity = None
    try:
        yield
    finally:
        cfg.recompute_granularity = saved


def _count_rows(mb: WindowedMicrobatch, psp) -> None:
    """Zero the MoE token weight (occurrence count; 1 per token of an expanded microbatch) of the rows
    ``mb.counted`` leaves out."""
    if mb.counted is None:
        return
    c = torch.as_tensor(mb.counted)
    if c.dtype != torch.bool or c.shape != (mb.layout.num_rows,):
        raise ValueError(f"WindowedMicrobatch.counted must be a bool tensor of {mb.layout.num_rows} rows, "
                         f"got {c.dtype} {tuple(c.shape)}")
    w = psp.token_weight
    if w is None:                  # expanded: every token weighs 1 (megatron's statistics), uncounted 0
        w = torch.ones(mb.layout.num_rows, dtype=torch.float64, device=mb.layout.tokens.device)
        total = float(c.sum())
    else:                          # tree: the layout's occurrence counts, known on the host
        host = mb.layout.host_copy if mb.layout.host_copy is not None else mb.layout
        occurrence = getattr(host, "occurrence", None)
        total = float((occurrence.to(torch.float64) * c.to(torch.float64)).sum()) \
            if psp.token_weight_total is not None and occurrence is not None and occurrence.device.type == "cpu" \
            else None
    psp.token_weight = w * host_to_device(c, w.device).to(w.dtype)
    psp.token_weight_total = total


def _loss_of(loss_func: Callable, output):
    out = loss_func(output)
    if not isinstance(out, tuple) or len(out) not in (2, 3):
        raise ValueError("loss_func must return (loss, stats) or (loss, num_tokens, stats)")
    return out[0], out[-1]


def _model_config(model):
    cfg = getattr(model, "config", None)
    if cfg is None and hasattr(model, "module"):
        cfg = getattr(model.module, "config", None)
    if cfg is None:
        raise ValueError("forward_backward_windows: the model has no config (a HybridModel is expected)")
    return cfg


def _spec_counts(spec: ExportSpec) -> Tuple[int, int, int, int]:
    return (int(spec.rows.numel()), int(spec.conv_rows.numel()), int(spec.replay_rows.numel()),
            int(np.asarray(spec.state_rows).size))


def step_memory_plan(mbs: List[WindowedMicrobatch], cfg, *, budget_bytes: Optional[int] = None,
                     force: Optional[bool] = None, recompute=None, specs: Optional[Dict[int, ExportSpec]] = None,
                     pieces: Optional["_Pieces"] = None, piece_keep="none",
                     piece_budget_bytes: Optional[int] = None,
                     layers: Optional[List[int]] = None) -> WindowMemoryPlan:
    """The keep/recompute choice of a step's windows and its predicted live activation bytes
    (``planner.memory.plan_window_memory`` on the step's items with the model's bytes per row and each
    window's exports as ``ExportSpec`` counts them).  ``force``: True recomputes every producer, False
    keeps every one, None decides within ``budget_bytes`` (None: keep all); ``recompute``: exactly these
    producer positions recompute (the prediction of a given choice).  ``piece_keep`` / ``piece_budget_bytes``:
    which read pieces of long paths keep their graph ("none", "all", "auto" within the budget, or positions;
    ``plan_window_memory``).  ``specs`` / ``pieces``:
    the producers' export specs and the pieces' plan where the caller has them (computed here
    otherwise).  ``layers``: the global numbers (1-based) of the layers this rank holds (a pipeline stage's;
    None: all).  A function of the items and the config only: every rank running the same items
    decides the same."""
    shape = ModelShape.from_config(cfg)
    if layers is not None:
        shape = dataclasses.replace(shape, layer_kinds=tuple(shape.layer_kinds[int(n) - 1] for n in layers))
    consumers_of = check_windows(mbs)
    if specs is None:
        specs = {p: ExportSpec.for_consumers(mbs[p].layout, [mbs[c].layout for c in cs], config=cfg,
                                             replay=mbs[p].replay) for p, cs in consumers_of.items()}
    if pieces is None:
        pieces = _plan_pieces(mbs, cfg)
    items = []
    for i, mb in enumerate(mbs):
        spec = specs.get(i, pieces.specs.get(i))
        ex = 0 if spec is None else export_bytes(shape, *_spec_counts(spec))
        items.append(StepItem(rows=int(mb.layout.num_rows), producer=None if mb.producer is None else int(mb.producer),
                              export_bytes=ex, reads=tuple(int(r) for r in mb.reads), read_later=i in pieces.readers,
                              attention_bytes=_attention_bytes(shape, mb.layout)))
    partial = getattr(cfg, "recompute_granularity", None) is None    # a kept piece may recompute its first layers
    return plan_window_memory(items, saved_per_row=saved_bytes_per_row(shape), graph_per_row=graph_bytes_per_row(shape),
                              budget_bytes=budget_bytes, force=force, recompute=recompute, piece_keep=piece_keep,
                              piece_graph_per_row=forward_end_bytes_per_row(shape),
                              piece_budget_bytes=piece_budget_bytes,
                              piece_layer_bytes=layer_graph_bytes_per_row(shape) if partial else None,
                              layer_input_bytes=layer_input_bytes_per_row(shape))


def _attention_bytes(shape: ModelShape, layout) -> int:
    """``planner.memory.attention_bytes`` of a microbatch: a tree layout's rows read over key paths
    (with its context rows); expanded rows attend within their sequences (no gathered keys)."""
    if not isinstance(layout, CompactLayout) or not any(a == "mla" for a, _ in shape.layer_kinds):
        return 0
    ctx = int(layout.num_context_rows)
    gathered = gathered_key_count(layout.visibility, layout.context_visibility if ctx else None)
    return attention_bytes(shape, rows=int(layout.num_rows), context_rows=ctx, gathered=gathered)


@dataclass
class ScheduleChoice:
    """What a replica's windowed step decides before it runs: the windows (``consumers_of``: producer ->
    its consumers), the pieces (``_Pieces``) and the producers' export specs, the memory plan (``memory``:
    :func:`step_memory_plan`'s, None where nothing asks for it), the producers recomputed at their window's
    close (``recompute``) and the read pieces keeping their graph (``keep``: position -> first layers whose
    forward runs again, :func:`piece_choice`)."""
    consumers_of: Dict[int, List[int]]
    pieces: "_Pieces"
    specs: Dict[int, ExportSpec]
    memory: Optional[WindowMemoryPlan]
    recompute: Tuple[int, ...]
    keep: Dict[int, int]


def piece_extra_forward_rows(mbs: List[WindowedMicrobatch], readers, keep: Dict[int, int], layers: int) -> int:
    """Rows whose forward the read pieces ``readers`` run again under the choice ``keep`` (position -> first
    layers recomputed): a recomputed piece's rows, a piece kept in part its rows times its recomputed share
    of the ``layers`` (this rank's), a piece kept whole none."""
    rows = 0
    for i in readers:
        n = int(mbs[i].layout.num_rows)
        rows += n if i not in keep else n * keep[i] // max(1, int(layers))
    return rows


def schedule_choice(mbs: List[WindowedMicrobatch], cfg, *, recompute_producers=False,
                    memory_budget: Optional[int] = None, piece_keep="all", piece_budget: Optional[int] = None,
                    predict: bool = False) -> ScheduleChoice:
    """The decisions of :func:`forward_backward_windows` for ``mbs`` (its arguments of the same names), made
    from the microbatches and the config alone, so a plan can be sized without a model: every rank running
    the same items decides the same.  ``predict``: compute the memory plan even where no decision needs it
    (for the step's predicted peak)."""
    consumers_of = check_windows(mbs)
    pieces = _plan_pieces(mbs, cfg)
    specs = {p: ExportSpec.for_consumers(mbs[p].layout, [mbs[c].layout for c in cs], config=cfg, replay=mbs[p].replay)
             for p, cs in consumers_of.items()}
    if isinstance(recompute_producers, bool):
        force = True if recompute_producers else (None if memory_budget is not None else False)
        chosen = None
    else:
        chosen = {int(p) for p in recompute_producers}
        if not chosen <= set(consumers_of):
            raise ValueError(f"forward_backward_windows: recompute_producers names microbatches that are no window's "
                             f"producer: {sorted(chosen - set(consumers_of))}")
        force = None
    if piece_keep == "auto" and piece_budget is None:
        raise ValueError("forward_backward_windows: piece_keep 'auto' needs piece_budget (bytes)")
    auto_pieces = piece_keep == "auto" and bool(pieces.readers)
    memory = step_memory_plan(mbs, cfg, budget_bytes=memory_budget, force=force, recompute=chosen, specs=specs,
                              pieces=pieces, piece_keep=piece_keep, piece_budget_bytes=piece_budget) \
        if predict or (force is None and chosen is None) or auto_pieces else None
    recompute = chosen if chosen is not None else set(consumers_of) if force is True else \
        set() if force is False else set(memory.recompute)
    keep = piece_choice(mbs, pieces, piece_keep, memory, layers=max(1, int(cfg.num_layers)))
    return ScheduleChoice(consumers_of, pieces, specs, memory, tuple(sorted(recompute)), keep)


def forward_backward_windows(*, forward_step_func, data_iterator, model, num_microbatches: int,
                             seq_length: Optional[int] = None, micro_batch_size: Optional[int] = None,
                             decoder_seq_length: Optional[int] = None, forward_only: bool = False,
                             collect_non_loss_data: bool = False, first_val_step: Optional[bool] = None,
                             adjust_tensor_shapes_fn=None, p2p_communicator=None, pg_collection=None,
                             force_all_reduce: Optional[bool] = False,
                             window_stats: Optional[Dict[str, Any]] = None,
                             recompute_producers: bool = False,
                             memory_budget: Optional[int] = None, piece_keep="all",
                             piece_budget: Optional[int] = None) -> List[Any]:
    """Run ``num_microbatches`` windowed microbatches (see the module docstring).

    ``recompute_producers``: a producer's first forward runs under ``no_grad`` with
    ``packed_seq_params.preview`` set (``forward_step_func`` then leaves the step's statistics
    alone and its loss is not asked for): it keeps only the exports its consumers read, not its
    activations; at window close the producer's forward runs again, with its loss, and its
    backward follows at once, the consumers' export gradients entering it through
    ``TreePackedSeqParams.inject_grads`` (the recomputed exports are not kept).  The same gradients
    (the forward is computed twice the same way) for one more producer forward, and no producer
    activations alive while its consumers run.  ``recompute_producers`` may also be a collection of
    producer positions: exactly those windows recompute their producer.

    ``memory_budget`` (bytes; with ``recompute_producers`` False): each window decides before the step
    runs whether its producer keeps its graph or is recomputed (:func:`step_memory_plan`): kept while
    the predicted live activation bytes stay within the budget.  Loss, log-probs and gradients do not
    depend on the choice.  ``window_stats`` (a dict) receives ``peak_export_bytes``, ``windows``,
    ``recomputed_windows``, ``predicted_peak_bytes`` (the live activation bytes the memory model
    predicts for the executed choice), ``memory_budget_bytes`` and ``largest_microbatch_rows``.

    ``piece_keep``: which pieces of long paths that later pieces read keep their graph until their
    backward, once their readers' backwards have run (``planner.pieces.piece_backward_points``; one
    forward), instead of running their forward again with it:
    "all", "none", "auto" (the memory model's choice within ``piece_budget`` bytes,
    :func:`step_memory_plan`, which may keep a piece in part), a collection of positions, or a mapping
    ``{position: N}`` keeping those pieces with their first N layers recomputed in their backward
    (:func:`leading_layers_recomputed`); the same gradients either way.
    ``window_stats`` also receives ``piece_rows`` (rows of the pieces), ``piece_extra_forward_rows``
    (rows of the forwards run again; a piece kept in part: its rows times its recomputed share of the
    layers), ``read_pieces``, ``kept_pieces``, ``partly_kept_pieces`` and ``piece_budget_bytes``.

    Returns the per-microbatch ``stats`` of ``loss_func``, in execution order (megatron's
    ``forward_data_store``; with ``recompute_producers`` a producer's come at its window close).
    ``seq_length``, ``micro_batch_size``, ``decoder_seq_length``,
    ``first_val_step``, ``adjust_tensor_shapes_fn``, ``p2p_communicator``,
    ``force_all_reduce`` are accepted for signature compatibility and unused, as in
    megatron's ``forward_backward_no_pipelining``.
    """
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError("forward_backward_windows: model chunks (virtual pipeline) are not supported")
        model = model[0]
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) != 1:
            raise ValueError("forward_backward_windows: one data iterator expected")
        data_iterator = data_iterator[0]
    if collect_non_loss_data:
        raise ValueError("forward_backward_windows: collect_non_loss_data is not supported")
    pp = pg_collection.pp.size() if pg_collection is not None and getattr(pg_collection, "pp", None) is not None \
        else getattr(_model_config(model), "pipeline_model_parallel_size", 1)
    if pp != 1:
        raise ValueError(f"forward_backward_windows runs pipeline size 1, got {pp}")
    cfg = _model_config(model)
    device = model_device(model)
    mbs: List[WindowedMicrobatch] = [next(data_iterator) for _ in range(int(num_microbatches))]
    choice = schedule_choice(mbs, cfg, recompute_producers=recompute_producers, memory_budget=memory_budget,
                             piece_keep=piece_keep, piece_budget=piece_budget, predict=window_stats is not None)
    consumers_of, pieces, specs = choice.consumers_of, choice.pieces, choice.specs
    last_consumer = {p: cs[-1] for p, cs in consumers_of.items()}
    memory, recompute, keep = choice.memory, set(choice.recompute), dict(choice.keep)
    layer_count = max(1, int(cfg.num_layers))  # a partly kept piece's extra forward: its rows x layers share
    if forward_only:
        recompute = set()
        keep = dict.fromkeys(pieces.readers, 0)  # no backward: every piece's forward once
    leaves: Dict[int, WindowExports] = {}       # pieces read later: their exports' leaves
    waiting: Dict[int, tuple] = {}              # pieces read later: their backward runs after their readers'
    piece_rows = 0

    open_windows: Dict[int, dict] = {}
    live_bytes, peak_bytes = 0, 0
    store: List[Any] = []

    def run(i: int, mb: WindowedMicrobatch, psp):
        output, loss_func = forward_step_func(iter([(mb, psp)]), model)
        loss, stats = _loss_of(loss_func, output)
        store.append(stats)
        return loss

    def piece_params(j: int, mb: WindowedMicrobatch):
        return _piece_params(j, mb, cfg, pieces, leaves)

    for i, mb in enumerate(mbs):
        mb = microbatch_on(mb, device)
        if i in pieces.members:                     # a piece of a long path
            exported_bytes = 0
            piece_rows += int(mb.layout.num_rows)
            if i in keep:                           # read later, graph kept: one forward, backward at the end
                psp = piece_params(i, mb)
                with leading_layers_recomputed(cfg, keep[i]):
                    loss = run(i, mb, psp)
                leaves[i] = psp.recorded.detached()
                waiting[i] = (mb, None if forward_only else psp, None if forward_only else loss)
                exported_bytes = leaves[i].nbytes()
                loss = psp = None
            elif i in pieces.readers:               # read later: exports only, forward and backward at the end
                psp = piece_params(i, mb)
                psp.preview = True
                with torch.no_grad(), producer_forward(cfg), torch.profiler.record_function(PIECES_RANGE):
                    forward_step_func(iter([(mb, psp)]), model)
                leaves[i] = psp.recorded.detached()
                waiting[i] = (mb, None, None)
                exported_bytes = leaves[i].nbytes()
                psp = None
            else:                                   # read by none: forward and backward at once
                psp = piece_params(i, mb)
                loss = run(i, mb, psp)
                if not forward_only:
                    loss.backward()
                loss = psp = None
            live_bytes += exported_bytes
            peak_bytes = max(peak_bytes, live_bytes)
            for p in pieces.backward_after.get(i, ()):   # read pieces whose readers are all done: backwards
                (pmb, psp, loss), own = waiting.pop(p), leaves[p]
                if p in keep:
                    if not forward_only:        # its graph's backward, its exports' gradients with it
                        kept_piece_backward(psp, own, loss)
                else:                           # its forward again, the exports' gradients injected
                    psp = piece_params(p, pmb)
                    psp.inject_grads = own.gradients()
                    loss = run(p, pmb, psp)     # with the run's recomputation: the gradients ride the graph
                    loss.backward()
                live_bytes -= own.nbytes()
                del leaves[p]
                own = loss = psp = pmb = None
            continue
        if i in consumers_of:                       # producer: forward, exports kept, backward deferred
            psp = producer_params(mb, [mbs[c] for c in consumers_of[i]], cfg, spec=specs.pop(i))
            preview = i in recompute
            if preview:                             # exports only; forward and backward again at close
                psp.preview = True
                with torch.no_grad(), producer_forward(cfg):
                    forward_step_func(iter([(mb, psp)]), model)
                psp.preview = False
                loss = None
            else:
                with producer_forward(cfg):
                    loss = run(i, mb, psp)
            nbytes = psp.exports.nbytes()
            open_windows[i] = {"loss": loss, "psp": psp, "leaves": psp.exports.detached(), "bytes": nbytes, "mb": mb,
                               "preview": preview}
            live_bytes += nbytes
            peak_bytes = max(peak_bytes, live_bytes)
            continue
        psp = microbatch_params(mb, cfg, None if mb.producer is None else open_windows[int(mb.producer)]["leaves"])
        loss = run(i, mb, psp)
        if not forward_only:
            loss.backward()
        # the graph's nodes outlive its backward through ``loss``, and hold the window's leaves
        loss = psp = None
        if mb.producer is not None and last_consumer[int(mb.producer)] == i:   # window close
            p = int(mb.producer)
            w = open_windows.pop(p)
            if w["preview"]:
                # the producer's forward again, now with its graph; the consumers' export gradients
                # enter it as it goes, so neither the preview's exports nor new ones stay alive
                ppsp = w["psp"]
                views = w.pop("leaves")
                ppsp.inject_grads = views.gradients()
                # the consumers' views (the last consumer's params still hold them) and the preview's
                # exports: neither is read again, only the gradients are
                views.layers.clear()
                ppsp.exports.layers.clear()
                loss = run(p, w["mb"], ppsp)     # with the run's recomputation (attach_injected)
                loss.backward()
                ppsp.inject_grads = None
            elif not forward_only:
                w["psp"].exports.close(w["leaves"], loss=w["loss"])
            live_bytes -= w["bytes"]
    if window_stats is not None:
        window_stats["peak_export_bytes"] = peak_bytes
        window_stats["windows"] = len(consumers_of)
        window_stats["recomputed_windows"] = len(recompute)
        window_stats["predicted_peak_bytes"] = None if memory is None else memory.predicted_peak_bytes
        window_stats["memory_budget_bytes"] = memory_budget
        window_stats["largest_microbatch_rows"] = max((int(mb.layout.num_rows) for mb in mbs), default=0)
        window_stats["piece_rows"] = piece_rows
        window_stats["piece_extra_forward_rows"] = piece_extra_forward_rows(mbs, pieces.readers, keep, layer_count)
        window_stats["read_pieces"] = len(pieces.readers)
        window_stats["kept_pieces"] = len(keep.keys() & set(pieces.readers))
        window_stats["partly_kept_pieces"] = sum(1 for n in keep.values() if n)
        window_stats["piece_budget_bytes"] = piece_budget
    return store
