"""The step's memory budget: the per-row activation model, the per-window keep/recompute choice of the
window schedule, and ``--tree-memory-budget`` through the driver.  A window that keeps its producer's
graph and one that recomputes it give the same log-probs, loss and gradients (fp64, bitwise here), in
one step holding both kinds."""
import numpy as np
import pytest
import torch

from megatron_harts.planner.memory import (GIB, ModelShape, StepItem, activation_bytes_per_row, default_budget_bytes,
                                           export_bytes, graph_bytes_per_row, plan_window_memory, saved_bytes_per_row,
                                           state_bytes_per_parameter)

# a step: plain, window A (producer 1, consumers 2, 3), window B (producer 4, consumer 5), plain
ITEMS = [StepItem(10), StepItem(10, export_bytes=50), StepItem(5, producer=1), StepItem(5, producer=1),
         StepItem(10, export_bytes=50), StepItem(8, producer=4), StepItem(10)]


def test_window_choice_within_the_budget():
    kw = dict(saved_per_row=10, graph_per_row=10)
    keep_all = plan_window_memory(ITEMS, **kw)
    assert keep_all.kept == (1, 4) and keep_all.recompute == () and keep_all.budget_bytes is None
    forced = plan_window_memory(ITEMS, force=True, budget_bytes=10 ** 9, **kw)
    assert forced.recompute == (1, 4) and forced.predicted_peak_bytes < keep_all.predicted_peak_bytes
    assert plan_window_memory(ITEMS, force=False, budget_bytes=1, **kw).kept == (1, 4)
    # the predicted peak by hand: window A kept while its consumers run: 5 rows + A's graph (100) + its
    # exports and their gradients (100); window B kept over its consumer: 80 + 100 + 100
    assert keep_all.predicted_peak_bytes == 280
    # recomputed: at B's consumer 80 + 100 (exports, gradients); at a close the graph beside the gradients
    assert forced.predicted_peak_bytes == 180
    for budget, kept in ((100, ()), (249, ()), (250, (1,)), (279, (1,)), (280, (1, 4)), (10 ** 6, (1, 4))):
        plan = plan_window_memory(ITEMS, budget_bytes=budget, **kw)
        assert plan.kept == kept, budget
        assert plan.predicted_peak_bytes <= max(budget, forced.predicted_peak_bytes)
        again = plan_window_memory(ITEMS, recompute=plan.recompute, **kw)
        assert again.predicted_peak_bytes == plan.predicted_peak_bytes and again.kept == plan.kept
    with pytest.raises(ValueError, match="no window's producer"):
        plan_window_memory(ITEMS, recompute=[2], **kw)
    with pytest.raises(ValueError, match="does not run before it"):
        plan_window_memory([StepItem(3, producer=1), StepItem(3)], **kw)


