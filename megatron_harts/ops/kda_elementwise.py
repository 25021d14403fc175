"""The KDA layer's elementwise chains, each as one fused Triton kernel forward and one backward.

Three chains of the KDA layer (``models/kda.py``, ``models/cores.py``) run, as eager torch, as a
string of elementwise kernels each reading and writing every element of a ``[rows, heads x dim]``
tensor, forward, in the recomputed forward and backward:

- the forget gate ``g = -exp(A_log[h]) * softplus(f + dt_bias)`` (softplus threshold 20);
- q and k after the short convolution: ``y = silu(x) / sqrt(|silu(x)|^2 + 1e-6)`` per head;
- the gated output norm ``y = rms_norm(o) * w * sigmoid(gate)`` per head (eps the layer's).

Each has a plain torch reference here (``*_reference``: what the eager layer computes) and a fused
form (``kda_gate``, ``silu_l2norm``, ``gated_rms_norm``): an autograd Function whose forward is one
Triton kernel and whose backward is one Triton kernel (parameter gradients as per-block partial
sums, reduced by one torch sum).  The fused forms compute in fp32 and round once to the input's
dtype, where the eager chains round after every op; they agree with the references to the
rounding of that dtype (tests/test_kda_elementwise.py, on the GPU and under Triton's interpreter).
Row by row they compute the same function in either mode, so tree and expanded rows of one token
agree as before.

Who uses which is decided once, by the model's config (``HybridConfig.fused_kernels``, on by default
on the GPU: ``--no-tree-fused-kernels`` turns it off) and the tensors (:func:`fusable`: CUDA, 16- or
32-bit floats); fp64 and CPU tensors run the references.  Importing this module never fails
without Triton; calling a fused form without it raises.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # Triton is optional: CPU machines have none, and only the fused forms need it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

__all__ = ["kda_gate_reference", "silu_l2norm_reference", "gated_rms_norm_reference", "kda_gate", "silu_l2norm",
           "gated_rms_norm", "fusable", "triton_available", "SOFTPLUS_THRESHOLD", "L2NORM_EPS"]

#: torch's softplus threshold as the KDA layer calls it: above it softplus(u) = u
SOFTPLUS_THRESHOLD = 20.0
#: fla's / Kimi-Linear's L2-norm epsilon for q and k
L2NORM_EPS = 1e-6
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: elements a program holds per tensor (rows x columns of its tile)
_TILE = 4096


def triton_available() -> bool:
    return triton is not None


def fusable(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernels can take these tensors: Triton installed, CUDA tensors, and 16- or 32-bit
    floats (fp64 keeps the references: the exactness tests run there)."""
    return triton is not None and all(t.is_cuda and t.dtype in _DTYPES for t in tensors)


# ---------------------------------------------------------------- references (plain torch)

def kda_gate_reference(f: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor, heads: int) -> torch.Tensor:
    """``-exp(A_log[h]) * softplus(f + dt_bias)``: ``f`` [R, H*D] (before the bias), ``dt_bias`` [H*D],
    ``A_log`` H values; returns [R, H, D] in f's dtype, rounding after each op as the eager layer does."""
    u = (f + dt_bias).view(f.shape[0], heads, -1)
    return -A_log.reshape(1, heads, 1).exp() * F.softplus(u, threshold=SOFTPLUS_THRESHOLD)


