"""Seeded synthetic agent logs in messages form (docs/messages.md): multi-turn, tool calls, branching.

One task is a group: a system prompt and a user task shared by ``samples_per_task`` rollouts.
A rollout alternates assistant turns (a thought and one tool call with a unique id) and tool
results, for a number of turns drawn in ``[min_turns, max_turns]``, and ends with an assistant
answer without a tool call.  Text is words drawn from a fixed list, message lengths lognormal
around their medians (in words).

- ``tree-step``: before each turn a rollout may branch (probability ``branch_prob``) into
  ``branch_factor`` children sampling different turns from the same history (at most
  ``max_leaves`` leaves per rollout); every leaf is a row, and the rows of a rollout share
  their history message for message.
- ``step-wise``: every assistant turn is its own row whose messages are the whole history up
  to it; only that turn is trainable (earlier assistant turns carry ``"trainable": false``).

With ``reasoning_words`` > 0 every assistant turn carries ``reasoning_content`` (the thinking a
reasoning model's template shows only after the last user message); with ``followup_prob`` > 0
a user follow-up comes, with that probability, before each assistant turn but the first (the
message after which such a template re-renders the earlier turns without their reasoning).

Rewards are Bernoulli, advantages group-normalized.  ``add_engine_tokens`` adds the ids an
inference engine would report, with a tokenizer: the common pipeline that drifts (see there).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import List

import numpy as np

SCHEMES = ("tree-step", "step-wise")
TOOLS = ("bash", "read_file", "edit_file", "run_tests")
WORDS = (
    "the test fails because parser returns none when input is empty so we check value before calling split "
    "then run pytest again file module function class import error trace line config path build install "
    "patch diff commit branch cache token buffer stream reader writer index table row column schema field "
    "list dict tuple string integer float boolean null default option flag argument return raise except "
    "finally while for if else elif def lambda yield async await open close read write seek flush sort "
    "merge tree node leaf root parent child depth width length size count total mean max min sum ok done "
    "looks like we need to update handle edge case add fix refactor rename move delete keep restore retry"
).split()


@dataclass
class AgentLogConfig:
    scheme: str = "tree-step"
    num_tasks: int = 4
    samples_per_task: int = 4
    min_turns: int = 2
    max_turns: int = 6
    prompt_words: int = 60
    action_words: int = 20
    observation_words: int = 40
    branch_prob: float = 0.3
    branch_factor: int = 2
    max_leaves: int = 8
    reasoning_words: int = 0
    followup_prob: float = 0.0
    seed: int = 0

    def validate(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {self.scheme!r}")
        for name in ("num_tasks", "samples_per_task", "min_turns", "prompt_words", "action_words",
                     "observation_words", "branch_factor", "max_leaves"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_turns < self.min_turns:
            raise ValueError(f"max_turns ({self.max_turns}) must be >= min_turns ({self.min_turns})")
        if not 0.0 <= self.branch_prob <= 1.0:
            raise ValueError(f"branch_prob must be in [0, 1], got {self.branch_prob}")
        if self.reasoning_words < 0:
            raise ValueError(f"reasoning_words must be >= 0, got {self.reasoning_words}")
        if not 0.0 <= self.followup_prob <= 1.0:
            raise ValueError(f"followup_prob must be in [0, 1], got {self.followup_prob}")


class _Writer:
    def __init__(self, cfg: AgentLogConfig):
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        self.calls = 0

    def words(self, median: int) -> str:
        n = int(max(1, round(median * np.exp(0.5 * self.rng.standard_normal()))))
        return " ".join(WORDS[i] for i in self.rng.integers(0, len(WORDS), size=n))

    def turn(self) -> List[dict]:
        """An assistant message with one tool call, and the tool's result."""
        self.calls += 1
        cid = f"call_{self.calls}"
        tool = TOOLS[int(self.rng.integers(0, len(TOOLS)))]
        args = json.dumps({"input": self.words(max(1, self.cfg.action_words // 4))})
        call = {"id": cid, "type": "function", "function": {"name": tool, "arguments": args}}
        return [self.think({"role": "assistant", "content": self.words(self.cfg.action_words), "tool_calls": [call]}),
                {"role": "tool", "tool_call_id": cid, "content": self.words(self.cfg.observation_words)}]

    def answer(self) -> dict:
        return self.think({"role": "assistant", "content": "done: " + self.words(self.cfg.action_words)})

    def think(self, m: dict) -> dict:
        if self.cfg.reasoning_words:
            m["reasoning_content"] = self.words(self.cfg.reasoning_words)
        return m

    def followup(self, path: List[dict], first: bool) -> List[dict]:
        """``path``, with a user follow-up appended with probability ``followup_prob`` (never before
        the first turn)."""
        if first or not self.cfg.followup_prob or self.rng.random() >= self.cfg.followup_prob:
            return path
        return path + [{"role": "user", "content": "Also: " + self.words(max(1, self.cfg.prompt_words // 4))}]


def _tree_step(w: _Writer, head: List[dict]) -> List[List[dict]]:
    c = w.cfg
    turns = int(w.rng.integers(c.min_turns, c.max_turns + 1))
    frontier = [head]
    for turn in range(turns + 1):
        frontier = [w.followup(path, turn == 0) for path in frontier]
        if turn == turns:
            break
        nxt = []
        for path in frontier:
            k = 1
            if w.rng.random() < c.branch_prob and len(frontier) + len(nxt) + c.branch_factor - 1 <= c.max_leaves:
                k = c.branch_factor
            nxt.extend(path + w.turn() for _ in range(k))
        frontier = nxt
    return [path + [w.answer()] for path in frontier]


def _step_wise(w: _Writer, head: List[dict]) -> List[List[dict]]:
    c = w.cfg
    turns = int(w.rng.integers(c.min_turns, c.max_turns + 1))
    path, out = list(head), []
    for k in range(turns + 1):
        path = w.followup(path, k == 0)
        msgs = w.turn() if k < turns else [w.answer()]
        frozen = [dict(m, trainable=False) if m["role"] == "assistant" else m for m in path]
        out.append(frozen + msgs[:1])
        path = path + msgs
    return out


def synthesize_agent_logs(cfg: AgentLogConfig) -> List[dict]:
    """Rows (JSON-able dicts with ``id``, ``group``, ``messages``, ``reward``, ``advantage``) of
    ``cfg.num_tasks`` tasks; identical output for identical configs."""
    cfg.validate()
    w = _Writer(cfg)
    rows: List[dict] = []
    system = {"role": "system", "content": "You are a coding agent. Tools: " + ", ".join(TOOLS) + "."}
    for t in range(cfg.num_tasks):
        task = f"task{t}"
        head = [system, {"role": "user", "content": f"Task {t}: " + w.words(cfg.prompt_words)}]
        group = []
        for sample in range(cfg.samples_per_task):
            if cfg.scheme == "tree-step":
                paths, tag = _tree_step(w, head), "b"
            else:
                paths, tag = _step_wise(w, head), "t"
            reward = float(w.rng.random() < 0.4)
            for j, messages in enumerate(paths):
                r = reward if cfg.scheme == "step-wise" else float(w.rng.random() < 0.4)
                group.append({"id": f"{task}/s{sample}/{tag}{j}", "group": task, "messages": messages,
                              "reward": r})
        rewards = np.array([g["reward"] for g in group])
        for g in group:
            g["advantage"] = float((g["reward"] - rewards.mean()) / (rewards.std() + 1e-6))
        rows.extend(group)
    return rows


def add_engine_tokens(rows: List[dict], tokenizer, drift: float, seed: int = 0) -> List[dict]:
    """``rows`` with the ``tokens`` and ``old_logprobs`` a common trainer pipeline would record.

    A row's ids are those of its exact form (docs/messages.md), one trajectory: the prompt of its
    last call, re-tokenized from its text, then the ids the engine sampled for that call.  The
    engine's ids are the completion's tokenization except that each generated token splits, with
    probability ``drift``, into two tokens of the same text (a tokenization the model may sample,
    which re-tokenizing never gives back).  Every target token gets a log-probability.  The split
    and the log-probabilities of a call are a function of the seed and the conversation up to the
    call, so rows sharing a history share its log-probabilities.  A row whose template re-renders
    its history (several trajectories) is a ValueError."""
    from .engine_records import merge_calls
    from .messages import ChatTokenizer, validate_messages

    chat = ChatTokenizer(tokenizer)
    out = []
    for rec in rows:
        def where(name, message, rec=rec):
            return ValueError(f"row {rec.get('id')!r}: {name}: {message}")

        messages, flags = validate_messages(rec["messages"], where)
        calls, _ = chat.calls(messages, flags, rec.get("tools"), where)
        segs = merge_calls(calls)
        if len(segs) != 1:
            raise ValueError(f"row {rec.get('id')!r}: the chat template re-renders the history: the exact form is "
                             f"{len(segs)} trajectories, not one sequence of engine tokens")
        seg = segs[0]
        ids: List[int] = []
        logprobs: List = []
        pos = 0
        for i, call in enumerate(calls):
            start = call.prompt.shape[0]          # where the call's completion starts in the trajectory
            ids.extend(seg.tokens[pos:start].tolist())
            logprobs.extend([None] * (start - pos))
            digest = hashlib.blake2b(json.dumps(rec["messages"][:call.index + 1], sort_keys=True).encode(),
                                     digest_size=16).digest()
            rng = np.random.default_rng([seed, *np.frombuffer(digest, dtype=np.uint32).tolist()])
            for tid in call.completion.tolist():
                parts = _split(tokenizer, tid, rng) if i == len(calls) - 1 and rng.random() < drift else [tid]
                ids.extend(parts)
                logprobs.extend(float(-rng.exponential(0.7)) for _ in parts)
            pos = start + call.completion.shape[0]
        ids.extend(seg.tokens[pos:].tolist())
        logprobs.extend([None] * (seg.tokens.shape[0] - pos))
        if ids:
            logprobs[0] = None
        out.append(dict(rec, tokens=ids, old_logprobs=logprobs))
    return out


def _split(tokenizer, tid: int, rng) -> List[int]:
    """Token ``tid`` as two or more tokens of the same text, or ``[tid]`` when it has no such split."""
    text = tokenizer.decode([tid], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if len(text) < 2 or "\ufffd" in text or tid in set(tokenizer.all_special_ids):
        return [tid]
    k = int(rng.integers(1, len(text)))
    parts = (tokenizer.encode(text[:k], add_special_tokens=False)
             + tokenizer.encode(text[k:], add_special_tokens=False))
    same = tokenizer.decode(parts, skip_special_tokens=False, clean_up_tokenization_spaces=False) == text
    return parts if same and parts != [tid] else [tid]
