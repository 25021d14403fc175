"""Paths longer than the row budget: pieces reading the earlier pieces' exports give the log-probs and
every parameter gradient of the uncut step (and of expanded training), fp64 to 1e-10."""
import numpy as np
import pytest
import torch

from megatron_harts.layout import build_layout
from megatron_harts.models.model import build_hybrid_model
from megatron_harts.planner.microbatch import MicrobatchPlan, PlanningError
from megatron_harts.planner.pieces import long_trees, plan_with_pieces, tree_pieces
from megatron_harts.schedules.windows import WindowedMicrobatch, piece_microbatches
from megatron_harts.tree_data import build_forest, make_trajectory

from hybrid_tiny import VOCAB, randomize_, tiny_config
from test_compaction_windows import expanded_with_events
from test_windows_schedule import assert_same, run_step


def long_forest(seed=0, compactions=False):
    """A 41-token chain, a tree whose shared 30-token prefix forks into four branches (one short), and a
    short tree."""
    rng = np.random.default_rng(seed)
    tok = lambda n: rng.integers(1, VOCAB, n).tolist()  # noqa: E731
    base = [1] + tok(29)
    recs = [{"id": "chain", "tokens": [0] + tok(40)},
            {"id": "a", "tokens": base + tok(7)}, {"id": "b", "tokens": base[:21] + tok(9)},
            {"id": "c", "tokens": base[:6] + tok(13)}, {"id": "d", "tokens": base[:30] + tok(2)},
            {"id": "e", "tokens": base[:6] + tok(3)},        # fits the budget: a group in expanded mode
            {"id": "short", "tokens": [2] + tok(6)}, {"id": "short2", "tokens": [2] + tok(8)}]
    if compactions:      # evictions whose spans and event rows sit in other pieces than their readers
        recs[0]["compactions"] = [{"at": 25, "start": 3, "end": 14}, {"at": 33, "start": 20, "end": 27}]
        recs[1]["compactions"] = [{"at": 24, "start": 2, "end": 11}]
        recs[4]["compactions"] = [{"at": 24, "start": 2, "end": 11}]
    return build_forest([make_trajectory(r) for r in recs])


def empty_plan(forest, mode):
    def make():
        from megatron_harts.planner.cost_model import CostModel
        return MicrobatchPlan(planner="pieces", mode=mode, num_replicas=1, num_slots=0, row_budget=12, chunk_size=4,
                              microbatches=[], slots=np.zeros((1, 0), dtype=np.int64), windows=[], expanded_tokens=0,
                              plan_seconds=0.0, cost_model=CostModel(chunk_size=4))
    return make


def whole_step(forest):
    return [WindowedMicrobatch(build_layout(forest))]


def pieces_step(forest, budget, mode="tree"):
    """Every tree cut into pieces (no fitting tree planned: the short tree is long-free and planned whole)."""
    plan = plan_with_pieces(forest, budget, 4, 1, lambda f: None, mode=mode, empty_plan=empty_plan(forest, mode)) \
        if long_trees(forest, budget).size == forest.num_trees else None
    return plan


@pytest.mark.parametrize("compactions", [False, True])
def test_long_paths_cut_into_pieces_equal_uncut(cpu_world, compactions):
    cfg = tiny_config(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 0)
    budget = 12
    full = long_forest(0, compactions)
    forest = full.select(long_trees(full, budget))        # the chain and the forked tree
    assert forest.num_trees == 2
    plan = plan_with_pieces(forest, budget, 4, 1, None, empty_plan=empty_plan(forest, "tree"))
    ps = plan.pieces
    step = ps.forest
    assert all(p.rows <= budget for p in ps.pieces)
    assert ps.chains[0][1] - ps.chains[0][0] >= 3
    items = piece_microbatches(plan, 0)
    assert sum(bool(mb.reads) for mb in items) >= 5
    cut = run_step(model, items)
    uncut = run_step(model, whole_step(step))
    assert_same(cut, uncut, "pieces vs uncut")
    assert_same(cut, expanded_with_events(model, step), "pieces vs expanded")


