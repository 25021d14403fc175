#!/usr/bin/env python3
"""Write seeded synthetic SWE-agent-like rollouts as JSONL (see megatron_harts/tree_data/synthetic.py).

With --compaction other than none, the engine keeps at most --context-budget live tokens per
rollout (the keys a token still attends to in full-attention layers, itself included) and every
trajectory carries the compaction events (at, start, end) that keep it there; the first
--keep-prefix tokens are never evicted.  Strategies:

  sliding-window  at the first token that would see budget + 1 tokens, evict the oldest
                  --evict-chunk tokens after the prefix (anywhere, inside a message too)
  markovian       before a message (action or observation) that would not fit: keep the
                  prefix and the last --keep-last tokens, evict the rest
  summary         before a message that would not fit: evict everything after the prefix
                  and append a bridge of --summary-tokens policy tokens (targets), drawn
                  from the seed and a hash of the history it replaces

Events depend only on the history before them (and, for markovian/summary, on the length of
the message about to be appended), so rollouts that share a history share its events and
bridges.  A message that does not fit even after compaction ends its rollout; with
markovian/summary prompts are clipped to the budget.  --compaction none (the default) writes
traces without events, and the compaction knobs then change nothing.

--format messages writes agent logs as chat messages instead (docs/messages.md;
megatron_harts/tree_data/agent_logs.py): a system prompt and a task per group, assistant turns
with tool calls and tool results, the same --scheme, task/sample/turn/branch flags and --seed;
--prompt-median, --action-median and --observation-median count words; --reasoning-median gives
assistant turns reasoning_content and --followup-prob adds user follow-ups, the two things a
reasoning model's template re-renders history on.  With --tokenizer DIR
every row also carries the engine `tokens` (and old_logprobs) of a common pipeline: the last
assistant turn as the engine sampled it, where each generated token splits with probability
--engine-drift into two tokens of the same text, and the history re-tokenized from its text.
"""
import argparse
import dataclasses
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_harts.cli import ArgumentParser, CliError, output_path, print_json, run  # noqa: E402
from megatron_harts.tree_data import TreeFormatError, write_jsonl  # noqa: E402
from megatron_harts.tree_data.readers import write_records  # noqa: E402
from megatron_harts.tree_data.agent_logs import AgentLogConfig, add_engine_tokens, synthesize_agent_logs  # noqa: E402
from megatron_harts.tree_data.synthetic import COMPACTIONS, SCHEMES, SweConfig, synthesize_swe  # noqa: E402

COMPACTION_HELP = {
    "context_budget": "live tokens per rollout the engine holds (a token and the keys it attends to); "
                      "ignored with --compaction none",
    "keep_prefix": "the first N tokens (system prompt / task) are never evicted",
    "keep_last": "markovian: the last N tokens before the boundary are kept",
    "evict_chunk": "sliding-window: tokens evicted at each overflow (<= budget - keep-prefix)",
    "summary_tokens": "summary: length of the bridge appended after each compaction",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _flag_message(message: str) -> str:
    """A SweConfig.validate message with its field names written as flags."""
    names = sorted((f.name for f in dataclasses.fields(SweConfig)), key=len, reverse=True)
    return re.sub(r"\b(" + "|".join(names) + r")\b", lambda m: _flag(m.group(1)), message)


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", required=True, metavar="FILE", help="JSONL file (.jsonl or .jsonl.gz)")
    ap.add_argument("--scheme", choices=SCHEMES, default="tree-step")
    defaults = SweConfig()
    for f in dataclasses.fields(SweConfig):
        if f.name in ("scheme", "compaction") or f.name in COMPACTION_HELP:
            continue
        ap.add_argument(_flag(f.name), type=type(getattr(defaults, f.name)),
                        default=getattr(defaults, f.name), help=f"default {getattr(defaults, f.name)}")
    group = ap.add_argument_group("compaction (KV eviction in place)")
    group.add_argument("--compaction", choices=COMPACTIONS, default="none",
                       help="strategy (see above); default none")
    for name, text in COMPACTION_HELP.items():
        group.add_argument(_flag(name), type=int, default=getattr(defaults, name), metavar="N",
                           help=f"{text}; default {getattr(defaults, name)}")
    logs = ap.add_argument_group("agent logs as chat messages")
    logs.add_argument("--format", choices=("tokens", "messages"), default="tokens",
                      help="tokens: token-id rollouts (default); messages: chat-message agent logs (see above)")
    logs.add_argument("--tokenizer", metavar="DIR", default=None,
                      help="with --format messages: add engine token ids made with this tokenizer directory")
    logs.add_argument("--trust-remote-code", action="store_true",
                      help="run the code the --tokenizer directory ships (tiktoken-based tokenizers such as "
                           "Kimi-Linear's); without it such a tokenizer is refused")
    logs.add_argument("--reasoning-median", type=int, default=0, metavar="WORDS",
                      help="with --format messages: every assistant turn carries reasoning_content of about this "
                           "many words (a reasoning model's thinking); default 0 (none)")
    logs.add_argument("--followup-prob", type=float, default=0.0, metavar="P",
                      help="with --format messages: probability of a user follow-up before each assistant turn but "
                           "the first (where a reasoning template re-renders the history); default 0")
    logs.add_argument("--engine-drift", type=float, default=0.0, metavar="P",
                      help="with --tokenizer: probability that a generated token is split by the engine; default 0")
    ap.add_argument("--json", action="store_true", help="print a JSON summary")
    args = ap.parse_args(argv)
    cfg = SweConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SweConfig)})
    try:
        cfg.validate()
    except ValueError as e:
        raise CliError(_flag_message(str(e))) from None
    if args.format == "messages":
        return _messages(args, cfg)
    if args.tokenizer is not None or args.engine_drift or args.reasoning_median or args.followup_prob \
            or args.trust_remote_code:
        raise CliError("--tokenizer, --trust-remote-code, --engine-drift, --reasoning-median and --followup-prob "
                       "need --format messages")
    output_path(args.output, "--output")
    trajs = synthesize_swe(cfg)
    write_jsonl(trajs, args.output)
    summary = {"output": args.output, "trajectories": len(trajs),
               "expanded_tokens": int(sum(len(t) for t in trajs)),
               "compaction_events": int(sum(0 if t.compactions is None else len(t.compactions) for t in trajs)),
               "config": dataclasses.asdict(cfg)}
    if args.json:
        print_json(summary)
    else:
        events = "" if cfg.compaction == "none" else \
            f", {summary['compaction_events']:,} compaction events ({cfg.compaction}, budget {cfg.context_budget})"
        print(f"wrote {args.output}: {summary['trajectories']} trajectories, "
              f"{summary['expanded_tokens']:,} tokens{events} ({cfg.scheme}, seed {cfg.seed})")
    return 0


