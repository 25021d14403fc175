"""Run a tools/*.py CLI in-process, as its ``__main__`` does (test helper only)."""
import importlib.util
import os

import pytest

from megatron_harts.cli import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_tool(name: str):
    """The module of ``tools/<name>.py``."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_tool(tool, capsys, *argv):
    """Run ``tool.main`` through megatron_harts.cli.run; returns (exit status, stdout, stderr)."""
    with pytest.raises(SystemExit) as e:
        run(tool.main, [str(a) for a in argv])
    out = capsys.readouterr()
    return e.value.code, out.out, out.err
