"""Faults a cluster throws at a training run (docs/faults.md).

- Preemption: SIGTERM delivered to torchrun (what Kubernetes does), to every rank's process group
  (what SLURM does) or to one rank makes every rank finish its iteration, save, and exit 0, with
  one line naming the checkpoint; a periodic save before the signal (which started megatron-core's
  writer helpers in the past) does not get in the way.  2 gloo ranks under torchrun, the three
  launches in parallel.
- Damaged checkpoints: a truncated, altered or missing file of the newest checkpoint is one error
  naming the file and the ``--ckpt-step`` that resumes from an earlier one, which then works; a
  checkpoint moved aside by a killed re-save still loads.
- A save that cannot write (no space, permission) is one error and marks nothing latest.
- Data: a dataset tree rewritten under a running loader fails the step that reads it, naming the
  tree; a data file replaced under it fails the next step; a resume on other data is refused.
Kills at every point of a save, and resumes, are in test_soak.py.
"""
import errno
import os
import re
import shutil
import signal
import time

import numpy as np
import pytest

from megatron_harts.training import checkpointing as ck
from megatron_harts.training.data import LoaderError, TreeBatchLoader
from megatron_harts.tree_data import TreeFormatError, build_forest, write_dataset
from megatron_harts.tree_data.dataset import TreeDataset

from faults_entry import kill_tree, launch_torchrun
from test_training_driver import argv, rollouts, write_rollouts

EXIT_LINE = re.compile(r"exiting at iteration (\d+) \(exit signal received\): checkpoint saved to (\S+)")


# ---------------------------------------------------------------------------------------------
# preemption

def _wait_for(path, pattern, proc, timeout=120.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        with open(path) as f:
            if re.search(pattern, f.read()):
                return
        assert proc.poll() is None, open(path).read()[-3000:]
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} not seen in {path} within {timeout} s")


def test_preemption_saves_and_exits_cleanly(tmp_path):
    data = tmp_path / "rollouts"
    write_rollouts(data)
    routes = ("launcher", "every rank", "one rank")
    jobs = {}
    try:
        for k, route in enumerate(routes):
            d = tmp_path / f"route{k}"
            d.mkdir()
            flags = argv(data, "windows", "--train-iters", "1000", "--save", str(d / "ckpt"), "--save-interval", "2",
                         "--exit-signal-handler", "--log-interval", "1000")
            jobs[route] = (d, launch_torchrun(flags, str(d / "log"), env={"HARTS_FAULT_STATUS": str(d)}))
        for route, (d, proc) in jobs.items():
            # a periodic save first: the writer's results used to go through a helper process that
            # the signal killed, and the save after the signal then failed (BrokenPipeError)
            _wait_for(d / "log", r"saved checkpoint of iteration 2 ", proc)
            pids = [int((d / f"pid_{r}").read_text()) for r in range(2)]
            if route == "launcher":
                os.kill(proc.pid, signal.SIGTERM)
            elif route == "every rank":
                for pid in pids:
                    os.killpg(pid, signal.SIGTERM)   # each rank's process group: the rank and its helpers
            else:
                os.kill(pids[1], signal.SIGTERM)
        for route, (d, proc) in jobs.items():
            code = proc.wait(timeout=120)
            out = (d / "log").read_text()
            assert [(d / f"rank_{r}").read_text() for r in range(2)] == ["0", "0"], (route, out[-3000:])
            if route != "launcher":          # torchrun itself re-raises the signal it got (exit 1)
                assert code == 0, (route, out[-3000:])
            lines = EXIT_LINE.findall(out)
            assert len(lines) == 1, (route, out[-3000:])
            it, path = int(lines[0][0]), lines[0][1]
            assert it > 2 and path == str(d / "ckpt" / f"iter_{it:07d}")
            assert "error:" not in out and "cannot save" not in out
            assert ck.latest_iteration(str(d / "ckpt")) == it
            names = sorted(os.listdir(d / "ckpt"))
            assert not [n for n in names if ".tmp-" in n or ".old-" in n], names
            assert it in ck.complete_iterations(str(d / "ckpt"))
            assert ck.MANIFEST_FILENAME in os.listdir(path)
    finally:
        for _, proc in jobs.values():
            kill_tree(proc.pid)
            proc.wait()


# ---------------------------------------------------------------------------------------------
# damaged checkpoints, ckpt-step, failed writes (in this process: a world of one)

