"""Training data loader: the rollout-tree dataset cut into planned global batches, one per step.

``TreeBatchLoader(source, global_batch_size=G, seed=..., plan_fn=...)`` is an endless iterator
of ``StepBatch``: the step's trees as one ``Forest`` (``Forest.select``), their dataset
indices, and the plan ``plan_fn`` made of them.  ``--global-batch-size`` counts trajectories.

Invariants (tests/test_training_data.py pins them):

1. Source.  A dataset prefix (``PREFIX.bin``/``.idx``, or a ``TreeDataset``) is read lazily:
   the index tables are in memory, the rows stay memory-mapped, a step reads the bytes of its
   own trees only, into memory of its own, and checks each tree's CRC32 after copying it, every
   time it reads it: a tree damaged or rewritten in place, also while a job runs, fails the step
   holding it with the dataset's ``TreeFormatError`` naming the tree and the file, never a batch
   of other data.  A data file replaced or resized under a running loader (a new file at the
   same path, e.g. the dataset converted again) is a ``LoaderError`` at the next step: the
   loader keeps the file it opened mapped, so it names the change rather than training on.  An
   in-memory ``Forest`` (tests, the library trainer) and trajectory files (JSONL/Parquet,
   through ``tree_data.load_forest``, built in memory) are accepted too.
2. Order.  Epoch ``e`` visits the trees in the permutation
   ``numpy.random.default_rng([seed, e]).permutation(num_trees)`` (``shuffle=False``: file
   order).  Epochs follow one another without end; the iterator never stops by itself.
3. Steps.  A step takes the next trees of its epoch's order, whole, greedily while the step's
   trajectory count stays ``<= G``: it stops before the first tree that does not fit (no
   look-ahead, so the visiting order is exactly the permutation), always holds at least one
   tree, and never spans an epoch boundary (the last step of an epoch may be short; a tree
   never appears twice in a step).  So a step holds at most ``G`` trajectories, often fewer.
   A tree of more than ``G`` trajectories, and a source without trees, are refused when the
   loader is built (``LoaderError``, a ``ValueError``, naming the file).
4. Background planning.  With ``prefetch=k >= 1`` one daemon worker thread loads and plans
   steps ``i+1 .. i+k`` while the caller trains step ``i`` (``prefetch=0``: everything runs in
   the caller's thread).  An exception raised while loading or planning step ``i`` is
   re-raised, as the same exception object, by the ``next()`` that asks for step ``i``; steps
   before it are delivered normally, and the loader refuses to go on afterwards (build a new
   one from ``state_dict()`` to retry).  ``close()`` (also on ``with`` exit and when the loader
   is garbage collected) cancels the steps not started and stops the worker once its current
   step is done; the thread is a daemon, so a plan that never returns cannot hang the exit.
5. Determinism.  Step composition depends only on (seed, shuffle, G, the source's per-tree
   trajectory counts); a step's forest only on its trees.  Every data-parallel rank and every
   pipeline stage runs its own loader with the same arguments and, with a deterministic
   ``plan_fn`` (plan_l1, plan_harts, plan_ffd, plan_tree_ffd are; plan_ortools_ffd is not: its
   CP-SAT search is time-limited and multi-threaded), gets identical batches and identical
   plans with no communication: no broadcast of plan metadata to pipeline stages is needed.
   ``plan_digest`` fingerprints a plan (timings excluded) for a cheap cross-rank check.
   ``plan_seconds`` and ``load_seconds`` are wall times and differ between ranks.
6. Resume.  ``state_dict()`` is the position after the last batch ``next()`` returned (steps
   prefetched by the worker do not count): a small JSON-serializable dict.  A loader built
   with ``start=state`` (or after ``load_state_dict(state)``) yields exactly the batches the
   uninterrupted run yields from that iteration on.  A state saved with another seed,
   shuffle, global batch size or source (tree count, per-tree trajectory counts, and for a
   dataset its per-tree CRC32s) is refused, naming what differs: a resumed run never silently
   changes its data order or its data.

Imports no torch (the layering rule of tree_data and planner holds here too).
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import os
import queue
import threading
import time
import weakref
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, Optional, Tuple

import numpy as np

from ..tree_data.dataset import TreeDataset, is_dataset, load_forest
from ..tree_data.forest import Forest

__all__ = ["LoaderError", "StepBatch", "TreeBatchLoader", "replica_share", "plan_digest",
           "STATE_VERSION"]

STATE_VERSION = 1
_STATE_KEYS = ("version", "seed", "shuffle", "global_batch_size", "num_trees", "tree_sizes_crc32",
               "epoch", "position", "iteration")
# in states of datasets only (and absent from states saved before it existed): CRC32 of the index's
# per-tree CRC32 table, i.e. of the data
_CONTENT_KEY = "tree_crcs_crc32"


class LoaderError(ValueError):
    """A source, a global batch size or a resume state the loader refuses (one-line message)."""


@dataclass
class StepBatch:
    """One optimizer step's data.

    ``forest`` holds the step's trees in step order: its tree ``j`` is dataset tree
    ``tree_ids[j]`` (indices re-based by ``Forest.select``; trajectory ids unchanged).
    ``plan`` is what ``plan_fn(forest)`` returned (None without a plan function);
    ``plan_seconds`` and ``load_seconds`` are the wall times of planning and of reading.
    """
    iteration: int
    epoch: int
    tree_ids: np.ndarray
    forest: Forest
    num_trajectories: int
    expanded_tokens: int
    plan: Any = None
    plan_seconds: float = 0.0
    load_seconds: float = 0.0

    def replica_share(self, replica: int) -> list:
        """``replica_share(self, replica)``."""
        return replica_share(self, replica)


def replica_share(batch: StepBatch, replica: int) -> list:
    """The microbatches data-parallel rank ``replica`` runs in this step, slot by slot (None:
    an idle slot): ``batch.plan.schedule(replica)``."""
    plan = batch.plan
    if plan is None:
        raise ValueError(f"step {batch.iteration} has no plan (the loader was built without plan_fn)")
    if isinstance(replica, bool) or not isinstance(replica, (int, np.integer)) \
            or not 0 <= replica < plan.num_replicas:
        raise ValueError(f"replica must be an integer in [0, {plan.num_replicas}) (the plan's "
                         f"data-parallel size), got {replica!r}")
    return plan.schedule(int(replica))


def plan_digest(plan) -> str:
    """SHA-256 of a ``MicrobatchPlan``'s contents: planner, sizes, slots, every microbatch's
    segments / trajectories / external reads / consumers / features, the sharing windows.
    Timings (``plan_seconds``) are left out, so identical plans on two ranks agree."""
    h = hashlib.sha256()

    def ints(x) -> None:
        h.update(np.ascontiguousarray(np.asarray(x, dtype=np.int64)).tobytes())
        h.update(b"|")

    h.update(repr((plan.planner, plan.mode, plan.num_replicas, plan.num_slots, plan.row_budget,
                   plan.chunk_size, plan.expanded_tokens)).encode())
    ints(plan.slots.ravel())
    for m in plan.microbatches:
        ints([m.index, m.replica, m.slot, m.recomputed_rows])
        ints(m.owned)
        ints(m.recomputed)
        ints(m.trajectories)
        ints(m.consumers)
        for e in m.external:
            ints([e.producer, e.rows])
            ints(e.segments)
        h.update(repr((m.features, m.cost)).encode())
    for w in plan.windows:
        ints([w.producer, w.rows, w.producer_slot, w.last_slot])
        ints(w.consumers)
        ints(w.segments)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# source and order
# ---------------------------------------------------------------------------------------------

class _Source:
    """Where the trees come from.  ``tree_trajs[i]``: trajectories of tree ``i``.

    For a dataset, ``forest`` has the index tables in memory and memory-mapped rows, so
    ``forest.select`` reads the selected trees' bytes only.
    """

    def __init__(self, source, vocab_size: Optional[int]):
        self.dataset: Optional[TreeDataset] = None
        if isinstance(source, Forest):
            self.name = "<in-memory forest>"
            self.forest = source
        elif isinstance(source, TreeDataset):
            self.dataset = source
        elif isinstance(source, (str, os.PathLike)):
            path = os.fspath(source)
            if is_dataset(path):
                self.dataset = TreeDataset(path)
            else:
                self.name = path
                self.forest = load_forest(path, vocab_size=vocab_size)
        else:
            raise TypeError("source must be a dataset prefix, a trajectory file, a TreeDataset or a Forest, "
                            f"got {type(source).__name__}")
        self.content_crc: Optional[int] = None
        if self.dataset is not None:
            self.name = self.dataset.idx_path
            self.forest = self.dataset.forest(verify=False)
            self.content_crc = zlib.crc32(np.ascontiguousarray(self.dataset._tables["tree_crc"]).tobytes())
            self._identity = _file_identity(self.dataset.bin_path)
        f = self.forest
        roots = np.asarray(f.tree_offsets[:-1], dtype=np.int64)
        lo = np.asarray(f.seg_traj_lo, dtype=np.int64)[roots]
        hi = np.asarray(f.seg_traj_hi, dtype=np.int64)[roots]
        self.tree_trajs = hi - lo
        self.num_trees = int(roots.shape[0])
        self.sizes_crc = zlib.crc32(self.tree_trajs.tobytes())
        self._lock = threading.Lock()

    def load(self, tree_ids: np.ndarray) -> Forest:
        """The trees ``tree_ids`` as one forest in memory of its own; from a dataset, each tree's
        CRC32 checked against the index after the copy (invariant 1)."""
        if self.dataset is not None:
            now = _file_identity(self.dataset.bin_path)
            if now != self._identity:
                raise LoaderError(f"{self.dataset.bin_path}: the data file was replaced or resized while the job "
                                  f"ran ({_describe_identity(self._identity)} when opened, "
                                  f"{_describe_identity(now)} now): restart the job (--load resumes it)")
        f = self.forest.select(tree_ids)
        if self.dataset is not None:
            if tree_ids.shape[0] == 1:
                f = _owned(f)              # a single tree comes back as views of the mapped file
            with self._lock:
                for i in tree_ids.tolist():
                    self.dataset._verify(i)    # the dataset's per-tree CRC32 check, after the copy
        if f.tokens.dtype != np.int64:
            f.tokens = np.asarray(f.tokens, dtype=np.int64)
        return f


def _file_identity(path: str) -> Optional[Tuple[int, int, int]]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size


def _describe_identity(ident: Optional[Tuple[int, int, int]]) -> str:
    return "missing" if ident is None else f"inode {ident[1]}, {ident[2]} bytes"


def _owned(value):
    """``value`` (a Forest, its Exceptions, arrays, lists) with every array copied."""
    if isinstance(value, np.ndarray):
        return np.array(value, copy=True)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _owned(getattr(value, f.name))
                                             for f in dataclasses.fields(value) if f.init})
    return value


@dataclass(frozen=True)
class _Job:
    """One step's composition and the position after it."""
    iteration: int
    epoch: int
    tree_ids: np.ndarray
    next_epoch: int
    next_position: int


