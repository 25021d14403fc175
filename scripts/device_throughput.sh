#!/usr/bin/env bash
# The single-GPU throughput table, on a GPU node (megatron-core and fla-core installed, or their wheels in .whl/):
#
#   bash scripts/device_throughput.sh [SECONDS] [STAGE...]
#
# Stages, each its own bench_throughput run with its share of SECONDS (default 540) as a deadline,
# results as JSON in $OUT (or ./out/throughput); $ITERS timed steps per mode (default 1):
#   fidelity    benchmarks/step_fidelity.py: one bf16 step, expanded / expanded repacked / within / windows
#   step-wise   the paper-level Step-wise batch (46 trajectories, 16k-row microbatches), within and windows
#               (the default memory budget, every producer recomputed, every producer kept) against expanded
#   tree-step   a Tree-Step batch at the paper's within-microbatch compression (116 trajectories, 656k tokens,
#               L1 3.91x at 16k rows; forest 4.89x), the same modes, and within with the KDA call plans of the
#               ablation (--kda-call-plans per-depth node-wise)
#   tree-step-s9  a larger Tree-Step batch (118 trajectories, 873k tokens, L1 3.17x)
#   attention   benchmarks/bench_tree_attention.py (flex and varlen vs causal SDPA) on both schemes at
#               head dims 128/128, 192/128 (MLA of h200-2k) and 96/64 (MLA of h200)
#   tests       the device-side tests (fla KDA, tree attention incl. flash-attn-4's kernels, the fused kernels, grouped
#               experts, the KDA input recompute, compaction on the GPU; the CPU-sized tests of those files left out),
#               Triton autotuning capped at one config (KDA_FLA_TEST_MAX_CONFIGS=1: minutes of compiles less;
#               results do not depend on the config); pytest's summary into $OUT/device-tests.txt
#   memory      the Tree-Step batch within vs expanded at both presets with --memory-profile (the bytes
#               alive at each mode's peak by allocation site), without the logit-cosine sample
#   large       both batches on preset h200-2k (hidden 2048), without the logit-cosine sample; Tree-Step
#               windows under the default memory budget and with every producer recomputed (kept: out of
#               memory at hidden 2048)
#   kimi        preset kimi48b-layers, 16k-token Step-wise and Tree-Step batches in 32k-row microbatches,
#               within against expanded
#   kimi-profile  preset kimi48b-layers, a one-task Step-wise batch, within and expanded profiled (--profile,
#               --profile-stacks, --memory-profile: where the step's time goes, what is alive at its peak)
#   kimi-64k, kimi-128k, h200-64k, h200-128k
#               one rollout of 64k- / 128k-token trajectories per scheme at preset kimi48b-layers / h200 (Tree-Step:
#               up to 6 leaves, forks of 2 at several turns), in
#               pieces of at most 32k rows, within against expanded; warm-up steps train the batch's longest
#               trajectory and one forking from it (--warmup-trajectories 1: an expanded 128k step takes minutes); STAGE@SCHEME
#               (e.g. kimi-128k@tree-step) runs one scheme only; MB=16384 sets the kimi stages' microbatch rows
#   gpu-check   a quick look before long stages: the GPU tests of the KDA short convolution's kernels
#               (tests/test_path_conv.py) and one tiny-preset step per mode through the driver on the GPU
#               (fla's kernels, the fused SwiGLU, the dispatcher, windows); fails the script's status if either fails
#   logprobs    benchmarks/bench_logprobs.py: the output layer's log-probs at vocabulary 163,840
#   compaction  benchmarks/bench_compaction.py: compaction traces against re-prefill samples, all sets
#   long        bench_compaction.py --set long-mixed at context budget 8192: the four modes with the profile
#               split of each and the table of what the device waited for; long@kv or long@reprefill runs one
#               form (the four modes take about 8 minutes on one H100: two calls of one form each)
#   long-pieces bench_compaction.py --set long-mixed --piece-study at full size: the traces in tree mode in
#               pieces (keep auto, keep none) and uncut at a row budget above the longest trace (the uncut
#               run needs more memory than an H100 has: an H200)
# A stage named STAGE=N gets N seconds instead of its share.  Default: fidelity step-wise tree-step.  With flash-attn-4 installed (docs/gpu_setup.md), MLA runs its
# varlen kernels in both modes.
set -uo pipefail
cd "$(dirname "$0")/.."
SECONDS_LEFT="${1:-540}"
shift || true
STAGES=("$@")
[[ ${#STAGES[@]} -eq 0 ]] && STAGES=(fidelity step-wise tree-step)
OUT="${OUT:-out/throughput}"
ITERS="${ITERS:-1}"     # timed steps per mode (median); single steps of a host-bound step move by ~15%
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
# the second entry: flash-attn-4's CuTe DSL where it was installed into /tmp/site (then both modes' MLA
# attention runs its kernels); without it, torch's kernels and FlexAttention
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
fixed=0; nfixed=0
for st in "${STAGES[@]}"; do [[ "$st" == *=* ]] && { fixed=$((fixed + ${st#*=})); nfixed=$((nfixed + 1)); }; done
rest=$(( ${#STAGES[@]} - nfixed ))
default_share=$(( rest > 0 ? (SECONDS_LEFT - fixed) / rest : 0 ))
quiet() { grep -v -i -E "warn|Unknown MLP|Rerun"; }
BENCH=(python3 benchmarks/bench_throughput.py --iters "$ITERS" --tree-sharing within windows --recompute-producers
       --keep-producers
       --driver-flags "--tree-triton-max-configs 1")
STEPWISE=(--schemes step-wise --num-tasks 2 --max-tokens 16384 --microbatch-tokens 16384)
TREESTEP=(--schemes tree-step --num-tasks 1 --samples-per-task 12 --max-tokens 6144 --microbatch-tokens 16384)
TREESTEP_S9=(--schemes tree-step --num-tasks 1 --samples-per-task 8 --max-tokens 8192 --microbatch-tokens 16384)
KIMI=(python3 benchmarks/bench_throughput.py --preset kimi48b-layers --iters "$ITERS" --tree-sharing within windows
      --no-cosine --microbatch-tokens "${MB:-32768}" --driver-flags "--tree-triton-max-configs 1")
rc=0
for entry in "${STAGES[@]}"; do
  stage="${entry%%=*}"
  scheme=""; schemes=(step-wise tree-step)
  [[ "$stage" == *@* ]] && { scheme="${stage#*@}"; schemes=("$scheme"); stage="${stage%%@*}"; }
  share=$default_share
  [[ "$entry" == *=* ]] && share="${entry#*=}"
  case "$stage" in
    fidelity) timeout "$share" python3 benchmarks/step_fidelity.py --num-tasks 3 --max-tokens 4096 \
                --microbatch-tokens 8192 --modes off off:4096 within windows \
                --driver-flags "--tree-triton-max-configs 1" --out "$OUT/step-fidelity.json" 2>&1 | quiet ;;
    step-wise) timeout "$share" "${BENCH[@]}" "${STEPWISE[@]}" --out "$OUT/step-wise-16k.json" 2>&1 | quiet ;;
    # with the ablation of the KDA call plans (per-depth bucketing, node-wise) on the same batch, same run
    tree-step) timeout "$share" "${BENCH[@]}" "${TREESTEP[@]}" --kda-call-plans per-depth node-wise \
                 --out "$OUT/tree-step-16k.json" 2>&1 | quiet ;;
    tree-step-s9) timeout "$share" "${BENCH[@]}" "${TREESTEP_S9[@]}" --out "$OUT/tree-step-s9-16k.json" 2>&1 | quiet ;;
    large) timeout $((share / 2)) "${BENCH[@]}" --preset h200-2k --no-cosine "${STEPWISE[@]}" \
             --out "$OUT/large-step-wise-16k.json" 2>&1 | quiet
           timeout $((share / 2)) python3 benchmarks/bench_throughput.py --iters "$ITERS" --preset h200-2k --no-cosine \
             --tree-sharing within windows --recompute-producers --driver-flags "--tree-triton-max-configs 1" \
             "${TREESTEP[@]}" --out "$OUT/large-tree-step-16k.json" 2>&1 | quiet ;;
    kimi) timeout $((share * 2 / 5)) "${KIMI[@]}" --tree-sharing within --schemes step-wise --num-tasks 2 \
            --max-tokens 16384 --out "$OUT/kimi48b-step-wise-16k.json" 2>&1 | quiet
          timeout $((share * 3 / 5)) "${KIMI[@]}" --tree-sharing within --schemes tree-step --num-tasks 2 \
            --max-tokens 16384 --out "$OUT/kimi48b-tree-step-16k.json" 2>&1 | quiet ;;
    kimi-profile) timeout "$share" "${KIMI[@]}" --tree-sharing within --schemes step-wise --num-tasks 1 \
            --max-tokens 16384 --profile "$OUT/profile-kimi48b.txt" --profile-stacks --memory-profile \
            --out "$OUT/kimi48b-profile.json" 2>&1 | quiet ;;
    kimi-64k|kimi-128k|h200-64k|h200-128k)
          preset="${stage%%-*}"; [[ "$preset" == kimi ]] && preset=kimi48b-layers
          [[ "$stage" == *-64k ]] && T=65536 || T=131072
          timeout "$share" "${KIMI[@]}" --preset "$preset" --tree-sharing within --schemes "${schemes[@]}" \
            --num-tasks 1 --samples-per-task 1 --max-leaves 6 --branch-prob 0.15 --branch-factor 2 \
            --max-tokens "$T" --max-turns 64 --observation-median 6000 --warmup-trajectories 1 \
            --out "$OUT/$preset-$T${scheme:+-$scheme}${MB:+-mb$MB}.json" 2>&1 | quiet ;;
    gpu-check) timeout $((share / 2)) python3 -m pytest -q -rs -p no:cacheprovider -W ignore tests/test_path_conv.py \
                 -k "fla or gpu" 2>&1 | tail -5
               st=${PIPESTATUS[0]}
               [[ $st -eq 124 ]] && echo "gpu-check: the conv kernel tests passed the stage's $((share / 2)) s" \
                                         "(Triton compiles; give gpu-check more seconds)" >&2
               [[ $st -eq 0 ]] || rc=1
               timeout $((share / 2)) python3 benchmarks/bench_throughput.py --preset tiny --schemes tree-step \
                 --num-tasks 1 --max-tokens 4096 --microbatch-tokens 2048 --tree-sharing within windows --iters 1 \
                 --recompute-producers --no-cosine --driver-flags "--tree-triton-max-configs 1" \
                 --out "$OUT/gpu-check.json" 2>&1 | quiet ;;
    logprobs) timeout "$share" python3 benchmarks/bench_logprobs.py --out "$OUT/logprobs.json" 2>&1 | quiet ;;
    compaction) timeout "$share" python3 benchmarks/bench_compaction.py --tree-sharing within \
                  --driver-flags "--tree-triton-max-configs 1" --out "$OUT/compaction.json" 2>&1 | quiet ;;
    tests) KDA_FLA_TEST_MAX_CONFIGS=1 timeout $((share / 2)) python3 -m pytest -q -rs -p no:cacheprovider -W ignore \
             tests/test_kda_fla.py tests/test_tree_kda.py tests/test_triton_launch.py tests/test_tree_attention.py \
             tests/test_norm.py tests/test_grouped_experts.py \
             2>&1 | grep -v "^  " | tee "$OUT/device-tests.txt" | tail -25
           st=${PIPESTATUS[0]}
           # the GPU tests of the files that also hold many CPU-sized tests, selected by name
           KDA_FLA_TEST_MAX_CONFIGS=1 timeout $((share / 2)) python3 -m pytest -q -rs -p no:cacheprovider -W ignore \
             tests/test_kda_input_recompute.py tests/test_fa4_blocks.py tests/test_moe_gather.py \
             tests/test_kda_elementwise.py tests/test_router_topk.py tests/test_path_conv.py \
             tests/test_interval_attention.py tests/test_compaction_gpu.py -k "cuda or gpu or fla or fa4 or triton" \
             2>&1 | grep -v "^  " | tee -a "$OUT/device-tests.txt" | tail -25
           st2=${PIPESTATUS[0]}
           (( st == 0 && st2 == 0 )) ;;
    memory) for preset in h200 h200-2k; do
              timeout $((share / 2)) python3 benchmarks/bench_throughput.py --iters "$ITERS" --tree-sharing within \
                --driver-flags "--tree-triton-max-configs 1" --no-cosine --memory-profile --preset "$preset" \
                "${TREESTEP[@]}" --out "$OUT/memory-$preset-tree-step-16k.json" 2>&1 | quiet
            done ;;
    attention) for dims in "128 128" "192 128" "96 64"; do for sc in tree-step step-wise; do
                 timeout $((share / 6)) python3 benchmarks/bench_tree_attention.py --rows 32768 --scheme "$sc" \
                   --dims $dims --kernel-options '{"USE_TMA": true}' \
                   --json > "$OUT/attn-$sc-${dims// /-}.json" 2>/dev/null || rc=1
                 python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], d['summary'])" \
                   "$OUT/attn-$sc-${dims// /-}.json" 2>/dev/null
               done; done; true ;;
    long) forms=(reprefill kv); [[ -n "$scheme" ]] && forms=("$scheme")
          timeout "$share" python3 benchmarks/bench_compaction.py --set long-mixed --budgets 8192 --forms "${forms[@]}" \
            --driver-flags "--tree-triton-max-configs 1" --out "$OUT/long-8192${scheme:+-$scheme}.json" 2>&1 | quiet ;;
    long-pieces) timeout "$share" python3 benchmarks/bench_compaction.py --set long-mixed --budgets 8192 --piece-study \
                   --no-split --driver-flags "--tree-triton-max-configs 1" --out "$OUT/long-8192-pieces.json" 2>&1 | quiet ;;
    *) echo "unknown stage $stage (fidelity, step-wise, tree-step, tree-step-s9, tests, memory, attention, large," \
            "kimi, kimi-profile, kimi-64k, kimi-128k, h200-64k, h200-128k, gpu-check, logprobs, compaction, long," \
            "long-pieces)" >&2
       exit 2 ;;
  esac
  st=${PIPESTATUS[0]}
  [[ $st -eq 124 ]] && echo "$stage: stopped at its deadline ($share s)" >&2
  [[ $st -eq 0 ]] || rc=1
done
exit "$rc"
