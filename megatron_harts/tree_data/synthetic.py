"""Seeded synthetic SWE-agent-like rollouts (the project's embedded default workload).

Shape of one task (a GRPO group, ``group`` = the task name):

- a long shared prompt: issue text + repository context, lognormal length
  (median ``prompt_median`` tokens);
- ``samples_per_task`` rollouts of that prompt, each a sequence of turns:
  an action (policy tokens, ``loss_mask`` 1, lognormal around
  ``action_median``) followed by an observation (environment tokens,
  ``loss_mask`` 0, heavier-tailed lognormal around ``observation_median``:
  file dumps and test logs).  A rollout stops after its turn budget or when
  the next turn would exceed ``max_tokens``.

Two sampling schemes:

- ``tree-step``: at each step a rollout may branch (probability
  ``branch_prob``) into ``branch_factor`` children that sample different
  actions from the same history, capped at ``max_leaves`` leaves per rollout.
  Every leaf is a trajectory; all action tokens on its path are targets.
- ``step-wise``: each step is its own sample whose context is the whole
  history so far: trajectory k = prompt + turns before k + action k, with only
  action k as target.  Trajectory k ends inside trajectory k+1's path.

Policy tokens carry ``old_logprobs`` (identical on shared tokens, as a real
sampler gives); rewards are Bernoulli and advantages are group-normalized.

Compaction (``compaction`` other than ``"none"``): the inference engine holds at most
``context_budget`` live tokens per rollout (the keys a new token attends to in
full-attention layers, itself included) and evicts KV entries in place, recorded as
compaction events ``(at, start, end)`` on the trajectory (see trajectory.py).  The
first ``keep_prefix`` tokens (system prompt / task) are never evicted, and every
strategy evicts the oldest tokens after them first, so the evicted tokens of a path
are always one run ``[keep_prefix, frontier)``:

- ``sliding-window``: at the first token that would see ``context_budget + 1``
  tokens, evict the oldest ``evict_chunk`` tokens after the prefix (that token then
  sees ``context_budget + 1 - evict_chunk``); anywhere, inside a message too.
- ``markovian``: at a message boundary (before an action or an observation), when
  the message would not fit, keep the prefix and the last ``keep_last`` tokens and
  evict the rest.
- ``summary``: at a message boundary, when the message would not fit, evict
  everything after the prefix and append a bridge of ``summary_tokens`` policy
  tokens (targets, like actions) right after the event.  The bridge is drawn from
  an RNG keyed by ``seed`` and a hash of the history it replaces.

An event depends only on the path up to it (and, for the two message-boundary
strategies, on the length of the message about to be appended: the engine overflows,
compacts and retries that message), so rollouts that share a history share its
events and bridges, and the tree merge keeps sharing through and after them.  A
message that does not fit even after compaction ends its rollout, like one past
``max_tokens``; with those two strategies a prompt is clipped to ``context_budget``
tokens.  In ``step-wise`` data a step's targets are the policy tokens new since the
previous step: its action and any bridge before it.  ``compaction="none"`` gives
exactly the output of the generator without compaction.

``synthesize_forks`` builds GRPO-like groups of long traces instead: per task (group) one
rollout, then ``samples_per_task - 1`` more, each forking from an earlier rollout of its group at
a random turn (so at random depths, before or after the compaction events on the way, which it
inherits), every rollout running until its next turn would pass its own length cap (drawn
between ``max_tokens / 2`` and ``max_tokens``).  Each group compacts under one strategy of a
list, cycled over the groups, so one set mixes strategies.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .trajectory import Trajectory

SCHEMES = ("tree-step", "step-wise")
COMPACTIONS = ("none", "sliding-window", "markovian", "summary")


@dataclass
class SweConfig:
    scheme: str = "tree-step"
    num_tasks: int = 4
    samples_per_task: int = 4
    prompt_median: int = 3000
    min_turns: int = 4
    max_turns: int = 16
    action_median: int = 150
    observation_median: int = 400
    branch_prob: float = 0.3
    branch_factor: int = 3
    max_leaves: int = 16
    max_tokens: int = 16384
    vocab_size: int = 32000
    seed: int = 0
    compaction: str = "none"
    context_budget: int = 8192
    keep_prefix: int = 256
    keep_last: int = 512
    evict_chunk: int = 512
    summary_tokens: int = 256

    def validate(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {self.scheme!r}")
        if self.compaction not in COMPACTIONS:
            raise ValueError(f"compaction must be one of {COMPACTIONS}, got {self.compaction!r}")
        positive = ("num_tasks", "samples_per_task", "prompt_median", "min_turns", "action_median",
                    "observation_median", "branch_factor", "max_leaves", "max_tokens", "context_budget",
                    "evict_chunk", "summary_tokens")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("keep_prefix", "keep_last"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_turns < self.min_turns:
            raise ValueError(f"max_turns ({self.max_turns}) must be >= min_turns ({self.min_turns})")
        if not 0.0 <= self.branch_prob <= 1.0:
            raise ValueError(f"branch_prob must be in [0, 1], got {self.branch_prob}")
        if self.vocab_size < 16:
            raise ValueError(f"vocab_size must be >= 16, got {self.vocab_size}")
        kp, budget = self.keep_prefix, self.context_budget
        if self.compaction == "sliding-window" and kp + self.evict_chunk > budget:
            raise ValueError(f"keep_prefix ({kp}) + evict_chunk ({self.evict_chunk}) must be <= context_budget "
                             f"({budget}) with compaction sliding-window: a chunk is evicted from the tokens "
                             f"after the prefix")
        if self.compaction == "markovian" and kp + self.keep_last >= budget:
            raise ValueError(f"keep_prefix ({kp}) + keep_last ({self.keep_last}) must be < context_budget "
                             f"({budget}) with compaction markovian: the kept tokens leave no room")
        if self.compaction == "summary" and kp + self.summary_tokens >= budget:
            raise ValueError(f"keep_prefix ({kp}) + summary_tokens ({self.summary_tokens}) must be < "
                             f"context_budget ({budget}) with compaction summary: the prefix and the bridge "
                             f"leave no room")


class _Piece:
    """A run of tokens with their loss mask and old log-probs."""
    __slots__ = ("tokens", "mask", "logprobs")

    def __init__(self, tokens, mask, logprobs):
        self.tokens, self.mask, self.logprobs = tokens, mask, logprobs


class _Sampler:
    def __init__(self, cfg: SweConfig):
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)

    def length(self, median: int, sigma: float, lo: int, hi: int) -> int:
        return int(np.clip(round(median * np.exp(sigma * self.rng.standard_normal())), lo, hi))

    def piece(self, n: int, policy: bool) -> _Piece:
        tokens = self.rng.integers(1, self.cfg.vocab_size, size=n, dtype=np.int64)
        mask = np.full(n, 1 if policy else 0, dtype=np.uint8)
        logprobs = (-self.rng.exponential(0.7, size=n)) if policy else np.zeros(n)
        return _Piece(tokens, mask, logprobs)

    def prompt(self) -> _Piece:
        c = self.cfg
        hi = max(16, c.max_tokens // 2)
        if c.compaction in ("markovian", "summary"):  # they compact only between messages
            hi = min(hi, c.context_budget)
        return self.piece(self.length(c.prompt_median, 0.4, min(16, hi), hi), policy=False)

    def action(self) -> _Piece:
        return self.piece(self.length(self.cfg.action_median, 0.6, 4, 4000), policy=True)

    def observation(self) -> _Piece:
        return self.piece(self.length(self.cfg.observation_median, 0.9, 4, 12000), policy=False)


def _join(pieces: List[_Piece]) -> _Piece:
    return _Piece(np.concatenate([p.tokens for p in pieces]), np.concatenate([p.mask for p in pieces]),
                  np.concatenate([p.logprobs for p in pieces]))


Event = Tuple[int, int, int]


def _trajectory(tid: str, group: str, piece: _Piece, reward: float, events: Tuple[Event, ...] = ()) -> Trajectory:
    mask = piece.mask.copy()
    mask[0] = 0
    compactions = np.array(events, dtype=np.int64) if events else None
    return Trajectory(id=tid, tokens=piece.tokens, loss_mask=mask, old_logprobs=piece.logprobs,
                      advantage=None, reward=reward, group=group, compactions=compactions)


@dataclass(frozen=True)
class _Path:
    """A rollout path being built: its pieces (``n`` tokens) and the events on it.

    The tokens evicted on the path are exactly ``[keep_prefix, frontier)`` (``frontier``
    starts at ``keep_prefix``); every event has ``at < n``.
    """
    pieces: List[_Piece]
    n: int
    frontier: int
    events: Tuple[Event, ...]


class _Compactor:
    """Appends pieces to paths under ``cfg``'s compaction strategy.

    Keeps, for every path it builds: no token sees more than ``context_budget`` tokens
    (itself included) after the events at or before it, and every event is needed (without
    it, a token up to the next event would see more).  With the validated knobs a one-token
    piece after a prompt always fits.
    """

    def __init__(self, cfg: SweConfig):
        self.cfg = cfg

    def start(self, prompt: _Piece) -> _Path:
        """The path of the prompt alone (with markovian/summary the prompt fits the budget)."""
        path = self.extend(_Path([], 0, self.cfg.keep_prefix, ()), prompt)
        assert path is not None
        return path

    def live(self, path: _Path) -> int:
        """Tokens of ``path`` a token appended to it still sees (itself not counted)."""
        return path.n - (path.frontier - self.cfg.keep_prefix)

    def extend(self, path: _Path, piece: _Piece) -> Optional[_Path]:
        """``path`` + ``piece`` with the events it needs; None when the piece cannot fit."""
        c = self.cfg
        L = len(piece.tokens)
        if c.compaction == "none":
            return _Path(path.pieces + [piece], path.n + L, path.frontier, path.events)
        if c.compaction == "sliding-window":
            return self._slide(path, piece)
        if self.live(path) + L <= c.context_budget:
            return _Path(path.pieces + [piece], path.n + L, path.frontier, path.events)
        kp, n, f = c.keep_prefix, path.n, path.frontier
        if c.compaction == "markovian":
            cut = n - c.keep_last
            if cut <= f or kp + c.keep_last + L > c.context_budget:
                return None
            return _Path(path.pieces + [piece], n + L, cut, path.events + ((n, f, cut),))
        # summary
        S = c.summary_tokens
        if n <= f or kp + S + L > c.context_budget:
            return None
        bridge = self._bridge(path)
        return _Path(path.pieces + [bridge, piece], n + S + L, n, path.events + ((n, f, n),))

    def _slide(self, path: _Path, piece: _Piece) -> _Path:
        c = self.cfg
        f, events = path.frontier, list(path.events)
        end = path.n + len(piece.tokens)
        j = c.context_budget - c.keep_prefix + f   # the first position that would see budget + 1 tokens
        while j < end:
            events.append((j, f, f + c.evict_chunk))
            f += c.evict_chunk
            j += c.evict_chunk
        return _Path(path.pieces + [piece], end, f, tuple(events))

    def _bridge(self, path: _Path) -> _Piece:
        """The summary of ``path``: a function of the seed and the path's tokens only."""
        c = self.cfg
        history = np.concatenate([p.tokens for p in path.pieces])
        digest = hashlib.blake2b(history.tobytes(), digest_size=16).digest()
        rng = np.random.default_rng([c.seed, *np.frombuffer(digest, dtype=np.uint32).tolist()])
        S = c.summary_tokens
        tokens = rng.integers(1, c.vocab_size, size=S, dtype=np.int64)
        return _Piece(tokens, np.ones(S, dtype=np.uint8), -rng.exponential(0.7, size=S))


