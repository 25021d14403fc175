#!/usr/bin/env bash
# The multi-GPU validation (benchmarks/validate_parallel.py) in one command on a GPU node.
#
#   bash scripts/device_validate.sh PRESET NPROC SECONDS CONFIG...
#   e.g. on a node of 4 GPUs:
#   bash scripts/device_validate.sh h200-fp32 4 540 dp tp-sp ep tp-sp-ep pp pp4 tp-sp-pp
#   VALIDATE_FLAGS=--schedules-only bash scripts/device_validate.sh h200-pp 4 540 pp4   # + NPROC 2: pp
#
# Installs the wheels in .whl/ (megatron-core 0.16.1, fla-core 0.6.0; for a node without network), then runs the
# configurations with one Triton/TorchInductor cache for all launches (kernels compile and
# autotune once per machine, not once per configuration; a cold machine still spends minutes on
# the first configuration), finishing within SECONDS (configurations that would start with under a
# minute left are skipped and say so).  TRITON_MAX_CONFIGS=n caps fla's autotuning (fidelity runs:
# numerics do not depend on it); VALIDATE_FLAGS adds flags (e.g. "--schedules-only"), DRIVER_FLAGS
# adds training-driver flags to every run (e.g. "--tree-kda-backend reference").  Results: $OUT/<preset>/multi_gpu_<preset>_<config>.json (one per
# configuration, failed runs with the first error of their log) and $OUT/logs.tgz (every launch
# log).
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ $# -lt 4 ]]; then
  echo "usage: bash scripts/device_validate.sh PRESET NPROC SECONDS CONFIG..." >&2
  exit 2
fi
PRESET=$1 NPROC=$2 SECONDS_LEFT=$3
shift 3
OUT="${OUT:-out/device_validate}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
extra=()
[[ -n "${TRITON_MAX_CONFIGS:-}" ]] && extra+=(--triton-max-configs "$TRITON_MAX_CONFIGS")
# shellcheck disable=SC2206
[[ -n "${VALIDATE_FLAGS:-}" ]] && extra+=($VALIDATE_FLAGS)
[[ -n "${DRIVER_FLAGS:-}" ]] && extra+=("--driver-flags=$DRIVER_FLAGS")
python3 benchmarks/validate_parallel.py --preset "$PRESET" --nproc "$NPROC" --configs "$@" \
    --out "$OUT/$PRESET" --work /tmp/harts-validate --cache-dir /tmp/harts-cache \
    --deadline "$SECONDS_LEFT" --keep-logs "${extra[@]}" 2>&1 | grep -v -i "warn"
rc=${PIPESTATUS[0]}
tar czf "$OUT/logs.tgz" -C "$OUT/$PRESET" logs && rm -rf "$OUT/$PRESET/logs"
exit "$rc"
