"""Shared fixtures of the test suite."""
import pytest

import megatron_harts.patches as patches
from megatron_cpu import megatron_cpu


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
