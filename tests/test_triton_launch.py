"""ops/triton_launch.py: the fast launch of tuned kernels, on a stand-in for Triton 3.6's autotuner and
fla's cached autotuner (CPU machines have no Triton; tests/test_kda_fla.py holds the real kernels'
results bitwise equal on the GPU)."""
import enum
import sys
import types

import pytest

from megatron_harts.ops import triton_launch
from megatron_harts.ops.triton_launch import FAST_LAUNCH_STATS, fast_autotuned_launches, tuning_key


class Dtype:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return self.name


class Tensor:
    def __init__(self, dtype):
        self.dtype = Dtype(dtype)

    def __eq__(self, other):
        return isinstance(other, Tensor) and str(other.dtype) == str(self.dtype)


class Config:
    def __init__(self, block, pre_hook=None):
        self.kwargs = {"BLOCK": block}
        self.num_warps, self.num_stages, self.pre_hook = 4, 2, pre_hook

    def all_kwargs(self):
        return {**self.kwargs, "num_warps": self.num_warps, "num_stages": self.num_stages}


class Kernel:
    """Stand-in for the JIT function: records every launch's arguments."""

    def __init__(self):
        self.launches = []

    def run(self, *args, **kwargs):
        self.launches.append((args, kwargs))
        return len(self.launches)


class Autotuner:
    """Triton 3.6's ``Autotuner.run`` logic: the key from the arguments, the first launch of a key
    'benchmarks' (picks ``pick(key)``), every launch ends in ``fn.run`` with the config's kwargs."""

    def __init__(self, arg_names, keys, configs, pick=None):
        self.fn, self.arg_names, self.keys, self.configs = Kernel(), arg_names, keys, configs
        self.cache, self.benchmarked, self.pick = {}, [], pick or (lambda key: configs[0])
        self.nargs = None

    def run(self, *args, **kwargs):
        self.nargs = dict(zip(self.arg_names, args))
        if len(self.configs) > 1:
            all_args = {**self.nargs, **kwargs}
            _args = {k: v for (k, v) in all_args.items() if k in self.arg_names}
            key = [_args[k] for k in self.keys if k in _args]
            for _, arg in _args.items():
                if hasattr(arg, "dtype"):
                    key.append(str(arg.dtype))
            key = tuple(key)
            if key not in self.cache:
                self.benchmarked.append(key)
                self.cache[key] = self.pick(key)
            config = self.cache[key]
        else:
            config = self.configs[0]
        self.best_config = config
        if config.pre_hook is not None:
            config.pre_hook({**self.nargs, **kwargs, **config.all_kwargs()})
        ret = self.fn.run(*args, **kwargs, **config.all_kwargs())
        self.nargs = None
        return ret


@pytest.fixture
def fake_triton(monkeypatch):
    mod = types.ModuleType("triton.runtime.autotuner")
    mod.Autotuner = Autotuner
    original = Autotuner.__dict__["run"]
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    monkeypatch.setitem(sys.modules, "triton.runtime", types.ModuleType("triton.runtime"))
    monkeypatch.setitem(sys.modules, "triton.runtime.autotuner", mod)
    FAST_LAUNCH_STATS.update(fast=0)
    yield Autotuner
    for cls in list(triton_launch._PATCHED):
        cls.run = triton_launch._PATCHED.pop(cls)
    assert Autotuner.__dict__["run"] is original


NAMES = ["x", "y", "T", "H", "scale", "BLOCK"]
CONFIGS = [Config(16), Config(32), Config(64)]


def launch(tuner, T, dtype="bf16", grid=(1,)):
    return tuner.run(x=Tensor(dtype), y=None, T=T, H=4, scale=0.5, grid=grid, warmup=False)


def test_key_is_the_autotuners_key():
    kwargs = {"x": Tensor("bf16"), "y": None, "T": 100, "H": 4, "z": Tensor("fp32"), "grid": (1,),
              "w": Tensor("fp32")}
    names = frozenset(["x", "y", "T", "H", "w"])
    # keys' values in the keys' order, then the dtypes of the named arguments in launch order
    assert tuning_key(["H", "T", "absent"], names, kwargs) == (4, 100, "bf16", "fp32")


