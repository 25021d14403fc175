"""Sharing windows with pipeline parallelism: consumer 1F1B, overlapping windows
(backward-first) and non-overlapping windows.

- ``stage_orders`` (pure Python): the orders run are ``simulator.schedule_ops``'s (the one
  generator), and on random steps they pass ``check_stage_orders`` (no deadlock under the blocking
  receives / deferred sends, the same forward/backward order on every stage, PF before its
  consumers, PB after them) and ``check_p2p_channels`` (NCCL's rendezvous channels, one per
  direction; one channel per stage pair deadlocks); consumer 1F1B: PF right before its first consumer, PB right after its
  last, in-flight bounds (at most 2 (S - s) - 1 consumers on stage s), also with
  uneven costs (the cost-aware orders); windows alive at once (non-overlap:
  one; overlap and 1F1B: several); without windows, non-overlap is plain 1F1B.
- gloo worlds of 2 and 4 processes (fp64, tiny hybrid model, MoE aux loss 0): pipeline sizes 2 and
  4, every schedule, gives the parameter gradients (1e-10 relative) and log-probs of expanded
  training and of the pipeline-size-1 windowed step on the same microbatches; the windows alive at
  once per stage are those of the orders (overlap: both windows); consumers spread over slots
  with plain microbatches between them; consumer 1F1B with uneven ``microbatch_costs`` (the
  items reordered: same gradients; the closing window's consumer of cheapest backward last);
  activation recomputation (full, uniform) on; DP=2 x PP=2 with windows on both replicas
  (gradients summed over replicas == expanded).
"""
import os

import numpy as np
import pytest
import torch

from megatron_harts.schedules import simulator
from megatron_harts.schedules.pipeline import SCHEDULES, check_p2p_channels, check_stage_orders, stage_orders

from multiproc import run_ranks


def random_structure(rng, n):
    producer_of, producers = [], []
    for i in range(n):
        r = rng.random()
        if producers and r < 0.5:
            producer_of.append(int(rng.choice(producers)))
        else:
            producer_of.append(None)
            if r < 0.8:
                producers.append(i)
    return producer_of


def _peak_forwarded(order, producer_of, producers: bool):
    """Most microbatches forwarded and not yet backwarded at once in ``order``: producers (windows alive)
    or, with ``producers=False``, the others (consumers and plain microbatches in flight)."""
    roles = {p for p in producer_of if p is not None}
    live, peak = 0, 0
    for k, i in order:
        if (i in roles) == producers:
            live += 1 if k == "F" else -1
            peak = max(peak, live)
    return peak


def consumers_in_flight(order, producer_of):
    return _peak_forwarded(order, producer_of, producers=False)


def windows_alive(order, producer_of):
    return _peak_forwarded(order, producer_of, producers=True)


def as_pipeline(ops):
    """The simulator's per-stage ops as the pipeline writes them: a producer's PF/PB is its F/B."""
    return [[({"PF": "F", "PB": "B"}.get(kind, kind), i) for kind, i in o] for o in ops]


