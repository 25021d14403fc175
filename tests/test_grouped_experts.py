"""GroupedSequentialMLP (megatron_harts/models/experts.py) against megatron-core's SequentialMLP.

The grouped path (two ``torch._grouped_mm`` calls over all local experts) gives the
reference's outputs and the gradients of the inputs, the probs and every expert weight
(fp32 within 1e-5, bf16 within a bf16 tolerance; on CPU ``_grouped_mm`` runs the same
per-group GEMMs, so these are in fact exact here), with experts that receive no tokens,
top-k > 1 probs, SwiGLU, fused weighted SwiGLU and a non-gated activation; gradients reach
megatron-DDP-style grad-accumulator hooks, and under megatron DDP itself the grouped backward's
own main_grad accumulation equals DDP's per-expert hook adds bitwise; fp64 and every other fallback is the reference
bitwise; parameters, attributes, state dict and sharded state dict are SequentialMLP's; a
tiny HybridModel gives the same log-probs and gradients with either expert module.
"""
import contextlib

import pytest
import torch
import torch.nn.functional as F

import megatron_harts.models.experts as experts_mod
import megatron_harts.models.layer as layer_mod
from megatron_harts.models.experts import GroupedSequentialMLP, _GroupedLinear
from megatron_harts.models.layer import _mlp_submodules
from megatron_harts.models.model import build_hybrid_model

from hybrid_tiny import VOCAB, expanded_inputs, randomize_, tiny_config, tiny_forest, tree_inputs

E = 8          # local experts
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _pair(cfg, num_local=E):
    """A SequentialMLP and a GroupedSequentialMLP with the same (random) weights."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    ref = SequentialMLP(num_local, cfg, _mlp_submodules(), pg_collection=get_default_pg_collection())
    new = GroupedSequentialMLP(num_local, cfg, _mlp_submodules(), pg_collection=get_default_pg_collection())
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    new.load_state_dict(ref.state_dict())
    return ref, new


def _routed(cfg, seed, num_tokens=13, topk=2, empty=(1, 6), num_local=E):
    """Rows as the dispatcher hands them over: each token routed to ``topk`` distinct experts
    (never to ``empty``), rows sorted by expert, per-row probs (fp32, like the router's)."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(num_local) if e not in empty])
    chosen = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:topk]] for _ in range(num_tokens)])
    probs = 2.5 * torch.rand(num_tokens, topk, generator=gen, dtype=torch.float32)
    order = torch.sort(chosen.flatten(), stable=True).indices
    token_of_row = torch.arange(num_tokens).repeat_interleave(topk)[order]
    counts = torch.bincount(chosen.flatten(), minlength=num_local)
    tokens = torch.randn(num_tokens, cfg.hidden_size, generator=gen, dtype=torch.float64).to(cfg.params_dtype)
    return tokens, token_of_row, probs.flatten()[order], counts


def _run(module, tokens, token_of_row, row_probs, counts, seed=9, ddp_hooks=False):
    """Forward + backward of random output weights; output and gradients (tokens, probs, weights).
    With ``ddp_hooks`` the weight gradients are collected as megatron DDP does: a hook on each
    parameter's grad accumulator adds ``.grad`` into ``.main_grad`` and clears ``.grad``."""
    t = tokens.clone().requires_grad_()
    p = row_probs.clone().requires_grad_()
    params = dict(module.named_parameters())
    fired = {n: 0 for n in params}
    accs = []
    if ddp_hooks:
        for n, w in params.items():
            w.main_grad = torch.zeros_like(w)

            def hook(*_, n=n, w=w):
                fired[n] += 1
                w.main_grad.add_(w.grad.data)
                w.grad = None
            acc = w.expand_as(w).grad_fn.next_functions[0][0]
            acc.register_hook(hook)
            accs.append(acc)
    y, bias = module(t[token_of_row], counts, p)
    assert bias is None
    gout = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(y.dtype)
    y.backward(gout)
    if ddp_hooks:
        assert all(v == 1 for v in fired.values()), fired
        wgrads = {n: w.main_grad.clone() for n, w in params.items()}
        for w in params.values():
            del w.main_grad
    else:
        wgrads = {n: w.grad.clone() for n, w in params.items()}
    module.zero_grad(set_to_none=True)
    return {"y": y.detach(), "tokens": t.grad, "probs": p.grad, **wgrads}


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.fixture
def grouped_calls(monkeypatch):
    """Counts the torch._grouped_mm calls."""
    calls = []
    real = torch._grouped_mm

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)
    monkeypatch.setattr(torch, "_grouped_mm", counting)
    return calls


