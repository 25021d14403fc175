"""MoE aux-loss and z-loss gradients of a whole driver step (CPU, fp64, world of one).

Megatron's routers enter a microbatch's mean aux loss and z-loss times its token count under
per-token loss scaling (what the driver's config sets); the step weighs them by 1 / its routed
tokens (``training.step.aux_loss_scale``), so the step's aux term is the token-weighted mean of
the microbatches' aux losses:

- a batch and the same batch twice (the copies under other trajectory ids) give the same
  gradients: the mean of identical statistics (the token count of a microbatch does not scale
  its aux gradient), in expanded mode and in tree mode (where the copies share rows, q = 2);
- with the z-loss on, tree mode's gradients are expanded mode's (the tree router's q-weighted
  z-loss is entered the way megatron's is);
- splitting a batch into more microbatches changes the aux gradient only through the
  microbatches' own statistics (small), not by the number of microbatches.
"""
import dataclasses

import pytest
import torch

from tool_runner import load_tool

from megatron_harts.tree_data import build_forest


@pytest.fixture(scope="module")
def sf():
    return load_tool("step_fidelity", "benchmarks")


@pytest.fixture(scope="module")
def forest(sf):
    f = sf.synthesize("tree-step", 1, 512, 512, seed=0, samples_per_task=3)
    assert sum(int(f.expand(t).loss_mask[1:].sum()) for t in f.traj_ids) > 100      # the loss takes part too
    assert f.stats()["compression"] > 1.5                                             # and shared rows
    return f


@pytest.fixture(scope="module")
def twice(forest):
    """The batch twice: the copies under other trajectory ids."""
    trajs = [forest.expand(t) for t in forest.traj_ids]
    return build_forest(trajs + [dataclasses.replace(t, id=f"copy/{t.id}") for t in trajs])


_RUNS = {}


def grads(sf, forest, sharing, tokens=8192, aux=0.01, extra=()):
    """One driver step's record (``step_fidelity.run_mode``); a run asked for again is not repeated
    (``forest`` is a module fixture: its id stays its own)."""
    key = (id(forest), sharing, tokens, aux, tuple(extra))
    if key not in _RUNS:
        common = sf.driver_argv("tiny", "fp64", forest, device="cpu", aux_loss_coeff=aux, kda_backend="reference",
                                attention_backend="reference") + list(extra)
        _RUNS[key] = sf.run_mode(sf.mode_argv(common, sharing, tokens), forest, 1)
    return _RUNS[key]


def max_rel(a, b):
    return max(float((a["grads"][n] - g).norm() / g.norm().clamp_min(1e-300)) for n, g in b["grads"].items())


@pytest.mark.parametrize("sharing", ["off", "within"])
def test_aux_gradient_is_a_token_mean(sf, forest, twice, sharing):
    one, two = grads(sf, forest, sharing), grads(sf, twice, sharing)
    assert one["microbatches"] == two["microbatches"] == 1
    assert max_rel(two, one) < 1e-10
    # the aux loss takes part: without it the router's gradient is another one
    assert max_rel(grads(sf, forest, sharing, aux=0.0), one) > 1e-4


def test_z_loss_tree_equals_expanded(sf, forest):
    z = ("--moe-z-loss-coeff", "0.01")
    ref, tree = grads(sf, forest, "off", aux=0.0, extra=z), grads(sf, forest, "within", aux=0.0, extra=z)
    assert max_rel(tree, ref) < 1e-10
    assert max_rel(grads(sf, forest, "off", aux=0.0), ref) > 1e-6      # the z-loss takes part


def test_more_microbatches_do_not_scale_the_aux_gradient(sf, forest):
    one, split = grads(sf, forest, "off"), grads(sf, forest, "off", tokens=512)
    assert split["microbatches"] > 1
    g1 = torch.cat([g.flatten() for g in one["grads"].values()])
    g2 = torch.cat([g.flatten() for g in split["grads"].values()])
    assert float((g2 - g1).norm() / g1.norm()) < 1e-3


