"""Cost model of a microbatch, its calibration file, and the forest index the planners share.

The cost (seconds of one forward + backward of a microbatch on one GPU) is linear in six
features of the microbatch:

========================  ====================================================================
feature                   meaning
========================  ====================================================================
``microbatch``            1 per microbatch (launch overheads, mask building, MoE dispatch)
``rows``                  rows computed (owned + recomputed segments): every layer's dense work
``attention_pairs``       visible (query, key) pairs of the MLA layers: a row at path position
                          ``p`` sees its ``p + 1`` root-path keys, whether computed here or
                          read from a producer (external rows cost pairs, not rows)
``kda_calls``             packed KDA kernel calls (``planner.calls.plan_calls`` on the
                          microbatch's segments; a segment whose parent is external starts a
                          sequence at ``floor(p/B)*B`` from the producer's state, in any call)
``kda_replay_tokens``     KDA replay tokens (recomputed inside the KDA core only)
``logits_rows``           rows with at least one target (output layer and loss), owned only
========================  ====================================================================

Default coefficients (``CostCoefficients()``) are estimates for a Kimi-Linear-48B-A3B-shaped
model (27 layers, 3 KDA : 1 MLA, 3B active parameters, hidden 2304, vocabulary 163840, MLA
32 heads with q/k dim 192 and v dim 128) on one H200 at about 40% of bf16 peak:
``row`` = 6 x 3e9 FLOP / 4e14 FLOP/s = 4.5e-5 s; ``attention_pair`` = 7 MLA layers x 6 x 32 x
320 FLOP / 3e14 FLOP/s = 1.4e-9 s; ``kda_call`` = 20 KDA layers x 0.3 ms of fixed launch and
state work (fwd + bwd) = 6e-3 s; ``kda_replay_token`` = 20 layers x 0.47 us (measured chunk_kda
fwd+bwd throughput, 9k tokens in 4.2 ms) = 9e-6 s; ``logits_row`` = 6 x 2304 x 163840 FLOP /
4e14 FLOP/s = 5.7e-6 s; ``microbatch`` = 2e-2 s.  Only their ratios matter to the planner.

Calibration file (JSON, written by ``save_calibration``, read by ``load_calibration``)::

    {
      "format": "megatron_harts.cost_calibration",
      "version": 1,
      "unit": "seconds",
      "chunk_size": 64,
      "coefficients": {"microbatch": 0.02, "row": 4.5e-05, "attention_pair": 1.4e-09,
                       "kda_call": 0.006, "kda_replay_token": 9e-06, "logits_row": 5.7e-06},
      "source": {"device": "NVIDIA H200", "samples": 48, "r2": 0.998}
    }

Every key but ``source`` (free-form, optional) is required; coefficients are finite numbers
>= 0 and ``row`` > 0; unknown keys are refused.  ``fit_calibration`` fits the coefficients to
measured microbatch times (non-negative least squares) for the GPU benchmark to save.
"""
from __future__ import annotations

import functools
import gc
import itertools
import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .compiled import compiled

__all__ = [
    "CostCoefficients", "CostFeatures", "CostModel", "ForestIndex", "CalibrationError",
    "load_calibration", "save_calibration", "fit_calibration", "CALIBRATION_FORMAT", "gc_paused",
]

CALIBRATION_FORMAT = "megatron_harts.cost_calibration"
CALIBRATION_VERSION = 1


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class CostCoefficients:
    """Seconds per unit of each feature (see the module docstring for the defaults)."""
    microbatch: float = 2.0e-2
    row: float = 4.5e-5
    attention_pair: float = 1.4e-9
    kda_call: float = 6.0e-3
    kda_replay_token: float = 9.0e-6
    logits_row: float = 5.7e-6

    def vector(self) -> np.ndarray:
        return np.array([getattr(self, f.name) for f in fields(self)], dtype=np.float64)


COEFFICIENT_NAMES = tuple(f.name for f in fields(CostCoefficients))


