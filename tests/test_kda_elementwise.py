"""The KDA layer's fused elementwise kernels (megatron_harts/ops/kda_elementwise.py) against their plain
torch references, forward and backward, and where the model uses which.

The kernel tests run on a GPU, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1`` set
before Python starts, Triton installed); elsewhere they skip.  Each fused result must be as close to
the fp64 reference as the eager chain in the same dtype is (two units of the dtype's rounding at
most, relative to each row's scale)."""
import os

import pytest
import torch

from megatron_harts.ops import kda_elementwise as ke

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
kernels = pytest.mark.skipif(not ke.triton_available() or not (torch.cuda.is_available() or _INTERPRET),
                             reason="needs Triton and a GPU (or TRITON_INTERPRET=1)")
DTYPES = pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2 ** -7)],
                                 ids=["fp32", "bf16"])


def _randn(gen, *shape, scale=1.0):
    return scale * torch.randn(*shape, generator=gen, dtype=torch.float64)


def _run(fn, inputs, grad_out, dtype):
    """fn's output and the input gradients for ``sum(out * grad_out)``, inputs cast to ``dtype`` on DEVICE."""
    xs = [t.to(DEVICE, dtype).requires_grad_() for t in inputs]
    y = fn(*xs)
    y.backward(grad_out.to(DEVICE, dtype).view(y.shape))
    return [y.detach()] + [x.grad for x in xs]


def _compare(fn, reference, inputs, grad_out, dtype, tol):
    """fn and the eager reference in ``dtype`` against the reference in fp64 on the same (rounded) inputs."""
    rounded = [t.to(dtype).double() for t in inputs]
    _check(_run(fn, inputs, grad_out, dtype), _run(reference, inputs, grad_out, dtype),
           _run(reference, rounded, grad_out.to(dtype).double(), torch.float64), tol)


def _check(fused, eager, oracle, tol):
    for i, (a, b, o) in enumerate(zip(fused, eager, oracle)):
        assert a.shape == o.shape and a.dtype == b.dtype
        o = o.cpu().reshape(o.shape[0], -1)
        scale = o.abs().amax(-1, keepdim=True).clamp_min(1e-30) if o.dim() > 1 and o.shape[0] > 1 else o.abs().max()
        err_fused = float(((a.cpu().double().reshape(o.shape) - o).abs() / scale).max())
        err_eager = float(((b.cpu().double().reshape(o.shape) - o).abs() / scale).max())
        assert err_fused <= max(2 * err_eager, tol), (i, err_fused, err_eager)


@kernels
@DTYPES
@pytest.mark.parametrize("rows,heads,dim", [(37, 3, 16), (130, 2, 64)])
def test_kda_gate(dtype, tol, rows, heads, dim):
    gen = torch.Generator().manual_seed(rows)
    f = _randn(gen, rows, heads * dim, scale=4.0)
    f[0, :3] = torch.tensor([25.0, 20.5, -30.0])       # both sides of softplus's threshold
    inputs = [f, _randn(gen, heads * dim), _randn(gen, 1, 1, heads, 1)]
    g = _randn(gen, rows, heads * dim)

    def fused(f, b, a):
        return ke.kda_gate(f, b, a, heads)

    def eager(f, b, a):
        return ke.kda_gate_reference(f, b, a, heads)
    _compare(fused, eager, inputs, g, dtype, tol)


@kernels
@DTYPES
@pytest.mark.parametrize("shape", [(37, 3, 16), (65, 2, 128), (9, 1, 24)])
def test_silu_l2norm(dtype, tol, shape):
    gen = torch.Generator().manual_seed(shape[0])
    x = _randn(gen, *shape) * torch.exp(_randn(gen, shape[0], 1, 1))      # rows of very different norms
    g = _randn(gen, *shape)
    _compare(ke.silu_l2norm, ke.silu_l2norm_reference, [x], g, dtype, tol)


@kernels
@DTYPES
@pytest.mark.parametrize("shape,eps", [((37, 3, 16), 1e-6), ((70, 2, 128), 1e-5)])
def test_gated_rms_norm(dtype, tol, shape, eps):
    gen = torch.Generator().manual_seed(shape[0])
    o = _randn(gen, *shape) * torch.exp(_randn(gen, shape[0], shape[1], 1))
    inputs = [o, 1.0 + 0.1 * _randn(gen, shape[-1]), _randn(gen, *shape)]
    g = _randn(gen, *shape)

    def fused(o, w, gate):
        return ke.gated_rms_norm(o, w, gate, eps)

    def eager(o, w, gate):
        return ke.gated_rms_norm_reference(o, w, gate, eps)
    _compare(fused, eager, inputs, g, dtype, tol)


