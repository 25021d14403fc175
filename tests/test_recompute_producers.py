"""``--tree-recompute-producers`` through the driver (CPU, fp64, world of one): a windowed step whose
producers keep only their exports until their windows close gives the plain windowed step's loss,
gradients, expert-bias update and statistics (KDA calls, replay, MoE load), MoE aux loss on; the
flag is refused where it has no meaning."""
import pytest

from tool_runner import load_tool

from megatron_harts.training.arguments import ArgumentsError, parse_args
from megatron_harts.tree_data import build_forest

from test_training_driver import MODEL, rollouts


@pytest.fixture(scope="module")
def sf():
    return load_tool("step_fidelity", "benchmarks")


def argv(*extra):
    flags = list(MODEL)
    flags[flags.index("--moe-aux-loss-coeff") + 1] = "0.01"
    return flags + ["--global-batch-size", "16", "--train-iters", "10", "--seq-length", "48", "--lr", "3e-3",
                    "--seed", "7", "--log-interval", "1000", "--rl-objective", "sft", "--tree-sharing", "windows",
                    "--tree-planner", "l1l2", "--tree-microbatch-tokens", "48", *extra]


RECOMPUTE = ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")


@pytest.mark.parametrize("extra", [(), RECOMPUTE], ids=["plain", "activation-recompute"])
def test_recomputed_producers_same_step(sf, extra):
    forest = build_forest(rollouts(0))
    plain = sf.run_mode(argv(*extra), forest, 2)
    rec = sf.run_mode(argv("--tree-recompute-producers", *extra), forest, 2)
    assert plain["windows"] > 0
    for k in ("loss_per_step", "grad_norm_per_step", "microbatches", "kda_calls", "replay_tokens", "windows",
              "moe_load_max_over_mean"):
        assert rec[k] == plain[k], k
    assert all(float((rec["grads"][n] - g).abs().max()) == 0.0 for n, g in plain["grads"].items())
    assert all(float((a - b).abs().max()) == 0.0 for a, b in zip(rec["bias_update"], plain["bias_update"]))


@pytest.mark.parametrize("extra,needle", [
    (["--tree-sharing", "within", "--tree-planner", "l1"], "needs --tree-sharing windows"),
    (["--pipeline-model-parallel-size", "2"], "pipeline"),
])
def test_recompute_producers_refused(extra, needle):
    parse_args(argv("--tree-recompute-producers"), require_data=False)
    with pytest.raises(ArgumentsError) as e:
        parse_args(argv("--tree-recompute-producers") + extra, require_data=False)
    assert "--tree-recompute-producers" in str(e.value) and needle in str(e.value)


def test_injected_export_gradients_keep_no_exports():
    """A recomputed producer's record_export keeps nothing; the recording layer's output carries each
    export's gradient exactly (attach_injected), and passes the output's own gradient through."""
    import torch

    from megatron_harts.layout import build_layout
    from megatron_harts.models.packed import TreePackedSeqParams, WindowExports
    psp = TreePackedSeqParams.for_tree(build_layout(build_forest(rollouts(0))))
    psp.exports = WindowExports(None, {})
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    k, states, out = x * 2.0, x[:2].exp(), x.sin()
    gk, gs, go = (torch.randn(5, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64),
                  torch.randn(5, 3, dtype=torch.float64))
    want = torch.autograd.grad([k, states, out], [x], [gk, gs, go], retain_graph=True)[0]
    psp.inject_grads = {3: {"k": gk, "states": gs}}
    psp.record_export(3, {"k": k, "states": states, "unread": x + 1.0})
    assert psp.exports.layers == {}
    assert psp.attach_injected(4, out) is out                     # a layer that recorded nothing
    carried = psp.attach_injected(3, out)
    assert torch.equal(carried, out)
    got = torch.autograd.grad(carried, [x], go)[0]
    assert torch.equal(got, want)


def test_recomputed_producer_runs_without_the_consumers_export_views(sf, monkeypatch):
    """At window close only the export gradients stay alive: while the producer's forward runs again,
    the consumers' leaves (detached views of the preview's exports, which the last consumer's params
    still reference) are freed."""
    import gc
    import weakref

    from megatron_harts.models.packed import TreePackedSeqParams, WindowExports
    views, checked = [], []
    gradients, record = WindowExports.gradients, TreePackedSeqParams.record_export

    def watched_gradients(self):
        views.extend(weakref.ref(t) for d in self.layers.values() for t in d.values())
        return gradients(self)

    def checked_record(self, layer_number, tensors):
        if self.inject_grads is not None:
            gc.collect()
            checked.append(sum(r() is not None for r in views))
        return record(self, layer_number, tensors)
    monkeypatch.setattr(WindowExports, "gradients", watched_gradients)
    monkeypatch.setattr(TreePackedSeqParams, "record_export", checked_record)
    out = sf.run_mode(argv("--tree-recompute-producers"), build_forest(rollouts(0)), 1)
    assert out["windows"] > 0 and views and checked and set(checked) == {0}