@dataclass(frozen=True)
class CostFeatures:
    """The features of one microbatch (``external_rows`` is informative: no cost of its own)."""
    rows: int = 0
    attention_pairs: int = 0
    kda_calls: int = 0
    replay_tokens: int = 0
    logits_rows: int = 0
    external_rows: int = 0

    def vector(self) -> np.ndarray:
        """Feature vector in ``COEFFICIENT_NAMES`` order (the first entry is 1: the microbatch)."""
        return np.array([1.0, self.rows, self.attention_pairs, self.kda_calls,
                         self.replay_tokens, self.logits_rows], dtype=np.float64)


def gc_paused(fn):
    """Decorator: run ``fn`` with Python's cyclic garbage collector paused (its previous state
    restored after).  Planning allocates many short-lived, acyclic lists and tuples; a
    collection they trigger scans every tracked object of the process (a full one costs
    milliseconds in a trainer holding a large heap), more than planning a small batch.
    Reference counting frees everything as usual."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()
    return wrapper


class ForestIndex:
    """Per-segment arrays the planners and the cost model share (built once per forest).

    ``sub_rows[s]`` rows in the subtree of ``s``; ``seg_pairs[s]`` attention pairs of the rows
    of ``s`` (``sum over p in [start, start+len) of p + 1``, less the keys compaction events evict:
    ``Forest.row_evicted``); ``seg_logits[s]`` rows of ``s``
    whose next token is a target of at least one trajectory through them (the rows the model
    computes logits for: row-level loss masks and per-trajectory loss-mask exceptions, as the
    layout reads them); ``traj_targets[t]`` targets of trajectory ``t`` (exceptions included);
    ``traj_pairs[t]`` attention pairs of trajectory ``t`` computed on its own (compaction applied);
    ``tree_max_path[t]`` the longest trajectory of tree ``t``.
    """

    @gc_paused
    def __init__(self, forest, compiled_core: bool = True):
        """``compiled_core``: build the arrays with ``_C.forest_index`` when it is built (the same
        values as ``_build_python``, the reference; False: the reference)."""
        self.forest = forest
        f = forest
        self.num_segments = f.num_segments
        self.parent_arr = f.seg_parent.astype(np.int64)
        self.start = f.seg_start.astype(np.int64)
        self.length = f.seg_length.astype(np.int64)
        self.row = f.seg_row.astype(np.int64)
        self.tree_offsets = f.tree_offsets.astype(np.int64)
        self.num_trees = f.num_trees
        self.traj_length = f.traj_length.astype(np.int64)
        self.expanded_tokens = int(self.traj_length.sum())
        out = None
        if compiled_core and _FOREST_INDEX is not None:
            exc = f.exc_loss_mask
            out = _FOREST_INDEX(self.parent_arr, self.start, self.length, self.row,
                                self.tree_offsets, f.row_loss_mask, f.traj_leaf,
                                self.traj_length, f.seg_traj_lo, f.seg_traj_hi, exc.traj,
                                exc.pos, exc.value)
        if out is None:
            self._build_python()
        else:
            (self.seg_pairs, self.seg_logits, self.sub_rows, self.sub_size, self.traj_targets,
             self.tree_max_path, longest, self.tree_rows, self.seg_tree, self.children) = out
            self.tree_longest_traj = longest.tolist()
        # attention pairs of each trajectory on its own (expanded mode): its root path's
        self.traj_pairs = self.traj_length * (self.traj_length + 1) // 2
        if getattr(f, "has_compactions", False):
            # keys evicted by compaction events are not attention pairs (both builds count without them)
            self.seg_pairs = self.seg_pairs - _segment_counts_int(f.row_evicted(), self.row)
            path_pairs = self.seg_pairs.copy()
            for seg in range(self.num_segments):          # parents precede children
                if self.parent_arr[seg] >= 0:
                    path_pairs[seg] += path_pairs[self.parent_arr[seg]]
            self.traj_pairs = path_pairs[f.traj_leaf]
        # list twins of per-segment arrays, for the planners' per-segment Python loops
        self.parent = self.parent_arr.tolist()
        self.sub_rows_list = self.sub_rows.tolist()
        self.sub_size_list = self.sub_size.tolist()
        self.start_list = self.start.tolist()
        self.length_list = self.length.tolist()

    def _build_python(self):
        """Reference of ``_C.forest_index``: ``seg_pairs``, ``seg_logits``, ``sub_rows``,
        ``sub_size``, ``traj_targets``, ``tree_max_path``, ``tree_longest_traj``, ``tree_rows``,
        ``seg_tree`` and ``children`` (per segment its children, in id order) from the arrays
        ``__init__`` set."""
        f = self.forest
        S = self.num_segments
        par = self.parent_arr.tolist()
        st, ln = self.start, self.length
        self.seg_pairs = ln * st + ln * (ln + 1) // 2
        mask = f.row_loss_mask
        seg_mask = _segment_counts(mask, self.row)
        first = mask[self.row].astype(np.int64)
        interior = seg_mask - first
        last = np.zeros(S, dtype=np.int64)
        has_parent = self.parent_arr >= 0
        kids = np.flatnonzero(has_parent)
        np.maximum.at(last, self.parent_arr[kids], first[kids])
        self.seg_logits = interior + last
        if f.exc_loss_mask.traj.size:  # rows that predict a target of some trajectory's exception only
            exc_added, exc_delta = _exception_targets(f, self.parent_arr, st, ln, self.row, last)
            self.seg_logits += exc_added
        # subtree sums and path sums by plain loops over lists (parents precede children)
        children: List[List[int]] = [[] for _ in range(S)]
        sub_rows = ln.tolist()
        sub_size = [1] * S
        for s in range(S - 1, -1, -1):
            p = par[s]
            if p >= 0:
                sub_rows[p] += sub_rows[s]
                sub_size[p] += sub_size[s]
        for s in kids.tolist():
            children[par[s]].append(s)
        self.children = children
        self.sub_rows = np.array(sub_rows, dtype=np.int64)
        self.sub_size = np.array(sub_size, dtype=np.int64)
        # per trajectory: targets (positions j >= 1 with loss mask) for expanded packing
        path_mask = seg_mask.tolist()
        for s in kids.tolist():
            path_mask[s] += path_mask[par[s]]
        path_mask = np.array(path_mask, dtype=np.int64)
        roots = self.tree_offsets[:-1]
        root_first = np.zeros(S, dtype=np.int64)
        root_first[roots] = first[roots]
        root_of = np.repeat(roots, np.diff(self.tree_offsets))
        leaf = f.traj_leaf.astype(np.int64)
        self.traj_targets = path_mask[leaf] - root_first[root_of[leaf]]
        if f.exc_loss_mask.traj.size:
            self.traj_targets += exc_delta
        lo = f.seg_traj_lo[roots]
        hi = f.seg_traj_hi[roots]
        self.tree_max_path = np.array([self.traj_length[a:b].max() for a, b in zip(lo, hi)], dtype=np.int64)
        self.tree_longest_traj = [int(a + np.argmax(self.traj_length[a:b])) for a, b in zip(lo, hi)]
        self.tree_rows = np.add.reduceat(ln, roots) if S else np.zeros(0, np.int64)
        self.seg_tree = f.seg_tree


_FOREST_INDEX = compiled("forest_index")  # ForestIndex._build_python, compiled
_EXC_TARGETS = compiled("exception_targets")  # _exception_targets_python, compiled


def _exception_targets(f, parent: np.ndarray, start: np.ndarray, length: np.ndarray, seg_row: np.ndarray,
                       last: np.ndarray):
    """``_exception_targets_python``'s arrays, from the compiled ``_C.exception_targets`` when it is
    built (the same values)."""
    exc = f.exc_loss_mask
    if _EXC_TARGETS is not None and exc.traj.size:
        return _EXC_TARGETS(parent, start, length, seg_row, f.traj_leaf, f.row_loss_mask, last, exc.traj,
                            exc.pos, exc.value)
    return _exception_targets_python(f, parent, start, length, seg_row, last)


def _exception_targets_python(f, parent: np.ndarray, start: np.ndarray, length: np.ndarray, seg_row: np.ndarray,
                              last: np.ndarray):
    """What the loss-mask exceptions add: (per segment, its rows that predict a target only an
    exception sets (``last[s]``: whether the row masks count the last row of ``s`` already), per
    trajectory the change to its target count).

    An exception ``(t, p, v)`` at ``p >= 1`` overrides trajectory ``t``'s loss mask at path
    position ``p`` (row mask ``m``): its target count changes by ``(v != 0) - (m != 0)``, and
    where ``v != 0 == m`` the row at position ``p - 1`` of ``t``'s path predicts a target.  A
    row's own mask is its reference trajectory's (one through it), so an exception never removes
    a logits row.  The segment holding ``(t, p)``: the last of ``t``'s path segments (sorted by
    trajectory, then start) starting at or before ``p``."""
    exc = f.exc_loss_mask
    S, N = parent.shape[0], f.traj_leaf.shape[0]
    keep = exc.pos >= 1
    t, p, v = exc.traj[keep].astype(np.int64), exc.pos[keep].astype(np.int64), exc.value[keep]
    lo = f.seg_traj_lo.astype(np.int64)
    cnt = f.seg_traj_hi.astype(np.int64) - lo
    pair_seg = np.repeat(np.arange(S, dtype=np.int64), cnt)
    pair_traj = np.arange(pair_seg.shape[0], dtype=np.int64) - np.repeat(np.cumsum(cnt) - cnt - lo, cnt)
    key = (pair_traj << 32) + start[pair_seg]
    order = np.argsort(key, kind="stable")
    key, pair_seg = key[order], pair_seg[order]
    seg = pair_seg[np.searchsorted(key, (t << 32) + p, side="right") - 1]
    row = seg_row[seg] + p - start[seg]
    m = f.row_loss_mask[row] != 0
    delta = np.bincount(t, weights=(v != 0).astype(np.int64) - m, minlength=N).astype(np.int64)
    on = (v != 0) & ~m
    seg, row, first = seg[on], row[on], p[on] == start[seg[on]]
    pred, at = row - 1, seg.copy()  # inside a segment: the row before (its row-level target is m = 0)
    par = parent[seg[first]]  # a segment's first position: its parent's last row, unless counted already
    pred[first] = seg_row[par] + length[par] - 1
    at[first] = par
    new = np.ones(pred.shape[0], dtype=bool)
    new[first] = last[par] == 0
    _, one = np.unique(pred[new], return_index=True)
    added = np.bincount(at[new][one], minlength=S).astype(np.int64)
    return added, delta


def _segment_counts_int(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Sum of int64 row values per segment (segments: the contiguous row ranges from ``starts``, sorted)."""
    if starts.size == 0:
        return np.zeros(0, dtype=np.int64)
    return np.add.reduceat(values.astype(np.int64, copy=False), starts)


