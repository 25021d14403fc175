"""Per-token ``rollout_logprobs`` and ``ref_logprobs`` carried by the data (docs/data_format.md,
docs/training.md "RL updates"), end to end:

- records -> forest -> dataset -> forest keeps both exactly, a shared target whose trajectories
  give different values stored as an exception (as old_logprobs); a forest without them is
  written as format version 2, with them as version 3; the committed version-1 file still reads;
  re-prefill, Parquet and engine records carry them;
- objective level: per-target values the update gathers from the forest (``data_logprobs``,
  ``TargetTables``), summed over every microbatch split of the targets, equal the plain
  per-trajectory reference reading each trajectory's own fields (fp64, loss, terms, gradients);
- driver: tools/score_logprobs.py -> tools/convert_trajectories.py -> ``--data-path`` with
  ``--rl-tis-cap`` on the data's rollout_logprobs and ``--kl-to ref`` on its ref_logprobs: the same
  loss, terms and gradients in expanded mode and both tree modes (1e-10), the loss equal to the
  plain per-trajectory reference computed from ``Trainer.logprobs``; ``--ref-load`` wins over the
  data's ref_logprobs;
- errors: a field the flags need that the data lacks is one ``error:`` line naming the file and flag.
"""
import json
import math
import os

import numpy as np
import pytest
import torch

from megatron_harts.layout import build_layout
from megatron_harts.rl.objectives import ObjectiveConfig, objective_loss, objective_loss_reference, target_scale
from megatron_harts.tree_data import TreeDataset, build_forest, make_trajectory, trajectory_record, write_dataset
from megatron_harts.tree_data.errors import TreeFormatError
from test_rl_objectives import Case, _records, assert_rel, microbatch_splits

FIELDS = ("rollout_logprobs", "ref_logprobs")


def _with_fields(recs, seed=5, spread=(0.3, 0.2)):
    """``recs`` with rollout and reference log-probs near the old ones, drawn per trajectory: where
    trajectories share a target their values differ (null on context, as an engine gives them)."""
    rng = np.random.default_rng(seed)
    out = []
    for r in recs:
        r = dict(r)
        n, mask = len(r["tokens"]), r.get("loss_mask") or [0] + [1] * (len(r["tokens"]) - 1)
        base = np.array([-1.0 if v is None else v for v in r.get("old_logprobs") or [-1.0] * n])
        for name, s in zip(FIELDS, spread):
            v = base + rng.normal(0, s, n)
            r[name] = [float(x) if m else None for x, m in zip(v, mask)]
        out.append(r)
    return out


# ---------------------------------------------------------------------------
# data: records, forest, dataset
# ---------------------------------------------------------------------------

def _same(a, b):
    return a is None and b is None or (a is not None and b is not None and np.array_equal(a, b, equal_nan=True))


def test_forest_and_dataset_round_trip(tmp_path):
    recs = _with_fields(_records())
    del recs[2]["ref_logprobs"]                 # a trajectory without one field
    trajs = [make_trajectory(r) for r in recs]
    forest = build_forest(trajs)
    # a0, a1 and a2 share the targets at positions 4 and 5 with different rollout values: exceptions
    assert forest.exc_rollout_logprobs.traj.shape[0] > 0 and forest.exc_ref_logprobs.traj.shape[0] > 0
    assert forest.has_logprobs("ref_logprobs").sum() == len(recs) - 1
    write_dataset(forest, str(tmp_path / "d"))
    ds = TreeDataset(str(tmp_path / "d"))
    assert ds.version == 3
    for f in (forest, ds.forest(), *(ds[i] for i in range(len(ds)))):
        for tid in f.traj_ids:
            t, want = f.expand(tid), trajs[[x.id for x in trajs].index(tid)]
            for name in ("old_logprobs", *FIELDS):
                assert _same(getattr(t, name), getattr(want, name)), (tid, name)
    # the record of an expanded trajectory is the record given (nulls included)
    rec = trajectory_record(ds.forest().expand("a1"))
    assert rec["rollout_logprobs"] == recs[1]["rollout_logprobs"] and rec["ref_logprobs"] == recs[1]["ref_logprobs"]
    # a selection of trees keeps the fields of its trajectories only
    sub = ds.forest().select([1])
    assert sub.row_rollout_logprobs.shape == (sub.num_rows,) and sub.has_logprobs("rollout_logprobs").all()
    # without the fields: version 2 (readable by builds that read versions 1 and 2); version 1 reads
    plain = build_forest([make_trajectory(r) for r in _records()])
    write_dataset(plain, str(tmp_path / "p"))
    p = TreeDataset(str(tmp_path / "p"))
    assert p.version == 2 and p.forest().row_rollout_logprobs is None
    assert not p.forest().has_logprobs("ref_logprobs").any()
    from tool_runner import ROOT
    v1 = TreeDataset(os.path.join(ROOT, "tests", "data", "format_v1"))
    assert v1.version == 1 and not v1.forest().has_logprobs("rollout_logprobs").any()


