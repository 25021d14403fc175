"""Distributed optimizer without Apex/TE: ``state_dict()`` of an optimizer that has not stepped yet.

megatron-core 0.16.1 ``DistributedOptimizer.state_dict`` on the torch-Adam path (no Apex or
Transformer Engine: ``HAVE_APEX_OR_TE`` is False) reads the step count from the inner optimizer's
per-parameter state and asserts it found exactly one value.  torch's Adam creates that state
lazily, at its first step, so before it the assertion fails.  Loading a checkpoint calls
``state_dict()`` on a freshly built optimizer (``sharded_state_dict(..., is_loading=True)``), so
every resume with ``--use-distributed-optimizer`` fails, and so does a save before the first step.

Before the first step the step count is 0.  The patch gives ``state_dict`` exactly that: while
the inner optimizer holds no state, it lends one parameter a ``{"step": 0}`` entry for the
duration of the original call (which reads nothing else from the state) and removes it again.
Optimizers that have stepped, and the Apex/TE path, run the original unchanged.
"""
from __future__ import annotations

import functools

import torch

NAME = "distrib_optimizer_fresh_state_dict"
TARGET = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.state_dict"
TARGET_SHA256 = "fe621ae6a622b58752df0330a2a30056dda222d73f22dc6bce6a5d1ac2bfa3d8"

_state = {"original": None}


def _module():
    from megatron.core.optimizer import distrib_optimizer
    return distrib_optimizer


def target():
    return _state["original"] or _module().DistributedOptimizer.state_dict


def needed() -> bool:
    return not _module().HAVE_APEX_OR_TE


def is_applied() -> bool:
    return _state["original"] is not None


def _first_param(inner: torch.optim.Optimizer):
    for group in inner.param_groups:
        for p in group["params"]:
            return p
    return None


def apply() -> None:
    if is_applied() or not needed():
        return
    cls = _module().DistributedOptimizer
    original = cls.state_dict

    @functools.wraps(original)
    def state_dict(self):
        inner = self.optimizer
        if not isinstance(inner, torch.optim.Optimizer) or len(inner.state) > 0:
            return original(self)
        lent = _first_param(inner)
        if lent is None:
            return original(self)
        inner.state[lent] = {"step": torch.tensor(0.0)}
        try:
            return original(self)
        finally:
            inner.state.pop(lent, None)

    _state["original"] = original
    cls.state_dict = state_dict


def undo() -> None:
    if not is_applied():
        return
    _module().DistributedOptimizer.state_dict = _state["original"]
    _state["original"] = None