def test_tuned_launches_skip_the_tuner_and_launch_the_same_kernel(fake_triton):
    plain = fake_triton(NAMES, ["T", "H"], CONFIGS, pick=lambda key: CONFIGS[key[0] % 3])
    fast = fake_triton(NAMES, ["T", "H"], CONFIGS, pick=lambda key: CONFIGS[key[0] % 3])
    for T in (1, 2, 1, 2, 5):
        launch(plain, T)
    undo = fast_autotuned_launches()
    for T in (1, 2, 1, 2, 5):
        launch(fast, T)
    # every launch reached the kernel with the same arguments and configuration as without the fast path
    assert fast.fn.launches == plain.fn.launches
    assert fast.benchmarked == plain.benchmarked == [(1, 4, "bf16"), (2, 4, "bf16"), (5, 4, "bf16")]
    assert FAST_LAUNCH_STATS["fast"] == 2                  # the first launch of each key is the tuner's
    assert fast.best_config is CONFIGS[5 % 3]
    launch(fast, 1, dtype="fp32")                           # a new dtype is a new key
    assert fast.benchmarked[-1] == (1, 4, "fp32") and FAST_LAUNCH_STATS["fast"] == 2
    undo()
    assert Autotuner.__dict__["run"].__name__ == "run" and not hasattr(Autotuner.run, "__wrapped__")


def test_what_takes_the_full_path(fake_triton):
    fast_autotuned_launches()
    fast_autotuned_launches()                                 # idempotent: one wrapper
    assert Autotuner.run.__wrapped__ is not None and not hasattr(Autotuner.run.__wrapped__, "__wrapped__")
    hooked = []
    hook = fake_triton(NAMES, ["T"], [Config(8, pre_hook=hooked.append), Config(16)])
    launch(hook, 3), launch(hook, 3)                        # a config with a pre-hook: the hook runs each time
    pos = fake_triton(NAMES, ["T"], CONFIGS)
    pos.run(Tensor("bf16"), None, 7, 4, 0.5, grid=(1,), warmup=False)
    pos.run(Tensor("bf16"), None, 7, 4, 0.5, grid=(1,), warmup=False)  # positional arguments
    assert FAST_LAUNCH_STATS["fast"] == 0
    assert len(hooked) == 2 and pos.benchmarked == [(7, "bf16")]


def test_one_config_launches_directly(fake_triton):
    plain, fast = fake_triton(NAMES, ["T"], [Config(8)]), fake_triton(NAMES, ["T"], [Config(8)])
    launch(plain, 3), launch(plain, 4)
    fast_autotuned_launches()
    launch(fast, 3), launch(fast, 4)
    assert fast.fn.launches == plain.fn.launches and FAST_LAUNCH_STATS["fast"] == 2


class FlaCacheMode(enum.Enum):
    DISABLED = 0
    ALWAYS = 1


def _fake_fla(monkeypatch, mode):
    class CachedAutotuner(Autotuner):
        """fla 0.6.0's shape: its own key, then Triton's run."""
        built = 0

        def run(self, *args, **kwargs):
            CachedAutotuner.built += 1
            return super().run(*args, **kwargs)

    mod = types.ModuleType("fla.ops.utils.cache")
    mod.CachedAutotuner, mod.FLA_CACHE_MODE = CachedAutotuner, mode
    monkeypatch.setitem(sys.modules, "fla.ops.utils.cache", mod)
    return CachedAutotuner


def test_fla_cached_autotuner_also_skips_its_own_key(fake_triton, monkeypatch):
    cached = _fake_fla(monkeypatch, FlaCacheMode.DISABLED)
    fast_autotuned_launches()
    t = cached(NAMES, ["T"], CONFIGS)
    launch(t, 3), launch(t, 3), launch(t, 3)
    assert cached.built == 1 and FAST_LAUNCH_STATS["fast"] == 2 and len(t.fn.launches) == 3


def test_fla_always_mode_keeps_reading_its_files(fake_triton, monkeypatch):
    cached = _fake_fla(monkeypatch, FlaCacheMode.ALWAYS)
    fast_autotuned_launches()
    assert cached not in triton_launch._PATCHED
    t = cached(NAMES, ["T"], CONFIGS)
    launch(t, 3), launch(t, 3)
    assert cached.built == 2
