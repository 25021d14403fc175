"""Tokenization drift: trajectories of a group whose text shares more than their token ids do.

Two trajectories of a merge scope (a group; ungrouped trajectories form one scope) share
their token-id prefix in the forest.  When the same text was tokenized differently in them
(a history re-tokenized, the engine's own split of a word), the text prefix is longer than
the id prefix and the tree forks early.  For a pair, the sharing that tokenizing alike
would restore ends at the last character offset, within their common text, that is a token
boundary in both; the trajectory's tokens from the id fork up to that boundary are its drift
region.

Repair replaces a trajectory's drift region by the donor's tokens of the same text.  Two
rules define it:

- *all* (what drift costs): every trajectory takes the tokenization of a shared text prefix
  from an earlier trajectory of its scope;
- *safe* (``repair_drift``): only context tokens (loss mask 0) are replaced, never a target
  (the ids the policy generated, with their log-probabilities); the donor is earlier, or
  holds targets in its region.

Tokens lost to drift are the unique tokens of the forest minus those after the *all* rule;
repairable tokens the same after the *safe* rule.  Trajectories with compaction events or a
``parent`` link are left as they are.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .trajectory import LOGPROB_FIELDS, Trajectory

MAX_ALL_PAIRS = 64     # scopes up to this size compare every pair; larger ones their text-order neighbours
NEIGHBOURS = 8
MAX_PASSES = 8


class TokenText:
    """Decodes token ids with a transformers tokenizer, caching the text of single ids."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.single: Dict[int, str] = {}

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def ends(self, ids: Sequence[int]) -> Tuple[str, np.ndarray]:
        """The text of ``ids`` and, per token, the character offset where its text ends.

        A token whose text is incomplete on its own (a byte of a multi-byte character, a piece a
        decoder joins with its neighbour) ends where the next complete one does, so the offsets
        never decrease and every offset that changes is a boundary of the text."""
        ids = [int(i) for i in ids]
        text = self.decode(ids)
        missing = sorted(set(ids) - set(self.single))
        if missing:
            pieces = self.tok.batch_decode([[i] for i in missing], skip_special_tokens=False,
                                           clean_up_tokenization_spaces=False)
            self.single.update(zip(missing, pieces))
        lengths = [len(self.single[i]) for i in ids]
        if sum(lengths) == len(text) and "".join(self.single[i] for i in ids) == text:
            return text, np.cumsum(lengths, dtype=np.int64)
        ends = np.empty(len(ids), dtype=np.int64)
        done, pos, lo = 0, 0, 0   # ids[:done] are placed and end at pos; lo: the decode window's start
        for i in range(len(ids)):
            base = self.decode(ids[lo:done])
            full = self.decode(ids[lo:i + 1])
            new = full[len(base):]
            if full.startswith(base) and not full.endswith("\ufffd") and text.startswith(new, pos):
                pos += len(new)
                ends[done:i + 1] = pos
                done = i + 1
                lo = max(0, done - 1)
        ends[done:] = len(text)
        return text, ends


@dataclass
class _Doc:
    """A trajectory's tokens, mask and text: ``offs[j]`` is the character offset after ``j`` tokens,
    a boundary where ``valid[j]``."""
    tokens: np.ndarray
    mask: np.ndarray
    text: str
    codes: np.ndarray
    offs: np.ndarray
    valid: np.ndarray


def _doc(tt: TokenText, t: Trajectory) -> _Doc:
    text, ends = tt.ends(t.tokens.tolist())
    offs = np.concatenate([[0], ends]).astype(np.int64)
    valid = np.ones(offs.shape[0], dtype=bool)
    valid[1:-1] = offs[2:] > offs[1:-1]
    return _Doc(t.tokens, t.loss_mask, text, np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32), offs, valid)


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.shape[0], b.shape[0])
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclass
class _Pair:
    """Drift of trajectory t against u: ids agree on ``[0, s)``; t's ``[s, jt)`` and u's ``[s, ju)``
    are the same text ``[offs[s], b)``, tokenized differently."""
    s: int
    b: int
    jt: int
    ju: int


def _pair(dt: _Doc, du: _Doc, text_lcp: int) -> Optional[_Pair]:
    s = _lcp(dt.tokens, du.tokens)
    kt = int(np.searchsorted(dt.offs, text_lcp, side="right"))
    ku = int(np.searchsorted(du.offs, text_lcp, side="right"))
    if kt <= s + 1 or ku <= s + 1:
        return None
    common = np.intersect1d(dt.offs[s:kt][dt.valid[s:kt]], du.offs[s:ku][du.valid[s:ku]])
    if not common.size:
        return None
    b = int(common[-1])
    jt = int(np.searchsorted(dt.offs, b, side="right")) - 1
    ju = int(np.searchsorted(du.offs, b, side="right")) - 1
    if jt <= s or ju <= s:
        return None
    return _Pair(s, b, jt, ju)


@dataclass
class DriftExample:
    trajectory: object
    other: object
    group: Optional[str]
    token: int          # where the ids fork
    char: int           # ... as a character offset of the text
    lost: int           # tokens of the trajectory the fork keeps from being shared
    before: str
    after: str
    pieces: List[str]
    other_pieces: List[str]