def _tree_step(s: _Sampler, task: str, sample: int, prompt: _Piece) -> List[Trajectory]:
    c = s.cfg
    comp = _Compactor(c)
    turns = int(s.rng.integers(c.min_turns, c.max_turns + 1))
    frontier = [comp.start(prompt)]  # open branches
    leaves: List[_Path] = []
    for _ in range(turns):
        nxt: List[_Path] = []
        for path in frontier:
            k = 1
            if s.rng.random() < c.branch_prob and len(frontier) + len(nxt) + c.branch_factor - 1 <= c.max_leaves:
                k = c.branch_factor
            for _ in range(k):
                act, obs = s.action(), s.observation()
                child = comp.extend(path, act)
                child = child and comp.extend(child, obs)
                if child is None or child.n > c.max_tokens:
                    leaves.append(path)
                    continue
                nxt.append(child)
        frontier = nxt
        if not frontier:
            break
    leaves.extend(frontier)
    out = []
    seen = set()
    for j, path in enumerate(leaves):
        key = tuple(id(p) for p in path.pieces)
        if key in seen:  # a branch whose children all overflowed ends where it was
            continue
        seen.add(key)
        out.append(_trajectory(f"{task}/s{sample}/b{j}", task, _join(path.pieces), float(s.rng.random() < 0.4),
                               path.events))
    return out


