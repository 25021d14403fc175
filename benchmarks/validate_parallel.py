#!/usr/bin/env python3
"""Fidelity and throughput of tree mode under each parallel configuration.

For every configuration (``--configs``), with the training driver (pretrain_tree_gpt.py through
torch.distributed.run, ``--nproc`` processes) on the same SWE-like data and initial weights:

- ``expanded``: expanded training (``--tree-sharing off``), and ``expanded_rerun``: the same run
  again (the self-rerun baseline: what a run differs from itself);
- ``expanded_repacked``: expanded training with half the microbatch row budget (at least
  ``--seq-length``): the same computation in another evaluation order (other GEMM shapes, other
  attention blocks), the size of the differences any reordering brings (see below);
- first, unmeasured warm-up runs of both modes (``--warmup-iters``; their results are dropped: the
  first run of a process compiles and autotunes the Triton and FlexAttention kernels);
- ``tree``: tree mode (``windows``; ``within`` where expert parallelism refuses windows), and
  ``tree_recompute``: the same with full activation recomputation;
- pipeline configurations also run tree mode under the other two window schedules
  (``--tree-pp-schedule overlap`` and ``non-overlap``) and compare their tokens/s with the
  schedule simulator's prediction for the same plans (schedules/simulator.py, the planner's
  default cost model).

Each run logs per-iteration metrics (``--tree-plan-report``) and a logit probe of the first
global batch before the first step and after the last (``--tree-logit-probe``).  Against
``expanded``: mean token-wise logit cosine at both probes, absolute loss difference per
iteration, and each run's median step throughput.  Targets: tree cosine no more than 1e-5 below
the rerun's, |loss difference| < 2e-4.  MoE auxiliary losses are off (load balancing through the
router's expert bias): megatron defines them per microbatch, so they differ with the packing and
no two packings of one batch give the same loss (docs/design.md invariant 1).

With a bf16 or fp32 model the ``expanded`` run also probes an upcast copy of the initial weights
(``--tree-logit-probe-oracle``: fp32 for bf16, fp64 for fp32, plain-torch kernels): each run's
iteration-0 logits against it give the size of its own rounding, and tree mode meets the bf16 rule
of testing/fidelity.py when its deficit is at most 1.5x expanded mode's (+1e-6).  On one device an
expanded rerun's forward is bitwise identical (deficit 0), so the rerun baseline alone measures
training-time nondeterminism, not the rounding that tree mode's different evaluation order brings.
With top-k MoE routing that rounding is not small everywhere: a token whose k-th and (k+1)-th
router scores are nearly tied takes another expert under any other order, a discrete change of its
logits.  Each probe comparison therefore also gives the median token deficit (rounding) and the
tokens over 1e-3 (such flips), and tree runs are also judged against ``expanded_repacked``
(``cosine_below_repacked``, ``meets_cosine_target_repacked``), which pays the same flips.

Results: one JSON per configuration, ``OUT/multi_gpu_<preset>_<config>.json``, and a table.

    python benchmarks/validate_parallel.py --preset cpu-tiny --nproc 2 --out out/validate      # CPU, gloo, fp64
    python benchmarks/validate_parallel.py --preset h200 --nproc 2 --configs dp tp-sp --out benchmarks/results/x
"""
import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_harts.cli import ArgumentParser, CliError, run  # noqa: E402
from megatron_harts.testing.fidelity import BF16_COSINE_FACTOR, BF16_COSINE_FLOOR  # noqa: E402
from megatron_harts.training.compare import ProbeError, compare_runs, read_report, throughput  # noqa: E402
from megatron_harts.training.probe import ORACLE_DIR, compare_probes  # noqa: E402

COSINE_SLACK, LOSS_TOLERANCE = 1e-5, 2e-4

