#!/usr/bin/env python3
"""Calibrate the planner's microbatch cost model: time microbatches on this device, fit, write the file.

What it measures.  For each SWE-like synthetic rollout scheme (``--schemes``: Tree-Step and/or
Step-wise), each row budget (``--budgets``) and each of tree mode ``within`` (L1+L2 plans with
sharing inside microbatches) and expanded mode ``off`` (trajectories packed with no sharing),
the step of the training driver (``training.step.plan_step``) is planned, and every
microbatch replica 0 runs in that step is run ALONE, forward + backward, through the path a
training step takes (``replica_microbatches``, ``make_forward_step`` and ``run_schedule``
under DDP's ``no_sync``; the gradient buffers are zeroed between runs, no optimizer step),
with the model of ``--preset`` built by the training driver (``Trainer.from_args``, bf16 on
CUDA).  Each microbatch runs once to warm up (kernel autotuning, mask compilation), then
``--repeat`` times; its time is the median, taken with ``torch.cuda.synchronize()`` around the
run on CUDA (plain ``perf_counter`` on the CPU).  The two modes and the budgets make rows,
attention pairs, KDA calls, replay tokens and logits rows vary independently enough for the
fit.

Each time is paired with the features of the microbatch that ran (``CostFeatures``): the plan's
``Microbatch.features`` (tree mode: ``replica_windows(..., windows=False)`` in slot order, the
order ``windowed_microbatches`` builds its items in; expanded mode: ``plan.schedule(0)``, the
order of ``expanded_microbatches``), or, for a tree-mode microbatch whose external context the
``within`` schedule recomputes, the features of the segments it really computes.  Every
pairing is checked against the executed layout's row count.  ``cost_model.fit_calibration``
(non-negative least squares, at the driver's ``--tree-chunk-size``) fits the six coefficients
and ``save_calibration`` writes ``--out``; its ``source`` records the device, the torch /
megatron-core / fla versions, the preset, the workload, the number of samples, R^2 and every
sample (features, measured seconds, predicted seconds).

How the planner reads the result: ``pretrain_tree_gpt.py ... --tree-cost-calibration FILE``
(the training driver's planner), ``tools/plan_report.py --calibration FILE`` and
``benchmarks/bench_planner.py --calibration FILE``.  Only the coefficients' ratios steer the
planner; the file must be fitted at the training run's ``--tree-chunk-size``.

Prints a table (features, measured, predicted, relative error), or everything as JSON with
``--json``.  Needs CUDA for real figures (``--preset tiny --device cpu`` is a smoke run).
Bad input (a budget below the longest trajectory, fewer than 6 microbatches to fit, ...) is
one ``error:`` line and exit status 2.
"""
import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, replace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench_throughput import PRESETS, check_device, model_flags, synthesize  # noqa: E402
from megatron_harts.cli import ArgumentParser, CliError, print_table, run  # noqa: E402

SCHEMES = ("tree-step", "step-wise")
MODES = ("within", "off")
MIN_SAMPLES = 6             # one per coefficient: fit_calibration's minimum
#: the workload when a flag is not given: the GPU calibration, and a CPU smoke run of seconds
DEFAULTS = {
    "cuda": dict(budgets=(4096, 8192, 16384, 32768), num_tasks=2, max_tokens=4096, repeat=3),
    "cpu": dict(budgets=(256, 512), num_tasks=1, max_tokens=128, repeat=1),
}
FEATURE_NAMES = ("rows", "attention_pairs", "kda_calls", "replay_tokens", "logits_rows", "external_rows")


def wall_timer(device: torch.device):
    """The measuring timer: ``timer(run, item)`` runs ``run()`` once and returns its wall seconds,
    with the device synchronized before and after on CUDA (queued kernels all counted)."""
    cuda = device.type == "cuda"

    def timer(run_once, item) -> float:
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        run_once()
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0
    return timer


def versions(device: torch.device) -> dict:
    """Device name and library versions for the calibration's ``source``."""
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
           else (platform.processor() or platform.machine() or "cpu"),
           "python": platform.python_version(), "torch": torch.__version__}
    try:
        import megatron.core
        out["megatron_core"] = megatron.core.__version__
    except (ImportError, AttributeError):
        out["megatron_core"] = None
    try:
        import fla
        out["fla"] = fla.__version__
    except Exception:        # fla's import fails without Triton (every CPU machine): recorded as absent
        out["fla"] = None
    return out


