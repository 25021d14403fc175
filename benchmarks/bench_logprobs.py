#!/usr/bin/env python3
"""The output layer's log-probs at a large vocabulary: chunk sizes against the unchunked form, one run.

Times forward + backward of ``ops.logprobs.multi_target_logprobs`` (what tree and expanded mode
both run for their targets: logits ``chunk_rows`` rows at a time, the backward recomputing each
chunk's logits) at every ``--chunks`` size, and of the unchunked fused form
(``multi_target_logprobs_reference``: the whole [rows, vocab] logits, ``log_softmax``, gather,
autograd's backward) where it fits, for each ``--rows`` count, on the same inputs: hidden states
[rows, hidden] and the output weight [vocab, hidden] in ``--dtype`` (bf16 by default), one target
per row plus a second token on ``--extra-pairs`` of the rows (fork rows; the pairs on the host, as
the driver passes them), the loss a random
weighting of the pair log-probs (``--entropy``: plus the rows' entropies).

Per variant: the median milliseconds of ``--iters`` timed forward + backward passes after
``--warmup`` (CUDA synchronized around each), the peak memory above what was allocated before the
pass (``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``; CUDA only), and the
largest log-prob difference against the unchunked form (or, where that did not fit, against the
first chunk size): numbers that differ only by rounding (a GEMM of another shape).  A variant that
runs out of memory is recorded as such.  Per row count the fastest variant is named.  Defaults:
Kimi-Linear-48B-A3B's output layer (vocab 163,840, hidden 2304) at 16k and 32k rows.

Writes one JSON object (``--out``; ``--json`` prints it).  ``--device cpu`` with small sizes is a
smoke run (times only).
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_harts.cli import ArgumentParser, CliError, output_path, run  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
DEFAULT_CHUNKS = (256, 409, 512, 1024, 2048, 4096, 8192)


def make_inputs(rows, vocab, hidden, dtype, device, extra_pairs, seed=0):
    """Hidden states, output weight (scaled like a trained model's logits: std about 2), the pairs
    (every row's next token, and a second distinct token on ``extra_pairs`` of the rows) and the
    loss weights."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(vocab, hidden, generator=g) * (2.0 / hidden ** 0.5)).to(device=device, dtype=dtype)
    tok = torch.randint(0, vocab, (rows,), generator=g)
    fork = torch.nonzero(torch.rand(rows, generator=g) < extra_pairs).flatten()
    pair_row = torch.cat([torch.arange(rows), fork])
    pair_token = torch.cat([tok, (tok[fork] + 1 + torch.randint(0, vocab - 1, (fork.numel(),), generator=g)) % vocab])
    stat = torch.float64 if dtype == torch.float64 else torch.float32       # the log-probs' dtype
    grad_lp = torch.randn(pair_row.numel(), generator=g, dtype=torch.float64).to(device=device, dtype=stat)
    grad_ent = torch.randn(rows, generator=g, dtype=torch.float64).to(device=device, dtype=stat)
    return h, w, pair_row, pair_token, grad_lp, grad_ent


def one_pass(fn, h, w, pair_row, pair_token, grad_lp, grad_ent, entropy):
    """Forward and backward of one variant; the log-probs (detached)."""
    h.grad = w.grad = None
    out = fn(h, w, pair_row, pair_token, entropy)
    lp, ent = out if entropy else (out, None)
    loss = (lp * grad_lp).sum()
    if entropy:
        loss = loss + (ent * grad_ent).sum()
    loss.backward()
    return lp.detach()


def time_variant(fn, inputs, entropy, iters, warmup, device):
    """(median ms, every ms, peak GiB above the start or None, log-probs of the last pass)."""
    cuda = device == "cuda"
    times, peak, lp = [], None, None
    for i in range(warmup + iters):
        if cuda:
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        lp = one_pass(fn, *inputs, entropy)
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt * 1e3)
            if cuda:
                peak = max(peak or 0.0, (torch.cuda.max_memory_allocated() - start) / 2 ** 30)
    h, w = inputs[0], inputs[1]
    h.grad = w.grad = None
    return statistics.median(times), times, peak, lp


def main(argv=None):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--rows", type=int, nargs="+", default=[16384, 32768],
                    help="rows (hidden states that carry targets) per pass, one measurement each (default 16384 32768)")
    ap.add_argument("--vocab", type=int, default=163840, help="vocabulary size (default 163840, Kimi-Linear's)")
    ap.add_argument("--hidden", type=int, default=2304, help="hidden size (default 2304, Kimi-Linear-48B-A3B's)")
    ap.add_argument("--chunks", type=int, nargs="+", default=list(DEFAULT_CHUNKS),
                    help="chunk sizes (rows per logits chunk) to time; 409 is the default at vocab 163,840 "
                         "(default: %(default)s)")
    ap.add_argument("--no-unchunked", action="store_true", help="skip the unchunked full-logits form")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="inputs' dtype (default bf16)")
    ap.add_argument("--extra-pairs", type=float, default=0.1,
                    help="fraction of rows with a second target token, as fork rows have (default 0.1)")
    ap.add_argument("--entropy", action="store_true", help="also the rows' entropies (an entropy bonus)")
    ap.add_argument("--iters", type=int, default=5, help="timed passes per variant (default 5)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed passes first (default 2)")
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/logprobs-<time>.json)")
    ap.add_argument("--json", action="store_true", help="print the results JSON")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda: no CUDA device is visible here (use --device cpu with small sizes for a "
                       "smoke run)")
    for flag, values in (("--rows", a.rows), ("--chunks", a.chunks), ("--vocab", [a.vocab]),
                         ("--hidden", [a.hidden]), ("--iters", [a.iters])):
        bad = [v for v in values if v < 1]
        if bad:
            raise CliError(f"{flag} {bad[0]}: must be >= 1")
    if a.vocab < 2:
        raise CliError(f"--vocab {a.vocab}: must be >= 2 (a second target token per fork row)")
    if a.warmup < 0:
        raise CliError(f"--warmup {a.warmup}: must be >= 0")
    if not 0.0 <= a.extra_pairs <= 1.0:
        raise CliError(f"--extra-pairs {a.extra_pairs}: must be in [0, 1]")
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                time.strftime("logprobs-%Y%m%d-%H%M%S.json"))
    if a.out:
        output_path(out, "--out")
    else:
        os.makedirs(os.path.dirname(out), exist_ok=True)

    from megatron_harts.ops.logprobs import default_chunk_rows, multi_target_logprobs, multi_target_logprobs_reference
    dtype = DTYPES[a.dtype]
    results = {"machine": {"device": torch.cuda.get_device_name() if a.device == "cuda" else platform.processor(),
                           "python": platform.python_version(), "torch": torch.__version__},
               "args": vars(a), "default_chunk_rows": default_chunk_rows(a.vocab, dtype), "runs": []}
    for rows in a.rows:
        inputs = make_inputs(rows, a.vocab, a.hidden, dtype, a.device, a.extra_pairs)
        h, w = inputs[0].requires_grad_(), inputs[1].requires_grad_()
        # the pairs stay on the host, as the driver passes them (a layout's host copy)
        pair_row, pair_token = inputs[2], inputs[3]
        args = (h, w, pair_row, pair_token, inputs[4], inputs[5])
        entry = {"rows": rows, "pairs": int(pair_row.numel()), "variants": {}}
        variants = [] if a.no_unchunked else [("unchunked", None)]
        variants += [(f"chunk_{c}", c) for c in a.chunks]
        ref_lp = None
        for name, chunk in variants:
            if chunk is None:
                def fn(h, w, r, t, ent):
                    return multi_target_logprobs_reference(h, w, r, t, return_entropy=ent)
            else:
                def fn(h, w, r, t, ent, chunk=chunk):
                    return multi_target_logprobs(h, w, r, t, chunk_rows=chunk, return_entropy=ent)
            try:
                ms, all_ms, peak, lp = time_variant(fn, args, a.entropy, a.iters, a.warmup, a.device)
            except torch.OutOfMemoryError as e:
                h.grad = w.grad = None
                entry["variants"][name] = {"chunk_rows": chunk, "error": f"out of memory: {str(e).splitlines()[0]}"}
                print(f"rows {rows} {name}: out of memory", flush=True)
                if a.device == "cuda":
                    torch.cuda.empty_cache()
                continue
            if ref_lp is None:
                ref_lp = lp
            diff = float((lp.double() - ref_lp.double()).abs().max()) if lp.numel() else 0.0
            entry["variants"][name] = {"chunk_rows": chunk, "ms": ms, "ms_all": all_ms, "peak_gib_above_start": peak,
                                       "max_abs_logprob_diff": diff}
            del lp
            if a.device == "cuda":
                torch.cuda.empty_cache()
            print(f"rows {rows} {name}: {ms:.2f} ms, peak above start "
                  f"{'n/a' if peak is None else f'{peak:.2f} GiB'}, max |lp diff| {diff:.2e}", flush=True)
        timed = {k: v["ms"] for k, v in entry["variants"].items() if "ms" in v}
        if timed:
            entry["fastest"] = min(timed, key=timed.get)
            chunked = {k: v for k, v in timed.items() if k != "unchunked"}
            entry["fastest_chunked"] = min(chunked, key=chunked.get) if chunked else None
        entry["reference_for_diff"] = next(iter(timed), None)
        results["runs"].append(entry)
        del args, inputs, h, w
        with open(out, "w") as f:          # after every row count: a cut-short run keeps what it measured
            json.dump(results, f, indent=2)
    if a.json:
        print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    run(main)