def test_step_fidelity_report_fp64(sf, tmp_path, capsys):
    """The benchmark's report: tree modes against expanded mode, exact in fp64 (one microbatch each)."""
    out = tmp_path / "sf.json"
    sf.main(["--device", "cpu", "--preset", "tiny", "--dtype", "fp64", "--scheme", "tree-step", "--num-tasks", "1",
             "--samples-per-task", "3", "--max-tokens", "512", "--microbatch-tokens", "8192", "--modes", "off",
             "within", "--kda-backend", "reference", "--attention-backend", "reference", "--out", str(out)])
    import json
    runs = json.loads(out.read_text())["runs"]
    tree = runs["within"]
    assert tree["grad_rel_diff"] < 1e-10 and tree["sign_agreement"] > 1 - 1e-12
    assert tree["expert_bias_sign_agreement"] == 1.0
    assert max(tree["loss_abs_diff_per_step"]) < 1e-12 and len(tree["loss_abs_diff_per_step"]) == 2
    assert runs["off"]["loss_per_step"][0] > 1.0 and runs["off"]["loss_per_step"][1] < runs["off"]["loss_per_step"][0]
    assert tree["worst_params"] and all(w["rel_diff"] < 1e-10 for w in tree["worst_params"])
    assert "grads" not in runs["off"] and tree["compression"] > 1


@pytest.mark.parametrize("mode", ["expanded", "off:many", "within:", "off:0"])
def test_step_fidelity_rejects_bad_modes(sf, mode, capsys):
    with pytest.raises(SystemExit) as e:
        sf.main(["--device", "cpu", "--preset", "tiny", "--dtype", "fp64", "--modes", "off", mode])
    assert e.value.code == 2 and "mode" in capsys.readouterr().err


@pytest.mark.parametrize("sharing,budget", [("within", 48), ("windows", 48), ("windows", 700), ("off", 700)])
@pytest.mark.parametrize("dp", [1, 3])
def test_step_token_weights_add_up_to_its_trajectory_tokens(sharing, budget, dp):
    """aux_loss_scale(plan) = 1 / the step's routed tokens: over all replicas' microbatches the MoE
    token weights (occurrence counts of the counted rows; 1 per expanded token) sum to them."""
    from test_training_driver import rollouts
    from megatron_harts.training.step import SharingSettings, aux_loss_scale, plan_step, replica_microbatches
    forest = build_forest(rollouts(1))
    settings = SharingSettings(sharing=sharing, microbatch_tokens=budget,
                               planner={"off": "ffd", "within": "l1", "windows": "l1l2"}[sharing])
    plan = plan_step(forest, settings, dp)
    total = 0.0
    for r in range(dp):
        for mb in replica_microbatches(forest, plan, r, settings, aligned=False):
            occ = getattr(mb.layout, "occurrence", None)
            w = torch.ones(mb.layout.num_rows, dtype=torch.float64) if occ is None else occ.double()
            total += float((w if mb.counted is None else w * mb.counted.double()).sum())
    assert total == int(forest.traj_length.sum()) and aux_loss_scale(plan) == 1.0 / total


@pytest.mark.parametrize("sharing,budget", [("within", 48), ("windows", 48), ("off", 48)])
def test_microbatch_token_weight_total_is_known_on_the_host(cpu_world_for_the_test, sharing, budget):
    """The packed params of every microbatch the schedule builds (plain, producer, expanded, with
    rows left uncounted) carry ``token_weight.sum()`` as a host number, so the MoE layers never
    read it from the device: it equals the device sum exactly, and padding keeps it."""
    from hybrid_tiny import tiny_config
    from test_training_driver import rollouts
    from megatron_harts.schedules.windows import check_windows, microbatch_params, producer_params
    from megatron_harts.training.step import SharingSettings, plan_step, replica_microbatches
    forest = build_forest(rollouts(1))
    cfg = tiny_config(dtype=torch.float64)
    settings = SharingSettings(sharing=sharing, microbatch_tokens=budget,
                               planner={"off": "ffd", "within": "l1", "windows": "l1l2"}[sharing])
    items = replica_microbatches(forest, plan_step(forest, settings, 1), 0, settings)
    producers = check_windows(items)
    checked = 0
    for i, mb in enumerate(items):
        if mb.producer is not None:          # a consumer's params need its producer's exports
            continue
        psp = producer_params(mb, [items[c] for c in producers[i]], cfg) if i in producers \
            else microbatch_params(mb, cfg)
        if psp.token_weight is None:         # expanded, every token counted: megatron's statistics,
            assert mb.counted is None        # until padding weighs the pad tokens 0
            psp = psp.padded(2)
        assert psp.token_weight_total is not None
        assert psp.token_weight_total == float(psp.token_weight.sum()) == psp.token_weight_sum()
        if not psp.pad_rows:
            assert psp.padded(3).token_weight_sum() == psp.token_weight_total
        checked += 1
    assert checked
