"""megatron-core runtime patches: version guard, apply/undo, upstream-change tripwire."""
import pytest
import torch

import megatron_harts.patches as patches
from megatron_harts.patches import router_gating


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
    assert patches.apply() == [router_gating.NAME]
    assert patches.apply() == [router_gating.NAME]            # idempotent
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
