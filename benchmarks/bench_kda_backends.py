#!/usr/bin/env python3
"""KDA backends side by side: ``fla`` (fla-core's GPU kernels, ops/kda_fla.py) vs ``reference`` (torch).

One run, same device, same dtype, fwd+bwd each, on the compact rows of synthetic SWE-like
rollout trees (``megatron_harts.tree_data.synthetic``, as benchmarks/bench_tree_attention.py):

- ``tree_fla`` / ``tree_reference``: ``tree_kda`` over the call plan (replay on unless
  ``--no-replay``), loss = <o, random>, backward to q, k, v, g, beta;
- ``expanded_fla``: what expanded training runs: every trajectory on its own, one padded
  ``kda_fla`` call (packed varlen launch) over all trajectories' tokens;
- ``expanded_chunk_kda``: fla's public ``chunk_kda`` on the same packed tokens (our
  autograd Function's overhead over fla's own is the difference to ``expanded_fla``);
- ``state_grad_ours`` / ``state_grad_fla``: the backward state-gradient recurrence alone on
  the expanded tokens: ours (ops/kda_state_grad.py) vs fla's ``chunk_gated_delta_rule_bwd_dhu``.

Also reported: tree_fla's error against tree_reference (same inputs; the reference computes in
fp32), the plan's calls and replay, peak memory per method.  Needs CUDA and fla-core 0.6.0
(``--device cpu`` runs only under ``TRITON_INTERPRET=1``: a smoke run of this script, no timing).
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench_tree_attention import swe_forest  # noqa: E402
from megatron_harts.cli import ArgumentParser, CliError, run  # noqa: E402
from megatron_harts.ops.kda_fla import CHUNK, kda_fla_varlen  # noqa: E402
from megatron_harts.ops.triton_tuning import limit_autotuning  # noqa: E402
from megatron_harts.ops.tree_kda import build_kda_schedule, get_kda_backend, tree_kda  # noqa: E402
from megatron_harts.planner.calls import plan_calls  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=4096, help="target number of compact rows (default 4096)")
    p.add_argument("--scheme", default="tree-step", choices=["tree-step", "step-wise"])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128, help="K = V (default 128)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--no-replay", action="store_true", help="plan without replay (unaligned hand-offs)")
    p.add_argument("--skip-reference", action="store_true", help="do not time the torch reference backend")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-configs", type=int, default=0, help="let every Triton autotuner try at most this "
                   "many configs (fewest stages first; 0 = all): compile time vs tuned timings")
    p.add_argument("--full-launch", action="store_true",
                   help="also time tree_fla and expanded_fla with every Triton launch through the autotuners "
                        "(ops/triton_launch.py's fast path undone): *_full_launch")
    p.add_argument("--host-profile", metavar="FILE", help="cProfile of --repeats runs of tree_fla and of "
                   "expanded_fla (after the timings): the host's functions by own time, into FILE (text)")
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    args = p.parse_args(argv)
    if args.rows < 64 or args.heads < 1 or args.head_dim < 16 or args.repeats < 1 or args.warmup < 0:
        p.error("--rows >= 64, --heads >= 1, --head-dim >= 16, --repeats >= 1, --warmup >= 0")
    return args


def timed(fn, warmup, repeats, device):
    """Median milliseconds of fn() (CUDA events) after ``warmup`` runs, peak memory (GiB) of one run, and
    the median host milliseconds of fn() (until it returns, the device not waited for)."""
    if device.type != "cuda":   # smoke run
        t0 = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t0) * 1e3
        return ms, 0.0, ms
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times, host = [], []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2 ** 30, statistics.median(host)


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main(argv=None):
    args = parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CliError("bench_kda_backends needs CUDA (the fla backend runs GPU kernels)")
    dtype = DTYPES[args.dtype]
    H, D = args.heads, args.head_dim
    get_kda_backend("fla")
    if args.max_configs > 0:
        limit_autotuning(args.max_configs)

    forest = swe_forest(args.rows, args.scheme, args.seed)
    R = forest.num_rows
    plan = plan_calls(forest.seg_parent, forest.seg_start, forest.seg_length, CHUNK, replay=not args.no_replay)
    sched = build_kda_schedule(forest.seg_parent, forest.seg_start, forest.seg_length, forest.seg_row, plan,
                               device=dev)
    trajs = [torch.as_tensor(np.asarray(forest.trajectory_rows(t)), device=dev)
             for t in range(forest.num_trajectories)]
    lens = torch.tensor([len(r) for r in trajs])
    E = int(lens.sum())
    flat_rows = torch.cat(trajs)

    gen = torch.Generator(device=dev).manual_seed(args.seed)
    rnd = lambda *s: torch.randn(*s, device=dev, generator=gen)  # noqa: E731
    base = [torch.nn.functional.normalize(rnd(R, H, D), dim=-1), torch.nn.functional.normalize(rnd(R, H, D), dim=-1),
            rnd(R, H, D), -torch.rand(R, H, D, device=dev, generator=gen) * 0.5,
            torch.sigmoid(rnd(R, H))]
    base = [x.to(dtype) for x in base]
    leaves = [x.clone().requires_grad_() for x in base]
    go_rows = rnd(R, H, D).to(dtype)
    go_exp = rnd(E, H, D).to(dtype)

    # expanded: trajectories packed back to back (kda_fla_varlen, and fla's own chunk_kda on [1, E])
    n_traj = len(trajs)

    cu = torch.as_tensor(np.concatenate([[0], np.cumsum(lens.numpy())]), device=dev)

    def run_tree(backend):
        def f():
            for x in leaves:
                x.grad = None
            o = tree_kda(*leaves, sched, backend=backend)
            o.backward(go_rows)
        return f

    def run_expanded_fla():
        for x in leaves:
            x.grad = None
        o, _ = kda_fla_varlen(*(x[flat_rows] for x in leaves), lens, chunk_size=CHUNK)
        o.backward(go_exp)

    from fla.ops.kda import chunk_kda

    def run_chunk_kda():
        for x in leaves:
            x.grad = None
        packed = [x[flat_rows].unsqueeze(0) for x in leaves]
        o, _ = chunk_kda(*packed, cu_seqlens=cu)
        o[0].backward(go_exp)

    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "dtype": args.dtype,
           "max_configs": args.max_configs,
           "heads": H, "head_dim": D,
           "rows": R, "expanded_tokens": E, "trajectories": n_traj, "calls": len(sched.calls),
           "sequences": int(plan.num_sequences), "replay_tokens": int(plan.replay_tokens),
           "replay": not args.no_replay, "compression": E / R, "ms": {}, "peak_gib": {}}

    # correctness next to the reference (same inputs)
    check = {}
    for backend in ("fla", "reference"):
        ls = [x.clone().requires_grad_() for x in base]
        o = tree_kda(*ls, sched, backend=backend)
        o.backward(go_rows)
        check[backend] = [o.detach()] + [x.grad for x in ls]
    res["tree_fla_vs_reference_rel"] = {n: rel(a, b) for n, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta"),
                                                                         check["fla"], check["reference"])}
    del check

    methods = [("tree_fla", run_tree("fla")), ("expanded_fla", run_expanded_fla),
               ("expanded_chunk_kda", run_chunk_kda)]
    if not args.skip_reference:
        methods.append(("tree_reference", run_tree("reference")))
    res["host_ms"] = {}
    for name, fn in methods:
        res["ms"][name], res["peak_gib"][name], res["host_ms"][name] = timed(fn, args.warmup, args.repeats, dev)
    if args.full_launch:
        from megatron_harts.ops.triton_launch import fast_autotuned_launches
        fast_autotuned_launches()()          # every launch through the autotuners, then back
        for name, fn in methods[:2]:
            key = f"{name}_full_launch"
            res["ms"][key], res["peak_gib"][key], res["host_ms"][key] = timed(fn, args.warmup, args.repeats, dev)
        fast_autotuned_launches()

    if args.host_profile:
        import cProfile
        import io
        import pstats
        with open(args.host_profile, "w") as f:
            for name, fn in methods[:2]:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.repeats):
                    fn()
                prof.disable()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(40)
                f.write(f"===== {name}: {args.repeats} runs, {len(sched.calls) if name == 'tree_fla' else 1} "
                        f"KDA call(s) each\n{buf.getvalue()}\n")

    # the state-gradient recurrence alone, on the expanded tokens
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu
    from megatron_harts.ops.kda_state_grad import kda_state_grad
    nch = (lens + CHUNK - 1) // CHUNK
    co = torch.as_tensor(np.concatenate([[0], np.cumsum(nch.numpy())]), device=dev)
    NT = int(nch.sum())
    q, k, w = (rnd(1, E, H, D).to(dtype) * 0.1 for _ in range(3))
    gk = -torch.rand(1, E, H, D, device=dev, generator=gen)
    do, dv = rnd(1, E, H, D).to(dtype), rnd(1, E, H, D).to(dtype)
    dht = rnd(n_traj, H, D, D)
    inj_map = torch.full((NT,), -1, dtype=torch.int32, device=dev)
    inj_map[co[1:] - 1] = torch.arange(n_traj, dtype=torch.int32, device=dev)
    h0 = torch.zeros(n_traj, H, D, D, device=dev)
    scale = D ** -0.5
    ours = lambda: kda_state_grad(q, k, w, gk, do, dv, dht, inj_map, cu, co, scale=scale,  # noqa: E731
                                  num_chunks=NT)
    theirs = lambda: chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, do=do, dv=dv, gk=gk, h0=h0,  # noqa: E731
                                                    dht=dht, scale=scale, cu_seqlens=cu, chunk_size=CHUNK)
    a, b = ours(), theirs()
    res["state_grad_ours_vs_fla_rel"] = {n: rel(x, y) for n, x, y in zip(("dh", "dh0", "dv2"), a, b)}
    for name, fn in (("state_grad_ours", ours), ("state_grad_fla", theirs)):
        res["ms"][name], res["peak_gib"][name], res["host_ms"][name] = timed(fn, args.warmup, args.repeats, dev)

    ms = res["ms"]
    res["speedup_fla_over_reference_tree"] = (ms["tree_reference"] / ms["tree_fla"]) if "tree_reference" in ms else None
    res["tree_fla_over_expanded_fla"] = ms["expanded_fla"] / ms["tree_fla"]
    text = json.dumps(res, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    print(f"\n{'method':<30}{'ms':>10}{'host ms':>10}{'peak GiB':>10}")
    for name in ms:
        print(f"{name:<30}{ms[name]:>10.3f}{res['host_ms'][name]:>10.3f}{res['peak_gib'][name]:>10.2f}")


if __name__ == "__main__":
    run(main)
