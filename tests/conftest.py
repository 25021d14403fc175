"""Shared fixtures of the test suite."""
import pytest

import megatron_harts.patches as patches
from megatron_cpu import megatron_cpu


@pytest.fixture(scope="module")
def cpu_world():
    """megatron-core patched (explicitly) and running as a one-process gloo world on the CPU."""
    patches.apply()
    with megatron_cpu():
        yield
    patches.undo()