def _segment_counts(mask: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Nonzero entries of a 0/1 row mask per segment (segments are the contiguous row ranges
    from ``starts``, sorted).  Segments of over 1024 rows on average: one ``count_nonzero`` each
    (a widening ``reduceat`` over millions of rows costs several times more); shorter ones:
    ``reduceat`` (Step-wise batches, about 700 rows a segment: twice as fast as the loop)."""
    if starts.size == 0:
        return np.zeros(0, dtype=np.int64)
    if mask.size > 1024 * starts.size:
        ends = starts[1:].tolist() + [mask.size]
        return np.array([np.count_nonzero(mask[a:b]) for a, b in zip(starts.tolist(), ends)], dtype=np.int64)
    # counted in int32 (a segment holds fewer than 2**31 rows), half the time of an int64 sum
    return np.add.reduceat(mask, starts, dtype=np.int32).astype(np.int64)


_KDA = compiled("plan_calls")                    # the call planner (calls.py: reference)
_MB_KDA = compiled("microbatch_kda")             # KDA features of one microbatch
_MB_FEATURES = compiled("microbatch_features")   # features of many microbatches


def _plan_calls_count(parent, start, length, B) -> Tuple[int, int]:
    """(calls, replay) of the call planner on arrays the caller built valid."""
    if _KDA is not None:
        out = _KDA(np.asarray(parent, np.int64), np.asarray(start, np.int64),
                   np.asarray(length, np.int64), B, True)
        return int(out["num_calls"]), int(out["replay_tokens"])
    from .calls import plan_calls
    plan = plan_calls(parent, start, length, B)
    return plan.num_calls, plan.replay_tokens


@dataclass(frozen=True)
class CostModel:
    """Linear cost of a microbatch: ``coefficients . features``; ``chunk_size`` is KDA's B."""
    coefficients: CostCoefficients = field(default_factory=CostCoefficients)
    chunk_size: int = 64
    source: Dict[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, (int, np.integer)) \
                or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be an integer >= 1, got {self.chunk_size!r}")

    def cost(self, f: CostFeatures) -> float:
        c = self.coefficients
        if f.rows == 0:
            return 0.0
        return (c.microbatch + c.row * f.rows + c.attention_pair * f.attention_pairs
                + c.kda_call * f.kda_calls + c.kda_replay_token * f.replay_tokens
                + c.logits_row * f.logits_rows)

    def kda(self, ix: ForestIndex, computed: np.ndarray) -> Tuple[int, int]:
        """(calls, replay tokens) of the computed segments (sorted ids).

        A segment whose parent is not computed here starts at path position ``p`` from a
        producer's boundary state at ``a = floor(p/B)*B``: it is planned as a root with a
        virtual parent of ``p - a`` tokens (the replay), which keeps every chunk boundary.
        """
        return self._kda_external(ix, np.asarray(computed, dtype=np.int64))[:2]

    def _kda_external(self, ix: ForestIndex, computed: np.ndarray) -> Tuple[int, int, int]:
        """(calls, replay tokens, external rows) of the computed segments (sorted ids): the
        compiled ``_C.microbatch_kda`` when built, else :meth:`_kda_python` (same numbers)."""
        if len(computed) == 0:
            return 0, 0, 0
        if _MB_KDA is not None:
            calls, replay, ext = _MB_KDA(ix.parent_arr, ix.start, ix.length, computed, self.chunk_size)
            return int(calls), int(replay), int(ext)
        return self._kda_python(ix, computed)

    def _kda_python(self, ix: ForestIndex, computed: np.ndarray) -> Tuple[int, int, int]:
        """Reference of ``_C.microbatch_kda``: (calls, replay tokens, external rows)."""
        B = self.chunk_size
        par_g, st_g, ln_g = ix.parent, ix.start, ix.length
        where: Dict[int, int] = {}
        shift: Dict[int, int] = {}
        par, st, ln = [], [], []
        extra = 0
        comp = computed.tolist()
        for s in comp:
            p = par_g[s]
            if p in where:
                a = shift[p]
                par.append(where[p])
                st.append(int(st_g[s]) - a)
            else:
                p0 = int(st_g[s])
                a = p0 // B * B
                if p0 > a:
                    par.append(-1)
                    st.append(0)
                    ln.append(p0 - a)
                    extra += p0 - a
                    par.append(len(par) - 1)
                    st.append(p0 - a)
                else:
                    par.append(-1)
                    st.append(0)
            shift[s] = a
            ln.append(int(ln_g[s]))
            where[s] = len(par) - 1
        calls, replay = _plan_calls_count(par, st, ln, B)
        ext_rows = 0
        seen = set()
        for s in comp:
            a = par_g[s]
            while a >= 0 and a not in where and a not in seen:
                seen.add(a)
                ext_rows += int(ln_g[a])
                a = par_g[a]
        return calls, replay + extra, ext_rows

    def features(self, ix: ForestIndex, computed: np.ndarray, owned: np.ndarray) -> CostFeatures:
        """Features of a tree-mode microbatch computing ``computed`` (sorted, distinct) and
        owning ``owned``."""
        computed = np.asarray(computed, dtype=np.int64)
        if computed.size == 0:
            return CostFeatures()
        calls, replay, ext_rows = self._kda_external(ix, computed)
        return CostFeatures(rows=int(ix.length[computed].sum()),
                            attention_pairs=int(ix.seg_pairs[computed].sum()),
                            kda_calls=calls, replay_tokens=replay,
                            logits_rows=int(ix.seg_logits[np.asarray(owned, dtype=np.int64)].sum()),
                            external_rows=ext_rows)

    def features_many(self, ix: ForestIndex, computed: Sequence[np.ndarray],
                      owned: Sequence[np.ndarray]) -> List[CostFeatures]:
        """``features`` of many microbatches (``computed[j]`` sorted and distinct, ``owned[j]``):
        the compiled ``_C.microbatch_features`` in one call when built, else
        :meth:`features_many_python` (the reference: the same numbers)."""
        if _MB_FEATURES is not None and len(computed):
            comp_off = np.zeros(len(computed) + 1, dtype=np.int64)
            own_off = np.zeros(len(owned) + 1, dtype=np.int64)
            np.cumsum([len(c) for c in computed], out=comp_off[1:])
            np.cumsum([len(o) for o in owned], out=own_off[1:])
            out = _MB_FEATURES(ix.parent_arr, ix.start, ix.length, ix.seg_pairs, ix.seg_logits, comp_off,
                               np.concatenate(computed).astype(np.int64, copy=False), own_off,
                               np.concatenate(owned).astype(np.int64, copy=False), self.chunk_size)
            return [CostFeatures(*row) for row in out.tolist()]
        return self.features_many_python(ix, computed, owned)

    def features_many_python(self, ix: ForestIndex, computed: Sequence[np.ndarray],
                             owned: Sequence[np.ndarray]) -> List[CostFeatures]:
        """Reference of ``features_many`` (and of ``_C.microbatch_features``)."""
        return [self.features(ix, c, o) for c, o in zip(computed, owned)]

    def expanded_features(self, ix: ForestIndex, trajectories: np.ndarray) -> CostFeatures:
        """Features of trajectories packed without sharing (one KDA call: all start at 0)."""
        L = ix.traj_length[trajectories]
        if L.size == 0:
            return CostFeatures()
        return CostFeatures(rows=int(L.sum()), attention_pairs=int(ix.traj_pairs[trajectories].sum()),
                            kda_calls=1, replay_tokens=0,
                            logits_rows=int(ix.traj_targets[trajectories].sum()))


# ---------------------------------------------------------------------------------------------
# calibration file
# ---------------------------------------------------------------------------------------------

def _number(path, name, value, positive=False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalibrationError(f"{path}: field {name}: must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        need = "> 0" if positive else ">= 0"
        raise CalibrationError(f"{path}: field {name}: must be a finite number {need}, got {value!r}")
    return v


def load_calibration(path: str) -> CostModel:
    """Read and validate a calibration file; raise ``CalibrationError`` naming file and field."""
    try:
        with open(path, "r", encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as e:
        raise CalibrationError(f"{path}: cannot read the calibration file ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CalibrationError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CalibrationError(f"{path}: the calibration must be a JSON object")
    allowed = {"format", "version", "unit", "chunk_size", "coefficients", "source"}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise CalibrationError(f"{path}: unknown field {unknown[0]!r}")
    for key in ("format", "version", "unit", "chunk_size", "coefficients"):
        if key not in data:
            raise CalibrationError(f"{path}: field {key}: missing")
    if data["format"] != CALIBRATION_FORMAT:
        raise CalibrationError(f"{path}: field format: expected {CALIBRATION_FORMAT!r}, got {data['format']!r}")
    if data["version"] != CALIBRATION_VERSION or isinstance(data["version"], bool):
        raise CalibrationError(f"{path}: field version: only version {CALIBRATION_VERSION} is known, "
                               f"got {data['version']!r}")
    if data["unit"] != "seconds":
        raise CalibrationError(f"{path}: field unit: must be 'seconds', got {data['unit']!r}")
    B = data["chunk_size"]
    if isinstance(B, bool) or not isinstance(B, int) or B < 1:
        raise CalibrationError(f"{path}: field chunk_size: must be an integer >= 1, got {B!r}")
    coef = data["coefficients"]
    if not isinstance(coef, dict):
        raise CalibrationError(f"{path}: field coefficients: must be an object")
    unknown = sorted(set(coef) - set(COEFFICIENT_NAMES))
    if unknown:
        raise CalibrationError(f"{path}: field coefficients.{unknown[0]}: unknown coefficient "
                               f"(known: {', '.join(COEFFICIENT_NAMES)})")
    values = {}
    for name in COEFFICIENT_NAMES:
        if name not in coef:
            raise CalibrationError(f"{path}: field coefficients.{name}: missing")
        values[name] = _number(path, f"coefficients.{name}", coef[name], positive=(name == "row"))
    source = data.get("source", {})
    if not isinstance(source, dict):
        raise CalibrationError(f"{path}: field source: must be an object")
    return CostModel(CostCoefficients(**values), chunk_size=B, source=dict(source))


def save_calibration(path: str, model: CostModel, source: Optional[Dict[str, object]] = None) -> None:
    """Write ``model`` as a calibration file (atomically: a temporary file renamed)."""
    data = {
        "format": CALIBRATION_FORMAT,
        "version": CALIBRATION_VERSION,
        "unit": "seconds",
        "chunk_size": int(model.chunk_size),
        "coefficients": asdict(model.coefficients),
        "source": dict(source if source is not None else model.source),
    }
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, path)


def fit_calibration(features: Sequence[CostFeatures], seconds: Sequence[float],
                    chunk_size: int = 64) -> Tuple[CostModel, float]:
    """Non-negative least-squares fit of the coefficients to measured microbatch times.

    Returns the model and the R^2 of the fit.  Exact NNLS over 6 unknowns: the best
    unconstrained least-squares solution over every subset of free coefficients whose solution
    is non-negative (``row`` always free).  Needs at least as many samples as coefficients.
    """
    X = np.stack([f.vector() for f in features]) if len(features) else np.zeros((0, 6))
    y = np.asarray(seconds, dtype=np.float64)
    if X.shape[0] != y.shape[0]:
        raise ValueError(f"{X.shape[0]} feature rows but {y.shape[0]} times")
    if X.shape[0] < X.shape[1]:
        raise ValueError(f"need at least {X.shape[1]} measured microbatches, got {X.shape[0]}")
    if not np.all(np.isfinite(y)) or np.any(y < 0):
        raise ValueError("measured times must be finite and >= 0")
    scale = np.maximum(np.abs(X).max(axis=0), 1.0)
    Xs = X / scale
    best, best_res = None, math.inf
    row = COEFFICIENT_NAMES.index("row")
    others = [i for i in range(X.shape[1]) if i != row]
    for k in range(len(others) + 1):
        for subset in itertools.combinations(others, k):
            cols = sorted((row,) + subset)
            sol, *_ = np.linalg.lstsq(Xs[:, cols], y, rcond=None)
            if np.any(sol < 0):
                continue
            res = float(np.sum((Xs[:, cols] @ sol - y) ** 2))
            if best is None or res < best_res * (1.0 - 1e-12):
                w = np.zeros(X.shape[1])
                w[cols] = sol
                best, best_res = w, res
    if best is None or best[row] <= 0:
        raise ValueError("no fit with a positive per-row cost: the measurements do not grow with rows")
    coef = best / scale
    total = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - best_res / total if total > 0 else 1.0
    model = CostModel(CostCoefficients(**dict(zip(COEFFICIENT_NAMES, coef.tolist()))), chunk_size=chunk_size,
                      source={"samples": int(X.shape[0]), "r2": r2})
    return model, r2
