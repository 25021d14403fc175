#!/usr/bin/env bash
# The main job on its embedded default: the CPU tiny example (examples/cpu_tiny.sh) end to end on a
# fresh machine: a seeded synthetic SWE-like rollout set is generated, converted into a rollout-tree
# dataset, and a tiny hybrid KDA/MLA MoE model trains on it for 12 iterations with 2 gloo processes
# (--tree-sharing within); prints the loss curve's first and last values and the tree/expanded token ratio.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OUT=${OUT:-out/quickstart} PYTHON=.venv/bin/python bash examples/cpu_tiny.sh "$@"
