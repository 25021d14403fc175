"""Sharing windows with pipeline parallelism: consumer 1F1B and the two schedules it is compared with.

:func:`forward_backward_pipelining_windows` has megatron-core's schedule signature and runs one
step of :class:`~megatron_harts.schedules.windows.WindowedMicrobatch` items (the same items, in
the same order, as ``forward_backward_windows`` on pipeline size 1) on pipeline size >= 2
(non-interleaved; virtual stages are refused).  Vocabulary (docs/design.md): a microbatch is a
*producer* when a later one names it, a *consumer* when it names one, *plain* otherwise.  Per
stage the operations are:

- ``F(i)``: the forward of microbatch i on this stage's layers (``PF`` for a producer: the
  stage's layers record their exports in a ``WindowExports`` keyed by layer number; the exports
  are retained on this stage from PF completion until the window's PB on this stage);
- ``B(i)``: the backward of a consumer or plain microbatch; a consumer's backward accumulates
  the gradients of this stage's export leaves (consumers read the producer's exports of the
  same stage);
- ``B(p)`` for a producer p is its *PB*: one backward through the producer on this stage from
  the accumulated export gradients and the output gradient of the producer's activation
  received from the next stage (on the last stage: the producer's own loss, 0 when it owns no
  targets); it runs after ``B`` of every consumer of the window (right after the last one's
  under "consumer-1f1b").

*Pieces* of paths longer than the row budget (``WindowedMicrobatch.reads``, docs/training.md) run
on every stage as on pipeline size 1 (``windows.forward_backward_windows``), each stage with its own
layers' exports: a piece is a consumer of the pieces it reads (their leaves on this stage, gathered
into one producer's view) and, when later pieces read it, a producer.  A read piece that keeps its
graph (``piece_keep``; "auto" decides per stage with the memory model on the stage's layers) runs
``F`` with it, its exports' leaves what its readers read, and its ``B`` is one backward from its
output gradient received from the next stage (on the last stage its loss) and the export gradients
its readers accumulated here (``windows.kept_piece_backward``).  A recomputed one runs ``F`` under
``no_grad`` keeping only this stage's exports (as leaves) and its input activation; its ``B`` runs
its forward on this stage again from that input, the export gradients its readers accumulated here
injected (``TreePackedSeqParams.inject_grads``), then its backward (its output gradient received
from the next stage as for any microbatch; on the last stage its loss).  A piece read by none runs
``F`` and ``B`` like a plain microbatch.  Either way no extra activation travels between stages:
every stage sends and receives one activation and one gradient per piece.  The pieces run after the
step's other microbatches (the windows' schedule first, drained): :func:`piece_orders` runs their
forwards in step order and their backwards in the pipeline-size-1 order (a read piece after all its
readers) on every stage, interleaved 1F1B-wise.

Every stage builds the same microbatch layouts and ``TreePackedSeqParams`` itself (planning is
deterministic, so no tree metadata is broadcast); the activation [rows, 1, hidden] and its
gradient go between neighbouring stages through megatron-core's ``P2PCommunicator``, the shape
known from the layout on every stage.  Receives block; sends are posted without waiting and
completed at the end of the step, so any per-stage order that has a valid execution
(:func:`check_stage_orders`) runs without deadlock.  Every stage runs the forwards in the same
order and the backwards in the same order, so messages match in FIFO order.  Activations and
gradients travel on different communicators (:func:`direction_groups`): NCCL runs the
operations of one communicator in issue order, so with one shared communicator a stage's posted
send of an activation would wait behind, and block, the neighbour's send of a gradient that the
stage receives later (megatron-core's size-2 pipelines already route one direction through the
world group; its batched 1F1B pairs each send with the opposite receive instead).

Schedules (``schedule=``): the per-stage orders are those of
:func:`megatron_harts.schedules.simulator.schedule_ops` (its module docstring defines them; the
event simulator, tools/simulate_schedule.py and benchmarks/bench_pp_schedule.py time the very
orders run here), read by :func:`stage_orders` and validated by :func:`check_stage_orders`
before the step runs.  In short:

- ``"consumer-1f1b"`` (default): a 1F1B-family order over the consumers and plain
  microbatches, each PF just before its first consumer's forward, each PB right after its last
  consumer's backward; windows overlap.  It is chosen with per-microbatch costs
  (``microbatch_costs``: (forward, backward) per item, the same on every rank; default forward 1,
  backward 2 each): the classic 1F1B order (stage s warms up with ``S - s - 1`` forwards) or a
  cost-aware one (warm-up up to S - 1 deeper, consumers grouped by window and reordered, the
  closing window's cheapest backward last; no more export bytes or windows alive than
  overlap's), at most ``2 (S - s) - 1`` consumers or plain microbatches in flight on stage s.
- ``"overlap"``: overlapping windows, backward-first: a unit-cost event simulation (forward 1,
  backward 2) where an idle stage runs its next backward when it is ready, otherwise its next
  forward (no in-flight bound: more windows are alive at once).
- ``"non-overlap"``: one window at a time, each drained on every stage before the next starts:
  a block is a window (PF, 1F1B over its consumers and the plain microbatches that follow the
  producer in the step up to the next producer, PB); plain microbatches before the first
  producer are a 1F1B block of their own.  Every consumer of a window runs in its block, even
  one that follows a later producer in the step, which changes only the order in which
  gradients are summed.

The parameter gradients are those of ``forward_backward_windows`` on the same items (and so of
expanded training): tests/test_pipeline_schedules.py pins all three schedules on pipeline
sizes 2 and 4 against both, tests/test_pieces_pipeline.py steps with pieces on pipeline size 2.
``forward_step_func(data_iterator, model)`` is called once per microbatch per stage (twice for a
recomputed read piece: its exports-only forward with ``packed_seq_params.preview`` set, then again at
its backward) with an iterator yielding ``(microbatch, packed_seq_params)``; on stages
other than the last it returns the model's output (hidden states) and its ``loss_func`` is not
called.  The per-microbatch ``stats`` of ``loss_func`` are returned on the last stage (``[]``
elsewhere), as megatron's ``forward_data_store``.  ``window_stats`` (when a dict is passed)
gets, per stage (lists indexed by pipeline rank, gathered over the pipeline group):
``peak_export_bytes`` (retained export bytes of windows and read pieces, maximum over the step)
and ``peak_windows_alive``;
and ``windows`` (number of windows of the step), ``schedule``, and this stage's ``piece_rows``,
``piece_extra_forward_rows``, ``read_pieces``, ``kept_pieces``, ``piece_budget_bytes``.  Activation recomputation: as in
``forward_backward_windows``: producers' forwards do not recompute (``producer_forward``); a kept
read piece's forward and a recomputed one's forward again at its ``B`` recompute as configured, its export gradients entering through
the recording layers' outputs (``TreePackedSeqParams.attach_injected``).
Gradient reduction across data-parallel replicas stays the caller's (``finalize_model_grads``).

:func:`build_stage_model` builds this stage's model chunk (the hybrid block spec sliced to the
stage's layers, embedding on the first stage, output layer on the last).
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..planner.pieces import piece_backward_points
from .simulator import _check_producers, _check_stages, schedule_ops
from .windows import (PIECES_RANGE, WindowedMicrobatch, _loss_of, _model_config, _piece_params, _plan_pieces,
                      check_windows, kept_piece_backward, leading_layers_recomputed, microbatch_on,
                      microbatch_params, model_device, piece_choice, producer_forward, producer_params,
                      step_memory_plan)

__all__ = ["SCHEDULES", "stage_orders", "check_stage_orders", "piece_orders", "piece_backward_order",
           "piece_positions", "forward_backward_pipelining_windows",
           "build_stage_model"]

SCHEDULES = ("consumer-1f1b", "overlap", "non-overlap")

Op = Tuple[str, int]


# ---------------------------------------------------------------------------------------------
# per-stage operation orders
# ---------------------------------------------------------------------------------------------
#: a simulator op kind as this schedule writes it: a producer's PF/PB is its F/B (its role says which)
_KIND = {"F": "F", "PF": "F", "B": "B", "PB": "B"}


def stage_orders(producer_of: Sequence[Optional[int]], num_stages: int, schedule: str = "consumer-1f1b",
                 forward_only: bool = False, costs: Optional[Sequence[Tuple[float, float]]] = None,
                 reads: Optional[Sequence[Sequence[int]]] = None) -> List[List[Op]]:
    """Per-stage operation orders ``[("F"|"B", microbatch), ...]`` for a step (module docstring).

    ``producer_of[i]``: the position of microbatch i's producer (None: not a consumer).  The
    orders of the step's windows and plain microbatches are
    :func:`~megatron_harts.schedules.simulator.schedule_ops`'s (the one generator of the schedules,
    also timed by the event simulator), with a producer's PF/PB written as its F/B.  ``reads[i]``:
    the earlier pieces microbatch i reads (``WindowedMicrobatch.reads``); the pieces of the step
    (microbatches that read or are read) run after all the others, in :func:`piece_orders`' order.
    The orders pass :func:`check_stage_orders` before they are returned.  ``forward_only``: forwards
    only, in step order.  ``costs``: (forward, backward) per microbatch, what consumer 1F1B chooses
    its order with (``schedule_ops``'s ``costs``; the pieces' entries are not used).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    n = len(producer_of)
    reads = _check_reads(reads, producer_of)
    pieces = piece_positions(reads)
    S = _check_stages(num_stages)
    if forward_only:
        orders = [[("F", i) for i in range(n)] for _ in range(S)]
    else:
        rest = [i for i in range(n) if i not in pieces]
        at = {i: k for k, i in enumerate(rest)}
        sub_po = [None if producer_of[i] is None else at[int(producer_of[i])] for i in rest]
        if costs is not None and len(costs) != n:
            raise ValueError(f"costs must give (forward, backward) for each of the {n} microbatches, got {len(costs)}")
        sub_costs = None if costs is None else [costs[i] for i in rest]
        orders = [[(_KIND[kind], rest[k]) for kind, k in ops]
                  for ops in schedule_ops(sub_po, S, schedule, costs=sub_costs)] if rest else [[] for _ in range(S)]
        for s, tail in enumerate(piece_orders(reads, S)):
            orders[s] += tail
    check_stage_orders(orders, producer_of, reads)
    return orders


