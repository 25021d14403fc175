"""rms_normalize (megatron_harts/models/norm.py): the fused CUDA path against the plain-torch
reference, forward and backward; elsewhere (CPU, fp64) it is the reference bitwise."""
import pytest
import torch

from megatron_harts.models.norm import rms_normalize, rms_normalize_reference


def _inputs(dtype, device, rows=37, width=96, seed=0):
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(rows, 1, generator=gen, dtype=torch.float64))     # rows of very different norms
    x = (scale * torch.randn(rows, width, generator=gen, dtype=torch.float64)).to(device, dtype)
    g = torch.randn(rows, width, generator=gen, dtype=torch.float64).to(device, dtype)
    return x, g


def _forward_backward(fn, x, g, eps):
    x = x.clone().requires_grad_()
    y = fn(x, eps)
    y.backward(g)
    return y.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
def test_cpu_is_the_reference_bitwise(dtype):
    x, g = _inputs(dtype, "cpu")
    for a, b in zip(_forward_backward(rms_normalize, x, g, 1e-6), _forward_backward(rms_normalize_reference, x, g, 1e-6)):
        assert a.dtype == dtype and torch.equal(a, b)


def test_reference_normalizes_rows():
    x, _ = _inputs(torch.float64, "cpu")
    y = rms_normalize_reference(x, 0.0)
    assert torch.allclose(y.pow(2).mean(-1), torch.ones(x.shape[0], dtype=torch.float64), rtol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_fused_cuda_equals_reference(dtype, tol, eps):
    x, g = _inputs(dtype, "cuda", rows=4099, width=1024)
    got = _forward_backward(rms_normalize, x, g, eps)
    want = _forward_backward(rms_normalize_reference, x, g, eps)
    oracle = _forward_backward(rms_normalize_reference, x.double(), g.double(), eps)
    for a, b, o in zip(got, want, oracle):
        assert a.dtype == dtype and a.shape == b.shape
        # elementwise: the fused result is as close to the fp64 oracle as the reference is (one
        # unit of the output dtype), relative to each row's scale
        row = o.abs().amax(-1, keepdim=True)
        err_fused = ((a.double() - o).abs() / row).max()
        err_ref = ((b.double() - o).abs() / row).max()
        assert err_fused <= max(2 * err_ref, tol), (float(err_fused), float(err_ref))
