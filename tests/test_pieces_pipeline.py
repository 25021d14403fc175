"""Pieces of paths longer than the row budget under the pipeline schedules.

- ``stage_orders`` with ``reads`` (pure Python): the pieces run after the step's other microbatches,
  forwards in step order, backwards in the pipeline-size-1 schedule's order (a read piece after
  every reader), 1F1B-interleaved per stage; on steps mixing windows and random piece chains the
  orders pass ``check_stage_orders`` (with the reads' constraints) and ``check_p2p_channels`` on 2,
  3 and 4 stages under every schedule; a piece that is a window's producer or consumer is refused.
- gloo world of 2 processes (fp64, tiny hybrid model, MoE aux loss 0), pipeline size 2, every
  schedule: a step of a forked tree and a chain cut into pieces, with a sharing window on a fitting
  tree, with and without compaction events crossing piece boundaries, and the steps ``plan_step``
  gives with ``--tree-sharing off``, ``within`` and ``windows`` (pieces after the planned
  microbatches) give the log-probs and every parameter gradient (1e-10 relative) of the same step
  on pipeline size 1 and of expanded training, read pieces keeping their graphs (one forward each)
  and recomputed (their forward again at their backward, the extra rows reported); also with
  activation recomputation (full, uniform) in both ways and the memory model's choice; forward only,
  the log-probs of pipeline size 1.
- the driver, pipeline size 2, a 16-row budget under trajectories of up to 43 tokens: every sharing
  mode's losses, objective terms and parameters equal uncut expanded training on pipeline size 1.
"""
import os

import numpy as np
import pytest
import torch

from megatron_harts.schedules.pipeline import (SCHEDULES, check_p2p_channels, check_stage_orders,
                                               piece_backward_order, piece_orders, stage_orders)

from multiproc import run_ranks
from test_pipeline_schedules import random_structure

BUDGET = 12


# ---------------------------------------------------------------------------------------------
# orders
# ---------------------------------------------------------------------------------------------
def random_chains(rng, start, n_chains):
    """``reads`` of random piece chains placed from step position ``start`` on: each piece reads a
    root path, i.e. an ancestor chain of earlier pieces of its chain (as ``planner.pieces`` makes)."""
    reads = {}
    pos = start
    for _ in range(n_chains):
        k = int(rng.integers(1, 6))
        members = list(range(pos, pos + k))
        paths = {members[0]: ()}
        for j in members[1:]:
            parent = int(rng.choice(members[:members.index(j)]))
            paths[j] = paths[parent] + (parent,)
            reads[j] = tuple(sorted(paths[j]))
        reads.setdefault(members[0], ())
        pos += k
    return reads, pos


def mixed_step(rng):
    """A step of windows and plain microbatches followed by piece chains: (producer_of, reads)."""
    n = int(rng.integers(0, 7))
    producer_of = random_structure(rng, n)
    chain_reads, end = random_chains(rng, n, int(rng.integers(1, 4)))
    producer_of += [None] * (end - n)
    reads = [()] * n + [chain_reads.get(i, ()) for i in range(n, end)]
    return producer_of, reads


def test_piece_orders_run_on_every_stage():
    rng = np.random.default_rng(0)
    for _ in range(40):
        po, reads = mixed_step(rng)
        read = {r for rs in reads for r in rs}
        for S in (2, 3, 4):
            for sch in SCHEDULES:
                orders = stage_orders(po, S, sch, reads=reads)
                check_stage_orders(orders, po, reads)
                check_p2p_channels(orders)
                for o in orders:
                    back = [i for k, i in o if k == "B"]
                    for j, rs in enumerate(reads):       # a read piece's backward after each reader's
                        assert all(back.index(r) > back.index(j) for r in rs), (po, reads, o)
                    pieces = [i for i in range(len(po)) if reads[i] or i in read]
                    assert [i for k, i in o if k == "F"][len(po) - len(pieces):] == pieces
            assert stage_orders(po, S, "consumer-1f1b", forward_only=True, reads=reads)[S - 1] == \
                [("F", i) for i in range(len(po))]