def _check_reads(reads, producer_of) -> List[Tuple[int, ...]]:
    """``reads`` as one tuple per microbatch; ValueError where a piece reads a later microbatch or is
    part of a sharing window (pieces and windows are separate: ``windows.check_windows``)."""
    n = len(producer_of)
    if reads is None:
        return [()] * n
    if len(reads) != n:
        raise ValueError(f"reads must name the pieces read by each of the {n} microbatches, got {len(reads)}")
    out = [tuple(int(r) for r in rs) for rs in reads]
    read = {r for rs in out for r in rs}
    for i, rs in enumerate(out):
        if any(not 0 <= r < i for r in rs):
            raise ValueError(f"microbatch {i}: the pieces it reads {list(rs)} must run before it in the step")
        if (rs or i in read) and (producer_of[i] is not None or i in set(p for p in producer_of if p is not None)):
            raise ValueError(f"microbatch {i}: a piece of a long path is no sharing window's producer or consumer")
    return out


def piece_positions(reads: Sequence[Sequence[int]]) -> List[int]:
    """The step positions of the pieces (microbatches that read earlier pieces or are read), ascending."""
    return sorted({i for i, rs in enumerate(reads) if rs} | {int(r) for rs in reads for r in rs})


def piece_backward_order(reads: Sequence[Sequence[int]]) -> List[int]:
    """The pieces' backwards in the order of the pipeline-size-1 schedule (``windows.forward_backward_windows``):
    a piece read by none right after its forward, a read piece at its point
    (``planner.pieces.piece_backward_points``: after the forward of its last reader, or of the last reader
    of a read reader).  So a piece's backward follows every backward of its readers, through which the
    gradients of its exports accumulate."""
    read = {int(r) for rs in reads for r in rs}
    points = piece_backward_points(reads)
    order: List[int] = []
    for i in piece_positions(reads):
        if i not in read:
            order.append(i)
        order += points.get(i, [])
    return order


