"""Tree attention through flash-attn-4's block-sparse kernels, keys and values read in place.

The ``fa4`` backend of :func:`~megatron_harts.ops.tree_attention.tree_attention`.  The same tiles as
:mod:`.interval_attention` (a visibility cut into tiles of query rows by keys; *full* when every key
of the tile sees every row of it, *partial* when some key sees some row, skipped otherwise), but
the kernels are flash-attn-4's Hopper kernels (warp-specialized, TMA loads, wgmma), which take
a tile list as "block sparsity" and a ``mask_mod`` for the elements of partial tiles:

- the forward walks, per query block, its full key blocks without a mask and its partial ones
  with the mask;
- the backward walks, per key block, the query blocks that visit it (the transposed lists, built
  at the backward kernel's tile shape, which may differ from the forward's: 128 x 96 at MLA's
  192/128 head dims);
- the mask is ``starts[kv] <= q < ends[kv]`` for one of the key's visible query intervals, read
  from the padded per-key interval table (int32 ``[K_pad]`` for one interval per key, as every
  tree and compaction layout has, else ``[K_pad, M]``), passed as the kernels' aux tensors.

So every visible pair is computed once, no key or value is gathered or copied, and a key that an
eviction removed drops out of the tiles.  :class:`Fa4Blocks` holds one microbatch's lists and
table (built once on the host by :func:`build_fa4_blocks` for the attention's head dims, shared by
every layer); :func:`fa4_block_attention` runs the kernels.  Tile shapes come from flash-attn-4's
own choice for the head dims (``fa4_tiles``), so the lists match the kernels' tiles.

The definition is the ``reference`` backend (dense mask, explicit softmax);
:func:`block_lists_reference` is the lists' brute-force definition from a dense mask.
tests/test_fa4_blocks.py holds the lists to it on the CPU and the kernels to the reference on a
Hopper GPU with the pinned flash-attn-4 installed; elsewhere :func:`fa4_block_attention` raises one
error naming the reason.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import torch

from ..layout import Visibility, host_to_device_many
from .interval_attention import _tile_kinds, blocks_reference, key_axis, key_axis_table
from .key_paths import fa4_available

__all__ = ["Fa4Blocks", "build_fa4_blocks", "fa4_block_attention", "fa4_tiles", "block_lists",
           "block_lists_reference", "SPARSE_BLOCK_Q"]

#: query rows per sparse block (forward and backward): a multiple of every Hopper tile height fa4 picks
SPARSE_BLOCK_Q = 128


def fa4_tiles(dqk: int, dv: int) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """((query rows, keys) of the forward's sparse blocks, the same of the backward's) for these head
    dims: ``SPARSE_BLOCK_Q`` rows, and the key-tile width flash-attn-4 (the pinned release) uses on
    Hopper for them with block sparsity, which a sparse block must equal."""
    from flash_attn.cute.interface import _tile_size_bwd_sm90, _tile_size_fwd_sm90
    fwd = _tile_size_fwd_sm90(dqk, dv, False, False, sparse_block_size_q=SPARSE_BLOCK_Q)
    bwd = _tile_size_bwd_sm90(dqk, dv, False, False, sparse_block_size_q=SPARSE_BLOCK_Q)
    return (SPARSE_BLOCK_Q, fwd.n_block_size), (SPARSE_BLOCK_Q, bwd.n_block_size)


def block_lists(kinds: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(partial counts [n], partial columns [n, w], full counts [n], full columns [n, w]) of the rows of
    a tile-kind matrix (2 full, 1 partial, 0 skipped), columns ascending, padded with 0 (int32)."""
    n = kinds.shape[0]
    out = []
    for kind in (1, 2):
        row, col = np.nonzero(kinds == kind)
        cnt = np.bincount(row, minlength=n)
        off = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(cnt, out=off[1:])
        idx = np.zeros((n, max(1, int(cnt.max(initial=0)))), dtype=np.int32)
        idx[row, np.arange(row.shape[0]) - off[row]] = col
        out += [cnt.astype(np.int32), idx]
    return out[0], out[1], out[2], out[3]


