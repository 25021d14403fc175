"""CPU shim for megatron-core in tests (shared/DESIGN.md, "Running megatron-core on CPU").

megatron-core 0.16.1 calls CUDA in a few places (``torch.cuda.current_device()``
as a device, ``torch.cuda.synchronize``, the CUDA RNG tracker).  ``megatron_cpu``
redirects those to the CPU for the duration of a test, starts a gloo world
(of 1 by default, or the caller's world in multi-process tests), initializes
megatron's model-parallel groups, and undoes everything on exit.  This file is
test infrastructure only: no product code imports it.
"""
from __future__ import annotations

import contextlib
import os
import socket

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _CpuRngTracker:
    """Stand-in for megatron's CUDA RNG tracker: forks the CPU generator, restoring it after."""

    def __init__(self):
        self.states_ = {}
        self.seeds_ = set()

    def is_initialized(self):
        return True

    def reset(self):
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = dict(states)

    def add(self, name, seed):
        gen = torch.Generator().manual_seed(seed)
        self.states_[name] = gen.get_state()
        self.seeds_.add(seed)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        saved = torch.get_rng_state()
        if name in self.states_:
            torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            if name in self.states_:
                self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


@contextlib.contextmanager
def megatron_cpu(tp: int = 1, ep: int = 1, pp: int = 1, seed: int = 1234, init_world: bool = True):
    """Run megatron-core on CPU: CUDA redirects, gloo world, model-parallel groups; undone on exit.

    With ``init_world`` a gloo world of one process is created (and destroyed);
    multi-process tests create their world themselves and pass ``init_world=False``.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    saved = {
        "current_device": torch.cuda.current_device,
        "synchronize": torch.cuda.synchronize,
        "get_cuda_rng_tracker": mrandom.get_cuda_rng_tracker,
        "get_state": mrandom._get_cuda_rng_state,
        "set_state": mrandom._set_cuda_rng_state,
    }
    tracker = _CpuRngTracker()
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 100)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    patched_modules = []
    created_world = False
    try:
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.synchronize = lambda *a, **k: None
        # activation recomputation saves/restores the "CUDA" RNG state: use the CPU generator's
        mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
        mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
        # every module that imported get_cuda_rng_tracker by name
        import sys
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("megatron.core") and \
                    getattr(mod, "get_cuda_rng_tracker", None) is saved["get_cuda_rng_tracker"]:
                patched_modules.append(mod)
                mod.get_cuda_rng_tracker = lambda *a, **k: tracker
        if init_world and not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ["MASTER_PORT"] = str(free_port())
            dist.init_process_group("gloo", rank=0, world_size=1)
            created_world = True
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep)
        torch.manual_seed(seed)
        yield tracker
    finally:
        parallel_state.destroy_model_parallel()
        if created_world:
            dist.destroy_process_group()
        for mod in patched_modules:
            mod.get_cuda_rng_tracker = saved["get_cuda_rng_tracker"]
        torch.cuda.current_device = saved["current_device"]
        torch.cuda.synchronize = saved["synchronize"]
        mrandom._get_cuda_rng_state = saved["get_state"]
        mrandom._set_cuda_rng_state = saved["set_state"]
