"""torch's fused Adam(W) inside megatron-core's optimizer (training/fused_adam.py): switched only
where every parameter lives on an allowed device and before the first step; a driver step with it
gives the foreach step's parameters (CPU, fp64: fused Adam runs on the CPU too)."""
import torch

from megatron_harts.training.fused_adam import torch_optimizers, use_fused_adam
from megatron_harts.training.trainer import Trainer
from megatron_harts.tree_data import build_forest

from test_training_driver import MODEL, rollouts


def argv():
    return list(MODEL) + ["--global-batch-size", "16", "--train-iters", "10", "--seq-length", "48", "--lr", "3e-3",
                          "--seed", "7", "--log-interval", "1000", "--rl-objective", "sft", "--tree-sharing", "within",
                          "--tree-microbatch-tokens", "64"]


def test_plain_torch_optimizers_and_refusals():
    p = torch.nn.Parameter(torch.randn(3))
    adam, sgd = torch.optim.AdamW([p]), torch.optim.SGD([p], lr=0.1)
    assert torch_optimizers(adam) == [adam]
    assert use_fused_adam(adam) == 0                   # CPU parameters: CUDA only by default
    assert use_fused_adam(sgd, devices=("cpu",)) == 0  # not Adam
    p.grad = torch.ones(3)
    adam.step()
    assert use_fused_adam(adam, devices=("cpu",)) == 0  # has stepped: its state keeps its layout
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))])
    assert use_fused_adam(fresh, devices=("cpu",)) == 1 and fresh.param_groups[0]["fused"]


def test_driver_step_with_fused_adam_equals_foreach():
    forest = build_forest(rollouts(0))
    results = []
    for fused in (False, True):
        with Trainer.from_args(argv()) as t:
            if fused:
                assert use_fused_adam(t.optimizer, devices=("cpu",)) >= 1
                assert all(g["fused"] for o in torch_optimizers(t.optimizer) for g in o.param_groups)
            losses = [t.step(forest)["loss"] for _ in range(3)]
            params = [p.detach().clone() for p in t.model[0].parameters()]
        results.append((losses, params))
    (l0, p0), (l1, p1) = results
    assert abs(l0[-1] - l1[-1]) <= 1e-6 * abs(l0[-1])
    assert max(float((a - b).abs().max()) for a, b in zip(p0, p1)) <= 1e-6


def test_resume_with_fused_adam(tmp_path, monkeypatch):
    """The driver switches before a checkpoint load: a fused run resumes fused, with the next step
    of the uninterrupted fused run."""
    from megatron_harts.training import fused_adam
    monkeypatch.setattr(fused_adam, "FUSED_DEVICES", ("cuda", "cpu"))
    forest = build_forest(rollouts(0))
    ck = str(tmp_path / "ck")
    with Trainer.from_args(argv() + ["--save", ck, "--save-interval", "1"]) as t:
        t.step(forest)
        t.save()
        want = t.step(forest)["loss"]
    with Trainer.from_args(argv() + ["--load", ck]) as t:
        assert all(g["fused"] for o in torch_optimizers(t.optimizer) for g in o.param_groups)
        got = t.step(forest)["loss"]
    assert abs(got - want) <= 1e-6 * abs(want)
