"""Shared fixtures of the test suite."""
import os

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
