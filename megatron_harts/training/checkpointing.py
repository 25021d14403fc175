"""Checkpoint save and load for the training driver (megatron-core ``dist_checkpointing``).

Megatron-LM's directory convention, torch_dist format::

    SAVE/latest_checkpointed_iteration.txt    "10" (or "release": weights only, e.g. converted from HF)
    SAVE/iter_0000010/                         one megatron-core dist checkpoint
        metadata.json, .metadata, __*.distcp   written by dist_checkpointing (torch_dist)
        common.pt                              non-sharded state, written once (rank 0)

What a checkpoint holds (keys of the state dict given to ``dist_checkpointing.save``):

- ``model`` (``model0``, ``model1``, ... for several chunks): each chunk's ``sharded_state_dict``
  (one key per layer: the hybrid's layers differ, so ``non_homogeneous_layers``);
- ``optimizer``: ``optimizer.sharded_state_dict(...)``; a distributed optimizer stores
  Megatron-LM's default ``dp_reshardable`` layout (reshardable over data parallelism only);
- ``opt_param_scheduler``: the scheduler's state dict (common);
- ``rng_state``: one ``ShardedObject`` per global rank (key ``rng_state_by_global_rank``, shard
  ``rank`` of ``world_size``): python ``random``, numpy, torch CPU, CUDA (when available) and
  megatron's model-parallel RNG tracker states;
- ``iteration``, ``checkpoint_version`` and ``megatron_harts`` (common): the caller's
  ``extra_state`` (JSON text), the parallel layout (world size, TP, PP, CP, EP, DP) and what was
  saved;
- ``content_metadata`` (common): the sharded-state-dict metadata the checkpoint was written with;
  loading uses the checkpoint's own.

Atomicity: every rank writes into ``SAVE/iter_0000010.tmp-<hex>``; only after all ranks report a
complete write does rank 0 record every file's size and CRC32 in ``harts_files.json`` (each rank
fingerprints the files it wrote), rename the directory to ``iter_0000010`` and then replace the
tracker file (temporary file + ``os.replace``), so the tracker always names a complete checkpoint.  A save
that fails on any rank (an exception) is agreed on by all ranks, rank 0 removes the temporary
directory, and every rank raises :class:`CheckpointError`; the previous checkpoint and the
tracker are untouched.  A save killed outright (or a rank that dies, leaving the others waiting
in a collective until the process-group timeout) leaves at most a ``*.tmp-*`` directory, which
loading ignores and the next save removes.  Saving refuses parameters that hold NaN/Inf
(``check_finite``).  With data parallelism the ranks share the writing of replicated tensors
(Megatron-LM's fully parallel save).  Re-saving an existing iteration moves the old
directory aside (``iter_0000010.old-<hex>``) until the new one is in place; a save killed in
between leaves the old one there, which loading reads and the next save puts back.

Helper processes: megatron-core's torch_dist writer forks one process per file bucket for each
save, and would hand their results back through a ``multiprocessing.Manager`` server spawned at
the first save and kept for the process's lifetime.  Launchers deliver a preemption signal to
each worker's whole process group (torchrun: ``os.killpg``), which kills that server, and the
save that should follow the signal then fails (BrokenPipeError).  Saves here are synchronous,
so the results stay in the saving process (:func:`_in_process_write_results`): no helper process
outlives a save.

Damage: loading checks every file against ``harts_files.json`` before reading (sizes on every
rank, the CRC32s shared out among the ranks), so a truncated, missing or altered file is one
error naming it, with the complete checkpoints of the directory that ``step=`` (``--ckpt-step``)
can load instead.  Checkpoints without that file (written by other tools) load unchecked.

RNG and world-size changes: RNG states are per global rank, so they are restored only when the
parallel layout (world size, TP, PP, CP, EP, DP) equals the saved one; otherwise loading warns
and leaves the current RNG state (as Megatron-LM does on a TP/PP change).  Model weights load
under any layout megatron's sharded state dicts support; a distributed optimizer's state under
any data-parallel size.

Without Apex/Transformer Engine, megatron-core 0.16's distributed optimizer can neither produce
a state dict before its first step nor restore Adam's step count on load: call
``megatron_harts.patches.apply()`` first (loading distributed-optimizer state refuses otherwise).

Collectives use the default process group (gloo or NCCL, any world size); every agreement
between ranks goes through ``all_gather_object``, so all ranks raise the same error.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import random
import re
import secrets
import shutil
import warnings
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

__all__ = ["CheckpointError", "TRACKER_FILENAME", "MANIFEST_FILENAME", "checkpoint_dir_name",
           "latest_iteration", "complete_iterations", "save_checkpoint", "load_checkpoint"]

logger = logging.getLogger(__name__)

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
MANIFEST_FILENAME = "harts_files.json"   # every file of a checkpoint: size and CRC32
CHECKPOINT_VERSION = 3.0          # Megatron-LM's checkpoint_version of dist checkpoints
FORMAT_VERSION = 1                # version of the "megatron_harts" common entry
RNG_KEY = "rng_state_by_global_rank"
# sharded_state_dict metadata (Megatron-LM's _build_sharded_state_dict_metadata, plus the hybrid's
# per-layer keys); stored in the checkpoint as content metadata
BASE_METADATA = {"non_homogeneous_layers": True, "singleton_local_shards": False,
                 "chained_optim_avoid_prefix": True}
DISTRIB_OPTIM_SHARDING = "dp_reshardable"
# torch.distributed.checkpoint reports failed reads/writes as CheckpointException, a BaseException
_ERRORS = (Exception, CheckpointException)
_REPORT = "megatron_harts.checkpointing.report"
_TMP_RE = re.compile(r"^iter_\d{7}\.tmp-")
_ITER_RE = re.compile(r"^iter_(\d{7})$")
_SHARD_RE = re.compile(r"^__(\d+)_\d+\.distcp$")      # torch_dist data files: __<writing rank>_<bucket>
_REQUIRED = ("metadata.json", "common.pt", ".metadata")
_OLD_RE = re.compile(r"^(iter_\d{7})\.old-")
_OPTIM_KEY_RE = re.compile(r"^(chained_\d+\.)?optimizer\.")      # tensors of the optimizer's state


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the directory and the cause."""