PRESETS = {
    # the examples/cpu_tiny.sh model in fp64 on gloo
    "cpu-tiny": dict(
        model="--num-layers 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --swiglu "
              "--disable-bias-linear --multi-latent-attention --kv-lora-rank 32 --qk-head-dim 16 "
              "--qk-pos-emb-head-dim 8 --v-head-dim 16 --linear-attention-freq 2 --linear-key-head-dim 16 "
              "--linear-value-head-dim 16 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 32 "
              "--moe-shared-expert-intermediate-size 32 --moe-layer-freq ([0]+[1]*3) "
              "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
              "--moe-router-topk-scaling-factor 2.5 --vocab-size 512 --untie-embeddings-and-output-weights "
              "--fp64 --distributed-backend gloo --tree-chunk-size 16",
        train="--seq-length 600 --tree-microbatch-tokens 1024 --global-batch-size 16 --lr 3e-3 --min-lr 3e-4 "
              "--lr-decay-style cosine --lr-warmup-iters 1",
        iters=3, probe_tokens=512, warmup_iters=0,
        data=dict(scheme="tree-step", num_tasks=12, samples_per_task=2, prompt_median=120, min_turns=2,
                  max_turns=4, action_median=12, observation_median=24, max_leaves=6, max_tokens=600,
                  vocab_size=512)),
    # Kimi-Linear-shaped MoE (examples/gpu_single_kimi.sh's model), bf16, NCCL
    "h200": dict(
        model="--num-layers 12 --hidden-size 1024 --num-attention-heads 16 --ffn-hidden-size 4096 --swiglu "
              "--disable-bias-linear --multi-latent-attention --kv-lora-rank 256 --qk-head-dim 64 "
              "--qk-pos-emb-head-dim 32 --v-head-dim 64 --linear-attention-freq 4 --linear-key-head-dim 64 "
              "--linear-value-head-dim 64 --num-experts 32 --moe-router-topk 8 --moe-ffn-hidden-size 512 "
              "--moe-shared-expert-intermediate-size 512 --moe-layer-freq ([0]+[1]*11) "
              "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
              "--moe-router-topk-scaling-factor 2.5 --vocab-size 32000 --untie-embeddings-and-output-weights "
              "--bf16",
        train="--seq-length 2048 --tree-microbatch-tokens 8192 --global-batch-size 24 --lr 1e-4 --min-lr 1e-5 "
              "--lr-decay-style cosine --lr-warmup-iters 1",
        iters=4, probe_tokens=512, warmup_iters=2,
        data=dict(scheme="tree-step", num_tasks=16, samples_per_task=2, max_tokens=2048, vocab_size=32000)),
}
PRESETS["cpu-tiny-fp32"] = dict(PRESETS["cpu-tiny"], model=PRESETS["cpu-tiny"]["model"].replace(" --fp64", ""))
# pipeline schedules side by side (--schedules-only): Step-wise trees far larger than a microbatch,
# so that a step has sharing windows (the schedule simulator predicts consumer 1F1B at 1.3x / 1.8x
# non-overlap on 2 / 4 stages for this batch: benchmarks/bench_pp_schedule.py --num-tasks 4
# --microbatch-tokens 16384 --schemes step-wise)
PRESETS["h200-pp"] = dict(
    PRESETS["h200"],
    train="--seq-length 16384 --tree-microbatch-tokens 16384 --global-batch-size 160 --lr 1e-4 --min-lr 1e-5 "
          "--lr-decay-style cosine --lr-warmup-iters 1",
    iters=3, warmup_iters=1,
    data=dict(scheme="step-wise", num_tasks=8, samples_per_task=4, max_tokens=16384, vocab_size=32000))
# fp32 end to end: Triton's fp32 dots (the fla KDA kernels) default to tf32, so the preset asks for IEEE fp32
PRESETS["h200-fp32"] = dict(PRESETS["h200"], model=PRESETS["h200"]["model"].replace(" --bf16", ""),
                            env={"TRITON_F32_DEFAULT": "ieee"})
#: the launch in flight and its spec file (:func:`_kill_launch` ends it and every worker it started)
_LAUNCH = {"proc": None, "spec": None}
COMMON = ("--clip-grad 1.0 --seed 1234 --log-interval 1 --rl-objective sft --moe-router-load-balancing-type none "
          "--hidden-dropout 0 --attention-dropout 0")
RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
CONFIGS = ("dp", "tp-sp", "ep", "tp-sp-ep", "pp", "pp4", "tp-sp-pp")
WARMUP = "warmup_"
REPACKED = "expanded_repacked"
SCHEDULE_RUNS = {"tree_overlap": "overlap", "tree_non_overlap": "non-overlap"}