@pytest.fixture
def unfused_swiglu(monkeypatch):
    """megatron's weighted SwiGLU without torch.compile (compiling on CPU takes seconds); the
    fused autograd functions themselves are unchanged, and both modules call the same ones."""
    import megatron.core.fusions.fused_bias_swiglu as fbs
    for name in ("weighted_swiglu", "weighted_swiglu_back", "swiglu", "swiglu_back"):
        fn = getattr(fbs, name)
        monkeypatch.setattr(fbs, name, getattr(fn, "_torchdynamo_orig_callable", fn))


ACTIVATIONS = {"swiglu": dict(gated_linear_unit=True, activation_func=F.silu),
               "gelu": dict(gated_linear_unit=False, activation_func=F.gelu),
               "fused_swiglu": dict(gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=True)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_grouped_equals_sequential(cpu_world, grouped_calls, unfused_swiglu, dtype, act):
    cfg = tiny_config(dtype=dtype, **ACTIVATIONS[act])
    ref, new = _pair(cfg)
    for seed, topk, empty in ((0, 2, (1, 6)), (1, 3, (0, 7)), (2, 1, ())):
        inputs = _routed(cfg, seed, topk=topk, empty=empty)
        assert new.fallback_reason(inputs[0][inputs[1]], inputs[3], inputs[2]) is None
        want = _run(ref, *inputs)
        n = len(grouped_calls)
        got = _run(new, *inputs, ddp_hooks=True)
        assert len(grouped_calls) - n == 6            # fc1, fc2; backward: dgrad and wgrad of each
        assert want.keys() == got.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
            assert _rel(got[k], want[k]) <= TOL[dtype], (k, _rel(got[k], want[k]))
        for e in empty:                               # experts without tokens: exactly zero gradient
            for fc in ("linear_fc1", "linear_fc2"):
                assert not got[f"local_experts.{e}.{fc}.weight"].any()


def test_fp64_is_the_reference_bitwise(cpu_world, grouped_calls):
    cfg = tiny_config(dtype=torch.float64)
    ref, new = _pair(cfg)
    inputs = _routed(cfg, 0)
    assert "float64" in new.fallback_reason(inputs[0][inputs[1]], inputs[3], inputs[2])
    want, got = _run(ref, *inputs), _run(new, *inputs)
    assert not grouped_calls
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("case", ["probs_on_input", "bias", "unaligned", "no_grouped_mm", "no_tokens",
                                  "one_expert", "switched_off", "counts_mismatch"])
def test_fallbacks_are_the_reference(cpu_world, grouped_calls, monkeypatch, case):
    overrides = {"probs_on_input": dict(moe_apply_probs_on_input=True, moe_router_topk=1),
                 "bias": dict(add_bias_linear=True),
                 "unaligned": dict(moe_ffn_hidden_size=6)}.get(case, {})
    cfg = tiny_config(dtype=torch.float32, **overrides)
    num_local = 1 if case == "one_expert" else E
    ref, new = _pair(cfg, num_local)
    inputs = _routed(cfg, 0, topk=1 if case in ("probs_on_input", "one_expert") else 2,
                     empty=() if case == "one_expert" else (1, 6), num_local=num_local)
    if case == "no_grouped_mm":
        monkeypatch.setattr(experts_mod, "_HAVE_GROUPED_MM", False)
    if case == "no_tokens":
        inputs = (inputs[0], inputs[1][:0], inputs[2][:0], torch.zeros_like(inputs[3]))
    if case == "switched_off":
        new.use_grouped_mm = False
    x = inputs[0][inputs[1]]
    counts = inputs[3]
    if case == "counts_mismatch":
        counts = counts.clone()
        counts[0] += 1
        assert new.fallback_reason(x, counts, inputs[2]) is not None
        with pytest.raises(RuntimeError):
            new(x, counts, inputs[2])
        return
    reason = new.fallback_reason(x, counts, inputs[2])
    assert reason is not None
    if case == "bias":
        # megatron's own expert MLP adds the scaled bias in place on a custom Function's view
        # output at TP = EP = 1, which autograd refuses: compare the forward without autograd
        with torch.no_grad():
            assert torch.equal(new(x, counts, inputs[2])[0], ref(x, counts, inputs[2])[0])
        assert not grouped_calls
        return
    want, got = _run(ref, *inputs), _run(new, *inputs)
    assert not grouped_calls, reason
    for k in want:
        assert torch.equal(got[k], want[k]), (case, k)


def test_grad_accumulation_fusion_keeps_the_grouped_path(cpu_world, grouped_calls):
    """With the dense linears' fused wgrad on, the experts still run grouped, with the unfused values."""
    cfg = tiny_config(dtype=torch.float32)
    ref, new = _pair(cfg)
    new.config.gradient_accumulation_fusion = True     # the module's own config copy
    inputs = _routed(cfg, 0)
    assert new.fallback_reason(inputs[0][inputs[1]], inputs[3], inputs[2]) is None
    want, got = _run(ref, *inputs), _run(new, *inputs)
    assert grouped_calls
    for k in want:
        assert _rel(got[k], want[k]) <= TOL[torch.float32], k


def _shapes(state):
    """Keys in order, tensor shapes (megatron's linears also store a None ``_extra_state``)."""
    return [(k, tuple(v.shape) if isinstance(v, torch.Tensor) else v) for k, v in state.items()]


def _describe_sharded(sd):
    return {k: (type(v).__name__, getattr(v, "key", None), getattr(v, "global_shape", None),
                getattr(v, "global_offset", None), getattr(v, "replica_id", None),
                getattr(v, "axis_fragmentations", None)) for k, v in sd.items()}


def test_parameters_and_checkpoint_format_are_sequential_mlps(cpu_world):
    cfg = tiny_config(dtype=torch.float32)
    ref, new = _pair(cfg)
    assert isinstance(new, type(ref))
    rs, ns = ref.state_dict(), new.state_dict()
    assert _shapes(rs) == _shapes(ns)
    assert "local_experts.7.linear_fc1.weight" in ns and "local_experts.7.linear_fc2.weight" in ns
    rp, np_ = dict(ref.named_parameters()), dict(new.named_parameters())
    assert list(rp) == list(np_)
    for k in rp:
        assert rp[k].shape == np_[k].shape and rp[k].dtype == np_[k].dtype
        assert vars(rp[k]) == vars(np_[k]), k          # allreduce, tensor_model_parallel, partition_dim, ...
    assert _describe_sharded(ref.sharded_state_dict(prefix="mlp.experts.")) == \
        _describe_sharded(new.sharded_state_dict(prefix="mlp.experts."))


def _model_run(model, cfg, short):
    """Log-probs of a packed expanded forest, or the logits of 3 tokens (6 routed rows over 8
    experts: some experts get none); loss, backward, gradients and tokens per expert."""
    model.zero_grad(set_to_none=True)
    if short:
        ids = torch.tensor([[3, 17, 5]])
        out = model(ids, torch.arange(3)[None])
    else:
        forest = tiny_forest(0)
        lay, psp = tree_inputs(forest, cfg)
        ids, pos, epsp, erows, etok, _ = expanded_inputs(lay, forest)
        out = model(ids, pos, packed_seq_params=epsp, pair_row=erows, pair_token=etok)
    coeffs = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float32)
    (coeffs * out).sum().backward()
    routers = [layer.mlp.router for layer in model.decoder.layers if layer.is_moe_layer]
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, \
        torch.stack([r.last_tokens_per_expert for r in routers])


