"""megatron-core runtime patches: version guard, apply/undo, upstream-change tripwire."""
import pytest
import torch

import megatron_harts.patches as patches
from megatron_harts.patches import checkpoint_without_output, router_gating


def test_every_patch_pins_its_upstream_source():
    """Fails loudly when megatron-core changes a patched function: review the patch, then re-pin."""
    for p in patches.PATCHES:
        assert p.TARGET_SHA256, f"{p.NAME}: no pinned source hash"
        got = patches.source_sha256(p.target())
        assert got == p.TARGET_SHA256, (
            f"{p.NAME}: upstream {p.TARGET} changed (sha256 {got}); the patch was written against "
            f"{p.TARGET_SHA256}. Re-check whether the patch is still needed and correct.")


def test_nothing_is_patched_at_import_and_apply_undo_round_trip():
    from megatron.core.transformer.moe import moe_utils
    patches.undo()
    assert not router_gating.is_applied()
    if not router_gating.needed():
        pytest.skip("Transformer Engine installed: te_general_gemm exists, nothing to patch")
    assert not hasattr(moe_utils, "te_general_gemm")
    # the upstream bug the patch exists for
    w = torch.randn(4, 3, dtype=torch.float32)
    x = torch.randn(5, 3, dtype=torch.float32)
    with pytest.raises(NameError, match="te_general_gemm"):
        moe_utils.router_gating_linear(x, w, None, torch.float32)
    assert router_gating.NAME in patches.apply()
    assert router_gating.NAME in patches.apply()              # idempotent
    out = moe_utils.router_gating_linear(x, w, None, torch.float32)
    torch.testing.assert_close(out, x @ w.t())
    patches.undo()
    patches.undo()
    assert not hasattr(moe_utils, "te_general_gemm")


def test_version_guard(monkeypatch):
    monkeypatch.setattr(patches, "megatron_version", lambda: "0.17.0")
    with pytest.raises(RuntimeError, match="0.16"):
        patches.apply()
    assert not router_gating.is_applied()


def test_checkpoint_without_output_default_is_not_fp8():
    from megatron.core.tensor_parallel.random import CheckpointWithoutOutput
    patches.undo()
    if not checkpoint_without_output.needed():
        pytest.skip("Transformer Engine installed: FP8GlobalStateManager exists")
    assert CheckpointWithoutOutput().fp8 is True          # the upstream bug: fp8=False counts as fp8
    patches.apply()
    assert CheckpointWithoutOutput().fp8 is False
    assert CheckpointWithoutOutput(fp8=None).fp8 is False
    assert CheckpointWithoutOutput(fp8="hybrid").fp8 is True
    from megatron_cpu import megatron_cpu
    with megatron_cpu():
        x = torch.randn(3, requires_grad=True)
        y = CheckpointWithoutOutput().checkpoint(torch.sin, x)     # raised NameError before the patch
        torch.testing.assert_close(y, torch.sin(x))
    patches.undo()
    assert CheckpointWithoutOutput().fp8 is True


def test_grad_norm_on_device_equals_upstream_norm():
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron_harts.patches import grad_norm_on_device
    patches.undo()
    if not grad_norm_on_device.needed():
        pytest.skip("Apex or Transformer Engine installed: clip_grads uses its fused L2 norm")
    assert clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm
    g = torch.Generator().manual_seed(0)
    from megatron_cpu import megatron_cpu
    for dtype in (torch.float32, torch.float64):
        grads = [torch.randn(*shape, generator=g, dtype=dtype) * 1e-3 for shape in ((7,), (3, 5), (1,), (64, 2))]
        grads.append(torch.zeros(4, dtype=dtype))
        with megatron_cpu():
            want, none = utils.local_multi_tensor_l2_norm(2048 * 32, None, [grads], False)
        got, none2 = grad_norm_on_device.device_multi_tensor_l2_norm(2048 * 32, None, [grads], False)
        assert none is None and none2 is None
        assert got.dtype == torch.float32 and got.shape == (1,) and got.device == grads[0].device
        exact = torch.linalg.vector_norm(torch.cat([x.double().reshape(-1) for x in grads]))
        torch.testing.assert_close(got.double(), exact.reshape(1), rtol=1e-6, atol=0)
        torch.testing.assert_close(got, want.to(got.device), rtol=1e-6, atol=0)
    patches.apply()
    assert clip_grads.l2_norm_impl is grad_norm_on_device.device_multi_tensor_l2_norm
    patches.undo()
    assert clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm


def test_foreach_param_copy_equals_upstream_copy():
    """The bf16 optimizer's main -> model parameter copy: the same bits as upstream's loop (fp32 into
    bf16 and into fp32), one multi-tensor copy once applied, upstream's path with an overflow buffer."""
    from megatron.core.optimizer import optimizer as opt
    from megatron_harts.patches import foreach_param_copy
    patches.undo()
    upstream = opt._multi_tensor_copy_this_to_that
    g = torch.Generator().manual_seed(0)
    this = [torch.randn(*s, generator=g) for s in ((7,), (3, 5), (1,), (64, 2))]
    for dtype in (torch.bfloat16, torch.float32):
        want = [torch.zeros(t.shape, dtype=dtype) for t in this]
        got = [torch.zeros(t.shape, dtype=dtype) for t in this]
        upstream(this, want)
        foreach_param_copy.foreach_copy_this_to_that(this, got)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert patches.apply() and foreach_param_copy.is_applied()
    assert opt._multi_tensor_copy_this_to_that is foreach_param_copy.foreach_copy_this_to_that
    calls = []
    monkey = foreach_param_copy._state["original"]
    foreach_param_copy._state["original"] = lambda *a: calls.append(a)
    try:
        foreach_param_copy.foreach_copy_this_to_that(this, this, torch.zeros(1, dtype=torch.int))
    finally:
        foreach_param_copy._state["original"] = monkey
    assert len(calls) == 1                     # fp16's overflow-buffer path stays upstream's
    with pytest.raises(ValueError, match="4 tensors into 3"):
        foreach_param_copy.foreach_copy_this_to_that(this, this[:3])
    patches.undo()
    assert opt._multi_tensor_copy_this_to_that is upstream


