"""Tokenization drift: the diagnostics count the sharing lost where a group's text agrees and its ids do
not, the repair re-tokenizes context alike and never touches a target, and the tools report both."""
import dataclasses
import json

import numpy as np
import pytest

from chat_tokenizer import build_tokenizer, corpus_of
from megatron_harts.tree_data import build_forest, make_trajectory, read_trajectories
from megatron_harts.tree_data.agent_logs import AgentLogConfig, add_engine_tokens, synthesize_agent_logs
from megatron_harts.tree_data.drift import TokenText, analyze_drift, repair_drift
from megatron_harts.tree_data.messages import load_chat_tokenizer, read_messages
from tool_runner import assert_one_error, load_tool, run_tool

CFG = AgentLogConfig(scheme="step-wise", num_tasks=2, samples_per_task=2, min_turns=2, max_turns=4, prompt_words=12,
                     action_words=8, observation_words=8, seed=5)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    rows = synthesize_agent_logs(AgentLogConfig(num_tasks=3, seed=11)) + synthesize_agent_logs(CFG)
    return build_tokenizer(str(tmp_path_factory.mktemp("tok")), [*corpus_of(rows), "caf\u00e9 \u2713 na\u00efve"])


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_chat_tokenizer(tok_dir)


@pytest.fixture(scope="module")
def drifted(tok, tmp_path_factory):
    """Step-wise rows whose last turn keeps the engine's ids and whose history is re-tokenized."""
    path = tmp_path_factory.mktemp("rows") / "e.jsonl"
    rows = add_engine_tokens(synthesize_agent_logs(CFG), tok, drift=0.3, seed=2)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trajs, _ = read_messages([str(path)], tok)
    return str(path), trajs


def text(tok, t):
    return tok.decode(t.tokens.tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def unique(trajs):
    return build_forest(trajs).stats()["unique_tokens"]


def test_token_ends_with_multibyte_characters(tok):
    s = "caf\u00e9 \u2713 na\u00efve <|end|> ok"
    ids = tok.encode(s, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)      # some tokens hold part of a character
    got, ends = TokenText(tok).ends(ids)
    assert got == s and ends[-1] == len(s) and np.all(np.diff(ends) >= 0)
    for j in range(len(ids)):
        if j + 1 == len(ids) or ends[j + 1] > ends[j]:    # the last token of an end is a boundary of the text
            assert tok.decode(ids[:j + 1]) == s[:ends[j]]


def test_no_drift_with_prefix_stable_tokenization(tok, tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in synthesize_agent_logs(CFG)))
    trajs, _ = read_messages([str(path)], tok)
    rep = analyze_drift(trajs, tok)
    assert rep.drifted == rep.lost_tokens == 0 and rep.lines()[0].startswith("drift: none")


def test_drift_found_and_repaired(tok, drifted):
    _, trajs = drifted
    rep = analyze_drift(trajs, tok)
    assert rep.drifted > 0 and rep.lost_tokens > 0 and rep.repairable_tokens == rep.lost_tokens
    assert rep.unique_tokens == unique(trajs)
    e = rep.examples[0]
    t = next(t for t in trajs if t.id == e.trajectory)
    o = next(t for t in trajs if t.id == e.other)
    assert text(tok, t)[e.char - len(e.before): e.char + len(e.after)] == e.before + e.after
    assert t.tokens[:e.token].tolist() == o.tokens[:e.token].tolist() and t.tokens[e.token] != o.tokens[e.token]
    assert e.pieces != e.other_pieces and "".join(e.pieces[:2]).startswith(e.after[:1])
    assert "tokens of sharing lost" in rep.lines()[0] and len(rep.lines()) == 1 + min(3, rep.drifted)

    fixed, changes = repair_drift(trajs, tok)
    assert changes and unique(fixed) == unique(trajs) - rep.repairable_tokens
    for a, b in zip(trajs, fixed):
        assert a.id == b.id and text(tok, a) == text(tok, b)
        # targets, with their log-probabilities, are exactly as given
        assert a.tokens[a.loss_mask == 1].tolist() == b.tokens[b.loss_mask == 1].tolist()
        assert np.array_equal(a.old_logprobs[a.loss_mask == 1], b.old_logprobs[b.loss_mask == 1])
        make_trajectory({"id": b.id, "tokens": b.tokens, "loss_mask": b.loss_mask, "old_logprobs": b.old_logprobs})
    assert analyze_drift(fixed, tok).lost_tokens == 0