def checkpoint_dir_name(iteration: int) -> str:
    """``iter_0000010`` for iteration 10 (Megatron-LM's name)."""
    return f"iter_{iteration:07d}"


def _tracker_path(directory: str) -> str:
    return os.path.join(directory, TRACKER_FILENAME)


def _read_tracker(directory: str):
    """None (no tracker file), an iteration, or "release"; CheckpointError for anything else."""
    path = _tracker_path(directory)
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the tracker file ({e.strerror or e})") from None
    value = text.strip()
    if value == "release":
        return value
    if not value.isdigit() or not value.isascii():
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise CheckpointError(f"{path}: corrupt tracker file: expected an iteration number or 'release', "
                              f"found {shown!r}")
    return int(value)


def latest_iteration(directory: str) -> Optional[int]:
    """The iteration the tracker file of ``directory`` names; None without a tracker file.

    A release checkpoint ("release" in the tracker) counts as iteration 0.  A tracker whose
    content is not an iteration raises CheckpointError.
    """
    value = _read_tracker(directory)
    if value is None:
        return None
    return 0 if value == "release" else value


def complete_iterations(directory: str) -> List[int]:
    """The iterations of ``directory`` whose ``iter_*`` directory holds a whole checkpoint (the
    files a finished save renames into place; contents not read), oldest first.  Interrupted
    saves' ``*.tmp-*`` and ``*.old-*`` directories do not count."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    out = []
    for name in names:
        m = _ITER_RE.match(name)
        if m and all(os.path.isfile(os.path.join(directory, name, f)) for f in _REQUIRED):
            out.append(int(m.group(1)))
    return sorted(out)


def _earlier_hint(load_dir: str, bad: Optional[int]) -> str:
    """Where to resume from instead of the damaged checkpoint of iteration ``bad``."""
    others = [i for i in complete_iterations(load_dir) if i != bad]
    if not others:
        return "; no other complete checkpoint in " + load_dir
    older = [i for i in others if bad is None or i < bad] or others
    return (f"; complete checkpoints in {load_dir}: iterations {', '.join(map(str, others))}: resume from "
            f"one with --ckpt-step {older[-1]} (load_checkpoint(step={older[-1]}))")


# ---------------------------------------------------------------------------------------------
# collectives: every rank contributes a report; all ranks see all reports and raise alike

def _world() -> Tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise CheckpointError("torch.distributed is not initialized: megatron-core dist checkpoints need a "
                              "process group (a world of one is fine)")
    return dist.get_rank(), dist.get_world_size()


def _describe(e: BaseException) -> str:
    """One line: the exception's type and first line (for a torch.distributed.checkpoint failure,
    each failed rank's exception, as far as this rank knows them)."""
    if isinstance(e, CheckpointException):
        failures = getattr(e, "failures", None) or {}
        parts = [f"rank {r}: {_describe(f[0] if isinstance(f, tuple) else f)}" for r, f in sorted(failures.items())
                 if isinstance(f, BaseException) or (isinstance(f, tuple) and isinstance(f[0], BaseException))]
        return "; ".join(parts) if parts else "torch.distributed.checkpoint failed on another rank"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _agree(what: str, error: Optional[str], local_exc: Optional[BaseException] = None, **fields) -> List[dict]:
    """All-gather one report per rank; raise CheckpointError on every rank if any rank failed."""
    report = {"tag": _REPORT, "what": what, "error": error, **fields}
    world = dist.get_world_size()
    if world == 1:
        reports = [report]
    else:
        reports = [None] * world
        dist.all_gather_object(reports, report)
    by_text: Dict[str, List[int]] = {}
    for r, rep in enumerate(reports):
        if not isinstance(rep, dict) or rep.get("tag") != _REPORT or rep.get("what") != what:
            by_text.setdefault("out of step with the other ranks (a collective failed on some rank)", []).append(r)
        elif rep["error"]:
            by_text.setdefault(rep["error"], []).append(r)
    if by_text:
        if world == 1:
            raise CheckpointError("; ".join(by_text)) from local_exc
        raise CheckpointError("; ".join(
            (f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}") + f": {text}"
            for text, ranks in by_text.items())) from local_exc
    return reports


