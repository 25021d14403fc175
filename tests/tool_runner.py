"""Run a tools/*.py CLI in-process, as its ``__main__`` does (test helper only)."""
import importlib.util
import os

import pytest

from megatron_harts.cli import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_tool(name: str, folder: str = "tools"):
    """The module of ``<folder>/<name>.py`` (a tool, or with ``folder="benchmarks"`` a benchmark)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, folder, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_tool(tool, capsys, *argv):
    """Run ``tool.main`` through megatron_harts.cli.run; returns (exit status, stdout, stderr)."""
    with pytest.raises(SystemExit) as e:
        run(tool.main, [str(a) for a in argv])
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def assert_one_error(code, err, *needles):
    """Exit status 2 and exactly one ``error:`` line on stderr, naming every needle."""
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    for n in needles:
        assert n in lines[0], (n, lines[0])