def test_targets_are_never_retokenized(tok):
    """Two samples that generated the same text with different ids: sharing is lost, nothing repairable."""
    head = tok.encode("<|user|>\nfix the parser<|end|>\n<|assistant|>\n", add_special_tokens=False)
    canon = tok.encode("the test fails because", add_special_tokens=False)
    j = next(j for j, i in enumerate(canon) if len(tok.decode([i])) >= 2)
    piece = tok.decode([canon[j]])
    split = canon[:j] + tok.encode(piece[:1]) + tok.encode(piece[1:]) + canon[j + 1:]   # one token as two
    trajs = []
    for k, body in enumerate((canon, split)):
        ids = head + body + tok.encode(f" then {'run' if k else 'stop'}", add_special_tokens=False)
        mask = [0] * len(head) + [1] * (len(ids) - len(head))
        trajs.append(make_trajectory({"id": f"s{k}", "tokens": ids, "loss_mask": mask, "group": "g"}))
    rep = analyze_drift(trajs, tok)
    assert rep.drifted == 1 and rep.lost_tokens > 0 and rep.repairable_tokens == 0
    fixed, changes = repair_drift(trajs, tok)
    assert changes == [] and [t.tokens.tolist() for t in fixed] == [t.tokens.tolist() for t in trajs]
    # as context, the later sample takes the earlier one's ids
    ctx = [dataclasses.replace(t, loss_mask=np.zeros(len(t), np.uint8)) for t in trajs]
    fixed, changes = repair_drift(ctx, tok)
    assert [c.trajectory for c in changes] == ["s1"] and unique(fixed) == unique(ctx) - rep.lost_tokens
    # other groups never donate
    apart = [trajs[0], dataclasses.replace(trajs[1], group="h")]
    assert analyze_drift(apart, tok).drifted == 0


def test_tools_report_and_repair(tok_dir, drifted, tmp_path, capsys):
    src, trajs = drifted
    code, out, _ = run_tool(load_tool("tree_stats"), capsys, "--input", src, "--tokenizer", tok_dir, "--drift",
                            "--json")
    assert code == 0
    stats = json.loads(out)
    lost = stats["drift"]["lost_tokens"]
    assert lost > 0 and stats["unique_tokens"] == unique(trajs)
    code, out, _ = run_tool(load_tool("tree_stats"), capsys, "--input", src, "--tokenizer", tok_dir, "--drift")
    assert code == 0 and f"{lost:,} tokens of sharing lost" in out
    code, out, _ = run_tool(load_tool("convert_trajectories"), capsys, "--input", src, "--output", tmp_path / "ds",
                            "--tokenizer", tok_dir, "--repair-drift", "--json")
    conv = json.loads(out)
    assert code == 0 and conv["repair"]["unique_tokens_after"] == conv["unique_tokens"] == stats["unique_tokens"] - lost
    code, out, _ = run_tool(load_tool("tree_stats"), capsys, "--input", tmp_path / "ds", "--tokenizer", tok_dir,
                            "--drift")
    assert code == 0 and "drift: none" in out
    # token-id files: drift needs a tokenizer to decode; with one it is found the same way
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(json.dumps({"id": t.id, "group": t.group, "tokens": t.tokens.tolist(),
                                       "loss_mask": t.loss_mask.tolist()}) + "\n" for t in trajs))
    assert len(read_trajectories([str(ids)])) == len(trajs)
    code, out, _ = run_tool(load_tool("tree_stats"), capsys, "--input", ids, "--tokenizer", tok_dir, "--drift",
                            "--json")
    assert code == 0 and json.loads(out)["drift"]["lost_tokens"] == lost
    code, _, err = run_tool(load_tool("tree_stats"), capsys, "--input", ids, "--drift")
    assert_one_error(code, err, "--drift needs --tokenizer")
    code, _, err = run_tool(load_tool("convert_trajectories"), capsys, "--input", ids, "--output", tmp_path / "x",
                            "--repair-drift")
    assert_one_error(code, err, "--repair-drift needs --tokenizer")