# ---------------------------------------------------------------------------------------------
# what goes into a checkpoint

def _optimizer_parts(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _is_distributed_optimizer(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    return any(isinstance(o, DistributedOptimizer) for o in _optimizer_parts(optimizer))


def _parallel_layout() -> Dict[str, int]:
    from megatron.core import parallel_state as ps
    return {"world_size": dist.get_world_size(),
            "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "cp": ps.get_context_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size()}


def _runtime_metadata(content_metadata: dict) -> dict:
    from megatron.core import parallel_state as ps
    return dict(content_metadata, dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True))


def _unwrap(model) -> list:
    """The model chunks without their DDP / FSDP / Float16Module wrappers (as Megatron-LM saves them)."""
    from megatron.core.utils import unwrap_model
    return unwrap_model(list(model) if isinstance(model, (list, tuple)) else [model])


def _model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


def _model_state(models: Sequence, metadata: dict) -> dict:
    return {_model_key(i, len(models)): m.sharded_state_dict(metadata=metadata) for i, m in enumerate(models)}


def _rng_tracker():
    from megatron.core.tensor_parallel import random as mrandom
    return mrandom.get_cuda_rng_tracker()


def _cuda_rng_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _collect_rng_state() -> dict:
    from megatron.core.tensor_parallel import random as mrandom
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"random": random.getstate(),
             "numpy": (str(kind), torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()), int(pos),
                       int(has_gauss), float(gauss)),
             "torch": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state() if _cuda_rng_available() else None,
             "tracker": {name: mrandom.convert_cuda_rng_state(s, to_graphable=False).clone()
                         for name, s in _rng_tracker().get_states().items()}}
    return state


def _restore_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import random as mrandom
    version, internal, gauss_next = state["random"]
    random.setstate((version, tuple(internal), gauss_next))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tracker = _rng_tracker()
    graphable = mrandom.is_graph_safe_cuda_rng_tracker(tracker)
    tracker.set_states({name: mrandom.convert_cuda_rng_state(s, to_graphable=graphable)
                        for name, s in state["tracker"].items()})


def _rng_sharded_object(data, rank: int, world: int):
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    return ShardedObject(RNG_KEY, data, (world,), (rank,), replica_id=0)


def _first_non_finite(models: Sequence) -> Optional[str]:
    """The name of the first parameter holding NaN/Inf, or None (one device sync when all are finite)."""
    named = [(name if len(models) == 1 else f"chunk {i}: {name}", p)
             for i, m in enumerate(models) for name, p in m.named_parameters() if p.is_floating_point()]
    if not named:
        return None
    finite = torch.stack([torch.isfinite(p.detach()).all() for _, p in named]).cpu()
    if bool(finite.all()):
        return None
    return named[int((~finite).nonzero()[0])][0]


def _encode_extra(extra_state) -> str:
    try:
        return json.dumps({} if extra_state is None else extra_state, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"extra_state is not JSON-serializable ({e})") from None


# ---------------------------------------------------------------------------------------------
# file-system steps (rank 0)

def _fsync_path(path: str) -> None:
    """Flush one file or directory to disk (best effort: a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    """Flush every file of a finished checkpoint directory (best effort: a no-op where unsupported)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            _fsync_path(os.path.join(dirpath, name))
        _fsync_path(dirpath)


def _file_digest(path: str) -> List[int]:
    """[size in bytes, CRC32] of one file."""
    crc = size = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(1 << 24)
            if not block:
                return [size, crc]
            crc = zlib.crc32(block, crc)
            size += len(block)


