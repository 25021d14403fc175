"""Data flows one way: lower layers never import higher ones; tree_data and planner never import torch."""
import subprocess
import sys

import pytest

ORDER = ["tree_data", "planner", "layout", "ops", "models", "testing", "rl", "schedules", "training", "integrations"]
HIGHER = {name: ORDER[i + 1:] for i, name in enumerate(ORDER)}


@pytest.mark.parametrize("layer", ["tree_data", "planner", "layout", "ops", "models", "testing", "training"])
def test_layer_imports_nothing_above_it(layer):
    code = (
        "import sys, importlib\n"
        f"importlib.import_module('megatron_harts.{layer}')\n"
        f"above = {HIGHER[layer]!r}\n"
        "bad = sorted(m for m in sys.modules for h in above if m == 'megatron_harts.' + h "
        "or m.startswith('megatron_harts.' + h + '.'))\n"
        "print(','.join(bad))\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "", f"megatron_harts.{layer} imports higher layers: {out[0]}"
    if layer in ("tree_data", "planner"):
        assert out[1] == "False", f"megatron_harts.{layer} imports torch"
