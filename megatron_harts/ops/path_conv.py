"""Path convolution: KDA's causal depthwise short convolution over compact rows.

Kimi-Linear's (transformers ``kimi_linear``) short convolution of a sequence ``x [L, C]`` with
weight ``[C, K]`` (``nn.Conv1d(C, C, K, groups=C, padding=K-1)`` with the output cut to the
first L steps) and optional bias is

    y[t, c] = act( bias[c] + sum_{j=0}^{K-1} weight[c, K-1-j] * x[t-j, c] ),   x[t<0] = 0,

so ``weight[:, K-1]`` multiplies the current token and ``weight[:, K-1-j]`` the token j steps
back; ``act`` is SiLU (``hidden_act``) or none.

In compact layout "j steps back" means j steps up the path: ``prev`` applied j times, never
"the row above".  A subtree whose ancestors live in a producer microbatch reads them as
context rows: ``prev_external[r]`` (index into the context rows, where ``prev[r] == -1``) and
``context_prev`` (the context rows' own path links).

Invariant: for every row r and every trajectory through r, the output equals the
trajectory's own causal convolution at r's position (tests check forward and backward).

Two backends, one interface.  ``reference`` walks ``prev`` tap by tap.  ``conv`` (the fast
path) uses that in DFS preorder almost every row's path runs straight up the row order: row r
reads rows r-1 .. r-K+1.  It runs one ordinary causal depthwise conv over the row order
(:func:`row_order_conv`: fla's Triton kernel on the GPU, torch's conv1d elsewhere; expanded mode
runs the same on its packed sequences) and recomputes by gather only the few rows
whose taps leave that straight line (:class:`ConvTaps` ``fix_rows``: the first K-1 rows of a
segment that does not continue the row above, rows reading context rows).
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ..layout import CompactLayout

__all__ = ["path_conv", "row_order_conv", "build_conv_taps", "sequence_conv_taps", "ConvTaps", "ACTIVATIONS",
           "BACKENDS"]

ACTIVATIONS = ("silu", None)
BACKENDS = ("conv", "reference")


def _check_index(t, name: str, n: int, lo: int, hi: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int64:
        raise ValueError(f"{name} must be a 1-D int64 tensor")
    if t.shape[0] != n:
        raise ValueError(f"{name} has {t.shape[0]} entries, expected {n}")
    if t.numel() and (int(t.min()) < lo or int(t.max()) >= hi):
        raise ValueError(f"{name} must hold indices in [{lo}, {hi})")
    return t


def _links(prev: torch.Tensor, prev_external: Optional[torch.Tensor], context_prev: Optional[torch.Tensor]
           ) -> torch.Tensor:
    """Previous-row links over the joint index space ``[rows; context rows; pad]``.

    Entry i is the joint index of the row before i on its path; the pad index ``R + Rc``
    stands for "before the start of the sequence" and links to itself.
    """
    R = prev.shape[0]
    Rc = 0 if context_prev is None else context_prev.shape[0]
    pad = R + Rc
    local = torch.where(prev >= 0, prev, torch.full_like(prev, pad))
    if prev_external is not None:
        local = torch.where((prev < 0) & (prev_external >= 0), R + prev_external, local)
    parts = [local]
    if context_prev is not None:
        parts.append(torch.where(context_prev >= 0, R + context_prev, torch.full_like(context_prev, pad)))
    parts.append(torch.full((1,), pad, dtype=torch.int64, device=prev.device))
    return torch.cat(parts)


@dataclass(frozen=True)
class ConvTaps:
    """Where every row's conv taps read; built once per layout, read by every layer.

    ``taps [R, K-1]``: column j-1 is the joint index (rows, then ``num_context_rows`` context
    rows, then one zero pad row at ``R + Rc``) of the row j steps up the row's path.
    ``fix_rows [F]`` (sorted): exactly the rows r for which some column differs from the straight
    line of the row order (row r - j, or the pad row where r - j < 0); a causal conv over the
    row order is right for every other row.
    """
    taps: torch.Tensor
    fix_rows: torch.Tensor
    num_context_rows: int

    @property
    def num_rows(self) -> int:
        return int(self.taps.shape[0])

    @property
    def kernel_size(self) -> int:
        return int(self.taps.shape[1]) + 1

    def to(self, device) -> "ConvTaps":
        """The same taps on ``device`` (CPU tensors reach a GPU without stalling the host)."""
        from ..layout import host_to_device_many
        return ConvTaps(*host_to_device_many([self.taps, self.fix_rows], device), self.num_context_rows)

    def context_rows_read(self) -> torch.Tensor:
        """The context rows some tap reads (sorted, unique; CPU long)."""
        taps = self.taps.cpu()
        R = self.num_rows
        return torch.unique(taps[(taps >= R) & (taps < R + self.num_context_rows)] - R)

    def reading_table(self, position: torch.Tensor, table_rows: int) -> "ConvTaps":
        """These taps with their context rows read from a table of ``table_rows`` rows instead:
        context row c is row ``position[c]`` of the table (``position[c] = -1``: a row no tap
        reaches).  ``path_conv(x, w, b, None, taps=t.reading_table(p, n), context=table)``
        equals ``path_conv(x, w, b, layout, taps=t, context=ctx)`` wherever ``ctx[c] =
        table[p[c]]`` for the reached rows, bitwise; a consumer's conv so reads its producer's
        exported rows without assembling all its context rows.  Host-side (it checks the values)."""
        position = torch.as_tensor(position, dtype=torch.int64).cpu()
        R, Rc = self.num_rows, self.num_context_rows
        if position.shape != (Rc,):
            raise ValueError(f"reading_table: position needs one entry per context row ({Rc}), got "
                             f"{tuple(position.shape)}")
        if not isinstance(table_rows, int) or table_rows < 0:
            raise ValueError(f"reading_table: table_rows must be a non-negative integer, got {table_rows!r}")
        if position.numel() and (int(position.min()) < -1 or int(position.max()) >= table_rows):
            raise ValueError(f"reading_table: positions must lie in [-1, {table_rows})")
        taps = self.taps.cpu()
        in_ctx = (taps >= R) & (taps < R + Rc)
        moved = position[(taps[in_ctx] - R)]
        if bool((moved < 0).any()):
            raise ValueError("reading_table: a tap reaches a context row whose position is -1")
        out = torch.where(taps >= R + Rc, torch.full_like(taps, R + table_rows), taps)   # the zero pad row
        out[in_ctx] = R + moved
        return ConvTaps(out, self.fix_rows.cpu(), int(table_rows))


def _fix_rows(taps: torch.Tensor, pad: int) -> torch.Tensor:
    R, J = taps.shape
    back = torch.arange(R, device=taps.device)[:, None] - torch.arange(1, J + 1, device=taps.device)[None]
    straight = torch.where(back >= 0, back, torch.full_like(back, pad))
    return torch.nonzero((taps != straight).any(dim=1)).flatten()


def build_conv_taps(layout_or_prev, kernel_size: int = 4, *, prev_external: Optional[torch.Tensor] = None,
                    context_prev: Optional[torch.Tensor] = None) -> ConvTaps:
    """The :class:`ConvTaps` of a layout (or of ``prev`` with optional context links).

    Build it once per layout (on the host: it reads values to check them) and pass it to every
    layer's :func:`path_conv`.  From a CompactLayout the context links are taken from it.
    """
    if isinstance(layout_or_prev, CompactLayout):
        lay = layout_or_prev
        prev = lay.prev
        if prev_external is None and lay.num_context_rows:
            prev_external = lay.prev_external
        if context_prev is None and lay.num_context_rows:
            context_prev = lay.ctx_prev
    else:
        prev = layout_or_prev
    if not isinstance(kernel_size, int) or kernel_size < 1:
        raise ValueError(f"kernel_size must be a positive integer, got {kernel_size!r}")
    if not isinstance(prev, torch.Tensor) or prev.dim() != 1:
        raise ValueError("prev must be a 1-D int64 tensor")
    R = prev.shape[0]
    _check_index(prev, "prev", R, -1, max(R, 1))
    if bool((prev >= torch.arange(R, device=prev.device)).any()):
        raise ValueError("prev must point to an earlier row (prev[r] < r) or be -1")
    Rc = 0
    if context_prev is not None:
        Rc = context_prev.shape[0]
        _check_index(context_prev, "context_prev", Rc, -1, Rc)
        if bool((context_prev >= torch.arange(Rc, device=prev.device)).any()):
            raise ValueError("context_prev must point to an earlier context row or be -1")
    if prev_external is not None:
        if context_prev is None:
            raise ValueError("prev_external needs context_prev (the context rows' own path links)")
        _check_index(prev_external, "prev_external", R, -1, Rc)
    link = _links(prev, prev_external, context_prev)
    cols = []
    cur = torch.arange(R, device=prev.device)
    for _ in range(kernel_size - 1):
        cur = link[cur]
        cols.append(cur)
    taps = torch.stack(cols, dim=1) if cols else torch.zeros(R, 0, dtype=torch.int64, device=prev.device)
    return ConvTaps(taps, _fix_rows(taps, R + Rc), Rc)


@functools.lru_cache(maxsize=None)
def _fla_causal_conv1d():
    """fla-core's Triton causal depthwise conv (row-major ``[B, T, C]``, its own backward), or None (with one
    warning: it is looked up for CUDA tensors only, once per process)."""
    try:
        from fla.modules.causal_conv1d.ops import causal_conv1d
    except ImportError:  # said once here (cached): CUDA rows then take torch's conv1d
        warnings.warn("fla-core is not installed: the short convolution on CUDA runs torch's conv1d (rows "
                      "transposed and back) instead of fla's Triton kernel", RuntimeWarning, stacklevel=3)
        return None
    return causal_conv1d


def row_order_conv(x: torch.Tensor, weight: torch.Tensor, kernel: str = "auto") -> torch.Tensor:
    """``y[r] = sum_j weight[:, K-1-j] * x[r-j]`` down the row order of ``x [R, C]``, zeros before row 0.

    Two kernels, the same sums: ``"fla"``, fla-core's Triton causal conv, reads the rows in place
    (CUDA only); ``"torch"``, torch's depthwise ``conv1d``, needs the rows transposed to channels
    first and back.  ``"auto"`` takes fla on a CUDA tensor where fla-core is installed, else torch.
    """
    if kernel not in ("auto", "fla", "torch"):
        raise ValueError(f"kernel must be 'auto', 'fla' or 'torch', got {kernel!r}")
    fla_conv = _fla_causal_conv1d() if kernel != "torch" and x.is_cuda else None
    if kernel == "fla" and fla_conv is None:
        raise ValueError("row_order_conv kernel 'fla' needs a CUDA tensor and fla-core installed")
    if fla_conv is not None:
        y, _ = fla_conv(x.unsqueeze(0), weight, activation=None)
        return y[0]
    K = weight.shape[1]
    return F.conv1d(F.pad(x.T.unsqueeze(0), (K - 1, 0)), weight.unsqueeze(1), groups=x.shape[1])[0].T.contiguous()


def _activate(y, activation):
    return F.silu(y) if activation == "silu" else y


def sequence_conv_taps(lengths, kernel_size: int = 4) -> ConvTaps:
    """The :class:`ConvTaps` of independent sequences packed back to back (expanded mode):
    each sequence's path is its own rows, so only the first K-1 rows of every sequence after
    the first are off the straight line (they must not read the sequence before)."""
    lens = torch.as_tensor([int(n) for n in lengths], dtype=torch.int64)
    if lens.numel() == 0 or bool((lens < 1).any()):
        raise ValueError("sequence_conv_taps: every sequence needs at least one row")
    prev = torch.arange(int(lens.sum()), dtype=torch.int64) - 1
    prev[lens.cumsum(0)[:-1]] = -1
    prev[0] = -1
    return build_conv_taps(prev, kernel_size)


def path_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], layout_or_prev, *,
              activation: Optional[str] = "silu", context: Optional[torch.Tensor] = None,
              prev_external: Optional[torch.Tensor] = None, context_prev: Optional[torch.Tensor] = None,
              taps: Optional[ConvTaps] = None, backend: str = "conv") -> torch.Tensor:
    """Causal depthwise conv along each row's path: x ``[R, C]``, weight ``[C, K]``, bias ``[C]``.

    ``layout_or_prev``: a CompactLayout, the ``prev`` tensor, or None when ``taps`` describe
    the rows alone (the ``conv`` backend; ``context`` is then the table of
    ``taps.num_context_rows`` rows the taps read, e.g. from :meth:`ConvTaps.reading_table`).
    ``context [Rc, C]``: inputs of the context rows (needed when some row's path continues into
    them; a CompactLayout supplies ``prev_external``/``context_prev``).  ``backend="conv"`` (default, module
    docstring) reads ``taps`` (:func:`build_conv_taps`, built here when omitted);
    ``"reference"`` walks ``prev`` tap by tap.  Returns ``[R, C]``, differentiable in x,
    weight, bias and context.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError("x must be a [rows, channels] tensor")
    R, C = x.shape
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"weight must be [channels={C}, kernel_size], got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    K = weight.shape[1]
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (C,)):
        raise ValueError(f"bias must be [{C}] or None")
    if layout_or_prev is None:
        if not isinstance(taps, ConvTaps) or backend != "conv":
            raise ValueError("path_conv without a layout or prev needs taps (ConvTaps) and the conv backend")
        if (context is None) != (taps.num_context_rows == 0):
            raise ValueError(f"path_conv without a layout: the taps read {taps.num_context_rows} context rows, so "
                             f"context must be {'given' if taps.num_context_rows else 'None'}")
        prev = None
    elif isinstance(layout_or_prev, CompactLayout):
        lay = layout_or_prev
        prev = lay.prev
        if lay.num_context_rows:
            prev_external = lay.prev_external if prev_external is None else prev_external
            context_prev = lay.ctx_prev if context_prev is None else context_prev
    else:
        prev = layout_or_prev
    if prev is not None and (not isinstance(prev, torch.Tensor) or prev.dim() != 1 or prev.shape[0] != R):
        raise ValueError(f"prev must be a 1-D tensor with one entry per row of x ({R})")
    Rc = 0 if context_prev is None else context_prev.shape[0]
    if layout_or_prev is None:
        Rc = taps.num_context_rows           # the taps' own context table
    if context is not None:
        if not isinstance(context, torch.Tensor) or context.dim() != 2 or context.shape[1] != C:
            raise ValueError(f"context must be a [context rows, {C}] tensor")
        if context.shape[0] != Rc:
            raise ValueError(f"context has {context.shape[0]} rows but "
                             f"{'the taps read' if layout_or_prev is None else 'context_prev has'} {Rc}")
    elif prev_external is not None and bool((prev_external >= 0).any()):
        raise ValueError("context: some rows continue into context rows (prev_external), "
                         "so their inputs must be given")
    if backend == "reference":
        return _reference(x, weight, bias, prev, prev_external, context_prev, context, activation)
    if taps is None:
        taps = build_conv_taps(prev, K, prev_external=prev_external, context_prev=context_prev)
    elif not isinstance(taps, ConvTaps) or taps.num_rows != R or taps.kernel_size != K \
            or taps.num_context_rows != Rc:
        raise ValueError(f"taps must be the ConvTaps of build_conv_taps for these {R} rows, {Rc} context rows "
                         f"and kernel size {K}")
    # every row as if its path ran straight up the row order (zeros before row 0) ...
    y = row_order_conv(x, weight)
    if taps.fix_rows.numel():
        # ... then the rows whose path does not, from the rows their taps name
        fix = taps.fix_rows
        joint = torch.cat([x] + ([context] if context is not None else
                                 [x.new_zeros(Rc, C)] if Rc else []) + [x.new_zeros(1, C)])
        past = joint.index_select(0, taps.taps.index_select(0, fix).flatten()).view(-1, K - 1, C)
        # column j-1 of taps is j steps back, multiplied by weight[:, K-1-j]
        y_fix = x.index_select(0, fix) * weight[:, K - 1] + (past * weight[:, :K - 1].flip(1).T).sum(1)
        y = y.index_copy(0, fix, y_fix)
    if bias is not None:
        y = y + bias
    return _activate(y, activation)