class _Cursor:
    """Walks the epochs' orders step by step (invariants 2 and 3 of the module docstring)."""

    def __init__(self, tree_trajs: np.ndarray, G: int, seed: int, shuffle: bool):
        self.tree_trajs = tree_trajs
        self.G = G
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = self.position = self.iteration = 0
        self._order_epoch = -1
        self._order = np.zeros(0, dtype=np.int64)

    def order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            n = self.tree_trajs.shape[0]
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(n).astype(np.int64)
            else:
                self._order = np.arange(n, dtype=np.int64)
            self._order_epoch = epoch
        return self._order

    def seek(self, epoch: int, position: int, iteration: int) -> None:
        self.epoch, self.position, self.iteration = epoch, position, iteration

    def next_job(self) -> _Job:
        order = self.order(self.epoch)
        p = self.position
        window = order[p: p + self.G]            # every tree has >= 1 trajectory
        fill = np.cumsum(self.tree_trajs[window])
        k = max(1, int(np.searchsorted(fill, self.G, side="right")))
        tree_ids = window[:k].copy()
        tree_ids.setflags(write=False)
        nxt_epoch, nxt_pos = self.epoch, p + k
        if nxt_pos >= order.shape[0]:
            nxt_epoch, nxt_pos = self.epoch + 1, 0
        job = _Job(self.iteration, self.epoch, tree_ids, nxt_epoch, nxt_pos)
        self.seek(nxt_epoch, nxt_pos, self.iteration + 1)
        return job