def test_piece_orders_chain_and_fork():
    # a chain of 3 (each reads all before it) and a fork (two pieces read piece 3): the pipeline-size-1 order
    reads = [(), (0,), (0, 1), (), (3,), (3,)]
    assert piece_backward_order(reads) == [2, 1, 0, 4, 5, 3]
    orders = piece_orders(reads, 2)
    # the last stage: a chain runs all its forwards before its first backward (each piece is read later)
    assert orders[1][:6] == [("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 1), ("B", 0)]
    # without reads between them, plain 1F1B (stage s warms up with S - s - 1 forwards)
    plain = piece_orders([(), (), (), (0, 1, 2)], 3)     # only the last reads: 0, 1, 2 all wait for it
    assert plain[2] == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 3), ("B", 2), ("B", 1), ("B", 0)]
    check_stage_orders(piece_orders([(), (0,), (), (2,)], 4), [None] * 4, [(), (0,), (), (2,)])


def test_pieces_in_windows_refused():
    with pytest.raises(ValueError, match="no sharing window"):
        stage_orders([None, 0, None], 2, reads=[(), (), (1,)])
    with pytest.raises(ValueError, match="no sharing window"):
        stage_orders([None, None, 1], 2, reads=[(), (0,), ()])
    with pytest.raises(ValueError, match="must run before"):
        stage_orders([None, None], 2, reads=[(1,), ()])


# ---------------------------------------------------------------------------------------------
# multi-process equality
# ---------------------------------------------------------------------------------------------
def pp_forest(seed, compactions):
    """The chain and the forked tree of ``test_pieces.long_forest`` (longer than the budget) and a bushy
    tree that fits it (each of its trajectories does) but not its rows, so a window can share its
    prefix; ``compactions``: evictions whose spans and event rows sit in other pieces than their readers."""
    from megatron_harts.tree_data import build_forest, make_trajectory
    from hybrid_tiny import VOCAB
    rng = np.random.default_rng(seed)
    tok = lambda n: rng.integers(1, VOCAB, n).tolist()  # noqa: E731
    base = [1] + tok(29)
    bush = [3] + tok(6)
    recs = [{"id": "chain", "tokens": [0] + tok(40)},
            {"id": "a", "tokens": base + tok(7)}, {"id": "b", "tokens": base[:21] + tok(9)},
            {"id": "c", "tokens": base[:6] + tok(13)}, {"id": "d", "tokens": base[:30] + tok(2)}]
    recs += [{"id": f"bush{k}", "tokens": bush + tok(3 + k % 2)} for k in range(3)]
    if compactions:
        recs[0]["compactions"] = [{"at": 25, "start": 3, "end": 14}, {"at": 33, "start": 20, "end": 27}]
        recs[1]["compactions"] = [{"at": 24, "start": 2, "end": 11}]
        recs[4]["compactions"] = [{"at": 24, "start": 2, "end": 11}]
    return build_forest([make_trajectory(r) for r in recs])


def windows_and_pieces(compactions):
    """(step forest, items): a hand-made window on the fitting tree (its whole tree the producer, each
    branch of its first fork a consumer), then the long trees' pieces."""
    from megatron_harts.layout import build_layout
    from megatron_harts.schedules.windows import WindowedMicrobatch, piece_microbatches
    from megatron_harts.training.step import SharingSettings, plan_step
    from test_windows_schedule import owned_outside
    forest = pp_forest(0, compactions)
    plan = plan_step(forest, SharingSettings(sharing="within", microbatch_tokens=BUDGET, planner="l1", replay=True), 1)
    step = plan.pieces.forest
    assert plan.pieces.num_fit_trees == 1               # the bush, tree 0 of the step forest
    lo, hi = int(step.tree_offsets[0]), int(step.tree_offsets[1])
    prod = build_layout(step, trees=[0])
    roots = [s for s in range(lo, hi) if step.seg_parent[s] == lo]
    cons = [build_layout(step, roots=[r], context=prod) for r in roots]
    items = [WindowedMicrobatch(prod, owned_outside(prod, cons))] + [WindowedMicrobatch(c, producer=0) for c in cons]
    items += piece_microbatches(plan, 0, offset=len(items))
    return step, items


def planned(sharing):
    from megatron_harts.training.step import SharingSettings, plan_step, replica_microbatches, step_forest
    forest = pp_forest(1, True)
    settings = SharingSettings(sharing=sharing, microbatch_tokens=BUDGET,
                               planner={"off": "ffd", "within": "l1", "windows": "l1l2"}[sharing], replay=True)
    plan = plan_step(forest, settings, 1)
    return step_forest(forest, plan), replica_microbatches(forest, plan, 0, settings)