def silu_l2norm_reference(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``silu(x)`` L2-normalized over the last dimension (``a / sqrt(sum(a^2) + eps)``), in x's dtype."""
    a = F.silu(x)
    return a / torch.sqrt((a * a).sum(-1, keepdim=True) + eps)


def gated_rms_norm_reference(o: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm(o) * weight * sigmoid(gate)`` over the last dimension: the statistics in >= fp32 and the
    normalized values rounded to o's dtype before the weight multiplies them (``models.norm``)."""
    os_ = o.to(torch.float64 if o.dtype == torch.float64 else torch.float32)
    n = (os_ * torch.rsqrt(os_.pow(2).mean(-1, keepdim=True) + eps)).to(o.dtype)
    return n * weight * torch.sigmoid(gate)


# ---------------------------------------------------------------- kernels

if triton is not None:

    @triton.jit
    def _gate_fwd(F_ptr, B_ptr, A_ptr, G_ptr, R, C, D: tl.constexpr, THRESH: tl.constexpr,
                  BR: tl.constexpr, BC: tl.constexpr):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        cm = cols < C
        m = (rows < R)[:, None] & cm[None, :]
        off = rows.to(tl.int64)[:, None] * C + cols[None, :]
        u = tl.load(F_ptr + off, mask=m, other=0.0).to(tl.float32) \
            + tl.load(B_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        a = tl.exp(tl.load(A_ptr + cols // D, mask=cm, other=0.0).to(tl.float32))
        sp = tl.where(u > THRESH, u, tl.maximum(u, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(u))))
        tl.store(G_ptr + off, (-a[None, :] * sp).to(G_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _gate_bwd(F_ptr, B_ptr, A_ptr, DG_ptr, DF_ptr, PB_ptr, PA_ptr, R, C, D: tl.constexpr,
                  THRESH: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BR + tl.arange(0, BR)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        cm = cols < C
        m = (rows < R)[:, None] & cm[None, :]
        off = rows.to(tl.int64)[:, None] * C + cols[None, :]
        u = tl.load(F_ptr + off, mask=m, other=0.0).to(tl.float32) \
            + tl.load(B_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        a = tl.exp(tl.load(A_ptr + cols // D, mask=cm, other=0.0).to(tl.float32))[None, :]
        dg = tl.load(DG_ptr + off, mask=m, other=0.0).to(tl.float32)
        sp = tl.where(u > THRESH, u, tl.maximum(u, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(u))))
        slope = tl.where(u > THRESH, 1.0, tl.sigmoid(u))
        df = -a * dg * slope
        tl.store(DF_ptr + off, df.to(DF_ptr.dtype.element_ty), mask=m)
        # d bias: the sum of df over rows; d A_log: the sum of dg * g (g = -a * sp) over rows (and dims)
        tl.store(PB_ptr + pid * C + cols, tl.sum(df, axis=0), mask=cm)
        tl.store(PA_ptr + pid * C + cols, tl.sum(-a * sp * dg, axis=0), mask=cm)

    @triton.jit
    def _silu_l2_fwd(X_ptr, Y_ptr, N, D: tl.constexpr, EPS: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        cols = tl.arange(0, BD)
        m = (rows < N)[:, None] & (cols < D)[None, :]
        off = rows.to(tl.int64)[:, None] * D + cols[None, :]
        x = tl.load(X_ptr + off, mask=m, other=0.0).to(tl.float32)
        a = x * tl.sigmoid(x)
        rinv = 1.0 / tl.sqrt(tl.sum(a * a, axis=1) + EPS)
        tl.store(Y_ptr + off, (a * rinv[:, None]).to(Y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _silu_l2_bwd(X_ptr, DY_ptr, DX_ptr, N, D: tl.constexpr, EPS: tl.constexpr, BN: tl.constexpr,
                     BD: tl.constexpr):
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        cols = tl.arange(0, BD)
        m = (rows < N)[:, None] & (cols < D)[None, :]
        off = rows.to(tl.int64)[:, None] * D + cols[None, :]
        x = tl.load(X_ptr + off, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(DY_ptr + off, mask=m, other=0.0).to(tl.float32)
        s = tl.sigmoid(x)
        a = x * s
        rinv = 1.0 / tl.sqrt(tl.sum(a * a, axis=1) + EPS)
        y = a * rinv[:, None]
        da = (dy - y * tl.sum(dy * y, axis=1)[:, None]) * rinv[:, None]
        dx = da * s * (1.0 + x * (1.0 - s))
        tl.store(DX_ptr + off, dx.to(DX_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _norm_gate_fwd(O_ptr, W_ptr, G_ptr, Y_ptr, N, D: tl.constexpr, EPS: tl.constexpr, BN: tl.constexpr,
                       BD: tl.constexpr):
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        cols = tl.arange(0, BD)
        m = (rows < N)[:, None] & (cols < D)[None, :]
        off = rows.to(tl.int64)[:, None] * D + cols[None, :]
        o = tl.load(O_ptr + off, mask=m, other=0.0).to(tl.float32)
        w = tl.load(W_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        gate = tl.load(G_ptr + off, mask=m, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(o * o, axis=1) / D + EPS)
        y = o * r[:, None] * w[None, :] * tl.sigmoid(gate)
        tl.store(Y_ptr + off, y.to(Y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _norm_gate_bwd(O_ptr, W_ptr, G_ptr, DY_ptr, DO_ptr, DG_ptr, PW_ptr, N, D: tl.constexpr,
                       EPS: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BN + tl.arange(0, BN)
        cols = tl.arange(0, BD)
        m = (rows < N)[:, None] & (cols < D)[None, :]
        off = rows.to(tl.int64)[:, None] * D + cols[None, :]
        o = tl.load(O_ptr + off, mask=m, other=0.0).to(tl.float32)
        w = tl.load(W_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
        gate = tl.load(G_ptr + off, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(DY_ptr + off, mask=m, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(o * o, axis=1) / D + EPS)
        n = o * r[:, None]
        s = tl.sigmoid(gate)
        dn = dy * w * s
        tl.store(DG_ptr + off, (dy * n * w * s * (1.0 - s)).to(DG_ptr.dtype.element_ty), mask=m)
        do = r[:, None] * (dn - n * (tl.sum(dn * n, axis=1) / D)[:, None])
        tl.store(DO_ptr + off, do.to(DO_ptr.dtype.element_ty), mask=m)
        tl.store(PW_ptr + pid * D + cols, tl.sum(dy * n * s, axis=0), mask=cols < D)


def _need_triton(what: str):
    if triton is None:
        raise RuntimeError(f"{what}: the fused KDA kernels need Triton (not installed); run the references")


def _row_tiles(D: int):
    """(rows per program, padded columns) of a row kernel over rows of D values."""
    BD = triton.next_power_of_2(D)
    return max(1, _TILE // BD), BD


def _gate_tiles(C: int):
    BC = min(triton.next_power_of_2(C), 256)
    return max(1, _TILE // BC), BC


# ---------------------------------------------------------------- autograd Functions

class _KdaGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, f, dt_bias, A_log, heads: int):
        R, C = f.shape
        D = C // heads
        f = f.contiguous()
        a_log = A_log.reshape(heads).contiguous()
        g = torch.empty_like(f)
        BR, BC = _gate_tiles(C)
        _gate_fwd[(triton.cdiv(R, BR), triton.cdiv(C, BC))](f, dt_bias, a_log, g, R, C, D, SOFTPLUS_THRESHOLD,
                                                            BR, BC)
        ctx.save_for_backward(f, dt_bias, a_log)
        ctx.heads, ctx.a_shape = heads, A_log.shape
        return g.view(R, heads, D)

    @staticmethod
    def backward(ctx, dg):
        f, dt_bias, a_log = ctx.saved_tensors
        R, C = f.shape
        H = ctx.heads
        dg = dg.reshape(R, C).contiguous()
        df = torch.empty_like(f)
        BR, BC = _gate_tiles(C)
        P = triton.cdiv(R, BR)
        pb = torch.empty(P, C, dtype=torch.float32, device=f.device)
        pa = torch.empty(P, C, dtype=torch.float32, device=f.device)
        _gate_bwd[(P, triton.cdiv(C, BC))](f, dt_bias, a_log, dg, df, pb, pa, R, C, C // H, SOFTPLUS_THRESHOLD,
                                          BR, BC)
        d_bias = pb.sum(0).to(dt_bias.dtype)
        d_a = pa.sum(0).view(H, -1).sum(1).to(a_log.dtype).view(ctx.a_shape)
        return df, d_bias, d_a, None


class _SiluL2Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps: float):
        D = x.shape[-1]
        x2 = x.contiguous().view(-1, D)
        y = torch.empty_like(x2)
        BN, BD = _row_tiles(D)
        _silu_l2_fwd[(triton.cdiv(x2.shape[0], BN),)](x2, y, x2.shape[0], D, eps, BN, BD)
        ctx.save_for_backward(x2)
        ctx.eps, ctx.shape = eps, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        (x2,) = ctx.saved_tensors
        D = x2.shape[1]
        dy = dy.contiguous().view(-1, D)
        dx = torch.empty_like(x2)
        BN, BD = _row_tiles(D)
        _silu_l2_bwd[(triton.cdiv(x2.shape[0], BN),)](x2, dy, dx, x2.shape[0], D, ctx.eps, BN, BD)
        return dx.view(ctx.shape), None


class _GatedRmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, weight, gate, eps: float):
        D = o.shape[-1]
        o2, g2 = o.contiguous().view(-1, D), gate.contiguous().view(-1, D)
        y = torch.empty_like(o2)
        BN, BD = _row_tiles(D)
        _norm_gate_fwd[(triton.cdiv(o2.shape[0], BN),)](o2, weight, g2, y, o2.shape[0], D, eps, BN, BD)
        ctx.save_for_backward(o2, weight, g2)
        ctx.eps, ctx.shape = eps, o.shape
        return y.view(o.shape)

    @staticmethod
    def backward(ctx, dy):
        o2, weight, g2 = ctx.saved_tensors
        N, D = o2.shape
        dy = dy.contiguous().view(-1, D)
        do, dgate = torch.empty_like(o2), torch.empty_like(g2)
        BN, BD = _row_tiles(D)
        P = triton.cdiv(N, BN)
        pw = torch.empty(P, D, dtype=torch.float32, device=o2.device)
        _norm_gate_bwd[(P,)](o2, weight, g2, dy, do, dgate, pw, N, D, ctx.eps, BN, BD)
        return do.view(ctx.shape), pw.sum(0).to(weight.dtype), dgate.view(ctx.shape), None


# ---------------------------------------------------------------- fused forms

def kda_gate(f: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor, heads: int) -> torch.Tensor:
    """:func:`kda_gate_reference` in one kernel forward and one backward (fp32 inside, rounded once)."""
    _need_triton("kda_gate")
    if f.dim() != 2 or f.shape[1] % heads or dt_bias.numel() != f.shape[1] or A_log.numel() != heads:
        raise ValueError(f"kda_gate: f [rows, heads x dim] with heads={heads}, dt_bias [heads x dim], A_log "
                         f"[heads]; got {tuple(f.shape)}, {tuple(dt_bias.shape)}, {tuple(A_log.shape)}")
    return _KdaGate.apply(f, dt_bias, A_log, heads)


def silu_l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """:func:`silu_l2norm_reference` in one kernel forward and one backward (fp32 inside, rounded once)."""
    _need_triton("silu_l2norm")
    return _SiluL2Norm.apply(x, eps)


def gated_rms_norm(o: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`gated_rms_norm_reference` in one kernel forward and one backward (fp32 inside, rounded once)."""
    _need_triton("gated_rms_norm")
    if o.shape != gate.shape or weight.dim() != 1 or weight.numel() != o.shape[-1]:
        raise ValueError(f"gated_rms_norm: o and gate of one shape, weight [{o.shape[-1]}]; got "
                         f"{tuple(o.shape)}, {tuple(gate.shape)}, {tuple(weight.shape)}")
    return _GatedRmsNorm.apply(o, weight, gate, eps)
