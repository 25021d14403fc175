"""Model calls -> trajectories, merged by prefix (docs/messages.md, "The exact form").

A *call* is one request to the inference engine: the prompt token ids it was given and the
ids it generated.  The calls of a conversation, in order, become trajectories:

- the first call starts a trajectory: its prompt (context) then its completion (targets);
- a later call whose prompt starts, token for token, with the current trajectory (the previous
  prompt plus completion) extends it: the new prompt tokens are context, the completion targets;
- otherwise (the history was re-rendered, rewritten or truncated) the current trajectory ends
  and the call starts a new one, which holds its whole prompt as context.  It shares with the
  trajectory it continues the tokens up to their first difference, which the forest merges.

So every call is, exactly, a prefix of one trajectory followed by its completion, and every
completion is a target once, in the trajectory of its call.

Engine token records are calls written by the engine itself, one JSONL line (or Parquet row)
per call; ``read_engine_records`` merges them with no re-tokenization.
"""
from __future__ import annotations

import gzip
import json
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .errors import TreeFormatError
from .readers import UnknownFieldsWarning
from .trajectory import Trajectory, make_trajectory

RECORD_FIELDS = frozenset(["conversation", "call", "prompt_token_ids", "completion_token_ids",
                           "completion_logprobs", "trainable", "group", "reward", "advantage", "weight"])
CONVERSATION_FIELDS = ("group", "reward", "advantage", "weight")
BRANCH_SEP = "#"


@dataclass
class Call:
    """One model call: the prompt ids the engine was given and the ids it generated."""
    index: int                                  # the message index (messages) or the call's number (records)
    prompt: np.ndarray                          # int64
    completion: np.ndarray                      # int64
    targets: np.ndarray                         # uint8 per completion token
    logprobs: Optional[np.ndarray] = None       # float64 per completion token


@dataclass
class Segment:
    """One trajectory of a conversation: tokens, loss mask, old log-probs (NaN on context), the
    calls it holds, and, for a branch, the tokens it shares with the trajectory it continues and
    the re-rendered tokens it computes again (``min(len(prompt), len(previous)) - shared``)."""
    tokens: np.ndarray
    mask: np.ndarray
    logprobs: Optional[np.ndarray]
    calls: List[int] = field(default_factory=list)
    shared: int = 0
    recomputed: int = 0


def lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two id arrays."""
    n = min(a.shape[0], b.shape[0])
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def merge_calls(calls: Sequence[Call], with_logprobs: bool = False) -> List[Segment]:
    """The trajectories of a conversation's ``calls`` (module docstring).  ``with_logprobs``: every
    call carries completion log-probs, which become the segments' ``logprobs``."""
    out: List[Segment] = []
    cur: Optional[Segment] = None
    for i, c in enumerate(calls):
        p = c.prompt
        lp = np.full(c.completion.shape[0], np.nan) if c.logprobs is None else c.logprobs
        if cur is not None and p.shape[0] >= cur.tokens.shape[0] and np.array_equal(p[:cur.tokens.shape[0]],
                                                                                      cur.tokens):
            n = cur.tokens.shape[0]
            new = p.shape[0] - n
            cur.tokens = np.concatenate([p, c.completion])
            cur.mask = np.concatenate([cur.mask, np.zeros(new, np.uint8), c.targets])
            if with_logprobs:
                cur.logprobs = np.concatenate([cur.logprobs, np.full(new, np.nan), lp])
            cur.calls.append(i)
            continue
        shared = recomputed = 0
        if cur is not None:
            shared = lcp(cur.tokens, p)
            recomputed = min(p.shape[0], cur.tokens.shape[0]) - shared
            out.append(cur)
        cur = Segment(np.concatenate([p, c.completion]),
                      np.concatenate([np.zeros(p.shape[0], np.uint8), c.targets]),
                      np.concatenate([np.full(p.shape[0], np.nan), lp]) if with_logprobs else None,
                      [i], shared, recomputed)
    if cur is not None:
        out.append(cur)
    for s in out:
        if s.mask.shape[0]:
            s.mask[0] = 0        # nothing predicts the first token
    return out