def piece_orders(reads: Sequence[Sequence[int]], num_stages: int) -> List[List[Op]]:
    """Per-stage orders of the step's pieces: their forwards in step order and their backwards in
    :func:`piece_backward_order` on every stage, interleaved 1F1B-wise: stage s runs the next backward
    once its forward has run on the stage and ``S - s`` pieces are in flight there (or no forward is
    left), else its next forward.  Without reads between them this is plain 1F1B (stage s warms up
    with ``S - s - 1`` forwards); a chain whose pieces all read each other runs all its forwards
    before its first backward, as the reads require (a piece read later keeps only its exports and
    its input activation until its backward, not its activations)."""
    S = _check_stages(num_stages)
    forwards = piece_positions(reads)
    backwards = piece_backward_order(reads)
    out: List[List[Op]] = []
    for s in range(S):
        order: List[Op] = []
        done = set()
        f = b = 0
        while f < len(forwards) or b < len(backwards):
            if b < len(backwards) and backwards[b] in done and (f - b >= S - s or f == len(forwards)):
                order.append(("B", backwards[b]))
                b += 1
            else:
                order.append(("F", forwards[f]))
                done.add(forwards[f])
                f += 1
        out.append(order)
    return out


def check_stage_orders(orders: List[List[Op]], producer_of: Sequence[Optional[int]],
                       reads: Optional[Sequence[Sequence[int]]] = None) -> None:
    """Assert that per-stage orders run: every stage has every forward and backward once, the same
    forward order and backward order on every stage, PF before its consumers' forwards, PB after its
    consumers' backwards, a piece's forward after the forwards of the pieces it reads (``reads``) and
    a read piece's backward after its readers' backwards, and some execution exists (receives wait
    for the neighbour's op)."""
    consumers = _check_producers(list(producer_of))
    for j, rs in enumerate(reads or []):       # a reader is a consumer of each piece it reads
        for r in rs:
            consumers.setdefault(int(r), []).append(j)
    n = len(producer_of)
    S = len(orders)
    fw = [[i for k, i in o if k == "F"] for o in orders]
    bw = [[i for k, i in o if k == "B"] for o in orders]
    for s in range(S):
        if sorted(fw[s]) != list(range(n)) or (bw[s] and sorted(bw[s]) != list(range(n))):
            raise AssertionError(f"stage {s}: not every microbatch runs once")
        if fw[s] != fw[0] or bw[s] != bw[0]:
            raise AssertionError(f"stage {s}: forward/backward order differs from stage 0 (P2P messages would "
                                 "not match)")
        pos = {op: k for k, op in enumerate(orders[s])}
        for p, cs in consumers.items():
            if any(pos[("F", p)] > pos[("F", c)] for c in cs):
                raise AssertionError(f"stage {s}: producer {p} runs after one of its consumers")
            if bw[s] and any(pos[("B", p)] < pos[("B", c)] for c in cs):
                raise AssertionError(f"stage {s}: producer {p}'s backward runs before one of its consumers'")
        for k, i in orders[s]:
            if k == "B" and pos[("F", i)] > pos[("B", i)]:
                raise AssertionError(f"stage {s}: backward of {i} before its forward")
    ptr = [0] * S
    done = set()
    progress = True
    while progress:
        progress = False
        for s in range(S):
            while ptr[s] < len(orders[s]):
                k, i = orders[s][ptr[s]]
                dep = (("F", i, s - 1) if s > 0 else None) if k == "F" else \
                    (("B", i, s + 1) if s + 1 < S else None)
                if dep is not None and dep not in done:
                    break
                done.add((k, i, s))
                ptr[s] += 1
                progress = True
    if any(ptr[s] < len(orders[s]) for s in range(S)):
        stuck = {s: orders[s][ptr[s]] for s in range(S) if ptr[s] < len(orders[s])}
        raise AssertionError(f"the stage orders deadlock (next operations {stuck})")


