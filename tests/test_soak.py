"""Kill-and-resume soak: a run in tree mode with sharing windows (fp64, CPU, a tiny hybrid
MoE), SIGKILLed at seeded random iterations and at every injected point of a save, resumed with
``--load`` each time, ends bitwise equal to the uninterrupted run: every parameter, the optimizer
state, the torch and model-parallel RNG states, the scheduler and the data position of the final
checkpoint, and the loss of every iteration any launch ran.  (Python's and numpy's global RNG
states are saved too, but the driver never seeds them and nothing in a step draws from them:
each process starts them from the OS, so they are left out of the comparison.)  Each resume
says which checkpoint it loaded, and it is the newest the tracker file recorded.

The default runs keep the launches few (data parallel 1, and pipeline parallel 2 on two ranks);
``-m slow`` runs a longer schedule (24 iterations, a kill at every point three times).
"""
import json
import os
import re

import numpy as np
import pytest

from megatron_harts.training.checkpointing import RNG_KEY

from faults_entry import POINTS, checkpoint_state, launch, same
from test_training_driver import argv, write_rollouts

SAVE_INTERVAL = 2


def kill_schedule(seed: int, iters: int, rounds: int = 1, per_round: int = 4):
    """Seeded (point, iteration) kills: in each of ``rounds`` rounds ``per_round`` of the points
    (all four kinds by default) in a random order, each at a random iteration at most two saves past
    the resume point the previous kill left (a ``rename`` kill is followed by an ``aside`` kill of
    the same iteration: only then does a save find the iteration's directory already there).
    Returns the kills and, for each, the iteration the next launch must resume from."""
    rng = np.random.default_rng(seed)
    base = [p for p in POINTS if p != "aside"]
    order = []
    for _ in range(rounds):
        for i in rng.permutation(len(base))[:per_round]:
            order.append(base[i])
            if base[i] == "rename":
                order.append("aside")
    saves = list(range(SAVE_INTERVAL, iters + 1, SAVE_INTERVAL))
    tracked = 0
    kills, resumes = [], []
    for point in order:
        reach = min(iters, tracked + 2 * SAVE_INTERVAL)       # the run goes on between kills
        if point == "aside":
            at = kills[-1][1]
        elif point == "step":
            at = int(rng.integers(tracked + 1, reach + 1))
        else:
            at = int(rng.choice([s for s in saves if tracked < s <= reach]))
        kills.append((point, at))
        tracked = max([tracked] + [s for s in saves if s < at])
        resumes.append(tracked)
    return kills, resumes


def _flags(data, save, report, iters, extra):
    return argv(data, "windows", "--save", save, "--load", save, "--save-interval", str(SAVE_INTERVAL),
                "--tree-plan-report", report, "--train-iters", str(iters), *extra)


def _losses(report):
    out = {}
    with open(report) as f:
        for line in f:
            m = json.loads(line)
            out.setdefault(m["iteration"], []).append(m["loss"])
    return out


def soak(tmp_path, *, nproc, extra, iters, seed, rounds=1, per_round=4):
    data = tmp_path / "rollouts"
    write_rollouts(data)
    kills, resumes = kill_schedule(seed, iters, rounds, per_round)

    straight = launch(_flags(data, str(tmp_path / "straight"), str(tmp_path / "straight.jsonl"), iters, extra),
                      str(tmp_path / "straight.log"), nproc=nproc, timeout=240)
    assert straight.codes == [0] * nproc, straight.output[-3000:]

    save, report = str(tmp_path / "killed"), str(tmp_path / "killed.jsonl")
    expect_resume = None
    seconds = [straight.seconds]
    for k, (point, at) in enumerate(kills + [(None, None)]):
        env = {"HARTS_FAULT_KILL": f"{point}@{at}"} if point else {}
        job = launch(_flags(data, save, report, iters, extra), str(tmp_path / f"launch{k}.log"), nproc=nproc,
                     env=env, timeout=240)
        seconds.append(job.seconds)
        if expect_resume == 0:
            assert "no checkpoint yet, starting from scratch" in job.output, job.output[-3000:]
        elif expect_resume is not None:
            m = re.search(r"resuming from iteration (\d+): (\S+)", job.output)
            assert m, job.output[-3000:]
            assert (int(m.group(1)), m.group(2)) == (expect_resume, os.path.join(save, f"iter_{expect_resume:07d}"))
        if point:
            assert job.codes[0] == -9, (point, at, job.codes, job.output[-3000:])
            assert not re.search(r"Traceback|error:", job.output), job.output[-3000:]
            expect_resume = resumes[k]
        else:
            assert job.codes == [0] * nproc, job.output[-3000:]

    final = f"iter_{iters:07d}"
    want = checkpoint_state(str(tmp_path / "straight" / final), str(tmp_path / "a.pt"))
    got = checkpoint_state(os.path.join(save, final), str(tmp_path / "b.pt"))
    assert want["sharded"].keys() == got["sharded"].keys()
    assert any(k.startswith("optimizer.state.exp_avg") for k in got["sharded"])
    for state in (want, got):        # (module docstring: the driver leaves these two unseeded)
        for k, v in state["sharded"].items():
            if k.startswith(RNG_KEY):
                state["sharded"][k] = [{n: r for n, r in rank.items() if n not in ("random", "numpy")} for rank in v]
    differ = [k for k in want["sharded"] if not same(want["sharded"][k], got["sharded"][k])]
    assert not differ, f"{len(differ)} entries differ, e.g. {differ[:5]}"
    assert same(want["common"], got["common"])

    straight_losses = _losses(str(tmp_path / "straight.jsonl"))
    killed_losses = _losses(report)
    assert sorted(killed_losses) == list(range(1, iters + 1))
    for it, losses in killed_losses.items():
        assert all(v == straight_losses[it][0] for v in losses), (it, losses, straight_losses[it])
    ran = sum(len(v) for v in killed_losses.values())
    print(f"\nsoak nproc={nproc} {' '.join(extra) or 'dp1'}: {len(kills)} kills survived "
          f"({', '.join(f'{p}@{a}' for p, a in kills)}), {iters} iterations, {ran} iteration runs "
          f"({ran - iters} recomputed after kills), steps lost: none (final checkpoint bitwise equal); "
          f"launches {' '.join(f'{t:.1f}' for t in seconds)} s")
    return len(kills)


def test_soak_data_parallel_1(tmp_path):
    assert soak(tmp_path, nproc=1, extra=(), iters=8, seed=37) == len(POINTS)


def test_soak_pipeline_2(tmp_path):
    """Two of the points (seeded), to keep the two-rank launches few."""
    assert soak(tmp_path, nproc=2, extra=("--pipeline-model-parallel-size", "2"), iters=8, seed=41,
                per_round=2) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("nproc,extra", [(1, ()), (2, ("--pipeline-model-parallel-size", "2"))])
def test_soak_long(tmp_path, nproc, extra):
    assert soak(tmp_path, nproc=nproc, extra=extra, iters=24, seed=370 + nproc, rounds=3) == 3 * len(POINTS)