def repacked_budget(train_flags: str):
    """The row budget of ``expanded_repacked``: half the preset's, at least its ``--seq-length`` (a trajectory
    never splits); None when that is the preset's own budget (no other packing to compare with)."""
    mbt = flag_value(train_flags, "--tree-microbatch-tokens")
    budget = max(flag_value(train_flags, "--seq-length"), mbt // 2)
    return None if budget >= mbt else budget


def config_flags(name: str, nproc: int):
    """(parallel flags, tree sharing mode) of a configuration on ``nproc`` processes, or None if it does not fit.
    Data parallelism takes the processes the other sizes leave (``nproc`` / (TP x PP))."""
    ep = f"--expert-model-parallel-size {nproc} --moe-token-dispatcher-type alltoall"
    table = {
        "dp": ("", "windows", 1),
        "tp-sp": ("--tensor-model-parallel-size 2 --sequence-parallel", "windows", 2),
        "ep": (ep, "within", 2),
        "tp-sp-ep": (f"--tensor-model-parallel-size 2 --sequence-parallel {ep} --expert-tensor-parallel-size 1",
                     "within", 2),
        "pp": ("--pipeline-model-parallel-size 2", "windows", 2),
        "pp4": ("--pipeline-model-parallel-size 4", "windows", 4),
        "tp-sp-pp": ("--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2",
                     "windows", 4),
    }
    flags, mode, need = table[name]
    if nproc < need or nproc % need:
        return None
    return flags, mode


def flag_value(flags: str, name: str, default: int = 1) -> int:
    """The integer value of ``name`` in a flag string (``default`` when absent)."""
    parts = flags.split()
    return int(parts[parts.index(name) + 1]) if name in parts else default


def make_data(preset: dict, directory: str, py: str) -> str:
    """Synthesize and convert the preset's rollout set once; returns the dataset prefix."""
    prefix = os.path.join(directory, "rollouts")
    if os.path.exists(prefix + ".idx"):
        return prefix
    os.makedirs(directory, exist_ok=True)
    d = dict(preset["data"])
    args = [py, os.path.join(ROOT, "tools", "synthesize_rollouts.py"), "--output", prefix + ".jsonl", "--seed", "0"]
    for k, v in d.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    subprocess.run([py, os.path.join(ROOT, "tools", "convert_trajectories.py"), "--input", prefix + ".jsonl",
                    "--output", prefix, "--vocab-size", str(d["vocab_size"])], check=True, stdout=subprocess.DEVNULL)
    return prefix


def launch_config(py: str, nproc: int, port: int, runs: dict, work: str, timeout: float, backend: str,
                  env: dict) -> dict:
    """Run one configuration's runs ``{name: flags}`` in order inside one torch.distributed.run launch
    (:func:`worker`: one process group, one CUDA context and kernel cache for all of them), each into
    ``work/<name>`` (report.jsonl, probe/, status.json), with ``env`` added to the environment; the
    launch's log is ``work/log.txt``.
    Returns {name: {"ok", "seconds", "report", "probe", "error"?}}."""
    if os.path.exists(work):
        shutil.rmtree(work)
    os.makedirs(work)
    spec = {"backend": backend, "runs": []}
    for name, flags in runs.items():
        d = os.path.join(work, name)
        spec["runs"].append({"name": name, "dir": d, "argv": flags.split() + [
            "--tree-plan-report", os.path.join(d, "report.jsonl"), "--tree-logit-probe", os.path.join(d, "probe")]})
    spec_path, log = os.path.join(work, "spec.json"), os.path.join(work, "log.txt")
    with open(spec_path, "w") as f:
        json.dump(spec, f, indent=1)
    cmd = [py, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port),
           os.path.abspath(__file__), "--worker", spec_path]
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                env={**os.environ, **env})
        _LAUNCH.update(proc=proc, spec=spec_path)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:       # the launcher and every worker it started
            rc = f"timeout after {timeout:.0f} s"
        _kill_launch()                          # also workers left behind by a launcher that exited
    with open(log) as f:
        lines = [ln.rstrip() for ln in f if ln.strip()]
    excerpt = log_excerpt(lines)
    out = {}
    for r in spec["runs"]:
        d = r["dir"]
        res = {"report": os.path.join(d, "report.jsonl"), "probe": os.path.join(d, "probe")}
        try:
            with open(os.path.join(d, "status.json")) as f:
                res.update(json.load(f))
        except (OSError, ValueError):
            errs = [ln for ln in lines if ln.startswith("error") or "Error:" in ln]
            res.update(ok=False, error=(errs[-3:] or lines[-5:]) + [f"launch exit {rc}; log: {log}"],
                       log_excerpt=excerpt)
        out[r["name"]] = res
    return out


