"""Conventions shared by the command-line tools in tools/.

A tool's ``main(argv)`` raises TreeFormatError (or ``CliError`` for bad flags)
on bad input; ``run`` turns that into one line on stderr and exit status 2,
never a traceback.  Its parser is ``ArgumentParser``, whose own refusals (an
unknown flag, a missing or malformed value) end the same way.  Warnings print as
one ``warning:`` line each.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from typing import Callable, Optional, Sequence

from .tree_data.errors import TreeFormatError


class CliError(Exception):
    """A bad flag or argument; the message names it."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose refusals are one ``error: <message>`` line on stderr and exit status 2
    (no usage block); ``--help`` still prints the flags and exits 0."""

    def error(self, message: str):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def require_path(path: str, flag: str, *, kind: str = "file") -> str:
    """``path`` when it exists; else ``CliError`` naming ``flag`` and the path.  ``kind="dir"``
    requires a directory, ``kind="prefix"`` a file or a dataset prefix (``PREFIX.idx``)."""
    if kind == "dir":
        ok = os.path.isdir(path)
    elif kind == "prefix":
        ok = os.path.isfile(path) or os.path.isfile(path + ".idx")
    else:
        ok = os.path.isfile(path)
    if not ok:
        what = {"dir": "no such directory", "prefix": "no such file or dataset prefix"}.get(kind, "no such file")
        raise CliError(f"{flag} {path}: {what}")
    return path


def output_path(path: str, flag: str) -> str:
    """``path`` when a file can be written there (its directory exists and it is no directory);
    else ``CliError`` naming ``flag``.  Checked before a long run, so that it fails at once."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise CliError(f"{flag} {path}: is a directory; name a file")
    if not os.path.isdir(folder):
        raise CliError(f"{flag} {path}: the directory {folder} does not exist")
    return path


def _one_line_warning(message, category, filename, lineno, file=None, line=None):
    print(f"warning: {message}", file=sys.stderr)


def run(main: Callable[[Optional[Sequence[str]]], object], argv: Optional[Sequence[str]] = None) -> None:
    """Run ``main(argv)`` as a command: its int return is the exit status (None or a results
    object: 0); bad input it raises is one ``error:`` line and exit status 2."""
    warnings.showwarning = _one_line_warning
    try:
        code = main(argv)
    except (TreeFormatError, CliError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except BrokenPipeError:  # the reader (e.g. `head`) went away: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)    # a main that returns its results succeeded


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


def print_table(rows: Sequence[tuple], header: Optional[tuple] = None) -> None:
    """Left-aligned text table."""
    table = ([header] if header else []) + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(str(r[k])) for r in table) for k in range(len(table[0]))]
    for n, r in enumerate(table):
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
        if header and n == 0:
            print("  ".join("-" * w for w in widths))


class Progress:
    """A one-line progress counter on stderr (redrawn in place on a terminal)."""

    def __init__(self, label: str, total: Optional[int] = None, unit: str = "items"):
        self.label, self.total, self.unit = label, total, unit
        self.done = 0
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.tty = sys.stderr.isatty()

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if self.tty and now - self.last > 0.1:
            self.last = now
            self._draw("\r")

    def _draw(self, lead: str) -> None:
        total = f"/{self.total}" if self.total else ""
        rate = self.done / max(now_elapsed := time.perf_counter() - self.t0, 1e-9)
        print(f"{lead}{self.label}: {self.done}{total} {self.unit} ({rate:,.0f}/s, {now_elapsed:.1f}s)",
              end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        self._draw("\r" if self.tty else "")
        print(file=sys.stderr)


def cost_model_from_flags(calibration: Optional[str], chunk_size: Optional[int]):
    """The planner's cost model of the tools' ``--calibration FILE`` and ``--chunk-size B`` flags:
    the calibrated coefficients (defaults without a file) at ``chunk_size`` when given."""
    from .planner.cost_model import CalibrationError, CostModel, load_calibration
    model = CostModel()
    if calibration:
        try:
            model = load_calibration(calibration)
        except CalibrationError as e:
            raise CliError(str(e)) from None
    if chunk_size is not None:
        model = CostModel(model.coefficients, chunk_size=chunk_size, source=model.source)
    return model
