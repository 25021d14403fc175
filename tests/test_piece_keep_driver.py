"""``--tree-piece-keep`` through the training driver (CPU, fp64, world of one, MoE aux loss on): with a
16-row budget under trajectories of up to 41 tokens, read pieces that keep their graphs (``all``, and
``auto`` under a large ``--tree-piece-memory``) and read pieces recomputed (``none``) give the same
loss, gradient norm, gradients and MoE load in a step; the logged step reports the extra forward rows (0 when
every read piece is kept), and the exports-only forwards leave the output layer and the log-probs out.  Bad values are one error line naming the flag."""
import pytest
import torch

from test_memory_budget_driver import _driver_run


def _budget16(*extra):
    return ["--tree-microbatch-tokens", "16", *extra]


def test_piece_keep_through_the_driver(monkeypatch):
    from test_training_driver import rollouts

    import megatron_harts.models.model as model_module
    from megatron_harts.tree_data import build_forest
    forest = build_forest(rollouts(0))
    calls = []
    real_logprobs = model_module.multi_target_logprobs

    def counted(*args, **kwargs):
        calls.append(1)
        return real_logprobs(*args, **kwargs)
    monkeypatch.setattr(model_module, "multi_target_logprobs", counted)
    kept, g_kept, _ = _driver_run(_budget16("--tree-piece-keep", "all"), forest, steps=1)
    kept_calls = len(calls)
    recomputed, g_rec, _ = _driver_run(_budget16("--tree-piece-keep", "none"), forest, steps=1)
    # a read piece's exports-only forward stops before the output layer: the log-prob op runs once per
    # microbatch either way
    assert len(calls) - kept_calls == kept_calls > 0
    auto, g_auto, t = _driver_run(_budget16("--tree-piece-memory", "1000"), forest, steps=1)
    m = kept[0]
    assert m["read_pieces"] > 0 and m["kept_pieces"] == m["read_pieces"] and m["piece_extra_forward_rows"] == 0
    r = recomputed[0]
    assert r["kept_pieces"] == 0 and 0 < r["piece_extra_forward_rows"] < r["piece_rows"] == m["piece_rows"]
    assert auto[0]["kept_pieces"] == m["read_pieces"] and auto[0]["piece_memory_gib"] == 1000
    assert t.settings.piece_keep == "auto" and kept[0]["piece_memory_gib"] is None
    for run, grads in ((recomputed, g_rec), (auto, g_auto)):
        for a, b in zip(run, kept):
            assert abs(a["loss"] - b["loss"]) <= 1e-10 * abs(b["loss"])
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-10 * b["grad_norm"]
            assert a["moe_load_max_over_mean"] == b["moe_load_max_over_mean"]
        for n, g in g_kept.items():
            assert g.dtype == torch.float64
            assert float((grads[n] - g).abs().max()) <= 1e-10 * max(float(g.abs().max()), 1e-30), n


@pytest.mark.parametrize("extra,needle", [
    (["--tree-piece-memory", "0"], "positive"),
    (["--tree-piece-memory", "2", "--tree-piece-keep", "none"], "only under --tree-piece-keep auto"),
])
def test_piece_memory_refused(extra, needle):
    from test_recompute_producers import argv

    from megatron_harts.training.arguments import ArgumentsError, parse_args
    parse_args(argv("--tree-piece-memory", "2"), require_data=False)
    with pytest.raises(ArgumentsError) as e:
        parse_args(argv(*extra), require_data=False)
    msg = str(e.value)
    assert "--tree-piece-memory" in msg and needle in msg and "\n" not in msg