def paired_microbatches(forest, plan, settings, index):
    """Replica 0's step items in execution order, each with the features of what it computes.

    Returns ``[(item, plan_microbatch, features, from_plan)]``: ``item`` the
    ``WindowedMicrobatch`` the step runs, ``plan_microbatch`` the plan's ``Microbatch`` it is,
    ``features`` its ``CostFeatures`` and ``from_plan`` whether those are the plan's own (False
    only for a tree-mode microbatch whose external context the ``within`` schedule recomputes:
    then the features of the segments it computes).  Invariant: ``features.rows`` equals the
    item's layout rows (checked; a mismatch is a pairing bug and raises RuntimeError).
    """
    from megatron_harts.planner.microbatch import replica_windows
    from megatron_harts.training.step import replica_microbatches

    if settings.sharing not in MODES:
        raise ValueError(f"paired_microbatches: sharing {settings.sharing!r} has producer/consumer windows; "
                         f"only {MODES} run microbatches alone")
    items = replica_microbatches(forest, plan, 0, settings)
    planned = [m for m in plan.schedule(0) if m is not None]
    if len(items) != len(planned):
        raise RuntimeError(f"replica 0 runs {len(items)} microbatches but the plan gives it {len(planned)}")
    out = []
    if settings.sharing == "off":
        for item, m in zip(items, planned):
            out.append((item, m, m.features, True))
    else:
        entries = replica_windows(forest, plan, 0, windows=False)
        for item, m, e in zip(items, planned, entries):
            if e.microbatch is not m:
                raise RuntimeError(f"replica 0's window entry for microbatch {e.microbatch.index} is paired with "
                                   f"plan microbatch {m.index}")
            if e.external.size == 0:
                out.append((item, m, m.features, True))
            else:
                out.append((item, m, plan.cost_model.features(index, e.computed, m.owned), False))
    for item, m, feats, _ in out:
        if item.producer is not None:
            raise RuntimeError(f"microbatch {m.index} reads a producer: not a plain microbatch")
        if int(item.layout.num_rows) != int(feats.rows):
            raise RuntimeError(f"microbatch {m.index}: the executed layout has {int(item.layout.num_rows)} rows, its "
                               f"features {feats.rows}")
    return out


def measure_step(trainer, forest, plan, settings, index, *, repeat: int, timer) -> list:
    """Time each of replica 0's microbatches of ``plan`` alone (module docstring); one record each.

    A record: ``{"microbatch": plan index, "slot", "features": CostFeatures, "from_plan",
    "seconds": median of the timed runs, "runs": every timed run}``; one untimed warm-up run
    (through ``timer`` too) precedes the timed ones.
    """
    from megatron_harts.rl.objectives import forest_normalizer
    from megatron_harts.models.experts import expert_grad_hooks_off
    from megatron_harts.schedules.windows import microbatch_on
    from megatron_harts.training.step import (aux_loss_scale, make_forward_step, megatron_aux_loss_scale_after,
                                              run_schedule)

    ddp = trainer.model[0]
    device = trainer.device
    normalizer = forest_normalizer(forest)
    counters = {}
    step_fn = make_forward_step(trainer.objective, normalizer, aux_loss_scale=aux_loss_scale(plan),
                                counters=counters)
    records = []
    for item, m, feats, from_plan in paired_microbatches(forest, plan, settings, index):
        on_device = microbatch_on(item, device)      # moved once: the timed runs copy nothing

        def run_once(mb=on_device):
            with ddp.no_sync(), expert_grad_hooks_off(ddp), megatron_aux_loss_scale_after(device):
                run_schedule(ddp, [mb], step_fn, settings)

        runs = []
        for k in range(repeat + 1):
            for chunk in trainer.model:
                chunk.zero_grad_buffer()
            t = float(timer(run_once, on_device))
            if k > 0:
                runs.append(t)
        for chunk in trainer.model:
            chunk.zero_grad_buffer()
        records.append({"microbatch": int(m.index), "slot": int(m.slot), "features": feats, "from_plan": from_plan,
                        "seconds": statistics.median(runs), "runs": runs})
        del on_device, run_once
    return records


def _fmt(values) -> str:
    return " ".join(str(v) for v in values)