def _kill_launch() -> None:
    """End the launch in flight and every worker it started.  torch.distributed.run starts each
    worker in a session of its own, so killing the launcher's process group leaves the workers
    running (holding their GPUs and ports): the launcher gets SIGTERM first (it stops its
    workers), then whatever is left of the launcher's group and every process of this launch's
    spec gets SIGKILL."""
    proc, spec = _LAUNCH["proc"], _LAUNCH["spec"]
    _LAUNCH["proc"] = None
    if proc is None:
        return
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for pid in _processes_with_argument(spec) if spec else []:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _processes_with_argument(arg: str) -> list:
    """Ids of the processes (Linux /proc) whose command line has ``arg`` as one argument."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if arg.encode() in argv:
            pids.append(int(entry))
    return pids


def _stopped(signum, frame):
    """SIGTERM / SIGINT (an outer ``timeout``, Ctrl-C): no launch outlives this script (its workers
    run in their own session and would keep the GPUs and ports of the next run)."""
    _kill_launch()
    raise SystemExit(128 + signum)


def log_excerpt(lines: list, limit: int = 40) -> list:
    """The first error of a launch log: from its first traceback (or first line naming an error,
    a worker's failure or a signal) on, at most ``limit`` lines, warnings left out."""
    keys = ("Traceback", "Error", "error:", "[worker] run", "Signal", "SIGSEGV", "core dumped")
    kept = [ln for ln in lines if "Warning" not in ln and "warnings.warn" not in ln]
    for i, ln in enumerate(kept):
        if any(k in ln for k in keys):
            return kept[i:i + limit]
    return kept[-limit:]


def worker(spec_path: str) -> int:
    """Inside torch.distributed.run: the spec's runs one after another, each ``Trainer(args).train()``
    exactly as pretrain_tree_gpt.py runs it, in one process group; rank 0 writes each run's status."""
    import logging
    import warnings
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    warnings.filterwarnings("ignore", module=r"megatron\.core")
    logging.getLogger("megatron.core").setLevel(logging.ERROR)
    from megatron_harts.training.arguments import parse_args
    from megatron_harts.training.trainer import Trainer, TrainingError
    with open(spec_path) as f:
        spec = json.load(f)
    if spec["backend"] == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(spec["backend"], timeout=timedelta(minutes=5))
    try:
        for r in spec["runs"]:
            os.makedirs(r["dir"], exist_ok=True)
            t0 = time.time()
            status = {"ok": True}
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            try:
                with Trainer(parse_args(r["argv"])) as t:
                    t.train()
            except (CliError, TrainingError) as e:   # every rank fails alike (flags, data): go on with the next run
                status = {"ok": False, "error": [f"{type(e).__name__}: {e}"]}
                print(f"[worker] run {r['name']} failed: {type(e).__name__}: {e}", flush=True)
            except BaseException:                    # ranks now disagree (collectives, kernels): end the launch
                print(f"[worker] run {r['name']} failed on rank {dist.get_rank()}:", flush=True)
                traceback.print_exc()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)
            status["seconds"] = round(time.time() - t0, 1)
            dist.barrier()
            if dist.get_rank() == 0:
                with open(os.path.join(r["dir"], "status.json"), "w") as f:
                    json.dump(status, f)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    return 0


def simulated_schedules(data_prefix: str, preset: dict, dp: int, stages: int, iters: int,
                        microbatch_tokens: int) -> dict:
    """The simulator's tokens/s of the three window schedules on the run's plans (replica 0, ``stages`` stages)."""
    from megatron_harts.schedules.simulator import SCHEDULES, simulate, step_from_plan
    from megatron_harts.training.data import TreeBatchLoader
    from megatron_harts.training.step import SharingSettings, plan_step
    settings = SharingSettings(sharing="windows", microbatch_tokens=microbatch_tokens, planner="l1l2")
    gbs = int(preset["train"].split("--global-batch-size ")[1].split()[0])
    loader = TreeBatchLoader(data_prefix, global_batch_size=gbs, seed=1234,
                             plan_fn=lambda f: plan_step(f, settings, dp), prefetch=0)
    total = {n: 0.0 for n in SCHEDULES}
    try:
        for _ in range(iters):
            b = next(loader)
            step = step_from_plan(b.plan, 0, forest=b.forest)
            for n in SCHEDULES:
                total[n] += simulate(step, stages, n).makespan
    finally:
        loader.close()
    return {n: {"makespan": t, "relative_tokens_per_s": total["non-overlap"] / t} for n, t in total.items()}


