"""One trajectory: tokens and per-token RL metadata, validated on construction.

Field semantics (docs/design.md, glossary "trajectory"):

- ``tokens``: int64 token ids, at least one.
- ``loss_mask``: uint8 0/1 per token; token j is a training target predicted
  from token j-1, so ``loss_mask[0]`` is always 0.  Default: all 1 after the
  first token.
- ``old_logprobs``: float64 per token, or None.  ``null`` in JSON becomes NaN
  (allowed only where ``loss_mask`` is 0).  The log-probs the PPO ratio divides by.
- ``rollout_logprobs``: the inference engine's log-prob of each token (the sampler's),
  same form; read by rollout correction (``--rl-tis-cap``) and the ``rollout/*`` metrics.
- ``ref_logprobs``: a reference model's log-prob of each token, same form; the target of
  the KL penalty (``--kl-to ref``) when no reference model is loaded.
- ``advantage``: None, a float (one value for the whole trajectory) or a
  float64 array (one value per token).
- ``reward``, ``weight``: optional floats.
- ``group``: optional string; prefixes are merged only within a group.
- ``parent``: optional ``(parent_id, at)``: an explicit fork, ``tokens[:at]``
  equals the parent's.
- ``compactions``: optional int64 ``[E, 3]`` array of KV-eviction events
  ``(at, start, end)`` in the order given (None when the record has none): every
  token at index >= ``at`` no longer attends to tokens ``[start, end)`` in
  full-attention layers; ``0 <= start < end <= at < len(tokens)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple, Union

import numpy as np

from .errors import TreeFormatError

TrajectoryId = Union[str, int]

#: the per-token log-prob fields of a trajectory, stored alike (float64 per token, NaN for null,
#: null only where loss_mask is 0)
LOGPROB_FIELDS = ("old_logprobs", "rollout_logprobs", "ref_logprobs")


@dataclass
class Trajectory:
    id: TrajectoryId
    tokens: np.ndarray
    loss_mask: np.ndarray
    old_logprobs: Optional[np.ndarray] = None
    advantage: Union[None, float, np.ndarray] = None
    reward: Optional[float] = None
    weight: Optional[float] = None
    group: Optional[str] = None
    parent: Optional[Tuple[TrajectoryId, int]] = None
    compactions: Optional[np.ndarray] = None
    rollout_logprobs: Optional[np.ndarray] = None
    ref_logprobs: Optional[np.ndarray] = None
    source: Tuple[Optional[str], Optional[int]] = field(default=(None, None), compare=False, repr=False)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def error(self, field_name: Optional[str], message: str) -> TreeFormatError:
        """A TreeFormatError pointing at this trajectory's file, line and ``field_name``."""
        return TreeFormatError(message, file=self.source[0], line=self.source[1],
                               trajectory=self.id, field=field_name)


def default_loss_mask(n: int) -> np.ndarray:
    """All tokens are targets except the first, which nothing predicts."""
    mask = np.ones(n, dtype=np.uint8)
    if n:
        mask[0] = 0
    return mask


def _first_bad(values, ok) -> int:
    """Index of the first element of ``values`` that fails ``ok`` (error path only)."""
    for j, v in enumerate(values):
        if not ok(v):
            return j
    return -1


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def _int_array(values, where, name) -> np.ndarray:
    if not isinstance(values, (list, tuple, np.ndarray)):
        raise where(name, f"must be a list of integers, got {type(values).__name__}")
    try:
        arr = np.asarray(values)
    except (ValueError, OverflowError):
        arr = np.asarray(values, dtype=object)
    if arr.ndim != 1:
        raise where(name, f"must be a flat list of integers, got shape {arr.shape}")
    if arr.dtype.kind in "iu" or arr.size == 0:
        if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
            raise where(name, "holds an integer that does not fit in 64 bits")
        return arr.astype(np.int64, copy=False)
    items = list(values) if isinstance(values, (list, tuple)) else arr.tolist()
    j = _first_bad(items, _is_int)
    if j < 0:
        raise where(name, "holds an integer that does not fit in 64 bits")
    raise where(name, f"element {j} is {items[j]!r}, not an integer")