def step_sets():
    """Named (step forest, items) of the PP tests."""
    sets = {"window+pieces": windows_and_pieces(False), "window+pieces, compactions": windows_and_pieces(True)}
    sets.update({f"planned {s}": planned(s) for s in ("off", "within", "windows")})
    return sets


@pytest.fixture(scope="module")
def reference(cpu_world, tmp_path_factory):
    """PP=1, computed once in this process: the weights, and per step set its PP=1 result and expanded
    training's (a file the workers load)."""
    from megatron_harts.models.model import build_hybrid_model
    from hybrid_tiny import VOCAB, randomize_, tiny_config
    from test_compaction_windows import expanded_with_events
    from test_pipeline_schedules import CFG_KW
    from test_windows_schedule import assert_same, run_step
    model = randomize_(build_hybrid_model(tiny_config(**CFG_KW), vocab_size=VOCAB), 0)
    results = {}
    for name, (step, items) in step_sets().items():
        assert any(mb.reads for mb in items), name
        assert all(mb.layout.num_rows <= BUDGET for mb in items if mb.reads or not name.startswith("window")), name
        if name.startswith("window"):
            assert any(mb.producer is not None for mb in items), name
        pp1 = run_step(model, items)[:2]
        exp = expanded_with_events(model, step)
        assert_same(pp1, exp, f"PP=1 {name} vs expanded")
        results[name] = {"pp1": pp1, "exp": exp}
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    weights.update({n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("expert_bias")})
    path = str(tmp_path_factory.mktemp("pp_pieces") / "reference.pt")
    torch.save({"weights": weights, "results": results}, path)
    return path


