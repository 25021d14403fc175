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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

import numpy as np

from .trajectory import Trajectory

SCHEMES = ("tree-step", "step-wise")


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

    def validate(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {self.scheme!r}")
        positive = ("num_tasks", "samples_per_task", "prompt_median", "min_turns", "action_median",
                    "observation_median", "branch_factor", "max_leaves", "max_tokens")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_turns < self.min_turns:
            raise ValueError(f"max_turns ({self.max_turns}) must be >= min_turns ({self.min_turns})")
        if not 0.0 <= self.branch_prob <= 1.0:
            raise ValueError(f"branch_prob must be in [0, 1], got {self.branch_prob}")
        if self.vocab_size < 16:
            raise ValueError(f"vocab_size must be >= 16, got {self.vocab_size}")


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
        return self.piece(self.length(c.prompt_median, 0.4, 16, max(16, c.max_tokens // 2)), policy=False)

    def action(self) -> _Piece:
        return self.piece(self.length(self.cfg.action_median, 0.6, 4, 4000), policy=True)

    def observation(self) -> _Piece:
        return self.piece(self.length(self.cfg.observation_median, 0.9, 4, 12000), policy=False)


def _join(pieces: List[_Piece]) -> _Piece:
    return _Piece(np.concatenate([p.tokens for p in pieces]), np.concatenate([p.mask for p in pieces]),
                  np.concatenate([p.logprobs for p in pieces]))


def _trajectory(tid: str, group: str, piece: _Piece, reward: float) -> Trajectory:
    mask = piece.mask.copy()
    mask[0] = 0
    return Trajectory(id=tid, tokens=piece.tokens, loss_mask=mask, old_logprobs=piece.logprobs,
                      advantage=None, reward=reward, group=group)


def _tree_step(s: _Sampler, task: str, sample: int, prompt: _Piece) -> List[Trajectory]:
    c = s.cfg
    turns = int(s.rng.integers(c.min_turns, c.max_turns + 1))
    # frontier of open branches: (pieces so far, tokens so far)
    frontier = [([prompt], len(prompt.tokens))]
    leaves = []
    for _ in range(turns):
        nxt = []
        for pieces, n in frontier:
            k = 1
            if s.rng.random() < c.branch_prob and len(frontier) + len(nxt) + c.branch_factor - 1 <= c.max_leaves:
                k = c.branch_factor
            for _ in range(k):
                act, obs = s.action(), s.observation()
                add = len(act.tokens) + len(obs.tokens)
                if n + add > c.max_tokens:
                    leaves.append(pieces)
                    continue
                nxt.append((pieces + [act, obs], n + add))
        frontier = nxt
        if not frontier:
            break
    leaves.extend(p for p, _ in frontier)
    out = []
    seen = set()
    for j, pieces in enumerate(leaves):
        key = tuple(id(p) for p in pieces)
        if key in seen:  # a branch whose children all overflowed ends where it was
            continue
        seen.add(key)
        out.append(_trajectory(f"{task}/s{sample}/b{j}", task, _join(pieces), float(s.rng.random() < 0.4)))
    return out


def _step_wise(s: _Sampler, task: str, sample: int, prompt: _Piece) -> List[Trajectory]:
    c = s.cfg
    turns = int(s.rng.integers(c.min_turns, c.max_turns + 1))
    history = [prompt]
    n = len(prompt.tokens)
    out = []
    reward = float(s.rng.random() < 0.4)
    for k in range(turns):
        act = s.action()
        if n + len(act.tokens) > c.max_tokens:
            break
        context = _join(history)
        ctx = _Piece(context.tokens, np.zeros_like(context.mask), np.zeros_like(context.logprobs))
        out.append(_trajectory(f"{task}/s{sample}/t{k}", task, _join([ctx, act]), reward))
        obs = s.observation()
        history += [act, obs]
        n += len(act.tokens) + len(obs.tokens)
    if not out:  # the first action did not fit: keep the prompt as a one-step sample
        act = s.piece(1, policy=True)
        out.append(_trajectory(f"{task}/s{sample}/t0", task, _join([prompt, act]), reward))
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