def test_stage_orders():
    assert set(SCHEDULES) == set(simulator.SCHEDULES)
    rng = np.random.default_rng(0)
    for trial in range(30):
        po = random_structure(rng, int(rng.integers(1, 14)))
        for S in (2, 3, 4):
            for sch in SCHEDULES:
                orders = stage_orders(po, S, sch)
                assert orders == as_pipeline(simulator.schedule_ops(po, S, sch)), (po, S, sch)
                check_stage_orders(orders, po)
                check_p2p_channels(orders)
                if sch == "consumer-1f1b":
                    costs = [(float(rng.uniform(0.1, 3)), float(rng.uniform(0.1, 6))) for _ in po]
                    timed = stage_orders(po, S, sch, costs=costs)
                    assert timed == as_pipeline(simulator.schedule_ops(po, S, sch, costs=costs)), (po, S, costs)
                    check_stage_orders(timed, po)
                    check_p2p_channels(timed)
                    for o in orders + timed:
                        s = (orders + timed).index(o) % S
                        assert consumers_in_flight(o, po) <= S - s + min(max(simulator.c1f1b_depths(S)), S - 1 - s)
                        fwd = [i for kind, i in o if kind == "F" and i not in po]
                        bwd = [i for kind, i in o if kind == "B" and i not in po]
                        for k, (kind, i) in enumerate(o):
                            if i not in po:
                                continue
                            mine = [c for c, p in enumerate(po) if p == i]
                            if kind == "F":     # PF directly before its first consumer's F
                                assert o[k + 1] == ("F", min(mine, key=fwd.index))
                            else:               # PB directly after its last consumer's B
                                assert o[k - 1] == ("B", max(mine, key=bwd.index))
                if sch == "non-overlap":
                    assert all(windows_alive(o, po) <= 1 for o in orders)
    # two windows whose consumers interleave: overlapping schedules keep both alive
    po = [None, None, 0, 1, 0, 1, 0, 1]
    for sch in ("consumer-1f1b", "overlap"):
        assert max(windows_alive(o, po) for o in stage_orders(po, 2, sch)) == 2
    assert stage_orders(po, 3, "consumer-1f1b", forward_only=True)[2] == [("F", i) for i in range(8)]
    # no windows: non-overlap is plain 1F1B (no microbatch drained on its own)
    plain = [None] * 6
    assert stage_orders(plain, 4, "non-overlap") == stage_orders(plain, 4, "consumer-1f1b")
    assert stage_orders(plain, 4, "non-overlap")[3][:4] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    with pytest.raises(ValueError, match="schedule must be"):
        stage_orders(po, 2, "gpipe")
    with pytest.raises(ValueError, match="nested"):
        stage_orders([None, 0, 1], 2)
    bad = stage_orders(po, 2)
    bad[1] = bad[1][::-1]
    with pytest.raises(AssertionError):
        check_stage_orders(bad, po)


#: the "overlap" step set's roles ([None, None, 0, 1, 1]) with costs under which consumer 1F1B closes
#: the last window with its consumer of cheapest backward (3) last, not its costliest (4)
CLOSING_COSTS = [(1.0, 2.0), (2.0, 4.0), (1.0, 2.0), (3.0, 6.0), (4.0, 8.0)]


def test_closing_window_cheapest_backward_last():
    po = [None, None, 0, 1, 1]
    orders = stage_orders(po, 2, "consumer-1f1b", costs=CLOSING_COSTS)
    for o in orders:
        assert [i for kind, i in o if kind == "B"] == [2, 0, 4, 3, 1]
        assert [i for kind, i in o if kind == "F"] == [0, 2, 1, 4, 3]
    check_stage_orders(orders, po)
    check_p2p_channels(orders)
    for S in (3, 4):
        check_p2p_channels(stage_orders(po, S, "consumer-1f1b", costs=CLOSING_COSTS))


def test_directions_need_their_own_channels():
    """On rendezvous channels (NCCL: a communicator runs its operations in order, a send completes
    with the peer's receive) the orders run only when activations and gradients travel on separate
    channels: with one per stage pair, 1F1B's second forward send meets the neighbour's first
    gradient send and both wait (what hung pipeline size 4 on GPUs)."""
    for S in (2, 4):
        for po in ([None, None], [None] * 6, [None, None, 0, 1, 0, 1, 0, 1]):
            for sch in SCHEDULES:
                orders = stage_orders(po, S, sch)
                check_p2p_channels(orders)
                with pytest.raises(AssertionError, match="deadlock on rendezvous channels"):
                    check_p2p_channels(orders, shared=True)
    check_p2p_channels(stage_orders([None], 4), shared=True)     # one microbatch: nothing to cross
    bad = [[("F", 0), ("F", 1), ("B", 1), ("B", 0)], [("F", 1), ("F", 0), ("B", 0), ("B", 1)]]
    with pytest.raises(AssertionError, match="deadlock"):          # forward orders differ
        check_p2p_channels(bad)


