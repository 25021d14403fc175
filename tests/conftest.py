"""Shared fixtures of the test suite, the environment guard and ``--shuffle``.

- Every test must leave ``os.environ`` as it found it (library code never writes it; a test that
  needs a variable uses ``monkeypatch.setenv``): a test that changes it fails, naming the
  variables, and the environment is restored for the tests after it.  ``NOT_GUARDED`` lists the
  variables pytest and torch's compiler set for themselves.
- ``--shuffle SEED`` runs the files in a seeded random order and each file's tests in a seeded
  random order (a file's tests stay together, so its module fixtures are built once): the suite
  must pass in any order.
"""
import os
import random

import pytest
import torch

import megatron_harts.patches as patches
from megatron_cpu import megatron_cpu

# under pytest-xdist each worker process takes one core: two workers with torch's default of a thread
# per core would oversubscribe the CI machine's two cores
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def cpu_world():
    """megatron-core patched (explicitly) and running as a one-process gloo world on the CPU.

    megatron's MoE loss tracker is a module global sized by the first model that logs into it:
    each module starts with an empty one."""
    from megatron.core.transformer.moe import moe_utils

    moe_utils.get_moe_layer_wise_logging_tracker().clear()
    patches.apply()
    with megatron_cpu():
        yield
    patches.undo()


def pytest_addoption(parser):
    parser.addoption("--shuffle", type=int, default=None, metavar="SEED",
                     help="run the test files, and each file's tests, in a random order seeded by SEED")


def pytest_report_header(config):
    seed = config.getoption("--shuffle")
    return None if seed is None else f"shuffled order: --shuffle {seed}"


def pytest_collection_modifyitems(session, config, items):
    seed = config.getoption("--shuffle")
    if seed is None:
        return
    rng = random.Random(seed)
    by_file = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    files = list(by_file)
    rng.shuffle(files)
    items[:] = []
    for f in files:
        tests = by_file[f]
        rng.shuffle(tests)
        items.extend(tests)


@pytest.fixture
def cpu_world_for_the_test():
    """``cpu_world`` for one test only: for a module whose other tests build a ``Trainer`` (which makes
    megatron's parallel state itself, so none may be left from an earlier test in any order)."""
    from megatron.core.transformer.moe import moe_utils

    moe_utils.get_moe_layer_wise_logging_tracker().clear()
    patches.apply()
    with megatron_cpu():
        yield
    patches.undo()


@pytest.fixture(scope="module", autouse=True)
def _megatron_state_released():
    """Fails the module that leaves megatron-core's model-parallel state initialized (a Trainer not
    closed, a runtime not exited), and releases it, so the next module starts clean."""
    yield
    import sys
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and getattr(ps, "_DATA_PARALLEL_GROUP", None) is not None:
        ps.destroy_model_parallel()
        pytest.fail("the module left megatron-core's model-parallel state initialized", pytrace=False)


#: variables the guard leaves alone: pytest's own (set anew in each phase of a test) and those torch's
#: compiler stack (inductor, its Triton launcher) sets once for the process to find its caches and tools
NOT_GUARDED = ("PYTEST_CURRENT_TEST", "KMP_DUPLICATE_LIB_OK", "CUDA_HOME", "CUBLAS_WORKSPACE_CONFIG")
NOT_GUARDED_PREFIXES = ("TORCHINDUCTOR_", "_TORCHINDUCTOR_", "TRITON_")


@pytest.fixture(autouse=True)
def _environment_unchanged():
    """Fails a test that leaves ``os.environ`` changed, and restores it for the next test."""
    before = dict(os.environ)
    yield
    after = dict(os.environ)
    for env in (before, after):
        for name in [k for k in env if k in NOT_GUARDED or k.startswith(NOT_GUARDED_PREFIXES)]:
            del env[name]
    if after != before:
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        for k in changed:
            if k in before:
                os.environ[k] = before[k]
            else:
                os.environ.pop(k, None)
        pytest.fail(f"the test changed os.environ: {', '.join(changed)}", pytrace=False)