def _flags(data, *extra):
    return argv(data, "windows", "--train-iters", "6", *extra)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A run of 6 iterations stopped after 4, with checkpoints of iterations 2 and 4."""
    from megatron_harts.training.pretrain import main
    root = tmp_path_factory.mktemp("faults")
    write_rollouts(root / "rollouts")
    assert main(_flags(root / "rollouts", "--save", str(root / "ckpt"), "--save-interval", "2",
                       "--exit-interval", "4")) == 0
    assert ck.complete_iterations(str(root / "ckpt")) == [2, 4]
    return root


def _copy(checkpoints, tmp_path):
    shutil.copytree(checkpoints / "ckpt", tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _truncate(path):
    os.truncate(path, os.path.getsize(path) // 2)


def _flip(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x5A]))


@pytest.mark.parametrize("damage,file,says", [
    (_truncate, "__0_0.distcp", "truncated"), (_flip, "__0_1.distcp", "corrupt (CRC32"),
    (_flip, "common.pt", "corrupt (CRC32"), (os.unlink, ".metadata", "missing"),
])
def test_damaged_newest_checkpoint_names_the_file_and_the_way_back(checkpoints, tmp_path, capsys, damage, file, says):
    from megatron_harts.cli import CliError
    from megatron_harts.training.pretrain import main
    ckpt = _copy(checkpoints, tmp_path)
    bad = ckpt / "iter_0000004" / file
    damage(str(bad))
    flags = _flags(checkpoints / "rollouts", "--load", str(ckpt))
    with pytest.raises(CliError) as err:
        main(flags)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{bad}: ") and says in msg, msg
    assert "--ckpt-step 2" in msg, msg
    capsys.readouterr()
    assert main(flags + ["--ckpt-step", "2", "--save", str(ckpt), "--save-interval", "2"]) == 0
    out = capsys.readouterr().out
    assert f"resuming from iteration 2: {ckpt / 'iter_0000002'} (--ckpt-step 2)" in out, out
    assert ck.latest_iteration(str(ckpt)) == 6
    assert ck.complete_iterations(str(ckpt)) == [2, 4, 6]    # the damaged 4 was saved again on the way


def test_ckpt_step_refusals(checkpoints, tmp_path):
    from megatron_harts.training.arguments import ArgumentsError, parse_args
    with pytest.raises(ArgumentsError, match="--ckpt-step needs --load"):
        parse_args(_flags(checkpoints / "rollouts", "--ckpt-step", "2"))
    from megatron_harts.cli import CliError
    from megatron_harts.training.pretrain import main
    with pytest.raises(CliError, match=r"--ckpt-step 3: .*iter_0000003 does not exist "
                                       r"\(complete checkpoints in .*: 2, 4\)"):
        main(_flags(checkpoints / "rollouts", "--load", str(checkpoints / "ckpt"), "--ckpt-step", "3"))


def test_checkpoint_moved_aside_by_a_killed_resave_still_loads(checkpoints, tmp_path, capsys):
    from megatron_harts.training.pretrain import main
    ckpt = _copy(checkpoints, tmp_path)
    os.rename(ckpt / "iter_0000004", ckpt / "iter_0000004.old-0badf00d")
    with pytest.warns(UserWarning, match="iter_0000004.old-0badf00d"):
        assert main(_flags(checkpoints / "rollouts", "--load", str(ckpt), "--save", str(ckpt),
                           "--save-interval", "2")) == 0
    assert "resuming from iteration 4" in capsys.readouterr().out
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000004", "iter_0000006", ck.TRACKER_FILENAME]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES])
def test_failed_write_is_one_error_and_marks_nothing_latest(checkpoints, tmp_path, monkeypatch, code):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_harts.cli import CliError
    from megatron_harts.training.pretrain import main
    ckpt = _copy(checkpoints, tmp_path)

    def failing_write(*args, **kw):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(filesystem_async, "_write_item", failing_write)   # the forked writers inherit it
    with pytest.raises(CliError) as err:
        main(_flags(checkpoints / "rollouts", "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "2"))
    msg = str(err.value)
    assert "\n" not in msg and f"cannot save iteration 6" in msg and os.strerror(code) in msg, msg
    assert ck.latest_iteration(str(ckpt)) == 4
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000004", ck.TRACKER_FILENAME]


# ---------------------------------------------------------------------------------------------
# the data under a running job

def _token_offset(prefix, tree):
    ds = TreeDataset(prefix)
    f = ds.forest(verify=False)
    row = int(f.seg_row[int(f.tree_offsets[tree])])
    return ds.header["bin"]["tokens"][0] + ds._arrays["tokens"].itemsize * row, ds._arrays["tokens"].dtype


@pytest.mark.parametrize("prefetch", [0, 1])
def test_tree_rewritten_under_a_running_loader_fails_its_step(tmp_path, prefetch):
    prefix = str(tmp_path / "data")
    write_dataset(build_forest(rollouts()), prefix)
    loader = TreeBatchLoader(prefix, global_batch_size=16, seed=3, prefetch=prefetch)
    read = 0
    while read < loader.num_trees:                   # epoch 0: every tree read (and checked) once
        b = next(loader)
        assert b.epoch == 0
        read += b.tree_ids.size
    victim = int(loader.epoch_order(1)[-1])          # read by the last step of the next epoch
    off, dtype = _token_offset(prefix, victim)
    with open(prefix + ".bin", "r+b") as fh:         # a plausible token, in place
        fh.seek(off)
        value = np.frombuffer(fh.read(dtype.itemsize), dtype=dtype)[0]
        fh.seek(off)
        fh.write(np.array([(value + 1) % 64], dtype=dtype).tobytes())
    with pytest.raises(TreeFormatError, match=rf"tree {victim} is corrupt \(CRC32 mismatch\)") as err:
        for _ in range(10):
            b = next(loader)
            assert victim not in b.tree_ids.tolist()
    assert prefix + ".bin" in str(err.value)
    loader.close()


def test_data_file_replaced_under_a_running_loader_or_before_a_resume(tmp_path):
    prefix = str(tmp_path / "data")
    write_dataset(build_forest(rollouts(0)), prefix)
    loader = TreeBatchLoader(prefix, global_batch_size=16, seed=3, prefetch=0)
    next(loader)
    state = loader.state_dict()
    other = rollouts(0)                              # the same shapes, one token changed
    other[0].tokens[-1] = (other[0].tokens[-1] + 1) % 64
    write_dataset(build_forest(other), prefix)       # a new file at the same path (os.replace)
    with pytest.raises(LoaderError, match="replaced or resized while the job ran"):
        next(loader)
    loader.close()
    with pytest.raises(LoaderError, match="contents differ from those the resume state was saved with"):
        TreeBatchLoader(prefix, global_batch_size=16, seed=3, prefetch=0, start=state)
    old = dict(state)
    del old["tree_crcs_crc32"]                       # a state saved before the contents were recorded
    TreeBatchLoader(prefix, global_batch_size=16, seed=3, prefetch=0, start=old).close()