def _step_wise(s: _Sampler, task: str, sample: int, prompt: _Piece) -> List[Trajectory]:
    c = s.cfg
    comp = _Compactor(c)
    turns = int(s.rng.integers(c.min_turns, c.max_turns + 1))
    path = comp.start(prompt)
    done = 0  # tokens of the previous step's sample: context in this one
    out = []
    reward = float(s.rng.random() < 0.4)
    for k in range(turns):
        act = s.action()
        step = comp.extend(path, act)
        if step is None or step.n > c.max_tokens:
            break
        whole = _join(step.pieces)
        mask, logprobs = whole.mask.copy(), whole.logprobs.copy()
        mask[:done] = 0
        logprobs[:done] = 0.0
        out.append(_trajectory(f"{task}/s{sample}/t{k}", task, _Piece(whole.tokens, mask, logprobs), reward,
                               step.events))
        done = step.n
        path = comp.extend(step, s.observation())
        if path is None:
            break
    if not out:  # the first action did not fit: keep the prompt as a one-step sample
        step = comp.extend(comp.start(prompt), s.piece(1, policy=True))
        out.append(_trajectory(f"{task}/s{sample}/t0", task, _join(step.pieces), reward, step.events))
    return out


def synthesize_swe(cfg: SweConfig) -> List[Trajectory]:
    """Trajectories of ``cfg.num_tasks`` tasks; identical output for identical configs."""
    cfg.validate()
    s = _Sampler(cfg)
    trajs: List[Trajectory] = []
    for t in range(cfg.num_tasks):
        task = f"task{t}"
        prompt = s.prompt()
        group: List[Trajectory] = []
        for sample in range(cfg.samples_per_task):
            gen = _tree_step if cfg.scheme == "tree-step" else _step_wise
            group.extend(gen(s, task, sample, prompt))
        rewards = np.array([g.reward for g in group])
        std = rewards.std()
        for g in group:
            g.advantage = float((g.reward - rewards.mean()) / (std + 1e-6))
        trajs.extend(group)
    return trajs


