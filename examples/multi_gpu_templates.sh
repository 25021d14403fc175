#!/usr/bin/env bash
# Launch templates for one node of 8 GPUs (edit sizes to your model; every flag is Megatron-LM's
# except the --tree-* and RL ones).  Pick one with: bash examples/multi_gpu_templates.sh {dp,tp,ep} DATA
# dp: 8 data-parallel replicas; tp: TP 2 (sequence parallel) x DP 4; ep: EP 8 (experts spread) x DP 8
# (expert parallelism runs the replicas in lockstep: all-to-all dispatcher, sharing within microbatches).
# DATA is a dataset prefix (DATA.idx) or a trajectory file; checkpoints and TensorBoard logs go
# under OUT (default out/multi_gpu).  A bad template or a missing DATA is one error: line, exit status 2.
set -euo pipefail
cd "$(dirname "$0")/.."
USAGE="usage: bash examples/multi_gpu_templates.sh {dp,tp,ep} DATA"
if [ $# -lt 2 ]; then
  echo "error: expected a template and a data prefix, got $# argument(s) ($USAGE)" >&2; exit 2
fi
if [ $# -gt 2 ]; then
  echo "error: unexpected argument(s) after DATA: ${*:3} (edit the template's flags instead; $USAGE)" >&2; exit 2
fi
KIND=$1
DATA=$2
case "$KIND" in
  dp) PAR=() ;;
  tp) PAR=(--tensor-model-parallel-size 2 --sequence-parallel) ;;
  ep) PAR=(--expert-model-parallel-size 8 --moe-token-dispatcher-type alltoall --tree-sharing within) ;;
  *) echo "error: unknown template $KIND (dp, tp, ep)" >&2; exit 2 ;;
esac
if [ ! -f "$DATA" ] && [ ! -f "$DATA.idx" ]; then
  echo "error: DATA $DATA: no such trajectory file or dataset prefix ($DATA.idx)" >&2; exit 2
fi
PY=${PYTHON:-python3}
OUT=${OUT:-out/multi_gpu}
MODEL=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 --swiglu
  --disable-bias-linear --multi-latent-attention --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64
  --v-head-dim 128 --linear-attention-freq 4 --linear-key-head-dim 128 --linear-value-head-dim 128
  --num-experts 64 --moe-router-topk 8 --moe-ffn-hidden-size 1024 --moe-shared-expert-intermediate-size 1024
  --moe-layer-freq "([0]+[1]*23)" --moe-router-score-function sigmoid --moe-router-enable-expert-bias
  --moe-router-topk-scaling-factor 2.446 --moe-aux-loss-coeff 0.001 --vocab-size 163840
  --untie-embeddings-and-output-weights --bf16 --use-distributed-optimizer)
TRAIN=(--seq-length 32768 --tree-microbatch-tokens 32768 --global-batch-size 256 --train-iters 1000
  --lr 1e-6 --min-lr 1e-7 --lr-decay-style cosine --lr-warmup-iters 10 --clip-grad 1.0 --seed 1234
  --rl-objective ppo --clip-ratio-low 0.2 --clip-ratio-high 0.28 --loss-agg-mode token-mean
  --tree-sharing windows --data-path "$DATA" --save "$OUT/ckpt" --save-interval 100 --load "$OUT/ckpt"
  --log-interval 1 --tensorboard-dir "$OUT/tb" --exit-signal-handler)
mkdir -p "$OUT"
exec "$PY" -m torch.distributed.run --nproc-per-node 8 pretrain_tree_gpt.py "${MODEL[@]}" "${TRAIN[@]}" "${PAR[@]}"