# megatron's torch.compile'd helpers (the router's expert-bias update) run eagerly: both models call the
# same ones, and torch 2.11's dynamo fails compiling a CPU graph in a process with CUDA unused (the GPU
# machine: "list indices must be integers or slices, not str" in get_device_properties).  Through the
# config's own patch: monkeypatch's undo leaves torch 2.13's config without the key.
@torch._dynamo.config.patch(disable=True)
def test_hybrid_model_equals_sequential_experts(cpu_world, grouped_calls, monkeypatch):
    from megatron.core.transformer.moe.experts import SequentialMLP
    cfg = tiny_config(dtype=torch.float32)
    model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 2)
    moe = [layer.mlp.experts for layer in model.decoder.layers if layer.is_moe_layer]
    assert moe and all(type(m) is GroupedSequentialMLP for m in moe)
    with monkeypatch.context() as m:
        m.setattr(layer_mod, "GroupedSequentialMLP", SequentialMLP)
        ref = build_hybrid_model(cfg, vocab_size=VOCAB)
    assert all(type(layer.mlp.experts) is SequentialMLP for layer in ref.decoder.layers if layer.is_moe_layer)
    rs, ns = ref.state_dict(), model.state_dict()
    assert _shapes(rs) == _shapes(ns)
    ref.load_state_dict(ns)
    for short in (True, False):
        out_ref, g_ref, tpe_ref = _model_run(ref, cfg, short)
        assert not grouped_calls
        out, g, tpe = _model_run(model, cfg, short)
        assert len(grouped_calls) == 6 * len(moe)
        grouped_calls.clear()
        assert torch.equal(tpe, tpe_ref) and (tpe == 0).any() == short    # short: experts without tokens
        assert _rel(out, out_ref) <= 1e-5
        assert g.keys() == g_ref.keys() and any(".local_experts." in k for k in g)
        for k in g_ref:
            assert _rel(g[k], g_ref[k]) <= 1e-5, (short, k, _rel(g[k], g_ref[k]))