def worker(rank, world, port, ref_path):
    import torch.distributed as dist
    import megatron_harts.patches as patches
    from megatron_cpu import megatron_cpu
    from test_pipeline_schedules import CFG_KW, assert_stage_same, build_stage, stage_grads, stage_step
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    patches.apply()
    try:
        ref = torch.load(ref_path, weights_only=False)
        with megatron_cpu(pp=world, init_world=False):
            model, cfg, offset, last = build_stage(CFG_KW, world, ref["weights"])
            for name, (_, items) in step_sets().items():
                for schedule in SCHEDULES:
                    stats = {}
                    lp = stage_step(model, items, schedule, stats)
                    grads = stage_grads(model, offset)
                    what = f"PP={world} {schedule} ({name})"
                    assert_stage_same(lp, grads, ref["results"][name]["pp1"], what + " vs PP=1", last)
                    assert_stage_same(lp, grads, ref["results"][name]["exp"], what + " vs expanded", last)
                    assert min(stats["peak_export_bytes"]) > 0, (what, stats)
                    assert stats["read_pieces"] > 0 and stats["kept_pieces"] == stats["read_pieces"], (what, stats)
                    assert stats["piece_extra_forward_rows"] == 0, (what, stats)
                    if name.startswith("planned"):
                        break           # no windows: the schedules order the same microbatches alike
            # read pieces recomputed (their forward again at their backward): the same numbers, the extra rows
            name = "window+pieces, compactions"
            items = step_sets()[name][1]
            stats = {}
            lp = stage_step(model, items, "consumer-1f1b", stats, piece_keep="none")
            assert_stage_same(lp, stage_grads(model, offset), ref["results"][name]["pp1"],
                              f"PP={world} pieces recomputed ({name}) vs PP=1", last)
            read_rows = sum(int(items[i].layout.num_rows) for i in {r for mb in items for r in mb.reads})
            assert stats["kept_pieces"] == 0 and stats["piece_extra_forward_rows"] == read_rows > 0, stats
            # read pieces keeping part of their graph: each stage's first layer checkpointed in their forward
            read = sorted({r for mb in items for r in mb.reads})
            stats = {}
            lp = stage_step(model, items, "consumer-1f1b", stats, piece_keep=dict.fromkeys(read, 1))
            assert_stage_same(lp, stage_grads(model, offset), ref["results"][name]["pp1"],
                              f"PP={world} pieces kept in part ({name}) vs PP=1", last)
            per_stage = len(model.decoder.layers)
            assert stats["kept_pieces"] == stats["partly_kept_pieces"] == len(read), stats
            assert stats["piece_extra_forward_rows"] == sum(int(items[i].layout.num_rows) // per_stage for i in read)
            assert cfg.recompute_granularity is None
            # forward only (the logit probe's pass): every piece's log-probs once, those of PP=1
            from megatron_harts.schedules.pipeline import forward_backward_pipelining_windows
            from test_pipeline_schedules import pp_forward_step
            name = "window+pieces, compactions"
            items = step_sets()[name][1]
            with torch.no_grad():
                store = forward_backward_pipelining_windows(
                    forward_step_func=pp_forward_step, data_iterator=iter(items), model=[model],
                    num_microbatches=len(items), forward_only=True)
            if last:
                lp = [kv for st in store for kv in st["lp"].items()]
                ref_lp = ref["results"][name]["pp1"][0]
                assert sorted(k for k, _ in lp) == sorted(ref_lp)
                assert all(abs(v - ref_lp[k]) <= 1e-10 * max(1.0, abs(ref_lp[k])) for k, v in lp)
            else:
                assert store == []
            # activation recomputation (full, uniform): kept read pieces (their graphs hold the layers' inputs,
            # their exports' gradients enter as the backward recomputes each layer), recomputed ones, and the
            # memory model's choice ("auto"; a budget of 1 byte keeps none)
            cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers = "full", "uniform", 1
            name = "window+pieces, compactions"
            for kw in ({"piece_keep": "all"}, {"piece_keep": "none"}, {"piece_keep": "auto", "piece_budget": 1}):
                stats = {}
                lp = stage_step(model, step_sets()[name][1], "consumer-1f1b", stats, **kw)
                assert_stage_same(lp, stage_grads(model, offset), ref["results"][name]["exp"],
                                  f"PP={world} recompute, {kw} ({name}) vs expanded", last)
                assert stats["kept_pieces"] == (stats["read_pieces"] if kw["piece_keep"] == "all" else 0), stats
    finally:
        patches.undo()
        dist.destroy_process_group()


@pytest.mark.slow
def test_pipeline_size_2_pieces(reference):
    from megatron_cpu import free_port
    run_ranks(worker, 2, (free_port(), reference), timeout=600)


# ---------------------------------------------------------------------------------------------
# the driver: --pipeline-model-parallel-size 2 with a row budget below the longest trajectory
# ---------------------------------------------------------------------------------------------
def _driver_worker(rank, world, port, data, out):
    from megatron_harts.training.trainer import Trainer
    from test_pipeline_schedules import two_steps_from
    from test_training_driver import _world, argv
    _world(rank, world, port)
    runs, init = {}, None
    # the reference first: pipeline size 1 (2 replicas), a budget that holds every trajectory, expanded
    for name, sharing, budget, extra in (("ref", "off", "48", []),
                                         *((s, s, "16", ["--pipeline-model-parallel-size", "2"])
                                           for s in ("off", "within", "windows"))):
        # --clip-grad 0: megatron computes the clipping norm in fp32, summed per stage under PP, so the
        # clip coefficient (not the gradients) differs between the layouts at ~1e-8
        flags = argv(data, sharing, "--clip-grad", "0", *extra)
        flags[flags.index("--tree-microbatch-tokens") + 1] = budget
        flags[flags.index("--train-iters") + 1] = "2"
        with Trainer.from_args(flags, require_data=True) as t:
            init, runs[name] = two_steps_from(t, init, world)     # the reference's initial weights everywhere
    if rank == 0:
        torch.save(runs, out)


@pytest.mark.slow
def test_driver_pp2_pieces_equal_uncut(tmp_path):
    """The driver with pipeline size 2 and a 16-row budget under trajectories of up to 43 tokens (every tree
    cut into pieces) gives, in every sharing mode, the losses, objective terms and parameters after each
    step of uncut expanded training (pipeline size 1, a budget that holds every trajectory)."""
    from test_training_driver import assert_same_steps, spawn
    runs = spawn(_driver_worker, tmp_path)
    ref = runs["ref"]
    for name in ("off", "within", "windows"):
        assert_same_steps(runs[name], ref, f"PP=2 pieces ({name}) vs uncut PP=1 expanded",
                          terms=("objective/pg_loss", "objective/kl", "objective/entropy"))
    # not vacuous: expanded mode ran more (smaller) microbatches, tree modes still shared rows
    assert all(m["microbatches"] > m_ref["microbatches"] for (m, _), (m_ref, _) in zip(runs["off"], ref))
    for name in ("within", "windows"):
        assert all(m["computed_tokens"] < m_ref["computed_tokens"] for (m, _), (m_ref, _) in zip(runs[name], ref))
