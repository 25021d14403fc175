#!/usr/bin/env python3
"""Sweep the interval attention kernels' tile shape and launch options on one GPU (bf16, MLA dims).

For each workload (``--sets``: a scheme, optionally ``:strategy:budget`` for compaction traces, as
``bench_tree_attention.py`` builds them) and tile (``--tiles``, ``MxN``), times the forward alone for
each (warps x stages) option of the forward (``--fwd``), then forward + backward for each option of
the backward (``--bwd``) with the fastest forward option, against causal SDPA (torch's flash kernel)
over the same rows.  Prints per option the time per visible pair over causal SDPA's (forward,
forward + backward, backward alone) and the best per workload; ``--out`` writes every measurement
as JSON.  Options that do not fit the GPU's shared memory are reported and skipped.  Needs CUDA and
Triton."""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron_harts.cli import ArgumentParser, CliError, output_path, run  # noqa: E402

import megatron_harts.ops.interval_attention as ia  # noqa: E402
from bench_tree_attention import compaction_forest, swe_forest, timed, visible_pairs  # noqa: E402
from megatron_harts.layout import build_layout  # noqa: E402


def workload(name, rows, seed=0):
    scheme, strategy, budget = (name.split(":") + ["none", "4096"])[:3]
    a = argparse.Namespace(scheme=scheme, compaction=strategy, context_budget=int(budget), rows=rows,
                           max_tokens=None, seed=seed)
    forest = swe_forest(rows, scheme, seed) if strategy == "none" else compaction_forest(a)
    return build_layout(forest)


def _options(flag, values, parts):
    for v in values:
        try:
            got = [int(x) for x in v.split("x")]
        except ValueError:
            got = []
        if len(got) != 2 or min(got) < 1:
            raise CliError(f"{flag}: expected {parts}, e.g. 64x64 or 4x2, got {v!r}")


def main(argv=None):
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sets", nargs="+", default=["tree-step", "tree-step:sliding-window:4096",
                                                  "step-wise:markovian:4096"])
    p.add_argument("--rows", type=int, default=32768)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--tiles", nargs="+", default=["64x64", "128x64", "64x128", "128x128"])
    p.add_argument("--fwd", nargs="+", default=["4x2", "4x3", "8x2", "8x3"])
    p.add_argument("--bwd", nargs="+", default=["4x1", "4x2", "8x1", "8x2"])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    _options("--tiles", a.tiles, "MxN (query rows x keys)")
    _options("--fwd", a.fwd, "WARPSxSTAGES")
    _options("--bwd", a.bwd, "WARPSxSTAGES")
    if a.out:
        output_path(a.out, "--out")
    reason = ia.interval_available("cuda")
    if not torch.cuda.is_available() or reason is not None:
        raise CliError(f"tune_interval needs CUDA and Triton: {reason or 'no CUDA device'}")
    from triton.runtime.errors import OutOfResources
    dev = torch.device("cuda")
    H, dqk, dv = a.heads, 192, 128
    results = []
    orig = ia._launch_args
    for name in a.sets:
        layout = workload(name, a.rows).to(dev)
        R = layout.num_rows
        pairs = visible_pairs(layout.visibility)
        gen = torch.Generator(device=dev).manual_seed(0)
        mk = lambda *s: (torch.randn(*s, device=dev, generator=gen) * 0.5).to(torch.bfloat16).requires_grad_()
        q, k, v = mk(R, H, dqk), mk(R, H, dqk), mk(R, H, dv)
        g = torch.randn(R, H, dv, device=dev, generator=gen).to(torch.bfloat16)
        qs, ks, vs = (t.detach().transpose(0, 1)[None].requires_grad_() for t in (q, k, v))
        gs = g.transpose(0, 1)[None]

        def sdpa_f():
            with torch.no_grad():
                F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

        def sdpa_fb():
            for t in (qs, ks, vs):
                t.grad = None
            F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).backward(gs)
        cf, cfb = timed(sdpa_f, dev, 3, a.repeats), timed(sdpa_fb, dev, 3, a.repeats)
        causal = R * (R + 1) // 2
        print(f"== {name}: {R} rows, {pairs} visible pairs; causal sdpa fwd {cf:.3f} ms, fwd+bwd {cfb:.3f} ms",
              flush=True)
        for tile in a.tiles:
            bm, bn = map(int, tile.split("x"))
            blocks = ia.build_interval_blocks(layout.visibility, block_m=bm, block_n=bn, device=dev)

            def run_with(fo, bo):
                fw, fs = map(int, fo.split("x"))
                bw, bs = map(int, bo.split("x"))

                def patched(q_, k_, v_, blocks_):
                    sizes, meta, _, _ = orig(q_, k_, v_, blocks_)
                    return sizes, meta, dict(num_warps=fw, num_stages=fs), dict(num_warps=bw, num_stages=bs)
                ia._launch_args = patched
                try:
                    def f():
                        with torch.no_grad():
                            ia.interval_attention(q, k, v, blocks)

                    def fb():
                        for t in (q, k, v):
                            t.grad = None
                        ia.interval_attention(q, k, v, blocks).backward(g)
                    return timed(f, dev, 2, a.repeats), timed(fb, dev, 2, a.repeats)
                except OutOfResources as e:      # the option's tiles do not fit the GPU's shared memory
                    print(f"  {tile} fwd {fo} bwd {bo}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
                    return None
                finally:
                    ia._launch_args = orig

            def record(fo, bo, got):
                tf, tfb = got
                rf = (tf / pairs) / (cf / causal)
                rfb = (tfb / pairs) / (cfb / causal)
                rb = ((tfb - tf) / pairs) / ((cfb - cf) / causal)
                results.append(dict(set=name, tile=tile, fwd=fo, bwd=bo, fwd_ms=tf, fwd_bwd_ms=tfb, rel_fwd=rf,
                                    rel_fwd_bwd=rfb, rel_bwd=rb, rows=R, pairs=pairs, causal_fwd_ms=cf,
                                    causal_fwd_bwd_ms=cfb))
                print(f"  {tile} fwd {fo} bwd {bo}: fwd {tf:.2f} ms ({rf:.2f}x), fwd+bwd {tfb:.2f} ms "
                      f"({rfb:.2f}x), bwd alone {rb:.2f}x", flush=True)
                return rf, rb

            best_f = None
            for fo in a.fwd:            # the forward's options with the first backward option
                got = run_with(fo, a.bwd[0])
                if got:
                    rf, _ = record(fo, a.bwd[0], got)
                    if best_f is None or rf < best_f[1]:
                        best_f = (fo, rf)
            if best_f is None:
                continue
            for bo in a.bwd[1:]:        # the backward's options with the best forward option
                got = run_with(best_f[0], bo)
                if got:
                    record(best_f[0], bo, got)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    for name in a.sets:
        rs = [r for r in results if r["set"] == name]
        if rs:
            best = min(rs, key=lambda r: r["rel_fwd_bwd"])
            print(f"best {name}: {best['tile']} fwd {best['fwd']} bwd {best['bwd']}: {best['rel_fwd_bwd']:.2f}x "
                  f"(fwd {best['rel_fwd']:.2f}x)")


if __name__ == "__main__":
    run(main)