@dataclass
class RepairChange:
    trajectory: object
    donor: object
    at: int             # first replaced token
    removed: int        # tokens replaced ...
    added: int          # ... by the donor's tokens of the same text


@dataclass
class DriftReport:
    trajectories: int = 0
    scopes: int = 0
    drifted: int = 0                 # trajectories losing sharing to drift
    drifted_scopes: int = 0
    unique_tokens: int = 0
    lost_tokens: int = 0             # unique tokens tokenizing alike would save
    repairable_tokens: int = 0       # ... of them the safe repair saves (context tokens only)
    skipped: int = 0                 # trajectories with compaction events or a parent link
    examples: List[DriftExample] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def lines(self, top: int = 3) -> List[str]:
        """The summary: one line, then the ``top`` worst examples."""
        if not self.drifted:
            return [f"drift: none: in {self.scopes:,} groups of {self.trajectories:,} trajectories, every text "
                    f"prefix shared is shared as token ids"]
        share = 100.0 * self.lost_tokens / max(1, self.unique_tokens)
        out = [f"drift: {self.drifted:,} of {self.trajectories:,} trajectories in {self.drifted_scopes:,} of "
               f"{self.scopes:,} groups share more text than token ids: {self.lost_tokens:,} tokens of sharing lost "
               f"({share:.1f}% of {self.unique_tokens:,} unique tokens); --repair-drift recovers "
               f"{self.repairable_tokens:,} (context tokens only)"]
        if self.skipped:
            out[0] += f"; {self.skipped:,} trajectories with compaction events or a parent link not examined"
        for e in self.examples[:top]:
            out.append(f"  {e.trajectory!r} vs {e.other!r}: {e.lost:,} tokens lost from token {e.token:,} "
                       f"(char {e.char:,}): ...{e.before!r} | {e.after!r}...: {e.pieces} vs {e.other_pieces}")
        return out


def _scopes(trajs: Sequence[Trajectory]) -> Dict[Optional[str], List[int]]:
    out: Dict[Optional[str], List[int]] = {}
    for i, t in enumerate(trajs):
        out.setdefault(t.group, []).append(i)
    return out


def _candidates(members: List[int], docs: Dict[int, _Doc]) -> Dict[int, List[int]]:
    """The trajectories each one is compared with: every other of its scope, or in a large scope
    its neighbours in text order (where the longest common texts are)."""
    if len(members) <= MAX_ALL_PAIRS:
        return {i: [j for j in members if j != i] for i in members}
    order = sorted(members, key=lambda i: docs[i].text)
    out = {}
    for k, i in enumerate(order):
        out[i] = [order[j] for j in range(max(0, k - NEIGHBOURS), min(len(order), k + NEIGHBOURS + 1)) if j != k]
    return out


def _replace(t: Trajectory, d: _Doc, donor: _Doc, p: _Pair) -> Tuple[Trajectory, _Doc]:
    """``t`` with its tokens ``[s, jt)`` replaced by the donor's ``[s, ju)`` (context, no log-prob)."""
    s, jt, ju = p.s, p.jt, p.ju
    added = ju - s
    tokens = np.concatenate([t.tokens[:s], donor.tokens[s:ju], t.tokens[jt:]])
    mask = np.concatenate([t.loss_mask[:s], np.zeros(added, np.uint8), t.loss_mask[jt:]])
    logprobs = {name: None if getattr(t, name) is None else np.concatenate(
        [getattr(t, name)[:s], np.full(added, np.nan), getattr(t, name)[jt:]]) for name in LOGPROB_FIELDS}
    adv = t.advantage
    if isinstance(adv, np.ndarray):
        adv = np.concatenate([adv[:s], np.zeros(added), adv[jt:]])
    if mask.shape[0]:
        mask[0] = 0
    offs = np.concatenate([donor.offs[:ju + 1], d.offs[jt + 1:]])
    valid = np.concatenate([donor.valid[:ju + 1], d.valid[jt + 1:]])
    new = dataclasses.replace(t, tokens=tokens, loss_mask=mask, advantage=adv, **logprobs)
    new.source = t.source
    return new, _Doc(tokens, mask, d.text, d.codes, offs, valid)


