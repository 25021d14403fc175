"""The training driver with injected faults (test helper for test_faults.py and test_soak.py).

``python tests/faults_entry.py FLAGS`` (or under torchrun) runs ``pretrain_tree_gpt.py FLAGS``
with the faults the environment asks for:

- ``HARTS_FAULT_KILL=POINT@N``: SIGKILL this process's whole process group (the job when the
  ranks share one, the rank and its helpers under torchrun) at ``POINT`` of iteration ``N``, on
  rank 0:

  * ``step``: after iteration N's optimizer step, before anything of it is saved;
  * ``write``: during the save of N, every file written, before the directory is renamed;
  * ``rename``: the directory renamed into place, before the tracker file is updated;
  * ``tracker``: the new tracker file written and flushed, before it replaces the old one;
  * ``aside``: a re-save of N has moved the old ``iter_N`` aside, the new one not yet renamed.

- ``HARTS_FAULT_WRITE_ERRNO=ERRNO@N``: writing the save of iteration N fails on the last rank
  with ``OSError(ERRNO)`` (as a full or read-only file system makes it fail).
- ``HARTS_FAULT_STATUS=DIR``: every rank writes its process id to ``DIR/pid_<RANK>`` when it
  starts and its exit status to ``DIR/rank_<RANK>`` when it ends.

``launch`` / ``launch_torchrun`` start it the way the tests need (one process group per job,
killed whole on the way out), ``checkpoint_state`` reads a checkpoint for bitwise comparisons.
"""
import errno as errno_names
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
POINTS = ("step", "write", "rename", "tracker", "aside")


def _kill() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.killpg(os.getpgid(0), signal.SIGKILL)


def _iteration_of(path: str) -> int:
    m = re.search(r"iter_(\d{7})", os.path.basename(os.fspath(path)))
    return int(m.group(1)) if m else -1


def _install(point: str, at: int) -> None:
    from megatron.core import dist_checkpointing

    from megatron_harts.training import checkpointing as ck
    from megatron_harts.training.trainer import Trainer
    rank = int(os.environ.get("RANK", "0"))
    if point not in POINTS:
        raise SystemExit(f"HARTS_FAULT_KILL: unknown point {point!r} (one of {POINTS})")

    if point == "step":
        run_step = Trainer._run_step

        def killing_step(self, *args, **kw):
            out = run_step(self, *args, **kw)
            if self.iteration + 1 == at and rank == 0:
                _kill()
            return out
        Trainer._run_step = killing_step
    elif point == "write":
        save = dist_checkpointing.save

        def killing_save(state, directory, *args, **kw):
            out = save(state, directory, *args, **kw)
            if _iteration_of(directory) == at and rank == 0:
                _kill()
            return out
        dist_checkpointing.save = killing_save
    elif point == "rename":
        write_tracker = ck._write_tracker

        def killing_tracker(save_dir, value):
            if value == str(at):
                _kill()
            return write_tracker(save_dir, value)
        ck._write_tracker = killing_tracker
    elif point == "tracker":
        replace = os.replace

        def killing_replace(src, dst, *args, **kw):
            if os.path.basename(dst) == ck.TRACKER_FILENAME:
                with open(src) as f:
                    if f.read().strip() == str(at):
                        _kill()
            return replace(src, dst, *args, **kw)
        os.replace = killing_replace
    elif point == "aside":
        rename = os.rename

        def killing_rename(src, dst, *args, **kw):
            out = rename(src, dst, *args, **kw)
            if ".old-" in os.path.basename(dst) and _iteration_of(src) == at:
                _kill()
            return out
        os.rename = killing_rename


def _install_write_error(code: int, at: int) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    if int(os.environ.get("RANK", "0")) != int(os.environ.get("WORLD_SIZE", "1")) - 1:
        return
    save = dist_checkpointing.save
    write_item = filesystem_async._write_item

    def failing_write(*args, **kw):
        raise OSError(code, f"{os.strerror(code)} (injected)")

    def failing_save(state, directory, *args, **kw):
        if _iteration_of(directory) != at:
            return save(state, directory, *args, **kw)
        filesystem_async._write_item = failing_write     # the forked writer processes inherit it
        try:
            return save(state, directory, *args, **kw)
        finally:
            filesystem_async._write_item = write_item
    dist_checkpointing.save = failing_save