def test_corrupt_rollout_bytes_fail_the_tree_checksum(tmp_path):
    forest = build_forest([make_trajectory(r) for r in _with_fields(_records())])
    write_dataset(forest, str(tmp_path / "d"))
    ds = TreeDataset(str(tmp_path / "d"))
    off, _, _ = ds.header["bin"]["row_rollout_logprobs"]
    with open(tmp_path / "d.bin", "r+b") as fh:
        fh.seek(off + 8 * 5)
        fh.write(np.float64(-123.0).tobytes())
    bad = TreeDataset(str(tmp_path / "d"))
    with pytest.raises(TreeFormatError, match="CRC32 mismatch"):
        bad.forest()


def test_data_format_example_reads():
    """The record docs/data_format.md shows reads, with its engine log-probs."""
    from tool_runner import ROOT
    with open(os.path.join(ROOT, "docs", "data_format.md")) as f:
        line = next(x for x in f if x.startswith('{"id": "task7/s0/b1"'))
    t = make_trajectory(json.loads(line))
    assert np.array_equal(t.rollout_logprobs, [np.nan, np.nan, np.nan, -0.29, -1.26], equal_nan=True)


def test_record_errors():
    r = _with_fields(_records())[0]
    for name in FIELDS:
        bad = dict(r, **{name: r[name][:-1]})
        with pytest.raises(TreeFormatError, match=f"trajectory 'a0': field '{name}': has 8 entries but 'tokens' "
                                                  "has 9"):
            make_trajectory(bad, file="r.jsonl", line=3)
        bad = dict(r, **{name: [None] * len(r["tokens"])})
        with pytest.raises(TreeFormatError, match=f"r.jsonl:3: trajectory 'a0': field '{name}': entry 4 is "
                                                  "null/NaN where loss_mask is 1"):
            make_trajectory(bad, file="r.jsonl", line=3)
        bad = dict(r, **{name: ["x"] * len(r["tokens"])})
        with pytest.raises(TreeFormatError, match=f"field '{name}': element 0 is 'x', not a number"):
            make_trajectory(bad, file="r.jsonl", line=3)


def test_reprefill_parquet_and_engine_records_carry_the_fields(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from megatron_harts.tree_data import read_trajectories
    from megatron_harts.tree_data.engine_records import read_engine_records
    from megatron_harts.tree_data.reprefill import reprefill
    recs = [{k: v for k, v in r.items() if k != "advantage"} for r in _with_fields(_records())]
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "r.parquet")
    got = read_trajectories([str(tmp_path / "r.parquet")])
    for t, r in zip(got, recs):
        for name in FIELDS:
            assert _same(getattr(t, name), np.array([np.nan if v is None else v for v in r[name]]))
    # re-prefill: each sample's values are the trajectory's at the sample's tokens
    t = make_trajectory(dict(recs[0], compactions=[{"at": 6, "start": 1, "end": 3}]))
    r0, r1 = reprefill([t])
    assert np.array_equal(r0.rollout_logprobs, t.rollout_logprobs[:6], equal_nan=True)
    assert np.array_equal(r1.ref_logprobs, t.ref_logprobs[[0, 3, 4, 5, 6, 7, 8]], equal_nan=True)
    # engine records: the completion log-probs are the engine's, so both rollout and old log-probs
    path = tmp_path / "calls.jsonl"
    path.write_text(json.dumps({"conversation": "c", "call": 0, "prompt_token_ids": [1, 2],
                                "completion_token_ids": [3, 4], "completion_logprobs": [-0.5, -0.25]}) + "\n")
    (traj,), _ = read_engine_records([str(path)])
    assert np.array_equal(traj.rollout_logprobs, [np.nan, np.nan, -0.5, -0.25], equal_nan=True)
    assert np.array_equal(traj.old_logprobs, traj.rollout_logprobs, equal_nan=True) and traj.ref_logprobs is None


