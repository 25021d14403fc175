"""Runtime patches of megatron-core (docs/design.md, "Dependency decisions").

Every change megatron_harts makes to megatron-core at run time lives in its own
module here, with

- ``NAME``: a short identifier,
- ``TARGET``: the upstream function or class the patch exists for, and
  ``TARGET_SHA256``: the hash of that object's source in megatron-core 0.16.1
  (tests fail loudly when upstream changes it, so the patch gets revisited),
- ``needed()``: whether this installation needs the patch,
- ``apply()`` / ``undo()``: idempotent; ``undo`` restores exactly what was there.

Nothing is patched at import time: callers (the training driver, tests) call
``megatron_harts.patches.apply()`` explicitly and may ``undo()`` it.  Both
refuse a megatron-core other than 0.16.x, the version the patches were written
against.
"""
from __future__ import annotations

import hashlib
import inspect
from typing import List

from . import (checkpoint_without_output, distrib_optimizer_fresh_state_dict, distrib_optimizer_step_restore,
               foreach_multi_tensor_scale, foreach_param_copy, grad_norm_on_device, router_gating,
               wgrad_accumulation)

SUPPORTED_MEGATRON = "0.16."
PATCHES = [router_gating, checkpoint_without_output, distrib_optimizer_fresh_state_dict,
           distrib_optimizer_step_restore, grad_norm_on_device, foreach_param_copy,
           foreach_multi_tensor_scale, wgrad_accumulation]


def megatron_version() -> str:
    from megatron.core import package_info
    return package_info.__version__


def check_version() -> None:
    """Raise RuntimeError unless megatron-core is 0.16.x."""
    v = megatron_version()
    if not v.startswith(SUPPORTED_MEGATRON):
        raise RuntimeError(f"megatron_harts.patches were written for megatron-core {SUPPORTED_MEGATRON}x, "
                           f"found {v}: review every module of megatron_harts/patches before use")


def source_sha256(obj) -> str:
    """SHA-256 of an object's source text (what TARGET_SHA256 pins)."""
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()


def apply() -> List[str]:
    """Apply every needed patch; returns the names of the patches now active."""
    check_version()
    active = []
    for p in PATCHES:
        if p.needed() or p.is_applied():
            p.apply()
            active.append(p.NAME)
    return active


def undo() -> None:
    """Undo every applied patch (in reverse order)."""
    for p in reversed(PATCHES):
        p.undo()