def block_lists_reference(mask: torch.Tensor, block_q: int, block_k: int, by_keys: bool = False):
    """:func:`block_lists` of the tiles of a dense boolean ``[queries, keys]`` mask, by brute force:
    per query block (or, ``by_keys``, per key block) the partial and the full blocks of the other axis,
    as Python lists."""
    kinds = blocks_reference(mask, block_q, block_k)
    if by_keys:
        kinds = kinds.T
    return ([[int(j) for j in np.nonzero(r == 1)[0]] for r in kinds],
            [[int(j) for j in np.nonzero(r == 2)[0]] for r in kinds])


@dataclass
class Fa4Blocks:
    """One microbatch's tiles for :func:`fa4_block_attention` (module docstring).  ``fwd_lists``: per
    query block of ``fwd_block`` its partial key blocks (count, padded columns) and its full ones
    (:func:`block_lists`, int32 on the device); ``bwd_lists``: the same per key block of ``bwd_block``
    (its query blocks); ``starts``/``ends``: the padded interval table on the device (int32,
    ``[K_pad]`` when every key has one interval, else ``[K_pad, width]``); ``dims``: the head dims
    it is for.  ``fwd``/``bwd``: the lists as flash-attn-4's ``BlockSparseTensorsTorch``."""
    fwd_lists: Tuple[torch.Tensor, ...]
    bwd_lists: Tuple[torch.Tensor, ...]
    starts: torch.Tensor
    ends: torch.Tensor
    num_queries: int
    num_keys: int
    dims: Tuple[int, int]
    fwd_block: Tuple[int, int]
    bwd_block: Tuple[int, int]
    width: int
    num_full: int
    num_partial: int
    pairs: int

    @property
    def fwd(self):
        return _sparse_tensors(self.fwd_lists, self.fwd_block)

    @property
    def bwd(self):
        return _sparse_tensors(self.bwd_lists, self.bwd_block)

    def visible_fraction(self) -> float:
        """Visible pairs per computed pair of the forward's tiles (1: no wasted work)."""
        tiles = self.num_full + self.num_partial
        return self.pairs / (tiles * self.fwd_block[0] * self.fwd_block[1]) if tiles else 1.0


