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
  sequence is causal on its own; nothing is shared.

Without any packed-sequence params the model runs the batched [s, b] form
(each batch column one causal sequence), which is expanded mode too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron.core.packed_seq_params import PackedSeqParams

MODES = ("tree", "expanded")


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
    conv_taps: Optional[torch.Tensor] = None  # [R, K-1] from ops.path_conv.build_conv_taps
    block_mask: Any = None                   # FlexAttention BlockMask (tree mode, flex backend)
    token_weight: Optional[torch.Tensor] = None  # [R] occurrence counts (tree mode)
    position_ids: Optional[torch.Tensor] = None  # [tokens] path depth (tree) / position in sequence

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"TreePackedSeqParams.mode must be one of {MODES}, got {self.mode!r}")

    @property
    def is_tree(self) -> bool:
        return self.mode == "tree"

    @property
    def num_tokens(self) -> int:
        if self.is_tree:
            return int(self.layout.num_rows)
        return int(self.cu_seqlens_q[-1])

    @classmethod
    def for_tree(cls, layout, *, config=None, chunk_size: int = 64, conv_kernel: int = 4, replay: bool = True,
                 attention_backend: str = "sdpa", device=None) -> "TreePackedSeqParams":
        """All per-microbatch tree metadata for ``layout``, built once and shared by all layers.

        With ``config`` (a HybridConfig) the chunk size, conv kernel and attention backend are
        the model's (``kda_chunk_size``, ``linear_conv_kernel_dim``, ``tree_attention_backend``).
        """
        if config is not None:
            chunk_size = config.kda_chunk_size
            conv_kernel = config.linear_conv_kernel_dim
            attention_backend = config.tree_attention_backend
        from ..ops.path_conv import build_conv_taps
        from ..ops.tree_kda import build_kda_schedule
        from ..planner.calls import plan_calls

        if layout.num_context_rows:
            raise ValueError("TreePackedSeqParams.for_tree: layouts with context rows (cross-microbatch "
                             "consumers) are not supported by the model yet")
        device = torch.device(device) if device is not None else layout.prev.device
        layout = layout.to(device)
        plan = plan_calls(layout.seg_parent, layout.seg_start, layout.seg_length, chunk_size, replay=replay)
        schedule = build_kda_schedule(layout.seg_parent, layout.seg_start, layout.seg_length, layout.seg_row,
                                      plan, device=device)
        taps = build_conv_taps(layout.prev, conv_kernel)
        block_mask = None
        if attention_backend == "flex":
            from ..ops.tree_attention import build_tree_block_mask
            block_mask = build_tree_block_mask(layout, device=device)
        R = layout.num_rows
        cu = torch.tensor([0, R], dtype=torch.int32, device=device)
        return cls(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=R, max_seqlen_kv=R,
                   mode="tree", layout=layout, kda_schedule=schedule, conv_taps=taps, block_mask=block_mask,
                   token_weight=layout.occurrence.to(torch.float64), position_ids=layout.position_ids)

    @classmethod
    def for_sequences(cls, lengths, *, device=None) -> "TreePackedSeqParams":
        """Expanded mode: independent causal sequences of the given lengths, packed back to back."""
        lengths = torch.as_tensor(list(lengths), dtype=torch.int64)
        if lengths.numel() == 0 or bool((lengths < 1).any()):
            raise ValueError("for_sequences: every sequence needs at least one token")
        cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
        cu[1:] = lengths.cumsum(0)
        pos = torch.cat([torch.arange(int(n)) for n in lengths])
        cu, pos = cu.to(device), pos.to(device)
        m = int(lengths.max())
        return cls(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=m, max_seqlen_kv=m,
                   mode="expanded", position_ids=pos)
