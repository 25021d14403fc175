#!/usr/bin/env python3
"""One optimizer step of the training driver, tree mode against expanded mode, parameter by parameter.

Every mode trains the same global batch from the same initial weights (same seed) through
``training.trainer.Trainer`` (what ``pretrain_tree_gpt.py`` runs: the planner, every microbatch,
megatron DDP, the loss normalization, the optimizer).  Just before the first optimizer step each
mode's gradients (``main_grad``, reduced and finalized, before clipping) are copied to the host
in fp32, with the routers' expert-bias update of that step; then ``--steps`` steps record the loss
and gradient norm of each step.  Reported per mode against the first one (the reference, by
default expanded mode):

- ``grad_rel_diff`` = ||g - g_ref|| / ||g_ref|| over all parameters, the same per parameter
  tensor with its cosine, and the ``--worst`` tensors by relative difference;
- ``sign_agreement``: the share of the reference's first-order loss decrease sum |g_ref| that
  the mode's gradient signs keep (a first Adam step moves every weight by about lr * sign(g));
- the expert-bias updates' agreement (the share of equal signs);
- loss and gradient norm of every step (the first at the initial weights).

A mode is ``SHARING[:TOKENS]``: ``off`` (expanded), ``within`` or ``windows`` (tree), optionally
with its own microbatch row budget (``off:4096``: expanded mode packed differently, a second
baseline that shows the size of the reordering noise of the dtype).  In fp64 on the CPU every
tree mode equals expanded mode to rounding (the tests pin it); in bf16 on the GPU a tree mode
should differ from expanded mode by no more than expanded mode repacked does.

Needs CUDA for ``--dtype bf16``; ``--device cpu --preset tiny --dtype fp64`` is the exact check.
"""
import argparse
import json
import math
import os
import sys
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bench_throughput import PRESETS, model_flags, release_memory, synthesize  # noqa: E402
from megatron_harts.cli import ArgumentParser, run  # noqa: E402

DTYPE_FLAGS = {"bf16": "--bf16", "fp32": "", "fp64": "--fp64"}


def parse_mode(text: str):
    """``SHARING[:TOKENS]`` -> (sharing, tokens or None)."""
    sharing, colon, tokens = text.partition(":")
    if sharing not in ("off", "within", "windows"):
        raise argparse.ArgumentTypeError(f"mode {text!r}: sharing must be off, within or windows")
    if colon and not (tokens.isdigit() and int(tokens) > 0):
        raise argparse.ArgumentTypeError(f"mode {text!r}: the row budget after ':' must be a positive integer")
    return sharing, int(tokens) if tokens else None


def _routers(module) -> list:
    return [m for m in module.modules() if getattr(m, "expert_bias", None) is not None]


def driver_argv(preset: str, dtype: str, forest, *, device: str, lr: float = 1e-5, expert_bias: bool = True,
                aux_loss_coeff=None, kda_backend: str = "auto", attention_backend: str = "auto") -> List[str]:
    """The driver flags every mode shares: bench_throughput's model of ``preset`` in ``dtype``, the
    global batch ``forest`` (one step), SFT, the given learning rate and MoE load-balancing settings."""
    flags = model_flags(PRESETS[preset], DTYPE_FLAGS[dtype])
    if not expert_bias:
        flags.remove("--moe-router-enable-expert-bias")
    if aux_loss_coeff is not None:
        flags[flags.index("--moe-aux-loss-coeff") + 1] = str(aux_loss_coeff)
    return flags + [
        "--seq-length", str(int(forest.traj_length.max())), "--global-batch-size", str(forest.num_trajectories),
        "--train-iters", "1000", "--lr", str(lr), "--seed", "1234", "--log-interval", "1000000",
        "--rl-objective", "sft", "--distributed-backend", "nccl" if device == "cuda" else "gloo",
        "--tree-kda-backend", kda_backend, "--tree-attention-backend", attention_backend]


def mode_argv(common: List[str], sharing: str, tokens: int) -> List[str]:
    return common + ["--tree-sharing", sharing, "--tree-microbatch-tokens", str(tokens)]


