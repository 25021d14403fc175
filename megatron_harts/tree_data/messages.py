"""Rollouts as chat messages -> trajectories of token ids and loss masks (docs/messages.md).

A row holds ``messages`` (OpenAI chat format) beside the RL fields of docs/data_format.md, and
optionally the engine's ``tokens``.  A chat template (a transformers tokenizer directory) turns
the messages into text.  Two forms:

- ``exact`` (default): every target message k is the completion of one model call, whose prompt
  is ``messages[:k]`` rendered with the generation prompt and tokenized as one text (what the
  engine did), and whose completion is the text rendering ``messages[:k+1]`` adds, tokenized on
  its own through its last end-of-sequence token.  The calls are merged by prefix
  (engine_records.merge_calls): one trajectory while each prompt extends the previous prompt
  plus completion token for token, a new trajectory ``ID#j`` where the template re-rendered the
  history.  A message the template renders nothing of, or a completion not rendered after its
  prompt, is an error naming it: no message is lost.
- ``single-trajectory`` (opt-in): one trajectory per row, message by message: message k
  contributes the text rendering ``messages[:k+1]`` appends to the rendering of ``messages[:k]``;
  where the template re-renders earlier turns they stay as rendered when they were the latest,
  so later turns are trained on a context the model did not see.

With engine ``tokens`` the ids are the engine's; they must decode to the text of the row's one
trajectory, and the loss mask follows the characters each token covers.  transformers is
imported only by ``load_chat_tokenizer``.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .drift import TokenText
from .engine_records import Call, Segment, merge_calls, segment_id
from .errors import TreeFormatError
from .readers import KNOWN_FIELDS, UnknownFieldsWarning
from .trajectory import LOGPROB_FIELDS, Trajectory, make_trajectory

ROLES = ("system", "developer", "user", "assistant", "tool")
ROW_FIELDS = KNOWN_FIELDS | {"messages", "tools"}
CACHE_TURNS = 8192     # cached turns before the cache is emptied (rows of one group rarely hold more)


def ships_code(path: str) -> Optional[str]:
    """What makes the tokenizer directory ``path`` run its own code (an ``auto_map`` naming a
    tokenizer class in tokenizer_config.json or config.json), or None."""
    for name in ("tokenizer_config.json", "config.json"):
        f = os.path.join(path, name)
        if not os.path.isfile(f):
            continue
        try:
            with open(f, encoding="utf-8") as fh:
                cfg = json.load(fh)
        except (OSError, ValueError):
            continue
        auto = cfg.get("auto_map") if isinstance(cfg, dict) else None
        if isinstance(auto, dict) and auto.get("AutoTokenizer"):
            ref = auto["AutoTokenizer"]
            ref = next((r for r in ref if r), None) if isinstance(ref, (list, tuple)) else ref
            return f"{name} maps AutoTokenizer to {ref!r}"
    return None


def load_chat_tokenizer(path: str, trust_remote_code: bool = False):
    """The transformers tokenizer saved in directory ``path`` (local files only; it must have a chat
    template).  A tokenizer that ships its own code (tiktoken-based ones such as Kimi-Linear's) runs
    it only with ``trust_remote_code``.  A problem is a TreeFormatError naming the directory."""
    if not os.path.isdir(path):
        raise TreeFormatError("no such tokenizer directory", file=path)
    code = ships_code(path)
    if code is not None and not trust_remote_code:
        raise TreeFormatError(f"the tokenizer ships its own code ({code}): pass --trust-remote-code to run it",
                              file=path)
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=code is not None)
    except Exception as e:  # transformers raises many types for a broken directory
        raise TreeFormatError(f"cannot load a tokenizer: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
                              file=path) from None
    if not getattr(tok, "chat_template", None):
        raise TreeFormatError("the tokenizer has no chat template", file=path)
    return tok


def messages_row(path: str) -> Optional[Tuple[int, object]]:
    """(line, id) of the first row of ``path`` (JSONL or Parquet) when it has a ``messages`` field,
    else None (an unreadable file is the reader's to report)."""
    try:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq
            pf = pq.ParquetFile(path)
            if "messages" not in pf.schema_arrow.names:
                return None
            first = next(pf.iter_batches(batch_size=1, columns=[c for c in ("id",) if c in pf.schema_arrow.names]))
            return 1, (first.to_pylist()[0].get("id") if first.num_rows else None)
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as fh:
            for line, text in enumerate(fh, start=1):
                if text.strip():
                    rec = json.loads(text)
                    return (line, rec.get("id")) if isinstance(rec, dict) and "messages" in rec else None
    except Exception:
        return None
    return None


def require_tokenizer_for_messages(paths: Iterable[str]) -> None:
    """A TreeFormatError naming the first row in messages form of ``paths``, if any: without a
    tokenizer such rows have no token ids."""
    for path in paths:
        hit = messages_row(path)
        if hit is not None:
            raise TreeFormatError("chat messages need --tokenizer DIR (a tokenizer directory with a chat template) "
                                  "to become token ids", file=path, line=hit[0], trajectory=hit[1], field="messages")


def _rows(path: str) -> Iterator[Tuple[int, dict]]:
    """(line, record) of every row of a JSONL or Parquet file; bad JSON is a TreeFormatError."""
    if not os.path.exists(path):
        raise TreeFormatError("no such file", file=path)
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq
        try:
            table = pq.read_table(path)
        except Exception as e:
            raise TreeFormatError(f"malformed Parquet: {e}", file=path) from None
        for row, rec in enumerate(table.to_pylist(), start=1):
            yield row, rec
        return
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            lines = fh.readlines()
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise TreeFormatError(f"cannot read: {e}", file=path) from None
    for line, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as e:
            raise TreeFormatError(f"malformed JSON at column {e.colno}: {e.msg}", file=path, line=line) from None
        if not isinstance(rec, dict):
            raise TreeFormatError(f"expected a JSON object, got {type(rec).__name__}", file=path, line=line)
        yield line, rec


# ---- validation -------------------------------------------------------------------------------------

def _content_text(content, where, name: str) -> Optional[str]:
    """A message's content as a string: a string, or a list of text parts joined (None stays None)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise where(f"{name}.content", f"part {j} is not a text part {{\"type\": \"text\", \"text\": ...}}")
            out.append(part["text"])
        return "".join(out)
    raise where(f"{name}.content", f"must be a string or a list of text parts, got {type(content).__name__}")


def _trainable(m: dict, where, name: str) -> bool:
    """Whether message ``m`` is a target: ``trainable`` / ``weight`` (0 or 1) when given, else
    whether it is an assistant message."""
    flags = []
    if m.get("trainable") is not None:
        if not isinstance(m["trainable"], bool):
            raise where(f"{name}.trainable", f"must be true or false, got {m['trainable']!r}")
        flags.append(m["trainable"])
    if m.get("weight") is not None:
        w = m["weight"]
        if isinstance(w, bool) or w not in (0, 1):
            raise where(f"{name}.weight", f"is {w!r}: must be 0 or 1 (the loss mask is binary)")
        flags.append(bool(w))
    if len(flags) == 2 and flags[0] != flags[1]:
        raise where(f"{name}.weight", f"is {m['weight']!r} but 'trainable' is {m['trainable']!r}")
    return flags[0] if flags else m["role"] == "assistant"


def validate_messages(messages, where) -> Tuple[List[dict], List[bool]]:
    """The messages as the template receives them (``weight``/``trainable`` removed, text parts
    joined) and whether each is a target.  ``where(field, message)`` builds the error."""
    if not isinstance(messages, list) or not messages:
        raise where("messages", "must be a non-empty list of messages")
    out, flags = [], []
    calls = set()
    for k, m in enumerate(messages):
        name = f"messages[{k}]"
        if not isinstance(m, dict):
            raise where(name, f"must be an object with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise where(f"{name}.role", f"is {role!r}: must be one of {', '.join(ROLES)}")
        content = _content_text(m.get("content"), where, name)
        tool_calls = m.get("tool_calls")
        if tool_calls is not None:
            if role != "assistant":
                raise where(f"{name}.tool_calls", f"only assistant messages make tool calls, this one is {role!r}")
            if not isinstance(tool_calls, list):
                raise where(f"{name}.tool_calls", "must be a list of tool calls")
            for j, c in enumerate(tool_calls):
                if not isinstance(c, dict):
                    raise where(f"{name}.tool_calls", f"call {j} is not an object")
                cid = c.get("id")
                if not isinstance(cid, str) or not cid:
                    raise where(f"{name}.tool_calls[{j}].id", "is missing: every tool call needs an id")
                fn = c.get("function")
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or "arguments" not in fn:
                    raise where(f"{name}.tool_calls[{j}].function",
                                'must be an object {"name": ..., "arguments": ...}')
                calls.add(cid)
        if content is None and not (role == "assistant" and tool_calls):
            raise where(f"{name}.content", "is missing")
        if role == "tool" and m.get("tool_call_id") is not None and m["tool_call_id"] not in calls:
            raise where(f"{name}.tool_call_id", f"{m['tool_call_id']!r} names no earlier tool call")
        if k == 0 and role == "assistant":
            raise where(f"{name}.role", "a conversation cannot start with an assistant message (nothing prompts it)")
        flags.append(_trainable(m, where, name))
        clean = {key: v for key, v in m.items() if key not in ("weight", "trainable") and v is not None}
        if content is not None:
            clean["content"] = content
        out.append(clean)
    return out, flags


# ---- prefix-stable tokenization -----------------------------------------------------------------------

def _lcp(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def appended_text(before: str, after: str) -> Tuple[Optional[str], bool]:
    """The text ``after`` appends to ``before``, and whether ``after`` re-renders ``before``.

    When ``after`` starts with ``before`` it is the rest.  Otherwise the tails after their common
    prefix are aligned and the text after the last aligned block that ends where ``before`` ends
    is the appended text (None when the end of ``before`` is not found in ``after``)."""
    if after.startswith(before):
        return after[len(before):], False
    import difflib
    n = _lcp(before, after)
    a, b = before[n:], after[n:]
    blocks = [blk for blk in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks() if blk.size]
    if not a or not blocks or blocks[-1].a + blocks[-1].size != len(a):
        return None, True
    last = blocks[-1]
    return b[last.b + last.size:], True


EXACT = "exact"
SINGLE = "single-trajectory"
FORMS = (EXACT, SINGLE)


@dataclass
class TokenizeReport:
    """What the conversion did beyond the plain rule (the converter prints it)."""
    form: str = EXACT
    trajectories: int = 0
    conversations: int = 0
    messages: int = 0
    calls: int = 0                           # model calls (target messages)
    tokens: int = 0
    targets: int = 0
    branches: int = 0                        # exact form: trajectories started by a prompt that re-renders history
    branch_tokens: int = 0                   # ... and the re-rendered tokens they compute again
    branch_calls: int = 0                    # calls in those trajectories: the single-trajectory form trains them
                                             # on a context that differs from the one the model saw
    branch_conversations: List = field(default_factory=list)
    unseen: int = 0                          # exact form: messages after the last call that no call saw, not stored
    rerendered: int = 0                      # single form: message boundaries where the template re-rendered
    rerendered_trajectories: List = field(default_factory=list)
    prompt_mismatch: int = 0                 # single form: assistant turns not starting with the generation prompt
    engine: int = 0                          # trajectories carrying engine tokens
    engine_differs: List = field(default_factory=list)   # ... whose ids differ from the converter's

    def to_dict(self) -> dict:
        return {"form": self.form, "conversations": self.conversations, "calls": self.calls,
                "trajectories": self.trajectories, "messages": self.messages, "tokens": self.tokens,
                "targets": self.targets, "branch_trajectories": self.branches, "branch_tokens": self.branch_tokens,
                "branch_calls": self.branch_calls, "unseen_messages": self.unseen,
                "rerendered_boundaries": self.rerendered,
                "rerendered_trajectories": len(self.rerendered_trajectories), "prompt_mismatch": self.prompt_mismatch,
                "engine_tokens": self.engine, "engine_tokens_differ": len(self.engine_differs)}

    def lines(self) -> List[str]:
        out = []
        if self.branches:
            ids = ", ".join(map(repr, self.branch_conversations[:3]))
            out.append(f"exact form: {self.calls:,} calls of {self.conversations:,} conversations -> "
                       f"{self.trajectories:,} trajectories; {self.branches:,} start where the template re-renders "
                       f"the history of a call (e.g. {ids}), computing {self.branch_tokens:,} re-rendered tokens "
                       f"again")
        if self.unseen:
            out.append(f"{self.unseen:,} messages after the last call of their conversation are seen by no call "
                       f"and are not stored (the template re-renders the history before them)")
        if self.rerendered:
            ids = ", ".join(map(repr, self.rerendered_trajectories[:3]))
            out.append(f"single-trajectory form: the chat template re-renders earlier turns at {self.rerendered:,} "
                       f"message boundaries of {len(self.rerendered_trajectories):,} trajectories (e.g. {ids}): "
                       f"every turn is kept as rendered when it was the latest, so later turns are trained on a "
                       f"context that differs from the one the model saw")
        if self.prompt_mismatch:
            out.append(f"{self.prompt_mismatch:,} assistant turns do not start with the template's generation "
                       f"prompt: their text up to where they differ from it is context")
        if self.engine:
            differs = len(self.engine_differs)
            eg = f" (e.g. {', '.join(map(repr, self.engine_differs[:3]))})" if differs else ""
            out.append(f"{self.engine:,} trajectories carry engine tokens (kept; they decode to their messages); "
                       f"{differs:,} differ from the converter's tokenization{eg}")
        return out


@dataclass
class _Turn:
    """Message k of a conversation rendered after ``messages[:k]``: its token ids and loss mask, its
    text, and the rendering of ``messages[:k+1]`` (the next turn's starting point)."""
    ids: np.ndarray
    mask: np.ndarray
    text: str
    char_mask: np.ndarray          # uint8 per character of ``text``
    rendered: str
    rerendered: bool
    prompt_mismatch: bool


class ChatTokenizer:
    """Messages -> (ids, loss mask, text) with a transformers tokenizer, message by message.

    Turns are cached by the hash of the conversation up to them, so a history shared by several
    trajectories is rendered and tokenized once (``reset`` empties the cache)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.eos = tokenizer.eos_token_id
        self.text_of = TokenText(tokenizer)
        self.cache: Dict[bytes, _Turn] = {}
        self.renders: Dict[Tuple[bytes, bool], str] = {}
        self.encoded: Dict[Tuple[bytes, bool], np.ndarray] = {}

    def reset(self) -> None:
        self.cache.clear()
        self.renders.clear()
        self.encoded.clear()

    def cached(self) -> int:
        return len(self.cache) + len(self.renders)

    def _render_at(self, key: bytes, messages, tools, k: int, gen: bool, where) -> str:
        """The rendering of ``messages[:k]`` (``key``: the hash of that prefix), cached."""
        ck = (key, gen)
        text = self.renders.get(ck)
        if text is None:
            text = self.renders[ck] = self._render(messages[:k], tools, gen, where, max(0, k - 1))
        return text

    def _encode_at(self, key: bytes, gen: bool, text: str) -> np.ndarray:
        ck = (key, gen)
        ids = self.encoded.get(ck)
        if ids is None:
            ids = self.encoded[ck] = self._encode(text)
        return ids

    def calls(self, messages, flags, tools, where) -> Tuple[List[Call], Optional[np.ndarray]]:
        """The model calls of a validated conversation, exactly as the engine made them, and the ids
        of the whole conversation's rendering when messages follow the last call (else None).

        A call is a target message k: its prompt is ``messages[:k]`` rendered (with the generation
        prompt for an assistant message) and tokenized as one text; its completion is the text that
        rendering ``messages[:k+1]`` appends to that prompt, tokenized on its own, up to and
        including its last end-of-sequence token (an assistant message).  A message the template
        renders nothing of, or an assistant message not rendered after its call's prompt, is an
        error naming it."""
        n = len(messages)
        keys = [hashlib.blake2b(json.dumps(tools, sort_keys=True).encode(), digest_size=16).digest()]
        for k, m in enumerate(messages):
            keys.append(hashlib.blake2b(keys[-1] + json.dumps(m, sort_keys=True).encode(), digest_size=16).digest())
        prev = None
        for k in range(n):       # every message shows in the rendering it ends
            cur = self._render_at(keys[k + 1], messages, tools, k + 1, False, where)
            if cur == prev or not cur:
                raise where(f"messages[{k}]", "the chat template renders nothing of this message: it would be lost")
            prev = cur
        out: List[Call] = []
        last = -1
        for k in range(n):
            if not flags[k]:
                continue
            last = k
            gen = messages[k]["role"] == "assistant"
            prompt = self._render_at(keys[k], messages, tools, k, gen, where) if k else ""
            full = self._render_at(keys[k + 1], messages, tools, k + 1, False, where)
            if not full.startswith(prompt):
                c = _lcp(prompt, full)
                raise where(f"messages[{k}]", f"the chat template does not render this message after the prompt of "
                                              f"its call (they differ at character {c}: {prompt[c:c + 30]!r} vs "
                                              f"{full[c:c + 30]!r}): cannot tell what the model generated")
            ids = self._encode(full[len(prompt):])
            cut = ids.shape[0]
            if gen and self.eos is not None:
                hits = np.flatnonzero(ids == self.eos)
                if hits.size:
                    cut = int(hits[-1]) + 1
            p_ids = self._encode_at(keys[k], gen, prompt) if k else np.zeros(0, np.int64)
            out.append(Call(k, p_ids, ids[:cut], np.ones(cut, np.uint8)))
        trailing = None
        if last < n - 1:
            trailing = self._encode_at(keys[n], False, self._render_at(keys[n], messages, tools, n, False, where))
        return out, trailing

    def _render(self, messages, tools, gen: bool, where, k: int) -> str:
        try:
            return self.tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)
        except Exception as e:
            text = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise where(f"messages[{k}]", f"the chat template fails on it: {text}") from None

    def _encode(self, text: str) -> np.ndarray:
        if not text:
            return np.zeros(0, dtype=np.int64)
        return np.asarray(self.tok.encode(text, add_special_tokens=False), dtype=np.int64)

    def _turn(self, messages, flags, tools, k: int, before: str, where) -> _Turn:
        after = self._render(messages[:k + 1], tools, False, where, k)
        delta, rerendered = appended_text(before, after)
        body = (messages[k].get("content") or "").split("</think>")[-1].strip()
        if delta is None or (rerendered and (not delta or body not in delta)):
            raise where(f"messages[{k}]", "the chat template re-renders the earlier turns once this message follows "
                                          "and its text cannot be told apart from them: the single-trajectory form "
                                          "would lose it (the exact form takes each call's prompt as rendered)")
        head, mismatch = "", False
        if messages[k]["role"] == "assistant":
            prompt, _ = appended_text(before, self._render(messages[:k], tools, True, where, k))
            prompt = prompt or ""
            if delta.startswith(prompt):
                head = prompt
            else:
                head, mismatch = delta[:_lcp(prompt, delta)], True
        body = delta[len(head):]
        h_ids, b_ids = self._encode(head), self._encode(body)
        b_mask = np.full(b_ids.shape[0], 1 if flags[k] else 0, dtype=np.uint8)
        char_mask = np.zeros(len(delta), dtype=np.uint8)
        if flags[k] and b_ids.shape[0]:
            cut = b_ids.shape[0]
            if messages[k]["role"] == "assistant" and self.eos is not None:
                hits = np.flatnonzero(b_ids == self.eos)
                if hits.size:
                    cut = int(hits[-1]) + 1
            b_mask[cut:] = 0
            generated = self.tok.decode(b_ids[:cut].tolist(), skip_special_tokens=False,
                                        clean_up_tokenization_spaces=False) if cut < b_ids.shape[0] else body
            char_mask[len(head):len(head) + len(generated)] = 1
        return _Turn(np.concatenate([h_ids, b_ids]),
                     np.concatenate([np.zeros(h_ids.shape[0], np.uint8), b_mask]),
                     delta, char_mask, after, rerendered, mismatch)

    def tokenize(self, messages, flags, tools, where) -> List[_Turn]:
        """The turns of a validated conversation; the ids of turn k depend on ``messages[:k+1]`` only."""
        key = hashlib.blake2b(json.dumps(tools, sort_keys=True).encode(), digest_size=16).digest()
        turns, before = [], ""
        for k, m in enumerate(messages):
            key = hashlib.blake2b(key + json.dumps([m, flags[k]], sort_keys=True).encode(), digest_size=16).digest()
            turn = self.cache.get(key)
            if turn is None:
                turn = self.cache[key] = self._turn(messages, flags, tools, k, before, where)
            turns.append(turn)
            before = turn.rendered
        return turns


# ---- engine tokens --------------------------------------------------------------------------------------

def _engine_mask(text_of: TokenText, tokens: np.ndarray, text: str, char_mask: np.ndarray, where) -> np.ndarray:
    """The loss mask of engine ``tokens``: a token is a target when every character it covers is.
    The tokens may stop before context that ends the text (what the template renders after the
    last generated token)."""
    dec, ends = text_of.ends(tokens.tolist())
    if len(dec) < len(text) and text.startswith(dec) and not char_mask[len(dec):].any():
        text, char_mask = dec, char_mask[:len(dec)]    # the engine's ids end before trailing context
    if dec != text:
        c = _lcp(dec, text)
        raise where("tokens", f"decode to text that differs from the messages rendered with the chat template at "
                              f"character {c}: tokens give {dec[c:c + 30]!r}, the messages {text[c:c + 30]!r}")
    starts = np.concatenate([[0], ends[:-1]])
    # prefix sums of non-target characters: a token is a target when its span has none
    ctx = np.concatenate([[0], np.cumsum(1 - char_mask.astype(np.int64))])
    return ((ends > starts) & (ctx[ends] == ctx[starts])).astype(np.uint8)


def _per_token(values, n: int, targets: np.ndarray, where, name: str):
    """A log-prob field (``old_logprobs``, ``rollout_logprobs``, ``ref_logprobs``) one per token, or one
    per target token (scattered, null elsewhere)."""
    if not isinstance(values, (list, tuple)):
        return values      # make_trajectory names the problem
    if len(values) == n:
        return list(values)
    if len(values) == int(targets.sum()):
        out: List = [None] * n
        for j, v in zip(np.flatnonzero(targets).tolist(), values):
            out[j] = v
        return out
    raise where(name, f"has {len(values)} entries: one per token ({n}) or one per target token "
                      f"({int(targets.sum())})")


# ---- rows -> trajectories -----------------------------------------------------------------------------------

def _row_prelude(rec: dict, file, line):
    tid = rec.get("id")

    def where(name, message):
        return TreeFormatError(message, file=file, line=line, trajectory=tid, field=name)

    if "id" not in rec or tid is None:
        raise where("id", "is missing")
    if rec.get("messages") is None:
        raise where("messages", "is missing (with --tokenizer every row holds chat messages)")
    messages, flags = validate_messages(rec["messages"], where)
    tools = rec.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise where("tools", "must be a list of tool definitions")
    if rec.get("loss_mask") is not None:
        raise where("loss_mask", "comes from the messages (assistant turns are targets): use per-message "
                                 "'trainable' or 'weight' instead")
    engine = rec.get("tokens")
    if engine is not None:
        if not isinstance(engine, (list, tuple, np.ndarray)) or not all(
                isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0 for v in engine):
            raise where("tokens", "must be a list of token ids >= 0")
        engine = np.asarray(engine, dtype=np.int64)
    else:
        for name in LOGPROB_FIELDS:
            if rec.get(name) is not None:
                raise where(name, "needs the engine 'tokens' it belongs to (the messages alone give no "
                                  "sampled token ids)")
        if isinstance(rec.get("advantage"), (list, tuple)):
            raise where("advantage", "per-token advantages need the engine 'tokens' they belong to")
    return tid, where, messages, flags, tools, engine


def row_to_trajectories(rec: dict, chat: ChatTokenizer, report: TokenizeReport, *, file: Optional[str] = None,
                        line: Optional[int] = None, vocab_size: Optional[int] = None,
                        form: str = EXACT) -> List[Trajectory]:
    """One messages row as validated Trajectories: in the exact form one per run of calls whose
    prompts extend each other (ids ``ID``, ``ID#1``, ...), in the single-trajectory form one."""
    if form == SINGLE:
        return [row_to_trajectory(rec, chat, report, file=file, line=line, vocab_size=vocab_size)]
    if form != EXACT:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    tid, where, messages, flags, tools, engine = _row_prelude(rec, file, line)
    calls, trailing = chat.calls(messages, flags, tools, where)
    segs = merge_calls(calls)
    last = calls[-1].index if calls else -1
    if trailing is not None:
        if not segs:
            segs = [Segment(trailing, np.zeros(trailing.shape[0], np.uint8), None)]
        elif trailing.shape[0] >= segs[-1].tokens.shape[0] and np.array_equal(
                trailing[:segs[-1].tokens.shape[0]], segs[-1].tokens):
            s = segs[-1]
            s.mask = np.concatenate([s.mask, np.zeros(trailing.shape[0] - s.tokens.shape[0], np.uint8)])
            s.tokens = trailing
        else:
            report.unseen += len(messages) - 1 - last
    if segs[0].tokens.shape[0] == 0:
        raise where("messages", "render to no tokens")
    segs[0].mask[0] = 0
    if len(segs) > 1:
        for name in ("tokens", "parent", "compactions"):
            if rec.get(name) is not None:
                raise where(name, f"counts the tokens of one sequence, but the chat template re-renders the history "
                                  f"at message {calls[segs[1].calls[0]].index}: in the exact form this conversation "
                                  f"is {len(segs)} trajectories (give the engine's ids per call as engine token "
                                  f"records, docs/messages.md)")
    base = {k: v for k, v in rec.items() if k in KNOWN_FIELDS and k not in ("tokens", "loss_mask", *LOGPROB_FIELDS)}
    out = []
    for j, s in enumerate(segs):
        row = {k: v for k, v in base.items() if j == 0 or k not in ("parent", "compactions")}
        row.update(id=segment_id(tid, j), tokens=s.tokens, loss_mask=s.mask)
        if engine is not None:
            report.engine += 1
            if not np.array_equal(engine, s.tokens):
                report.engine_differs.append(tid)
                text, ends = chat.text_of.ends(s.tokens.tolist())
                starts = np.concatenate([[0], ends[:-1]])
                char_mask = np.zeros(len(text), np.uint8)
                char_mask[:int(ends[-1])] = np.repeat(s.mask, ends - starts)[:len(text)]
                row["loss_mask"] = _engine_mask(chat.text_of, engine, text, char_mask, where)
                row["loss_mask"][0] = 0
                row["tokens"] = engine
            for name in LOGPROB_FIELDS:
                if rec.get(name) is not None:
                    row[name] = _per_token(rec[name], engine.shape[0], row["loss_mask"], where, name)
        t = make_trajectory(row, file=file, line=line, vocab_size=vocab_size)
        out.append(t)
        report.tokens += len(t)
        report.targets += int(t.loss_mask.sum())
    report.trajectories += len(segs)
    report.conversations += 1
    report.messages += len(messages)
    report.calls += len(calls)
    report.branches += len(segs) - 1
    report.branch_tokens += sum(s.recomputed for s in segs)
    report.branch_calls += sum(len(s.calls) for s in segs[1:])
    if len(segs) > 1:
        report.branch_conversations.append(tid)
    return out


def row_to_trajectory(rec: dict, chat: ChatTokenizer, report: TokenizeReport, *, file: Optional[str] = None,
                      line: Optional[int] = None, vocab_size: Optional[int] = None) -> Trajectory:
    """One messages row in the single-trajectory form: every turn kept as rendered when it was the
    latest; where the template re-renders history, later turns are trained on a context that
    differs from the one the model saw (engine ``tokens`` win when given)."""
    tid, where, messages, flags, tools, engine = _row_prelude(rec, file, line)
    turns = chat.tokenize(messages, flags, tools, where)
    ids = np.concatenate([t.ids for t in turns])
    mask = np.concatenate([t.mask for t in turns])
    out = {k: v for k, v in rec.items() if k in KNOWN_FIELDS}
    if engine is not None:
        report.engine += 1
        if not np.array_equal(engine, ids):
            report.engine_differs.append(tid)
            text = "".join(t.text for t in turns)
            mask = _engine_mask(chat.text_of, engine, text, np.concatenate([t.char_mask for t in turns]), where)
        ids = engine
    if ids.shape[0] == 0:
        raise where("messages", "render to no tokens")
    mask = mask.copy()
    mask[0] = 0
    out["tokens"] = ids
    out["loss_mask"] = mask
    for name in LOGPROB_FIELDS:
        if rec.get(name) is not None:
            out[name] = _per_token(rec[name], ids.shape[0], mask, where, name)
    report.trajectories += 1
    report.conversations += 1
    report.calls += sum(flags)
    report.messages += len(messages)
    report.tokens += int(ids.shape[0])
    report.targets += int(mask.sum())
    rer = sum(t.rerendered for t in turns)
    if rer:
        report.rerendered += rer
        report.rerendered_trajectories.append(tid)
    report.prompt_mismatch += sum(t.prompt_mismatch for t in turns)
    return make_trajectory(out, file=file, line=line, vocab_size=vocab_size)


def read_messages(paths: Iterable[str], tokenizer, *, vocab_size: Optional[int] = None,
                  progress: Optional[Callable[[int], None]] = None, form: str = EXACT
                  ) -> Tuple[List[Trajectory], TokenizeReport]:
    """Every row of ``paths`` (messages form) as Trajectories, in file order, and the report.
    ``tokenizer``: a transformers tokenizer or a ChatTokenizer; ``form``: ``exact`` (default: each
    call's prompt as the engine rendered it) or ``single-trajectory`` (one trajectory per row, whose
    trained context differs from the rollout's where the template re-renders history).

    Unknown fields are ignored with one UnknownFieldsWarning listing them."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    chat = tokenizer if isinstance(tokenizer, ChatTokenizer) else ChatTokenizer(tokenizer)
    report = TokenizeReport(form=form)
    trajs: List[Trajectory] = []
    unknown = set()
    group = object()
    for path in paths:
        for line, rec in _rows(path):
            unknown.update(k for k in rec if k not in ROW_FIELDS)
            if rec.get("group") != group or chat.cached() > CACHE_TURNS:   # a group's rows share histories
                chat.reset()
                group = rec.get("group")
            trajs.extend(row_to_trajectories(rec, chat, report, file=path, line=line, vocab_size=vocab_size,
                                             form=form))
            if progress:
                progress(1)
    if unknown:
        warnings.warn("ignored unknown fields: " + ", ".join(sorted(unknown)), UnknownFieldsWarning, stacklevel=2)
    return trajs, report


@dataclass
class InputReport:
    """How one input file was read: ``kind`` is ``tokens``, ``messages`` or ``records`` (engine token
    records); ``report`` the TokenizeReport or RecordReport (None for token-id files)."""
    path: str
    kind: str
    report: object = None
    start: int = 0              # the file's trajectories are trajs[start:end] of read_rollouts
    end: int = 0


def read_rollouts(paths: Sequence[str], tokenizer=None, *, vocab_size: Optional[int] = None, workers: int = 1,
                  progress: Optional[Callable[[int], None]] = None, form: str = EXACT
                  ) -> Tuple[List[Trajectory], List[InputReport]]:
    """Trajectories of token-id files, engine token record files (first row has
    ``prompt_token_ids``) and, with ``tokenizer``, messages files (first row has ``messages``), in
    ``form``; and how each input was read.

    Without a tokenizer a messages file is a TreeFormatError naming its first row."""
    from .engine_records import is_record_file, read_engine_records
    from .readers import read_trajectories

    if tokenizer is None:
        require_tokenizer_for_messages(paths)
    trajs: List[Trajectory] = []
    inputs: List[InputReport] = []
    chat = None if tokenizer is None else ChatTokenizer(tokenizer)
    for path in paths:
        start = len(trajs)
        if is_record_file(path):
            part, rep = read_engine_records([path], vocab_size=vocab_size, progress=progress)
            kind = "records"
        elif chat is not None and messages_row(path) is not None:
            chat.reset()
            part, rep = read_messages([path], chat, vocab_size=vocab_size, progress=progress, form=form)
            kind = "messages"
        else:
            part, rep, kind = read_trajectories([path], vocab_size=vocab_size, workers=workers,
                                                progress=progress), None, "tokens"
        trajs.extend(part)
        inputs.append(InputReport(path, kind, rep, start, len(trajs)))
    return trajs, inputs


def _form_stats(trajs: Sequence[Trajectory]) -> dict:
    from .forest import build_forest
    st = build_forest(trajs).stats()
    return {"trajectories": st["num_trajectories"], "expanded_tokens": st["expanded_tokens"],
            "unique_tokens": st["unique_tokens"], "compression": st["compression"]}


def compare_forms(inputs: Sequence[InputReport], trajs: Sequence[Trajectory], tokenizer=None, *,
                  vocab_size: Optional[int] = None) -> List[dict]:
    """Per messages or engine-record input: its calls, the trajectories re-render branching made and
    the re-rendered tokens they compute again, and the unique tokens / compression of the exact
    form beside the single-trajectory form (messages inputs; null for engine records, which are
    exact by nature).  ``trajs``/``inputs``: what read_rollouts gave (in any form)."""
    out = []
    for inp in inputs:
        if inp.kind == "tokens":
            continue
        rep = inp.report
        mine = list(trajs[inp.start:inp.end])
        if inp.kind == "records":
            out.append({"input": inp.path, "kind": "records", "conversations": rep.conversations,
                        "calls": rep.calls, "trajectories": rep.trajectories, "branch_trajectories": rep.branches,
                        "branch_tokens": rep.recomputed_tokens, "branch_calls": rep.branch_calls,
                        "exact": _form_stats(mine),
                        "single_trajectory": None})
            continue
        other = SINGLE if rep.form == EXACT else EXACT
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnknownFieldsWarning)
            alt, alt_rep = read_messages([inp.path], tokenizer, vocab_size=vocab_size, form=other)
        exact, ex_rep = (mine, rep) if rep.form == EXACT else (alt, alt_rep)
        single = alt if rep.form == EXACT else mine
        out.append({"input": inp.path, "kind": "messages", "conversations": ex_rep.conversations,
                    "calls": ex_rep.calls, "trajectories": ex_rep.trajectories,
                    "branch_trajectories": ex_rep.branches, "branch_tokens": ex_rep.branch_tokens,
                    "branch_calls": ex_rep.branch_calls, "exact": _form_stats(exact),
                    "single_trajectory": _form_stats(single)})
    return out


def compare_lines(rows: Sequence[dict]) -> List[str]:
    """One line per input of ``compare_forms``."""
    out = []
    for r in rows:
        e, s = r["exact"], r["single_trajectory"]
        line = (f"{r['input']}: {r['calls']:,} calls of {r['conversations']:,} conversations -> "
                f"{r['trajectories']:,} trajectories, {r['branch_trajectories']:,} of them by re-render branching "
                f"({r['branch_tokens']:,} re-rendered tokens computed again; {r['branch_calls']:,} calls whose "
                f"context the single-trajectory form would change); exact form {e['unique_tokens']:,} "
                f"unique tokens ({e['compression']:.2f}x)")
        if s is not None:
            line += (f", single-trajectory form (trained context differs from the rollout's) "
                     f"{s['unique_tokens']:,} ({s['compression']:.2f}x)")
        out.append(line)
    return out


def merged_reports(inputs: Sequence[InputReport]) -> Tuple[Optional[TokenizeReport], Optional[object]]:
    """The TokenizeReport of all messages inputs and the RecordReport of all engine-record inputs
    (None where there is none)."""
    from .engine_records import RecordReport
    msg = rec = None
    for inp in inputs:
        r = inp.report
        if inp.kind == "messages":
            if msg is None:
                msg = TokenizeReport(form=r.form)
            for name in ("trajectories", "conversations", "messages", "calls", "tokens", "targets", "branches",
                         "branch_tokens", "branch_calls", "unseen", "rerendered", "prompt_mismatch", "engine"):
                setattr(msg, name, getattr(msg, name) + getattr(r, name))
            for name in ("branch_conversations", "rerendered_trajectories", "engine_differs"):
                getattr(msg, name).extend(getattr(r, name))
        elif inp.kind == "records":
            rec = rec or RecordReport()
            for name in ("conversations", "calls", "trajectories", "branches", "recomputed_tokens", "branch_calls"):
                setattr(rec, name, getattr(rec, name) + getattr(r, name))
            rec.examples.extend(r.examples)
    return msg, rec
