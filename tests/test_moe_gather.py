"""The MoE gathers that sum (megatron_harts/ops/moe_gather.py): the fused Triton kernel against the plain
torch reference, and the dispatcher's two directions with and without it.

The kernel tests run on a GPU, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1`` set
before Python starts); elsewhere they skip.  The reference's own contract runs everywhere."""
import os

import pytest
import torch

from megatron_harts.ops import moe_gather as mg

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
kernels = pytest.mark.skipif(mg.triton is None or not (torch.cuda.is_available()
                                                       or os.environ.get("TRITON_INTERPRET") == "1"),
                             reason="needs Triton and a GPU (or TRITON_INTERPRET=1)")


def _case(tokens, group, hidden, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens * group, hidden, generator=gen).to(DEVICE, dtype)
    rows = torch.randperm(tokens * group, generator=gen).to(DEVICE)
    return x, rows


def test_reference_sums_each_group_of_gathered_rows():
    x = torch.arange(12.0).view(6, 2)
    rows = torch.tensor([5, 0, 1, 1, 4, 2])
    out = mg.gather_sum_reference(x, rows, 2)
    assert torch.equal(out, torch.stack([x[5] + x[0], x[1] + x[1], x[4] + x[2]]))
    assert torch.equal(mg.gather_sum_reference(x, rows, 1), x[rows])


@kernels
@pytest.mark.parametrize("tokens,group,hidden", [(37, 8, 96), (300, 8, 2304), (5, 3, 17), (1, 2, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_equals_reference(tokens, group, hidden, dtype):
    x, rows = _case(tokens, group, hidden, dtype, tokens * hidden)
    ref = mg.gather_sum_reference(x, rows, group)
    out = mg.gather_sum(x, rows, group)
    assert out.dtype == dtype and out.shape == ref.shape
    exact = mg.gather_sum_reference(x.double(), rows, group)
    # fp32 accumulation, rounded once: as close to the fp64 sum as torch's own reduction
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(out.double(), exact, **tol)
    torch.testing.assert_close(out, ref, **tol)


@kernels
def test_fused_refuses_a_ragged_group():
    x, rows = _case(4, 2, 8, torch.float32, 0)
    with pytest.raises(ValueError, match="multiple of the group 3"):
        mg.gather_sum(x, rows[:7], 3)


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=kernels)])
def test_dispatch_and_combine_directions(fused):
    """_GatherRows as the dispatcher runs it: dispatch (group 1, backward sums top-k) then combine (sums top-k,
    backward a gather); values and gradients equal the scatter-add forms megatron's dispatcher uses."""
    from megatron_harts.models.dispatcher import _GatherRows
    tokens, topk, hidden = 19, 4, 32
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64 if not fused else torch.float32).to(DEVICE)
    x.requires_grad_()
    sorted_tokens = torch.arange(tokens).repeat(topk)[torch.randperm(tokens * topk, generator=gen)].to(DEVICE)
    token_rows = sorted_tokens.argsort(stable=True)
    permuted = _GatherRows.apply(x, sorted_tokens, token_rows, 1, topk, fused)
    w = torch.randn(tokens * topk, 1, generator=gen, dtype=x.dtype).to(DEVICE)
    combined = _GatherRows.apply(permuted * w, token_rows, sorted_tokens, topk, 1, fused)
    g = torch.randn(tokens, hidden, generator=gen, dtype=x.dtype).to(DEVICE)
    gx, = torch.autograd.grad((combined * g).sum(), x)
    # megatron's forms: index_select forward, scatter-add (index_add) for the sums
    want = torch.zeros_like(x).index_add(0, sorted_tokens, x.detach()[sorted_tokens] * w)
    want_g = torch.zeros_like(x).index_add(0, sorted_tokens, g[sorted_tokens] * w)
    tol = dict(rtol=1e-5, atol=1e-5) if fused else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(combined, want, **tol)
    torch.testing.assert_close(gx, want_g, **tol)