def test_plan_step_cuts_long_trees_and_keeps_the_rest(cpu_world):
    """``plan_step`` in every sharing mode: fitting trees planned as before, long trees cut into pieces of at
    most the budget; the replica's microbatches give the uncut step's log-probs and gradients."""
    from megatron_harts.training.step import SharingSettings, plan_step, replica_microbatches, step_forest
    cfg = tiny_config(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 1)
    forest = long_forest(1, compactions=True)
    budget = 12
    assert 0 < long_trees(forest, budget).size < forest.num_trees
    ref = None
    for sharing, planner in (("off", "ffd"), ("within", "l1"), ("windows", "l1l2")):
        settings = SharingSettings(sharing=sharing, microbatch_tokens=budget, planner=planner, replay=True)
        plan = plan_step(forest, settings, 1)
        assert plan.pieces is not None and plan.pieces.mode == ("expanded" if sharing == "off" else "tree")
        if sharing == "off":        # the long tree's trajectories that fit are packed, not cut
            ps = plan.pieces
            assert len(ps.groups) == 1 and ps.forest.traj_ids[int(ps.groups[0][0])] == "e"
            assert len(ps.chains) == 5 and ps.num_microbatches == len(ps.pieces) + 1   # chain, a, b, c, d
        items = replica_microbatches(forest, plan, 0, settings)
        assert all(mb.layout.num_rows <= budget for mb in items)
        assert any(mb.reads for mb in items)
        got = run_step(model, items)
        if ref is None:
            ref = expanded_with_events(model, step_forest(forest, plan))   # trajectory ids: the step forest's
        assert_same(got, ref, f"{sharing}: pieces vs expanded")


def test_every_tree_long_and_refusals():
    forest = long_forest(0)
    with pytest.raises(PlanningError, match="no empty plan"):
        plan_with_pieces(forest.select(long_trees(forest, 12)), 12, 4, 1, lambda f: None)
    f = forest.select(long_trees(forest, 12))
    with pytest.raises(PlanningError, match="--tree-microbatch-tokens"):
        tree_pieces(f, 0, 12)            # not cut at depths first: a segment is longer than the budget


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_pieces_and_windows_with_activation_recomputation(cpu_world, granularity):
    """``--recompute-granularity``: a windows-mode step with pieces gives the same log-probs and gradients
    as without recomputation, whether the read pieces keep their graphs (under full recomputation a kept
    graph holds the layers' inputs: the exports' gradients enter through the recording layers' outputs
    when the backward recomputes them) or run their forward again at their chain's end."""
    from megatron_harts.training.step import SharingSettings, plan_step, replica_microbatches
    kw = dict(recompute_granularity=granularity)
    if granularity == "full":
        kw.update(recompute_method="uniform", recompute_num_layers=1)
    else:          # the modules the hybrid model recomputes (megatron-core's default, core_attn, is refused)
        kw.update(recompute_modules=["layernorm", "mlp", "moe"])
    forest = long_forest(2, compactions=True)
    settings = SharingSettings(sharing="windows", microbatch_tokens=12, planner="l1l2", replay=True)
    plan = plan_step(forest, settings, 1)
    items = replica_microbatches(forest, plan, 0, settings)
    assert any(mb.reads for mb in items)
    base = tiny_config(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    plain = run_step(randomize_(build_hybrid_model(base, vocab_size=VOCAB), 3), items)
    cfg = tiny_config(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none", **kw)
    model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 3)
    for keep in ("all", "none"):
        got = counting_step(model, items, piece_keep=keep)
        assert_same(got, plain, f"recompute {granularity}, pieces keep={keep} vs no recomputation")
        assert got[2]["kept_pieces"] == (got[2]["read_pieces"] if keep == "all" else 0) and got[2]["read_pieces"]
    assert model.config.recompute_granularity == granularity


def counting_step(model, items, **kw):
    """``run_step`` of ``items`` with ``forward_backward_windows``'s keywords ``kw``, counting each item's
    forwards (the model's forward calls on its layout) and summing the routers' tokens per expert over the
    forwards that count the step's statistics (not a read piece's exports-only forward, as the driver's
    ``make_forward_step``): (log-probs, gradients, stats, forwards per item, tokens per expert)."""
    from megatron_harts.schedules.windows import forward_backward_windows
    from megatron_harts.training.step import _count_experts
    from test_windows_schedule import forward_step
    at = {id(mb.layout): i for i, mb in enumerate(items)}
    forwards = [0] * len(items)
    counters = {"tokens_per_expert": None}

    def counted(data_iterator, model):
        mb, psp = next(data_iterator)
        forwards[at[id(mb.layout)]] += 1
        out = forward_step(iter([(mb, psp)]), model)
        if not psp.preview:
            _count_experts(model, counters)
        return out
    model.zero_grad(set_to_none=True)
    stats = {}
    store = forward_backward_windows(forward_step_func=counted, data_iterator=iter(items), model=model,
                                     num_microbatches=len(items), window_stats=stats, **kw)
    lp = {k: v for s in store for k, v in s["lp"].items()}
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp, grads, stats, forwards, counters["tokens_per_expert"]


def long_tree_pieces():
    """The long trees of ``long_forest(3)`` (with compactions) in pieces of 12 rows on the tiny model (MoE aux
    loss on: its gradients ride the kept graphs too): (config, model, the plan, its step items, their
    pieces' plan, the read pieces)."""
    from megatron_harts.schedules.windows import _plan_pieces
    cfg = tiny_config()
    model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 5)
    full = long_forest(3, compactions=True)
    forest = full.select(long_trees(full, 12))
    plan = plan_with_pieces(forest, 12, 4, 1, None, empty_plan=empty_plan(forest, "tree"))
    items = piece_microbatches(plan, 0)
    planned = _plan_pieces(items, cfg)
    return cfg, model, plan, items, planned, sorted(set(planned.readers))


