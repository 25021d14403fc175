"""Rollouts as chat messages -> token ids and a loss mask, prefix-stable (docs/messages.md).

A row holds ``messages`` (OpenAI chat format) beside the RL fields of docs/data_format.md, and
optionally the engine's ``tokens``.  A chat template (a transformers tokenizer directory) turns
the messages into text, one message at a time:

- message k contributes the text that rendering ``messages[:k+1]`` appends to the rendering of
  ``messages[:k]``; that text is tokenized on its own, so the tokens of turn k never depend on
  later turns and a history shared by several trajectories gets identical ids in all of them;
- an assistant message is preceded by the template's generation prompt (the text rendering
  ``messages[:k]`` with ``add_generation_prompt`` appends), which is context; the rest of the
  turn is a target up to and including its last end-of-sequence token (what the model
  generated); text the template puts after that token is context;
- where the template renders earlier turns differently once a later message follows (e.g. it
  drops earlier reasoning), the earlier turns stay as they were rendered when they were the
  latest (what the model saw) and the new message contributes the text appended after them;
  the report counts those boundaries.

With engine ``tokens`` the ids are the engine's; they must decode to the text of the messages,
and the loss mask follows the characters each token covers.  transformers is imported only by
``load_chat_tokenizer``.
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
from .errors import TreeFormatError
from .readers import KNOWN_FIELDS, UnknownFieldsWarning
from .trajectory import Trajectory, make_trajectory

ROLES = ("system", "developer", "user", "assistant", "tool")
ROW_FIELDS = KNOWN_FIELDS | {"messages", "tools"}
CACHE_TURNS = 8192     # cached turns before the cache is emptied (rows of one group rarely hold more)


def load_chat_tokenizer(path: str):
    """The transformers tokenizer saved in directory ``path`` (local files only; it must have a chat
    template).  A problem is a TreeFormatError naming the directory."""
    if not os.path.isdir(path):
        raise TreeFormatError("no such tokenizer directory", file=path)
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
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


@dataclass
class TokenizeReport:
    """What the conversion did beyond the plain rule (the converter prints it)."""
    trajectories: int = 0
    messages: int = 0
    tokens: int = 0
    targets: int = 0
    rerendered: int = 0                      # message boundaries where the template re-rendered the history
    rerendered_trajectories: List = field(default_factory=list)
    prompt_mismatch: int = 0                 # assistant turns not starting with the generation prompt
    engine: int = 0                          # trajectories carrying engine tokens
    engine_differs: List = field(default_factory=list)   # ... whose ids differ from the per-message ones

    def to_dict(self) -> dict:
        return {"trajectories": self.trajectories, "messages": self.messages, "tokens": self.tokens,
                "targets": self.targets, "rerendered_boundaries": self.rerendered,
                "rerendered_trajectories": len(self.rerendered_trajectories), "prompt_mismatch": self.prompt_mismatch,
                "engine_tokens": self.engine, "engine_tokens_differ": len(self.engine_differs)}

    def lines(self) -> List[str]:
        out = []
        if self.rerendered:
            ids = ", ".join(map(repr, self.rerendered_trajectories[:3]))
            out.append(f"the chat template re-renders earlier turns at {self.rerendered:,} message boundaries of "
                       f"{len(self.rerendered_trajectories):,} trajectories (e.g. {ids}): kept every turn as "
                       f"rendered when it was the latest (what the model saw)")
        if self.prompt_mismatch:
            out.append(f"{self.prompt_mismatch:,} assistant turns do not start with the template's generation "
                       f"prompt: their text up to where they differ from it is context")
        if self.engine:
            differs = len(self.engine_differs)
            eg = f" (e.g. {', '.join(map(repr, self.engine_differs[:3]))})" if differs else ""
            out.append(f"{self.engine:,} trajectories carry engine tokens (kept; they decode to their messages); "
                       f"{differs:,} differ from the per-message tokenization{eg}")
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

    def reset(self) -> None:
        self.cache.clear()

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
        if delta is None:
            raise where(f"messages[{k}]", "the chat template rewrites the end of the previous turn once this "
                                          "message follows: cannot tell this message's text")
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
    """The loss mask of engine ``tokens``: a token is a target when every character it covers is."""
    dec, ends = text_of.ends(tokens.tolist())
    if dec != text:
        c = _lcp(dec, text)
        raise where("tokens", f"decode to text that differs from the messages rendered with the chat template at "
                              f"character {c}: tokens give {dec[c:c + 30]!r}, the messages {text[c:c + 30]!r}")
    starts = np.concatenate([[0], ends[:-1]])
    # prefix sums of non-target characters: a token is a target when its span has none
    ctx = np.concatenate([[0], np.cumsum(1 - char_mask.astype(np.int64))])
    return ((ends > starts) & (ctx[ends] == ctx[starts])).astype(np.uint8)


def _per_token(values, n: int, targets: np.ndarray, where, name: str):
    """``old_logprobs`` one per token, or one per target token (scattered, null elsewhere)."""
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

def row_to_trajectory(rec: dict, chat: ChatTokenizer, report: TokenizeReport, *, file: Optional[str] = None,
                      line: Optional[int] = None, vocab_size: Optional[int] = None) -> Trajectory:
    """One messages row as a validated Trajectory (engine ``tokens`` win when given)."""
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
    turns = chat.tokenize(messages, flags, tools, where)
    ids = np.concatenate([t.ids for t in turns])
    mask = np.concatenate([t.mask for t in turns])
    if rec.get("loss_mask") is not None:
        raise where("loss_mask", "comes from the messages (assistant turns are targets): use per-message "
                                 "'trainable' or 'weight' instead")
    engine = rec.get("tokens")
    out = {k: v for k, v in rec.items() if k in KNOWN_FIELDS}
    if engine is not None:
        if not isinstance(engine, (list, tuple, np.ndarray)) or not all(
                isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0 for v in engine):
            raise where("tokens", "must be a list of token ids >= 0")
        engine = np.asarray(engine, dtype=np.int64)
        report.engine += 1
        if not np.array_equal(engine, ids):
            report.engine_differs.append(tid)
            text = "".join(t.text for t in turns)
            mask = _engine_mask(chat.text_of, engine, text, np.concatenate([t.char_mask for t in turns]), where)
        ids = engine
    else:
        if rec.get("old_logprobs") is not None:
            raise where("old_logprobs", "needs the engine 'tokens' it belongs to (the messages alone give no "
                                        "sampled token ids)")
        if isinstance(rec.get("advantage"), (list, tuple)):
            raise where("advantage", "per-token advantages need the engine 'tokens' they belong to")
    if ids.shape[0] == 0:
        raise where("messages", "render to no tokens")
    mask = mask.copy()
    mask[0] = 0
    out["tokens"] = ids
    out["loss_mask"] = mask
    if rec.get("old_logprobs") is not None:
        out["old_logprobs"] = _per_token(rec["old_logprobs"], ids.shape[0], mask, where, "old_logprobs")
    report.trajectories += 1
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
                  progress: Optional[Callable[[int], None]] = None) -> Tuple[List[Trajectory], TokenizeReport]:
    """Every row of ``paths`` (messages form) as a Trajectory, in file order, and the report.
    ``tokenizer``: a transformers tokenizer or a ChatTokenizer.

    Unknown fields are ignored with one UnknownFieldsWarning listing them."""
    chat = tokenizer if isinstance(tokenizer, ChatTokenizer) else ChatTokenizer(tokenizer)
    report = TokenizeReport()
    trajs: List[Trajectory] = []
    unknown = set()
    group = object()
    for path in paths:
        for line, rec in _rows(path):
            unknown.update(k for k in rec if k not in ROW_FIELDS)
            if rec.get("group") != group or len(chat.cache) > CACHE_TURNS:   # a group's rows share histories
                chat.reset()
                group = rec.get("group")
            trajs.append(row_to_trajectory(rec, chat, report, file=path, line=line, vocab_size=vocab_size))
            if progress:
                progress(1)
    if unknown:
        warnings.warn("ignored unknown fields: " + ", ".join(sorted(unknown)), UnknownFieldsWarning, stacklevel=2)
    return trajs, report


def read_rollouts(paths: Sequence[str], tokenizer=None, *, vocab_size: Optional[int] = None, workers: int = 1,
                  progress: Optional[Callable[[int], None]] = None
                  ) -> Tuple[List[Trajectory], Optional[TokenizeReport]]:
    """Trajectories of token-id files and, with ``tokenizer``, of messages files (a file is in
    messages form when its first row has ``messages``); the report when a tokenizer is given.

    Without a tokenizer a messages file is a TreeFormatError naming its first row."""
    from .readers import read_trajectories

    if tokenizer is None:
        require_tokenizer_for_messages(paths)
        return read_trajectories(paths, vocab_size=vocab_size, workers=workers, progress=progress), None
    trajs: List[Trajectory] = []
    report = TokenizeReport()
    chat = ChatTokenizer(tokenizer)
    for path in paths:
        if messages_row(path) is None:
            trajs.extend(read_trajectories([path], vocab_size=vocab_size, workers=workers, progress=progress))
            continue
        part, rep = read_messages([path], chat, vocab_size=vocab_size, progress=progress)
        trajs.extend(part)
        _merge_report(report, rep)
    return trajs, report


def _merge_report(into: TokenizeReport, rep: TokenizeReport) -> None:
    for name in ("trajectories", "messages", "tokens", "targets", "rerendered", "prompt_mismatch", "engine"):
        setattr(into, name, getattr(into, name) + getattr(rep, name))
    into.rerendered_trajectories.extend(rep.rerendered_trajectories)
    into.engine_differs.extend(rep.engine_differs)
