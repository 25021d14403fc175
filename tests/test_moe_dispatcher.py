"""SyncFreeAllGatherDispatcher (models/dispatcher.py) against megatron-core's all-gather dispatcher.

With every expert local and dropless routing, the fixed-size permutation is megatron's exactly:
same permuted tokens, probabilities and tokens per expert (bitwise); the combine and the gradients
are megatron's sums in a fixed order (fp64: equal to rounding, and bitwise the same on every run);
other configurations run megatron's method; a routing map without exactly top-k
experts per token is refused (checked where it costs no device read: on the CPU); the hybrid
model's MoE layers use it.
"""
import pytest
import torch

from megatron_harts.models.dispatcher import SyncFreeAllGatherDispatcher

from hybrid_tiny import VOCAB, tiny_config


def _pair(cfg):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
    E, pg = cfg.num_moe_experts, get_default_pg_collection()
    return (MoEAllGatherTokenDispatcher(E, list(range(E)), config=cfg, pg_collection=pg),
            SyncFreeAllGatherDispatcher(E, list(range(E)), config=cfg, pg_collection=pg))


def _routing(num_tokens, E, topk, seed, empty=(2,)):
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(E) if e not in empty])
    routing = torch.zeros(num_tokens, E, dtype=torch.bool)
    for t in range(num_tokens):
        routing[t, allowed[torch.randperm(len(allowed), generator=gen)[:topk]]] = True
    probs = torch.rand(num_tokens, E, generator=gen, dtype=torch.float64) * routing
    hidden = torch.randn(num_tokens, 1, 6, generator=gen, dtype=torch.float64)
    return hidden, routing, probs


def _dispatch_and_combine(d, hidden, routing, probs, seed=1):
    h = hidden.clone().requires_grad_()
    p = probs.clone().requires_grad_()
    x, q = d.dispatch_preprocess(h, routing, p)
    x, q = d.token_dispatch(x, q)
    permuted, counts, pprobs = d.dispatch_postprocess(x, q)
    w = torch.randn(permuted.shape, generator=torch.Generator().manual_seed(seed), dtype=permuted.dtype)
    y = d.combine_postprocess(d.token_combine(d.combine_preprocess(permuted * w * pprobs.unsqueeze(-1))))
    gh, gp = torch.autograd.grad((y * y).sum(), (h, p))
    return permuted.detach(), counts, pprobs.detach(), y.detach(), gh, gp


@pytest.mark.parametrize("num_tokens,topk,seed", [(11, 2, 0), (1, 3, 1), (40, 4, 2)])
def test_same_permutation_and_gradients_as_megatron(cpu_world, num_tokens, topk, seed):
    cfg = tiny_config(moe_router_topk=topk)
    ref, new = _pair(cfg)
    assert new.fixed_fanout
    hidden, routing, probs = _routing(num_tokens, cfg.num_moe_experts, topk, seed)
    want = _dispatch_and_combine(ref, hidden, routing, probs)
    got = _dispatch_and_combine(new, hidden, routing, probs)
    assert got[1].tolist() == want[1].tolist() and got[1].tolist()[2] == 0      # an expert with no token
    for a, b in zip(got[:3], want[:3]):                 # permuted tokens, counts, probabilities
        assert torch.equal(a, b.to(a.device))
    for a, b in zip(got[3:], want[3:]):                 # combined output, hidden and prob gradients
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    again = _dispatch_and_combine(new, hidden, routing, probs)
    assert all(torch.equal(a, b) for a, b in zip(again, got))


def test_other_configurations_run_megatrons_method(cpu_world):
    ref, new = _pair(tiny_config(moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs",
                                 moe_pad_expert_input_to_capacity=False))
    assert not new.fixed_fanout
    hidden, routing, probs = _routing(9, 8, 2, seed=3)
    routing[4] = False                    # a dropped token: not top-k pairs per token
    routing[4, 0] = True
    for a, b in zip(_dispatch_and_combine(new, hidden, routing, probs), _dispatch_and_combine(ref, hidden, routing, probs)):
        assert torch.equal(a, b)


def test_refuses_a_routing_map_without_topk_per_token(cpu_world):
    _, new = _pair(tiny_config())
    hidden, routing, probs = _routing(9, 8, 2, seed=4)
    routing[3] = False
    with pytest.raises(ValueError, match="tokens x topk"):
        _dispatch_and_combine(new, hidden, routing, probs)


def test_hybrid_model_moe_layers_dispatch_without_sync(cpu_world):
    from megatron_harts.models.model import build_hybrid_model
    model = build_hybrid_model(tiny_config(), VOCAB)
    moe = [m for m in model.modules() if hasattr(m, "token_dispatcher")]
    assert moe and all(isinstance(m.token_dispatcher, SyncFreeAllGatherDispatcher) and m.token_dispatcher.fixed_fanout
                       for m in moe)
