"""Compaction events through the hybrid model: tree mode == expanded mode (log-probs, loss, every
gradient, MoE aux loss, tokens per expert) in fp64 on CPU with eviction in the MLA layers only; the
driver's expanded, whole-tree and sharing-window runs agree on such data."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from megatron_harts.layout import build_layout, sequence_visibility
from megatron_harts.models.model import build_hybrid_model
from megatron_harts.models.packed import TreePackedSeqParams
from megatron_harts.tree_data import build_forest, make_trajectory, write_dataset

from hybrid_tiny import VOCAB, randomize_, tiny_config
from test_compaction_layout import trees_with_events
from test_models_tree import _assert_modes_equal, _run


def forest_with_events(seed=0):
    """Two trees; shared events, a sibling without the event, forks at and around event positions, a
    trajectory ending inside another's compacted path, an event evicting the token before it."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, VOCAB, 16).tolist()
    other = rng.integers(0, VOCAB, 9).tolist()
    tail = lambda n: rng.integers(0, VOCAB, n).tolist()   # noqa: E731
    spec = [(base + tail(2), [(6, 1, 4), (11, 0, 2), (11, 6, 11)]),
            (base[:9] + tail(4), [(6, 1, 4), (9, 2, 9)]),
            (base[:6] + tail(5), None),
            (base[:8], [(6, 1, 4)]),
            (base[:7] + tail(3), [(6, 1, 4), (7, 0, 7)]),
            (other + tail(3), [(4, 0, 3), (4, 1, 2), (8, 2, 6)]),
            (other[:5] + tail(4), [(4, 0, 3)])]
    return build_forest([make_trajectory({"id": i, "tokens": t, **({"compactions": [
        {"at": p, "start": a, "end": b} for p, a, b in ev]} if ev else {})}) for i, (t, ev) in enumerate(spec)])


def expanded_inputs(lay, forest, events=True):
    """Every trajectory of the layout packed on its own, with its events' visibility (or none)."""
    trs = [forest.expand(tid) for tid in lay.traj_ids]
    lengths = [len(t) for t in trs]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    vis = sequence_visibility(lengths, [t.compactions for t in trs]) if events else None
    psp = TreePackedSeqParams.for_sequences(lengths, visibility=vis)
    rows = torch.as_tensor(offsets[lay.target_traj.numpy()] + lay.target_position.numpy() - 1)
    ids = torch.as_tensor(np.concatenate([t.tokens for t in trs]))[None]
    return ids, psp.position_ids[None], psp, rows, lay.target_token, None


