"""A single-process megatron-core world for tools that run the model outside a training launcher.

megatron-core 0.16.1 assumes CUDA in a few places: ``torch.cuda.current_device()`` as a
device, ``torch.cuda.synchronize``, and the CUDA RNG tracker (model-parallel RNG forks,
activation recomputation).  :func:`megatron_cpu_runtime` makes those work on the CPU for
the duration of a ``with`` block, and :func:`single_process_megatron` picks it or the
plain CUDA setup by device.

Invariants:

- Nothing happens at import: a caller applies the context manager explicitly (tools do; the
  test fixture ``tests/megatron_cpu.py`` is this same context manager).
- Inside the block: a gloo world (of 1 unless the caller made its own), megatron's
  model-parallel groups, ``torch.cuda.current_device() == "cpu"``, ``torch.cuda.synchronize``
  a no-op, CUDA streams one no-op CPU stream (``torch.cuda.Stream``, ``current_stream``,
  ``stream``: megatron's all-to-all token dispatcher makes a side stream), every megatron module's ``get_cuda_rng_tracker`` returning a CPU tracker seeded
  from ``seed`` (so parameter initialization is reproducible), and the CPU generator seeded.
- megatron's optimizer modules (``CUDA_LITERAL_MODULES``) create small tensors with a
  literal ``device='cuda'`` (loss scale, found-inf flag, grad-norm buffers, the local multi-tensor L2 norm): inside the block
  their module-level ``torch`` name is a proxy whose tensor factories read a CUDA device as
  the CPU; everything else is the real torch.  Their gradient clipping asserts CUDA float
  gradients: ``clip_grad_by_total_norm_fp32`` is, inside the block, :func:`clip_grads_cpu`
  (same coefficient ``max_norm / (total_norm + 1e-6)``, applied when below 1).  The all-to-all
  token dispatcher's split sizes come to the host as numpy arrays, as its GPU path gives them.
- On exit, also on error: model-parallel groups destroyed, the world destroyed if this block
  created it, and every redirected attribute restored to the object it was before.

This does not apply ``megatron_harts.patches`` (call ``patches.apply()`` / ``undo()`` around it).
"""
from __future__ import annotations

