"""Selective recomputation without Transformer Engine: ``CheckpointWithoutOutput()`` is not fp8.

megatron-core 0.16.1 ``tensor_parallel.random.CheckpointWithoutOutput.__init__(self, fp8=False)``
sets ``self.fp8 = fp8 is not None``, so the default ``fp8=False`` (how TransformerLayer
builds its layernorm checkpoints for ``--recompute-modules layernorm``, and the experts
for ``moe_act``) counts as fp8, and the forward then reads ``FP8GlobalStateManager``,
which only exists with Transformer Engine: NameError.  Callers that do mean fp8 pass
the config's fp8 recipe (None when off).  The patch maps ``fp8=False`` to ``None``
before the original ``__init__`` runs; every other value is passed through unchanged.
"""
from __future__ import annotations

import functools

NAME = "checkpoint_without_output_fp8_default"
TARGET = "megatron.core.tensor_parallel.random.CheckpointWithoutOutput.__init__"
TARGET_SHA256 = "72036565b77136f2579f36e1f34fcc29706746f7515fa9711bf73eb78b1c5f07"

_state = {"original": None}


def _cls():
    from megatron.core.tensor_parallel import random
    return random.CheckpointWithoutOutput


def target():
    return _state["original"] or _cls().__init__


def needed() -> bool:
    from megatron.core.tensor_parallel import random
    return "FP8GlobalStateManager" not in vars(random)


def is_applied() -> bool:
    return _state["original"] is not None


def apply() -> None:
    if is_applied() or not needed():
        return
    cls = _cls()
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, fp8=False, *args, **kwargs):
        original(self, None if fp8 is False else fp8, *args, **kwargs)

    _state["original"] = original
    cls.__init__ = __init__


def undo() -> None:
    if not is_applied():
        return
    _cls().__init__ = _state["original"]
    _state["original"] = None