@torch._dynamo.config.patch(disable=True)
def test_hybrid_model_with_fused_swiglu_equals_unfused(cpu_world, unfused_swiglu, monkeypatch):
    """``bias_activation_fusion`` (the driver's default on the GPU): the dense MLP and the grouped experts
    through megatron's fused SwiGLU (routing weights folded in) give the unfused model's outputs and
    gradients (fp32, to rounding)."""
    import megatron.core.fusions.fused_bias_swiglu as fbs
    calls = {"swiglu": 0, "weighted_swiglu": 0}
    for name in calls:
        fn = getattr(fbs, name)

        def counted(*a, _fn=fn, _name=name):
            calls[_name] += 1
            return _fn(*a)
        monkeypatch.setattr(fbs, name, counted)
    want_cfg = tiny_config(dtype=torch.float32)
    fused_cfg = tiny_config(dtype=torch.float32, bias_activation_fusion=True)
    ref = randomize_(build_hybrid_model(want_cfg, vocab_size=VOCAB), 5)
    model = build_hybrid_model(fused_cfg, vocab_size=VOCAB)
    model.load_state_dict(ref.state_dict())
    for short in (True, False):
        out_ref, g_ref, tpe_ref = _model_run(ref, want_cfg, short)
        assert calls == {"swiglu": 0, "weighted_swiglu": 0}
        out, g, tpe = _model_run(model, fused_cfg, short)
        assert calls["swiglu"] > 0 and calls["weighted_swiglu"] > 0      # the dense MLP's and the experts'
        calls.update(swiglu=0, weighted_swiglu=0)
        assert torch.equal(tpe, tpe_ref)
        assert _rel(out, out_ref) <= 1e-5
        assert g.keys() == g_ref.keys()
        for k in g_ref:
            assert _rel(g[k], g_ref[k]) <= 1e-5, (short, k, _rel(g[k], g_ref[k]))


@pytest.mark.parametrize("dtype,fp32_grads", [(torch.float32, False), (torch.bfloat16, False),
                                              (torch.bfloat16, True)], ids=["fp32", "bf16", "bf16-fp32-grads"])