def test_piece_forwards_counted_and_kept_graphs_exact(cpu_world):
    """A read piece that keeps its graph runs its forward once, one that does not runs it twice (its
    exports-only forward, then again with its backward); the step stats report those extra rows.  Every
    choice (all, none, the memory plan's mix) gives the same log-probs, gradients (MoE aux loss included)
    and tokens per expert, and equals the uncut step's."""
    from megatron_harts.schedules.windows import step_memory_plan
    cfg, model, plan, items, planned, read = long_tree_pieces()
    assert len(read) >= 3 and len(read) < len(items)
    rows = [int(mb.layout.num_rows) for mb in items]
    runs = {}
    for keep in ("all", "none"):
        lp, grads, stats, forwards, tpe = runs[keep] = counting_step(model, items, piece_keep=keep)
        twice = set(read) if keep == "none" else set()
        assert forwards == [2 if i in twice else 1 for i in range(len(items))], keep
        assert stats["piece_rows"] == sum(rows) and stats["read_pieces"] == len(read)
        assert stats["piece_extra_forward_rows"] == sum(rows[i] for i in twice), keep
        assert stats["kept_pieces"] == len(read) - len(twice)
    # auto: a budget between keeping none and keeping all keeps some read pieces, recomputes the others
    lo = step_memory_plan(items, cfg, pieces=planned, piece_keep="none").predicted_peak_bytes
    hi = step_memory_plan(items, cfg, pieces=planned, piece_keep="all").predicted_peak_bytes
    assert lo < hi
    mixed = None
    for b in np.linspace(lo, hi, 32).astype(np.int64):
        m = step_memory_plan(items, cfg, pieces=planned, piece_keep="auto", piece_budget_bytes=int(b))
        assert m.predicted_peak_bytes <= max(int(b), lo)
        if m.kept_pieces and m.recomputed_pieces:
            mixed = int(b), m
            break
    assert mixed is not None
    budget, m = mixed
    runs["auto"] = counting_step(model, items, piece_keep="auto", piece_budget=budget)
    forwards = runs["auto"][3]
    assert [i for i in read if forwards[i] == 2] == list(m.recomputed_pieces)
    assert runs["auto"][2]["predicted_peak_bytes"] == m.predicted_peak_bytes
    assert step_memory_plan(items, cfg, pieces=planned, piece_keep="auto", piece_budget_bytes=hi).kept_pieces == \
        tuple(read)
    for keep in ("none", "auto"):
        assert_same(runs[keep], runs["all"], f"pieces keep={keep} vs all (aux loss on)")
        torch.testing.assert_close(runs[keep][4], runs["all"][4], rtol=0, atol=0)
    # the uncut step: the same log-probs and tokens per expert (its gradients differ by the aux loss, which
    # megatron defines per microbatch; test_long_paths_cut_into_pieces_equal_uncut compares them without it)
    uncut = counting_step(model, whole_step(plan.pieces.forest))
    assert uncut[3] == [1]
    assert set(uncut[0]) == set(runs["all"][0])
    assert all(abs(runs["all"][0][k] - v) <= 1e-10 * max(1.0, abs(v)) for k, v in uncut[0].items())
    torch.testing.assert_close(runs["all"][4], uncut[4], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="needs piece_budget"):
        counting_step(model, items, piece_keep="auto")
    with pytest.raises(ValueError, match="no read piece"):
        counting_step(model, items, piece_keep=[len(items) - 1])


