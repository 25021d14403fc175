#!/usr/bin/env bash
# One H200: a Kimi-Linear-shaped hybrid MoE (12 layers, KDA:MLA 3:1, 32 experts top-8, bf16) on a
# synthetic SWE-like rollout set, trained in tree mode and then in expanded mode with the same flags
# (only --tree-sharing differs).  Prints both summaries and the speedup.
# Usage: bash examples/gpu_single_kimi.sh [extra flags]   (PYTHON, OUT, ITERS, GBS, MAXTOK, SCHEME override
# the defaults; MAXTOK caps trajectory length, microbatches hold 2 x MAXTOK rows).  Bad flags or
# settings are refused (one error: line, exit status 2) before anything is written.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-out/gpu_single}
ITERS=${ITERS:-6}
GBS=${GBS:-48}
MAXTOK=${MAXTOK:-8192}
SCHEME=${SCHEME:-tree-step}
if ! command -v "$PY" > /dev/null; then
  echo "error: PYTHON $PY: not found" >&2; exit 2
fi
for V in ITERS GBS MAXTOK; do
  if ! [[ ${!V} =~ ^[1-9][0-9]*$ ]]; then
    echo "error: $V=${!V}: must be a positive integer" >&2; exit 2
  fi
done
case "$SCHEME" in
  tree-step|step-wise) ;;
  *) echo "error: SCHEME=$SCHEME: must be tree-step or step-wise" >&2; exit 2 ;;
esac
MODEL=(--num-layers 12 --hidden-size 1024 --num-attention-heads 16 --ffn-hidden-size 4096 --swiglu
  --disable-bias-linear --multi-latent-attention --kv-lora-rank 256 --qk-head-dim 64 --qk-pos-emb-head-dim 32
  --v-head-dim 64 --linear-attention-freq 4 --linear-key-head-dim 64 --linear-value-head-dim 64
  --num-experts 32 --moe-router-topk 8 --moe-ffn-hidden-size 512 --moe-shared-expert-intermediate-size 512
  --moe-layer-freq "([0]+[1]*11)" --moe-router-score-function sigmoid --moe-router-enable-expert-bias
  --moe-router-topk-scaling-factor 2.5 --moe-router-num-groups 1 --moe-aux-loss-coeff 0.001
  --vocab-size 32000 --untie-embeddings-and-output-weights --bf16)
TRAIN=(--seq-length "$MAXTOK" --tree-microbatch-tokens $((2 * MAXTOK)) --global-batch-size "$GBS"
  --train-iters "$ITERS" --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 1 --clip-grad 1.0
  --seed 1234 --log-interval 1 --rl-objective sft --data-path "$OUT/rollouts")
# the driver's flag checks, before the data is generated (the report goes to a scratch folder here)
CHECK=$(mktemp -d)
trap 'rm -rf "$CHECK"' EXIT
if ! ERR=$("$PY" -W ignore -c 'import sys
from megatron_harts.training.arguments import parse_args_or_exit
parse_args_or_exit(sys.argv[1:])' "${MODEL[@]}" "${TRAIN[@]}" --tree-plan-report "$CHECK/report.jsonl" "$@" \
    2>&1 > /dev/null); then
  grep '^error:' <<< "$ERR" | tail -n 1 >&2 || echo "error: the flag check failed: $(tail -n 1 <<< "$ERR")" >&2
  exit 2
fi
mkdir -p "$OUT"
if [ ! -f "$OUT/rollouts.idx" ]; then
  "$PY" tools/synthesize_rollouts.py --output "$OUT/rollouts.jsonl" --scheme "$SCHEME" --num-tasks 16 \
      --samples-per-task 2 --max-tokens "$MAXTOK" --vocab-size 32000 --seed 0 > /dev/null
  "$PY" tools/convert_trajectories.py --input "$OUT/rollouts.jsonl" --output "$OUT/rollouts" --vocab-size 32000
fi
for MODE in within off; do
  rm -f "$OUT/$MODE.jsonl"
  "$PY" -m torch.distributed.run --nproc-per-node 1 pretrain_tree_gpt.py "${MODEL[@]}" "${TRAIN[@]}" \
      --tree-sharing "$MODE" --tree-plan-report "$OUT/$MODE.jsonl" "$@"
done
"$PY" examples/summarize_run.py "$OUT/within.jsonl" "$OUT/off.jsonl"