def test_ddp_main_grads_are_the_unfused_hooks_bitwise(cpu_world, unfused_swiglu, monkeypatch, dtype, fp32_grads):
    """Under megatron DDP the grouped backward adds the experts' weight gradients into their
    ``main_grad`` itself (one foreach add) and DDP's post-hooks skip theirs: after two backward
    passes (accumulation) every main_grad equals, bitwise, what DDP's own per-expert hook adds give."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    cfg = tiny_config(dtype=dtype)
    inputs = [_routed(cfg, seed) for seed in (0, 1)]
    foreach = []
    real_foreach = torch._foreach_add_
    monkeypatch.setattr(torch, "_foreach_add_", lambda *a, **k: (foreach.append(len(a[0])), real_foreach(*a, **k)))

    def main_grads(fused, hooks_off=False, x_grad=True):
        with monkeypatch.context() as m:
            if not fused:
                m.setattr(experts_mod, "_accumulates_into_main_grad", lambda *a: False)
            _, new = _pair(cfg)
            ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=fp32_grads), new)
            ddp.zero_grad_buffer()
            accumulated = []
            for w in new.parameters():
                w.register_post_accumulate_grad_hook(lambda w: accumulated.append(w))
            with ddp.no_sync(), (experts_mod.expert_grad_hooks_off(ddp) if hooks_off else contextlib.nullcontext()):
                for tokens, token_of_row, probs, counts in inputs:     # hidden states in the graph, as in a model
                    y, _ = ddp(tokens[token_of_row].requires_grad_(x_grad), counts, probs)
                    y.float().square().sum().backward()
            assert all(m.weight_grad_hooks for m in new.modules() if isinstance(m, GroupedSequentialMLP))
            added = [getattr(w, "grad_added_to_main_grad") for w in new.parameters()]
            assert all(w.grad is None for w in new.parameters())
            return {n: w.main_grad.clone() for n, w in new.named_parameters()}, added, len(accumulated)

    want, added, accumulated = main_grads(fused=False)
    assert not any(added) and not foreach and accumulated == 2 * 2 * E
    got, added, accumulated = main_grads(fused=True)
    assert all(added) and foreach == [E] * 4          # fc1 and fc2 of each of the two backward passes
    assert accumulated == 2 * 2 * E                   # placeholders: every weight's accumulator ran
    foreach.clear()
    # expert_grad_hooks_off (under no_sync): the same main_grads, and no weight's accumulator runs
    quiet, added, accumulated = main_grads(fused=True, hooks_off=True)
    assert all(added) and foreach == [E] * 4 and accumulated == 0
    # ... but not where the input is out of the graph (no backward would add the weight gradients):
    # fc1 then keeps its weights' accumulators (E per pass), fc2's input is in the graph through fc1's
    unhooked, _, accumulated = main_grads(fused=True, hooks_off=True, x_grad=False)
    assert accumulated == 2 * E and all(torch.equal(unhooked[k], got[k]) for k in got)
    assert want.keys() == got.keys() == quiet.keys()
    for k in want:
        assert got[k].dtype == (torch.float32 if fp32_grads else dtype)
        assert torch.equal(got[k], want[k]), k
        assert torch.equal(quiet[k], want[k]), k
        assert got[k].any() or "local_experts.1." in k or "local_experts.6." in k

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_grouped_linear_on_gpu(dtype):
    """The autograd function alone on the GPU kernels, against per-expert matmuls."""
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 17, 1, 0, 33, 8, 0])
    x = torch.randn(int(counts.sum()), 64, generator=gen).to("cuda", dtype).requires_grad_()
    ws = [torch.randn(96, 64, generator=gen).to("cuda", dtype).requires_grad_() for _ in counts]
    offs = torch.cumsum(counts, 0, dtype=torch.int32).cuda()
    y = _GroupedLinear.apply(x, offs, (counts == 0).cuda(), None, None, *ws)
    gy = torch.randn(y.shape, generator=gen).to("cuda", dtype)
    grads = torch.autograd.grad(y, [x, *ws], gy)
    xr = x.detach().double().requires_grad_()
    wr = [w.detach().double().requires_grad_() for w in ws]
    yr = torch.cat([a @ w.t() for a, w in zip(torch.split(xr, counts.tolist()), wr)])
    grads_r = torch.autograd.grad(yr, [xr, *wr], gy.double())
    tol = TOL[dtype] if dtype == torch.bfloat16 else 1e-4
    assert _rel(y, yr) <= tol
    for a, b in zip(grads, grads_r):
        assert _rel(a, b) <= tol if b.abs().max() > 0 else not a.any()


def _saved_bytes(model, cfg, grouped_calls, linear: int):
    """One forward and backward of ``model`` (``_model_run``): its results, the bytes of every storage its
    graph saved (parameters left out, each storage once) and the elements of the grouped linear's inputs
    in the forward (``linear`` 0: fc1, 1: fc2, summed over the MoE layers)."""
    moe_layers = sum(layer.is_moe_layer for layer in model.decoder.layers)
    seen, alive = {}, []          # every saved storage kept alive: no address is reused in the run
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        alive.append(t)
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t
    grouped_calls.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = _model_run(model, cfg, False)
    forward = grouped_calls[:2 * moe_layers]       # per MoE layer fc1, fc2 (the backward's calls follow)
    return got, sum(seen.values()), sum(shape[0] * shape[1] for shape in forward[linear::2])


@torch._dynamo.config.patch(disable=True)
def test_fc1_keeps_the_dispatch_source_not_the_permuted_tokens(cpu_world, grouped_calls, monkeypatch):
    """With the all-gather dispatcher the experts read the dispatch's source and index from it: fc1
    keeps those for its backward and gathers its input again there, instead of keeping the
    ``top-k`` permuted copies.  Outputs and every gradient are bitwise those of keeping the copies, and
    the forward saves ``top-k x hidden`` elements a token less per MoE layer."""
    cfg = tiny_config(dtype=torch.float32)
    model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 2)
    moe = [layer.mlp for layer in model.decoder.layers if layer.is_moe_layer]
    (out, g, tpe), kept, fc1_inputs = _saved_bytes(model, cfg, grouped_calls, 0)
    assert all(e.experts.dispatcher is e.token_dispatcher for e in moe)
    with monkeypatch.context() as m:
        for e in moe:
            m.setattr(e.experts, "dispatcher", None)
        (out_ref, g_ref, tpe_ref), kept_ref, fc1_ref = _saved_bytes(model, cfg, grouped_calls, 0)
    assert fc1_inputs == fc1_ref > 0 and all(e.token_dispatcher.permuted_from is None for e in moe)
    assert torch.equal(out, out_ref) and torch.equal(tpe, tpe_ref) and g.keys() == g_ref.keys()
    assert all(torch.equal(g[k], g_ref[k]) for k in g)
    assert kept_ref - kept == fc1_inputs * 4          # fp32: every fc1 input (top-k copies of the tokens)


@torch._dynamo.config.patch(disable=True)
@pytest.mark.parametrize("fused", [False, True], ids=["swiglu", "fused_swiglu"])
def test_fc2_builds_its_input_again_in_the_backward(cpu_world, grouped_calls, unfused_swiglu, fused):
    """fc2 keeps the activation's inputs (the fc1 output and the probs, which the activation keeps for
    its own backward) and runs the activation again in its backward instead of keeping its output:
    outputs and every gradient are bitwise those of keeping it, and the forward saves fc2's input
    (``top-k x width`` elements a token per MoE layer) less."""
    cfg = tiny_config(dtype=torch.float32)
    cfg.bias_activation_fusion = fused
    model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 2)
    moe = [layer.mlp for layer in model.decoder.layers if layer.is_moe_layer]
    (out, g, tpe), kept, fc2_inputs = _saved_bytes(model, cfg, grouped_calls, 1)
    for e in moe:
        e.experts.rebuild_fc2_input = False
    (out_ref, g_ref, tpe_ref), kept_ref, fc2_ref = _saved_bytes(model, cfg, grouped_calls, 1)
    assert fc2_inputs == fc2_ref > 0
    assert torch.equal(out, out_ref) and torch.equal(tpe, tpe_ref) and g.keys() == g_ref.keys()
    assert all(torch.equal(g[k], g_ref[k]) for k in g)
    assert kept_ref - kept == fc2_inputs * 4          # fp32: every fc2 input
