"""``Trainer.close()`` frees the run's model and optimizer (a process that trains several runs one after
another, as benchmarks/bench_throughput.py does, must not keep each closed run's weights, gradient
buffers and optimizer state).

Two tiny trainers (CPU, world of one, fp64 MoE model with megatron's allgather token dispatcher), each
stepped once and closed, the first one still referenced by the caller as ``with ... as t`` leaves it:
after ``gc.collect()`` no parameter, gradient buffer or optimizer state tensor of the first survives.
"""
import gc
import weakref

import torch

from test_training_driver import argv, rollouts


def _flags():
    flags = argv("unused", "within")
    i = flags.index("--data-path")
    return flags[:i] + flags[i + 2:]


def _tensors_of(trainer):
    """Weak references to the run's parameters, DDP gradient buffers and optimizer state tensors."""
    ddp = trainer.model[0]
    params = list(ddp.module.parameters())
    grads = [b.grad_data for b in ddp.buffers] + [p.main_grad for p in params]
    state = [v for s in trainer.optimizer.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert params and grads and state
    return {"parameters": [weakref.ref(p) for p in params], "gradient buffers": [weakref.ref(g) for g in grads],
            "optimizer state": [weakref.ref(v) for v in state], "model": [weakref.ref(ddp)]}


def test_close_releases_model_and_optimizer(monkeypatch):
    from megatron_cpu import free_port
    from megatron_harts.training.trainer import Trainer
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                     LOCAL_RANK="0").items():
        monkeypatch.setenv(k, v)
    trajs = rollouts()[:4]
    refs = None
    for _ in range(2):
        with Trainer.from_args(_flags()) as t:
            t.step(trajs)
            if refs is None:
                refs = _tensors_of(t)
                first = t                      # the caller keeps the closed trainer
        gc.collect()
        alive = {k: sum(r() is not None for r in v) for k, v in refs.items()}
        assert not any(alive.values()), f"still alive after close() (of {({k: len(v) for k, v in refs.items()})}): {alive}"
    assert first.iteration == 1 and first.model is None and first.optimizer is None


def test_embedded_trainer_leaves_the_process_environment_unchanged(monkeypatch):
    """An RL framework embeds ``Trainer`` in its own process (no launcher): building it, stepping it
    and closing it write nothing into ``os.environ`` (its subprocesses and later runs would inherit
    it).  The launcher's variables are removed first, so the world of one is made here."""
    import os

    from megatron_harts.training.trainer import Trainer
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    before = dict(os.environ)
    t = Trainer.from_args(_flags())
    assert dict(os.environ) == before, "from_args changed the environment"
    t.step(rollouts()[:2])
    assert dict(os.environ) == before, "step changed the environment"
    t.close()
    after = dict(os.environ)
    assert after == before, sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
