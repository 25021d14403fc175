"""The KDA layers' convs and q/k/v activations run again in the backward (``kda_input_recompute``, the
default; ``models.cores.KDACore._inputs``): the same bits as keeping what they save, for fewer saved bytes.

Tiny fp64 model on CPU: log-probs, loss and every gradient bitwise equal with and without, in tree and
expanded mode, alone and under full layer recomputation; the bytes the forward leaves for the backward
drop by at least the conv outputs (3 x heads x dim a row and KDA layer); through the driver, with sharing
windows and pieces (read pieces kept and run again), the same step as ``--no-tree-kda-input-recompute``: the
same loss, gradients to rounding (the step's backward may sum some of them in another order).
"""
import contextlib

import pytest
import torch

from megatron_harts.models.model import build_hybrid_model

from hybrid_tiny import VOCAB, expanded_inputs, randomize_, tiny_config, tiny_forest, tree_inputs
from test_memory_budget_driver import _driver_run


def _inputs(cfg, forest):
    lay, psp = tree_inputs(forest, cfg)
    ids, pos, epsp, erows, etok, _ = expanded_inputs(lay, forest)
    return {"tree": (lay.tokens[None], lay.position_ids[None], psp, lay.pair_row, lay.pair_token),
            "expanded": (ids, pos, epsp, erows, etok)}


def _step(model, inputs):
    """(log-probs, loss, gradients, bytes the forward leaves saved for the backward)."""
    model.zero_grad(set_to_none=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ids, pos, psp, prow, ptok = inputs
        lp = model(ids, pos, packed_seq_params=psp, pair_row=prow, pair_token=ptok)
    storages = {}
    for t in saved:   # a released storage counts 0 bytes
        st = t.untyped_storage()
        storages[st.data_ptr() if st.size() else id(st)] = st.size()
    coeffs = torch.linspace(-1.0, 1.0, lp.numel(), dtype=lp.dtype)
    loss = (coeffs * lp).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), loss.detach(), grads, sum(storages.values())


@pytest.mark.parametrize("overrides", [{}, dict(recompute_granularity="full", recompute_method="uniform",
                                                recompute_num_layers=1)], ids=["plain", "full-recompute"])
def test_recomputed_kda_inputs_give_the_same_bits(cpu_world_for_the_test, overrides):
    forest = tiny_forest(3)
    runs = {}
    for on in (True, False):
        cfg = tiny_config(kda_input_recompute=on, **overrides)
        model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 3)
        runs[on] = {mode: _step(model, x) for mode, x in _inputs(cfg, forest).items()}
    kda_layers = sum(1 for t in cfg.resolved_layer_types() if t == "kda")
    hd = cfg.linear_num_heads * cfg.linear_head_dim
    for mode in ("tree", "expanded"):
        lp, loss, grads, saved = runs[True][mode]
        lp0, loss0, grads0, saved0 = runs[False][mode]
        assert torch.equal(lp, lp0) and torch.equal(loss, loss0), mode
        assert set(grads) == set(grads0) and any(n.endswith("conv_q_weight") for n in grads)
        for n, g in grads0.items():
            assert torch.equal(grads[n], g), (mode, n)
        if not overrides:   # under full recomputation the layers' activations are not saved in the forward
            num_rows = _inputs(cfg, forest)[mode][0].numel()
            assert saved0 - saved >= 3 * hd * 8 * num_rows * kda_layers, (mode, saved0, saved)


def test_no_recompute_flag_through_the_driver():
    """Sharing windows (producers and consumers) and pieces (read pieces kept, and run again): the step's
    loss is that of ``--no-tree-kda-input-recompute``, its gradients to rounding."""
    from test_training_driver import rollouts

    from megatron_harts.tree_data import build_forest
    forest = build_forest(rollouts(0))
    runs = [(["--tree-microbatch-tokens", "16", "--tree-piece-keep", keep], "read_pieces") for keep in ("all", "none")]
    for extra, used in runs + [([], "windows")]:
        on, g_on, t_on = _driver_run(extra, forest, steps=1)
        off, g_off, t_off = _driver_run(extra + ["--no-tree-kda-input-recompute"], forest, steps=1)
        assert t_on.config.kda_input_recompute and not t_off.config.kda_input_recompute
        assert on[0][used] > 0, (extra, used)
        if t_on.device.type == "cpu":
            assert on[0]["loss"] == off[0]["loss"]
        else:   # CUDA's atomic adds (index_add_ with repeated rows) order the forward's sums freely
            assert abs(on[0]["loss"] - off[0]["loss"]) <= 1e-14 * abs(off[0]["loss"])
        assert abs(on[0]["grad_norm"] - off[0]["grad_norm"]) <= 1e-14 * off[0]["grad_norm"]
        assert set(g_on) == set(g_off)
        for n, g in g_off.items():   # to rounding: the step's backward may sum some gradients in another order
            assert float((g_on[n] - g).abs().max()) <= 1e-14 * float(g.abs().max()), (extra, n)


