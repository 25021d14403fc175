"""Tree metadata on megatron's packed-sequence parameter path.

``TreePackedSeqParams`` is a ``PackedSeqParams`` (megatron passes it, untouched,
from ``GPTModel``/``TransformerBlock`` to every ``TransformerLayer`` and its
attention module), so the tree layout reaches every layer without globals.
Two modes, one model, same weights:

- ``mode="tree"``: the hidden states are the compact rows of a
  :class:`~megatron_harts.layout.CompactLayout` (shape [R, 1, h]).  Carries the
  layout (``prev``, ``position_ids``, visibility, ``occurrence``), the KDA call
  schedule, the conv taps and, for the flex backend, the attention block mask,
  all built once per microbatch by :meth:`TreePackedSeqParams.for_tree`.
- ``mode="expanded"``: ordinary THD packing of independent sequences
  (``cu_seqlens_q``), e.g. every trajectory of the microbatch on its own.  Each
  sequence is causal on its own; nothing is shared.  Sequences with compaction
  events carry ``visibility`` (``for_sequences(..., visibility=ExpandedBatch.visibility)``,
  or ``layout.sequence_visibility``): full attention then honours each sequence's
  evictions (``tree_attention`` over that visibility); KDA, conv and MoE do not change.

Without any packed-sequence params the model runs the batched [s, b] form
(each batch column one causal sequence), which is expanded mode too.

Readers: the KDA and MLA layers hand these params, untouched, to their cores
(:mod:`megatron_harts.models.cores`, the spec slots ``KDASubmodules.core`` and
``MLASubmodules.core_attention``), which decide the row mode with ``cores.row_mode`` and make
every call of the sharing-window protocol below (``layer_exports``, ``record_export``,
``attach_injected``); the MoE layer reads ``token_weight``.

Padding (sequence parallelism needs the token count divisible by the TP size):
:meth:`TreePackedSeqParams.padded` appends ``pad_rows`` rows that nothing reads.  Tree mode:
the rows after the layout's get zero outputs from the KDA and MLA cores and occurrence 0 (no
MoE statistic counts them).  Expanded mode: the pad rows form one more sequence, and
``token_weight`` (1 per real token, 0 per pad token) keeps them out of the MoE statistics.

Sharing windows (cross-microbatch): a *producer* layout built with
``for_tree(producer, export=ExportSpec.for_consumers(producer, consumers, ...))``
records, during its forward, per-layer exports in ``packed.exports`` (a
:class:`WindowExports`, tensors still in the producer's autograd graph): for
MLA's key/value latent (the normalized ``kv_lora_rank`` latent and the rotated shared rope key:
``kv_lora_rank + qk_rope_head_dim`` values a row, against heads x (q/k + v head dims) for the keys
and values themselves) of every context row a consumer's rows see (``spec.rows``: compaction
events may evict context rows; KDA and the conv read evicted rows too), KDA's
conv inputs (pre-conv q/k/v projections) of the context rows within a consumer
row's conv reach (``spec.conv_rows``), KDA's core inputs (q, k, v, g, beta) of
the replay rows (``spec.replay_rows``) and KDA's recurrent states after
``spec.state_rows``.  A *consumer*
layout (subtrees whose ancestors are the producer's rows) runs with
``for_tree(consumer, exports=...)``: MLA up-projects the context rows' latents to keys and values
(the producer's own projection, so the same numbers) and attends to them, the conv reads the
context rows' inputs where the producer exported them (its taps index ``spec.conv_rows``:
``ConvTaps.reading_table``), KDA starts its subtree roots
from the producer's boundary states and replays the producer's rows.  Pass
``exports.detached()`` to every consumer of a window (shared leaves: export
gradients accumulate), then ``exports.close(leaves)`` runs the one producer
backward ("window close").

KDA call plan (``config.tree_kda_call_plan``, ``--tree-kda-call-plan``): ``harts`` runs the
call planner's plan (``planner.calls.plan_calls``); the ablations ``per-depth`` and
``node-wise`` run ``planner.baselines``' replay-free plans of the same segments (more calls,
same outputs to rounding).  They serve layouts of whole trees; consumers and producers of
sharing windows run ``harts`` only and refuse the others.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

import torch

from megatron.core.packed_seq_params import PackedSeqParams

from ..layout import Visibility, host_to_device, host_to_device_many

MODES = ("tree", "expanded")


def _host(layout):
    """The host copy of a device layout (``CompactLayout.host_copy``), else the layout itself:
    metadata read from it never waits for the device."""
    return layout.host_copy if getattr(layout, "host_copy", None) is not None else layout


def _seen_context_rows(layout) -> np.ndarray:
    """Bool [context rows]: the context rows some row of ``layout`` sees (those with a visible interval)."""
    off = layout.ctx_vis_offsets.cpu().numpy()
    return off[1:] > off[:-1]


def _kda_consumer_schedule(layout, chunk_size: int, replay: bool, device=None, export_rows=None):
    from ..ops.tree_kda import build_kda_schedule, plan_subtree_calls
    sp = plan_subtree_calls(layout.seg_parent, layout.seg_start, layout.seg_length, layout.seg_row, chunk_size,
                            replay=replay)
    return build_kda_schedule(layout.seg_parent, layout.seg_start, layout.seg_length, layout.seg_row, sp,
                              export_rows=export_rows, device=device)


@dataclass
class ExportSpec:
    """The producer rows a window's consumers read (sorted, unique producer row ids).

    Invariants: every context row some row of some consumer sees (its context visibility: compaction
    events may evict context rows) is in ``rows`` (MLA key/value latents), and ``rows`` is not empty; every
    context row some consumer row's conv taps reach is in ``conv_rows``; every KDA replay row
    is in ``replay_rows``; every consumer's external KDA state is the state after one of
    ``state_rows``.
    """
    producer_rows: int
    producer_forest_rows: torch.Tensor
    rows: torch.Tensor
    conv_rows: torch.Tensor
    replay_rows: torch.Tensor
    state_rows: np.ndarray
    chunk_size: int
    replay: bool
    conv_kernel: int

    def to(self, device) -> "ExportSpec":
        """The spec with its row indices (what the producer's layers gather) on ``device``."""
        import dataclasses
        rows, conv_rows, replay_rows = host_to_device_many((self.rows, self.conv_rows, self.replay_rows), device)
        return dataclasses.replace(self, rows=rows, conv_rows=conv_rows, replay_rows=replay_rows)

    @classmethod
    def for_consumers(cls, producer, consumers: Sequence, *, config=None, chunk_size: int = 64,
                      conv_kernel: int = 4, replay: bool = True) -> "ExportSpec":
        """The exports ``consumers`` (layouts built with ``context=producer``) need from ``producer``."""
        from ..ops.path_conv import build_conv_taps
        from ..ops.tree_kda import consumer_kda_sources
        if config is not None:
            chunk_size = config.kda_chunk_size
            conv_kernel = config.linear_conv_kernel_dim
        producer, consumers = _host(producer), [_host(c) for c in consumers]
        if producer.num_context_rows:
            raise ValueError("ExportSpec: the producer has context rows of its own (nested producers are not "
                             "supported: a producer must hold whole trees)")
        rows: List[np.ndarray] = []
        conv: List[np.ndarray] = []
        replays: List[np.ndarray] = []
        states: List[np.ndarray] = []
        pf = producer.forest_rows.cpu()
        for i, c in enumerate(consumers):
            if not c.num_context_rows:
                raise ValueError(f"ExportSpec: consumer {i} has no context rows (it reads nothing from a producer)")
            src = c.ctx_source_rows.cpu()
            if not torch.equal(pf[src], c.ctx_forest_rows.cpu()):
                raise ValueError(f"ExportSpec: consumer {i} was built against another producer layout")
            sched = _kda_consumer_schedule(c, chunk_size, replay)
            state_rows, replay_rows = consumer_kda_sources(c, sched)
            rows.append(src.numpy()[_seen_context_rows(c)])
            conv.append(src.numpy()[build_conv_taps(c, conv_kernel).context_rows_read().numpy()])
            replays.append(replay_rows)
            states.append(state_rows)

        def union(parts):
            return np.unique(np.concatenate(parts)).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
        mla_rows = union(rows)
        if mla_rows.size == 0 and consumers:     # every consumer's row index must be valid (module docstring)
            mla_rows = consumers[0].ctx_source_rows.cpu().numpy()[:1].astype(np.int64)
        return cls(producer_rows=producer.num_rows, producer_forest_rows=pf, rows=torch.as_tensor(mla_rows),
                   conv_rows=torch.as_tensor(union(conv)), replay_rows=torch.as_tensor(union(replays)),
                   state_rows=union(states), chunk_size=int(chunk_size), replay=bool(replay),
                   conv_kernel=int(conv_kernel))


@dataclass
class WindowExports:
    """Per-layer exports of a producer run (``layers[layer_number][name]``), for ``spec``.

    Tensors keep their autograd link to the producer's forward; ``detached()`` gives the
    consumers' view (leaves whose gradients accumulate over every consumer of the window) and
    ``close(leaves)`` back-propagates those accumulated gradients through the producer once.
    """
    spec: ExportSpec
    layers: Dict[int, Dict[str, torch.Tensor]]

    def detached(self) -> "WindowExports":
        return WindowExports(self.spec, {n: {k: t.detach().requires_grad_(t.is_floating_point())
                                             for k, t in d.items()} for n, d in self.layers.items()})

    def close(self, leaves: "WindowExports", loss: Optional[torch.Tensor] = None,
              retain_graph: bool = False) -> None:
        """One producer backward from the gradients the consumers accumulated in ``leaves``
        (plus, when given, the producer's own ``loss``)."""
        outs, grads = ([loss], [torch.ones_like(loss)]) if loss is not None else ([], [])
        accumulated = leaves.gradients()
        for n, d in self.layers.items():
            for k, t in d.items():
                g = accumulated[n].get(k)
                if g is not None and t.requires_grad:
                    outs.append(t)
                    grads.append(g)
        if outs:
            torch.autograd.backward(outs, grads, retain_graph=retain_graph)

    def gradients(self) -> Dict[int, Dict[str, torch.Tensor]]:
        """Of consumer leaves (``detached()``): the gradients accumulated in them, per layer and name
        (tensors nobody read are left out)."""
        return {n: {k: t.grad for k, t in d.items() if t.grad is not None} for n, d in self.layers.items()}

    def nbytes(self) -> int:
        """Bytes held by the exported tensors (the window's retained export memory)."""
        return sum(t.numel() * t.element_size() for d in self.layers.values() for t in d.values())


def _check_export(export: ExportSpec, host, chunk_size: int, replay: bool, conv_kernel: int) -> None:
    if export.producer_rows != host.num_rows or \
            not torch.equal(export.producer_forest_rows, host.forest_rows.cpu()):
        raise ValueError("TreePackedSeqParams.for_tree: export= was made for another producer layout")
    if (export.chunk_size, export.replay, export.conv_kernel) != (int(chunk_size), bool(replay), int(conv_kernel)):
        raise ValueError(f"export= was made for chunk size {export.chunk_size}, replay={export.replay}, "
                         f"conv kernel {export.conv_kernel}; this producer runs {chunk_size}, "
                         f"replay={replay}, conv kernel {conv_kernel}")


class _AttachGradients(torch.autograd.Function):
    """Identity on a layer's output ``out`` whose backward also hands ``grads[i]`` to ``exports[i]``:
    a recomputed producer's export gradients enter its backward through the output of the layer that
    recorded them, without the exports being kept.  Being part of the layer's forward, it is
    recomputed with it, so the gradients arrive also when the layer's forward runs again in the
    backward (full activation recomputation)."""

    @staticmethod
    def forward(ctx, out, n, *exports_and_grads):
        ctx.grads = exports_and_grads[n:]
        return out.clone()

    @staticmethod
    def backward(ctx, g_out):
        return (g_out, None) + tuple(ctx.grads) + (None,) * len(ctx.grads)


@dataclass
class ConsumerIndex:
    """Where a consumer's reads sit in its producer's exports: ``ctx`` (each context row's
    index in ``spec.rows``; 0 for a context row no row of the consumer sees, which attention masks),
    ``replay`` (each KDA replay row's index in ``spec.replay_rows``),
    ``state`` (each external KDA state's index in ``spec.state_rows``).  The conv reads
    ``spec.conv_rows`` through the consumer's conv taps (``ConvTaps.reading_table``)."""
    ctx: torch.Tensor
    replay: torch.Tensor
    state: torch.Tensor


@dataclass
class TreePackedSeqParams(PackedSeqParams):
    """Packed-sequence params that also carry a rollout-tree layout (see module docstring).

    Invariants: in tree mode ``layout``, ``kda_schedule`` (built for the same rows with
    the model's KDA chunk size) and ``conv_taps`` are set and describe the rows the model
    receives, in order; ``token_weight`` is the layout's occurrence count (float), used by
    MoE statistics.  In expanded mode ``cu_seqlens_q`` partitions the packed tokens.
    """
    mode: str = "expanded"
    layout: Any = None                       # CompactLayout (tree mode)
    kda_schedule: Any = None                 # ops.tree_kda.KdaSchedule (tree mode)
    conv_taps: Any = None                    # ops.path_conv.ConvTaps (tree mode)
    block_mask: Any = None                   # FlexAttention BlockMask (tree mode, flex backend)
    key_paths: Any = None                    # ops.key_paths.KeyPaths (tree mode, varlen backend; expanded
                                             # mode: the sequences, built by sequence_key_paths on first use)
    interval_blocks: Any = None              # ops.interval_attention.IntervalBlocks (tree mode, interval backend)
    fa4_visibility: Any = None               # (visibility, context visibility or None) on the host (tree mode, fa4
                                             # backend): what fa4_blocks_for cuts into tiles
    attention_backend: Optional[str] = None  # tree mode: this microbatch's tree-attention backend (the
                                             # config's, or the block-mask one where varlen does not pay)
    token_weight: Optional[torch.Tensor] = None  # [R] occurrence counts (tree mode); expanded: None (megatron's
                                                 # statistics) or 1 per counted token, 0 per uncounted/pad token
    token_weight_total: Optional[float] = None   # ``token_weight.sum()`` as a host number, once known (set
                                                 # where the host knows it, else read once by token_weight_sum)
    position_ids: Optional[torch.Tensor] = None  # [tokens] path depth (tree) / position in sequence
    export_spec: Optional[ExportSpec] = None  # producer: what to record (tree mode)
    exports: Optional[WindowExports] = None   # producer: filled by the forward; consumer: what to read
    recorded: Optional[WindowExports] = None  # producer: what its forward records (``exports`` itself, except
                                              # for a piece that reads earlier pieces' exports and also exports)
    consumer_index: Optional[ConsumerIndex] = None  # consumer: where its reads sit in ``exports``
    pad_rows: int = 0                        # rows appended after the real ones (padding, see module docstring)
    inject_grads: Optional[Dict[int, Dict[str, torch.Tensor]]] = None  # recomputed producer: its exports'
                                             # gradients (``WindowExports.gradients``); record_export and
                                             # attach_injected hand them to the exports instead of keeping them
    preview: bool = False                    # producer: a forward for its exports only, recomputed at window
                                             # close (schedules.windows recompute_producers): not the step's
                                             # statistics
    seq_lengths: Optional[torch.Tensor] = None  # CPU long [N] (expanded mode): the sequences' lengths
    visibility: Optional[Visibility] = None  # expanded mode, host: the packed rows' full-attention visibility
                                             # where compaction events evict keys (None: causal sequences)
    _pending: Dict[int, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    _seq_taps: Dict[int, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    _seq_attention: Dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    _fa4_blocks: Dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def fa4_blocks_for(self, dims, device):
        """The fa4 backend's tiles (``ops.fa4_blocks.Fa4Blocks``) of this microbatch for attention head
        dims ``dims = (q/k, v)``: the tree's visibility (context keys first) or, in expanded mode, the
        packed rows'; built on the host once per microbatch and head dims, shared by every MLA layer."""
        key = tuple(dims)
        if key not in self._fa4_blocks:
            from ..ops.fa4_blocks import build_fa4_blocks
            vis, ctx = self.fa4_visibility if self.is_tree else (self.visibility, None)
            if vis is None:
                raise ValueError("fa4_blocks_for: these params carry no visibility for the fa4 backend")
            self._fa4_blocks[key] = build_fa4_blocks(vis, ctx, dims=key, device=device)
        return self._fa4_blocks[key]

    def sequence_conv_taps(self, kernel_size: int, device):
        """Expanded mode: the conv taps of the packed sequences (``ops.path_conv.sequence_conv_taps``),
        built on the host once per microbatch and kernel size, shared by every KDA layer."""
        if kernel_size not in self._seq_taps:
            from ..ops.path_conv import sequence_conv_taps
            self._seq_taps[kernel_size] = sequence_conv_taps(self.seq_lengths.tolist(), kernel_size).to(device)
        return self._seq_taps[kernel_size]

    def sequence_key_paths(self, device):
        """Expanded mode: the packed sequences as key-path runs (``ops.key_paths.sequence_key_paths``),
        built once per microbatch, shared by every MLA layer."""
        if self.key_paths is None:
            from ..ops.key_paths import build_key_paths, sequence_key_paths
            if self.visibility is None:
                self.key_paths = sequence_key_paths(self.host_seq_lengths().numpy(), device=device)
            else:       # each sequence's evictions: runs break at its event rows
                lens = self.host_seq_lengths()
                prev = torch.arange(int(lens.sum()), dtype=torch.int64) - 1
                prev[torch.cumsum(lens, 0) - lens] = -1
                self.key_paths = build_key_paths(self.visibility, prev=prev, device=device)
        return self.key_paths

    def sequence_attention(self, backend: str, device, dims=None) -> dict:
        """Expanded mode with a ``visibility``: the keyword arguments of ``ops.tree_attention`` for
        ``backend`` (the visibility on ``device``, and the backend's block mask, key paths or tiles; the
        fa4 tiles for the attention head dims ``dims``), built on the host once per microbatch and
        backend, shared by every MLA layer."""
        if self.visibility is None:
            raise ValueError("sequence_attention: these expanded params have no visibility (causal sequences)")
        if backend not in self._seq_attention:
            kw = {"visibility": self.visibility.to(device), "backend": backend}
            if backend == "varlen":
                kw["key_paths"] = self.sequence_key_paths(device)
            elif backend == "flex":
                from ..ops.tree_attention import build_tree_block_mask
                kw["block_mask"] = build_tree_block_mask(self.visibility, device=device)
            elif backend == "interval":
                from ..ops.interval_attention import build_interval_blocks
                kw["interval_blocks"] = build_interval_blocks(self.visibility, device=device)
            self._seq_attention[backend] = kw
        if backend == "fa4":
            return dict(self._seq_attention[backend], fa4_blocks=self.fa4_blocks_for(dims, device))
        return self._seq_attention[backend]

    def host_seq_lengths(self) -> torch.Tensor:
        """Expanded mode: the sequences' lengths (CPU long): ``seq_lengths`` where set, else read from
        ``cu_seqlens_q``."""
        if self.seq_lengths is not None:
            return self.seq_lengths
        cu = self.cu_seqlens_q
        return (cu[1:] - cu[:-1]).cpu()

    def token_weight_sum(self) -> float:
        """``token_weight.sum()`` as a host number: ``token_weight_total``, read from the device once per
        microbatch where the host does not know it (every MoE layer needs it; reading it per layer
        would stall the host once per layer)."""
        if self.token_weight_total is None:
            self.token_weight_total = float(self.token_weight.sum())
        return self.token_weight_total

    def record_export(self, layer_number: int, tensors: Dict[str, torch.Tensor]) -> None:
        """Producer: keep one layer's exports (called by the layers during the forward).  With
        ``inject_grads`` (a producer recomputed at its window's close, a read piece run again) nothing
        is kept: the exports with a gradient wait for the layer's :meth:`attach_injected`."""
        if self.inject_grads is None:
            self.recorded.layers[int(layer_number)] = tensors
            return
        grads = self.inject_grads.get(int(layer_number), {})
        self._pending[int(layer_number)] = [(t, grads[n]) for n, t in tensors.items()
                                            if grads.get(n) is not None and t.requires_grad]

    def attach_injected(self, layer_number: int, out: torch.Tensor) -> torch.Tensor:
        """The layer's output, carrying into the backward the gradients of the exports the layer
        recorded (``inject_grads``, :class:`_AttachGradients`); ``out`` itself where there are none.
        ``loss.backward()`` of the recomputed producer is then the window-close backward of
        ``WindowExports.close``, with or without full activation recomputation."""
        pending = self._pending.pop(int(layer_number), None)
        if not pending:
            return out
        return _AttachGradients.apply(out, len(pending), *(t for t, _ in pending), *(g for _, g in pending))

    def layer_exports(self, layer_number: int) -> Dict[str, torch.Tensor]:
        """Consumer: the producer's exports of one layer."""
        d = self.exports.layers.get(int(layer_number))
        if d is None:
            raise ValueError(f"consumer: the producer's exports have no layer {layer_number} (was the producer "
                             "run with the same model?)")
        return d

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"TreePackedSeqParams.mode must be one of {MODES}, got {self.mode!r}")

    @property
    def is_tree(self) -> bool:
        return self.mode == "tree"

    @property
    def num_tokens(self) -> int:
        """Rows the model receives, padding included."""
        if self.is_tree:
            return int(self.layout.num_rows) + self.pad_rows
        return int(self.cu_seqlens_q[-1])

    @classmethod
    def for_tree(cls, layout, *, config=None, chunk_size: int = 64, conv_kernel: int = 4, replay: bool = True,
                 attention_backend: str = "sdpa", device=None, export: Optional[ExportSpec] = None,
                 exports: Optional[WindowExports] = None, call_plan: str = "harts") -> "TreePackedSeqParams":
        """All per-microbatch tree metadata for ``layout``, built once and shared by all layers.

        With ``config`` (a HybridConfig) the chunk size, conv kernel, attention backend and KDA
        call plan are the model's (``kda_chunk_size``, ``linear_conv_kernel_dim``,
        ``tree_attention_backend``, ``tree_kda_call_plan``).
        ``export``: this layout is a producer; its forward records ``self.recorded`` (for a layout
        without context rows also ``self.exports``).
        ``exports``: this layout is a consumer (it has context rows) reading them.  Both: a piece of a
        long path, reading the earlier pieces' exports and exporting its own rows to the later ones.
        ``call_plan``: ``harts`` (``plan_calls``, with ``replay``) or a replay-free ablation of
        ``planner.baselines.BASELINE_PLANS`` (``replay`` does not apply); the ablations are
        refused for consumers and producers.
        """
        if config is not None:
            chunk_size = config.kda_chunk_size
            conv_kernel = config.linear_conv_kernel_dim
            attention_backend = config.tree_attention_backend
            call_plan = config.tree_kda_call_plan
        from ..ops.path_conv import build_conv_taps
        from ..ops.tree_kda import build_kda_schedule, consumer_kda_sources
        from ..planner.baselines import BASELINE_PLANS, CALL_PLANS
        from ..planner.calls import plan_calls

        if call_plan not in CALL_PLANS:
            raise ValueError(f"TreePackedSeqParams.for_tree: KDA call plan {call_plan!r} (--tree-kda-call-plan) "
                             f"must be one of {', '.join(CALL_PLANS)}")
        if call_plan != "harts" and (layout.num_context_rows or export is not None):
            role = "has context rows (a sharing-window consumer)" if layout.num_context_rows else \
                "is a sharing-window producer (export=)"
            raise ValueError(f"TreePackedSeqParams.for_tree: --tree-kda-call-plan {call_plan} runs layouts of whole "
                             f"trees only, and this layout {role}: --tree-kda-call-plan {call_plan} needs "
                             "--tree-sharing within")
        device = torch.device(device) if device is not None else layout.prev.device
        # conv taps and block mask are built on the host (from the layout's host copy) and moved
        host = _host(layout)
        taps = build_conv_taps(host, conv_kernel)
        layout = layout.to(device)
        consumer_index = None
        if layout.num_context_rows:
            if exports is None:
                raise ValueError("TreePackedSeqParams.for_tree: this layout has context rows (a consumer): pass "
                                 "exports= (the producer's WindowExports)")
            spec = exports.spec
            if (spec.chunk_size, spec.replay, spec.conv_kernel) != (int(chunk_size), bool(replay), int(conv_kernel)):
                raise ValueError(f"exports were made for chunk size {spec.chunk_size}, replay={spec.replay}, conv "
                                 f"kernel {spec.conv_kernel}; this consumer runs chunk size {chunk_size}, "
                                 f"replay={replay}, conv kernel {conv_kernel}")
            src = host.ctx_source_rows.cpu()
            if (src.numel() and int(src.max()) >= spec.producer_rows) or \
                    not torch.equal(spec.producer_forest_rows[src], host.ctx_forest_rows.cpu()):
                raise ValueError("TreePackedSeqParams.for_tree: the consumer's context rows are not the rows of the "
                                 "producer these exports come from")
            schedule = _kda_consumer_schedule(host, chunk_size, replay)
            state_rows, replay_rows = consumer_kda_sources(host, schedule)
            recorded = None
            if export is not None:          # a piece: also exports its own rows to later pieces
                _check_export(export, host, chunk_size, replay, conv_kernel)
                schedule = _kda_consumer_schedule(host, chunk_size, replay, export_rows=export.state_rows)
                recorded = WindowExports(export, {})
            schedule = schedule.to(device)

            def position(values, table, what) -> np.ndarray:
                table = np.asarray(table)
                pos = np.searchsorted(table, values)
                ok = (pos < table.size) & (table[np.minimum(pos, max(table.size - 1, 0))] == values) \
                    if table.size else np.zeros(len(values), dtype=bool)
                if not np.all(ok):
                    raise ValueError(f"TreePackedSeqParams.for_tree: the producer's exports lack {what} this "
                                     "consumer needs (ExportSpec.for_consumers was built without it)")
                return pos.astype(np.int64)

            # the conv reads its context rows straight from the exported conv rows
            reach = taps.context_rows_read().numpy()
            conv_pos = np.full(host.num_context_rows, -1, dtype=np.int64)
            conv_pos[reach] = position(src.numpy()[reach], spec.conv_rows.numpy(), "conv context rows")
            taps = taps.reading_table(torch.from_numpy(conv_pos), int(spec.conv_rows.numel()))
            # MLA reads the context rows it sees; the others (evicted for every row) read exported row 0,
            # which the attention masks out (no value, no gradient)
            seen = _seen_context_rows(host)
            ctx_pos = np.zeros(host.num_context_rows, dtype=np.int64)
            ctx_pos[seen] = position(src.numpy()[seen], spec.rows.numpy(), "context rows")
            if spec.rows.numel() == 0:
                raise ValueError("TreePackedSeqParams.for_tree: the producer's exports lack context rows this "
                                 "consumer needs (ExportSpec.for_consumers was built without it)")
            ctx, rep, st = host_to_device_many([torch.from_numpy(ctx_pos)] + [
                torch.from_numpy(position(v, t, what)) for v, t, what in (
                (replay_rows, spec.replay_rows.numpy(), "replay rows"),
                (state_rows, spec.state_rows, "KDA states"))], device)
            consumer_index = ConsumerIndex(ctx=ctx, replay=rep, state=st)
        else:
            if exports is not None:
                raise ValueError("TreePackedSeqParams.for_tree: exports= is for consumer layouts (with context "
                                 "rows); this layout has none")
            export_rows = None
            if export is not None:
                _check_export(export, host, chunk_size, replay, conv_kernel)
                export_rows = export.state_rows
                exports = recorded = WindowExports(export, {})
            else:
                recorded = None
            if call_plan == "harts":
                plan = plan_calls(layout.seg_parent, layout.seg_start, layout.seg_length, chunk_size, replay=replay)
            else:
                plan = BASELINE_PLANS[call_plan](layout.seg_parent, layout.seg_start, layout.seg_length, chunk_size)
            schedule = build_kda_schedule(layout.seg_parent, layout.seg_start, layout.seg_length, layout.seg_row,
                                          plan, export_rows=export_rows, device=device)
        key_paths = None
        if attention_backend == "varlen":
            from ..ops.key_paths import build_key_paths
            key_paths = build_key_paths(host.visibility,
                                        host.context_visibility if host.num_context_rows else None,
                                        prev=host.prev if host.num_events else None, device=device)
            if not key_paths.worth_gathering():      # many short runs: the block-mask backend instead
                key_paths = None
            if key_paths is None:
                attention_backend = "flex" if device.type == "cuda" else "sdpa"
        block_mask = None
        if attention_backend == "flex":
            from ..ops.tree_attention import build_tree_block_mask
            block_mask = build_tree_block_mask(
                host, context_visibility=host.context_visibility if host.num_context_rows else None,
                device=device)
        interval_blocks = None
        if attention_backend == "interval":
            from ..ops.interval_attention import build_interval_blocks
            interval_blocks = build_interval_blocks(
                host.visibility, host.context_visibility if host.num_context_rows else None, device=device)
        fa4_visibility = None
        if attention_backend == "fa4":     # tiles cut on first use, at the attention's head dims
            fa4_visibility = (host.visibility, host.context_visibility if host.num_context_rows else None)
        taps = taps.to(device)
        R = layout.num_rows
        cu = host_to_device(torch.tensor([0, R], dtype=torch.int32), device)
        return cls(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=R, max_seqlen_kv=R,
                   mode="tree", layout=layout, kda_schedule=schedule, conv_taps=taps, block_mask=block_mask,
                   key_paths=key_paths, interval_blocks=interval_blocks, fa4_visibility=fa4_visibility,
                   attention_backend=attention_backend,
                   token_weight=layout.occurrence.to(torch.float64),
                   token_weight_total=float(host.occurrence.to(torch.float64).sum()), position_ids=layout.position_ids,
                   export_spec=None if export is None else export.to(device), exports=exports,
                   recorded=recorded, consumer_index=consumer_index)

    def padded(self, pad: int) -> "TreePackedSeqParams":
        """These params for the same rows followed by ``pad`` padding rows (module docstring)."""
        import dataclasses
        if pad < 0:
            raise ValueError(f"padded: pad must be >= 0, got {pad}")
        if pad == 0:
            return self
        if self.pad_rows:
            raise ValueError("padded: these params are padded already")
        if self.is_tree:
            w = self.token_weight
            return dataclasses.replace(self, pad_rows=int(pad),
                                       token_weight=torch.cat([w, w.new_zeros(pad)]),
                                       position_ids=torch.cat([self.position_ids,
                                                               self.position_ids.new_zeros(pad)]))
        lens, device = self.host_seq_lengths(), self.cu_seqlens_q.device
        vis = self.visibility
        if vis is not None:         # the padding: one more causal sequence
            n = vis.num_queries
            pad_rows = torch.arange(n, n + int(pad), dtype=torch.int64)
            vis = Visibility(torch.cat([vis.offsets, vis.offsets[-1] + 1 + torch.arange(int(pad))]),
                             torch.cat([vis.start, pad_rows]), torch.cat([vis.end, torch.full_like(pad_rows, n + pad)]),
                             n + int(pad), causal=True)
        out = TreePackedSeqParams.for_sequences(lens.tolist() + [int(pad)], device=device, visibility=vis)
        n = int(lens.sum())
        weight = self.token_weight if self.token_weight is not None else \
            torch.ones(n, dtype=torch.float64, device=device)
        total = self.token_weight_total if self.token_weight is not None else float(n)
        return dataclasses.replace(out, pad_rows=int(pad), token_weight=torch.cat([weight, weight.new_zeros(pad)]),
                                   token_weight_total=total)

    @classmethod
    def for_sequences(cls, lengths, *, device=None, visibility: Optional[Visibility] = None) -> "TreePackedSeqParams":
        """Expanded mode: independent causal sequences of the given lengths, packed back to back.

        ``visibility``: where the sequences carry compaction events, the packed rows' full-attention
        visibility (``ExpandedBatch.visibility``, ``layout.sequence_visibility``), kept on the host;
        None (default, also what those give without events): plain causal sequences."""
        lengths = torch.as_tensor(list(lengths), dtype=torch.int64)
        if lengths.numel() == 0 or bool((lengths < 1).any()):
            raise ValueError("for_sequences: every sequence needs at least one token")
        if visibility is not None:
            if not isinstance(visibility, Visibility):
                raise ValueError(f"for_sequences: visibility must be a Visibility, got {type(visibility).__name__}")
            if not visibility.causal or visibility.num_queries != int(lengths.sum()):
                raise ValueError(f"for_sequences: the visibility covers {visibility.num_queries} rows, the sequences "
                                 f"{int(lengths.sum())} (a causal visibility of the packed rows is needed)")
            visibility = visibility.to("cpu")
        cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
        cu[1:] = lengths.cumsum(0)
        pos = torch.cat([torch.arange(int(n)) for n in lengths])
        if device is not None:
            cu, pos = host_to_device_many((cu, pos), device)
        m = int(lengths.max())
        return cls(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=m, max_seqlen_kv=m,
                   mode="expanded", position_ids=pos, seq_lengths=lengths, visibility=visibility)