def run_mode(argv: List[str], forest, steps: int) -> Dict:
    """Losses and gradient norms of ``steps`` steps; gradients and expert-bias updates of the first."""
    from megatron_harts.training.trainer import Trainer
    with Trainer.from_args(argv) as t:
        module = t.model[0].module
        params = dict(module.named_parameters())
        routers = _routers(module)
        bias_before = [r.expert_bias.detach().double().cpu().clone() for r in routers]
        captured: Dict = {}
        real_step = t.optimizer.step

        def step_capturing():
            if not captured:
                captured["grads"] = {n: (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad)
                                     .detach().float().cpu().clone() for n, p in params.items()}
                captured["bias_update"] = [r.expert_bias.detach().double().cpu() - b
                                           for r, b in zip(routers, bias_before)]
            return real_step()

        t.optimizer.step = step_capturing
        losses, norms, seconds = [], [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            m = t.step(forest)
            seconds.append(time.perf_counter() - t0)
            losses.append(m["loss"])
            norms.append(m["grad_norm"])
        last = {k: m[k] for k in ("microbatches", "compression", "kda_calls", "replay_tokens", "windows",
                                  "moe_load_max_over_mean") if k in m}
        return {"loss_per_step": losses, "grad_norm_per_step": norms, "step_seconds": seconds, **last, **captured}


def compare(run: Dict, ref: Dict, worst: int) -> Dict:
    """``run``'s first-step gradients and bias updates against ``ref``'s (module docstring)."""
    per, diff2, ref2, kept, total = [], 0.0, 0.0, 0.0, 0.0
    for name, g_ref in ref["grads"].items():
        g = run["grads"][name].double()
        g_ref = g_ref.double()
        d = float((g - g_ref).norm()) ** 2
        r = float(g_ref.norm()) ** 2
        diff2, ref2 = diff2 + d, ref2 + r
        kept += float((g.sign() * g_ref).sum())
        total += float(g_ref.abs().sum())
        denom = math.sqrt(r * float(g.norm()) ** 2)
        per.append({"param": name, "rel_diff": math.sqrt(d / r) if r > 0 else (0.0 if d == 0 else math.inf),
                    "cosine": float((g * g_ref).sum()) / denom if denom > 0 else None,
                    "norm_ratio": float(g.norm()) / math.sqrt(r) if r > 0 else None})
    per.sort(key=lambda e: -e["rel_diff"])
    signs = [float((a.sign() == b.sign()).double().mean()) for a, b in zip(run["bias_update"], ref["bias_update"])]
    return {"grad_rel_diff": math.sqrt(diff2 / ref2) if ref2 > 0 else 0.0,
            "sign_agreement": kept / total if total > 0 else 1.0,
            "expert_bias_sign_agreement": min(signs) if signs else None,
            "loss_abs_diff_per_step": [abs(a - b) for a, b in zip(run["loss_per_step"], ref["loss_per_step"])],
            "worst_params": per[:worst]}


def summary_line(key: str, row: Dict) -> str:
    """One printed line of a mode's results (the reference has no comparison fields)."""
    line = (f"{key}: {row['microbatches']} microbatches, losses {['%.6f' % v for v in row['loss_per_step']]}, "
            f"grad norms {['%.4g' % v for v in row['grad_norm_per_step']]}")
    if "grad_rel_diff" not in row:
        return line + " (reference)"
    worst = row["worst_params"][0] if row["worst_params"] else {"param": None, "rel_diff": 0.0}
    return (line + f", grad rel diff {row['grad_rel_diff']:.3e}, sign agreement {row['sign_agreement']:.5f}, "
            f"bias signs {row['expert_bias_sign_agreement']}, worst {worst['param']} {worst['rel_diff']:.3e}")


def main(argv=None):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--preset", default="h200", choices=sorted(PRESETS))
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_FLAGS))
    ap.add_argument("--scheme", default="step-wise", choices=["tree-step", "step-wise"])
    ap.add_argument("--num-tasks", type=int, default=2)
    ap.add_argument("--samples-per-task", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=4096, help="trajectory length cap")
    ap.add_argument("--microbatch-tokens", type=int, default=8192)
    ap.add_argument("--modes", nargs="+", type=parse_mode, default=[("off", None), ("off", 4096), ("within", None)],
                    metavar="SHARING[:TOKENS]", help="modes to run; the first is the reference (default: off "
                    "off:4096 within)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--no-expert-bias", action="store_true", help="train without the routers' expert bias")
    ap.add_argument("--aux-loss-coeff", type=float, default=None, help="override the preset's MoE aux-loss coefficient")
    ap.add_argument("--kda-backend", default="auto")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--driver-flags", default="", metavar="'FLAGS'", help="more driver flags for every mode")
    ap.add_argument("--worst", type=int, default=8, help="worst parameter tensors to list per mode")
    ap.add_argument("--out", default=None, help="results JSON")
    ap.add_argument("--json", action="store_true", help="print the results JSON")
    a = ap.parse_args(argv)
    if a.device == "cpu" and a.dtype == "bf16":
        ap.error("--dtype bf16 needs CUDA (megatron-core's mixed-precision optimizer); use fp32 or fp64 on the CPU")
    if a.steps < 1:
        ap.error("--steps must be at least 1")
    forest = synthesize(a.scheme, a.num_tasks, a.max_tokens, PRESETS[a.preset]["vocab"], seed=0,
                        samples_per_task=a.samples_per_task)
    common = driver_argv(a.preset, a.dtype, forest, device=a.device, lr=a.lr, expert_bias=not a.no_expert_bias,
                         aux_loss_coeff=a.aux_loss_coeff, kda_backend=a.kda_backend,
                         attention_backend=a.attention_backend) + a.driver_flags.split()
    results = {"args": {k: v for k, v in vars(a).items() if k != "modes"},
               "modes": [f"{s}:{n}" if n else s for s, n in a.modes], "forest": forest.stats(),
               "machine": {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
                           "torch": torch.__version__}, "runs": {}}
    ref = None
    for k, (sharing, tokens) in enumerate(a.modes):
        key = f"{sharing}:{tokens}" if tokens else sharing
        print(f"step_fidelity: mode {k + 1}/{len(a.modes)}: {key} ({a.steps} steps)", file=sys.stderr, flush=True)
        release_memory(a.device)
        run = run_mode(mode_argv(common, sharing, tokens or a.microbatch_tokens), forest, a.steps)
        if ref is None:
            ref = run
        row = {k: v for k, v in run.items() if k not in ("grads", "bias_update")}
        if run is not ref:
            row.update(compare(run, ref, a.worst))
            del run                  # only the reference's gradients are needed later
        results["runs"][key] = row
        print(summary_line(key, row), flush=True)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=2, default=float)
    if a.json:
        print(json.dumps(results, indent=2, default=float))
    return results


if __name__ == "__main__":
    run(main)