def check_p2p_channels(orders: List[List[Op]], *, shared: bool = False) -> None:
    """Assert that per-stage orders run on rendezvous channels, the NCCL model: each channel
    executes its operations in the order they were posted, on both ends, and a send completes
    only together with the peer's receive of the same message.  A stage posts the receive of an
    operation's input when the operation is next (and waits for it), and posts the send of its
    output right after it (and goes on).  ``shared=False``: one channel per pair of neighbouring
    stages and direction (what :func:`direction_groups` gives pipelines of more than 2 stages and
    megatron-core's world-group routing gives 2-stage ones); ``shared=True``: one channel per pair
    for both directions (one NCCL communicator)."""
    S = len(orders)

    def channel(a: int, b: int, direction: str):
        return (min(a, b), max(a, b)) if shared else (min(a, b), max(a, b), direction)

    queues: Dict[Any, Dict[int, List[Tuple[str, Tuple[str, int]]]]] = {}

    def post(a: int, b: int, direction: str, what: str, msg) -> None:
        queues.setdefault(channel(a, b, direction), {}).setdefault(a, []).append((what, msg))

    received = set()
    ptr = [0] * S
    waiting: List[Optional[Tuple[str, int]]] = [None] * S
    while True:
        progress = False
        for s in range(S):                        # run each stage until it waits on a receive
            while ptr[s] < len(orders[s]):
                k, i = orders[s][ptr[s]]
                src = s - 1 if k == "F" else s + 1
                if 0 <= src < S:
                    msg = (k, i, s)
                    if waiting[s] is None:
                        post(s, src, k, "recv", msg)
                        waiting[s] = msg
                        progress = True
                    if msg not in received:
                        break
                    waiting[s] = None
                dst = s + 1 if k == "F" else s - 1
                if 0 <= dst < S:
                    post(s, dst, k, "send", (k, i, dst))
                ptr[s] += 1
                progress = True
        for ends in queues.values():              # match the heads of every channel's two ends
            (a, qa), (b, qb) = (sorted(ends.items()) + [(None, [])])[:2]
            while qa and qb:
                (wa, ma), (wb, mb) = qa[0], qb[0]
                if ma != mb or wa == wb:
                    break
                received.add(ma)
                qa.pop(0)
                qb.pop(0)
                progress = True
        if not progress:
            break
    if any(ptr[s] < len(orders[s]) for s in range(S)):
        stuck = {s: orders[s][ptr[s]] for s in range(S) if ptr[s] < len(orders[s])}
        kind = "one channel per pair" if shared else "one channel per pair and direction"
        raise AssertionError(f"the stage orders deadlock on rendezvous channels ({kind}; next operations {stuck})")


