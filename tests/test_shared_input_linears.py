"""models.common.shared_input_linears: the linears reading one input as one GEMM each way, held to the
linears run one by one (values, the input's gradient, every weight's gradient), with and without
megatron-core's gradient-accumulation fusion."""
import pytest
import torch

import megatron_harts.patches as patches
from megatron_harts.models.common import rows_linear, shared_input_linears


def _config(fusion: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True,
                             params_dtype=torch.float64, gradient_accumulation_fusion=fusion)


def _linears(cfg, sizes, seed):
    from megatron.core.tensor_parallel import ColumnParallelLinear
    torch.manual_seed(seed)
    return [ColumnParallelLinear(7, n, config=cfg, init_method=torch.nn.init.normal_, bias=False,
                                 gather_output=False, skip_bias_add=True, disable_grad_reduce=True) for n in sizes]


def test_values_and_gradients_match_the_linears_one_by_one():
    from megatron_cpu import megatron_cpu
    g = torch.Generator().manual_seed(0)
    with megatron_cpu():
        lins = _linears(_config(False), (5, 3, 1), seed=1)
        plain = torch.randn(2, 7, generator=g, dtype=torch.float64, requires_grad=True)   # a plain weight
        x = torch.randn(11, 7, generator=g, dtype=torch.float64, requires_grad=True)
        dys = [torch.randn(11, n, generator=g, dtype=torch.float64) for n in (5, 3, 1, 2)]
        want = [rows_linear(lin, x) for lin in lins] + [x @ plain.t()]
        sum((y * dy).sum() for y, dy in zip(want, dys)).backward()
        grads = [x.grad.clone()] + [lin.weight.grad.clone() for lin in lins] + [plain.grad.clone()]
        for t in [x, plain] + [lin.weight for lin in lins]:
            t.grad = None
        got = shared_input_linears(x, lins + [plain])
        assert [tuple(y.shape) for y in got] == [(11, 5), (11, 3), (11, 1), (11, 2)]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        sum((y * dy).sum() for y, dy in zip(got, dys)).backward()
        for a, b in zip([x.grad] + [lin.weight.grad for lin in lins] + [plain.grad], grads):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_frozen_parts_and_input_get_no_gradient():
    from megatron_cpu import megatron_cpu
    with megatron_cpu():
        lins = _linears(_config(False), (4, 2), seed=2)
        lins[1].weight.requires_grad_(False)
        x = torch.randn(6, 7, dtype=torch.float64)
        a, b = shared_input_linears(x, lins)
        (a.sum() + b.sum()).backward()
        assert lins[0].weight.grad is not None and lins[1].weight.grad is None


def test_gradient_accumulation_fusion_adds_into_main_grad():
    """Under the fusion each megatron linear's weight gradient lands in its main_grad inside the GEMM and a
    placeholder goes to autograd (grad_added_to_main_grad), as megatron-core's linears do; a plain weight
    gets its gradient as usual."""
    from megatron_cpu import megatron_cpu
    from megatron_harts.patches import wgrad_accumulation as wa
    patches.undo()
    if not wa.needed():
        pytest.skip("Apex's fused_weight_gradient_mlp_cuda is installed: nothing to patch")
    g = torch.Generator().manual_seed(3)
    try:
        with megatron_cpu():
            patches.apply()
            lins = _linears(_config(True), (3, 2), seed=4)
            for lin in lins:
                lin.weight.main_grad = torch.ones(lin.weight.shape, dtype=torch.float32)   # fp32, as megatron DDP keeps it
                lin.weight.grad_added_to_main_grad = False
            plain = torch.randn(4, 7, generator=g, dtype=torch.float64, requires_grad=True)
            x = torch.randn(9, 7, generator=g, dtype=torch.float64, requires_grad=True)
            dys = [torch.randn(9, n, generator=g, dtype=torch.float64) for n in (3, 2, 4)]
            ys = shared_input_linears(x, lins + [plain])
            sum((y * dy).sum() for y, dy in zip(ys, dys)).backward()
            for lin, dy in zip(lins, dys):
                torch.testing.assert_close(lin.weight.main_grad.double(), 1 + dy.t() @ x.detach(), rtol=1e-5, atol=1e-5)
                assert lin.weight.grad_added_to_main_grad
            torch.testing.assert_close(plain.grad, dys[2].t() @ x.detach())
            want_dx = sum(dy @ w.detach() for dy, w in zip(dys, [lin.weight for lin in lins] + [plain]))
            torch.testing.assert_close(x.grad, want_dx)
    finally:
        patches.undo()