def _messages(args, cfg: SweConfig) -> int:
    """--format messages: agent logs as chat messages (with engine tokens when --tokenizer is given)."""
    if cfg.compaction != "none":
        raise CliError("--compaction needs --format tokens: agent logs in messages form carry no compaction events")
    if not 0.0 <= args.engine_drift <= 1.0:
        raise CliError(f"--engine-drift must be in [0, 1], got {args.engine_drift}")
    if args.engine_drift and args.tokenizer is None:
        raise CliError("--engine-drift needs --tokenizer DIR")
    if args.reasoning_median < 0:
        raise CliError(f"--reasoning-median must be >= 0, got {args.reasoning_median}")
    if not 0.0 <= args.followup_prob <= 1.0:
        raise CliError(f"--followup-prob must be in [0, 1], got {args.followup_prob}")
    log = AgentLogConfig(scheme=cfg.scheme, num_tasks=cfg.num_tasks, samples_per_task=cfg.samples_per_task,
                         min_turns=cfg.min_turns, max_turns=cfg.max_turns, prompt_words=cfg.prompt_median,
                         action_words=cfg.action_median, observation_words=cfg.observation_median,
                         branch_prob=cfg.branch_prob, branch_factor=cfg.branch_factor, max_leaves=cfg.max_leaves,
                         reasoning_words=args.reasoning_median, followup_prob=args.followup_prob, seed=cfg.seed)
    output_path(args.output, "--output")
    rows = synthesize_agent_logs(log)
    if args.tokenizer is not None:
        from megatron_harts.tree_data.messages import load_chat_tokenizer
        try:
            rows = add_engine_tokens(rows, load_chat_tokenizer(args.tokenizer, args.trust_remote_code),
                                     args.engine_drift, seed=cfg.seed)
        except ValueError as e:
            if isinstance(e, TreeFormatError):
                raise
            raise CliError(f"--tokenizer {args.tokenizer}: {e}") from None
    write_records(rows, args.output)
    summary = {"output": args.output, "format": "messages", "trajectories": len(rows),
               "messages": sum(len(r["messages"]) for r in rows), "config": dataclasses.asdict(log),
               "engine_tokens": sum(len(r["tokens"]) for r in rows) if args.tokenizer else None}
    if args.json:
        print_json(summary)
    else:
        engine = "" if args.tokenizer is None else \
            f", {summary['engine_tokens']:,} engine tokens (drift {args.engine_drift})"
        print(f"wrote {args.output}: {summary['trajectories']} trajectories, {summary['messages']:,} messages"
              f"{engine} ({log.scheme}, seed {log.seed})")
    return 0


if __name__ == "__main__":
    run(main)