def test_references_are_the_eager_layer():
    """The references are the expressions the layer ran before fusion (bitwise, bf16)."""
    import torch.nn.functional as F

    from megatron_harts.models.norm import rms_normalize
    gen = torch.Generator().manual_seed(0)
    H, D = 2, 8
    f, b, a = (t.bfloat16() for t in (_randn(gen, 5, H * D), _randn(gen, H * D), _randn(gen, 1, 1, H, 1)))
    old = -a.view(1, H, 1).exp() * F.softplus((f + b).view(-1, H, D), threshold=20.0)
    assert torch.equal(ke.kda_gate_reference(f, b, a, H), old)
    o, w, gate = (t.bfloat16() for t in (_randn(gen, 5, H, D), _randn(gen, D), _randn(gen, 5, H, D)))
    assert torch.equal(ke.gated_rms_norm_reference(o, w, gate, 1e-6), rms_normalize(o, 1e-6) * w * torch.sigmoid(gate))


def test_where_the_model_fuses():
    """The config asks and the tensors allow: CUDA 16/32-bit floats only, never fp64 or the CPU; the
    driver's --no-tree-fused-kernels reaches the model's config."""
    from megatron_harts.models.common import use_fused_kernels
    from megatron_harts.training.arguments import hybrid_config, parse_args
    from types import SimpleNamespace
    on, off = SimpleNamespace(fused_kernels=True), SimpleNamespace(fused_kernels=False)
    cpu = torch.zeros(2, dtype=torch.float32)
    assert not use_fused_kernels(on, cpu) and not use_fused_kernels(off, cpu)
    if torch.cuda.is_available() and ke.triton_available():
        assert use_fused_kernels(on, cpu.cuda()) and not use_fused_kernels(on, cpu.cuda().double())
        assert not use_fused_kernels(off, cpu.cuda())
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "1",
            "--train-iters", "1", "--lr", "1e-4", "--vocab-size", "64"]
    assert hybrid_config(parse_args(base, require_data=False), device="cpu").fused_kernels is True
    assert hybrid_config(parse_args(base + ["--no-tree-fused-kernels"], require_data=False),
                         device="cpu").fused_kernels is False


def test_fused_kernels_without_triton_say_so_once(monkeypatch):
    """Asked for on a CUDA tensor where Triton is missing: eager chains, and one warning per process."""
    import warnings
    from types import SimpleNamespace

    import megatron_harts.models.common as common
    monkeypatch.setattr(common, "fusable", lambda t: False)
    monkeypatch.setattr(common, "triton_available", lambda: False)
    monkeypatch.setattr(common, "_SAID_NO_TRITON", [])
    cuda_like = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert not common.use_fused_kernels(SimpleNamespace(fused_kernels=True), cuda_like)
        assert not common.use_fused_kernels(SimpleNamespace(fused_kernels=True), cuda_like)
        assert not common.use_fused_kernels(SimpleNamespace(fused_kernels=False), cuda_like)
        assert not common.use_fused_kernels(SimpleNamespace(fused_kernels=True), torch.zeros(1))
    said = [w for w in seen if "Triton is not installed" in str(w.message)]
    assert len(said) == 1 and "--no-tree-fused-kernels" in str(said[0].message)


@pytest.mark.skipif(not (ke.triton_available() and _INTERPRET),
                    reason="needs Triton's interpreter (TRITON_INTERPRET=1)")
def test_model_fused_equals_eager_and_tree_equals_expanded(cpu_world, monkeypatch):
    """A tiny fp32 model on the CPU with the kernels interpreted: fused and eager chains give the same
    log-probs and gradients (to fp32 rounding), and tree mode equals expanded mode with them fused."""
    import megatron_harts.models.common as common
    from megatron_harts.models.model import build_hybrid_model

    from hybrid_tiny import VOCAB, expanded_inputs, randomize_, tiny_config, tiny_forest, tree_inputs
    monkeypatch.setattr(common, "fusable", lambda t: t.dtype == torch.float32)   # the CPU as if it were a GPU
    forest = tiny_forest(0)

    def run(fusion, tree):
        cfg = tiny_config(torch.float32, fused_kernels=fusion)
        model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 0)
        lay, psp = tree_inputs(forest, cfg)
        if tree:
            lp = model(lay.tokens[None], lay.position_ids[None], packed_seq_params=psp, pair_row=lay.pair_row,
                       pair_token=lay.pair_token)[lay.target_pair]
        else:
            ids, pos, epsp, rows, tok, _ = expanded_inputs(lay, forest)
            lp = model(ids, pos, packed_seq_params=epsp, pair_row=rows, pair_token=tok)
        lp.sum().backward()
        return lp.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    eager, fused, fused_expanded = run(False, True), run(True, True), run(True, False)
    for other in (fused, fused_expanded):
        torch.testing.assert_close(other[0], eager[0], rtol=1e-5, atol=1e-5)
        for name, g in eager[1].items():
            torch.testing.assert_close(other[1][name], g, rtol=0, atol=1e-4 * float(g.abs().max()) + 1e-7,
                                       msg=f"gradient of {name}")