def _float_array(values, where, name, n: int, allow_null: bool) -> np.ndarray:
    if not isinstance(values, (list, tuple, np.ndarray)):
        raise where(name, f"must be a list of numbers, got {type(values).__name__}")
    arr = np.asarray(values)
    if arr.ndim == 1 and arr.dtype.kind in "fiu":
        out = arr.astype(np.float64, copy=False)
    elif arr.ndim == 1 and arr.dtype.kind == "O":
        ok = (lambda v: v is None or _is_number(v)) if allow_null else _is_number
        j = _first_bad(arr.tolist(), ok)
        if j >= 0:
            raise where(name, f"element {j} is {arr.tolist()[j]!r}, not a number")
        out = np.array([np.nan if v is None else v for v in arr.tolist()], dtype=np.float64)
    elif arr.ndim == 1 and arr.size:
        items = arr.tolist()
        j = _first_bad(items, _is_number)
        raise where(name, f"element {j} is {items[j]!r}, not a number")
    else:
        out = arr.astype(np.float64) if arr.ndim == 1 else arr
    if out.ndim != 1 or out.shape[0] != n:
        got = out.shape[0] if out.ndim == 1 else f"shape {out.shape}"
        raise where(name, f"has {got} entries but 'tokens' has {n}")
    return out


def _scalar(value, where, name) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise where(name, f"must be a number, got {value!r}")
    return float(value)


def make_trajectory(record: dict, *, file: Optional[str] = None, line: Optional[int] = None,
                    vocab_size: Optional[int] = None) -> Trajectory:
    """Validate one input record (a JSON object or Parquet row) into a Trajectory.

    Every problem raises TreeFormatError naming file, line, trajectory id and
    field.  Unknown keys are the caller's business (readers warn once).
    """
    tid = record.get("id")

    def where(name, message):
        return TreeFormatError(message, file=file, line=line, trajectory=tid, field=name)

    if "id" not in record or tid is None:
        raise where("id", "is missing")
    if isinstance(tid, bool) or not isinstance(tid, (str, int)):
        raise where("id", f"must be a string or an integer, got {type(tid).__name__}")
    if "tokens" not in record or record["tokens"] is None:
        raise where("tokens", "is missing")
    tokens = _int_array(record["tokens"], where, "tokens")
    n = tokens.shape[0]
    if n == 0:
        raise where("tokens", "is empty: a trajectory needs at least one token")
    if tokens.min() < 0:
        j = int(np.argmax(tokens < 0))
        raise where("tokens", f"token {j} is {int(tokens[j])}: token ids must be >= 0")
    if vocab_size is not None and tokens.max() >= vocab_size:
        j = int(np.argmax(tokens >= vocab_size))
        raise where("tokens", f"token {j} is {int(tokens[j])}, not below --vocab-size {vocab_size}")

    if record.get("loss_mask") is None:
        loss_mask = default_loss_mask(n)
    else:
        lm = _int_array(record["loss_mask"], where, "loss_mask")
        if lm.shape[0] != n:
            raise where("loss_mask", f"has {lm.shape[0]} entries but 'tokens' has {n}")
        bad = (lm != 0) & (lm != 1)
        if bad.any():
            j = int(np.argmax(bad))
            raise where("loss_mask", f"entry {j} is {int(lm[j])}: must be 0 or 1")
        if lm[0] != 0:
            raise where("loss_mask", "entry 0 is 1, but the first token has no predecessor to predict it")
        loss_mask = lm.astype(np.uint8)

    logprobs = {}
    for name in LOGPROB_FIELDS:
        if record.get(name) is None:
            logprobs[name] = None
            continue
        values = _float_array(record[name], where, name, n, allow_null=True)
        missing = np.isnan(values) & (loss_mask == 1)
        if missing.any():
            j = int(np.argmax(missing))
            raise where(name, f"entry {j} is null/NaN where loss_mask is 1")
        logprobs[name] = values

    advantage = record.get("advantage")
    if advantage is not None:
        if isinstance(advantage, (list, tuple, np.ndarray)):
            advantage = _float_array(advantage, where, "advantage", n, allow_null=False)
        else:
            advantage = _scalar(advantage, where, "advantage")

    reward = record.get("reward")
    reward = None if reward is None else _scalar(reward, where, "reward")
    weight = record.get("weight")
    weight = None if weight is None else _scalar(weight, where, "weight")

    group = record.get("group")
    if group is not None:
        if isinstance(group, bool) or not isinstance(group, (str, int)):
            raise where("group", f"must be a string or an integer, got {type(group).__name__}")
        group = str(group)

    parent = record.get("parent")
    if parent is not None:
        if not isinstance(parent, dict) or "id" not in parent or "at" not in parent:
            raise where("parent", 'must be an object {"id": ..., "at": p}')
        pid, at = parent["id"], parent["at"]
        if isinstance(pid, bool) or not isinstance(pid, (str, int)):
            raise where("parent", f"id must be a string or an integer, got {pid!r}")
        if isinstance(at, bool) or not isinstance(at, (int, np.integer)) or not 0 <= at <= n:
            raise where("parent", f"'at' is {at!r}: must be an integer in [0, {n}]")
        parent = (pid, int(at))

    compactions = None
    if record.get("compactions") is not None:
        compactions = parse_compactions(record["compactions"], n, where)

    return Trajectory(id=tid, tokens=tokens, loss_mask=loss_mask, advantage=advantage, reward=reward,
                      weight=weight, group=group, parent=parent, compactions=compactions, source=(file, line),
                      **logprobs)