def test_piece_choice_within_the_budget():
    """A chain of three pieces (0 and 1 read later, 2 reads both): phases run 0, run 1, run 2, backward of
    1, backward of 0.  Recomputed, a read piece holds its exports until its backward and runs there again;
    kept, it also holds its graph (rows x piece_graph_per_row) from its run to its backward."""
    chain = [StepItem(10, export_bytes=5, read_later=True), StepItem(10, export_bytes=5, reads=(0,), read_later=True),
             StepItem(10, reads=(0, 1))]
    kw = dict(saved_per_row=10, graph_per_row=10, piece_graph_per_row=2)
    none = plan_window_memory(chain, **kw)
    assert none.recomputed_pieces == (0, 1) and none.kept_pieces == ()
    assert none.predicted_peak_bytes == 110          # the last piece beside both exports; backward of 1 alike
    every = plan_window_memory(chain, piece_keep="all", **kw)
    assert every.kept_pieces == (0, 1) and every.predicted_peak_bytes == 150      # 100 + 2 x (5 + 20)
    for budget, kept in ((10 ** 6, (0, 1)), (150, (0, 1)), (149, (0,)), (130, (0,)), (129, ())):
        plan = plan_window_memory(chain, piece_keep="auto", piece_budget_bytes=budget, **kw)
        assert plan.kept_pieces == kept, budget
        assert plan_window_memory(chain, piece_keep=kept, **kw).predicted_peak_bytes == plan.predicted_peak_bytes
    # part of a graph (per layer 1 byte a row, the layers' inputs free): a piece that does not fit whole is
    # kept with the fewest first layers recomputed that fit
    part = dict(kw, piece_layer_bytes=[1, 1], layer_input_bytes=0)
    for budget, kept, layers, peak in ((150, (0, 1), {}, 150), (149, (0, 1), {1: 1}, 140),
                                       (129, (0,), {0: 1}, 120), (119, (), {}, 110)):
        plan = plan_window_memory(chain, piece_keep="auto", piece_budget_bytes=budget, **part)
        assert (plan.kept_pieces, plan.piece_layers, plan.predicted_peak_bytes) == (kept, layers, peak), budget
        given = {i: layers.get(i, 0) for i in kept}
        assert plan_window_memory(chain, piece_keep=given, **part).predicted_peak_bytes == peak
    with pytest.raises(ValueError, match="without --recompute-granularity"):
        plan_window_memory(chain, piece_keep={0: 1}, **kw)
    with pytest.raises(ValueError, match=r"must lie in \[0, layers\)"):
        plan_window_memory(chain, piece_keep={0: 2}, **part)
    with pytest.raises(ValueError, match="needs piece_budget_bytes"):
        plan_window_memory(chain, piece_keep="auto", **kw)
    with pytest.raises(ValueError, match="no read piece"):
        plan_window_memory(chain, piece_keep=[2], **kw)
    with pytest.raises(ValueError, match="piece_keep must be"):
        plan_window_memory(chain, piece_keep="some", **kw)