def test_pieces_keeping_part_of_their_graph(cpu_world):
    """A read piece may keep part of its graph: its first layers checkpointed (megatron's block
    recomputation), their forward run again in its backward, the exports recorded there getting their
    gradients when it does.  Same log-probs, gradients (aux loss on) and tokens per expert as keeping
    every graph whole; the layers' forwards counted; the run's own recomputation settings untouched; the
    memory plan keeps a piece that does not fit whole with the fewest recomputed layers that fit."""
    from megatron_harts.schedules.windows import step_memory_plan
    cfg, model, plan, items, planned, read = long_tree_pieces()
    rows = [int(mb.layout.num_rows) for mb in items]
    L = cfg.num_layers
    calls = [0] * L
    hooks = [layer.register_forward_hook(lambda *_, n=n: calls.__setitem__(n, calls[n] + 1))
             for n, layer in enumerate(model.decoder.layers)]
    try:
        whole = counting_step(model, items, piece_keep="all")
        assert calls == [len(items)] * L
        calls[:] = [0] * L
        part = {read[0]: 1, read[1]: L - 1}
        got = counting_step(model, items, piece_keep=part)
        again = len(read) - len(part)       # the other read pieces run their whole forward again
        assert calls == [len(items) + again + sum(n < k for k in part.values()) for n in range(L)], calls
    finally:
        for h in hooks:
            h.remove()
    assert model.config.recompute_granularity is None and model.config.recompute_method is None
    assert_same(got, whole, "pieces keeping part of their graph vs whole")
    torch.testing.assert_close(got[4], whole[4], rtol=0, atol=0)
    assert [got[3][i] for i in part] == [1, 1]         # one model forward each: the layers recompute inside
    s = got[2]
    assert s["kept_pieces"] == 2 and s["partly_kept_pieces"] == 2
    assert s["piece_extra_forward_rows"] == rows[read[0]] * 1 // L + rows[read[1]] * (L - 1) // L + \
        sum(rows[i] for i in read[2:])
    # the memory plan: below what keeping every graph whole needs, a piece is kept in part
    hi = step_memory_plan(items, cfg, pieces=planned, piece_keep="all").predicted_peak_bytes
    lo = step_memory_plan(items, cfg, pieces=planned, piece_keep="none").predicted_peak_bytes
    found = None
    for b in np.linspace(hi, lo, 64).astype(np.int64):
        m = step_memory_plan(items, cfg, pieces=planned, piece_keep="auto", piece_budget_bytes=int(b))
        assert m.predicted_peak_bytes <= max(int(b), lo)
        assert set(m.piece_layers) <= set(m.kept_pieces) and all(0 < n < L for n in m.piece_layers.values())
        for i, n in m.piece_layers.items():   # the fewest recomputed layers: one fewer does not fit
            fewer = {**{j: m.piece_layers.get(j, 0) for j in m.kept_pieces}, i: n - 1}
            assert step_memory_plan(items, cfg, pieces=planned, piece_keep=fewer).predicted_peak_bytes > b
        if m.piece_layers and found is None:
            found = int(b), m
    assert found is not None
    budget, m = found
    auto = counting_step(model, items, piece_keep="auto", piece_budget=budget)
    assert auto[2]["partly_kept_pieces"] == len(m.piece_layers) and auto[2]["predicted_peak_bytes"] == \
        m.predicted_peak_bytes
    assert_same(auto, whole, "pieces auto (some kept in part) vs whole")
    # a run that recomputes on its own keeps whole graphs (its kept graph is the layers' inputs already)
    rec = randomize_(build_hybrid_model(tiny_config(recompute_granularity="full", recompute_method="uniform",
                                                    recompute_num_layers=1), vocab_size=VOCAB), 5)
    assert step_memory_plan(items, rec.config, pieces=planned, piece_keep="auto",
                            piece_budget_bytes=budget).piece_layers == {}
    with pytest.raises(ValueError, match="without --recompute-granularity"):
        counting_step(rec, items, piece_keep={read[0]: 1})
    with pytest.raises(ValueError, match=r"recomputed layers must lie in \[0, "):
        counting_step(model, items, piece_keep={read[0]: L})


