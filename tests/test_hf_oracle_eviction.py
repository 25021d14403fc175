"""The transformers oracle (testing/fidelity.py: hf_logprobs, eviction_mask, kimi_linear_torch_path):
with compaction events, evicted keys leave the MLA layers' attention only (KDA layers and their
convolutions see everything); on the CPU it runs transformers' torch code whatever kernels import."""
import contextlib
import importlib
import sys
import types

import numpy as np
import pytest
import torch

from megatron_harts.testing.fidelity import KIMI_LINEAR_MODELING, eviction_mask, hf_logprobs, kimi_linear_torch_path
from megatron_harts.models.hf_convert import kimi_linear_hf_config

from hybrid_tiny import VOCAB, tiny_config

transformers = pytest.importorskip("transformers")

T = 20
EVENTS = np.array([[9, 2, 6], [14, 0, 3], [14, 7, 9]], dtype=np.int64)


@pytest.fixture(scope="module")
def hf():
    """A tiny fp64 Kimi-Linear (KDA, MLA, KDA, MLA) with random weights of a realistic spread."""
    cfg = kimi_linear_hf_config(tiny_config(), VOCAB)
    cfg._experts_implementation = "eager"
    model = transformers.KimiLinearForCausalLM(cfg).double().eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in sorted([*model.named_parameters(), *model.named_buffers()]):
            r = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * r)
            elif name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen, dtype=torch.float64))
            elif name.endswith("dt_bias"):
                p.copy_(-2.0 + 0.5 * r)
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.05 * r)
            else:
                p.copy_(0.2 * r)
    return model


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(1).integers(0, VOCAB, T)


def brute_force_mask(length, events):
    """The definition, one (query, key) pair at a time."""
    return torch.tensor([[j <= i and not any(s <= j < e and a <= i for a, s, e in events) for j in range(length)]
                         for i in range(length)])


def test_no_events_equals_the_plain_oracle_bitwise(hf, tokens):
    plain = hf_logprobs(hf, tokens)
    assert plain.shape == (T, VOCAB) and plain.dtype == torch.float64
    masked = hf_logprobs(hf, tokens, np.zeros((0, 3), dtype=np.int64))     # the masked path, no event
    assert torch.equal(masked, plain)
    with torch.no_grad(), kimi_linear_torch_path():
        direct = hf(torch.as_tensor(tokens)[None]).logits[0].double().log_softmax(-1)
    assert torch.equal(plain, direct)


def test_events_change_only_the_positions_from_the_first_at_on(hf, tokens):
    diff = (hf_logprobs(hf, tokens, EVENTS) - hf_logprobs(hf, tokens)).abs().amax(-1)
    first = int(EVENTS[:, 0].min())
    assert torch.equal(diff[:first], torch.zeros(first, dtype=torch.float64))
    assert (diff[first:] > 1e-6).all(), diff
    # the second event's at: positions 9..13 see only the first event
    only_first = hf_logprobs(hf, tokens, EVENTS[:1])
    assert torch.equal(hf_logprobs(hf, tokens, EVENTS)[:14], only_first[:14])
    assert not torch.equal(hf_logprobs(hf, tokens, EVENTS)[14:], only_first[14:])


def test_mask_matches_the_definition_and_reaches_mla_layers_only(hf, tokens):
    want = brute_force_mask(T, EVENTS.tolist())
    assert torch.equal(eviction_mask(T, EVENTS), want)
    assert torch.equal(eviction_mask(T, None), brute_force_mask(T, []))
    seen = {}

    def keep(i):
        def hook(module, args, kwargs):
            seen[i] = kwargs.get("attention_mask")
        return hook
    hooks = [layer.self_attn.register_forward_pre_hook(keep(i), with_kwargs=True)
             for i, layer in enumerate(hf.model.layers)]
    try:
        hf_logprobs(hf, tokens, EVENTS)
    finally:
        for h in hooks:
            h.remove()
    assert hf.config.layer_types == ["linear_attention", "full_attention"] * 2
    for i in (0, 2):                                   # KDA: no mask, nothing treated as padding
        assert seen[i] is None
    for i in (1, 3):                                   # MLA: additive 0 where allowed, -max where evicted
        mask = seen[i]
        assert mask.shape == (1, 1, T, T) and mask.dtype == torch.float64
        assert torch.equal(mask[0, 0] == 0, want)
        assert (mask[0, 0][~want] == torch.finfo(torch.float64).min).all()


