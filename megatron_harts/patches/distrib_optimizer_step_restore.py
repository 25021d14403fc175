"""Distributed optimizer without Apex/TE: ``load_state_dict()`` restores Adam's step count.

On the torch-Adam path (no Apex or Transformer Engine: ``HAVE_APEX_OR_TE`` is False) torch's
Adam keeps a step tensor in every parameter's state, and megatron-core 0.16.1
``DistributedOptimizer`` saves the common step count in the parameter groups.  Its
``load_state_dict`` gets it back wrong twice:

- it assigns one and the same tensor to every parameter's ``"step"`` (torch's
  ``Optimizer.load_state_dict`` keeps step tensors uncopied), and Adam increments each
  parameter's step in place, so the shared counter advances once per parameter per step;
- the ``dp_reshardable`` parameter-state loader (Megatron-LM's default dist-checkpoint format)
  then copies the step of the *requesting* optimizer over it (``step`` is a non-persistent entry
  of that format: the fresh optimizer's 0).

After a resume Adam's bias correction thus restarts from 0 and runs too fast, and every update
differs from the uninterrupted run's.  The patch runs the original, then gives every parameter
its own step tensor (same dtype and device as before) holding the step count of the loaded
parameter groups.  The Apex/TE path keeps its step in the parameter groups only (``needed`` is
False there).
"""
from __future__ import annotations

import functools

NAME = "distrib_optimizer_step_restore"
TARGET = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.load_state_dict"
TARGET_SHA256 = "15f257b4c4f9a7ef6d6660e829de088d39997615c2a4e52ec5e7e1306b465f04"

_state = {"original": None}


def _module():
    from megatron.core.optimizer import distrib_optimizer
    return distrib_optimizer


def target():
    return _state["original"] or _module().DistributedOptimizer.load_state_dict


def needed() -> bool:
    return not _module().HAVE_APEX_OR_TE


def is_applied() -> bool:
    return _state["original"] is not None


def saved_step(state_dict):
    """The step count a DistributedOptimizer state dict carries in its parameter groups, or None."""
    try:
        groups = state_dict["optimizer"]["param_groups"]
    except (KeyError, TypeError):
        return None
    steps = {g["step"] for g in groups if isinstance(g, dict) and g.get("step") is not None}
    return steps.pop() if len(steps) == 1 else None


def set_steps(inner, step) -> int:
    """Give every parameter state of the torch optimizer ``inner`` its own step tensor holding
    ``step``; returns how many states it set."""
    import torch

    count = 0
    for state in inner.state.values():
        old = state.get("step") if isinstance(state, dict) else None
        if isinstance(old, torch.Tensor):
            state["step"] = torch.full_like(old, step)
            count += 1
    return count


def apply() -> None:
    if is_applied() or not needed():
        return
    import torch

    cls = _module().DistributedOptimizer
    original = cls.load_state_dict

    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        step = saved_step(state_dict)
        result = original(self, state_dict)
        if step is not None and isinstance(self.optimizer, torch.optim.Optimizer):
            set_steps(self.optimizer, step)
        return result

    _state["original"] = original
    cls.load_state_dict = load_state_dict


def undo() -> None:
    if not is_applied():
        return
    _module().DistributedOptimizer.load_state_dict = _state["original"]
    _state["original"] = None
