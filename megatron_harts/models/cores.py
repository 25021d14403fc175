"""The sequence-mixing cores of the KDA and MLA layers: the only modules that read a row mode.

A KDA or MLA layer projects its rows and hands them to its core, a megatron-core spec slot
(``KDASubmodules.core``, ``MLASubmodules.core_attention``); the core mixes the rows along their
sequences and returns one output per row.  The layers' forwards are the same in every mode; the
cores own everything about how the rows are laid out: the packed-sequence params
(:class:`~megatron_harts.models.packed.TreePackedSeqParams`), the padding rows, and the sharing
window mechanics (a producer records its exports, a consumer reads them, a recomputed producer
carries its exports' gradients back through ``attach_injected``).

Where a mode is decided: :func:`row_mode`, from the packed-sequence params the layer receives (the
one place the model's modules read ``packed_seq_params.mode`` and its window roles;
``HybridTransformerLayer`` asks it too, for the MoE statistics).  Its answer:

- ``tree``: the rows are a ``CompactLayout``'s ([R, 1, h], plus ``pad_rows`` padding rows
  after them that get zero outputs), with two independent roles:
  ``producer`` (``export_spec`` set: record what the window's consumers read) and
  ``consumer`` (``consumer_index`` set: read the producer's exports for the context rows);
  a piece of a long path is both.
- ``packed``: expanded mode, independent causal sequences packed back to back (THD; megatron's
  own ``PackedSeqParams`` too), possibly with a visibility that compaction events cut, possibly
  ending in one padding sequence.
- ``batched``: no packed-sequence params: each of the b columns of [s, b] is one causal sequence
  (expanded mode too).

Cores (their parameters stay with their layers: the cores are parameter free, so checkpoints and
the transformers mapping do not see them):

- :class:`KDACore`: short causal conv (kernel ``linear_conv_kernel_dim``) of the q/k/v projections
  with SiLU, L2 norm of q and k per head, and the KDA recurrence.  Tree mode runs the conv along
  ``prev`` (``ops.path_conv`` with the layout's taps) and the recurrence on the layout's call
  schedule (``ops.tree_kda``); packed/batched mode runs the conv per sequence
  (``ops.path_conv.sequence_conv_taps``) and one varlen call of ``config.kda_backend``.
- :class:`MLACoreAttention`: keys and values from the latents (the layer's own up projection,
  passed in as ``keys_values``), then tree attention (``ops.tree_attention``) in tree mode, or
  causal attention per sequence (fa4 over key paths where it runs, the tree-attention backend over
  a compaction visibility, else SDPA over zero-padded sequences).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Tuple

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.random import CheckpointWithoutOutput
from megatron.core.transformer.module import MegatronModule

from ..ops.kda_elementwise import L2NORM_EPS, silu_l2norm
from ..ops.key_paths import default_kernel, path_attention
from ..ops.path_conv import path_conv, sequence_conv_taps
from ..ops.tree_attention import tree_attention
from ..ops.tree_kda import KdaExternal, calls_rows, get_kda_backend, tree_kda
from .common import (from_sequence_order, sequence_lengths, sequences_unview, sequences_view,
                     to_sequence_order, use_fused_kernels)

ROW_MODES = ("tree", "packed", "batched")
#: ``torch.profiler.record_function`` names around the cores' forward (a profile finds their
#: backward through the autograd nodes those forwards create)
ATTENTION_RANGE = "harts.attention"
KDA_RANGE = "harts.kda"


@dataclass(frozen=True)
class RowMode:
    """How the rows a layer receives are laid out (module docstring); made by :func:`row_mode` only."""
    kind: str               # one of ROW_MODES
    producer: bool = False  # tree: records exports for a sharing window's consumers
    consumer: bool = False  # tree: reads a producer's exports for its context rows
    pad_rows: int = 0       # padding rows after the real ones (tree: zero outputs; packed: one more sequence)

    @property
    def tree(self) -> bool:
        return self.kind == "tree"


def row_mode(packed_seq_params) -> RowMode:
    """The row mode of ``packed_seq_params`` (None: batched).  The one place a mode is decided."""
    if packed_seq_params is None:
        return RowMode("batched")
    pad = int(getattr(packed_seq_params, "pad_rows", 0) or 0)
    if getattr(packed_seq_params, "mode", "expanded") != "tree":
        return RowMode("packed", pad_rows=pad)
    return RowMode("tree", producer=packed_seq_params.export_spec is not None,
                   consumer=packed_seq_params.consumer_index is not None, pad_rows=pad)


def row_positions(packed_seq_params, s: int, b: int, device) -> torch.Tensor:
    """Each row's position id [s*b]: the path depth (tree) or position in its sequence (packed), from the
    packed-sequence params; batched rows: their index in the column."""
    if row_mode(packed_seq_params).kind == "batched":
        return torch.arange(s, device=device).repeat_interleave(b)
    if packed_seq_params.position_ids is None:
        raise ValueError("packed-sequence params without position_ids: the rows' positions are unknown")
    return packed_seq_params.position_ids.to(device)


def _zero_pad(o: torch.Tensor, pad: int) -> torch.Tensor:
    """``o`` followed by ``pad`` zero rows (the padding rows' outputs)."""
    return torch.cat([o, o.new_zeros((pad,) + tuple(o.shape[1:]))]) if pad else o


def conv_activate_qkv(config, conv, qkv, heads: int, dim: int):
    """The KDA inputs from the projections ``qkv``: ``conv(i, t, activation)`` (the mode's short conv of
    the i-th of q, k, v) of each, SiLU, and q and k L2-normalized per head, as [rows, heads, dim].
    Where :func:`~megatron_harts.models.common.use_fused_kernels` says so, q's and k's SiLU and norm
    run as one kernel (``ops.kda_elementwise.silu_l2norm``) after a conv without activation."""
    fused = use_fused_kernels(config, qkv[0])
    qk_act, norm = (None, silu_l2norm) if fused else ("silu", l2norm)
    q, k = (norm(conv(i, qkv[i], qk_act).view(-1, heads, dim)) for i in (0, 1))
    return q, k, conv(2, qkv[2], "silu").view(-1, heads, dim)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """fla's / Kimi-Linear's L2 norm over the last dim: ``x / sqrt(sum(x^2) + eps)``."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


class KDACore(MegatronModule):
    """The KDA layer's core (module docstring); parameter free.

    ``forward(q, k, v, g, beta, conv_weights, packed_seq_params, shape)``: ``q, k, v`` the rows' pre-conv
    projections [s*b, Hl*D] (rows in [s, b] order), ``g`` [s*b, Hl, D] the log forget gates,
    ``beta`` [s*b, Hl], ``conv_weights`` the layer's (q, k, v) conv weights [Hl*D, Kc], ``shape``
    (s, b).  Returns the recurrence's outputs [s*b, Hl, D] (padding rows: zeros).
    """

    def __init__(self, config, layer_number: int, **kwargs):
        super().__init__(config)
        self.config = config
        self.layer_number = layer_number
        self.kernel = config.linear_conv_kernel_dim

    def forward(self, q, k, v, g, beta, conv_weights, packed_seq_params=None, *, shape: Tuple[int, int]):
        mode = row_mode(packed_seq_params)
        run = self._tree if mode.tree else self._sequences
        with torch.profiler.record_function(KDA_RANGE):
            return run(mode, q, k, v, g, beta, conv_weights, packed_seq_params, shape)

    def _tree(self, mode, q, k, v, g, beta, conv_weights, psp, shape):
        if shape[1] != 1:
            raise ValueError(f"tree mode needs the rows as [R, 1, h], got b={shape[1]}")
        R = psp.layout.num_rows           # rows after R are padding: zero core output
        if mode.pad_rows:
            q, k, v, g, beta = (t[:R] for t in (q, k, v, g, beta))
        H, D = g.shape[1], g.shape[2]
        pre = {"conv_q": q, "conv_k": k, "conv_v": v}
        if mode.consumer:   # the conv taps read the producer's exported inputs of the context rows
            ex = psp.layer_exports(self.layer_number)
            context = [ex[n] for n in ("conv_q", "conv_k", "conv_v")]

            def conv(i, t, act):
                return path_conv(t, conv_weights[i], None, None, activation=act, taps=psp.conv_taps,
                                 context=context[i])
        else:
            def conv(i, t, act):
                return path_conv(t, conv_weights[i], None, psp.layout.prev, activation=act, taps=psp.conv_taps)
        external, replay, sched = None, (), psp.kda_schedule
        if mode.consumer:   # subtree roots start from the producer's states and replay its rows
            ex, ci = psp.layer_exports(self.layer_number), psp.consumer_index
            external = KdaExternal(ex["states"].index_select(0, ci.state),
                                   *(ex[n].index_select(0, ci.replay) for n in ("q", "k", "v", "g", "beta")))
            replay = (external.q, external.k, external.v)
        # the calls' rows of q, k, v come with them where they are not q, k, v themselves
        gather = sched if sched.call_rows is not None or replay else None
        q, k, v, calls_in, release = self._inputs(conv, q, k, v, H, D, gather, replay)
        backend = self.config.kda_backend
        if mode.producer:   # record what the window's consumers read
            o, states = tree_kda(q, k, v, g, beta, sched, backend=backend, external=external,
                                 return_exports=True, calls_inputs=calls_in)
            conv_rows, replay_rows = psp.export_spec.conv_rows, psp.export_spec.replay_rows
            rec = {n: t.index_select(0, conv_rows) for n, t in pre.items()}
            rec.update({n: t.index_select(0, replay_rows)
                        for n, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta))})
            rec["states"] = states
            psp.record_export(self.layer_number, rec)
        else:
            o = tree_kda(q, k, v, g, beta, sched, backend=backend, external=external, calls_inputs=calls_in)
        release(o)
        return psp.attach_injected(self.layer_number, _zero_pad(o, mode.pad_rows))

    def _sequences(self, mode, q, k, v, g, beta, conv_weights, psp, shape):
        s, b = shape
        H, D = g.shape[1], g.shape[2]
        lens = sequence_lengths(psp, s, b)
        if getattr(psp, "seq_lengths", None) is not None:     # ours: taps built once per microbatch
            taps = psp.sequence_conv_taps(self.kernel, q.device)
        else:                                                 # batched, or megatron's own params
            taps = sequence_conv_taps(lens, self.kernel).to(q.device)
        def conv(i, t, act):
            return from_sequence_order(path_conv(to_sequence_order(t, s, b), conv_weights[i], None, None,
                                                 activation=act, taps=taps), s, b)
        q, k, v, _, release = self._inputs(conv, q, k, v, H, D)
        run = get_kda_backend(self.config.kda_backend)
        o, _ = run(*(to_sequence_order(t, s, b) for t in (q, k, v, g, beta)), lens,
                   chunk_size=self.config.kda_chunk_size)
        release(o)
        return from_sequence_order(o, s, b)

    def _inputs(self, conv, q, k, v, heads: int, dim: int, gather=None, replay=()):
        """(q, k, v, calls_inputs, release): the recurrence's inputs from the projections
        (:func:`conv_activate_qkv`); with ``gather`` (tree mode: the layout's KDA schedule) also the rows its
        calls read of them (``ops.tree_kda.calls_rows``, after them the producer's ``replay`` rows of q, k,
        v), else None; and the function to call with the recurrence's output once nothing in the forward
        reads them again.

        With ``config.kda_input_recompute`` (and gradients on) the conv, activations and gathers run under
        megatron-core's ``CheckpointWithoutOutput``: nothing they would save for the backward is kept
        but their inputs (the projections), ``release(o)`` frees the storage of what they computed (the
        recurrence keeps it for its backward), and when ``o``'s gradient arrives it is computed again
        into that storage by the same kernels, so the recurrence's backward reads the same bits and the
        conv's, activations' and gathers' backward runs as it would have (the step's gradients are the
        same up to the order in which the backward sums some of them).  On the GPU a KDA layer keeps 6 x
        heads x dim elements a row fewer (the conv outputs of q, k and v, which the SiLU and L2 norm
        keep, and the recurrence's q, k, v or its calls' copies of them) (``planner.memory``), for one
        more forward of the convs, activations and gathers."""
        def inputs(a, b, c, *rp):
            qkv = conv_activate_qkv(self.config, conv, (a, b, c), heads, dim)
            if gather is None:
                return qkv
            return (*qkv, *(calls_rows(x, gather, e) for x, e in zip(qkv, rp or (None,) * 3)))

        args = (q, k, v, *replay)    # replay rows come only with gather (a consumer's tree calls)
        if not (getattr(self.config, "kda_input_recompute", False) and torch.is_grad_enabled()):
            out, release = inputs(*args), _keep
        else:
            ck = CheckpointWithoutOutput(fp8=None)   # None: no fp8 (megatron's default False counts as fp8)
            out, release = ck.checkpoint(inputs, *args), ck.discard_output_and_register_recompute
        return (*out[:3], tuple(out[3:]) or None, release)


def _keep(o: torch.Tensor) -> None:
    """``KDACore._inputs``' release where q, k and v are kept (nothing to do)."""


KeysValues = Callable[[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]


class MLACoreAttention(MegatronModule):
    """The MLA layer's core attention (module docstring); parameter free.

    ``forward(query, kv_latent, k_rope, keys_values, packed_seq_params, shape)``: ``query`` [s*b, Hl, dn+dr]
    (rope part rotated), ``kv_latent`` [s*b, kv_lora_rank] (normalized), ``k_rope`` [s*b, 1, dr] (rotated),
    ``keys_values(kv_latent, k_rope) -> (keys [n, Hl, dn+dr], values [n, Hl, dv])`` the layer's up projection
    (also applied to a producer's exported latents), ``shape`` (s, b).  Returns [s*b, Hl, dv] (padding
    rows: zeros).
    """

    def __init__(self, config, layer_number: int, softmax_scale: float, **kwargs):
        super().__init__(config)
        self.config = config
        self.layer_number = layer_number
        self.scale = softmax_scale

    def forward(self, query, kv_latent, k_rope, keys_values: KeysValues, packed_seq_params=None, *,
                shape: Tuple[int, int]):
        mode = row_mode(packed_seq_params)
        k, v = keys_values(kv_latent, k_rope)
        if mode.tree:
            return self._tree(mode, query, k, v, kv_latent, k_rope, keys_values, packed_seq_params, shape)
        with torch.profiler.record_function(ATTENTION_RANGE):
            return self._sequences(query, k, v, packed_seq_params, shape)

    def _tree(self, mode, q, k, v, kv_latent, k_rope, keys_values, psp, shape):
        if shape[1] != 1:
            raise ValueError(f"tree mode needs the rows as [R, 1, h], got b={shape[1]}")
        context_kv = None
        if mode.consumer:       # the context rows' keys/values from the producer's latents
            ex, ci = psp.layer_exports(self.layer_number), psp.consumer_index
            context_kv = keys_values(ex["kv_latent"].index_select(0, ci.ctx), ex["k_rope"].index_select(0, ci.ctx))
        if mode.producer:       # record what the window's consumers read
            rows = psp.export_spec.rows
            psp.record_export(self.layer_number, {"kv_latent": kv_latent.index_select(0, rows),
                                                  "k_rope": k_rope.index_select(0, rows)})
        R = psp.layout.num_rows  # rows after R are padding: zero attention output
        backend = psp.attention_backend or self.config.tree_attention_backend
        fa4_blocks = psp.fa4_blocks_for((q.shape[-1], v.shape[-1]), q.device) if backend == "fa4" else None
        with torch.profiler.record_function(ATTENTION_RANGE):
            o = tree_attention(q[:R], k[:R], v[:R], psp.layout, self.scale, backend=backend,
                               block_mask=psp.block_mask, key_paths=psp.key_paths,
                               interval_blocks=psp.interval_blocks, fa4_blocks=fa4_blocks, context_kv=context_kv)
        return psp.attach_injected(self.layer_number, _zero_pad(o, mode.pad_rows))

    def _sequences(self, q, k, v, psp, shape):
        s, b = shape
        dv = v.shape[-1]
        if b == 1 and hasattr(psp, "sequence_key_paths") and default_kernel(q, dv) == "fa4":
            # packed rows through the tree mode's fastest varlen kernel (the same one), not padded;
            # with compaction events the paths break at the event rows (sequence_key_paths)
            return path_attention(q, k, v, psp.sequence_key_paths(q.device), self.scale, kernel="fa4")
        if getattr(psp, "visibility", None) is not None:
            # packed rows whose compaction events evict keys: each sequence's own mask, through the
            # model's tree-attention backend (the tree mode's)
            kw = psp.sequence_attention(self.config.tree_attention_backend, q.device,
                                        dims=(q.shape[-1], v.shape[-1]))
            return tree_attention(q, k, v, scale=self.scale, **kw)
        (qp, kp, vp), flat = sequences_view((q, k, v), s, b, psp)
        op = F.scaled_dot_product_attention(qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2),
                                            is_causal=True, scale=self.scale)
        return sequences_unview(op.transpose(1, 2), flat)

