#!/usr/bin/env bash
# Create ./.venv (once) and install megatron_harts with its test and bench extras into it
# (bench brings OR-Tools, so the planner baseline that uses it is tested too).
# Safe to re-run: pip skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# the CPU build of torch first, so that no dependency pulls a CUDA build
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,bench]"
