#!/usr/bin/env bash
# The main job on its embedded default: synthesize a SWE-like rollout set,
# convert it into a rollout-tree dataset, print its sharing statistics.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OUT=${OUT:-out/quickstart}
mkdir -p "$OUT"
.venv/bin/python tools/synthesize_rollouts.py --output "$OUT/swe_tree_step.jsonl.gz" --scheme tree-step --seed 0
.venv/bin/python tools/convert_trajectories.py --input "$OUT/swe_tree_step.jsonl.gz" --output "$OUT/swe_tree_step"
.venv/bin/python tools/tree_stats.py --input "$OUT/swe_tree_step"