def test_full_recomputation_budget_recomputes_producers():
    """Under full activation recomputation a row keeps far less than a producer's graph, so the default
    budget (what expanded mode keeps) leaves no room for a kept producer."""
    from tool_runner import load_tool
    p = load_tool("bench_throughput", "benchmarks").PRESETS["kimi48b-layers"]
    s = ModelShape.from_preset(p)
    assert saved_bytes_per_row(s) * 4 < graph_bytes_per_row(s)
    rows = 32768
    items = [StepItem(rows // 2, export_bytes=10 ** 6), StepItem(rows, producer=0), StepItem(rows)]
    plan = plan_window_memory(items, saved_per_row=saved_bytes_per_row(s), graph_per_row=graph_bytes_per_row(s),
                              budget_bytes=default_budget_bytes(s, rows))
    assert plan.recompute == (0,)
    # the recomputed producer runs again at its close with the run's recomputation: its saved bytes, not its
    # graph (a 32k-row graph at this shape is most of what an 80 GB GPU holds)
    assert plan.predicted_peak_bytes <= rows * saved_bytes_per_row(s) + 3 * 10 ** 6
    assert rows * graph_bytes_per_row(s) > 64 * 2 ** 30
    # so do the read pieces of a chain at its end, one at a time
    chain = [StepItem(rows, export_bytes=10 ** 6, read_later=True), StepItem(rows, reads=(0,))]
    plan = plan_window_memory(chain, saved_per_row=saved_bytes_per_row(s), graph_per_row=graph_bytes_per_row(s))
    assert plan.predicted_peak_bytes <= rows * saved_bytes_per_row(s) + 10 ** 6


def test_shape_of_the_driver_config_is_the_presets():
    """The model config the driver builds gives the benchmark preset's shape, so the budget and the
    benchmark's memory estimate use the same bytes per row; bf16 keeps 2 bytes an element, 4 in fp32."""
    from tool_runner import load_tool

    from megatron_harts.training.arguments import hybrid_config, parse_args
    bt = load_tool("bench_throughput", "benchmarks")
    for name in ("h200-2k", "kimi48b-layers"):
        p = bt.PRESETS[name]
        flags = bt.model_flags(p, "--bf16") + ["--seq-length", "64", "--global-batch-size", "1", "--train-iters", "1",
                                                "--lr", "1e-5", "--distributed-backend", "gloo"]
        cfg = hybrid_config(parse_args(flags, require_data=False), device="cpu")
        assert ModelShape.from_config(cfg) == ModelShape.from_preset(p), name
    s = ModelShape.from_preset(bt.PRESETS["h200-2k"])
    a = activation_bytes_per_row(s)
    assert graph_bytes_per_row(s) == sum(a["mla" if (i + 1) % 4 == 0 else "kda"] + a["dense" if i == 0 else "moe"]
                                         for i in range(12))
    assert saved_bytes_per_row(s) == graph_bytes_per_row(s)        # no recomputation in this preset
    wide = ModelShape.from_preset(bt.PRESETS["h200-2k"], element_bytes=4)
    assert graph_bytes_per_row(s) < graph_bytes_per_row(wide) < 2 * graph_bytes_per_row(s)
    assert state_bytes_per_parameter(2) == 18 and state_bytes_per_parameter(4) == 16
    assert state_bytes_per_parameter(2, 4) == 2 + 4 + 3


# ---- the window schedule (fp64, tiny hybrid model) ----------------------------------------------------

def _tiny():
    from hybrid_tiny import VOCAB, randomize_, tiny_config, tiny_forest

    from megatron_harts.models.model import build_hybrid_model
    cfg = tiny_config(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    return cfg, randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 0), tiny_forest(0)


def _mixing_budget(items, cfg):
    """A budget under which the step keeps some windows' producers and recomputes others."""
    from megatron_harts.schedules.windows import step_memory_plan
    lo = step_memory_plan(items, cfg, force=True).predicted_peak_bytes
    hi = step_memory_plan(items, cfg, force=False).predicted_peak_bytes
    for b in np.linspace(lo, hi, 64).astype(np.int64):
        plan = step_memory_plan(items, cfg, budget_bytes=int(b))
        if plan.kept and plan.recompute:
            return int(b), plan
    raise AssertionError("no budget mixes kept and recomputed windows")


def test_kept_and_recomputed_windows_in_one_step(cpu_world):
    from test_windows_schedule import run_step, windowed_step
    cfg, model, forest = _tiny()
    seq, _ = windowed_step(forest, overlap=True)
    kept = run_step(model, seq)
    budget, plan = _mixing_budget(seq, cfg)
    # the exports the model predicts are the bytes the producers record (both windows open at once)
    assert kept[2]["peak_export_bytes"] == sum(plan.export_bytes) > 0
    lp, grads, stats = run_step(model, seq, memory_budget=budget)
    assert stats["recomputed_windows"] == len(plan.recompute) and 0 < len(plan.recompute) < stats["windows"]
    assert stats["memory_budget_bytes"] == budget and stats["predicted_peak_bytes"] == plan.predicted_peak_bytes
    assert stats["predicted_peak_bytes"] < kept[2]["predicted_peak_bytes"]
    assert lp == kept[0] and set(grads) == set(kept[1])
    assert all(torch.equal(grads[n], kept[1][n]) for n in grads)
    # the other mix, named explicitly
    other = run_step(model, seq, recompute_producers=set(plan.kept))
    assert other[2]["recomputed_windows"] == len(plan.kept)
    assert other[0] == kept[0] and all(torch.equal(other[1][n], kept[1][n]) for n in kept[1])
    with pytest.raises(ValueError, match="no window's producer"):
        run_step(model, seq, recompute_producers={len(seq) - 1})


def test_export_bytes_by_kind():
    s = ModelShape(hidden=8, heads=2, lin_heads=2, lin_head=4, kv_lora=4, qk=3, rope=2, v=5, ffn=8, moe_ffn=4,
                   shared_ffn=4, experts=4, topk=2, layer_kinds=(("kda", "dense"), ("mla", "moe")), element_bytes=8)
    # MLA: rows x (kv latent + rope key); KDA: conv rows x 3 x 8, replay rows x (4 x 8 + 2), states x 2 x 4 x 4
    assert export_bytes(s, 3, 0, 0, 0) == 3 * (4 + 2) * 8
    assert export_bytes(s, 0, 2, 1, 1) == (2 * 24 + 34 + 32) * 8


def test_output_bytes_match_the_measured_log_prob_peaks():
    """The log-prob op's bytes against its peak above start as measured on an H200 at vocabulary
    163,840, hidden 2304 (bench_logprobs), chunks of 256-4096 rows at 16k and 32k rows: within 4%."""
    import json
    import os
    from megatron_harts.planner.memory import output_bytes
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "scale-h200", "logprobs-h200.json")
    rec = json.load(open(path))
    hidden, vocab = 2304, rec["args"]["vocab"]
    checked = 0
    for run in rec["runs"]:
        for v in run["variants"].values():
            if v["chunk_rows"] is None or v["chunk_rows"] > 4096:
                continue
            got = output_bytes(hidden, vocab, 2, v["chunk_rows"], run["rows"]) / GIB
            assert got == pytest.approx(v["peak_gib_above_start"], rel=0.04), (run["rows"], v["chunk_rows"])
            checked += 1
    assert checked == 12


SMALL = ModelShape(hidden=8, heads=2, lin_heads=2, lin_head=4, kv_lora=4, qk=3, rope=2, v=5, ffn=8, moe_ffn=4,
                   shared_ffn=4, experts=4, topk=2, layer_kinds=(("kda", "dense"), ("mla", "moe"), ("mla", "moe")),
                   element_bytes=2)


def test_step_peak_is_the_larger_of_the_backward_and_the_output_phase():
    from dataclasses import replace

    from megatron_harts.planner.memory import forward_end_bytes_per_row, step_peak_bytes
    full = replace(SMALL, recompute="full")
    unit = saved_bytes_per_row(full) - forward_end_bytes_per_row(full)
    assert forward_end_bytes_per_row(full) == 3 * 8 * 2 and unit > 0
    # the log-probs run where a recompute unit's backward would: only their excess over it adds
    assert step_peak_bytes(full, state_bytes=100, activation_bytes=1000, output=10 * unit, largest_rows=10) == 1100
    assert step_peak_bytes(full, state_bytes=100, activation_bytes=1000, output=10 * unit + 7, largest_rows=10) == 1107
    # without recomputation the whole graph is alive when the log-probs run
    assert forward_end_bytes_per_row(SMALL) == graph_bytes_per_row(SMALL)
    assert step_peak_bytes(SMALL, state_bytes=100, activation_bytes=1000, output=5, largest_rows=10) == 1105


def test_attention_bytes_of_key_paths_and_context():
    from dataclasses import replace

    from megatron_harts.planner.memory import attention_bytes
    no_mla = replace(SMALL, layer_kinds=(("kda", "dense"),))
    assert attention_bytes(no_mla, rows=10, context_rows=5, gathered=15) == 0
    # heads 2, q/k 3 + rope 2 = 5, v 5, W 5; bf16 activations, fp32 sums
    ctx = 5 * 2 * (5 + 5) * 2
    kernel = 4 * 15 * 2 * 5 * 2
    summing = 2 * 15 * 2 * 5 * 2 + 15 * 2 * 5 * 4
    assert attention_bytes(SMALL, rows=10, context_rows=5, gathered=15) == 2 * ctx + max(kernel, summing)
    full = replace(SMALL, recompute="full")
    assert attention_bytes(full, rows=10, context_rows=5, gathered=15) == ctx + max(kernel, summing)
    # a tree's runs gather ancestors once per run: more gathered keys, more bytes
    assert attention_bytes(full, rows=10, context_rows=5, gathered=40) > attention_bytes(full, rows=10, context_rows=5,
                                                                                          gathered=15)
    # in the plan the running item carries them
    plan = plan_window_memory([StepItem(10, attention_bytes=77), StepItem(4)], saved_per_row=3, graph_per_row=3)
    assert plan.predicted_peak_bytes == 30 + 77


def test_a_consumer_layout_counts_its_context_and_gathered_keys():
    """The schedule's memory items: a subtree read beside its producer's rows carries the attention bytes of
    its context rows and the keys its paths gather; the producer's own layout, of its rows only."""
    from dataclasses import replace

    from megatron_harts.layout import build_layout
    from megatron_harts.ops.key_paths import build_key_paths
    from megatron_harts.planner.memory import attention_bytes
    from megatron_harts.schedules.windows import _attention_bytes
    from megatron_harts.tree_data import build_forest, make_trajectory
    f = build_forest([make_trajectory({"id": f"t{i}", "tokens": [1] * 30 + [2 + i] * (10 + i)}) for i in range(3)])
    producer = build_layout(f)
    consumer = build_layout(f, roots=[s for s in range(f.num_segments) if f.seg_parent[s] >= 0], context=producer)
    assert consumer.num_context_rows == 30
    full = replace(SMALL, recompute="full")
    for lay in (producer, consumer):
        ctx = lay.num_context_rows
        gathered = build_key_paths(lay.visibility, lay.context_visibility if ctx else None).gathered_keys
        assert _attention_bytes(full, lay) == attention_bytes(full, rows=lay.num_rows, context_rows=ctx,
                                                              gathered=gathered) > 0
    assert _attention_bytes(replace(full, layer_kinds=(("kda", "dense"),)), consumer) == 0


def test_mlp_bytes_per_row_are_what_a_bf16_forward_saves(cpu_world):
    """The memory model's dense-MLP and MoE bytes per row against the tensors a bf16 forward saves for its
    backward (every saved tensor's storage counted once, parameters left out, attributed to the layer part
    that saved it first), with the fused weighted SwiGLU the GPU runs.  On the CPU the norm keeps an fp32
    copy of its input where the GPU's fused kernel keeps the bf16 input: (4 - 2) x hidden bytes more."""
    from hybrid_tiny import randomize_, tiny_config

    from megatron_harts.models.model import build_hybrid_model
    from megatron_harts.models.packed import TreePackedSeqParams
    cfg = tiny_config(dtype=torch.bfloat16, hidden_size=64, ffn_hidden_size=96, moe_ffn_hidden_size=32,
                      moe_shared_expert_intermediate_size=32, moe_router_num_groups=None,
                      moe_router_group_topk=None)
    cfg.bias_activation_fusion = True
    model = randomize_(build_hybrid_model(cfg, vocab_size=64), 0).to(torch.bfloat16)
    part = ["other"]
    for n, layer in enumerate(model.decoder.layers):
        layer.pre_mlp_layernorm.register_forward_pre_hook(lambda *_, n=n: part.__setitem__(0, n))
        layer.mlp.register_forward_hook(lambda *_: part.__setitem__(0, "other"))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in saved:     # the tensor held: no later storage reuses its address
            saved[ptr] = (part[0], t.untyped_storage().nbytes(), t)
        return t
    rows = 512
    psp = TreePackedSeqParams.for_sequences([rows])
    ids = torch.randint(0, 64, (1, rows), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, psp.position_ids[None], packed_seq_params=psp)
    shape = ModelShape.from_config(cfg)
    model_bytes = activation_bytes_per_row(shape)
    for n, (_, mlp) in enumerate(shape.layer_kinds):
        got = sum(b for p, b, _ in saved.values() if p == n) / rows
        want = model_bytes[mlp] + (4 - 2) * shape.hidden
        assert abs(got - want) <= 0.01 * want, (n, mlp, got, want)