@pytest.mark.parametrize("overrides", [
    {},
    {"mla_rope": True, "q_lora_rank": 12, "moe_z_loss_coeff": 1e-2, "tree_attention_backend": "sdpa"},
    {"mla_rope": True, "tree_attention_backend": "varlen"},
], ids=["kimi_reference", "rope_qlora_sdpa", "rope_varlen"])
def test_tree_equals_expanded_with_eviction_fp64(cpu_world, overrides):
    cfg = tiny_config(**overrides)
    model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 3)
    forest = forest_with_events()
    lay = build_layout(forest)
    assert lay.num_events > 0 and lay.visibility.num_intervals > lay.num_rows
    assert lay.num_rows < int(lay.traj_length.sum())
    psp = TreePackedSeqParams.for_tree(lay, config=cfg)
    coeffs = torch.randn(lay.num_targets, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    tree = _run(model, (lay.tokens[None], lay.position_ids[None], psp, lay.pair_row, lay.pair_token,
                        lay.target_pair), coeffs)
    expanded = _run(model, expanded_inputs(lay, forest), coeffs)
    _assert_modes_equal(tree, expanded)
    # eviction matters: the same trajectories without their events give other log-probs
    plain = _run(model, expanded_inputs(lay, forest, events=False), coeffs)
    assert float((plain[0] - expanded[0]).abs().max()) > 1e-3


def test_padded_expanded_params_keep_the_visibility():
    vis = sequence_visibility([4, 3], [np.array([[3, 0, 2]]), None])
    psp = TreePackedSeqParams.for_sequences([4, 3], visibility=vis)
    padded = psp.padded(2)
    dense = padded.visibility.validate().dense()
    assert torch.equal(dense[:7, :7], vis.dense())
    assert torch.equal(dense[7:, 7:], torch.tril(torch.ones(2, 2, dtype=torch.bool)))
    assert not dense[7:, :7].any() and not dense[:7, 7:].any()
    paths = padded.sequence_key_paths("cpu")
    assert paths.pairs == int(dense.sum())
    with pytest.raises(ValueError, match="covers 7 rows"):
        TreePackedSeqParams.for_sequences([4, 4], visibility=vis)


# ---- the driver ------------------------------------------------------------------------------

def rollouts_with_events(seed=0, records=False):
    """The driver test's PPO rollouts (first 12) with a compaction of the prompt in every one and a
    later event in every third; ``records``: the JSON-like records instead of trajectories."""
    from test_training_driver import rollouts
    out = []
    for i, t in enumerate(rollouts(seed)[:12]):
        rec = {"id": t.id, "tokens": t.tokens.tolist(), "loss_mask": t.loss_mask.tolist(),
               "old_logprobs": t.old_logprobs.tolist(), "advantage": t.advantage, "weight": t.weight,
               "compactions": [{"at": 16, "start": 2, "end": 10}]}
        if i % 3 == 0:
            n = len(rec["tokens"])
            rec["compactions"].append({"at": n - 2, "start": 12, "end": n - 3})
        out.append(rec if records else make_trajectory(rec))
    return out


def _driver_worker(rank, world, port, data, plain, out):
    """One process (the test module's own megatron world is left alone): a step of each sharing mode."""
    from test_training_driver import _world, argv
    _world(rank, world, port)
    from megatron_harts.training.trainer import Trainer
    got = {}
    for name, path, sharing in (("off", data, "off"), ("within", data, "within"), ("windows", data, "windows"),
                                ("plain_off", plain, "off")):
        with Trainer.from_args(argv(path, sharing), require_data=True) as t:
            m = t.train_iteration()
            got[name] = (m["loss"], m["grad_norm"], m["computed_tokens"], m["visible_pairs"], m["compaction_events"])
    # the RL-loop entry: in-memory records with their compaction events
    with Trainer.from_args(argv(data, "within"), require_data=True) as t:
        m = t.step(rollouts_with_events(records=True))
        got["step_api"] = (m["loss"], m["grad_norm"], m["computed_tokens"], m["visible_pairs"], m["compaction_events"])
    torch.save(got, out)


def test_driver_windows_and_within_equal_off(tmp_path):
    from megatron_cpu import free_port
    from multiproc import run_ranks
    forest = build_forest(rollouts_with_events())
    assert forest.has_compactions
    data, plain, out = tmp_path / "rollouts", tmp_path / "plain", tmp_path / "out.pt"
    write_dataset(forest, str(data))
    write_dataset(build_forest([make_trajectory({**r, "compactions": None})
                                for r in rollouts_with_events(records=True)]), str(plain))
    run_ranks(_driver_worker, 1, (free_port(), str(data), str(plain), str(out)), timeout=300)
    got = torch.load(out, weights_only=False)
    for mode in ("within", "windows"):
        for a, b in zip(got[mode][:2], got["off"][:2]):
            assert abs(a - b) <= 1e-10 * abs(b), (mode, got)
    # tree modes shared rows, windows read shared context from producers
    assert got["windows"][2] < got["within"][2] < got["off"][2], got
    # not vacuous: the same rollouts without their events train to another loss
    assert abs(got["plain_off"][0] - got["off"][0]) > 1e-6, got
    # the step log counts the events and the attention pairs each mode computed
    stats = forest.stats()
    assert got["off"][3] == stats["visible_pairs_expanded"]     # each trajectory on its own
    for mode in ("within", "windows"):      # microbatches recompute prefixes they share with others
        assert stats["visible_pairs_tree"] <= got[mode][3] < got["off"][3], got
    assert got["off"][4] == got["within"][4] == got["windows"][4] == stats["compaction_events"] > 0
    assert got["plain_off"][3] > got["off"][3] and got["plain_off"][4] == 0
    assert abs(got["step_api"][0] - got["within"][0]) <= 1e-10 * abs(got["within"][0]), got
    assert got["step_api"][2:] == got["within"][2:], got


_PROPERTY_MODEL = {}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(trees_with_events(max_traj=5, max_len=12, vocab=3))
def test_tree_equals_expanded_on_random_trees_with_events(cpu_world, trajs):
    """Property: on random trees with random events (shared, dropped by a sibling, forks at and around
    them), tree mode equals expanded mode in fp64: log-probs, loss, gradients, aux loss, tokens per expert."""
    if "model" not in _PROPERTY_MODEL:
        _PROPERTY_MODEL["model"] = randomize_(build_hybrid_model(tiny_config(), vocab_size=VOCAB), 3)
    model = _PROPERTY_MODEL["model"]
    forest = build_forest(trajs)
    lay = build_layout(forest)
    if lay.num_targets == 0:
        return
    psp = TreePackedSeqParams.for_tree(lay, config=model.config)
    coeffs = torch.randn(lay.num_targets, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    tree = _run(model, (lay.tokens[None], lay.position_ids[None], psp, lay.pair_row, lay.pair_token,
                        lay.target_pair), coeffs)
    _assert_modes_equal(tree, _run(model, expanded_inputs(lay, forest), coeffs), every_gradient=False)