def main() -> None:
    sys.path.insert(0, os.path.dirname(HERE))
    kill = os.environ.get("HARTS_FAULT_KILL")
    if kill:
        point, at = kill.split("@")
        _install(point, int(at))
    write_error = os.environ.get("HARTS_FAULT_WRITE_ERRNO")
    if write_error:
        code, at = write_error.split("@")
        _install_write_error(getattr(errno_names, code) if not code.isdigit() else int(code), int(at))
    status_dir = os.environ.get("HARTS_FAULT_STATUS")
    if status_dir:
        with open(os.path.join(status_dir, f"pid_{os.environ.get('RANK', '0')}"), "w") as f:
            f.write(str(os.getpid()))
    from megatron_harts.cli import run
    from megatron_harts.training.pretrain import main as driver
    code = 1
    try:
        run(driver, sys.argv[1:])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        raise
    finally:
        if status_dir:
            with open(os.path.join(status_dir, f"rank_{os.environ.get('RANK', '0')}"), "w") as f:
                f.write(str(code))


# ---------------------------------------------------------------------------------------------
# launching (the tests' side)

ROOT = os.path.dirname(HERE)
ENTRY = os.path.join(HERE, "faults_entry.py")


@dataclass
class Job:
    """A finished (or killed) launch: every rank's exit code and the job's combined output."""
    codes: List[Optional[int]]
    output: str
    seconds: float


def _env(extra: Optional[Dict[str, str]]) -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("HARTS_FAULT_KILL", "HARTS_FAULT_WRITE_ERRNO", "HARTS_FAULT_STATUS"):
        env.pop(k, None)
    env.update(extra or {})
    return env


def _descendants(pid: int) -> List[int]:
    children: Dict[int, List[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every descendant's (torchrun gives each rank its own)."""
    groups = set()
    for p in [pid] + _descendants(pid):
        try:
            groups.add(os.getpgid(p))
        except ProcessLookupError:
            pass
    for g in groups:
        if g != os.getpgid(0):
            try:
                os.killpg(g, signal.SIGKILL)
            except ProcessLookupError:
                pass


def launch(flags: Sequence[str], log: str, *, nproc: int = 1, env: Optional[Dict[str, str]] = None,
           timeout: float = 120.0) -> Job:
    """``nproc`` ranks of the driver started directly (RANK/WORLD_SIZE as torchrun sets them), all in
    one new process group, so that a kill at an injected point takes the whole job down at once."""
    from megatron_harts.testing.cpu_runtime import free_port
    port = str(free_port())
    procs: List[subprocess.Popen] = []
    files = []
    t0 = time.time()
    try:
        for r in range(nproc):
            e = _env(dict(env or {}, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
            f = open(f"{log}.rank{r}", "w")
            files.append(f)
            group = {"process_group": 0 if r == 0 else procs[0].pid}
            procs.append(subprocess.Popen([sys.executable, ENTRY, *flags], cwd=ROOT, env=e, stdout=f,
                                          stderr=subprocess.STDOUT, **group))
        deadline = t0 + timeout
        for p in procs:
            try:
                p.wait(timeout=max(deadline - time.time(), 0.1))
            except subprocess.TimeoutExpired:
                break
    finally:
        if procs:
            kill_tree(procs[0].pid)
        for p in procs:
            p.wait()
        for f in files:
            f.close()
    output = ""
    for r in range(nproc):
        with open(f"{log}.rank{r}") as f:
            output += f.read()
    return Job([p.returncode for p in procs], output, time.time() - t0)


def launch_torchrun(flags: Sequence[str], log: str, *, nproc: int = 2, env: Optional[Dict[str, str]] = None):
    """torchrun (``python -m torch.distributed.run``) running the driver, started in its own session:
    the ``subprocess.Popen`` (output to ``log``); the caller waits and calls ``kill_tree``."""
    from megatron_harts.testing.cpu_runtime import free_port
    f = open(log, "w")
    try:
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                                 "--master-port", str(free_port()), ENTRY, *flags],
                                cwd=ROOT, env=_env(env), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        f.close()


def checkpoint_state(ckpt_dir: str, scratch: str) -> dict:
    """Everything a checkpoint holds: its tensors and objects (model, optimizer, RNG, as one dict)
    and its common state (iteration, scheduler, data position)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(ckpt_dir, scratch)
    state = torch.load(scratch, weights_only=False)
    os.unlink(scratch)
    common = torch.load(os.path.join(ckpt_dir, "common.pt"), weights_only=False)
    return {"sharded": state, "common": common}


def same(a, b) -> bool:
    """Bitwise equality of nested tensors / containers / plain values."""
    import torch
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


if __name__ == "__main__":
    main()
