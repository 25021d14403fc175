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
