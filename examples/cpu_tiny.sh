#!/usr/bin/env bash
# A tiny hybrid KDA/MLA MoE model trained on CPU by 2 gloo processes (data parallel 2) on a
# seeded synthetic SWE-like rollout set generated here.  Prints the loss curve's first and last
# values and the tree/expanded token ratio.  Usage: bash examples/cpu_tiny.sh [extra flags]
# (e.g. --tree-sharing off for the expanded baseline; PYTHON=.venv/bin/python and OUT=out/cpu_tiny
# by default).  Bad flags are refused (one error: line, exit status 2) before anything is written.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-out/cpu_tiny}
if ! command -v "$PY" > /dev/null; then
  echo "error: PYTHON $PY: not found (run scripts/setup.sh first)" >&2; exit 2
fi
FLAGS=(--num-layers 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --swiglu --disable-bias-linear
  --multi-latent-attention --kv-lora-rank 32 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16
  --linear-attention-freq 2 --linear-key-head-dim 16 --linear-value-head-dim 16
  --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 32
  --moe-layer-freq "([0]+[1]*3)" --moe-router-score-function sigmoid --moe-router-enable-expert-bias
  --moe-router-topk-scaling-factor 2.5 --moe-aux-loss-coeff 0.001
  --vocab-size 512 --untie-embeddings-and-output-weights --seq-length 600 --tree-microbatch-tokens 1024
  --global-batch-size 16 --train-iters 12 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 2
  --clip-grad 1.0 --weight-decay 0.01 --seed 1234 --log-interval 1 --distributed-backend gloo
  --tree-chunk-size 16 --rl-objective sft --data-path "$OUT/rollouts")
# the driver's flag checks, before the data is generated: a refusal is its one error: line (the
# report goes to a scratch folder here, since $OUT is not made yet)
CHECK=$(mktemp -d)
trap 'rm -rf "$CHECK"' EXIT
if ! ERR=$("$PY" -W ignore -c 'import sys
from megatron_harts.training.arguments import parse_args_or_exit
parse_args_or_exit(sys.argv[1:])' "${FLAGS[@]}" --tree-plan-report "$CHECK/report.jsonl" "$@" 2>&1 > /dev/null); then
  grep '^error:' <<< "$ERR" | tail -n 1 >&2 || echo "error: the flag check failed: $(tail -n 1 <<< "$ERR")" >&2
  exit 2
fi
mkdir -p "$OUT"
if [ ! -f "$OUT/rollouts.idx" ]; then
  "$PY" tools/synthesize_rollouts.py --output "$OUT/rollouts.jsonl" --scheme tree-step --num-tasks 12 \
      --samples-per-task 2 --prompt-median 120 --min-turns 2 --max-turns 4 --action-median 12 \
      --observation-median 24 --max-leaves 6 --max-tokens 600 --vocab-size 512 --seed 0 > /dev/null
  "$PY" tools/convert_trajectories.py --input "$OUT/rollouts.jsonl" --output "$OUT/rollouts" --vocab-size 512
fi
rm -f "$OUT/report.jsonl"
"$PY" -m torch.distributed.run --nproc-per-node 2 --master-port "${MASTER_PORT:-29517}" pretrain_tree_gpt.py \
    "${FLAGS[@]}" --tree-plan-report "$OUT/report.jsonl" "$@"
"$PY" examples/summarize_run.py "$OUT/report.jsonl"