def segment_id(conversation, j: int):
    """The trajectory id of segment ``j`` of a conversation: the conversation's id, then ``ID#1``, ..."""
    return conversation if j == 0 else f"{conversation}{BRANCH_SEP}{j}"


# ---- engine token records ------------------------------------------------------------------------------

def is_record_file(path: str) -> bool:
    """Whether the first row of ``path`` (JSONL or Parquet) is an engine token record."""
    try:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq
            return "prompt_token_ids" in pq.ParquetFile(path).schema_arrow.names
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as fh:
            for text in fh:
                if text.strip():
                    rec = json.loads(text)
                    return isinstance(rec, dict) and "prompt_token_ids" in rec
    except Exception:
        return False
    return False


def _ids(values, where, name: str, vocab_size: Optional[int], empty_ok: bool) -> np.ndarray:
    if not isinstance(values, (list, tuple, np.ndarray)) or not all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        raise where(name, "must be a list of token ids")
    ids = np.asarray(values, dtype=np.int64).reshape(-1)
    if ids.shape[0] == 0 and not empty_ok:
        raise where(name, "is empty")
    if ids.shape[0] and ids.min() < 0:
        raise where(name, f"token {int(np.argmax(ids < 0))} is negative: token ids must be >= 0")
    if vocab_size is not None and ids.shape[0] and ids.max() >= vocab_size:
        j = int(np.argmax(ids >= vocab_size))
        raise where(name, f"token {j} is {int(ids[j])}, not below --vocab-size {vocab_size}")
    return ids


@dataclass
class RecordReport:
    """What merging engine records did (the converter prints it)."""
    conversations: int = 0
    calls: int = 0
    trajectories: int = 0
    branches: int = 0                 # trajectories started because a prompt did not extend the previous call
    recomputed_tokens: int = 0        # re-rendered prompt tokens the branches compute again
    branch_calls: int = 0             # calls in the branches
    examples: List = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"conversations": self.conversations, "calls": self.calls, "trajectories": self.trajectories,
                "branch_trajectories": self.branches, "branch_tokens": self.recomputed_tokens,
                "branch_calls": self.branch_calls}

    def lines(self) -> List[str]:
        out = [f"engine records: {self.calls:,} calls of {self.conversations:,} conversations -> "
               f"{self.trajectories:,} trajectories"]
        if self.branches:
            eg = ", ".join(map(repr, self.examples[:3]))
            out[0] += (f"; {self.branches:,} start where a prompt does not extend the previous call (e.g. {eg}), "
                       f"computing {self.recomputed_tokens:,} re-rendered tokens again")
        return out


def _record_rows(path: str) -> Iterator[Tuple[int, dict]]:
    from .messages import _rows
    return _rows(path)


def read_engine_records(paths: Iterable[str], *, vocab_size: Optional[int] = None,
                        progress: Optional[Callable[[int], None]] = None
                        ) -> Tuple[List[Trajectory], RecordReport]:
    """Engine token records of ``paths`` (docs/messages.md, "Engine token records") as trajectories,
    conversations in order of first appearance, and the report.  Unknown fields are ignored with one
    UnknownFieldsWarning."""
    convs: Dict[object, List[Tuple[str, int, dict]]] = {}
    unknown = set()
    for path in paths:
        for line, rec in _record_rows(path):
            unknown.update(k for k in rec if k not in RECORD_FIELDS)
            cid = rec.get("conversation")
            if cid is None:
                raise TreeFormatError("is missing: every call names its conversation", file=path, line=line,
                                      field="conversation")
            if isinstance(cid, bool) or not isinstance(cid, (str, int)):
                raise TreeFormatError(f"must be a string or an integer, got {type(cid).__name__}", file=path,
                                      line=line, field="conversation")
            convs.setdefault(cid, []).append((path, line, rec))
            if progress:
                progress(1)
    report = RecordReport()
    trajs: List[Trajectory] = []
    for cid, recs in convs.items():
        trajs.extend(_conversation(cid, recs, report, vocab_size))
    if unknown:
        warnings.warn("ignored unknown fields: " + ", ".join(sorted(unknown)), UnknownFieldsWarning, stacklevel=2)
    return trajs, report


