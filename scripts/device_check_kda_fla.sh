#!/usr/bin/env bash
# The fla KDA backend on a GPU node: its tests and the backend timing.
#
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD && bash scripts/device_check_kda_fla.sh [all|fp32|bf16|bench]
#
# (.whl/ holds the wheel of fla-core 0.6.0 on a node without network.)  Results go to $OUT (or ./out/kda_fla):
# tests_fp32.log, tests_bf16.log (pytest), figures.jsonl (the accuracy figures the tests report),
# bench.json and bench.log (timing).
#
# Compile time dominates: fla autotunes ~150 Triton configs per kernel set, dtype and (H, K, V).
# Measured on a fresh H200 (2026-11-29): the fp32 stage with 4 configs per kernel ran 13 tests in
# 540 s and was cut there; the bench plus the bf16 tree test with 1 config per kernel took 59 s.
# So stages are separate (one 10-minute call each if need be), and the config limits below
# (TEST_MAX_CONFIGS, BENCH_MAX_CONFIGS; 0 = full autotuning) trade tuned timings for compile time.
# fp32 tests run with TRITON_F32_DEFAULT=ieee (Triton's default computes fp32 dots in tf32); the
# bf16 tests and the timing run with Triton's defaults, as training does.
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE="${1:-all}"
OUT="${OUT:-out/kda_fla}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KDA_FLA_REPORT="$OUT/figures.jsonl"
TEST_MAX_CONFIGS="${TEST_MAX_CONFIGS:-4}"
BENCH_MAX_CONFIGS="${BENCH_MAX_CONFIGS:-1}"
nvidia-smi -L
python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)"
rc=0
if [[ "$STAGE" == all || "$STAGE" == fp32 ]]; then
  TRITON_F32_DEFAULT=ieee KDA_FLA_TEST_MAX_CONFIGS="$TEST_MAX_CONFIGS" python3 -m pytest -q --noconftest \
      -p no:cacheprovider tests/test_kda_fla.py -k "not bf16" 2>&1 | tee "$OUT/tests_fp32.log" || rc=1
fi
if [[ "$STAGE" == all || "$STAGE" == bf16 ]]; then
  KDA_FLA_TEST_MAX_CONFIGS="$BENCH_MAX_CONFIGS" python3 -m pytest -q --noconftest -p no:cacheprovider \
      tests/test_kda_fla.py -k "bf16" 2>&1 | tee "$OUT/tests_bf16.log" || rc=1
fi
if [[ "$STAGE" == all || "$STAGE" == bench ]]; then
  python3 benchmarks/bench_kda_backends.py --rows 4096 --heads 16 --head-dim 128 --dtype bf16 \
      --max-configs "$BENCH_MAX_CONFIGS" --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" || rc=1
fi
echo "figures:"
cat "$OUT/figures.jsonl" 2>/dev/null
exit $rc