def parse_args(argv):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="h200", choices=sorted(PRESETS),
                    help="model shape of benchmarks/bench_throughput.py (default h200)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None,
                    help="where to measure (default cuda when available; cpu: smoke run)")
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES,
                    help="synthetic SWE-like rollout schemes (default both)")
    ap.add_argument("--budgets", nargs="+", type=int, default=None, metavar="M",
                    help="row budgets (--tree-microbatch-tokens) to plan at (default %s on cuda, %s on the cpu); "
                         "each at least the longest trajectory" % (_fmt(DEFAULTS["cuda"]["budgets"]),
                                                                   _fmt(DEFAULTS["cpu"]["budgets"])))
    ap.add_argument("--num-tasks", type=int, default=None,
                    help="rollout tasks (trees) per scheme (default %d on cuda, %d on the cpu)"
                         % (DEFAULTS["cuda"]["num_tasks"], DEFAULTS["cpu"]["num_tasks"]))
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="trajectory length cap (default %d on cuda, %d on the cpu)"
                         % (DEFAULTS["cuda"]["max_tokens"], DEFAULTS["cpu"]["max_tokens"]))
    ap.add_argument("--repeat", type=int, default=None,
                    help="timed runs per microbatch, after one warm-up (default %d on cuda, %d on the cpu)"
                         % (DEFAULTS["cuda"]["repeat"], DEFAULTS["cpu"]["repeat"]))
    ap.add_argument("--out", metavar="FILE", default=None,
                    help="calibration file to write (default benchmarks/results/cost-calibration-<time>.json on "
                         "cuda, out/cost-calibration-<time>.json on the cpu)")
    ap.add_argument("--json", action="store_true", help="print everything as JSON instead of the table")
    ap.add_argument("--kda-backend", default="auto", help="--tree-kda-backend of the driver (default auto)")
    ap.add_argument("--attention-backend", default="auto", help="--tree-attention-backend of the driver (default auto)")
    a = ap.parse_args(argv)
    if a.device is None:
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, value in DEFAULTS[a.device].items():
        if getattr(a, name) is None:
            setattr(a, name, list(value) if isinstance(value, tuple) else value)
    for flag, value, low in (("--num-tasks", a.num_tasks, 1), ("--max-tokens", a.max_tokens, 2),
                             ("--repeat", a.repeat, 1)):
        if value < low:
            raise CliError(f"{flag} must be >= {low}, got {value}")
    for b in a.budgets:
        if b < 1:
            raise CliError(f"--budgets: each budget must be >= 1, got {b}")
    check_device(a.device)
    a.schemes = list(dict.fromkeys(a.schemes))
    a.budgets = sorted(set(a.budgets))
    if a.out is None:        # the folder is made when missing; a CPU smoke run stays out of the committed results
        folder = os.path.join(HERE, "results") if a.device == "cuda" else os.path.join(os.path.dirname(HERE), "out")
        a.out = os.path.join(folder, time.strftime("cost-calibration-%Y%m%d-%H%M%S.json"))
    else:
        out_dir = os.path.dirname(os.path.abspath(a.out))
        if os.path.isdir(a.out):
            raise CliError(f"--out {a.out}: is a directory; name the calibration file")
        if not os.path.isdir(out_dir):
            raise CliError(f"--out {a.out}: the directory {out_dir} does not exist")
        if not os.access(out_dir, os.W_OK):
            raise CliError(f"--out {a.out}: the directory {out_dir} is not writable")
    return a


def _progress(text: str) -> None:
    print(f"calibrate: {text}", file=sys.stderr, flush=True)


def trainer_argv(a, forests) -> list:
    """The driver's command line: the preset's model, tree mode ``within`` (the steps' own
    ``SharingSettings`` choose the mode and budget), an SFT objective, no data path."""
    p = PRESETS[a.preset]
    longest = max(int(f.traj_length.max()) for f in forests.values())
    batch = max(int(f.num_trajectories) for f in forests.values())
    return model_flags(p, "--bf16" if a.device == "cuda" else "") + [
        "--seq-length", str(longest), "--tree-microbatch-tokens", str(max(a.budgets)),
        "--global-batch-size", str(batch), "--train-iters", "1", "--lr", "1e-5", "--seed", "1234",
        "--log-interval", "1000000", "--rl-objective", "sft", "--tree-sharing", "within",
        "--distributed-backend", "nccl" if a.device == "cuda" else "gloo",
        "--tree-kda-backend", a.kda_backend, "--tree-attention-backend", a.attention_backend]


