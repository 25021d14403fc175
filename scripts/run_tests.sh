#!/usr/bin/env bash
# Set up ./.venv and run the whole test suite on two worker processes (pytest-xdist; a file's tests stay
# on one worker, so its module fixtures are built once).  Extra arguments go to pytest; `-n 0` runs it
# in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -n 2 --dist loadfile tests "$@"