def test_read_pieces_run_their_backward_once_their_readers_are_done():
    """``piece_backward_points``: a read piece's backward right after the forward of its last reader (a read
    reader: that reader's point), pieces of one point last first; the pipeline's backward order and the
    memory model follow it, so a tree's branch releases its pieces' graphs when the branch ends."""
    import random

    from megatron_harts.planner.memory import StepItem, plan_window_memory
    from megatron_harts.planner.pieces import piece_backward_points
    from megatron_harts.schedules.pipeline import piece_backward_order
    tree = [[], [0], [0, 1], [0], [0, 3]]          # prefix 0; branch 1 -> 2, branch 3 -> 4
    assert piece_backward_points(tree) == {2: [1], 4: [3, 0]}
    assert piece_backward_order(tree) == [2, 1, 4, 3, 0]
    assert piece_backward_points([[], [0], [0, 1], [0, 1, 2]]) == {3: [2, 1, 0]}
    assert piece_backward_points([[], [0], [], [1]]) == {3: [1, 0]}
    with pytest.raises(ValueError, match="does not run before it"):
        piece_backward_points([[1], []])
    rng = random.Random(0)
    for _ in range(200):                            # every order valid, every backward at its earliest point
        n = rng.randint(1, 9)
        reads = [sorted(rng.sample(range(j), rng.randint(0, min(j, 3)))) for j in range(n)]
        order = piece_backward_order(reads)
        at = {p: i for i, p in enumerate(order)}
        readers = {}
        for j, rs in enumerate(reads):
            for r in rs:
                readers.setdefault(r, []).append(j)
        assert sorted(order) == sorted({i for i, rs in enumerate(reads) if rs} | set(readers))
        points = {p: j for j, ps in piece_backward_points(reads).items() for p in ps}
        for p, rs in readers.items():
            assert all(at[r] < at[p] for r in rs)
            assert points[p] == max(points.get(r, r) for r in rs)
    # the memory model: branch 1's kept graph is gone when branch 3 runs (at the chain's end it would not be)
    items = [StepItem(10, export_bytes=5 if i in (0, 1, 3) else 0, reads=tuple(r), read_later=i in (0, 1, 3))
             for i, r in enumerate(tree)]
    plan = plan_window_memory(items, saved_per_row=10, graph_per_row=10, piece_graph_per_row=2, piece_keep="all")
    assert plan.predicted_peak_bytes == 150         # 100 running + 2 x 5 exports + 2 x 20 graphs, never three


def test_profile_finds_the_forward_a_piece_kept_in_part_runs_again(cpu_world):
    """benchmarks/step_profile.py on a profiled CPU step: the layers a piece kept in part checkpoints run
    their forward again inside their checkpoint node's backward, and that work (not the backward nested in
    it) is the pieces' extra forward; a step keeping every graph whole has none."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_harts.models.cores import ATTENTION_RANGE, KDA_RANGE
    from megatron_harts.schedules.windows import PIECES_KEPT_RANGE, PIECES_RANGE
    from tool_runner import load_tool
    sp = load_tool("step_profile", "benchmarks")
    cfg, model, plan, items, planned, read = long_tree_pieces()
    L = cfg.num_layers

    def extra(piece_keep):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            counting_step(model, items, piece_keep=piece_keep)
        work, _, _ = sp.profile_work(prof.events(), "cpu", ATTENTION_RANGE, KDA_RANGE, PIECES_RANGE,
                                     PIECES_KEPT_RANGE)
        names: dict = {}
        for name, s, scopes in work:
            names.setdefault(sp.bucket(name, scopes), []).append(name)
        return names

    assert "pieces_extra_forward" not in extra("all")
    got = extra({r: L - 1 for r in read})            # every read piece kept, its first L-1 layers checkpointed
    fwd = got["pieces_extra_forward"]
    assert "aten::mm" in fwd or "aten::addmm" in fwd or "aten::linear" in fwd
    assert not any(n.endswith("_backward") or "backward" in n for n in fwd), sorted(set(fwd))
    assert any("backward" in n for b in ("attention_backward", "kda", "gemm", "other") for n in got.get(b, ()))