def _core_run(device, dtype, backend, on, mode, heads=2, dim=64):
    """The KDA core alone over three packed sequences or a tree of them (one shared prefix): (output, input
    gradients, conv weight gradients, bytes the forward leaves alive for the backward, rows)."""
    import numpy as np
    from megatron_harts.layout import build_layout
    from megatron_harts.models.cores import KDACore
    from megatron_harts.models.packed import TreePackedSeqParams
    from megatron_harts.tree_data import build_forest, make_trajectory
    cfg = tiny_config(dtype, linear_num_heads=heads, linear_head_dim=dim, kda_backend=backend,
                      kda_chunk_size=64, kda_input_recompute=on)
    core = KDACore(cfg, layer_number=1)
    if mode == "tree":
        toks = np.random.default_rng(0).integers(1, 99, 300).tolist()
        trajs = [make_trajectory({"id": i, "tokens": toks[:90] + toks[90 + 70 * i:160 + 70 * i]}) for i in range(3)]
        lay = build_layout(build_forest(trajs))
        psp = TreePackedSeqParams.for_tree(lay, config=cfg, device=device)
        R = lay.num_rows
        assert psp.kda_schedule.call_rows is not None      # calls reading gathered copies of the rows
    else:
        psp = TreePackedSeqParams.for_sequences([70, 130, 61], device=device)
        R = 261
    hd = heads * dim
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(R, hd, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_()
               for _ in range(3))
    g = (-torch.rand(R, heads, dim, generator=gen, dtype=torch.float64) * 0.5).to(device, dtype).requires_grad_()
    beta = torch.rand(R, heads, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_()
    conv = tuple((0.3 * torch.randn(hd, cfg.linear_conv_kernel_dim, generator=gen, dtype=torch.float64))
                 .to(device, dtype).requires_grad_() for _ in range(3))
    wo = torch.randn(R, heads, dim, generator=gen, dtype=torch.float64).to(device, dtype)
    saved = []
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        o = core(q, k, v, g, beta, conv, psp, shape=(R, 1))
    if device == "cuda":
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before - o.numel() * o.element_size()
    else:
        kept = sum({t.untyped_storage().data_ptr() if t.untyped_storage().size() else id(t):
                    t.untyped_storage().size() for t in saved}.values())
    del saved
    (wo * o).sum().backward()
    return o.detach(), [x.grad for x in (q, k, v, g, beta)], [w.grad for w in conv], kept, R


@contextlib.contextmanager
def _deterministic(device):
    """On CUDA, ``index_add_`` with repeated indices (a fork's state gradient summed over the calls that
    start from it) adds in an order that changes from run to run; torch's deterministic mode fixes it,
    so that two runs may be compared bit for bit (warn_only: the ops without a deterministic form warn)."""
    if device != "cuda":
        yield
        return
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


@pytest.mark.parametrize("mode", ["expanded", "tree"])
@pytest.mark.parametrize("device,dtype,backend", [
    ("cpu", torch.float64, "reference"),
    pytest.param("cuda", torch.bfloat16, "fla", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="fla's KDA kernels and the fused kernels run on CUDA")),
], ids=["cpu-fp64-reference", "cuda-bf16-fla-fused"])
def test_the_kda_core_releases_its_inputs(request, device, dtype, backend, mode):
    """On the GPU (fla, fused kernels) the core keeps 6 x heads x dim elements a row fewer (the conv outputs of q,
    k and v, and the recurrence's q, k, v or its calls' copies, released), on the CPU at least the conv outputs;
    the same bits."""
    if backend == "fla":
        pytest.importorskip("fla")
    else:
        request.getfixturevalue("cpu_world_for_the_test")
    with _deterministic(device):
        o1, g1, w1, kept1, R = _core_run(device, dtype, backend, True, mode)
        o0, g0, w0, kept0, _ = _core_run(device, dtype, backend, False, mode)
    assert torch.equal(o1, o0)
    for a, b in zip(g1 + w1, g0 + w0):
        assert torch.equal(a, b)
    hd, e = 128, torch.finfo(dtype).bits // 8
    assert kept0 - kept1 >= (6 if device == "cuda" else 3) * hd * e * R, (kept0, kept1)