def _repair(trajs: Sequence[Trajectory], docs: Dict[int, _Doc], safe: bool
            ) -> Tuple[List[Trajectory], List[RepairChange], Dict[int, int]]:
    """Trajectories after the *safe* or the *all* rule, the changes, and the number of changes of
    each changed trajectory."""
    out = list(trajs)
    docs = dict(docs)
    changes: List[RepairChange] = []
    first: Dict[int, int] = {}
    for members in _scopes(trajs).values():
        members = [i for i in members if i in docs]
        cands = _candidates(members, docs)
        text_lcp: Dict[Tuple[int, int], int] = {}
        for _ in range(MAX_PASSES):
            changed = False
            for i in members:
                best = None
                for j in cands[i]:
                    key = (min(i, j), max(i, j))
                    if key not in text_lcp:
                        text_lcp[key] = _lcp(docs[i].codes, docs[j].codes)
                    p = _pair(docs[i], docs[j], text_lcp[key])
                    if p is None:
                        continue
                    donor_targets = bool(docs[j].mask[p.s:p.ju].any())
                    if safe:
                        if docs[i].mask[p.s:p.jt].any() or not (j < i or donor_targets):
                            continue
                    elif j > i:
                        continue
                    rank = (p.b, donor_targets, -j)
                    if best is None or rank > best[0]:
                        best = (rank, j, p)
                if best is None:
                    continue
                _, j, p = best
                first[i] = first.get(i, 0) + 1
                out[i], docs[i] = _replace(out[i], docs[i], docs[j], p)
                changes.append(RepairChange(out[i].id, out[j].id, p.s, p.jt - p.s, p.ju - p.s))
                changed = True
            if not changed:
                break
    return out, changes, first


def _documents(tt: TokenText, trajs: Sequence[Trajectory]) -> Dict[int, _Doc]:
    return {i: _doc(tt, t) for i, t in enumerate(trajs) if t.compactions is None and t.parent is None}


def _unique(trajs: Sequence[Trajectory]) -> int:
    from .forest import build_forest
    return int(build_forest(trajs).stats()["unique_tokens"])


def _pieces(d: _Doc, lo: int, hi: int, limit: int = 8) -> List[str]:
    out = [d.text[d.offs[j]:d.offs[j + 1]] for j in range(lo, min(hi, lo + limit))]
    return out + (["..."] if hi - lo > limit else [])


def analyze_drift(trajs: Sequence[Trajectory], tokenizer, top: int = 3, context: int = 40) -> DriftReport:
    """The drift of ``trajs`` (see the module docstring) with the ``top`` worst examples."""
    tt = tokenizer if isinstance(tokenizer, TokenText) else TokenText(tokenizer)
    docs = _documents(tt, trajs)
    scopes = _scopes(trajs)
    rep = DriftReport(trajectories=len(trajs), scopes=len(scopes), skipped=len(trajs) - len(docs))
    if not trajs:
        return rep
    rep.unique_tokens = _unique(trajs)
    every, _, first = _repair(trajs, docs, safe=False)
    if not first:
        return rep
    safe, _, _ = _repair(trajs, docs, safe=True)
    rep.lost_tokens = rep.unique_tokens - _unique(every)
    rep.repairable_tokens = rep.unique_tokens - _unique(safe)
    rep.drifted = len(first)
    rep.drifted_scopes = len({trajs[i].group for i in first})
    cands = {}
    for members in _scopes(trajs).values():
        cands.update(_candidates([i for i in members if i in docs], docs))
    worst = []
    for i in first:     # each drifted trajectory against the one it shares the most text with, as given
        pairs = [(j, _pair(docs[i], docs[j], _lcp(docs[i].codes, docs[j].codes))) for j in cands[i]]
        pairs = [(p.jt - p.s, -j, j, p) for j, p in pairs if p is not None]
        if pairs:
            lost, _, j, p = max(pairs)
            worst.append((lost, i, j, p))
    shown = set()
    for lost, i, j, p in sorted(worst, key=lambda w: (-w[0], w[1])):
        if len(rep.examples) == top or (j, i) in shown:
            if len(rep.examples) == top:
                break
            continue
        shown.add((i, j))
        d, du = docs[i], docs[j]
        c = int(d.offs[p.s])
        rep.examples.append(DriftExample(
            trajectory=trajs[i].id, other=trajs[j].id, group=trajs[i].group, token=p.s, char=c, lost=lost,
            before=d.text[max(0, c - context):c], after=d.text[c:c + context],
            pieces=_pieces(d, p.s, p.jt), other_pieces=_pieces(du, p.s, p.ju)))
    return rep


def repair_drift(trajs: Sequence[Trajectory], tokenizer) -> Tuple[List[Trajectory], List[RepairChange]]:
    """``trajs`` with the *safe* rule applied (the same order and ids) and what it changed."""
    tt = tokenizer if isinstance(tokenizer, TokenText) else TokenText(tokenizer)
    out, changes, _ = _repair(trajs, _documents(tt, trajs), safe=True)
    return out, changes


def repair_lines(changes: Sequence[RepairChange], before: int, after: int, top: int = 3) -> List[str]:
    """The summary of a repair: one line, then the ``top`` largest changes."""
    if not changes:
        return ["repair-drift: nothing to repair"]
    touched = len({c.trajectory for c in changes})
    out = [f"repair-drift: re-tokenized {touched:,} trajectories alike ({len(changes):,} spans, "
           f"{sum(c.removed for c in changes):,} context tokens -> {sum(c.added for c in changes):,}): unique "
           f"tokens {before:,} -> {after:,}"]
    for c in sorted(changes, key=lambda c: -c.removed)[:top]:
        out.append(f"  {c.trajectory!r}: tokens {c.at:,}..{c.at + c.removed:,} replaced by {c.added:,} tokens "
                   f"of {c.donor!r}")
    return out