def fidelity(runs: dict) -> dict:
    """Each run against ``expanded``: probes, loss differences, throughput; the verdicts."""
    if "expanded" not in runs:          # --schedules-only
        return {}
    base = runs["expanded"]
    out = {}
    for name, r in runs.items():
        if name == "expanded" or not r["ok"] or not base["ok"]:
            continue
        try:
            c = compare_runs(base, r)
        except ProbeError as e:
            out[name] = {"error": str(e)}
            continue
        its = sorted(c["probes"])
        first = c["probes"][its[0]]
        out[name] = {"logit_cosine_start": first["logit_cosine_mean"],
                     "logit_cosine_start_min": first["logit_cosine_min"],
                     "logit_cosine_deficit_start_median": first["logit_cosine_deficit_median"],
                     "tokens_deficit_over_1e-3_start": first["tokens_deficit_over_1e-3"],
                     "logit_cosine_end": c["probes"][its[-1]]["logit_cosine_mean"],
                     "logit_cosine_end_min": c["probes"][its[-1]]["logit_cosine_min"],
                     "probe_tokens": first["tokens"],
                     "loss_abs_diff_max": c["losses"]["loss_abs_diff_max"],
                     "loss_abs_diff": c["losses"]["loss_abs_diff"]}
    oracle_dir = os.path.join(base["probe"], ORACLE_DIR)
    if base["ok"] and os.path.isdir(oracle_dir):         # bf16 rule against the upcast oracle (iteration 0)
        first = sorted(d for d in os.listdir(oracle_dir) if d.startswith("iter_"))[0]
        deficit = {}
        for name, r in runs.items():
            if r["ok"]:
                c = compare_probes(os.path.join(r["probe"], first), os.path.join(oracle_dir, first))
                deficit[name] = 1.0 - c["logit_cosine_mean"]
                out.setdefault(name, {})["oracle_cosine_deficit_start"] = deficit[name]
        if "expanded" in deficit:
            bound = BF16_COSINE_FACTOR * deficit["expanded"] + BF16_COSINE_FLOOR
            for name, d in deficit.items():
                if name != "expanded":
                    out[name]["meets_oracle_rule"] = d <= bound
    return judge(out)


def judge(out: dict) -> dict:
    """Adds the verdicts to each tree run's comparison in ``out`` (``fidelity``'s result, by run name): its
    cosine below the rerun's (the target) and below the repacked run's, its loss difference; returns ``out``."""
    rerun, repacked = out.get("expanded_rerun", {}), out.get(REPACKED, {})
    for name, f in out.items():
        if name in ("expanded", "expanded_rerun", REPACKED) or "error" in f or "logit_cosine_end" not in rerun:
            continue
        f["cosine_below_rerun"] = _cosine_below(rerun, f)
        f["meets_cosine_target"] = f["cosine_below_rerun"] <= COSINE_SLACK
        f["meets_loss_target"] = f["loss_abs_diff_max"] < LOSS_TOLERANCE
        if "logit_cosine_end" in repacked:
            f["cosine_below_repacked"] = _cosine_below(repacked, f)
            f["meets_cosine_target_repacked"] = f["cosine_below_repacked"] <= COSINE_SLACK
    return out


