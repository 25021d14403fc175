"""ops/triton_tuning.py: the autotuning cap, on a stand-in for triton.runtime.autotuner (CPU machines
have no Triton), and the driver flag that applies it."""
import sys
import types
from dataclasses import dataclass

import pytest

from megatron_harts.ops.triton_tuning import kept_configs, limit_autotuning


@dataclass
class Config:
    name: str
    num_stages: int


class Autotuner:
    """Stand-in: ``run`` benchmarks every config in ``self.configs`` (here: records them)."""

    def __init__(self, configs):
        self.configs = list(configs)
        self.tried = None

    def run(self, *args, **kwargs):
        self.tried = [c.name for c in self.configs]
        return args, kwargs


@pytest.fixture
def fake_triton(monkeypatch):
    mod = types.ModuleType("triton.runtime.autotuner")
    mod.Autotuner = Autotuner
    original = Autotuner.run
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    monkeypatch.setitem(sys.modules, "triton.runtime", types.ModuleType("triton.runtime"))
    monkeypatch.setitem(sys.modules, "triton.runtime.autotuner", mod)
    yield Autotuner
    Autotuner.run = original


CONFIGS = [Config("a", 4), Config("b", 2), Config("c", 3), Config("d", 2), Config("e", 1)]


def test_kept_configs_fewest_stages_first_stable():
    assert [c.name for c in kept_configs(CONFIGS, 3)] == ["e", "b", "d"]
    assert [c.name for c in kept_configs(CONFIGS, 0)] == [c.name for c in CONFIGS]
    assert [c.name for c in kept_configs(CONFIGS, 9)] == [c.name for c in CONFIGS]


def test_limit_caps_each_autotuner_and_undo_restores(fake_triton):
    undo = limit_autotuning(2)
    t = fake_triton(CONFIGS)
    assert t.run(1, k=2) == ((1,), {"k": 2})          # arguments pass through
    assert t.tried == ["e", "b"]
    limit_autotuning(3)                               # one limit per process: the latest holds
    t3 = fake_triton(CONFIGS)
    t3.run()
    assert t3.tried == ["e", "b", "d"]
    undo()
    full = fake_triton(CONFIGS)
    full.run()
    assert full.tried == [c.name for c in CONFIGS]


def test_limit_refuses_non_positive():
    with pytest.raises(ValueError, match="n must be >= 1"):
        limit_autotuning(0)


def test_driver_flag_parses_and_defaults_to_full_autotuning():
    from megatron_harts.training.arguments import ArgumentsError, parse_args
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--vocab-size", "128", "--train-iters", "1", "--global-batch-size", "2", "--lr", "1e-3"]
    assert parse_args(base, require_data=False).tree_triton_max_configs == 0
    assert parse_args(base + ["--tree-triton-max-configs", "2"], require_data=False).tree_triton_max_configs == 2
    with pytest.raises(ArgumentsError, match="--tree-triton-max-configs"):
        parse_args(base + ["--tree-triton-max-configs", "-1"], require_data=False)