def test_kda_layers_see_the_whole_stream(hf, tokens):
    """Layer 0 (KDA, before any MLA) gives the same output with and without events; layer 2 (KDA
    after an MLA layer) differs only where its input does (from the first at on)."""
    outs = {}

    def run(key, events):
        hooks = [hf.model.layers[i].self_attn.register_forward_hook(
            lambda m, a, k, out, i=i: outs.__setitem__((key, i), out.detach().clone()), with_kwargs=True)
            for i in (0, 2)]
        try:
            hf_logprobs(hf, tokens, events)
        finally:
            for h in hooks:
                h.remove()
    run("plain", None)
    run("evicted", EVENTS)
    assert torch.equal(outs["evicted", 0], outs["plain", 0])
    first = int(EVENTS[:, 0].min())
    assert torch.equal(outs["evicted", 2][:, :first], outs["plain", 2][:, :first])
    assert not torch.equal(outs["evicted", 2][:, first:], outs["plain", 2][:, first:])


@pytest.mark.parametrize("event", [(5, 2, 6), (5, 3, 3), (5, -1, 2), (T, 0, 2)])
def test_invalid_events_are_refused(event):
    with pytest.raises(ValueError, match="compaction event"):
        eviction_mask(T, np.array([event]))


TRITON_ON_CPU = "Pointer argument cannot be accessed from Triton (cpu tensor?)"


def _kernel(module_name):
    def kernel(*args, **kwargs):
        raise RuntimeError(TRITON_ON_CPU)
    kernel.__module__ = module_name
    return kernel


@contextlib.contextmanager
def kernels_for_cpu_tensors():
    """transformers' Kimi-Linear modeling file re-imported where fla and causal-conv1d import and
    transformers hands them tensors of every device (as versions without a device check do): each
    of their kernels raises as Triton does on CPU tensors; plus a kernel bound at module level, as
    older versions import them.  Re-imported as it was afterwards."""
    from transformers.integrations import hub_kernels
    mod = importlib.import_module(KIMI_LINEAR_MODELING)
    with pytest.MonkeyPatch.context() as mp:
        for package, names in (("fla", ("chunk_kda", "fused_recurrent_kda")),
                               ("causal_conv1d", ("causal_conv1d_fn", "causal_conv1d_update"))):
            fake = types.ModuleType(package)
            for name in names:
                setattr(fake, name, _kernel(package))
            mp.setitem(sys.modules, package, fake)
        if hasattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES"):      # transformers with a device check
            mp.setattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", {})
        try:
            importlib.reload(mod)
            mp.setattr(mod, "chunk_kda", _kernel("fla.ops.kda"), raising=False)
            yield mod
        finally:
            mp.undo()
            importlib.reload(mod)


def test_cpu_oracle_runs_torch_code_where_kernels_would_be_taken(hf, tokens):
    want_plain, want_evicted = hf_logprobs(hf, tokens), hf_logprobs(hf, tokens, EVENTS)
    with kernels_for_cpu_tensors() as mod:
        with pytest.raises(RuntimeError, match="Triton"), torch.no_grad():
            hf(torch.as_tensor(tokens)[None])              # transformers' own choice: the kernels
        simulated = dict(vars(mod))
        assert torch.equal(hf_logprobs(hf, tokens), want_plain)
        assert torch.equal(hf_logprobs(hf, tokens, EVENTS), want_evicted)
        with kimi_linear_torch_path():
            assert mod.chunk_kda is None
            assert mod.chunk_kimi_delta_attention is not simulated["chunk_kimi_delta_attention"]
        assert all(vars(mod)[k] is v for k, v in simulated.items())         # restored on exit
        with pytest.raises(RuntimeError, match="Triton"), torch.no_grad():
            hf(torch.as_tensor(tokens)[None])