def _own_files(directory: str, rank: int, world: int) -> List[str]:
    """The files of a just-written checkpoint directory that ``rank`` fingerprints: the data files
    it wrote (``__<rank>_*.distcp``); rank 0 also takes every other file."""
    out = []
    for name in sorted(os.listdir(directory)):
        m = _SHARD_RE.match(name)
        owner = int(m.group(1)) if m and int(m.group(1)) < world else 0
        if owner == rank and name != MANIFEST_FILENAME:
            out.append(name)
    return out


def _write_manifest(directory: str, files: Dict[str, List[int]]) -> None:
    """Record the checkpoint's files; refuse a directory holding a file no rank fingerprinted."""
    present = sorted(n for n in os.listdir(directory) if n != MANIFEST_FILENAME)
    unclaimed = [n for n in present if n not in files]
    if unclaimed:
        raise CheckpointError(f"{directory}: files no rank accounts for: {unclaimed}")
    with open(os.path.join(directory, MANIFEST_FILENAME), "w") as f:
        json.dump({"format_version": 1, "files": {n: {"bytes": files[n][0], "crc32": files[n][1]} for n in present}},
                  f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _verify_files(ckpt_dir: str, rank: int, world: int) -> Optional[str]:
    """The first damaged file of ``ckpt_dir`` against its manifest, as an error naming it, or None.
    Every rank checks all sizes; the CRC32s are shared out among the ranks (file ``i`` on rank
    ``i % world``).  No manifest: nothing to check."""
    path = os.path.join(ckpt_dir, MANIFEST_FILENAME)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            files = json.load(f)["files"]
        expected = [(n, int(v["bytes"]), int(v["crc32"])) for n, v in sorted(files.items())]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{path}: unreadable file list ({_describe(e)})"
    for i, (name, size, crc) in enumerate(expected):
        file = os.path.join(ckpt_dir, name)
        try:
            have = os.path.getsize(file)
        except OSError:
            return f"{file}: missing (the checkpoint was saved with it)"
        if have != size:
            return f"{file}: {have} bytes, the save wrote {size} (truncated or overwritten)"
        if i % world == rank:
            try:
                got = _file_digest(file)[1]
            except OSError as e:
                return f"{file}: unreadable ({_describe(e)})"
            if got != crc:
                return f"{file}: corrupt (CRC32 {got:08x}, the save wrote {crc:08x})"
    return None


@contextlib.contextmanager
def _in_process_write_results():
    """megatron-core's torch_dist writer (``filesystem_async``) hands each save's results through a
    queue served by a spawned ``multiprocessing.Manager`` process, created at the first save and
    kept; a signal to the worker's process group kills it and every later save fails.  A save here
    runs the writer synchronously in this process, which also reads the results back, so a plain
    in-process queue serves for the save's duration (module docstring, "Helper processes")."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    if not hasattr(filesystem_async, "_results_queue"):
        raise CheckpointError("megatron-core's filesystem_async has no _results_queue: this megatron-core "
                              "version's writer is not supported")
    saved = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = saved


def _tidy(save_dir: str) -> None:
    """Remove what interrupted saves left (temporary directories and tracker files); put back a
    moved-aside checkpoint whose replacement never arrived."""
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        if not os.path.isdir(path):
            if name.startswith(TRACKER_FILENAME + ".tmp-"):
                try:
                    os.unlink(path)
                except OSError:
                    pass
            continue
        if _TMP_RE.match(name):
            shutil.rmtree(path, ignore_errors=True)
            continue
        m = _OLD_RE.match(name)
        if m:
            final = os.path.join(save_dir, m.group(1))
            if os.path.exists(final):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.rename(path, final)


def _create_unique(prefix: str, make) -> str:
    """``make(prefix + random suffix)`` until the name is new (files and directories get the
    permissions of the process's umask, like Megatron-LM's; mkstemp/mkdtemp would make them private)."""
    for _ in range(100):
        path = f"{prefix}{secrets.token_hex(4)}"
        try:
            make(path)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"{prefix}*: no free name")


def _write_tracker(save_dir: str, value: str) -> None:
    """Replace the tracker file atomically (a new file, flushed, renamed over the old one)."""
    path = _tracker_path(save_dir)
    opened = {}

    def create(name):
        opened["fd"] = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)

    tmp = _create_unique(path + ".tmp-", create)
    try:
        with os.fdopen(opened["fd"], "w") as f:
            f.write(value + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_path(save_dir)


def _commit(save_dir: str, tmp_dir: str, iteration: int, files: Dict[str, List[int]]) -> None:
    """Record the files of the finished temporary directory, rename it into place, then point the
    tracker at it."""
    for required in _REQUIRED:
        if not os.path.isfile(os.path.join(tmp_dir, required)):
            raise CheckpointError(f"{tmp_dir}: incomplete after writing ({required} missing)")
    _write_manifest(tmp_dir, files)
    _fsync_tree(tmp_dir)
    final = os.path.join(save_dir, checkpoint_dir_name(iteration))
    aside = None
    if os.path.lexists(final):
        aside = f"{final}.old-{os.path.basename(tmp_dir).rsplit('.tmp-', 1)[1]}"
        os.rename(final, aside)
    try:
        os.rename(tmp_dir, final)
        try:
            _fsync_path(save_dir)
            _write_tracker(save_dir, str(iteration))
        except BaseException:
            os.rename(final, tmp_dir)
            raise
    except BaseException:
        if aside is not None:
            os.rename(aside, final)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# save

def _save_strategy():
    """torch_dist; with data parallelism, replicated tensors are written by all data-parallel ranks
    in turn rather than all by the first (Megatron-LM's default --ckpt-fully-parallel-save)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    strategy = get_default_save_sharded_strategy("torch_dist")
    group = ps.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(group) > 1:
        strategy = FullyParallelSaveStrategyWrapper(strategy, group)
    return strategy


def save_checkpoint(save_dir: str, iteration: int, model, optimizer, scheduler, *,
                    extra_state: Optional[dict] = None, save_optim: bool = True, save_rng: bool = True,
                    check_finite: bool = True) -> str:
    """Save a checkpoint of ``iteration`` under ``save_dir`` (collective: call on every rank).

    ``model``: a list of model chunks (megatron DDP-wrapped or bare modules with
    ``sharded_state_dict``); ``optimizer``: a megatron-core optimizer or None; ``scheduler``: an
    ``OptimizerParamScheduler`` or None; ``extra_state``: a JSON-serializable dict of global state
    (rank 0's copy is stored; ranks holding a different one make the save fail);
    ``check_finite``: refuse to save parameters holding NaN/Inf.  Returns the checkpoint
    directory.  Raises CheckpointError (on every rank) when the save failed; the previous
    checkpoint and the tracker are then untouched (module docstring).
    """
    from megatron.core import dist_checkpointing

    rank, world = _world()
    models = _unwrap(model)
    save_dir = os.path.abspath(save_dir)
    where = f"{save_dir}: cannot save iteration {iteration}"
    tmp_dir = None
    committed = False
    try:
        # 1. local preparation; rank 0 creates the temporary directory
        error = local_exc = None
        extra_json = ""
        state = content_metadata = None
        try:
            if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
                raise CheckpointError(f"iteration must be a non-negative int, got {iteration!r}")
            extra_json = _encode_extra(extra_state)
            if check_finite:
                bad = _first_non_finite(models)
                if bad is not None:
                    raise CheckpointError(f"parameter {bad} holds NaN/Inf values: refusing to save it")
            content_metadata = dict(BASE_METADATA)
            with_optim = save_optim and optimizer is not None
            if with_optim and _is_distributed_optimizer(optimizer):
                _require_optimizer_patches()
                content_metadata["distrib_optim_sharding_type"] = DISTRIB_OPTIM_SHARDING
            metadata = _runtime_metadata(content_metadata)
            state = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
            state.update(_model_state(models, metadata))
            if with_optim:
                state["optimizer"] = optimizer.sharded_state_dict(state, metadata=metadata)
                if scheduler is not None:
                    state["opt_param_scheduler"] = scheduler.state_dict()
            if save_rng:
                state["rng_state"] = _rng_sharded_object(_collect_rng_state(), rank, world)
            state["megatron_harts"] = {
                "format_version": FORMAT_VERSION, "extra_state": extra_json, "layout": _parallel_layout(),
                "num_model_chunks": len(models), "optimizer": with_optim,
                "distributed_optimizer": bool(with_optim and _is_distributed_optimizer(optimizer)),
                "scheduler": bool(with_optim and scheduler is not None), "rng": bool(save_rng)}
            if rank == 0:
                os.makedirs(save_dir, exist_ok=True)
                _tidy(save_dir)
                tmp_dir = _create_unique(os.path.join(save_dir, checkpoint_dir_name(iteration) + ".tmp-"), os.mkdir)
        except _ERRORS as e:
            error, local_exc = (str(e) if isinstance(e, CheckpointError) else _describe(e)), e
        digest = hashlib.sha256(extra_json.encode()).hexdigest()
        reports = _agree("prepare", error and f"{where}: {error}", local_exc, tmp_dir=tmp_dir, extra=digest)
        differing = [r for r, rep in enumerate(reports) if rep["extra"] != reports[0]["extra"]]
        if differing:
            raise CheckpointError(f"{where}: extra_state differs between rank 0 and rank(s) {differing}: "
                                  "it must be global state (the same on every rank)")
        tmp_dir = reports[0]["tmp_dir"]

        # 2. every rank writes its shards into the temporary directory (no helper process kept)
        error = local_exc = None
        try:
            with _in_process_write_results():
                dist_checkpointing.save(state, tmp_dir, sharded_strategy=_save_strategy(),
                                        validate_access_integrity=True, content_metadata=content_metadata)
        except _ERRORS as e:
            error, local_exc = _describe(e), e
        _agree("write", error and f"{where}: writing {tmp_dir} failed ({error})", local_exc)

        # 3. every rank fingerprints what it wrote
        error = local_exc = None
        digests: Dict[str, List[int]] = {}
        try:
            digests = {n: _file_digest(os.path.join(tmp_dir, n)) for n in _own_files(tmp_dir, rank, world)}
        except _ERRORS as e:
            error, local_exc = _describe(e), e
        reports = _agree("digest", error and f"{where}: reading back {tmp_dir} failed ({error})", local_exc,
                         files=digests)

        # 4. rank 0 publishes it: file list, rename, then the tracker
        error = local_exc = None
        if rank == 0:
            try:
                _commit(save_dir, tmp_dir, iteration, {n: d for rep in reports for n, d in rep["files"].items()})
                committed = True
            except _ERRORS as e:
                error, local_exc = _describe(e), e
        _agree("commit", error and f"{where}: publishing the checkpoint failed ({error})", local_exc)
        committed = True
    finally:
        if rank == 0 and not committed and tmp_dir is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return os.path.join(save_dir, checkpoint_dir_name(iteration))


# ---------------------------------------------------------------------------------------------
# load

def _sharded_tensors(tree) -> list:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    out = []
    for v in nested_values(tree):
        if isinstance(v, ShardedTensorFactory):
            out.extend(_sharded_tensors(v.build()))
        elif isinstance(v, ShardedTensor):
            out.append(v)
    return out


def _require_optimizer_patches() -> None:
    """Without Apex/TE megatron's distributed optimizer cannot checkpoint before its first step and
    resumes with a wrong Adam step count unless megatron_harts.patches are applied
    (patches/distrib_optimizer_*.py): refuse rather than drift."""
    from ..patches import distrib_optimizer_fresh_state_dict, distrib_optimizer_step_restore
    missing = [p.NAME for p in (distrib_optimizer_fresh_state_dict, distrib_optimizer_step_restore)
               if p.needed() and not p.is_applied()]
    if missing:
        raise CheckpointError(f"distributed-optimizer checkpoints without Apex/Transformer Engine need the "
                              f"megatron-core patches {missing}: call megatron_harts.patches.apply() first")


def _check_model_matches(ckpt_dir: str, model_state: dict) -> None:
    """One readable error for the first tensor of this rank's model that the checkpoint lacks or has in
    another shape (tensors of the checkpoint that no rank holds: :func:`_unclaimed_tensors`)."""
    from megatron.core import dist_checkpointing
    saved = dist_checkpointing.load_tensors_metadata(ckpt_dir)
    wanted = {}
    for t in _sharded_tensors(model_state):
        wanted.setdefault(t.key, (tuple(t.global_shape), bool(getattr(t, "allow_shape_mismatch", False))))
    for key, (shape, may_differ) in wanted.items():
        if key not in saved:
            raise CheckpointError(f"{ckpt_dir}: the checkpoint does not match the model: tensor {key!r} "
                                  f"(shape {shape}) is not in the checkpoint")
        have = tuple(saved[key].global_shape)
        if have != shape and not may_differ:
            raise CheckpointError(f"{ckpt_dir}: the checkpoint does not match the model: tensor {key!r} has "
                                  f"shape {have} in the checkpoint, {shape} in the model")


def _unclaimed_tensors(ckpt_dir: str, model_state: dict) -> Optional[str]:
    """The error for model tensors of the checkpoint that no rank's model holds, or None (collective:
    with pipeline stages each rank holds only its stage's tensors, so the model is the union)."""
    from megatron.core import dist_checkpointing
    saved = dist_checkpointing.load_tensors_metadata(ckpt_dir)
    local = sorted({t.key for t in _sharded_tensors(model_state)})
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local)
        wanted = set().union(*parts)
    else:
        wanted = set(local)
    extra = sorted(k for k in saved if k not in wanted and not _OPTIM_KEY_RE.match(k) and k != RNG_KEY)
    if not extra:
        return None
    more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
    return (f"{ckpt_dir}: the checkpoint does not match the model: it has tensor {extra[0]!r}{more}, which the "
            "model lacks")


def _resolve(load_dir: str, step: Optional[int] = None):
    """(directory of the checkpoint, iteration or "release"), or None without a tracker file.

    ``step``: that iteration's checkpoint, whatever the tracker says (Megatron-LM's --ckpt-step).
    Otherwise the tracker's; when a save of that same iteration was killed after moving it aside
    (``iter_N.old-*``, module docstring), the moved-aside directory, which is whole.
    """
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be a non-negative int, got {step!r}")
        ckpt_dir = os.path.join(load_dir, checkpoint_dir_name(step))
        if not os.path.isdir(ckpt_dir):
            have = complete_iterations(load_dir)
            raise CheckpointError(f"--ckpt-step {step}: {ckpt_dir} does not exist (complete checkpoints in "
                                  f"{load_dir}: {', '.join(map(str, have)) or 'none'})")
        value = step
    else:
        value = _read_tracker(load_dir)
        if value is None:
            return None
        ckpt_dir = os.path.join(load_dir, "release" if value == "release" else checkpoint_dir_name(value))
        if not os.path.isdir(ckpt_dir):
            prefix = os.path.basename(ckpt_dir) + ".old-"
            aside = sorted(n for n in os.listdir(load_dir) if n.startswith(prefix)
                           and all(os.path.isfile(os.path.join(load_dir, n, f)) for f in _REQUIRED))
            if not aside:
                raise CheckpointError(f"{load_dir}: {_tracker_path(load_dir)} names {value!r} but {ckpt_dir} does "
                                      f"not exist{_earlier_hint(load_dir, None)}")
            warnings.warn(f"{ckpt_dir}: reading {aside[-1]}, where a save of the same iteration that did not "
                          "finish moved it (the next save puts it back)")
            ckpt_dir = os.path.join(load_dir, aside[-1])
    if not os.path.isfile(os.path.join(ckpt_dir, "metadata.json")):
        raise CheckpointError(f"{ckpt_dir}: not a megatron-core dist checkpoint (no metadata.json)")
    return ckpt_dir, value


def _iter_of(found) -> Optional[int]:
    return found[1] if found is not None and found[1] != "release" else None


def load_checkpoint(load_dir: str, model, optimizer, scheduler, *, load_optim: bool = True,
                    load_rng: bool = True, finetune: bool = False,
                    step: Optional[int] = None) -> Optional[Tuple[int, dict]]:
    """Load the checkpoint the tracker of ``load_dir`` names, or that of iteration ``step``
    (Megatron-LM's --ckpt-step) (collective: call on every rank).

    Returns ``(iteration, extra_state)``, or None when ``load_dir`` has no tracker file (and no
    ``step``).  Files that differ from the checkpoint's file list (``MANIFEST_FILENAME``) are an
    error naming the first of them and the complete checkpoints ``step`` can load instead.
    ``finetune`` (Megatron-LM's --finetune) and release checkpoints load the model weights only
    and return ``(0, {})``.  ``load_optim`` covers the optimizer and the scheduler (as Megatron-LM's
    --no-load-optim); when the optimizer state is not loaded, its main parameters are refreshed from
    the loaded weights.  ``load_rng`` restores the RNG states when the parallel layout is the saved
    one (a warning otherwise).  Raises CheckpointError, on every rank, naming the directory and
    the problem (missing checkpoint directory, corrupt tracker, a model of another shape, ...);
    problems found before reading (everything but an unreadable data file) leave the model,
    optimizer and scheduler untouched.
    """
    from megatron.core import dist_checkpointing

    rank, world = _world()
    models = _unwrap(model)
    load_dir = os.path.abspath(load_dir)

    # 1. find the checkpoint; every rank must see the same one
    error = local_exc = None
    found = common = None
    try:
        found = _resolve(load_dir, step)
        if found is not None:
            damaged = _verify_files(found[0], rank, world)
            if damaged:
                raise CheckpointError(f"{damaged}: the checkpoint is damaged{_earlier_hint(load_dir, _iter_of(found))}")
            common = dist_checkpointing.load_common_state_dict(found[0])
    except CheckpointError as e:
        error, local_exc = str(e), e
    except _ERRORS as e:
        error, local_exc = (f"{found[0] if found else load_dir}: unreadable checkpoint ({_describe(e)})"
                            f"{_earlier_hint(load_dir, _iter_of(found))}"), e
    reports = _agree("find", error, local_exc, found=None if found is None else str(found[1]))
    if len({rep["found"] for rep in reports}) > 1:
        raise CheckpointError(f"{load_dir}: ranks see different checkpoints "
                              f"({[rep['found'] for rep in reports]}): is it on a shared file system?")
    if found is None:
        if os.path.isdir(load_dir) and any(re.match(r"^iter_\d{7}$", n) for n in os.listdir(load_dir)):
            warnings.warn(f"{load_dir}: has iter_* directories but no {TRACKER_FILENAME}: not loading any "
                          "(step= / --ckpt-step loads one)")
        return None
    ckpt_dir, value = found
    release = value == "release"
    info = common.get("megatron_harts") or {}
    weights_only = finetune or release

    # 2. decide what to load; check the model against the checkpoint; build the request
    error = local_exc = None
    request = None
    do_optim = do_sched = do_rng = False
    try:
        if not weights_only and not info:
            raise CheckpointError(f"{ckpt_dir}: not written by megatron_harts (no 'megatron_harts' entry in "
                                  "common.pt): load it with finetune=True (weights only)")
        if info and info.get("num_model_chunks", len(models)) != len(models):
            raise CheckpointError(f"{ckpt_dir}: has {info['num_model_chunks']} model chunk(s), the model has "
                                  f"{len(models)}")
        content_metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) \
            or dict(BASE_METADATA)
        do_optim = not weights_only and load_optim and optimizer is not None
        if do_optim:
            if not info.get("optimizer"):
                raise CheckpointError(f"{ckpt_dir}: holds no optimizer state (saved without it): "
                                      "load with load_optim=False (--no-load-optim)")
            saved_dist, ours = bool(info.get("distributed_optimizer")), _is_distributed_optimizer(optimizer)
            if ours:
                _require_optimizer_patches()
            if saved_dist != ours:
                kind = {True: "a distributed", False: "a non-distributed"}
                raise CheckpointError(f"{ckpt_dir}: optimizer state was saved by {kind[saved_dist]} optimizer, "
                                      f"this run uses {kind[ours]} one: load with load_optim=False "
                                      "(--no-load-optim) to start the optimizer afresh")
        do_sched = do_optim and scheduler is not None
        if do_sched and "opt_param_scheduler" not in common:
            raise CheckpointError(f"{ckpt_dir}: holds no learning-rate scheduler state")
        if not weights_only and load_rng:
            if not info.get("rng"):
                warnings.warn(f"{ckpt_dir}: saved without RNG state: the RNG state is not restored")
            elif info.get("layout") != _parallel_layout():
                warnings.warn(f"{ckpt_dir}: saved with parallel layout {info.get('layout')}, this run has "
                              f"{_parallel_layout()}: RNG states are per rank, so they are not restored "
                              "(pass load_rng=False / --no-load-rng to silence this)")
            else:
                do_rng = True
        metadata = _runtime_metadata(content_metadata)
        request = _model_state(models, metadata)
        _check_model_matches(ckpt_dir, request)
    except CheckpointError as e:
        error, local_exc = str(e), e
    except _ERRORS as e:
        error, local_exc = f"{ckpt_dir}: {_describe(e)}", e
    _agree("plan", error, local_exc)
    _agree("plan", _unclaimed_tensors(ckpt_dir, request))

    # 3. read
    error = local_exc = None
    loaded = None
    try:
        if do_optim:
            # (allocates the optimizer's state, which the read then fills)
            request["optimizer"] = optimizer.sharded_state_dict(request, is_loading=True, metadata=metadata)
        if do_rng:
            request["rng_state"] = _rng_sharded_object(None, rank, world)
        loaded = dist_checkpointing.load(request, ckpt_dir)
    except _ERRORS as e:
        error, local_exc = (f"{ckpt_dir}: reading the checkpoint failed ({_describe(e)})"
                            f"{_earlier_hint(load_dir, _iter_of(found))}"), e
    _agree("read", error, local_exc)

    # 4. apply
    error = local_exc = None
    extra = {}
    try:
        # (no autograd: with fp32 parameters the distributed optimizer's main parameters are views
        # of the model's leaf parameters, which its dp_reshardable loader copies into in place)
        with torch.no_grad():
            for i, m in enumerate(models):
                m.load_state_dict(loaded[_model_key(i, len(models))], strict=True)
            if do_optim:
                optimizer.load_state_dict(loaded["optimizer"])
            elif optimizer is not None:
                optimizer.reload_model_params()
        if do_sched:
            try:
                scheduler.load_state_dict(loaded["opt_param_scheduler"])
            except AssertionError as e:
                raise CheckpointError(f"{ckpt_dir}: the learning-rate schedule differs from the saved one "
                                      f"({e})") from None
        if do_rng:
            _restore_rng_state(loaded["rng_state"])
        if not weights_only:
            extra = json.loads(info.get("extra_state") or "{}")
    except CheckpointError as e:
        error, local_exc = str(e), e
    except _ERRORS as e:
        error, local_exc = f"{ckpt_dir}: applying the loaded state failed ({_describe(e)})", e
    _agree("apply", error, local_exc)
    iteration = 0 if weights_only else int(common["iteration"])
    logger.info("loaded %s (iteration %d)", ckpt_dir, iteration)
    return iteration, extra

