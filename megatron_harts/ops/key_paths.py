"""Tree attention as causal attention over gathered key paths (the ``varlen`` backend).

In DFS order a tree layout's rows fall into *runs*: maximal stretches of consecutive rows
where each row is the next one's parent (and, with compaction events, no row but the first is an
event row: its visible set is its parent's plus itself).  All rows of a run share the keys visible to its
first row except the run's own rows, which they see causally.  So tree attention of run g
is bottom-right-aligned causal attention of its ``Lq`` query rows over a gathered key list:
the keys visible to the first row other than its own rows (ancestors, context rows), in any
order, followed by the run's own rows in order.  Row ``i`` of the run sees exactly the first
``len(keys) - (Lq - 1 - i)`` keys.  A varlen causal kernel (flash-attention's, through torch)
then runs every run in one call, and each visible (query, key) pair is computed once.

:class:`KeyPaths` holds that decomposition for one microbatch (built once, shared by all
layers); :func:`path_attention` runs it: ``kernel="flash"`` (CUDA: torch's bundled
flash-attention 2 varlen kernels), ``kernel="fa4"`` (CUDA, Hopper: flash-attn-4's CuTe kernels,
which use the chip's own matrix instructions; optional, pinned to ``FA4_VERSION``), or
``kernel="reference"`` (plain torch per run, autograd; any device and dtype: the readable
definition the tests hold both fast kernels to).  The fast kernels gather the
keys/values in the forward and again in the backward and sum the key/value gradients back in fp32;
:func:`default_kernel` picks fa4 where it is installed and runs, else flash.
:func:`sequence_key_paths` states independent causal sequences (expanded mode) in the same form, so
that both modes can run the same kernel.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch
import torch.nn.functional as F

from ..layout import Visibility, host_to_device

__all__ = ["KeyPaths", "build_key_paths", "gathered_key_count", "sequence_key_paths", "path_attention", "KERNELS",
           "default_kernel", "fa4_available"]

KERNELS = ("flash", "fa4", "reference")

#: limits of :meth:`KeyPaths.worth_gathering` (the model falls back to the block-mask backend for
#: a microbatch outside them).  The microbatches of the benchmarks' paper-level batches (16k rows):
#: Step-wise 2,600-7,400 pairs per gathered key, 1.0 gathered keys per row; Tree-Step 1,200-3,700
#: pairs per gathered key, 1.0-4.0 gathered keys per row.
MIN_PAIRS_PER_GATHERED_KEY = 64
MAX_GATHER_FACTOR = 16


@dataclass
class KeyPaths:
    """Runs of query rows and the gathered key list of each.

    Invariant: query rows ``[q_offsets[g], q_offsets[g+1])`` form run g; its keys are
    ``key_index[k_offsets[g]:k_offsets[g+1]]`` (positions on the key axis: context keys
    ``[0, num_context)``, then the layout's rows), the last ``Lq_g`` of them the run's own rows
    in order; row ``q_offsets[g] + i`` sees exactly the first ``P_g - (Lq_g - 1 - i)`` keys of
    its run (``P_g`` = the run's key count), and these are exactly the keys visible to it.
    ``pairs`` counts the visible pairs.  Offsets are int32 and on the compute device (what the
    varlen kernels take); ``q_lengths``/``k_lengths`` stay on the host.  ``in_place``: ``key_index``
    is the identity (every key read once, in order: packed causal sequences), so the kernels read the
    keys and values where they are and take their gradients as they come, with no gather and no sum.
    """
    q_offsets: torch.Tensor      # int32 [G+1]
    k_offsets: torch.Tensor      # int32 [G+1]
    key_index: torch.Tensor      # int64 [sum P]
    q_lengths: np.ndarray        # int64 [G]
    k_lengths: np.ndarray        # int64 [G]
    num_queries: int
    num_keys: int                # key axis length: context keys + rows
    pairs: int
    in_place: bool = False       # key_index is the identity (no gather, no sum back)

    @property
    def num_runs(self) -> int:
        return int(self.q_lengths.shape[0])

    @property
    def max_q(self) -> int:
        return int(self.q_lengths.max()) if self.num_runs else 0

    @property
    def max_k(self) -> int:
        return int(self.k_lengths.max()) if self.num_runs else 0

    @property
    def gathered_keys(self) -> int:
        return int(self.k_lengths.sum())

    def worth_gathering(self) -> bool:
        """Whether the varlen kernels suit these runs: on average at least
        ``MIN_PAIRS_PER_GATHERED_KEY`` query rows read each gathered key (fewer: the flash tiles
        of 128 query rows run mostly empty and the gathers dominate, as in trees of many short
        branches), and at most ``MAX_GATHER_FACTOR`` gathered keys per key row (the gathered
        keys/values are a transient of that size per attention call)."""
        g = self.gathered_keys
        return g == 0 or (self.pairs >= MIN_PAIRS_PER_GATHERED_KEY * g
                          and g <= MAX_GATHER_FACTOR * max(self.num_keys, 1))


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.int64, copy=False)


def build_key_paths(vis: Visibility, context_visibility: Optional[Visibility] = None, *,
                    prev: Optional[torch.Tensor] = None, device=None) -> KeyPaths:
    """The run decomposition of a tree visibility.

    Without ``prev`` every key has one interval ``[k, end[k])`` and the tree is read from the
    intervals.  Where compaction events evict keys (``CompactLayout.num_events > 0``; expanded
    sequences with events) the intervals do not give the tree: pass ``prev``, the previous row on
    each row's path (``CompactLayout.prev``; -1 at a root).  A run then also breaks at every row
    where some key's interval starts or ends (an event row: its visible set is not its parent's
    plus itself), and a run's gathered keys are those of its first row's parent that still see its
    first row (context keys: those the context visibility lets it see).

    Raises ValueError, naming what does not hold, for a visibility that is not a tree's: several
    intervals for a key without ``prev``, or a key set that the runs would not reproduce (checked by
    construction: every gathered key is visible to every row of its run, and the runs' pair
    count equals the visibility's).
    """
    device = torch.device(device) if device is not None else vis.offsets.device
    if not vis.causal:
        raise ValueError("tree attention backend 'varlen' needs causal (tree) visibility; use 'flex'")
    R = vis.num_queries
    off = _host(vis.offsets)
    n_ctx = 0 if context_visibility is None else context_visibility.num_keys
    if prev is not None:
        return _evicted_key_paths(vis, context_visibility, _host(prev), n_ctx, device) if R else _no_runs(n_ctx, device)
    if R and not np.array_equal(np.diff(off), np.ones(R, dtype=np.int64)):
        raise ValueError("tree attention backend 'varlen' needs one visible interval per key (a tree's "
                         "visibility) unless the rows' tree is given (prev=, a layout's with compaction "
                         "events); this one has keys with several (use backend 'flex')")
    end = _host(vis.end)
    if R == 0:
        return _no_runs(n_ctx, device)
    rows = np.arange(R, dtype=np.int64)
    # row r continues the run of r - 1 iff r - 1 sees r (then r - 1 is r's parent)
    starts = np.flatnonzero(np.concatenate([[True], end[:-1] <= rows[1:]]))
    stops = np.append(starts[1:], R)
    if context_visibility is not None:
        c_keys = _host(context_visibility.interval_keys())
        c_s, c_e = _host(context_visibility.start), _host(context_visibility.end)
    keys: List[np.ndarray] = []
    stack: List[int] = []            # runs on the path of the current run, outermost first
    for g, (a, b) in enumerate(zip(starts, stops)):
        while stack and end[starts[stack[-1]]] <= a:
            stack.pop()
        own = np.arange(a, b, dtype=np.int64) + n_ctx
        if stack:
            h = stack[-1]
            run = np.arange(starts[h], stops[h])
            # the parent: the last row of run h whose subtree holds a (ends do not increase along a run)
            p = int(run[np.searchsorted(-end[run], -a, side="left") - 1])
            parent_keys = keys[h]
            inherited = parent_keys[:parent_keys.shape[0] - (int(stops[h]) - 1 - p)]
        elif context_visibility is not None:
            hit = (c_s <= a) & (a < c_e)
            inherited = c_keys[hit]
            if inherited.size and int(c_e[hit].min()) < b:
                raise ValueError(f"context visibility is not a tree's: a context key seen by row {a} is not "
                                 f"seen by row {b - 1} of the same path")
        else:
            inherited = np.zeros(0, dtype=np.int64)
        keys.append(np.concatenate([inherited, own]))
        stack.append(g)
    q_len = (stops - starts).astype(np.int64)
    k_len = np.array([k.shape[0] for k in keys], dtype=np.int64)
    key_index = np.concatenate(keys)
    # every gathered row key is visible to its whole run ...
    run_stop = np.repeat(stops, k_len)
    row_key = key_index >= n_ctx
    if bool((end[key_index[row_key] - n_ctx] < run_stop[row_key]).any()):
        raise ValueError("visibility is not a tree's: a gathered ancestor key does not see its whole run "
                         "(use backend 'flex')")
    # ... and the runs hold exactly the visible pairs
    pairs = int((q_len * k_len - q_len * (q_len - 1) // 2).sum())
    expected = int((end - rows).sum())
    if context_visibility is not None:
        expected += int((c_e - c_s).sum())
    if pairs != expected:
        raise ValueError(f"visibility is not a tree's: its runs cover {pairs} (query, key) pairs, the "
                         f"visibility {expected} (use backend 'flex')")
    return _key_paths(q_len, k_len, key_index, R, n_ctx, pairs, device)


def gathered_key_count(vis: Visibility, context_visibility: Optional[Visibility] = None) -> int:
    """How many key rows the varlen kernels gather for ``vis`` (and its context keys), without
    building the runs: ``build_key_paths(vis, context_visibility).gathered_keys`` for a tree's
    visibility (one interval per key), since a run gathers exactly the keys its last row sees.
    Where compaction events give keys several intervals, the same count over the runs of the rows'
    tree (``build_key_paths`` with ``prev`` also breaks runs at event rows: an estimate there)."""
    R = vis.num_queries
    if R == 0:
        return 0
    first_end = _host(vis.end)[_host(vis.offsets)[:-1]]      # each row's own first interval
    rows = np.arange(R, dtype=np.int64)
    last = np.append(np.flatnonzero(first_end[:-1] <= rows[1:]), R - 1)

    def seeing(v):                                           # intervals over each last row
        lo, hi = np.sort(_host(v.start)), np.sort(_host(v.end))
        return np.searchsorted(lo, last, side="right") - np.searchsorted(hi, last, side="right")
    seen = seeing(vis)
    if context_visibility is not None:
        seen = seen + seeing(context_visibility)
    return int(seen.sum())


def _no_runs(n_ctx: int, device) -> KeyPaths:
    z = torch.zeros(1, dtype=torch.int32)
    return KeyPaths(host_to_device(z, device), host_to_device(z.clone(), device),
                    host_to_device(torch.zeros(0, dtype=torch.int64), device),
                    np.zeros(0, np.int64), np.zeros(0, np.int64), 0, n_ctx, 0)


def _key_paths(q_len, k_len, key_index, R: int, n_ctx: int, pairs: int, device) -> KeyPaths:
    q_off = np.concatenate([[0], np.cumsum(q_len)]).astype(np.int32)
    k_off = np.concatenate([[0], np.cumsum(k_len)])
    if k_off[-1] >= 2 ** 31:
        raise ValueError(f"tree attention backend 'varlen': {k_off[-1]} gathered keys exceed int32 offsets")
    return KeyPaths(host_to_device(torch.from_numpy(q_off), device),
                    host_to_device(torch.from_numpy(k_off.astype(np.int32)), device),
                    host_to_device(torch.from_numpy(key_index), device), q_len, k_len, R, n_ctx + R, pairs)


class _IntervalLookup:
    """Which of a visibility's keys see a query: the interval of key k holding q, by one binary
    search over the (key, start)-sorted intervals."""

    def __init__(self, vis: Visibility):
        self.width = vis.num_queries + 1
        self.key = _host(vis.interval_keys())
        self.start, self.end = _host(vis.start), _host(vis.end)
        self.sorted = self.key * self.width + self.start

    def end_of(self, keys: np.ndarray, q: int) -> np.ndarray:
        """Per key, the end of its interval holding query ``q``, or -1 where none holds it."""
        if self.key.size == 0:
            return np.full(keys.shape[0], -1, dtype=np.int64)
        idx = np.searchsorted(self.sorted, keys * self.width + q, side="right") - 1
        idx_c = np.maximum(idx, 0)
        hit = (idx >= 0) & (self.key[idx_c] == keys) & (self.end[idx_c] > q)
        return np.where(hit, self.end[idx_c], -1)


def _evicted_key_paths(vis: Visibility, ctx_vis: Optional[Visibility], prev: np.ndarray, n_ctx: int,
                       device) -> KeyPaths:
    """:func:`build_key_paths` for keys with several intervals, the tree given by ``prev``."""
    R = vis.num_queries
    rows = np.arange(R, dtype=np.int64)
    if prev.shape != (R,) or bool(((prev >= rows) | (prev < -1)).any()):
        raise ValueError(f"build_key_paths: prev must hold, for each of the {R} rows, an earlier row or -1")
    off, start, end = _host(vis.offsets), _host(vis.start), _host(vis.end)
    later = np.ones(start.shape[0], dtype=bool)
    later[off[:-1]] = False                                  # intervals other than a key's first
    opens = np.bincount(start[later], minlength=R + 1)[:R] > 0
    closes = np.bincount(end, minlength=R + 1)[:R] > 0
    brk = (prev != rows - 1) | opens | closes
    if ctx_vis is not None:      # a context key's visibility starts or stops: the visible set changes there
        cs, ce = _host(ctx_vis.start), _host(ctx_vis.end)
        brk |= (np.bincount(cs, minlength=R + 1)[:R] > 0) | (np.bincount(ce, minlength=R + 1)[:R] > 0)
    brk[0] = True
    starts = np.flatnonzero(brk)
    stops = np.append(starts[1:], R)
    run_of = np.repeat(np.arange(starts.shape[0], dtype=np.int64), stops - starts)
    own_vis = _IntervalLookup(vis)
    ctx_look = _IntervalLookup(ctx_vis) if ctx_vis is not None else None
    keys: List[np.ndarray] = []
    for g, (a, b) in enumerate(zip(starts.tolist(), stops.tolist())):
        p = int(prev[a])
        if p >= 0:
            h = int(run_of[p])
            cand = keys[h][:keys[h].shape[0] - (int(stops[h]) - 1 - p)]
        elif ctx_look is not None:
            cand = np.arange(n_ctx, dtype=np.int64)
        else:
            cand = np.zeros(0, dtype=np.int64)
        reach = np.empty(cand.shape[0], dtype=np.int64)
        is_ctx = cand < n_ctx
        if is_ctx.any():
            reach[is_ctx] = ctx_look.end_of(cand[is_ctx], a)
        reach[~is_ctx] = own_vis.end_of(cand[~is_ctx] - n_ctx, a)
        seen = reach > a
        if bool((reach[seen] < b).any()):
            raise ValueError(f"visibility is not a tree's: a key seen by row {a} is not seen by row {b - 1} "
                             f"of the same run (use backend 'flex')")
        keys.append(np.concatenate([cand[seen], np.arange(a, b, dtype=np.int64) + n_ctx]))
    q_len = (stops - starts).astype(np.int64)
    k_len = np.array([k.shape[0] for k in keys], dtype=np.int64)
    pairs = int((q_len * k_len - q_len * (q_len - 1) // 2).sum())
    expected = int((end - start).sum())
    if ctx_vis is not None:
        expected += int((_host(ctx_vis.end) - _host(ctx_vis.start)).sum())
    if pairs != expected:
        raise ValueError(f"visibility is not a tree's: its runs cover {pairs} (query, key) pairs, the "
                         f"visibility {expected} (use backend 'flex')")
    return _key_paths(q_len, k_len, np.concatenate(keys), R, n_ctx, pairs, device)


def sequence_key_paths(lengths, *, device=None) -> KeyPaths:
    """Independent causal sequences packed back to back (expanded mode's THD rows): one run per
    sequence over its own keys, in place (``key_index`` is the identity)."""
    device = "cpu" if device is None else device
    q_len = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if q_len.size and int(q_len.min()) < 1:
        raise ValueError("sequence_key_paths: every sequence needs at least one token")
    off = np.concatenate([[0], np.cumsum(q_len)]).astype(np.int64)
    if off[-1] >= 2 ** 31:
        raise ValueError(f"sequence_key_paths: {off[-1]} tokens exceed int32 offsets")
    cu = torch.from_numpy(off.astype(np.int32))
    n = int(off[-1])
    return KeyPaths(host_to_device(cu, device), host_to_device(cu.clone(), device),
                    host_to_device(torch.arange(n, dtype=torch.int64), device), q_len, q_len.copy(), n, n,
                    int((q_len * (q_len + 1) // 2).sum()), in_place=True)


# ---------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------

def _gathered(t: torch.Tensor, paths: KeyPaths) -> torch.Tensor:
    """The rows of ``t`` (keys or values over the key axis) in the runs' order: ``t`` itself where
    the paths read the keys in place."""
    return t if paths.in_place else t.index_select(0, paths.key_index)


def _reference(q, k_all, v_all, paths: KeyPaths, scale: float):
    """Per run: gathered keys, bottom-right causal mask, explicit softmax."""
    group = q.shape[1] // k_all.shape[1]
    kg = _gathered(k_all, paths).repeat_interleave(group, dim=1)
    vg = _gathered(v_all, paths).repeat_interleave(group, dim=1)
    outs, q0, k0 = [], 0, 0
    for lq, lk in zip(paths.q_lengths.tolist(), paths.k_lengths.tolist()):
        s = torch.einsum("qhd,khd->hqk", q[q0:q0 + lq], kg[k0:k0 + lk]) * scale
        i = torch.arange(lq, device=q.device)[:, None]
        j = torch.arange(lk, device=q.device)[None]
        s = s.masked_fill(j > i + (lk - lq), float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vg[k0:k0 + lk]))
        q0, k0 = q0 + lq, k0 + lk
    return torch.cat(outs) if outs else q.new_zeros(q.shape[:2] + v_all.shape[2:])


#: the flash kernels' head dims: one for q, k and v, a multiple of 8, at most 256
FLASH_MAX_HEAD_DIM = 256


def _flash_head_dim(D: int, Dv: int) -> int:
    return -(-max(D, Dv) // 8) * 8


def _pad_to(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))


#: bytes of gathered gradients ``_sum_back`` widens to fp32 at a time
SUM_BACK_BYTES = 1 << 30


def _sum_back(k_all, v_all, paths: KeyPaths, dkg, dvg):
    """Gradients of the gathered keys/values summed onto ``k_all``/``v_all``'s rows in fp32 (a key
    gathered for several runs gets their sum), in their dtypes.  The gathered gradients are widened
    in chunks of at most ``SUM_BACK_BYTES`` fp32 bytes (one chunk for all but long paths: few
    launches), so the fp32 transient beside the sums is bounded, not all gathered rows' (every row
    gets the same fp32 terms); keys are summed and narrowed before values.  Keys read in place
    (``paths.in_place``) have one gradient each: it is their sum, as it comes (the fp32 round trip of
    the sum would give it back bit for bit)."""
    if paths.in_place:
        return dkg.to(k_all.dtype).contiguous(), dvg.to(v_all.dtype).contiguous()
    summed = []
    for t, g in ((k_all, dkg), (v_all, dvg)):
        acc = torch.zeros(t.shape, dtype=torch.float32, device=t.device)
        step = max(1, SUM_BACK_BYTES // (4 * max(1, g[0].numel()))) if g.shape[0] else 1
        for a in range(0, g.shape[0], step):
            acc.index_add_(0, paths.key_index[a:a + step], g[a:a + step].float())
        summed.append(acc.to(t.dtype))
        del acc
    return summed[0], summed[1]


class _FlashPaths(torch.autograd.Function):
    """Varlen flash attention over the gathered paths.  Gathered keys/values live only inside
    the forward and the backward (re-gathered); their gradients are summed back in fp32.  Head
    dims are zero-padded to the kernel's (``_flash_head_dim``): zero q/k columns add nothing to
    the scores (the scale is explicit), zero v columns are cut from the output."""

    @staticmethod
    def forward(ctx, q, k_all, v_all, paths: KeyPaths, scale: float):
        D, Dv = q.shape[-1], v_all.shape[-1]
        W = _flash_head_dim(D, Dv)
        kg = _pad_to(_gathered(k_all, paths), W)
        vg = _pad_to(_gathered(v_all, paths), W)
        qp = _pad_to(q, W)
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            qp, kg, vg, paths.q_offsets, paths.k_offsets, paths.max_q, paths.max_k, 0.0, True, False,
            scale=scale)
        ctx.save_for_backward(qp, k_all, v_all, out, lse, rng, unused)
        ctx.paths, ctx.scale, ctx.D = paths, scale, D
        return out[..., :Dv] if Dv < W else out

    @staticmethod
    def backward(ctx, grad):
        qp, k_all, v_all, out, lse, rng, unused = ctx.saved_tensors
        paths, D = ctx.paths, ctx.D
        Dv, W = v_all.shape[-1], qp.shape[-1]
        kg = _pad_to(_gathered(k_all, paths), W)
        vg = _pad_to(_gathered(v_all, paths), W)
        dq, dkg, dvg = torch.ops.aten._flash_attention_backward(
            _pad_to(grad, W).contiguous(), qp, kg, vg, out, lse, paths.q_offsets, paths.k_offsets,
            paths.max_q, paths.max_k, 0.0, True, rng, unused, scale=ctx.scale)
        del kg, vg                                # not alive beside the fp32 sums
        dk, dv = _sum_back(k_all, v_all, paths, dkg[..., :D], dvg[..., :Dv])
        return dq[..., :D], dk, dv, None, None


#: the flash-attn-4 release whose private forward/backward entry points ``_Fa4Paths`` calls
FA4_VERSION = "4.0.0b36"
#: fa4's head-dim range on Hopper: q/k and v each in [8, 256], a multiple of 8 (16-byte rows in bf16),
#: and v no wider than q/k (4.0.0b36's Hopper backward at q/k 64, v 128 asks for more shared memory
#: than the chip has: 248,832 of 232,448 bytes, measured on an H200)
FA4_MAX_HEAD_DIM = 256

_FA4 = None          # (forward, backward) once imported; False where flash-attn-4 is missing or another release


def _fa4_entry_points():
    """flash-attn-4's varlen forward and backward, or None where the pinned release is not installed.
    An installed flash-attn-4 that cannot be used (another release, or one that does not import)
    is reported once, as a warning naming the reason, since the kernels then fall back silently."""
    global _FA4
    if _FA4 is None:
        _FA4 = False
        from importlib.metadata import PackageNotFoundError, version
        try:
            installed = version("flash-attn-4")
        except PackageNotFoundError:
            return None
        if installed != FA4_VERSION:
            warnings.warn(f"flash-attn-4 {installed} is installed; megatron_harts calls {FA4_VERSION}'s entry "
                          f"points, so tree attention uses torch's kernels (pip install flash-attn-4=={FA4_VERSION})")
            return None
        try:
            from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
            _FA4 = (_flash_attn_fwd, _flash_attn_bwd)
        except Exception as err:   # its CuTe DSL does not load here (e.g. nvidia-cutlass-dsl not on the path)
            warnings.warn(f"flash-attn-4 {installed} is installed but does not import ({type(err).__name__}: "
                          f"{err}); tree attention uses torch's kernels")
    return _FA4 or None


def fa4_available(device, dims=None) -> bool:
    """Whether ``kernel="fa4"`` runs on ``device``: CUDA of compute capability 9.x (Hopper), the
    pinned flash-attn-4 installed, and ``dims = (q/k head dim, v head dim)`` (when given) in its
    range (``FA4_MAX_HEAD_DIM``)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device)[0] != 9:
        return False
    if dims is not None and not (all(8 <= d <= FA4_MAX_HEAD_DIM and d % 8 == 0 for d in dims)
                                 and dims[-1] <= dims[0]):
        return False
    return _fa4_entry_points() is not None