import contextlib
import os
import random
import socket
import sys
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["megatron_cpu_runtime", "megatron_cuda_runtime", "single_process_megatron", "free_port",
           "CpuRngTracker", "clip_grads_cpu"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a local gloo/nccl rendezvous).

    Drawn at random below the system's ephemeral range, where the OS puts the local ends of
    connections (gloo's between ranks among them) and the ports of binds to port 0: a port taken from
    that range can be handed to another socket between this call and the rendezvous binding it.  The
    OS's choice where that range is not known."""
    low = _ephemeral_low()
    if low is not None and low > 2 * _LOWEST:
        draw = random.Random()          # seeded by the OS: spawned test ranks do not share a sequence
        for _ in range(64):
            port = draw.randrange(_LOWEST, low)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_LOWEST = 10000     # above the well-known and most registered service ports


def _ephemeral_low() -> Optional[int]:
    """The lowest port of the system's ephemeral range (Linux), or None."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class CpuRngTracker:
    """Stand-in for megatron's CUDA RNG tracker: named CPU generator states.

    ``fork(name)`` runs its block with the named state on the default CPU generator, stores
    the advanced state back under the name, and restores the default generator after.
    """

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
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()
        self.seeds_.add(seed)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        outer = torch.get_rng_state()
        if name in self.states_:
            torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            if name in self.states_:
                self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


CUDA_LITERAL_MODULES = ("megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads",
                        "megatron.core.optimizer.grad_scaler", "megatron.core.optimizer.distrib_optimizer",
                        "megatron.core.utils")


class _CpuDeviceTorch:
    """``torch`` with ``device="cuda..."`` in the tensor factories read as the CPU."""

    _FACTORIES = frozenset(("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "empty_like"))

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if name not in self._FACTORIES:
            return attr

        def factory(*args, device=None, **kwargs):
            if device is not None and str(device).startswith("cuda"):
                device = "cpu"
            return attr(*args, device=device, **kwargs)
        return factory


class _CpuEvent:
    """A recorded point on the CPU "stream": always reached."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuStream:
    """The one "stream" of the CPU: waits and records are no-ops (megatron's all-to-all token
    dispatcher and shared-expert overlap create side streams)."""

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _CpuEvent()


_CPU_STREAM = _CpuStream()


class _CpuStreamFactory(_CpuStream):
    """Stands in for the ``torch.cuda.Stream`` class (a class: libraries use it in annotations such
    as ``torch.cuda.Stream | None``); every instance is the one CPU stream."""

    def __new__(cls, *args, **kwargs):
        return _CPU_STREAM


def _to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron's ``maybe_move_tensor_to_cpu`` for tensors already on the CPU: the all-to-all split
    sizes must still come back as numpy arrays (what its device-to-host copy gives on GPUs)."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def clip_grads_cpu(parameters, max_norm, total_norm, use_decoupled_grad: bool = False) -> None:
    """megatron's ``clip_grad_by_total_norm_fp32`` for gradients of any dtype and device."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff >= 1.0:
        return
    for p in parameters:
        g = getattr(p, "decoupled_grad", None) if use_decoupled_grad else p.grad
        if g is not None:
            g.detach().mul_(coeff)


def _start_world(backend: str) -> bool:
    """Create a world of one process unless one exists; returns whether this call created it."""
    if dist.is_initialized():
        return False
    # an in-process store: no port to race for, nothing written into the process's environment
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


@contextlib.contextmanager
def megatron_cpu_runtime(tp: int = 1, ep: int = 1, pp: int = 1, seed: int = 1234, init_world: bool = True,
                         etp: Optional[int] = None):
    """megatron-core on CPU for the block (module docstring); yields the CPU RNG tracker.

    With ``init_world`` a gloo world of one process is created when none exists (and destroyed
    on exit); multi-process callers create their world themselves and pass ``init_world=False``.
    ``etp``: expert tensor-parallel size (megatron's default: ``tp``).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    saved = {"current_device": torch.cuda.current_device, "synchronize": torch.cuda.synchronize,
             "Stream": torch.cuda.Stream, "current_stream": torch.cuda.current_stream, "stream": torch.cuda.stream,
             "get_cuda_rng_tracker": mrandom.get_cuda_rng_tracker, "get_state": mrandom._get_cuda_rng_state,
             "set_state": mrandom._set_cuda_rng_state}
    tracker = CpuRngTracker()
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 100)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    redirected = []
    literal = []
    created_world = False
    groups = False
    try:
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.Stream = _CpuStreamFactory
        torch.cuda.current_stream = lambda *a, **k: _CPU_STREAM
        torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
        # activation recomputation saves/restores the "CUDA" RNG state: use the CPU generator's
        mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
        mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
        # every megatron module that imported get_cuda_rng_tracker by name
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("megatron.core") and \
                    getattr(mod, "get_cuda_rng_tracker", None) is saved["get_cuda_rng_tracker"]:
                redirected.append(mod)
                mod.get_cuda_rng_tracker = lambda *a, **k: tracker
        import importlib
        for name in CUDA_LITERAL_MODULES:
            mod = importlib.import_module(name)
            if mod.torch is torch:
                literal.append(mod)
                mod.torch = _CpuDeviceTorch(torch)
        from megatron.core.optimizer import optimizer as moptimizer
        saved["clip"] = moptimizer.clip_grad_by_total_norm_fp32
        moptimizer.clip_grad_by_total_norm_fp32 = clip_grads_cpu
        from megatron.core.transformer.moe import token_dispatcher
        saved["to_cpu"] = token_dispatcher.maybe_move_tensor_to_cpu
        token_dispatcher.maybe_move_tensor_to_cpu = _to_host
        if init_world:
            created_world = _start_world("gloo")
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp)
        groups = True
        torch.manual_seed(seed)
        yield tracker
    finally:
        if groups:
            parallel_state.destroy_model_parallel()
        if created_world:
            dist.destroy_process_group()
        for mod in redirected:
            mod.get_cuda_rng_tracker = saved["get_cuda_rng_tracker"]
        for mod in literal:
            mod.torch = torch
        if "clip" in saved:
            from megatron.core.optimizer import optimizer as moptimizer
            moptimizer.clip_grad_by_total_norm_fp32 = saved["clip"]
        if "to_cpu" in saved:
            from megatron.core.transformer.moe import token_dispatcher
            token_dispatcher.maybe_move_tensor_to_cpu = saved["to_cpu"]
        torch.cuda.current_device = saved["current_device"]
        torch.cuda.synchronize = saved["synchronize"]
        torch.cuda.Stream, torch.cuda.current_stream = saved["Stream"], saved["current_stream"]
        torch.cuda.stream = saved["stream"]
        mrandom._get_cuda_rng_state = saved["get_state"]
        mrandom._set_cuda_rng_state = saved["set_state"]


@contextlib.contextmanager
def megatron_cuda_runtime(seed: int = 1234):
    """A one-GPU megatron-core world (nccl, TP = PP = EP = 1, CUDA RNG tracker seeded); undone on exit."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    created_world = _start_world("nccl")
    groups = False
    try:
        parallel_state.initialize_model_parallel()
        groups = True
        model_parallel_cuda_manual_seed(seed)
        torch.manual_seed(seed)
        yield None
    finally:
        if groups:
            parallel_state.destroy_model_parallel()
        if created_world:
            dist.destroy_process_group()


def single_process_megatron(device: str = "cpu", seed: int = 1234):
    """The single-process world for ``device`` ("cpu" or "cuda"): a context manager."""
    if device == "cpu":
        return megatron_cpu_runtime(seed=seed)
    if device == "cuda":
        return megatron_cuda_runtime(seed=seed)
    raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