# ---------------------------------------------------------------------------------------------
# multi-process equality
# ---------------------------------------------------------------------------------------------
def step_sets(forest):
    """Named microbatch lists (the order every stage runs)."""
    from megatron_harts.layout import build_layout
    from megatron_harts.schedules.windows import WindowedMicrobatch
    from test_windows_schedule import owned_outside, windowed_step
    overlap, _ = windowed_step(forest, overlap=True)
    # one window whose consumers sit in slots 1 and 3 (and on) with a plain microbatch (tree 1) between
    prod = build_layout(forest, trees=[0])
    lo, hi = int(forest.tree_offsets[0]), int(forest.tree_offsets[1])
    kids = {}
    for seg in range(lo, hi):
        kids.setdefault(int(forest.seg_parent[seg]), []).append(seg)
    fork = min(a for a, k in kids.items() if a >= 0 and len(k) >= 2)
    cons = [build_layout(forest, roots=[r], context=prod) for r in kids[fork]]
    spread = [WindowedMicrobatch(prod, owned_outside(prod, cons)), WindowedMicrobatch(cons[0], producer=0),
              WindowedMicrobatch(build_layout(forest, trees=[1])), WindowedMicrobatch(cons[1], producer=0)]
    spread += [WindowedMicrobatch(c, producer=0) for c in cons[2:]]
    return {"overlap": overlap, "spread": spread}


def pp_forward_step(data_iterator, model):
    from test_windows_schedule import forward_step
    if getattr(model, "post_process", True):
        return forward_step(data_iterator, model)
    mb, psp = next(data_iterator)
    lay = mb.layout
    return model(lay.tokens[None], lay.position_ids[None], packed_seq_params=psp), None


def stage_name(name, offset):
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + offset)
    return ".".join(parts)


def two_steps_from(trainer, init, world):
    """Two training iterations of ``trainer`` from the weights ``init`` (by global parameter name; None:
    this trainer's own, returned for the next layouts: inits differ per layout), with every stage's
    parameters gathered after each step: (init, [(metrics, {name: tensor}), ...])."""
    import torch.distributed as dist
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    offset = get_transformer_layer_offset(trainer.config)
    named = dict(trainer.model[0].module.named_parameters())
    if init is None:
        init = {stage_name(n, offset): p.detach().clone() for n, p in named.items()}
    else:
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(init[stage_name(n, offset)])
    steps = []
    for _ in range(2):
        m = trainer.train_iteration()
        mine = {stage_name(n, offset): p.detach().clone() for n, p in trainer.model[0].module.named_parameters()}
        parts = [None] * world
        dist.all_gather_object(parts, mine)
        steps.append((m, {k: v for part in parts for k, v in part.items()}))
    return init, steps


CFG_KW = dict(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")


@pytest.fixture(scope="module")
def reference(cpu_world, tmp_path_factory):
    """PP=1, computed once in this process: full weights, expanded and windowed results (a file the
    workers load)."""
    from megatron_harts.models.model import build_hybrid_model
    from hybrid_tiny import VOCAB, randomize_, tiny_config, tiny_forest
    from test_windows_schedule import assert_same, expanded_step, run_step
    forest = tiny_forest(0)
    sets = step_sets(forest)
    cfg = tiny_config(**CFG_KW)
    model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 0)
    exp = expanded_step(model, forest)
    win = {k: run_step(model, v)[:2] for k, v in sets.items()}
    for k in win:
        assert_same(win[k], exp, f"PP=1 windows ({k}) vs expanded")
    cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers = "full", "uniform", 1
    assert_same(run_step(model, sets["spread"]), exp, "PP=1 windows with recomputation vs expanded")
    cfg.recompute_granularity = cfg.recompute_method = cfg.recompute_num_layers = None
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    weights.update({n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("expert_bias")})
    path = str(tmp_path_factory.mktemp("pp") / "reference.pt")
    torch.save({"weights": weights, "exp": exp, "win": win}, path)
    return path


def stage_step(model, mbs, schedule, stats=None, costs=None, **kw):
    """One step of ``mbs`` on this stage (``kw``: further keywords of the schedule): the log-probs."""
    from megatron_harts.schedules.pipeline import forward_backward_pipelining_windows
    model.zero_grad(set_to_none=True)
    store = forward_backward_pipelining_windows(forward_step_func=pp_forward_step, data_iterator=iter(mbs),
                                                model=[model], num_microbatches=len(mbs), seq_length=0,
                                                micro_batch_size=1, window_stats=stats, schedule=schedule,
                                                microbatch_costs=costs, **kw)
    lp = {}
    for s in store:
        for k, v in s["lp"].items():
            assert k not in lp
            lp[k] = v
    return lp