# ---------------------------------------------------------------------------------------------
# the stage's model chunk
# ---------------------------------------------------------------------------------------------
def build_stage_model(config, vocab_size: int, *, pp_rank: Optional[int] = None, pp_size: Optional[int] = None,
                      **kwargs):
    """This pipeline stage's hybrid model chunk: the stage's layers of the hybrid block spec (global
    layer numbers), the embedding on the first stage (``pre_process``), the final norm, output layer
    and log-probs on the last (``post_process``).  ``kwargs`` go to the model (e.g.
    ``share_embeddings_and_output_weights``)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from ..models.layer import hybrid_block_spec
    from ..models.model import HybridModel, validate_config

    if pp_rank is None:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    if pp_size is None:
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if getattr(config, "virtual_pipeline_model_parallel_size", None):
        raise ValueError("build_stage_model: virtual pipeline stages (interleaved schedules) are not supported")
    validate_config(config)
    spec = hybrid_block_spec(config)
    if pp_size > 1:
        off = get_transformer_layer_offset(config, pp_rank=pp_rank)
        n = get_num_layers_to_build(config, pp_rank=pp_rank)
        spec = TransformerBlockSubmodules(layer_specs=spec.layer_specs[off:off + n], layer_norm=spec.layer_norm)
    share = kwargs.pop("share_embeddings_and_output_weights", False)
    return HybridModel(config=config, transformer_layer_spec=spec, vocab_size=vocab_size,
                       max_sequence_length=kwargs.pop("max_sequence_length", 1 << 20),
                       pre_process=pp_rank == 0, post_process=pp_rank == pp_size - 1,
                       share_embeddings_and_output_weights=share, position_embedding_type="none", **kwargs)


# ---------------------------------------------------------------------------------------------
# the schedule
# ---------------------------------------------------------------------------------------------
#: id(pipeline group) -> (that group, its gradient group); the group is kept so that its id stays unique
_BACKWARD_GROUPS: Dict[int, Tuple[Any, Any]] = {}


def direction_groups(pp_group) -> Tuple[Any, Any]:
    """(group for activations, group for gradients) of a pipeline: ``pp_group`` and, for pipelines
    of more than 2 stages, a second group of the same ranks (created once per pipeline group,
    collectively: every rank of the world calls this at the same step, as every rank runs a
    pipeline schedule).  Size-2 pipelines need no second group: megatron-core's P2P already sends
    one direction through the world group there."""
    if pp_group.size() <= 2:
        return pp_group, pp_group
    if id(pp_group) not in _BACKWARD_GROUPS:
        ranks = tuple(dist.get_process_group_ranks(pp_group))
        gathered: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, ranks)
        pipelines = sorted(set(gathered))
        mine, _ = dist.new_subgroups_by_enumeration([list(r) for r in pipelines],
                                                    backend=dist.get_backend(pp_group))
        if tuple(dist.get_process_group_ranks(mine)) != ranks:
            raise RuntimeError(f"pipeline ranks {list(ranks)} are not in increasing stage order; the gradient "
                               "group would number the stages differently")
        _BACKWARD_GROUPS[id(pp_group)] = (pp_group, mine)
    return pp_group, _BACKWARD_GROUPS[id(pp_group)][1]


def _rows(mb: WindowedMicrobatch, psp, cfg, tp: int) -> int:
    rows = int(psp.num_tokens) if psp.is_tree else int(mb.layout.tokens.numel())
    if getattr(cfg, "sequence_parallel", False) and tp > 1:
        rows = -(-rows // tp)
    return rows


def forward_backward_pipelining_windows(*, forward_step_func, data_iterator, model, num_microbatches: int,
                                        seq_length: Optional[int] = None, micro_batch_size: Optional[int] = None,
                                        decoder_seq_length: Optional[int] = None, forward_only: bool = False,
                                        collect_non_loss_data: bool = False, first_val_step: Optional[bool] = None,
                                        adjust_tensor_shapes_fn=None, p2p_communicator=None, pg_collection=None,
                                        force_all_reduce: Optional[bool] = False,
                                        window_stats: Optional[Dict[str, Any]] = None,
                                        schedule: str = "consumer-1f1b",
                                        microbatch_costs: Optional[Sequence[Tuple[float, float]]] = None,
                                        piece_keep="all", piece_budget: Optional[int] = None) -> List[Any]:
    """Run ``num_microbatches`` windowed microbatches on this pipeline stage (module docstring).

    ``seq_length``, ``micro_batch_size``, ``decoder_seq_length``, ``first_val_step``,
    ``adjust_tensor_shapes_fn``, ``force_all_reduce`` are accepted for signature compatibility
    and unused (shapes come from the layouts).  ``p2p_communicator``: its pipeline group is used.
    ``microbatch_costs``: (forward, backward) per microbatch for consumer 1F1B's order (module
    docstring); every rank must pass the same.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.utils import get_attr_wrapped_model

    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError("forward_backward_pipelining_windows: model chunks (virtual pipeline stages, "
                             "interleaved schedules) are not supported")
        model = model[0]
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) != 1:
            raise ValueError("forward_backward_pipelining_windows: one data iterator expected")
        data_iterator = data_iterator[0]
    if collect_non_loss_data:
        raise ValueError("forward_backward_pipelining_windows: collect_non_loss_data is not supported")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    cfg = _model_config(model)
    if getattr(cfg, "virtual_pipeline_model_parallel_size", None):
        raise ValueError("forward_backward_pipelining_windows: virtual pipeline stages (interleaved schedules) "
                         "are not supported")
    if p2p_communicator is not None:
        pp_group = p2p_communicator.pp_group
    elif pg_collection is not None and getattr(pg_collection, "pp", None) is not None:
        pp_group = pg_collection.pp
    else:
        pp_group = parallel_state.get_pipeline_model_parallel_group()
    S, s = pp_group.size(), pp_group.rank()
    if S < 2:
        raise ValueError("forward_backward_pipelining_windows runs pipeline size >= 2; use "
                         "forward_backward_windows for pipeline size 1")
    first, last = s == 0, s == S - 1
    tp = pg_collection.tp.size() if pg_collection is not None and getattr(pg_collection, "tp", None) is not None \
        else parallel_state.get_tensor_model_parallel_world_size()
    # sends are posted without waiting (completed at the end of the step): plain isend/irecv
    p2p_cfg = copy.copy(cfg)
    p2p_cfg.batch_p2p_comm = False
    p2p_cfg.use_ring_exchange_p2p = False
    p2p_cfg.variable_seq_lengths = False
    if p2p_cfg.pipeline_dtype is None:
        p2p_cfg.pipeline_dtype = cfg.params_dtype
    forward_group, backward_group = direction_groups(pp_group)
    p2p = P2PCommunicator(forward_group, p2p_cfg)                  # activations: stage s -> s + 1
    p2p_back = p2p if backward_group is forward_group else P2PCommunicator(backward_group, p2p_cfg)
    set_input_tensor = get_attr_wrapped_model(model, "set_input_tensor")

    mbs: List[WindowedMicrobatch] = [next(data_iterator) for _ in range(int(num_microbatches))]
    consumers_of = check_windows(mbs)
    orders = stage_orders([mb.producer for mb in mbs], S, schedule, forward_only, costs=microbatch_costs,
                          reads=[mb.reads for mb in mbs])[s]
    pieces = _plan_pieces(mbs, cfg)
    if piece_keep == "auto" and piece_budget is None:
        raise ValueError("forward_backward_pipelining_windows: piece_keep 'auto' needs piece_budget (bytes)")
    memory = step_memory_plan(mbs, cfg, pieces=pieces, piece_keep=piece_keep, piece_budget_bytes=piece_budget,
                              layers=_stage_layers(model)) if piece_keep == "auto" and pieces.readers else None
    layer_count = max(1, len(_stage_layers(model) or ()) or int(cfg.num_layers))   # this stage's
    keep = dict.fromkeys(pieces.readers, 0) if forward_only else \
        piece_choice(mbs, pieces, piece_keep, memory, layers=layer_count)
    piece_leaves: Dict[int, Any] = {}           # pieces read later: this stage's exports' leaves
    piece_rows = extra_rows = 0

    hidden = cfg.hidden_size
    state: Dict[int, dict] = {}
    windows: Dict[int, dict] = {}
    store: List[Any] = []
    pending: List[Any] = []
    live, peak, alive, peak_alive = 0, 0, 0, 0

    def send(tensor, to_next: bool):
        t = tensor.detach().contiguous()
        channel = p2p if to_next else p2p_back
        _, _, reqs = channel._communicate(tensor_send_next=t if to_next else None,
                                          tensor_send_prev=None if to_next else t, recv_prev=False,
                                          recv_next=False, tensor_shape=None, wait_on_reqs=False)
        pending.append((t, reqs))

    device = model_device(model)
    for kind, i in orders:
        mb = mbs[i]
        if kind == "F" and i in pieces.members:    # a piece of a long path
            mb = microbatch_on(mb, device)
            psp = _piece_params(i, mb, cfg, pieces, piece_leaves)
            shape = (_rows(mb, psp, cfg, tp), 1, hidden)
            x = None if first else p2p.recv_forward(shape, is_first_stage=False)
            set_input_tensor(x)
            st = {"x": x, "shape": shape}
            piece_rows += int(mb.layout.num_rows)
            if i in keep:                        # read later, graph kept: one forward, its backward after its readers'
                with leading_layers_recomputed(cfg, keep[i]):
                    output, loss_func = forward_step_func(iter([(mb, psp)]), model)
                extra_rows += int(mb.layout.num_rows) * keep[i] // layer_count
                if last:
                    loss, stats = _loss_of(loss_func, output)
                    store.append(stats)
                    st["loss"] = loss
                st["out"], st["psp"] = output, psp
                piece_leaves[i] = psp.recorded.detached()
                live += piece_leaves[i].nbytes()
                peak = max(peak, live)
            elif i in pieces.readers:            # read later: exports only (its backward recomputes the forward)
                psp.preview = not forward_only
                with torch.no_grad(), producer_forward(cfg), torch.profiler.record_function(PIECES_RANGE):
                    output, loss_func = forward_step_func(iter([(mb, psp)]), model)
                if last and forward_only:
                    store.append(_loss_of(loss_func, output)[1])
                piece_leaves[i] = psp.recorded.detached()
                live += piece_leaves[i].nbytes()
                peak = max(peak, live)
            else:                                # read by none: a consumer of the pieces it reads
                output, loss_func = forward_step_func(iter([(mb, psp)]), model)
                if last:
                    loss, stats = _loss_of(loss_func, output)
                    store.append(stats)
                    st["loss"] = loss
                st["out"] = output
            if not last:
                send(output, to_next=True)
            if not forward_only:
                state[i] = st
            output = psp = None
            continue
        if kind == "B" and i in keep:             # a read piece that kept its graph: its backward
            st = state.pop(i)
            own = piece_leaves.pop(i)
            root = st["loss"] if last else (st["out"] * p2p_back.recv_backward(st["shape"], is_last_stage=False)).sum()
            kept_piece_backward(st["psp"], own, root)
            live -= own.nbytes()
            if not first:
                gx = st["x"].grad
                send(gx if gx is not None else torch.zeros_like(st["x"]), to_next=False)
            own = root = st = None
            continue
        if kind == "B" and i in pieces.readers:    # a read piece: its forward again, then its backward
            st = state.pop(i)
            mb = microbatch_on(mb, device)
            psp = _piece_params(i, mb, cfg, pieces, piece_leaves)
            own = piece_leaves.pop(i)
            psp.inject_grads = own.gradients()    # what its readers accumulated in its exports on this stage
            x = st["x"]
            if x is not None:
                x = x.detach().requires_grad_(True)
            set_input_tensor(x)
            output, loss_func = forward_step_func(iter([(mb, psp)]), model)   # the gradients ride the graph
            extra_rows += int(mb.layout.num_rows)
            if last:
                root, stats = _loss_of(loss_func, output)
                store.append(stats)
            else:
                g = p2p_back.recv_backward(st["shape"], is_last_stage=False)
                root = (output * g).sum()
            root.backward()
            live -= own.nbytes()
            if not first:
                send(x.grad if x.grad is not None else torch.zeros_like(x), to_next=False)
            own = output = root = psp = None
            continue
        if kind == "F":
            mb = microbatch_on(mb, device)
            if i in consumers_of:
                psp = producer_params(mb, [mbs[c] for c in consumers_of[i]], cfg)
            else:
                leaves = None if mb.producer is None else windows[int(mb.producer)]["leaves"]
                psp = microbatch_params(mb, cfg, leaves)
            shape = (_rows(mb, psp, cfg, tp), 1, hidden)
            x = None if first else p2p.recv_forward(shape, is_first_stage=False)
            set_input_tensor(x)
            if i in consumers_of:
                with producer_forward(cfg):
                    output, loss_func = forward_step_func(iter([(mb, psp)]), model)
            else:
                output, loss_func = forward_step_func(iter([(mb, psp)]), model)
            st = {"x": x, "shape": shape}
            if last:
                loss, stats = _loss_of(loss_func, output)
                store.append(stats)
                st["loss"] = loss
            else:
                send(output, to_next=True)
                st["out"] = output
            if not forward_only:
                state[i] = st
            if i in consumers_of:
                nbytes = psp.exports.nbytes()
                windows[i] = {"exports": psp.exports, "leaves": psp.exports.detached(), "bytes": nbytes}
                live += nbytes
                alive += 1
                peak, peak_alive = max(peak, live), max(peak_alive, alive)
            continue
        st = state.pop(i)
        g = None if last else p2p_back.recv_backward(st["shape"], is_last_stage=False)
        if i in consumers_of:                                  # PB: window close on this stage
            w = windows.pop(i)
            root = st["loss"] if last else (st["out"] * g).sum()
            w["exports"].close(w["leaves"], loss=root)
            live -= w["bytes"]
            alive -= 1
        elif last:
            st["loss"].backward()
        else:
            torch.autograd.backward(st["out"], grad_tensors=g)
        if not first:
            gx = st["x"].grad
            send(gx if gx is not None else torch.zeros_like(st["x"]), to_next=False)
    if forward_only:
        for w in windows.values():
            live -= w["bytes"]
        windows.clear()
        piece_leaves.clear()
    for _, reqs in pending:
        for r in (reqs.values() if isinstance(reqs, dict) else reqs):
            r.wait()
    if window_stats is not None:
        dev = next(iter(model.parameters())).device
        t = torch.tensor([float(peak), float(peak_alive)], dtype=torch.float64, device=dev)
        gathered = [torch.zeros_like(t) for _ in range(S)]
        dist.all_gather(gathered, t, group=pp_group)
        window_stats["peak_export_bytes"] = [int(v[0]) for v in gathered]
        window_stats["peak_windows_alive"] = [int(v[1]) for v in gathered]
        window_stats["windows"] = len(consumers_of)
        window_stats["schedule"] = schedule
        window_stats["piece_rows"] = piece_rows
        window_stats["piece_extra_forward_rows"] = extra_rows
        window_stats["read_pieces"] = len(pieces.readers)
        window_stats["kept_pieces"] = len(keep.keys() & set(pieces.readers))
        window_stats["partly_kept_pieces"] = sum(1 for n in keep.values() if n)
        window_stats["piece_budget_bytes"] = piece_budget
    return store


def _stage_layers(model) -> Optional[List[int]]:
    """The global numbers (1-based) of this stage's transformer layers, for the memory model's shape."""
    module = model
    while hasattr(module, "module"):
        module = module.module
    decoder = getattr(module, "decoder", None)
    if decoder is None:
        return None
    return [int(layer.layer_number) for layer in decoder.layers]
