"""RMSNorm for megatron-core specs, with sequence parallelism and no TE/apex dependency.

megatron-core's local norm (``WrappedTorchNorm``) refuses sequence parallelism.
``RMSNorm`` here is built like any norm of a spec
(``build_module(spec, config=..., hidden_size=..., eps=...)``) and works with
``config.sequence_parallel``: under SP every TP rank holds a different slice of
the rows, so each rank's weight gradient is a partial sum; the weight carries
``sequence_parallel=True``, which megatron's ``finalize_model_grads`` reads to
all-reduce those gradients over the TP group.

Numerics (Kimi-Linear's ``KimiLinearRMSNorm``): statistics in at least fp32
(in the input dtype when that is wider), ``y = weight * (x / sqrt(mean(x^2) + eps))``
cast back to the input dtype before the weight multiplies it.  On CUDA the
normalization is torch's fused RMSNorm kernel (:func:`rms_normalize`), held to
the plain-torch :func:`rms_normalize_reference` by tests/test_norm.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_normalize_reference(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps)`` computed in >= fp32, returned in x's dtype (plain torch)."""
    xs = x.to(_stat_dtype(x.dtype))
    return (xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


#: input dtypes whose normalization runs torch's fused RMSNorm kernel on CUDA (statistics in fp32,
#: one rounding to the input dtype, like the reference; fp64 keeps the reference)
FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps)`` in x's dtype: on CUDA one fused kernel forward and one
    backward (``F.rms_norm`` without weight), elsewhere :func:`rms_normalize_reference`.

    Invariant: the two differ only in the order of the fp32 sum of squares (rounding of the last
    fp32 bit, at most one unit of the output dtype); each row depends on that row alone, so tree
    and expanded rows of the same token normalize identically on either path.
    """
    if x.is_cuda and x.dtype in FUSED_DTYPES:
        return F.rms_norm(x, (x.shape[-1],), eps=eps)
    return rms_normalize_reference(x, eps)


class RMSNorm(MegatronModule):
    """Root-mean-square norm over the last dimension, usable through specs, SP-aware.

    Args follow megatron's norm builders: ``config``, ``hidden_size``, ``eps``
    (``config.layernorm_epsilon`` when omitted).  ``config.normalization`` must be
    "RMSNorm"; zero-centered gamma and persist-layernorm options are refused.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = None):
        super().__init__(config)
        if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise ValueError(f"RMSNorm module built with --normalization {config.normalization!r}; "
                             "use --normalization RMSNorm")
        if getattr(config, "layernorm_zero_centered_gamma", False):
            raise ValueError("RMSNorm: --apply-layernorm-1p (layernorm_zero_centered_gamma) is not supported")
        self.eps = config.layernorm_epsilon if eps is None else eps
        dev = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=dev))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * rms_normalize(x, self.eps)