def test_foreach_multi_tensor_scale_equals_upstream_scale():
    """Clipping's scale without Apex/TE: the same bits as upstream's loop, in place and into other
    tensors; installed where upstream's fallback was, and undone."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron_harts.patches import foreach_multi_tensor_scale as fms
    patches.undo()
    if not fms.needed():
        pytest.skip("Apex or Transformer Engine installed: clip_grads uses its fused scale")
    g = torch.Generator().manual_seed(1)
    src = [torch.randn(*s, generator=g) for s in ((7,), (3, 5), (1,), (64, 2))]
    for scale in (0.37, 1.0):
        want, got = [t.clone() for t in src], [t.clone() for t in src]
        utils.local_multi_tensor_scale(2048 * 32, None, [want, want], scale)
        fms.foreach_multi_tensor_scale(2048 * 32, None, [got, got], scale)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        want = [torch.zeros(t.shape, dtype=torch.bfloat16) for t in src]
        got = [torch.zeros(t.shape, dtype=torch.bfloat16) for t in src]
        utils.local_multi_tensor_scale(2048 * 32, None, [src, want], scale)
        fms.foreach_multi_tensor_scale(2048 * 32, None, [src, got], scale)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    patches.apply()
    assert clip_grads.multi_tensor_scale_impl is fms.foreach_multi_tensor_scale
    patches.undo()
    assert clip_grads.multi_tensor_scale_impl is utils.local_multi_tensor_scale


def test_wgrad_accumulation_is_the_unfused_gradient_in_fp32():
    """megatron's gradient-accumulation fusion through torch: refused by megatron without the patch,
    and with it each linear's weight gradient lands in ``main_grad`` (no ``.grad`` for DDP to add)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, layers
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_cpu import megatron_cpu
    from megatron_harts.patches import wgrad_accumulation as wa
    patches.undo()
    if not wa.needed():
        pytest.skip("Apex's fused_weight_gradient_mlp_cuda is installed: nothing to patch")
    assert not layers._grad_accum_fusion_available and not hasattr(layers, "fused_weight_gradient_mlp_cuda")
    g = torch.Generator().manual_seed(0)
    # the accumulation itself: main_grad += grad_output^T @ input in main_grad's dtype
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        x, dy = torch.randn(9, 5, generator=g).to(dtype), torch.randn(9, 3, generator=g).to(dtype)
        main = torch.randn(3, 5, generator=g, dtype=torch.float64).float()
        want = main.double() + dy.double().t() @ x.double()
        wa.accumulate(main, dy, x)
        torch.testing.assert_close(main.double(), want, rtol=1e-6, atol=1e-6)
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True,
                            gradient_accumulation_fusion=True)
    with megatron_cpu():
        with pytest.raises(RuntimeError, match="fused_weight_gradient_mlp_cuda"):
            ColumnParallelLinear(5, 3, config=cfg, init_method=torch.nn.init.zeros_, bias=False)
        assert wa.NAME in patches.apply()
        assert layers.fused_weight_gradient_mlp_cuda is wa.TorchWgradAccumulation
        lin = ColumnParallelLinear(5, 3, config=cfg, init_method=torch.nn.init.normal_, bias=False,
                                   gather_output=True)
        w = lin.weight
        w.main_grad = torch.ones(3, 5)
        w.grad_added_to_main_grad = False
        x = torch.randn(4, 2, 5, generator=g, requires_grad=True)
        dy = torch.randn(4, 2, 3, generator=g)
        y, _ = lin(x)
        y.backward(dy)
        torch.testing.assert_close(y, x @ w.t())
        torch.testing.assert_close(w.main_grad, 1 + dy.reshape(-1, 3).t() @ x.reshape(-1, 5))
        torch.testing.assert_close(x.grad, dy @ w.detach())
        assert w.grad_added_to_main_grad
    patches.undo()
    assert not layers._grad_accum_fusion_available and not hasattr(layers, "fused_weight_gradient_mlp_cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the bf16 x bf16 -> fp32 addmm)")
def test_wgrad_accumulation_cuda_bf16_into_fp32():
    from megatron_harts.patches import wgrad_accumulation as wa
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 64, device="cuda", generator=g).bfloat16()
    dy = torch.randn(300, 48, device="cuda", generator=g).bfloat16()
    main = torch.randn(48, 64, device="cuda", generator=g)
    want = main.double() + dy.double().t() @ x.double()
    ptr = main.data_ptr()
    wa.accumulate(main, dy, x)
    assert main.dtype == torch.float32 and main.data_ptr() == ptr
    torch.testing.assert_close(main.double(), want, rtol=1e-5, atol=1e-4)