def _reference(x, weight, bias, prev, prev_external, context_prev, context, activation):
    """Tap by tap: follow ``prev`` one step per tap, reading zero before the start of a path."""
    R, C = x.shape
    K = weight.shape[1]
    y = x * weight[:, K - 1]
    cur_local = torch.arange(R, device=x.device)              # index into x, or -1
    cur_ctx = torch.full((R,), -1, dtype=torch.int64, device=x.device)  # index into context, or -1
    for j in range(1, K):
        # one step up: local rows go to prev (or into the context), context rows to context_prev
        in_local = cur_local >= 0
        nxt_local = torch.where(in_local, prev[cur_local.clamp(min=0)], torch.full_like(cur_local, -1))
        nxt_ctx = torch.full_like(cur_ctx, -1)
        if prev_external is not None:
            enter = in_local & (nxt_local < 0)
            nxt_ctx = torch.where(enter, prev_external[cur_local.clamp(min=0)], nxt_ctx)
        if context_prev is not None:
            in_ctx = cur_ctx >= 0
            nxt_ctx = torch.where(in_ctx, context_prev[cur_ctx.clamp(min=0)], nxt_ctx)
        cur_local, cur_ctx = nxt_local, nxt_ctx
        xj = torch.where((cur_local >= 0)[:, None], x[cur_local.clamp(min=0)], torch.zeros_like(x))
        if context is not None and context.shape[0]:
            xj = torch.where((cur_ctx >= 0)[:, None], context[cur_ctx.clamp(min=0)], xj)
        y = y + xj * weight[:, K - 1 - j]
    if bias is not None:
        y = y + bias
    return _activate(y, activation)