def _forking_group(s: _Sampler, task: str, prompt: _Piece) -> List[Trajectory]:
    """One group of ``synthesize_forks`` (module docstring) under ``s.cfg``'s strategy."""
    c = s.cfg
    comp = _Compactor(c)
    start = comp.start(prompt)
    rollouts: List[List[_Path]] = []      # each rollout's path after the prompt and after every turn

    def run(turns: List[_Path], cap: int) -> List[_Path]:
        while len(turns) <= c.max_turns:
            act, obs = s.action(), s.observation()
            child = comp.extend(turns[-1], act)
            child = child and comp.extend(child, obs)
            if child is None or child.n > cap:
                break
            turns = turns + [child]
        return turns

    for b in range(c.samples_per_task):
        cap = int(s.rng.integers(max(1, c.max_tokens // 2), c.max_tokens + 1))
        if not rollouts:
            rollouts.append(run([start], cap))
            continue
        for _ in range(8):          # a fork with no room for a turn under its cap is drawn again
            parent = rollouts[int(s.rng.integers(len(rollouts)))]
            at = int(s.rng.integers(len(parent)))       # after the prompt (0) or after turn ``at``
            turns = run(parent[:at + 1], max(cap, parent[at].n))
            if len(turns) > at + 1:
                break
        rollouts.append(turns)
    rewards = s.rng.random(len(rollouts)) < 0.4
    return [_trajectory(f"{task}/b{j}", task, _join(turns[-1].pieces), float(r), turns[-1].events)
            for j, (turns, r) in enumerate(zip(rollouts, rewards))]


def synthesize_forks(cfg: SweConfig, strategies: Sequence[str]) -> List[Trajectory]:
    """``cfg.num_tasks`` groups of ``cfg.samples_per_task`` rollouts forking at random turns
    (module docstring), group ``g`` under compaction ``strategies[g % len(strategies)]`` (``cfg``'s
    own ``compaction`` and ``scheme`` are not read); identical output for identical arguments."""
    if not strategies:
        raise ValueError("strategies must name at least one compaction strategy")
    cfgs = [replace(cfg, compaction=st) for st in strategies]
    for c in cfgs:
        c.validate()
    rng = np.random.default_rng(cfg.seed)
    trajs: List[Trajectory] = []
    for t in range(cfg.num_tasks):
        s = _Sampler(cfgs[t % len(cfgs)])
        s.rng = rng                         # one stream for the whole set
        group = _forking_group(s, f"task{t}", s.prompt())
        rewards = np.array([g.reward for g in group])
        for g in group:
            g.advantage = float((g.reward - rewards.mean()) / (rewards.std() + 1e-6))
        trajs.extend(group)
    return trajs