def _conversation(cid, recs: List[Tuple[str, int, dict]], report: RecordReport,
                  vocab_size: Optional[int]) -> List[Trajectory]:
    def at(path, line):
        return lambda name, message: TreeFormatError(message, file=path, line=line, trajectory=cid, field=name)

    numbered = [r for r in recs if r[2].get("call") is not None]
    if numbered and len(numbered) != len(recs):
        path, line, _ = next(r for r in recs if r[2].get("call") is None)
        raise at(path, line)("call", "is missing here but given on other calls of the conversation")
    if numbered:
        seen = {}
        for path, line, rec in recs:
            k = rec["call"]
            if isinstance(k, bool) or not isinstance(k, int):
                raise at(path, line)("call", f"must be an integer, got {k!r}")
            if k in seen:
                raise at(path, line)("call", f"call {k} appears twice (first at {seen[k][0]}:{seen[k][1]})")
            seen[k] = (path, line)
        recs = sorted(recs, key=lambda r: r[2]["call"])
    shared: Dict[str, Tuple[object, str, int]] = {}
    calls: List[Call] = []
    have_lp = []
    for k, (path, line, rec) in enumerate(recs):
        where = at(path, line)
        for name in CONVERSATION_FIELDS:
            v = rec.get(name)
            if v is None:
                continue
            if name in shared and shared[name][0] != v:
                raise where(name, f"is {v!r} but {shared[name][0]!r} on an earlier call of the conversation "
                                  f"({shared[name][1]}:{shared[name][2]}): it belongs to the conversation")
            shared.setdefault(name, (v, path, line))
        if isinstance(rec.get("advantage"), (list, tuple)):
            raise where("advantage", "must be one number per conversation in engine records")
        prompt = _ids(rec.get("prompt_token_ids"), where, "prompt_token_ids", vocab_size, empty_ok=False)
        if rec.get("completion_token_ids") is None:
            raise where("completion_token_ids", "is missing")
        comp = _ids(rec["completion_token_ids"], where, "completion_token_ids", vocab_size, empty_ok=True)
        trainable = rec.get("trainable", True)
        if not isinstance(trainable, bool):
            raise where("trainable", f"must be true or false, got {trainable!r}")
        lp = rec.get("completion_logprobs")
        if lp is not None:
            if not isinstance(lp, (list, tuple)) or len(lp) != comp.shape[0] or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) for v in lp):
                raise where("completion_logprobs", f"must be {comp.shape[0]} finite numbers, one per completion "
                                                   f"token")
            lp = np.asarray(lp, dtype=np.float64)
        have_lp.append(lp is not None)
        calls.append(Call(k, prompt, comp, np.full(comp.shape[0], 1 if trainable else 0, np.uint8), lp))
    if any(have_lp) and not all(have_lp):
        path, line, _ = recs[have_lp.index(False)]
        raise at(path, line)("completion_logprobs", "is missing here but given on other calls of the conversation")
    segs = merge_calls(calls, with_logprobs=all(have_lp))
    out = []
    for j, s in enumerate(segs):
        path, line, _ = recs[s.calls[0]]
        rec = {"id": segment_id(cid, j), "tokens": s.tokens, "loss_mask": s.mask,
               **{name: v[0] for name, v in shared.items()}}
        if s.logprobs is not None:      # the engine's log-probs: the rollout's, and the data's old ones
            lp = [None if np.isnan(v) else float(v) for v in s.logprobs]
            rec["old_logprobs"] = rec["rollout_logprobs"] = lp
        out.append(make_trajectory(rec, file=path, line=line, vocab_size=vocab_size))
    report.conversations += 1
    report.calls += len(calls)
    report.trajectories += len(segs)
    report.branches += len(segs) - 1
    report.recomputed_tokens += sum(s.recomputed for s in segs)
    report.branch_calls += sum(len(s.calls) for s in segs[1:])
    if len(segs) > 1:
        report.examples.append(cid)
    return out