# ---------------------------------------------------------------------------
# objective level: the values the update gathers from the forest
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [
    ObjectiveConfig(tis_cap=1.1, kl_coef=0.2, kl_estimator="k3", loss_agg_mode="token-mean"),
    ObjectiveConfig(tis_cap=1.5, tis_level="sequence", tis_mode="mask", kl_coef=0.1, kl_estimator="k2",
                    loss_agg_mode="seq-mean-token-mean"),
], ids=["token-truncate-k3", "sequence-mask-k2"])
def test_forest_values_microbatch_sum_equals_reference(cfg):
    from megatron_harts.training.rl_update import TargetTables, _targets, _tis_table, data_logprobs
    recs = [r for r in _with_fields(_records()) if r["id"] != "a4"]      # a4: no advantage, no targets
    case = Case(recs)
    f = case.forest
    old = {tid: f.expand(tid).old_logprobs for tid in f.traj_ids}
    tables = TargetTables(f, {"ref": data_logprobs(f, "ref_logprobs"),
                              "tis": _tis_table(_targets(f), old, data_logprobs(f, "rollout_logprobs"), cfg)})
    case.zero_grad()
    lps, ents = case.expanded_values()
    ref, ref_terms = objective_loss_reference(lps, case.trajs, cfg, ents)   # each trajectory's own fields
    ref.backward()
    ref = ref.detach()
    ref_grads = case.grads()
    assert float(ref_grads[0].abs().max()) > 0 and float(ref_terms["kl"]) > 0
    for name, mbs in microbatch_splits(case).items():
        case.zero_grad()
        total, terms = 0.0, {}
        for lay, idx in mbs:
            lp, ent, old_t, adv, traj, weight = case.target_values(lay, idx)
            extra = tables.gather(lay)
            kw = {"ref_logprobs": extra["ref"], "tis_weight": extra["tis"]}
            if idx is not None:
                kw = {k: v[idx] for k, v in kw.items()}
            scale = target_scale(case.normalizer, traj, weight, cfg.loss_agg_mode, cfg.loss_norm_length)
            loss, t = objective_loss(lp, old_t, adv, scale, cfg, entropy=ent, **kw)
            loss.backward()
            total = total + loss.detach()
            for k, v in t.items():
                terms[k] = terms.get(k, 0.0) + v
        assert_rel(total, ref, what=f"{name} loss")
        for k in ref_terms:
            assert abs(float(terms[k]) - float(ref_terms[k])) <= 1e-12 * max(abs(float(ref_terms[k])), 1.0), (name, k)
        for g, rg in zip(case.grads(), ref_grads):
            torch.testing.assert_close(g, rg, rtol=1e-12, atol=1e-15, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------
# driver: score -> convert -> --data-path
# ---------------------------------------------------------------------------

FLAGS = ["--rl-old-logprobs", "data", "--rl-tis-cap", "1.02", "--kl-coef", "0.1", "--kl-estimator", "k3",
         "--loss-agg-mode", "seq-mean-token-mean"]


def _engine_records():
    """The driver records of one task (a tree with shared targets, split into several 48-row
    microbatches) with engine log-probs near the data's old log-probs (so that the cap binds on some
    tokens only), drawn per trajectory (shared targets differ)."""
    from test_rl_update import _driver_records
    rng = np.random.default_rng(21)
    out = []
    for r in [r for r in _driver_records() if r["id"].startswith("t0/")]:
        m = np.array(r["loss_mask"]) == 1
        v = np.array(r["old_logprobs"]) + rng.normal(0, 0.03, len(r["tokens"]))
        out.append(dict(r, rollout_logprobs=[float(x) if k else None for x, k in zip(v, m)]))
    return out


@pytest.fixture(scope="module")
def scored_dataset(tmp_path_factory):
    """A reference checkpoint (seed 7), the engine records scored by it with tools/score_logprobs.py
    (--field ref_logprobs), converted to a dataset with tools/convert_trajectories.py."""
    from test_rl_update import _argv
    from test_training_driver import MODEL
    from tool_runner import load_tool
    from megatron_harts.cli import run
    from megatron_harts.training.trainer import Trainer
    d = tmp_path_factory.mktemp("scored")
    with Trainer.from_args(_argv("within", "--save", str(d / "ref"), "--save-interval", "1")) as t:
        t.save(announce=False)
    recs = _engine_records()
    (d / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    flags = MODEL + ["--seq-length", "48", "--tree-microbatch-tokens", "48"]
    for tool, argv in (("score_logprobs", ["--input", d / "rollouts.jsonl", "--output", d / "scored.jsonl",
                                           "--checkpoint", d / "ref", "--field", "ref_logprobs", *flags]),
                       ("convert_trajectories", ["--input", d / "scored.jsonl", "--output", d / "data"])):
        with pytest.raises(SystemExit) as e:
            run(load_tool(tool).main, [str(a) for a in argv])
        assert e.value.code == 0
    scored = [json.loads(line) for line in (d / "scored.jsonl").read_text().splitlines()]
    return {"dir": d, "records": recs, "scored": scored, "prefix": str(d / "data"), "ref": str(d / "ref")}


def _data_argv(sharing, prefix, *extra):
    from test_rl_update import _argv
    # the policy starts from other weights (seed 11) than the reference (seed 7): the KL term is not 0
    return _argv(sharing, "--data-path", str(prefix), "--seed", "11", *extra, n=64)


def test_score_convert_round_trip(scored_dataset):
    """The dataset holds every field of the scored records exactly: old and rollout log-probs as given,
    ref_logprobs as scored (null at position 0), the other fields unchanged."""
    s = scored_dataset
    ds = TreeDataset(s["prefix"])
    assert ds.version == 3
    forest = ds.forest()
    assert forest.has_logprobs("rollout_logprobs").all() and forest.has_logprobs("ref_logprobs").all()
    assert forest.exc_rollout_logprobs.traj.shape[0] > 0      # shared targets with differing engine values
    for rec, sc in zip(s["records"], s["scored"]):
        assert {k: v for k, v in sc.items() if k != "ref_logprobs"} == rec
        got = trajectory_record(forest.expand(rec["id"]))
        assert {k: got[k] for k in ("tokens", "loss_mask", "old_logprobs", "rollout_logprobs", "ref_logprobs")} == \
            {k: sc[k] for k in ("tokens", "loss_mask", "old_logprobs", "rollout_logprobs", "ref_logprobs")}
        assert sc["ref_logprobs"][0] is None and all(v is not None for v in sc["ref_logprobs"][1:])


def test_driver_data_fields_tree_equals_expanded_and_reference(scored_dataset):
    """One driver iteration from the dataset with TIS on its rollout_logprobs and a k3 KL to its
    ref_logprobs: loss, terms and every gradient equal in expanded mode and both tree modes (fp64,
    1e-10); the loss and terms equal the plain per-trajectory reference at the initial weights."""
    from test_rl_update import _grads
    from megatron_harts.training.trainer import Trainer
    s = scored_dataset
    runs = {}
    for sharing in ("off", "within", "windows"):
        with Trainer.from_args(_data_argv(sharing, s["prefix"], *FLAGS), require_data=True) as t:
            if sharing == "within":     # the plain reference: trajectory by trajectory, at the initial weights
                trajs = [make_trajectory(r) for r in s["scored"]]
                lps = t.logprobs(s["scored"])
                want, want_terms = objective_loss_reference([torch.from_numpy(a) for a in lps], trajs, t.objective)
            m = t.train_iteration()
            runs[sharing] = (m, _grads(t))
    m0, g0 = runs["off"]
    # not vacuous: the reference reads every rollout and reference log-prob of the data, and the cap binds
    assert m0["trajectories"] == len(s["records"])
    assert abs(m0["loss"] - float(want)) <= 1e-10 * abs(float(want))
    for k, v in want_terms.items():
        assert abs(m0[f"objective/{k}"] - float(v)) <= 1e-10 * max(abs(float(v)), 1e-3), k
    assert m0["objective/kl"] > 1e-4                          # the reference is another model
    assert 0 < m0["rollout/abs_diff_mean"] and m0["rollout/abs_diff_max"] > math.log(1.02)   # the cap binds
    assert any(float(g.abs().max()) > 0 for g in g0.values())
    for sharing in ("within", "windows"):
        m, g = runs[sharing]
        for k in ("loss", "objective/kl", "objective/pg_loss", "rollout/kl", "rollout/abs_diff_max"):
            assert abs(m[k] - m0[k]) <= 1e-10 * abs(m0[k]), (sharing, k)
        for name, rg in g0.items():
            torch.testing.assert_close(g[name], rg, rtol=1e-10, atol=1e-10 * float(rg.abs().max()) + 1e-300,
                                       msg=lambda msg: f"{sharing} grad {name}: {msg}")


def test_ref_load_wins_over_the_data(scored_dataset, capsys):
    """--ref-load with ref_logprobs in the data: the reference model's log-probs are used (the loss is the
    one of the same records without ref_logprobs), said once."""
    from megatron_harts.training.trainer import Trainer
    s = scored_dataset
    recs4 = s["records"][:4]
    bogus = [dict(r, ref_logprobs=[None] + [-30.0] * (len(r["tokens"]) - 1)) for r in recs4]
    out = {}
    for name, recs in (("bogus", bogus), ("none", recs4)):
        with Trainer.from_args(_data_argv("within", s["prefix"], *FLAGS, "--ref-load", s["ref"])) as t:
            out[name] = t.step(recs)["loss"]
    assert out["bogus"] == out["none"]
    said = [line for line in capsys.readouterr().out.splitlines() if "ref_logprobs are not read" in line]
    assert len(said) == 1


# ---------------------------------------------------------------------------
# errors: a field the flags need, missing from the data
# ---------------------------------------------------------------------------

def _cli_error(argv, capsys):
    import sys
    from megatron_harts.training.pretrain import console_main
    old = sys.argv
    sys.argv = ["pretrain_tree_gpt.py", *argv]
    try:
        with pytest.raises(SystemExit) as e:
            console_main()
    finally:
        sys.argv = old
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error:"), err
    return err[0]


def test_driver_refuses_data_without_the_fields(scored_dataset, tmp_path, capsys):
    s = scored_dataset
    plain = [{k: v for k, v in r.items() if k not in FIELDS} for r in s["scored"]]
    write_dataset(build_forest([make_trajectory(r) for r in plain]), str(tmp_path / "plain"))
    idx = str(tmp_path / "plain.idx")
    err = _cli_error(_data_argv("within", tmp_path / "plain", "--rl-tis-cap", "2"), capsys)
    assert idx in err and "--rl-tis-cap 2.0 needs `rollout_logprobs`" in err
    err = _cli_error(_data_argv("within", tmp_path / "plain", "--kl-coef", "0.1"), capsys)
    assert idx in err and "--kl-coef 0.1 --kl-to ref needs `ref_logprobs`" in err and "--ref-load" in err
    # some trajectories carry the field, one does not: refused at its step, naming it
    some = [dict(r) for r in s["scored"]]
    del some[3]["ref_logprobs"]
    write_dataset(build_forest([make_trajectory(r) for r in some]), str(tmp_path / "some"))
    err = _cli_error(_data_argv("within", tmp_path / "some", "--kl-coef", "0.1"), capsys)
    assert str(tmp_path / "some.idx") in err and f"trajectory {some[3]['id']!r}" in err
    assert "--kl-coef 0.1 --kl-to ref needs `ref_logprobs`" in err
    # a record with a null engine log-prob at a target: the converter names file, line, trajectory, field
    from tool_runner import assert_one_error, load_tool, run_tool
    bad = [dict(r) for r in s["records"][:3]]
    bad[1]["rollout_logprobs"] = [None] * len(bad[1]["tokens"])
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
    code, _, err = run_tool(load_tool("convert_trajectories"), capsys, "--input", tmp_path / "bad.jsonl", "--output",
                            tmp_path / "bad")
    assert_one_error(code, err, "bad.jsonl:2", repr(bad[1]["id"]), "rollout_logprobs", "null")