def default_kernel(q: torch.Tensor, v_head_dim: int) -> str:
    """The kernel :func:`path_attention` should take for these tensors: fa4 where it runs, else
    torch's flash kernels (CUDA, fp16/bf16), else the reference."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return "reference"
    return "fa4" if fa4_available(q.device, (q.shape[-1], v_head_dim)) else "flash"


def _fa4_gather(q, k_all, v_all, paths: KeyPaths):
    """The run-ordered keys and values fa4 reads.  fa4's Hopper backward takes grouped key/value
    heads (GQA) only with equal q/k and v head dims, so with unequal dims each key/value head is
    repeated for its query heads (query head ``h`` reads key/value head ``h // (H / Hk)``, the
    grouping of the other kernels)."""
    kg, vg = _gathered(k_all, paths), _gathered(v_all, paths)
    group = q.shape[1] // k_all.shape[1]
    if group > 1 and q.shape[-1] != v_all.shape[-1]:
        kg = kg.repeat_interleave(group, dim=1)
        vg = vg.repeat_interleave(group, dim=1)
    return kg, vg


class _Fa4Paths(torch.autograd.Function):
    """flash-attn-4's varlen causal kernels (bottom-right aligned) over the gathered paths, any
    q/k and v head dims in its range (no padding).  As ``_FlashPaths``: gathered keys/values live
    only inside the forward and the backward, their gradients are summed back in fp32."""

    @staticmethod
    def forward(ctx, q, k_all, v_all, paths: KeyPaths, scale: float):
        fwd, _ = _fa4_entry_points()
        kg, vg = _fa4_gather(q, k_all, v_all, paths)
        out, lse = fwd(q, kg, vg, cu_seqlens_q=paths.q_offsets, cu_seqlens_k=paths.k_offsets,
                       max_seqlen_q=paths.max_q, max_seqlen_k=paths.max_k, softmax_scale=scale, causal=True,
                       return_lse=True)[:2]
        ctx.save_for_backward(q, k_all, v_all, out, lse)
        ctx.paths, ctx.scale = paths, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k_all, v_all, out, lse = ctx.saved_tensors
        paths = ctx.paths
        _, bwd = _fa4_entry_points()
        kg, vg = _fa4_gather(q, k_all, v_all, paths)
        dq, dkg, dvg = bwd(q, kg, vg, out, grad.contiguous(), lse, ctx.scale, True, 0.0,
                           cu_seqlens_q=paths.q_offsets, cu_seqlens_k=paths.k_offsets,
                           max_seqlen_q=paths.max_q, max_seqlen_k=paths.max_k)[:3]
        del kg, vg                                # not alive beside the fp32 sums
        if dkg.shape[1] != k_all.shape[1]:        # heads repeated by _fa4_gather: sum each group back
            dkg = dkg.float().unflatten(1, (k_all.shape[1], -1)).sum(2)
            dvg = dvg.float().unflatten(1, (v_all.shape[1], -1)).sum(2)
        dk, dv = _sum_back(k_all, v_all, paths, dkg, dvg)
        return dq, dk, dv, None, None


def path_attention(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, paths: KeyPaths,
                   scale: float, kernel: str = "flash") -> torch.Tensor:
    """Attention of every query row over its run's keys (:class:`KeyPaths` invariant).

    q ``[R, H, D]``, k_all ``[K, Hk, D]``, v_all ``[K, Hk, Dv]`` over the key axis of ``paths``
    (context keys first).  Differentiable in q, k_all and v_all.
    """
    if kernel not in KERNELS:
        raise ValueError(f"path_attention kernel must be one of {KERNELS}, got {kernel!r}")
    if q.shape[0] != paths.num_queries or k_all.shape[0] != paths.num_keys:
        raise ValueError(f"key paths are for {paths.num_queries} queries over {paths.num_keys} keys, got "
                         f"{q.shape[0]} queries and {k_all.shape[0]} keys")
    if kernel == "reference":
        return _reference(q, k_all, v_all, paths, scale)
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"path_attention kernel {kernel!r} needs CUDA fp16/bf16 tensors (use 'reference')")
    if kernel == "fa4":
        if not fa4_available(q.device, (q.shape[-1], v_all.shape[-1])):
            raise ValueError(f"path_attention kernel 'fa4' needs flash-attn-4=={FA4_VERSION} on a Hopper GPU and "
                             f"head dims in [8, {FA4_MAX_HEAD_DIM}], multiples of 8, v's at most q/k's "
                             f"(got {q.shape[-1]}/{v_all.shape[-1]}); use 'flash'")
        if paths.num_runs == 0:
            return q.new_zeros(q.shape[:2] + v_all.shape[2:])
        return _Fa4Paths.apply(q.contiguous(), k_all.contiguous(), v_all.contiguous(), paths, scale)
    if _flash_head_dim(q.shape[-1], v_all.shape[-1]) > FLASH_MAX_HEAD_DIM:
        raise ValueError(f"tree attention backend 'varlen': head dims {q.shape[-1]}/{v_all.shape[-1]} exceed the "
                         f"flash kernels' {FLASH_MAX_HEAD_DIM} (use backend 'flex')")
    if paths.num_runs == 0:
        return q.new_zeros(q.shape[:2] + v_all.shape[2:])
    return _FlashPaths.apply(q.contiguous(), k_all.contiguous(), v_all.contiguous(), paths, scale)