def calibrate(a, timer=None) -> dict:
    """Measure, fit and write the calibration file (module docstring); returns the results."""
    from megatron_harts.planner.cost_model import ForestIndex, fit_calibration, save_calibration
    from megatron_harts.training.step import plan_step
    from megatron_harts.training.trainer import Trainer, TrainingError

    p = PRESETS[a.preset]
    forests, indexes = {}, {}
    for scheme in a.schemes:
        forest = synthesize(scheme, a.num_tasks, a.max_tokens, p["vocab"], seed=0)
        longest = int(forest.traj_length.max())
        short = [b for b in a.budgets if b < longest]
        if short:
            raise CliError(f"--budgets {short[0]}: below the longest {scheme} trajectory ({longest} tokens at "
                           f"--max-tokens {a.max_tokens}); use budgets >= {longest} or a lower --max-tokens")
        forests[scheme], indexes[scheme] = forest, ForestIndex(forest)
    samples = []
    steps = len(forests) * len(a.budgets) * len(MODES)
    t0 = time.perf_counter()
    _progress(f"building the {a.preset} model on {a.device} (training driver)")
    try:        # megatron's own prints go to stderr: stdout holds the report (or the JSON) only
        with contextlib.redirect_stdout(sys.stderr), Trainer.from_args(trainer_argv(a, forests)) as trainer:
            timer = timer or wall_timer(trainer.device)
            chunk_size = int(trainer.args.tree_chunk_size)
            machine = versions(trainer.device)
            done = 0
            for scheme, forest in forests.items():
                for budget in a.budgets:
                    for sharing in MODES:
                        settings = replace(trainer.settings, sharing=sharing, microbatch_tokens=budget)
                        plan = plan_step(forest, settings, trainer.dp)
                        records = measure_step(trainer, forest, plan, settings, indexes[scheme], repeat=a.repeat,
                                               timer=timer)
                        for r in records:
                            r.update(scheme=scheme, budget=budget, sharing=sharing, planner=plan.planner)
                            samples.append(r)
                        done += 1
                        _progress(f"step {done}/{steps}: {scheme} budget {budget} {sharing}: {len(records)} "
                                  f"microbatches timed ({len(samples)} samples, {time.perf_counter() - t0:.1f} s)")
    except TrainingError as e:
        raise CliError(str(e)) from None
    if len(samples) < MIN_SAMPLES:
        raise CliError(f"only {len(samples)} microbatches were measured, the fit needs at least {MIN_SAMPLES}: add "
                       "--budgets or --schemes, or raise --num-tasks")
    feats = [s["features"] for s in samples]
    try:
        model, r2 = fit_calibration(feats, [s["seconds"] for s in samples], chunk_size=chunk_size)
    except ValueError as e:
        raise CliError(f"cannot fit the cost model to the {len(samples)} measured microbatches: {e}") from None
    measurements = []
    for s in samples:
        pred = model.cost(s["features"])
        measurements.append({
            "scheme": s["scheme"], "sharing": s["sharing"], "budget": s["budget"], "planner": s["planner"],
            "microbatch": s["microbatch"], "slot": s["slot"], "features": asdict(s["features"]),
            "features_from_plan": s["from_plan"], "seconds": s["seconds"], "runs": s["runs"], "predicted": pred,
            "relative_error": (pred - s["seconds"]) / s["seconds"] if s["seconds"] > 0 else None})
    source = dict(machine, tool="benchmarks/calibrate_cost.py", preset=a.preset, model=p, schemes=a.schemes,
                  budgets=a.budgets, num_tasks=a.num_tasks, max_tokens=a.max_tokens, repeat=a.repeat,
                  kda_backend=a.kda_backend, attention_backend=a.attention_backend,
                  samples=len(samples), r2=r2, measurements=measurements)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    save_calibration(a.out, model, source=source)
    return {"out": a.out, "chunk_size": chunk_size, "coefficients": asdict(model.coefficients), "source": source}


def print_report(res: dict) -> None:
    rows = []
    for m in res["source"]["measurements"]:
        f = m["features"]
        err = "-" if m["relative_error"] is None else f"{100 * m['relative_error']:+.1f}%"
        rows.append((m["scheme"], m["sharing"], m["budget"], m["microbatch"], f["rows"], f["attention_pairs"],
                     f["kda_calls"], f["replay_tokens"], f["logits_rows"], f"{1e3 * m['seconds']:.2f}",
                     f"{1e3 * m['predicted']:.2f}", err))
    print_table(rows, ("scheme", "mode", "budget", "mb", "rows", "pairs", "kda_calls", "replay", "logits",
                       "measured_ms", "predicted_ms", "rel_err"))
    errs = [abs(m["relative_error"]) for m in res["source"]["measurements"] if m["relative_error"] is not None]
    print()
    print(f"device {res['source']['device']} | preset {res['source']['preset']} | samples {res['source']['samples']} "
          f"| R^2 {res['source']['r2']:.4f} | median |rel err| {100 * float(np.median(errs)) if errs else 0:.1f}% "
          f"| chunk size {res['chunk_size']}")
    print("coefficients (seconds per unit): " + ", ".join(f"{k} {v:.4g}" for k, v in res["coefficients"].items()))
    print(f"wrote {res['out']} (read it with --tree-cost-calibration {res['out']})")


def main(argv=None, timer=None) -> int:
    """The command (module docstring); ``timer(run, item) -> seconds`` replaces the wall-clock
    timer (tests inject a synthetic cost)."""
    a = parse_args(argv)
    res = calibrate(a, timer=timer)
    if a.json:
        print(json.dumps(res, indent=2, sort_keys=True, default=float))
    else:
        print_report(res)
    return 0


if __name__ == "__main__":
    run(main)
