#!/usr/bin/env bash
# Set up ./.venv and run the whole test suite on two worker processes (pytest-xdist; a file's tests stay
# on one worker, so its module fixtures are built once), the files and each file's tests in a seeded
# random order (tests/conftest.py's --shuffle; the seed, from the commit, is printed in pytest's header;
# --no-loadscope-reorder keeps that order: by default xdist hands out the files with the most tests
# first, which leaves the few-test multi-process files, the slowest, to the end of one worker).
# Then, when no arguments are given, the files of tests/one_process.txt once more in this one process in
# another order: the suite must pass in any order, on workers and in one process.
# Extra arguments go to the first run's pytest; `-n 0` runs it in this process.  TEST_SHUFFLE_SEED=N
# replays an order.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
head=$(git rev-parse --short=6 HEAD 2> /dev/null || echo 0)
seed=${TEST_SHUFFLE_SEED:-$((16#$head))}
.venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --shuffle "$seed" tests "$@"
if [ $# -eq 0 ]; then
  mapfile -t files < <(grep -v '^#' tests/one_process.txt | grep .)
  echo "run_tests: ${#files[@]} files of tests/one_process.txt in one process, --shuffle $((seed + 1))"
  .venv/bin/python -m pytest -n 0 --shuffle "$((seed + 1))" "${files[@]}"
fi
