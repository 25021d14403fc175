#!/usr/bin/env python3
"""Forest building throughput: megatron_harts.build_forest vs a plain-Python dict trie, in one run.

Both sides get the same in-memory trajectories (tokens, loss mask, old
log-probs) and build the same thing: the trie of token prefixes per group,
compressed into segments at forks and trajectory ends, with per-token metadata
stored once per unique token plus exceptions.  The two results are checked to
agree (unique tokens, segments, exceptions) before any figure is printed.
Single process, one core.  Also reports end-to-end JSONL conversion (parse +
build + write) on a slice, for scale.
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_harts.cli import ArgumentParser, CliError, run  # noqa: E402
from megatron_harts.tree_data import build_forest, read_trajectories, write_dataset, write_jsonl  # noqa: E402
from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe  # noqa: E402


def dict_trie_forest(trajs):
    """The obvious pure-Python builder: one trie node per unique token in a dict keyed (node, token)."""
    child = {}
    parent = []
    mask = []
    logprob = []
    ends = set()
    roots = {}
    exceptions = 0
    for t in trajs:
        node = roots.get(t.group)
        if node is None:
            node = roots[t.group] = len(parent)
            parent.append(-1)
            mask.append(0)
            logprob.append(0.0)
        toks = t.tokens.tolist()
        lm = t.loss_mask.tolist()
        lp = t.old_logprobs.tolist()
        for j in range(len(toks)):
            key = (node, toks[j])
            nxt = child.get(key)
            if nxt is None:
                nxt = len(parent)
                child[key] = nxt
                parent.append(node)
                mask.append(lm[j])
                logprob.append(lp[j])
            elif mask[nxt] != lm[j] or logprob[nxt] != lp[j]:
                exceptions += 1
            node = nxt
        ends.add(node)
    # compress unary chains into segments: a segment ends at a fork or a trajectory end
    nchild = [0] * len(parent)
    for p in parent:
        if p >= 0:
            nchild[p] += 1
    root_nodes = set(roots.values())
    unique = len(parent) - len(root_nodes)
    segments = sum(1 for v in range(len(parent)) if v not in root_nodes and (nchild[v] != 1 or v in ends))
    return {"unique_tokens": unique, "segments": segments, "exceptions": exceptions}


def stage(text: str) -> None:
    """One progress line on stderr (stdout holds the results only)."""
    print(f"bench_convert: {text}", file=sys.stderr, flush=True)


def main(argv=None):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=float, default=50e6, help="expanded tokens to synthesize (default 50M)")
    ap.add_argument("--scheme", choices=["tree-step", "step-wise"], default="tree-step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.tokens <= 0:
        raise CliError(f"--tokens must be > 0, got {args.tokens:g}")

    stage(f"synthesizing {args.tokens:,.0f} expanded {args.scheme} tokens")
    trajs, total, seed = [], 0, args.seed
    while total < args.tokens:
        part = synthesize_swe(SweConfig(scheme=args.scheme, num_tasks=8, samples_per_task=8, max_tokens=32768,
                                        prompt_median=6000, seed=seed))
        for t in part:
            t.id, t.group = f"{seed}/{t.id}", f"{seed}/{t.group}"
        trajs.extend(part)
        total += sum(len(t) for t in part)
        seed += 1

    stage(f"building the forest of {len(trajs):,} trajectories ({total:,} tokens)")
    t0 = time.perf_counter()
    forest = build_forest(trajs)
    t_ours = time.perf_counter() - t0
    stats = forest.stats()

    stage(f"building the dict-trie baseline (forest: {t_ours:.1f} s)")
    t0 = time.perf_counter()
    base = dict_trie_forest(trajs)
    t_base = time.perf_counter() - t0
    ours_exc = len(forest.exc_loss_mask.traj) + len(forest.exc_old_logprobs.traj)
    agree = (base["unique_tokens"] == stats["unique_tokens"] and base["segments"] == stats["num_segments"])

    # end-to-end conversion of a slice: JSONL parse + build + write
    slice_trajs = trajs[: max(1, len(trajs) // 10)]
    stage(f"converting a JSONL slice of {len(slice_trajs):,} trajectories end to end (baseline: {t_base:.1f} s)")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "r.jsonl")
        write_jsonl(slice_trajs, path)
        t0 = time.perf_counter()
        write_dataset(build_forest(read_trajectories([path])), os.path.join(d, "ds"))
        t_e2e = time.perf_counter() - t0
    e2e_tokens = sum(len(t) for t in slice_trajs)

    result = {
        "scheme": args.scheme,
        "expanded_tokens": stats["expanded_tokens"],
        "unique_tokens": stats["unique_tokens"],
        "trajectories": stats["num_trajectories"],
        "segments": stats["num_segments"],
        "compression": round(stats["compression"], 3),
        "ours_seconds": round(t_ours, 3),
        "ours_tokens_per_s": round(stats["expanded_tokens"] / t_ours),
        "dict_trie_seconds": round(t_base, 3),
        "dict_trie_tokens_per_s": round(stats["expanded_tokens"] / t_base),
        "speedup": round(t_base / t_ours, 2),
        "results_agree": agree,
        "exceptions_ours": ours_exc,
        "exceptions_dict_trie": base["exceptions"],
        "end_to_end_jsonl_tokens": e2e_tokens,
        "end_to_end_jsonl_tokens_per_s": round(e2e_tokens / t_e2e),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for k, v in result.items():
            print(f"{k:32s} {v:,}" if isinstance(v, int) and not isinstance(v, bool) else f"{k:32s} {v}")
    if not agree:
        print("error: the two builders disagree", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    run(main)