def _build(source: _Source, plan_fn: Optional[Callable], job: _Job) -> StepBatch:
    t0 = time.perf_counter()
    forest = source.load(job.tree_ids)
    t1 = time.perf_counter()
    plan = plan_fn(forest) if plan_fn is not None else None
    t2 = time.perf_counter()
    return StepBatch(iteration=job.iteration, epoch=job.epoch, tree_ids=job.tree_ids, forest=forest,
                     num_trajectories=forest.num_trajectories,
                     expanded_tokens=int(np.asarray(forest.traj_length, dtype=np.int64).sum()),
                     plan=plan, plan_seconds=t2 - t1 if plan_fn is not None else 0.0,
                     load_seconds=t1 - t0)


# ---------------------------------------------------------------------------------------------
# background worker (module-level: it holds no reference to the loader, so the loader can be
# garbage collected while the worker waits)
# ---------------------------------------------------------------------------------------------

_Pending = Deque[Tuple[concurrent.futures.Future, _Job]]


def _worker(jobs: "queue.SimpleQueue", source: _Source, plan_fn: Optional[Callable]) -> None:
    while True:
        item = jobs.get()
        if item is None:
            return
        fut, job = item
        if not fut.set_running_or_notify_cancel():
            continue  # cancelled by close() / load_state_dict()
        try:
            fut.set_result(_build(source, plan_fn, job))
        except BaseException as e:  # re-raised in the caller, at the step it belongs to
            fut.set_exception(e)
        del fut, item