COMPACTION_KEYS = ("at", "start", "end")


def parse_compactions(events, n: int, where) -> Optional[np.ndarray]:
    """``[{"at": p, "start": a, "end": b}, ...]`` as an int64 ``[E, 3]`` array in the order given.

    Every event satisfies ``0 <= a < b <= p < n``; an empty list gives None.  ``where(field,
    message)`` builds the error, which names the event by its index in the list.
    """
    if not isinstance(events, (list, tuple)):
        raise where("compactions", f'must be a list of objects {{"at": p, "start": a, "end": b}}, '
                                   f"got {type(events).__name__}")
    if not events:
        return None
    out = np.empty((len(events), 3), dtype=np.int64)
    for i, ev in enumerate(events):
        if not isinstance(ev, dict):
            raise where("compactions", f'event {i} is {ev!r}, not an object {{"at": p, "start": a, "end": b}}')
        for j, key in enumerate(COMPACTION_KEYS):
            if key not in ev or ev[key] is None:
                raise where("compactions", f"event {i} has no '{key}'")
            v = ev[key]
            if not _is_int(v):
                raise where("compactions", f"event {i}: '{key}' is {v!r}, not an integer")
            out[i, j] = v
        extra = sorted(set(ev) - set(COMPACTION_KEYS))
        if extra:
            raise where("compactions", f"event {i} has unknown keys {', '.join(map(repr, extra))} "
                                       f"(an event is {{\"at\", \"start\", \"end\"}})")
        p, a, b = (int(x) for x in out[i])
        if a < 0:
            raise where("compactions", f"event {i}: start {a} is negative")
        if b <= a:
            raise where("compactions", f"event {i}: end {b} must be greater than start {a} (an empty span)")
        if b > p:
            raise where("compactions", f"event {i}: end {b} is after at {p}: a token can only be evicted "
                                       f"for the tokens after it")
        if p >= n:
            raise where("compactions", f"event {i}: at {p} is not a token index: the trajectory has {n} tokens")
    return out
