"""patches/distrib_optimizer_step_restore.py: DistributedOptimizer.load_state_dict() restores Adam's step
count (torch Adam, no Apex/TE) from a dp_reshardable dist checkpoint: upstream it comes back as the fresh
optimizer's 0 in one tensor shared by all parameters; patched, every parameter holds its own saved step
and the resumed update equals the uninterrupted one bitwise."""
import os

import pytest
import torch

from megatron_harts.patches import distrib_optimizer_step_restore as patch
from megatron_harts.training import checkpointing as ck

from test_checkpointing import CudaAsCpu, build_training, empty_moe_tracker, train_steps

METADATA = {"distrib_optim_sharding_type": "dp_reshardable", "non_homogeneous_layers": True}


def _steps(opt):
    (dopt,) = opt.chained_optimizers
    return [s["step"] for s in dopt.optimizer.state.values()]


def _load(path, model, opt):
    from megatron.core import dist_checkpointing
    request = {"model": model.module.sharded_state_dict(metadata=METADATA)}
    request["optimizer"] = opt.sharded_state_dict(request, is_loading=True, metadata=METADATA)
    loaded = dist_checkpointing.load(request, path)
    with torch.no_grad():
        model.module.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])


@pytest.fixture(autouse=True)
def _moe_tracker_emptied_after():
    yield
    empty_moe_tracker()


def test_resumed_adam_step_count(cpu_world, tmp_path):
    from megatron.core import dist_checkpointing
    if not patch.needed():
        pytest.skip("Apex or Transformer Engine installed: the optimizer keeps its step in the param groups")
    with CudaAsCpu():
        a = build_training("distributed", seed=1)
        train_steps(*a, 0, "distributed", [0, 1])
        state = {"model": a[0].module.sharded_state_dict(metadata=METADATA)}
        state["optimizer"] = a[1].sharded_state_dict(state, metadata=METADATA)
        path = str(tmp_path / "ckpt")
        os.makedirs(path)
        dist_checkpointing.save(state, path)

        b = build_training("distributed", seed=2)
        patch.undo()
        try:
            _load(path, b[0], b[1])
        finally:
            patch.apply()
        steps = _steps(b[1])
        assert len({id(s) for s in steps}) == 1          # the upstream bug: one shared tensor ...
        assert float(steps[0]) == 0.0                    # ... holding the fresh optimizer's step
        # megatron_harts' checkpoints refuse distributed-optimizer state without the patch
        ck.save_checkpoint(str(tmp_path / "harts"), 2, [a[0]], a[1], a[2])
        patch.undo()
        try:
            with pytest.raises(ck.CheckpointError, match=patch.NAME):
                ck.load_checkpoint(str(tmp_path / "harts"), [b[0]], b[1], b[2])
        finally:
            patch.apply()

        c = build_training("distributed", seed=3)
        _load(path, c[0], c[1])
        steps = _steps(c[1])
        assert len({id(s) for s in steps}) == len(steps) > 1
        assert all(float(s) == 2.0 for s in steps)
        assert train_steps(*c, 0, "distributed", [2]) == train_steps(*a, 0, "distributed", [2])
        assert all(torch.equal(p, q) for p, q in zip(a[0].parameters(), c[0].parameters()))