def _cosine_below(base: dict, f: dict) -> float:
    """How far ``f``'s mean logit cosine falls below ``base``'s, the larger of the first and last probe."""
    return max(base["logit_cosine_start"] - f["logit_cosine_start"], base["logit_cosine_end"] - f["logit_cosine_end"])


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), required=True, help="model, data and dtype")
    ap.add_argument("--nproc", type=int, required=True, help="processes (GPUs) per run")
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    ap.add_argument("--out", required=True, metavar="DIR", help="results (JSON per configuration) and run folders")
    ap.add_argument("--work", metavar="DIR", help="run folders and data (default OUT/runs)")
    ap.add_argument("--scheme", choices=("tree-step", "step-wise"), default=None,
                    help="rollout scheme of the synthetic data (default: the preset's, tree-step)")
    ap.add_argument("--iters", type=int, default=None, help="iterations per run (default: the preset's)")
    ap.add_argument("--warmup-iters", type=int, default=None, metavar="N",
                    help="per configuration, first run each mode for N iterations unmeasured (kernel compilation "
                         "and autotuning out of the timings; default: the preset's, 2 on GPU, 0 on CPU; at least 2 when "
                         "given: the learning-rate warm-up of 1 iteration needs a decay after it)")
    ap.add_argument("--driver-flags", default="", metavar="FLAGS",
                    help="more pretrain_tree_gpt.py flags for every run, one string after '=' (e.g. "
                         "--driver-flags='--tree-kda-backend reference': which kernel brings a run's rounding)")
    ap.add_argument("--lr", type=float, default=None,
                    help="peak learning rate of every run, minimum a tenth of it (default: the preset's, 1e-4 "
                         "on GPU; RL fine-tuning runs near 1e-6)")
    ap.add_argument("--no-recompute", action="store_true", help="skip the tree run with activation recomputation")
    ap.add_argument("--schedules-only", action="store_true",
                    help="pipeline configurations only: tree mode under the three window schedules and the "
                         "simulator's prediction, no expanded runs (no fidelity figures)")
    ap.add_argument("--config-timeout", type=float, nargs="+", default=[1800.0], metavar="S",
                    help="limit per configuration, all its runs, in --configs order (the last repeats; "
                         "default 1800 s; the first configuration of a cold machine compiles the kernels)")
    ap.add_argument("--deadline", type=float, default=None, metavar="S",
                    help="finish within S seconds of the start: each configuration's limit is cut to the time "
                         "left (minus 15 s for the results), and configurations that would start with under "
                         "60 s left are skipped (for machines lent by the minute)")
    ap.add_argument("--cache-dir", default=None, metavar="DIR",
                    help="one Triton and TorchInductor cache for every launch, autotuning results included "
                         "(TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_AUTOTUNING=1): the kernels "
                         "compile and tune once per machine, not once per configuration")
    ap.add_argument("--triton-max-configs", type=int, default=0, metavar="N",
                    help="pass --tree-triton-max-configs N to every run (cap fla's autotuning: shorter "
                         "compilation, untuned kernel timings; default 0: full autotuning)")
    ap.add_argument("--keep-logs", action="store_true",
                    help="copy each configuration's launch log to OUT/logs/<preset>_<config>.txt")
    ap.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29650)
    ap.add_argument("--json", action="store_true", help="print all results as one JSON object")
    if argv is None and "--worker" in sys.argv:       # a process of launch_config's torch.distributed.run
        return worker(sys.argv[sys.argv.index("--worker") + 1])
    a = ap.parse_args(argv)
    start = time.time()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stopped)
    if a.nproc < 1:
        raise CliError(f"--nproc must be >= 1, got {a.nproc}")
    preset = PRESETS[a.preset]
    if a.scheme:
        preset = dict(preset, data=dict(preset["data"], scheme=a.scheme))
    if a.lr is not None:
        if not a.lr > 0:
            raise CliError(f"--lr must be > 0, got {a.lr}")
        train = re.sub(r"--lr \S+", f"--lr {a.lr:g}", preset["train"])
        preset = dict(preset, train=re.sub(r"--min-lr \S+", f"--min-lr {a.lr / 10:g}", train))
    scheme = preset["data"].get("scheme", "tree-step")
    iters = a.iters or preset["iters"]
    if iters < 1:
        raise CliError(f"--iters must be >= 1, got {iters}")
    py = sys.executable
    backend = "nccl" if "gloo" not in preset["model"] else "gloo"
    work = a.work or os.path.join(a.out, "runs")
    os.makedirs(a.out, exist_ok=True)
    print(f"validate_parallel: preparing the {scheme} rollout data under {work}", file=sys.stderr, flush=True)
    data = make_data(preset, os.path.join(work, f"data_{scheme}"), py)
    mbt = flag_value(preset["train"], "--tree-microbatch-tokens")
    base = f"{preset['model']} {preset['train']} {COMMON} --train-iters {iters} " \
           f"--tree-logit-probe-tokens {preset['probe_tokens']} --data-path {data}"
    if a.triton_max_configs:
        base += f" --tree-triton-max-configs {a.triton_max_configs}"
    if a.driver_flags.strip():
        base += " " + a.driver_flags.strip()
    launch_env = dict(preset.get("env", {}))
    if a.cache_dir:
        cache = os.path.abspath(a.cache_dir)
        launch_env.update(TRITON_CACHE_DIR=os.path.join(cache, "triton"), TRITON_CACHE_AUTOTUNING="1",
                          TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"))
    env = {"versions": _versions(), "machine": platform.node(), "preset": a.preset, "nproc": a.nproc,
           "iters": iters, "scheme": scheme, "env": launch_env, "train_flags": preset["train"],
           "driver_flags": a.driver_flags.strip(),
           "triton_max_configs": a.triton_max_configs}
    results, port = {}, a.port
    for k, cfg in enumerate(a.configs):
        got = config_flags(cfg, a.nproc)
        if got is None:
            results[cfg] = {"config": cfg, "skipped": f"does not fit {a.nproc} processes"}
            continue
        par, tree_mode = got
        limit = a.config_timeout[min(k, len(a.config_timeout) - 1)]
        if a.deadline is not None:
            left = a.deadline - (time.time() - start) - 15.0
            if left < 60.0:
                results[cfg] = {"config": cfg, "skipped": f"--deadline {a.deadline:.0f} s: {max(left, 0):.0f} s left"}
                continue
            limit = min(limit, left)
        oracle = "" if "--fp64" in preset["model"] else " --tree-logit-probe-oracle"
        warm = a.warmup_iters if a.warmup_iters is not None else preset["warmup_iters"]
        stages = flag_value(par, "--pipeline-model-parallel-size")
        if a.schedules_only and stages < 2:
            results[cfg] = {"config": cfg, "skipped": "--schedules-only: not a pipeline configuration"}
            continue
        plan = {}
        if warm:        # compile the kernels of both modes before any measured run (results dropped)
            if not a.schedules_only:
                plan[f"{WARMUP}expanded"] = f"--tree-sharing off --train-iters {max(warm, 2)}"
            plan[f"{WARMUP}tree"] = f"--tree-sharing {tree_mode} --train-iters {max(warm, 2)}"
        if not a.schedules_only:
            plan.update({"expanded": "--tree-sharing off" + oracle, "expanded_rerun": "--tree-sharing off"})
            repack = repacked_budget(preset["train"])
            if repack is not None:
                plan[REPACKED] = f"--tree-sharing off --tree-microbatch-tokens {repack}"
        plan["tree"] = f"--tree-sharing {tree_mode}"
        if not a.no_recompute and not a.schedules_only:
            plan["tree_recompute"] = f"--tree-sharing {tree_mode} {RECOMPUTE}"
        if stages > 1:
            plan.update({k: f"--tree-sharing windows --tree-pp-schedule {v}" for k, v in SCHEDULE_RUNS.items()})
        port += 1
        print(f"[{cfg}] launching {len(plan)} runs of {a.nproc} processes ({', '.join(plan)}; limit {limit:.0f} s)",
              file=sys.stderr, flush=True)
        runs = launch_config(py, a.nproc, port, {n: f"{base} {par} {m}" for n, m in plan.items()},
                             os.path.join(work, cfg), limit, backend, launch_env)
        if a.keep_logs:
            os.makedirs(os.path.join(a.out, "logs"), exist_ok=True)
            shutil.copyfile(os.path.join(work, cfg, "log.txt"), os.path.join(a.out, "logs", f"{a.preset}_{cfg}.txt"))
        warmups = {n: runs.pop(n) for n in list(runs) if n.startswith(WARMUP)}
        for name, r in [*warmups.items(), *runs.items()]:
            if r["ok"]:
                r["throughput"] = throughput(read_report(r["report"]))
            status = "ok" if r["ok"] else "FAILED: " + " | ".join(r["error"])
            print(f"[{cfg}] {name}: {status} ({r.get('seconds', '-')} s)", file=sys.stderr, flush=True)
        res = {"config": cfg, "parallel_flags": par, "tree_sharing": tree_mode, **env,
               "runs": {k: {kk: vv for kk, vv in v.items() if kk not in ("report", "probe")} for k, v in runs.items()},
               "fidelity": fidelity(runs), "warmup_seconds": {k: v.get("seconds") for k, v in warmups.items()}}
        if stages > 1 and all(runs[k]["ok"] for k in ("tree", *SCHEDULE_RUNS)):
            dp = a.nproc // (stages * flag_value(par, "--tensor-model-parallel-size"))
            sim = simulated_schedules(data, preset, dp, stages, iters, mbt)
            measured = {"consumer-1f1b": runs["tree"], "overlap": runs["tree_overlap"],
                        "non-overlap": runs["tree_non_overlap"]}
            ref = measured["non-overlap"]["throughput"]["trajectory_tokens_per_s"]
            res["pp_schedules"] = {n: {"tokens_per_s": m["throughput"]["trajectory_tokens_per_s"],
                                       "relative_to_non_overlap": m["throughput"]["trajectory_tokens_per_s"] / ref,
                                       "simulated_relative_to_non_overlap": sim[n]["relative_tokens_per_s"]}
                                   for n, m in measured.items()}
        results[cfg] = res
        with open(os.path.join(a.out, f"multi_gpu_{a.preset}_{cfg}.json"), "w") as f:
            json.dump(res, f, indent=2, sort_keys=True)
    if a.json:
        print(json.dumps(results, indent=2, sort_keys=True))
    else:
        print_summary(results)
    return 0


def print_summary(results: dict) -> None:
    print(f"{'config':9s} {'run':17s} {'1-cos start':>12s} {'median':>9s} {'flips':>5s} {'1-cos end':>12s} "
          f"{'below rerun':>11s} {'below repack':>12s} {'max |dloss|':>11s} {'traj tok/s':>10s} {'targets':>8s} "
          f"{'1-cos fp32':>11s} {'bf16 rule':>9s}")
    for cfg, res in results.items():
        if "skipped" in res:
            print(f"{cfg:9s} skipped: {res['skipped']}")
            continue
        for name, r in res["runs"].items():
            f = res["fidelity"].get(name, {})
            tps = f"{r['throughput']['trajectory_tokens_per_s']:.0f}" if r.get("ok") else "failed"
            if "logit_cosine_start" in f:
                verdict = "-" if "meets_cosine_target" not in f else \
                    ("met" if f["meets_cosine_target"] and f["meets_loss_target"] else "MISSED")
                print(f"{cfg:9s} {name:17s} {1 - f['logit_cosine_start']:12.3e} "
                      f"{f['logit_cosine_deficit_start_median']:9.1e} {f['tokens_deficit_over_1e-3_start']:5d} "
                      f"{1 - f['logit_cosine_end']:12.3e} {f.get('cosine_below_rerun', float('nan')):11.2e} "
                      f"{f.get('cosine_below_repacked', float('nan')):12.2e} {f['loss_abs_diff_max']:11.3e} "
                      f"{tps:>10s} {verdict:>8s} {_oracle(f)}")
            else:
                print(f"{cfg:9s} {name:17s} {'':12s} {'':9s} {'':5s} {'':12s} {'':11s} {'':12s} {'':11s} {tps:>10s} "
                      f"{f.get('error', '') if f else '':>8s} {_oracle(f)}")
        for n, s in res.get("pp_schedules", {}).items():
            print(f"{cfg:9s} schedule {n:13s}: {s['tokens_per_s']:.0f} tok/s, {s['relative_to_non_overlap']:.3f}x "
                  f"non-overlap (simulated {s['simulated_relative_to_non_overlap']:.3f}x)")


def _oracle(f: dict) -> str:
    if "oracle_cosine_deficit_start" not in f:
        return ""
    rule = {True: "met", False: "MISSED"}.get(f.get("meets_oracle_rule"), "-")
    return f"{f['oracle_cosine_deficit_start']:11.3e} {rule:>9s}"


def _versions() -> dict:
    import torch
    v = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import megatron.core
        v["megatron_core"] = megatron.core.__version__
    except Exception:
        pass
    try:
        import fla
        v["fla"] = getattr(fla, "__version__", "?")
    except Exception:
        pass
    if torch.cuda.is_available():
        v["gpu"] = torch.cuda.get_device_name(0)
        v["gpus"] = torch.cuda.device_count()
    return v


if __name__ == "__main__":
    run(main)
