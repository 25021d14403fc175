"""CPU shim for megatron-core in tests (docs/design.md, "Running megatron-core on CPU").

The shim is the product's explicit helper ``megatron_harts.testing.cpu_runtime.megatron_cpu_runtime``
(tools that run the model on CPU apply the same context manager), so tests and tools share one
implementation: CUDA redirects, a gloo world (of 1 by default, or the caller's world in
multi-process tests), megatron's model-parallel groups, a seeded CPU RNG tracker, all undone
on exit.  Nothing here or there is applied at import time.
"""
from __future__ import annotations

from megatron_harts.testing.cpu_runtime import free_port, megatron_cpu_runtime as megatron_cpu

__all__ = ["free_port", "megatron_cpu"]