def build_fa4_blocks(vis: Visibility, context_visibility: Optional[Visibility] = None, *,
                     dims: Tuple[int, int], device=None,
                     blocks: Optional[Tuple[Tuple[int, int], Tuple[int, int]]] = None) -> Fa4Blocks:
    """The tiles of ``vis`` (context keys of ``context_visibility`` first on the key axis) for
    attention of head dims ``dims = (q/k, v)``.  ``blocks``: the (forward, backward) sparse block
    shapes; default :func:`fa4_tiles` (which imports flash-attn-4).  Host work O(intervals + tiles)."""
    R, K = key_axis(vis, context_visibility)
    fwd_block, bwd_block = blocks if blocks is not None else fa4_tiles(*dims)
    device = torch.device(device) if device is not None else vis.offsets.device
    # the mask is read up to the edge of the last tile of either pass: pad with empty intervals
    starts, ends = key_axis_table(vis, context_visibility, max(-(-K // b[1]) * b[1] for b in (fwd_block, bwd_block)))
    width = starts.shape[1]
    kinds_f = _tile_kinds(starts, ends, K, R, *fwd_block)
    kinds_b = _tile_kinds(starts, ends, K, R, *bwd_block).T
    i32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))
    arrays = [*block_lists(kinds_f), *block_lists(kinds_b)]
    table = [starts[:, 0], ends[:, 0]] if width == 1 else [starts, ends]
    tensors = host_to_device_many([i32(a) for a in arrays + table], device)
    return Fa4Blocks(tuple(tensors[0:4]), tuple(tensors[4:8]), tensors[8], tensors[9],
                     num_queries=R, num_keys=K, dims=tuple(dims), fwd_block=tuple(fwd_block),
                     bwd_block=tuple(bwd_block), width=width, num_full=int((kinds_f == 2).sum()),
                     num_partial=int((kinds_f == 1).sum()), pairs=int((ends - starts).sum()))


def _sparse_tensors(lists, block):
    """flash-attn-4's block-sparsity tuple of one pass: batch and head dims 1 (every head alike)."""
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    part_cnt, part_idx, full_cnt, full_idx = (x[None, None] for x in lists)
    return BlockSparseTensorsTorch(mask_block_cnt=part_cnt, mask_block_idx=part_idx, full_block_cnt=full_cnt,
                                   full_block_idx=full_idx, block_size=tuple(block))


_MASK_MODS = {}


def _mask_mod(width: int):
    """The kernels' ``mask_mod`` for an interval table of ``width`` intervals per key: key ``kv`` sees
    query ``q`` iff ``starts[kv, m] <= q < ends[kv, m]`` for some ``m`` (aux tensors 0 and 1)."""
    if width in _MASK_MODS:
        return _MASK_MODS[width]
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils

    if width == 1:
        @cute.jit
        def mask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
            lo = utils.scalar_to_ssa(aux_tensors[0][kv_idx[0]], cutlass.Int32)
            hi = utils.scalar_to_ssa(aux_tensors[1][kv_idx[0]], cutlass.Int32)
            return (q_idx >= lo) & (q_idx < hi)
    else:
        @cute.jit
        def mask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
            lo = utils.scalar_to_ssa(aux_tensors[0][kv_idx[0], 0], cutlass.Int32)
            hi = utils.scalar_to_ssa(aux_tensors[1][kv_idx[0], 0], cutlass.Int32)
            seen = (q_idx >= lo) & (q_idx < hi)
            for m in cutlass.range_constexpr(1, width):
                lo = utils.scalar_to_ssa(aux_tensors[0][kv_idx[0], m], cutlass.Int32)
                hi = utils.scalar_to_ssa(aux_tensors[1][kv_idx[0], m], cutlass.Int32)
                seen = seen | ((q_idx >= lo) & (q_idx < hi))
            return seen
    _MASK_MODS[width] = mask_mod
    return mask_mod


def fa4_block_attention(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, blocks: Fa4Blocks,
                        scale: float) -> torch.Tensor:
    """Attention of every query row over its visible keys (``blocks``' visibility), through
    flash-attn-4.  q ``[R, H, D]``, k_all ``[K, Hk, D]``, v_all ``[K, Hk, Dv]`` (context keys first),
    bf16 or fp16 on a Hopper GPU.  Differentiable in q, k_all and v_all."""
    dims = (q.shape[-1], v_all.shape[-1])
    if not fa4_available(q.device, dims) or q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"tree attention backend 'fa4' needs flash-attn-4 on a Hopper GPU, bf16/fp16 and head dims "
                         f"in its range; got {q.dtype} on {q.device}, head dims {dims}")
    if tuple(blocks.dims) != dims:
        raise ValueError(f"fa4 blocks were built for head dims {blocks.dims}, got {dims}")
    if (blocks.num_queries, blocks.num_keys) != (q.shape[0], k_all.shape[0]):
        raise ValueError(f"fa4 blocks are for (queries, keys) = {(blocks.num_queries, blocks.num_keys)}, "
                         f"got {(q.shape[0], k_all.shape[0])}")
    group = q.shape[1] // k_all.shape[1]
    if group > 1 and dims[0] != dims[1]:  # the Hopper backward takes grouped heads only at equal head dims
        k_all, v_all = k_all.repeat_interleave(group, dim=1), v_all.repeat_interleave(group, dim=1)
    from flash_attn.cute.interface import flash_attn_func
    out = flash_attn_func(q[None], k_all[None], v_all[None], softmax_scale=scale, causal=False,
                          mask_mod=_mask_mod(blocks.width), aux_tensors=[blocks.starts, blocks.ends],
                          block_sparse_tensors=blocks.fwd, block_sparse_tensors_bwd=blocks.bwd)
    out = out[0] if isinstance(out, tuple) else out
    return out[0]
