"""patches/distrib_optimizer_fresh_state_dict.py: DistributedOptimizer.state_dict() before the first step
(torch Adam, no Apex/TE): the upstream AssertionError, the patched step count 0, nothing changed after a step."""
import pytest

from megatron_harts.patches import distrib_optimizer_fresh_state_dict as patch

from test_checkpointing import CudaAsCpu, build_training, empty_moe_tracker, train_steps


def _param_groups(sd):
    return [{k: v for k, v in g.items()} for g in sd["optimizer"]["param_groups"]]


@pytest.fixture(autouse=True)
def _moe_tracker_emptied_after():
    yield
    empty_moe_tracker()


def test_state_dict_of_a_fresh_distributed_optimizer(cpu_world):
    if not patch.needed():
        pytest.skip("Apex or Transformer Engine installed: the optimizer keeps its step in the param groups")
    with CudaAsCpu():
        model, opt, sched = build_training("distributed", seed=1)
        (dopt,) = opt.chained_optimizers
        patch.undo()
        try:
            with pytest.raises(AssertionError):
                dopt.state_dict()                     # the upstream bug: no per-parameter state yet
        finally:
            patch.apply()
        assert patch.is_applied()
        sd = dopt.state_dict()
        assert {g["step"] for g in sd["optimizer"]["param_groups"]} == {0.0}
        assert len(dopt.optimizer.state) == 0         # the lent entry is gone again
        # what loading a checkpoint into a fresh optimizer does first
        opt.sharded_state_dict(model.module.sharded_state_dict(), is_loading=True,
                               metadata={"distrib_optim_sharding_type": "dp_reshardable"})
        # once the optimizer has stepped, the patched method returns what the original does
        fresh = build_training("distributed", seed=1)
        train_steps(*fresh, 0, "distributed", [0])
        (stepped,) = fresh[1].chained_optimizers
        patched = _param_groups(stepped.state_dict())
        assert {g["step"] for g in patched} == {1.0}
        patch.undo()
        try:
            assert _param_groups(stepped.state_dict()) == patched
        finally:
            patch.apply()
