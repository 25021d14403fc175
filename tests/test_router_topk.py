"""Kimi-Linear's sigmoid top-k routing (megatron_harts/ops/router_topk.py): the fused Triton kernels
against the plain torch reference, forward (routing map and probabilities) and backward.

On a GPU, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1`` set before Python starts);
elsewhere the kernel tests skip."""
import os

import pytest
import torch

from megatron_harts.ops import router_topk as rt

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
kernels = pytest.mark.skipif(rt.triton is None or not (torch.cuda.is_available()
                                                       or os.environ.get("TRITON_INTERPRET") == "1"),
                             reason="needs Triton and a GPU (or TRITON_INTERPRET=1)")


@kernels
@pytest.mark.parametrize("N,E,K,groups,group_topk,normalize,scale", [
    (37, 32, 8, None, None, True, 2.5),          # the presets: 32 experts top-8, no groups
    (50, 64, 6, 8, 4, True, None),               # DeepSeek-V3-style group-limited routing
    (20, 24, 3, None, None, False, 2.0),         # experts not a power of two, no renormalization
    (33, 16, 4, 4, 2, False, 1.5),
    (9, 256, 8, 8, 4, True, 2.446),              # Kimi-Linear-48B's 256 experts
])
def test_fused_equals_reference(N, E, K, groups, group_topk, normalize, scale):
    gen = torch.Generator().manual_seed(N * E)
    x = torch.randn(N, E, generator=gen).to(DEVICE).requires_grad_()
    kw = dict(num_groups=groups, group_topk=group_topk, scaling_factor=scale, normalize=normalize,
              expert_bias=(0.1 * torch.randn(E, generator=gen)).to(DEVICE))
    dp = torch.randn(N, E, generator=gen).to(DEVICE)
    p_ref, m_ref = rt.sigmoid_topk_reference(x, K, **kw)
    g_ref, = torch.autograd.grad((p_ref * dp).sum(), x)
    p, m = rt.sigmoid_topk(x, K, **kw)
    g, = torch.autograd.grad((p * dp).sum(), x)
    assert m.dtype == torch.bool and torch.equal(m, m_ref) and int(m.sum()) == N * K
    torch.testing.assert_close(p, p_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-7)


@kernels
def test_bf16_routes_as_the_reference():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=gen).to(DEVICE, torch.bfloat16)
    p_ref, m_ref = rt.sigmoid_topk_reference(x, 8, scaling_factor=2.5)
    p, m = rt.sigmoid_topk(x, 8, scaling_factor=2.5)
    assert p.dtype == torch.bfloat16
    # bf16 scores tie often: compare rows whose 8th and 9th rounded scores differ (rounding keeps order)
    top = torch.sigmoid(x).topk(9, dim=-1)[0]
    clear = top[:, 7] > top[:, 8]
    assert int(clear.sum()) > 32 and torch.equal(m[clear], m_ref[clear])
    torch.testing.assert_close(p[clear].float(), p_ref[clear].float(), rtol=2 ** -7, atol=2 ** -8)


def test_bad_shapes_are_refused():
    if rt.triton is None:
        with pytest.raises(RuntimeError, match="needs Triton"):
            rt.sigmoid_topk(torch.zeros(2, 8), 2)
        return
    with pytest.raises(ValueError, match="top-9"):
        rt.sigmoid_topk(torch.zeros(2, 8), 9)
    with pytest.raises(ValueError, match="groups"):
        rt.sigmoid_topk(torch.zeros(2, 8), 2, num_groups=3, group_topk=1)