def reordering_costs(po, pp):
    """Uneven (forward, backward) costs under which consumer 1F1B runs the items in another order
    than with unit costs (None if no trial pattern does)."""
    plain = stage_orders(po, pp, "consumer-1f1b")
    for k in range(1, 8):
        costs = [(1.0 + (i * k) % 5, 1.0 + (3 * i + k) % 7) for i in range(len(po))]
        if [m for kind, m in stage_orders(po, pp, "consumer-1f1b", costs=costs)[0] if kind == "F"] != \
                [m for kind, m in plain[0] if kind == "F"]:
            return costs
    return None


def stage_grads(model, offset):
    return {stage_name(n, offset): p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def assert_stage_same(lp, grads, ref, what, last, check_keys=True):
    ref_lp, ref_g = ref[:2]
    if last:
        if check_keys:
            assert set(lp) == set(ref_lp), what
        for k, v in lp.items():
            assert abs(v - ref_lp[k]) <= 1e-10 * max(1.0, abs(ref_lp[k])), f"{what}: log-prob of {k}"
    assert grads, what
    for name, g in grads.items():
        scale = float(ref_g[name].abs().max())
        assert scale > 0, f"{what}: {name} got no gradient"
        torch.testing.assert_close(g, ref_g[name], rtol=0, atol=1e-10 * scale, msg=f"{what}: {name}")


def build_stage(cfg_kw, pp, weights):
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from megatron_harts.schedules.pipeline import build_stage_model
    from hybrid_tiny import VOCAB, tiny_config
    cfg = tiny_config(pipeline_model_parallel_size=pp, pipeline_dtype=torch.float64, **cfg_kw)
    model = build_stage_model(cfg, VOCAB)
    offset = get_transformer_layer_offset(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[stage_name(n, offset)])
        for n, b in model.named_buffers():
            if n.endswith("expert_bias"):
                b.copy_(weights[stage_name(n, offset)])
    return model, cfg, offset, parallel_state.is_pipeline_last_stage()


def worker(rank, world, port, ref_path):
    import torch.distributed as dist
    import megatron_harts.patches as patches
    from megatron.core import parallel_state
    from megatron_harts.schedules.windows import windowed_microbatches
    from hybrid_tiny import tiny_forest
    from megatron_cpu import megatron_cpu
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    patches.apply()
    try:
        forest = tiny_forest(0)
        sets = step_sets(forest)
        ref = torch.load(ref_path, weights_only=False)
        weights, exp, win = ref["weights"], ref["exp"], ref["win"]
        pp = world
        with megatron_cpu(pp=pp, init_world=False):      # PP = world: every schedule, both step sets
            model, cfg, offset, last = build_stage(CFG_KW, pp, weights)
            for schedule in SCHEDULES:
                for name, mbs in (sets.items() if pp == 2 else [("overlap", sets["overlap"])]):
                    stats = {}
                    lp = stage_step(model, mbs, schedule, stats)
                    grads = stage_grads(model, offset)
                    what = f"PP={pp} {schedule} ({name})"
                    assert_stage_same(lp, grads, win[name], what + " vs PP=1 windows", last)
                    assert_stage_same(lp, grads, exp, what + " vs expanded", last)
                    assert len(stats["peak_export_bytes"]) == pp and min(stats["peak_export_bytes"]) > 0
                    assert stats["windows"] == (2 if name == "overlap" else 1)
                    po = [mb.producer for mb in mbs]      # the windows alive at once are the orders'
                    orders = stage_orders(po, pp, schedule)
                    assert stats["peak_windows_alive"] == [windows_alive(o, po) for o in orders], stats
                    if schedule == "non-overlap":         # drained window by window
                        assert stats["peak_windows_alive"] == [1] * pp, stats
                    elif schedule == "overlap" and name == "overlap":   # two producers before any consumer
                        assert stats["peak_windows_alive"] == [2] * pp, (schedule, stats)
            for name, mbs in sets.items():                # cost-aware consumer 1F1B: other orders, same numbers
                po = [mb.producer for mb in mbs]
                costs = reordering_costs(po, pp)
                if costs is None:
                    continue
                lp = stage_step(model, mbs, "consumer-1f1b", costs=costs)
                assert_stage_same(lp, stage_grads(model, offset), exp, f"PP={pp} cost-aware 1F1B ({name})", last)
            if pp == 2:                                   # the closing window's cheapest backward last
                mbs = sets["overlap"]
                orders = stage_orders([mb.producer for mb in mbs], pp, "consumer-1f1b", costs=CLOSING_COSTS)
                assert [i for kind, i in orders[0] if kind == "B"][-2:] == [3, 1]
                lp = stage_step(model, mbs, "consumer-1f1b", costs=CLOSING_COSTS)
                assert_stage_same(lp, stage_grads(model, offset), exp, f"PP={pp} closing order vs expanded", last)
            if pp == 2:                                   # activation recomputation (full, uniform)
                cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers = "full", "uniform", 1
                lp = stage_step(model, sets["spread"], "consumer-1f1b")
                assert_stage_same(lp, stage_grads(model, offset), exp, f"PP={pp} recompute vs expanded", last)
        if world == 4:                                    # DP=2 x PP=2: each replica its share, grads summed
            from test_windows_plan import hand_plan
            with megatron_cpu(pp=2, init_world=False):
                model, cfg, offset, last = build_stage(CFG_KW, 2, weights)
                dp_group = parallel_state.get_data_parallel_group()
                plan = hand_plan(forest, 2, [(0, 0), (1, 1), (0, 2), (0, 3), (1, 0), (1, 2)])
                items = windowed_microbatches(forest, plan, replica=parallel_state.get_data_parallel_rank())
                assert any(it.producer is not None for it in items)       # a window on each replica
                lp = stage_step(model, items, "consumer-1f1b")
                grads = stage_grads(model, offset)
                for g in grads.values():
                    dist.all_reduce(g, group=dp_group)
                assert_stage_same(lp, grads, exp, "DP=2 x PP=2 consumer-1f1b vs expanded", last, check_keys=False)
                if last:
                    keys = [None, None]
                    dist.all_gather_object(keys, sorted(lp), group=dp_group)
                    assert sorted(keys[0] + keys[1]) == sorted(exp[0])
    finally:
        patches.undo()
        dist.destroy_process_group()


def test_pipeline_size_2_every_schedule(reference):
    from megatron_cpu import free_port
    run_ranks(worker, 2, (free_port(), reference), timeout=240)


def test_pipeline_size_4_and_dp2_pp2(reference):
    from megatron_cpu import free_port
    run_ranks(worker, 4, (free_port(), reference), timeout=300)


# ---------------------------------------------------------------------------------------------
# the driver (--tree-sharing windows --pipeline-model-parallel-size 2 --tree-pp-schedule ...)
# ---------------------------------------------------------------------------------------------
def _driver_worker(rank, world, port, data, out):
    from megatron_harts.training.trainer import Trainer
    from test_training_driver import _world, argv
    _world(rank, world, port)
    runs, init = {}, None
    for name, extra in (("pp1", []), ("pp2", ["--pipeline-model-parallel-size", "2"])):
        # --clip-grad 0: megatron computes the clipping norm in fp32, summed per stage under PP, so the
        # clip coefficient (not the gradients) differs between the layouts at ~1e-8
        with Trainer.from_args(argv(data, "windows", "--train-iters", "2", "--clip-grad", "0", *extra),
                               require_data=True) as t:
            init, runs[name] = two_steps_from(t, init, world)     # PP=1's initial weights in every layout
    if rank == 0:
        torch.save(runs, out)


def test_driver_pp2_equals_pp1(tmp_path):
    from test_training_driver import assert_same_steps, spawn
    runs = spawn(_driver_worker, tmp_path)
    terms = ("objective/pg_loss", "objective/kl", "objective/entropy")
    assert_same_steps(runs["pp2"], runs["pp1"], "PP=2 consumer-1f1b vs PP=1", terms=terms)
    assert all(m["windows"] > 0 for m, _ in runs["pp2"])
