"""torch's fused Adam(W) kernel for the optimizer megatron-core builds without Apex / TE.

Without Apex or Transformer Engine, ``megatron.core.optimizer`` steps its fp32 main parameters
with ``torch.optim.Adam``/``AdamW`` at torch's default implementation (``foreach`` on CUDA): a
chain of multi-tensor kernels, each a pass over every parameter, gradient and moment.  On the H200
that step took 58 ms of the h200-2k benchmark model's 1.6-1.8 s tree step (2.6B parameters).
torch's ``fused`` implementation makes one pass; with Apex, megatron-core would use Apex's
FusedAdam, the same algorithm.  :func:`use_fused_adam` switches the torch optimizers inside a
megatron optimizer to it.  The update is Adam's either way; the two implementations round
differently in the last bits.
"""
from __future__ import annotations

from typing import Iterable, List

import torch

__all__ = ["FUSED_DEVICES", "torch_optimizers", "use_fused_adam"]

#: where the driver (training.trainer) switches to the fused kernel
FUSED_DEVICES = ("cuda",)


def torch_optimizers(optimizer) -> List[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron-core optimizer (chained ones included)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [o for c in chained for o in torch_optimizers(c)]
    inner = getattr(optimizer, "optimizer", None)
    return torch_optimizers(inner) if inner is not None else []


def use_fused_adam(optimizer, devices: Iterable[str] = None) -> int:
    """Set ``fused=True`` on every torch Adam/AdamW of ``optimizer`` whose parameters all are
    floating-point tensors on one of ``devices`` (default ``FUSED_DEVICES``); returns how many
    were switched.

    Invariant: only optimizers that have not stepped yet are switched (their state, created at
    the first step or by a checkpoint load after this call, then follows the fused layout).
    """
    devices = tuple(FUSED_DEVICES if devices is None else devices)
    switched = 0
    for opt in torch_optimizers(optimizer):
        if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)) or opt.state:
            continue
        params = [p for g in opt.param_groups for p in g["params"]]
        if not params or not all(p.is_floating_point() and p.device.type in devices for p in params):
            continue
        if any(g.get("differentiable") or g.get("capturable") for g in opt.param_groups):
            continue
        for g in opt.param_groups:
            g["fused"], g["foreach"] = True, False
        opt._step_supports_amp_scaling = True     # what Adam.__init__ sets for fused=True
        switched += 1
    return switched
