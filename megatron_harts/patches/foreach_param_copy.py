"""The bf16 optimizer's copy of the fp32 main parameters into the model's parameters, as one
multi-tensor copy.

megatron-core 0.16.1's ``_multi_tensor_copy_this_to_that`` (optimizer/optimizer.py) copies
tensor by tensor when it gets no overflow buffer, which is always the case under bf16
(``MixedPrecisionOptimizer`` sets ``_dummy_overflow_buf = None`` there, Apex or not): after
every optimizer step one ``copy_`` per parameter tensor, each a separate launch from Python
(about 900 for the 12-layer benchmark model, whose experts hold a weight each).  The
replacement copies them with ``torch._foreach_copy_``, which launches multi-tensor kernels over
the whole list.  A copy is a copy: the model's parameters get the same bits (fp32 rounded to
bf16 the same way).  With an overflow buffer (fp16) the upstream path is kept.
"""
from __future__ import annotations

NAME = "foreach_param_copy"
TARGET = "megatron.core.optimizer.optimizer._multi_tensor_copy_this_to_that"
TARGET_SHA256 = "2788b0572db3ae06792290baeaf36b75a6ab33ab539a019e88817597adcac75c"

_state = {"original": None}


def _module():
    from megatron.core.optimizer import optimizer
    return optimizer


def target():
    return _state["original"] or _module()._multi_tensor_copy_this_to_that


def foreach_copy_this_to_that(this, that, overflow_buf=None):
    """``_multi_tensor_copy_this_to_that``'s contract: ``that[i]`` gets ``this[i]``'s values (in
    ``that[i]``'s dtype); without an overflow buffer one multi-tensor copy over the lists."""
    if overflow_buf is not None:
        return _state["original"](this, that, overflow_buf)
    import torch
    if len(this) != len(that):
        raise ValueError(f"copy of {len(this)} tensors into {len(that)}")
    if that:
        torch._foreach_copy_(list(that), list(this))


def needed() -> bool:
    import torch
    return hasattr(torch, "_foreach_copy_")


def is_applied() -> bool:
    return _state["original"] is not None


def apply() -> None:
    if is_applied() or not needed():
        return
    mod = _module()
    _state["original"] = mod._multi_tensor_copy_this_to_that
    mod._multi_tensor_copy_this_to_that = foreach_copy_this_to_that


def undo() -> None:
    if not is_applied():
        return
    _module()._multi_tensor_copy_this_to_that = _state["original"]
    _state["original"] = None
