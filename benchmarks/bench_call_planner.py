"""Call planner benchmark: planning speed (C++ vs Python reference) and calls vs baselines.

Part 1 times ``plan_calls`` on random forests of 10^3 .. 10^6 segments (DFS preorder, random
recursive trees, lengths uniform in [1, 2B]) and prints segments/s and ns/segment per size, so
linear growth shows as a flat ns/segment column.  Part 2 plans SWE-like synthetic rollout
forests (a local generator: long shared prompt, turns of 100-500 policy tokens and 200-3000
observation tokens; "Tree-Step" branches into k children at random steps, "Step-wise" also ends
a training sample after every policy turn, so each sample ends inside the next one's path) and
compares the number of KDA calls of the optimal plan with per-depth bucketing and node-wise
execution (megatron_harts.planner.baselines), plus tokens computed vs expanded execution.

    python benchmarks/bench_call_planner.py            # full run, text tables
    python benchmarks/bench_call_planner.py --quick    # small sizes
    python benchmarks/bench_call_planner.py --json     # one JSON document on stdout
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from megatron_harts.cli import ArgumentParser, run
from megatron_harts.planner import baselines
from megatron_harts.planner.calls import plan_calls

try:
    from megatron_harts import _C
except ImportError:  # pragma: no cover - the benchmark reports the Python reference only
    _C = None


# --------------------------------------------------------------------------- random forests

def random_preorder_tree(n: int, chunk_size: int, seed: int):
    """A random recursive tree (parent uniform among earlier nodes) relabelled in DFS preorder,
    with lengths uniform in [1, 2B]; returns int64 (parent, start, length)."""
    rng = np.random.default_rng(seed)
    raw = np.empty(n, dtype=np.int64)
    raw[0] = -1
    if n > 1:
        raw[1:] = (rng.random(n - 1) * np.arange(1, n)).astype(np.int64)
    kids_order = np.argsort(raw[1:], kind="stable") + 1
    counts = np.bincount(raw[1:], minlength=n)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    kids = kids_order.tolist()
    off = offsets.tolist()
    order = []
    stack = [0]
    while stack:
        x = stack.pop()
        order.append(x)
        stack.extend(reversed(kids[off[x]:off[x + 1]]))
    order = np.asarray(order, dtype=np.int64)
    new_id = np.empty(n, dtype=np.int64)
    new_id[order] = np.arange(n)
    old_parent = raw[order]
    parent = np.where(old_parent >= 0, new_id[np.maximum(old_parent, 0)], -1)
    length = rng.integers(1, 2 * chunk_size + 1, size=n).astype(np.int64)
    start = np.zeros(n, dtype=np.int64)
    par = parent.tolist()
    ln = length.tolist()
    st = [0] * n
    for i in range(1, n):
        p = par[i]
        st[i] = st[p] + ln[p]
    start[:] = st
    return parent, start, length


def best_time(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def stage(text: str) -> None:
    """One progress line on stderr (stdout holds the tables or the JSON only)."""
    print(f"bench_call_planner: {text}", file=sys.stderr, flush=True)


def bench_speed(sizes, python_max, chunk_size, reps, seed):
    rows = []
    for n in sizes:
        stage(f"speed: {n:,} segments")
        parent, start, length = random_preorder_tree(n, chunk_size, seed)
        row = {"segments": n}
        plan = plan_calls(parent, start, length, chunk_size, backend="python" if _C is None else "cpp")
        row["calls"] = plan.num_calls
        if _C is not None:
            core = best_time(lambda: _C.plan_calls(parent, start, length, chunk_size, True), reps)
            api = best_time(lambda: plan_calls(parent, start, length, chunk_size, backend="cpp"), reps)
            row["cpp_core_s"] = core
            row["cpp_core_segments_per_s"] = n / core
            row["cpp_api_s"] = api
            row["cpp_api_segments_per_s"] = n / api
        if n <= python_max:
            py = best_time(lambda: plan_calls(parent, start, length, chunk_size, backend="python"),
                           1 if n >= 100_000 else reps)
            row["python_s"] = py
            row["python_segments_per_s"] = n / py
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- SWE-like forests

def swe_forest(rng, n_trees, max_steps, max_leaves, branch_prob, max_k, stepwise,
               group=1, prompt=(1000, 6000), policy=(100, 500), obs=(200, 3000)):
    """SWE-like rollout forest: returns int64 (parent, start, length).

    Each tree is a prompt followed by turns (policy tokens, then observation tokens).  Before a
    turn a trajectory branches into ``k`` in [2, max_k] children with ``branch_prob`` (at most
    ``max_leaves`` trajectories per tree); the root branches into ``group`` rollouts first.
    Every branch draws its own last step.  The last turn of a trajectory has no observation.
    With ``stepwise`` a training sample ends after every policy turn, which splits segments.
    """
    p_parent, p_len, p_cut = [], [], []

    def add(par, ln, cut):
        p_parent.append(par)
        p_len.append(int(ln))
        p_cut.append(cut)
        return len(p_parent) - 1

    for _ in range(n_trees):
        root = add(-1, rng.integers(*prompt), False)
        leaves = 1
        frontier = []
        g = min(group, max_leaves)
        leaves += g - 1
        for _ in range(g):
            frontier.append((root, 0, int(rng.integers(max(1, max_steps // 2), max_steps + 1))))
        while frontier:
            node, step, last = frontier.pop()
            k = 1
            if step > 0 and leaves < max_leaves and rng.random() < branch_prob:
                k = int(min(rng.integers(2, max_k + 1), max_leaves - leaves + 1))
                leaves += k - 1
            for j in range(k):
                end = last if (j == 0 or last <= step + 1) else int(rng.integers(step + 1, last + 1))
                pol = add(node, rng.integers(*policy), stepwise)
                if step + 1 < end:
                    o = add(pol, rng.integers(*obs), False)
                    frontier.append((o, step + 1, end))
    return _compress_pieces(p_parent, p_len, p_cut)


def _compress_pieces(p_parent, p_len, p_cut):
    """Merge pieces into segments: a piece starts a segment at a root, after a fork, or after a
    cut (a sample end); segments are emitted in DFS preorder of the pieces."""
    n = len(p_parent)
    kids = [[] for _ in range(n)]
    for i, p in enumerate(p_parent):
        if p >= 0:
            kids[p].append(i)
    seg_of = [-1] * n
    parent, start, length = [], [], []
    stack = [i for i in range(n - 1, -1, -1) if p_parent[i] < 0]
    while stack:
        x = stack.pop()
        p = p_parent[x]
        if p >= 0 and len(kids[p]) == 1 and not p_cut[p]:
            s = seg_of[p]
            length[s] += p_len[x]
        else:
            s = len(parent)
            ps = seg_of[p] if p >= 0 else -1
            parent.append(ps)
            start.append(0 if ps < 0 else start[ps] + length[ps])
            length.append(p_len[x])
        seg_of[x] = s
        stack.extend(reversed(kids[x]))
    return (np.asarray(parent, dtype=np.int64), np.asarray(start, dtype=np.int64),
            np.asarray(length, dtype=np.int64))


WORKLOADS = {
    # name: (kind, generator kwargs)
    "tree-step/32x8": ("Tree-Step", dict(n_trees=32, max_steps=16, max_leaves=8, branch_prob=0.25, max_k=3, stepwise=False)),
    "tree-step/8x32": ("Tree-Step", dict(n_trees=8, max_steps=30, max_leaves=32, branch_prob=0.3, max_k=4, stepwise=False)),
    "tree-step/4x64": ("Tree-Step", dict(n_trees=4, max_steps=50, max_leaves=64, branch_prob=0.2, max_k=2, stepwise=False)),
    "tree-step/G8": ("Tree-Step", dict(n_trees=16, max_steps=20, max_leaves=32, branch_prob=0.2, max_k=3, stepwise=False, group=8)),
    "step-wise/G8": ("Step-wise", dict(n_trees=32, max_steps=16, max_leaves=8, branch_prob=0.0, max_k=2, stepwise=True, group=8)),
    "tree+step-wise/8x32": ("Step-wise", dict(n_trees=8, max_steps=30, max_leaves=32, branch_prob=0.3, max_k=4, stepwise=True)),
}


def bench_workloads(chunk_size, seeds):
    rows = []
    for name, (kind, kwargs) in WORKLOADS.items():
        stage(f"workload {name}: {len(seeds)} forests")
        for seed in seeds:
            rng = np.random.default_rng(seed)
            parent, start, length = swe_forest(rng, **kwargs)
            res = baselines.all_baselines(parent, start, length, chunk_size)
            plan = plan_calls(parent, start, length, chunk_size)
            plan.validate(parent, start, length, chunk_size)
            rows.append({
                "workload": name,
                "kind": kind,
                "seed": seed,
                "segments": int(parent.size),
                "unique_tokens": int(length.sum()),
                "calls_harts": res["harts"]["calls"],
                "calls_harts_no_replay": res["harts_no_replay"]["calls"],
                "calls_per_depth": res["per_depth"]["calls"],
                "calls_node_wise": res["node_wise"]["calls"],
                "replay_tokens": res["harts"]["replay_tokens"],
                "tokens_harts": res["harts"]["tokens_computed"],
                "tokens_expanded": res["expanded"]["tokens_computed"],
                "compression": res["expanded"]["tokens_computed"] / res["harts"]["tokens_computed"],
            })
    return rows


def print_tables(speed, work, out=sys.stdout):
    print("== planner speed (random preorder trees, B=64; best of reps) ==", file=out)
    print(f"{'segments':>10} {'calls':>5} {'C++ core Mseg/s':>16} {'C++ ns/seg':>10} "
          f"{'C++ API Mseg/s':>15} {'Python Mseg/s':>14} {'Python ns/seg':>13}", file=out)
    for r in speed:
        core = r.get("cpp_core_segments_per_s")
        api = r.get("cpp_api_segments_per_s")
        py = r.get("python_segments_per_s")
        fmt = lambda x, k=1e6: f"{x / k:.2f}" if x else "-"  # noqa: E731
        ns = lambda x: f"{1e9 / x:.0f}" if x else "-"  # noqa: E731
        print(f"{r['segments']:>10} {r['calls']:>5} {fmt(core):>16} {ns(core):>10} {fmt(api):>15} "
              f"{fmt(py):>14} {ns(py):>13}", file=out)
    print("\n== calls on SWE-like forests (B=64) ==", file=out)
    print(f"{'workload':>22} {'seed':>4} {'segs':>5} {'HARTS':>5} {'no-rep':>6} {'per-depth':>9} "
          f"{'node-wise':>9} {'replay':>7} {'compression':>11}", file=out)
    for r in work:
        print(f"{r['workload']:>22} {r['seed']:>4} {r['segments']:>5} {r['calls_harts']:>5} "
              f"{r['calls_harts_no_replay']:>6} {r['calls_per_depth']:>9} {r['calls_node_wise']:>9} "
              f"{r['replay_tokens']:>7} {r['compression']:>10.2f}x", file=out)
    tree_step = [r for r in work if r["kind"] == "Tree-Step"]
    fewer = sum(r["calls_harts"] < r["calls_per_depth"] for r in tree_step)
    print(f"\nTree-Step forests with fewer calls than per-depth bucketing: {fewer}/{len(tree_step)}",
          file=out)


def main(argv=None):
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=None,
                    help="segment counts for the speed table (default 1e3 1e4 1e5 1e6)")
    ap.add_argument("--python-max", type=int, default=100_000,
                    help="largest size timed with the Python reference (default 1e5)")
    ap.add_argument("--chunk-size", type=int, default=64, help="KDA chunk size B (default 64)")
    ap.add_argument("--reps", type=int, default=5, help="timing repetitions, best kept")
    ap.add_argument("--seeds", type=int, default=5, help="SWE-like forests per workload")
    ap.add_argument("--quick", action="store_true", help="small sizes and 2 seeds")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    args = ap.parse_args(argv)
    sizes = args.sizes or ([1_000, 10_000] if args.quick else [1_000, 10_000, 100_000, 1_000_000])
    seeds = list(range(2 if args.quick else args.seeds))
    speed = bench_speed(sizes, args.python_max, args.chunk_size, args.reps, seed=0)
    work = bench_workloads(args.chunk_size, seeds)
    if args.json:
        json.dump({"chunk_size": args.chunk_size, "cpp": _C is not None, "speed": speed,
                   "workloads": work}, sys.stdout, indent=1)
        print()
    else:
        print_tables(speed, work)


if __name__ == "__main__":
    run(main)