def _cancel(pending: _Pending) -> None:
    while pending:
        fut, _ = pending.popleft()
        fut.cancel()


def _shutdown(jobs: "queue.SimpleQueue", pending: _Pending) -> None:
    _cancel(pending)
    jobs.put(None)


# ---------------------------------------------------------------------------------------------
# the loader
# ---------------------------------------------------------------------------------------------

def _check_int(name: str, value, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise LoaderError(f"{name} must be an integer >= {lo}, got {value!r}")
    return int(value)


class TreeBatchLoader:
    """Endless iterator of ``StepBatch`` (module docstring: invariants 1-6).

    ``source``: dataset prefix (or ``.bin``/``.idx`` path), trajectory file, ``TreeDataset``
    or ``Forest``.  ``global_batch_size``: trajectories per step at most (``--global-batch-size``).
    ``plan_fn(forest) -> plan``: the trainer's planner, e.g.
    ``lambda f: plan_harts(f, dp, row_budget)[1]``.  ``prefetch``: steps loaded and planned
    ahead by the worker thread (0: none, no thread).  ``start``: a ``state_dict()`` to resume
    from.  ``vocab_size``: checked when reading trajectory files.
    """

    def __init__(self, source, *, global_batch_size: int, seed: int = 0, shuffle: bool = True,
                 plan_fn: Optional[Callable[[Forest], Any]] = None, prefetch: int = 1,
                 start: Optional[Dict[str, Any]] = None, vocab_size: Optional[int] = None):
        self.global_batch_size = _check_int("--global-batch-size", global_batch_size, 1)
        self.seed = _check_int("seed", seed, 0)
        self.shuffle = bool(shuffle)
        self.prefetch = _check_int("prefetch", prefetch, 0)
        if plan_fn is not None and not callable(plan_fn):
            raise TypeError(f"plan_fn must be callable, got {type(plan_fn).__name__}")
        self.plan_fn = plan_fn
        self._source = _Source(source, vocab_size)
        src = self._source
        if src.num_trees == 0:
            raise LoaderError(f"{src.name}: the dataset has no trees (nothing to train on)")
        G = self.global_batch_size
        big = np.flatnonzero(src.tree_trajs > G)
        if big.size:
            i = int(big[0])
            raise LoaderError(
                f"{src.name}: tree {i} has {int(src.tree_trajs[i])} trajectories, more than "
                f"--global-batch-size {G} (a step takes whole trees; {big.size} tree(s) too big): "
                f"use --global-batch-size >= {int(src.tree_trajs.max())}")
        self._delivered = _Cursor(src.tree_trajs, G, self.seed, self.shuffle)  # what next() returned
        self._ahead = _Cursor(src.tree_trajs, G, self.seed, self.shuffle)      # what was scheduled
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._pending: _Pending = collections.deque()
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._failed: Optional[str] = None
        self._finalizer = weakref.finalize(self, _shutdown, self._jobs, self._pending)
        if start is not None:
            self.load_state_dict(start)

    # ---- facts ---------------------------------------------------------------------------
    @property
    def source_name(self) -> str:
        return self._source.name

    @property
    def source_forest(self) -> Forest:
        """The whole source as one forest (a dataset's: index tables in memory, rows memory-mapped)."""
        return self._source.forest

    @property
    def num_trees(self) -> int:
        return self._source.num_trees

    @property
    def tree_trajectories(self) -> np.ndarray:
        """int64[num_trees]: trajectories of every tree of the source."""
        return self._source.tree_trajs

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The order in which epoch ``epoch`` visits the trees."""
        c = _Cursor(self._source.tree_trajs, self.global_batch_size, self.seed, self.shuffle)
        return c.order(_check_int("epoch", epoch, 0)).copy()

    # ---- iteration -----------------------------------------------------------------------
    def __iter__(self) -> "TreeBatchLoader":
        return self

    def __next__(self) -> StepBatch:
        if self._closed:
            raise RuntimeError("the data loader is closed")
        if self._failed is not None:
            raise RuntimeError(self._failed)
        if self.prefetch == 0:
            job = self._ahead.next_job()
            try:
                batch = _build(self._source, self.plan_fn, job)
            except BaseException as e:
                self._fail(job, e)
                raise
            self._deliver(job)
            return batch
        if self._thread is None:
            self._thread = threading.Thread(target=_worker, args=(self._jobs, self._source, self.plan_fn),
                                            name="harts-data-loader", daemon=True)
            self._thread.start()
        if not self._pending:
            self._submit()
        fut, job = self._pending.popleft()
        while len(self._pending) < self.prefetch:   # the worker goes on with the next steps
            self._submit()
        try:
            batch = fut.result()
        except BaseException as e:
            if fut.done() and not fut.cancelled() and fut.exception() is e:
                self._fail(job, e)          # the step's own error
            else:
                self._pending.appendleft((fut, job))   # interrupted while waiting: keep the step
            raise
        self._deliver(job)
        return batch

    def _submit(self) -> None:
        job = self._ahead.next_job()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._pending.append((fut, job))
        self._jobs.put((fut, job))

    def _deliver(self, job: _Job) -> None:
        self._delivered.seek(job.next_epoch, job.next_position, job.iteration + 1)

    def _fail(self, job: _Job, err: BaseException) -> None:
        _cancel(self._pending)
        self._failed = (f"the data loader stopped at iteration {job.iteration} after an error while "
                        f"loading or planning it ({type(err).__name__}: {err}); build a new one "
                        "with start=state_dict() to retry")

    # ---- resumable position ----------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Position after the last batch ``next()`` returned (JSON-serializable)."""
        d = self._delivered
        return {"version": STATE_VERSION, "seed": self.seed, "shuffle": self.shuffle,
                "global_batch_size": self.global_batch_size, "num_trees": self.num_trees,
                "tree_sizes_crc32": self._source.sizes_crc, "epoch": d.epoch, "position": d.position,
                "iteration": d.iteration, **({_CONTENT_KEY: self._source.content_crc}
                                            if self._source.content_crc is not None else {})}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resume at ``state`` (from ``state_dict()``); steps already prefetched are dropped."""
        if self._closed:
            raise RuntimeError("the data loader is closed")
        if not isinstance(state, dict):
            raise LoaderError(f"a data loader state must be a dict, got {type(state).__name__}")
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise LoaderError(f"data loader state lacks {', '.join(missing)}")
        if state["version"] != STATE_VERSION:
            raise LoaderError(f"data loader state version {state['version']!r} (this build reads "
                              f"{STATE_VERSION})")
        mine = self.state_dict()
        labels = {"seed": "seed", "shuffle": "shuffle", "global_batch_size": "--global-batch-size",
                  "num_trees": "number of trees in the dataset",
                  "tree_sizes_crc32": "trajectories per tree (CRC32) in the dataset"}
        diff = [f"{label}: state {state[k]!r}, loader {mine[k]!r}" for k, label in labels.items()
                if state[k] != mine[k]]
        if diff:
            raise LoaderError(f"{self.source_name}: the resume state does not match this loader ("
                              + "; ".join(diff) + "): resuming would change the data order")
        if state.get(_CONTENT_KEY) is not None and mine.get(_CONTENT_KEY) is not None \
                and state[_CONTENT_KEY] != mine[_CONTENT_KEY]:
            raise LoaderError(f"{self.source_name}: the dataset's contents differ from those the resume state was "
                              f"saved with (per-tree CRC32s: state {state[_CONTENT_KEY]}, dataset "
                              f"{mine[_CONTENT_KEY]}): resuming would train on other data")
        epoch = _check_int("state epoch", state["epoch"], 0)
        iteration = _check_int("state iteration", state["iteration"], 0)
        position = _check_int("state position", state["position"], 0)
        if position >= self.num_trees:
            raise LoaderError(f"state position {position} is outside an epoch of {self.num_trees} trees")
        _cancel(self._pending)
        self._failed = None
        self._ahead.seek(epoch, position, iteration)
        self._delivered.seek(epoch, position, iteration)

    # ---- shutdown --------------------------------------------------------------------------
    def close(self, timeout: Optional[float] = 10.0) -> bool:
        """Cancel the steps not started and stop the worker; wait up to ``timeout`` seconds
        for it to finish its current step.  True when no worker thread is left running."""
        self._closed = True
        self._finalizer()          # cancels the pending steps and tells the worker to stop
        t = self._thread
        if t is None:
            return True
        t.join(timeout)
        return not t.is_alive()

    def __enter__(self) -> "TreeBatchLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def worker_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
