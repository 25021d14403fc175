"""Rollouts as chat messages: the exact form (each call's prompt as the engine rendered it, equal to the
engine's calls over templates that re-render history), the single-trajectory form, the loss mask, engine
tokens, bad input, tokenizers that ship code, the per-input summary, and the tools end to end with
tokenizers built here."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chat_tokenizer import CHAT_TEMPLATE, QWEN_LIKE_TEMPLATE, REASONING_TEMPLATE, build_tokenizer, corpus_of
from megatron_harts.tree_data import TreeDataset, TreeFormatError, build_forest
from megatron_harts.tree_data.agent_logs import AgentLogConfig, add_engine_tokens, synthesize_agent_logs
from megatron_harts.tree_data.messages import (EXACT, SINGLE, ChatTokenizer, TokenizeReport, load_chat_tokenizer,
                                               read_messages, row_to_trajectories)
from tool_runner import assert_one_error, load_tool, run_tool

CFG = AgentLogConfig(num_tasks=2, samples_per_task=2, min_turns=2, max_turns=3, prompt_words=12, action_words=6,
                     observation_words=8, branch_prob=0.5, seed=3)


def write_rows(path, rows):
    with open(path, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    rows = synthesize_agent_logs(AgentLogConfig(num_tasks=3, seed=11)) + synthesize_agent_logs(CFG)
    return build_tokenizer(str(tmp_path_factory.mktemp("tok")), corpus_of(rows))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_chat_tokenizer(tok_dir)


def convert(tok, rows, tmp_path, name="m.jsonl"):
    return read_messages([write_rows(tmp_path / name, rows)], tok)


def decode(tok, ids):
    return tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_generator_is_seeded_and_branches():
    rows = synthesize_agent_logs(CFG)
    assert rows == synthesize_agent_logs(CFG)
    assert rows != synthesize_agent_logs(AgentLogConfig(**{**CFG.__dict__, "seed": 4}))
    roles = {m["role"] for r in rows for m in r["messages"]}
    assert roles == {"system", "user", "assistant", "tool"}
    for r in rows:   # tool results answer earlier calls; a rollout ends with an answer
        calls = [c["id"] for m in r["messages"] for c in m.get("tool_calls", ())]
        assert len(calls) == len(set(calls))
        assert all(m["tool_call_id"] in calls for m in r["messages"] if m["role"] == "tool")
        assert r["messages"][-1]["role"] == "assistant" and "tool_calls" not in r["messages"][-1]
    assert len(rows) > CFG.num_tasks * CFG.samples_per_task    # some rollouts branched
    with pytest.raises(ValueError, match="max_turns"):
        synthesize_agent_logs(AgentLogConfig(min_turns=3, max_turns=2))


def test_prefix_stable_and_shared(tok, tmp_path):
    rows = synthesize_agent_logs(CFG)
    trajs, report = convert(tok, rows, tmp_path)
    assert report.trajectories == len(rows) and not report.rerendered and not report.engine
    by_id = {t.id: t for t in trajs}
    # the tokens of turn k never depend on later turns: every conversation prefix is a token prefix
    row = max(rows, key=lambda r: len(r["messages"]))
    full = by_id[row["id"]].tokens
    for k in range(2, len(row["messages"])):
        part, _ = convert(tok, [{"id": "p", "messages": row["messages"][:k]}], tmp_path, "p.jsonl")
        assert np.array_equal(part[0].tokens, full[:len(part[0].tokens)])
    # siblings sharing k messages share the ids of those messages; each file's text is the template's
    for a in rows:
        for b in rows:
            if a["group"] != b["group"] or a["id"] >= b["id"]:
                continue
            k = next(i for i, (x, y) in enumerate(zip(a["messages"], b["messages"])) if x != y)
            shared, _ = convert(tok, [{"id": "s", "messages": a["messages"][:k]}], tmp_path, "s.jsonl")
            n = len(shared[0].tokens)
            assert np.array_equal(by_id[a["id"]].tokens[:n], by_id[b["id"]].tokens[:n])
    t = by_id[rows[0]["id"]]
    # the exact form ends with the last generated token: the template's newline after it is no call's
    assert decode(tok, t.tokens) + "\n" == tok.apply_chat_template(rows[0]["messages"], tokenize=False)
    assert build_forest(trajs).stats()["compression"] > 1.5


def test_loss_mask_is_what_the_model_generated(tok, tmp_path):
    rows = synthesize_agent_logs(CFG)
    trajs, report = convert(tok, rows[:1], tmp_path)
    t, msgs = trajs[0], rows[0]["messages"]
    assert t.loss_mask[0] == 0 and report.targets == int(t.loss_mask.sum())
    # the runs of targets are the assistant turns after their generation prompt, through <|end|>
    runs, j = [], 0
    mask = t.loss_mask.tolist() + [0]
    while j < len(t.tokens):
        if mask[j]:
            k = mask.index(0, j)
            runs.append(decode(tok, t.tokens[j:k]))
            j = k
        else:
            j += 1
    turns = [m for m in msgs if m["role"] == "assistant"]
    assert len(runs) == len(turns)
    for text, m in zip(runs, turns):
        assert text.startswith(m["content"]) and text.endswith("<|end|>")
        for c in m.get("tool_calls", ()):
            assert c["id"] in text and c["function"]["arguments"] in text
    context = decode(tok, t.tokens[t.loss_mask == 0])
    assert context.count("<|assistant|>\n") == len(turns) and msgs[1]["content"] in context


def test_trainable_and_weight(tok, tmp_path):
    step = synthesize_agent_logs(AgentLogConfig(**{**CFG.__dict__, "scheme": "step-wise"}))
    trajs, _ = convert(tok, step, tmp_path)
    for r, t in zip(step, trajs):     # only the last turn of a step-wise row is a target
        last = r["messages"][-1]
        assert decode(tok, t.tokens[t.loss_mask == 1]) == last["content"] + "".join(
            f"<|call|>{c['id']} {c['function']['name']} {c['function']['arguments']}<|/call|>"
            for c in last.get("tool_calls", ())) + "<|end|>"
    msgs = [{"role": "user", "content": "run the tests"}, {"role": "assistant", "content": "ok", "weight": 0},
            {"role": "user", "content": "again", "trainable": True}]
    (t,), _ = convert(tok, [{"id": "w", "messages": msgs}], tmp_path)
    assert decode(tok, t.tokens[t.loss_mask == 1]) == "<|user|>\nagain<|end|>\n"    # all of a trainable user turn


def test_rerendering_template_keeps_what_the_model_saw(tmp_path):
    msgs = [{"role": "user", "content": "fix the parser"},
            {"role": "assistant", "content": "done", "reasoning_content": "check the split"},
            {"role": "user", "content": "and the tests"},
            {"role": "assistant", "content": "ok", "reasoning_content": "run pytest"}]
    d = build_tokenizer(str(tmp_path / "r"), [m["content"] for m in msgs] + ["check the split run pytest"],
                        template=REASONING_TEMPLATE)
    tok = load_chat_tokenizer(d)
    (t,), report = read_messages([write_rows(tmp_path / "m.jsonl", [{"id": "r", "messages": msgs}])], tok,
                                 form=SINGLE)
    text = decode(tok, t.tokens)
    assert report.rerendered == 1 and report.rerendered_trajectories == ["r"]
    assert "<think>check the split</think>done" in text and "<think>run pytest</think>ok" in text
    assert "check the split" not in tok.apply_chat_template(msgs, tokenize=False)   # the template drops it
    assert text.endswith("<|user|>\nand the tests<|end|>\n<|assistant|>\n<think>run pytest</think>ok<|end|>\n")
    assert any("re-renders earlier turns at 1 message boundaries" in line for line in report.lines())


def test_engine_tokens_win(tok, tmp_path):
    rows = synthesize_agent_logs(CFG)[:3]
    plain, _ = convert(tok, rows, tmp_path)
    engine = add_engine_tokens(rows, tok, drift=0.5, seed=1)
    trajs, report = convert(tok, engine, tmp_path, "e.jsonl")
    assert report.engine == 3 and len(report.engine_differs) == 3
    for p, t, r in zip(plain, trajs, engine):
        assert t.tokens.tolist() == r["tokens"] and len(t.tokens) > len(p.tokens)
        assert decode(tok, t.tokens[t.loss_mask == 1]) == decode(tok, p.tokens[p.loss_mask == 1])
        given = np.array([np.nan if v is None else v for v in r["old_logprobs"]])
        assert np.array_equal(np.isnan(t.old_logprobs), np.isnan(given))
    # old_logprobs may also come one per target token
    compact = dict(engine[0], old_logprobs=[v for v in engine[0]["old_logprobs"] if v is not None])
    (t,), _ = convert(tok, [compact], tmp_path, "c.jsonl")
    assert np.allclose(t.old_logprobs[t.loss_mask == 1], compact["old_logprobs"])


def test_parquet_rows(tok, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    rows = synthesize_agent_logs(CFG)[:4]
    path = str(tmp_path / "m.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    got, _ = read_messages([path], tok)
    want, _ = convert(tok, rows, tmp_path)
    assert [t.tokens.tolist() for t in got] == [t.tokens.tolist() for t in want]
    assert [t.loss_mask.tolist() for t in got] == [t.loss_mask.tolist() for t in want]


def _row(messages, **kw):
    return {"id": "bad/0", "group": "g", "messages": messages, **kw}


USER = {"role": "user", "content": "hi"}
BAD = [
    ("role", [USER, {"role": "robot", "content": "x"}], {}, "messages[1].role"),
    ("content", [USER, {"role": "assistant"}], {}, "messages[1].content"),
    ("call id", [USER, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "bash", "arguments": "{}"}}]}], {}, "messages[1].tool_calls[0].id"),
    ("tool result", [USER, {"role": "tool", "tool_call_id": "c9", "content": "out"}], {},
     "messages[1].tool_call_id"),
    ("weight", [USER, {"role": "assistant", "content": "x", "weight": 0.5}], {}, "messages[1].weight"),
    ("logprobs", [USER, {"role": "assistant", "content": "x"}], {"old_logprobs": [0.0]}, "old_logprobs"),
]


@pytest.mark.parametrize("name,messages,extra,field", BAD, ids=[b[0] for b in BAD])
def test_bad_rows(tok, tmp_path, capsys, name, messages, extra, field):
    rows = [_row([USER, {"role": "assistant", "content": "fine"}], id="ok/0"), _row(messages, **extra)]
    src = write_rows(tmp_path / "bad.jsonl", rows)
    with pytest.raises(TreeFormatError) as e:
        read_messages([src], tok)
    assert (e.value.file, e.value.line, e.value.trajectory, e.value.field) == (src, 2, "bad/0", field)
    code, out, err = run_tool(load_tool("convert_trajectories"), capsys, "--input", src, "--output",
                              tmp_path / "ds", "--tokenizer", tok.name_or_path)
    assert_one_error(code, err, "bad.jsonl:2", "'bad/0'", field)
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]


def test_engine_tokens_must_decode_to_the_messages(tok, tok_dir, tmp_path, capsys):
    row = add_engine_tokens(synthesize_agent_logs(CFG)[:1], tok, drift=0.0)[0]
    row["tokens"] = row["tokens"][:5] + row["tokens"][6:]
    src = write_rows(tmp_path / "e.jsonl", [row])
    code, _, err = run_tool(load_tool("convert_trajectories"), capsys, "--input", src, "--output", tmp_path / "ds",
                            "--tokenizer", tok_dir)
    assert_one_error(code, err, "e.jsonl:1", repr(row["id"]), "field 'tokens'", "decode to text that differs")
    assert sorted(os.listdir(tmp_path)) == ["e.jsonl"]


def test_messages_need_a_tokenizer(tmp_path, capsys):
    src = write_rows(tmp_path / "m.jsonl", synthesize_agent_logs(CFG)[:2])
    for tool, args in (("convert_trajectories", ("--output", tmp_path / "ds")), ("tree_stats", ())):
        code, _, err = run_tool(load_tool(tool), capsys, "--input", src, *args)
        assert_one_error(code, err, "m.jsonl:1", "'task0/s0/b0'", "field 'messages'", "--tokenizer")
    code, _, err = run_tool(load_tool("convert_trajectories"), capsys, "--input", src, "--output", tmp_path / "ds",
                            "--tokenizer", tmp_path / "nope")
    assert_one_error(code, err, "nope", "no such tokenizer directory")
    assert sorted(os.listdir(tmp_path)) == ["m.jsonl"]


def test_tools_end_to_end(tok_dir, tmp_path, capsys):
    src = str(tmp_path / "m.jsonl")
    code, out, _ = run_tool(load_tool("synthesize_rollouts"), capsys, "--format", "messages", "--output", src,
                            "--num-tasks", 2, "--samples-per-task", 2, "--prompt-median", 12, "--action-median", 6,
                            "--observation-median", 8, "--max-turns", 5, "--json")
    assert code == 0 and json.loads(out)["trajectories"] == len(open(src).readlines())
    code, out, _ = run_tool(load_tool("convert_trajectories"), capsys, "--input", src, "--output",
                            tmp_path / "ds", "--tokenizer", tok_dir, "--json")
    assert code == 0
    conv = json.loads(out)
    assert conv["messages"]["trajectories"] == conv["num_trajectories"] and conv["drift"]["lost_tokens"] == 0
    code, out, _ = run_tool(load_tool("tree_stats"), capsys, "--input", src, "--tokenizer", tok_dir, "--json")
    stats = json.loads(out)
    assert code == 0 and stats == {k: v for k, v in conv.items() if k not in ("messages", "drift", "inputs")}
    assert TreeDataset(str(tmp_path / "ds")).stats() == stats
    code, out, _ = run_tool(load_tool("convert_trajectories"), capsys, "--input", src, "--output",
                            tmp_path / "ds2", "--tokenizer", tok_dir)
    assert code == 0 and "drift: none" in out
    code, _, err = run_tool(load_tool("synthesize_rollouts"), capsys, "--format", "messages", "--output", src,
                            "--engine-drift", "0.5")
    assert_one_error(code, err, "--engine-drift needs --tokenizer")


def test_tree_data_imports_no_transformers():
    code = ("import sys; import megatron_harts.tree_data.messages, megatron_harts.tree_data.drift, "
            "megatron_harts.tree_data.agent_logs; print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_report_lines_are_quiet_when_nothing_happened(tok):
    assert TokenizeReport().lines() == []
    assert ChatTokenizer(tok).eos == tok.eos_token_id


# ---- the exact form: each call's prompt as the engine rendered it --------------------------------------------

WORDS = ("the parser fails on empty input so check the split then run pytest again read file line config "
         "tests pass fix edit done look value none error trace think why maybe because first second").split()


def qwen_corpus():
    """Texts to train a test BPE on for QWEN_LIKE_TEMPLATE conversations."""
    text = " ".join(WORDS)
    return [text, text.upper(), '<tool_call>{"name": "bash", "arguments": {"cmd": "pytest -q"}}</tool_call>',
            "<tool_response>\n", "\n</tool_response>\n", "<think>", "</think>", "You are a helpful assistant."]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return load_chat_tokenizer(build_tokenizer(str(tmp_path_factory.mktemp("qwen")), qwen_corpus(),
                                               template=QWEN_LIKE_TEMPLATE))


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return load_chat_tokenizer(build_tokenizer(str(tmp_path_factory.mktemp("plain")), qwen_corpus()))


def engine_calls(tok, messages, tools=None):
    """The (prompt ids, generated ids) of every assistant call, as an engine makes them: the render of
    the messages before it with the generation prompt, tokenized as one text, and the text the
    assistant message adds, tokenized on its own, through its last end-of-sequence token."""
    out = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = tok.apply_chat_template(messages[:k], tools=tools, tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(messages[:k + 1], tools=tools, tokenize=False)
        assert full.startswith(prompt)
        gen = tok.encode(full[len(prompt):], add_special_tokens=False)
        cut = max(j for j, i in enumerate(gen) if i == tok.eos_token_id) + 1
        out.append((tuple(tok.encode(prompt, add_special_tokens=False)), tuple(gen[:cut])))
    return out


def trajectory_calls(trajs):
    """Every run of targets of ``trajs`` with everything before it: (context, targets)."""
    out = []
    for t in trajs:
        mask, j = t.loss_mask.tolist() + [0], 0
        while j < len(t):
            if mask[j]:
                k = mask.index(0, j)
                out.append((tuple(t.tokens[:j].tolist()), tuple(t.tokens[j:k].tolist())))
                j = k
            else:
                j += 1
    return out


def assert_exact(tok, rows, trajs):
    """The union of the trajectories' calls is, token for token, the calls an engine made: each once."""
    want = sorted(c for r in rows for c in engine_calls(tok, r["messages"]))
    assert sorted(trajectory_calls(trajs)) == want


def call(cid, name="bash", cmd="pytest -q"):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps({"cmd": cmd})}}


FOLLOW_UP = [{"role": "user", "content": "fix the parser"},
             {"role": "assistant", "content": "done", "reasoning_content": "check the split first"},
             {"role": "user", "content": "and the tests"},
             {"role": "assistant", "content": "tests pass", "reasoning_content": "run pytest again"}]


def test_exact_form_branches_where_the_template_rerenders(qwen, tmp_path):
    trajs, report = convert(qwen, [{"id": "r", "group": "g", "messages": FOLLOW_UP}], tmp_path)
    assert_exact(qwen, [{"messages": FOLLOW_UP}], trajs)
    assert [t.id for t in trajs] == ["r", "r#1"] and [t.group for t in trajs] == ["g", "g"]
    first, second = (decode(qwen, t.tokens) for t in trajs)
    assert first.endswith("<|assistant|>\n<think>check the split first</think>done<|end|>")
    # the second call saw the first turn without its reasoning: that re-rendered turn is context only
    assert "check the split first" not in second and second.endswith("<think>run pytest again</think>tests pass<|end|>")
    assert decode(qwen, trajs[1].tokens[trajs[1].loss_mask == 1]) == "<think>run pytest again</think>tests pass<|end|>"
    assert report.calls == 2 and report.branches == 1 and report.branch_conversations == ["r"]
    assert report.branch_calls == 1
    # the tree computes the shared part once: the branch adds only its tokens after the first difference
    shared = int(np.flatnonzero(trajs[0].tokens[:len(trajs[1])] != trajs[1].tokens[:len(trajs[0])])[0])
    assert build_forest(trajs).stats()["unique_tokens"] == len(trajs[0]) + len(trajs[1]) - shared
    prompt = int(np.flatnonzero(trajs[1].loss_mask)[0])
    assert report.branch_tokens == min(len(trajs[0]), prompt) - shared > 0
    assert any("1 start where the template re-renders" in line for line in report.lines())
    # the single-trajectory form trains the second turn on a context holding the dropped reasoning
    (t,), _ = read_messages([write_rows(tmp_path / "s.jsonl", [{"id": "r", "messages": FOLLOW_UP}])], qwen,
                            form=SINGLE)
    assert "check the split first" in decode(qwen, t.tokens)
    with pytest.raises(AssertionError):
        assert_exact(qwen, [{"messages": FOLLOW_UP}], [t])


CASES = {
    # two parallel calls and their results, which the template groups in one block
    "parallel tool results": [
        {"role": "user", "content": "run the tests and read the config"},
        {"role": "assistant", "content": "", "reasoning_content": "two things",
         "tool_calls": [call("c1"), call("c2", "read_file", "config")]},
        {"role": "tool", "tool_call_id": "c1", "content": "tests pass"},
        {"role": "tool", "tool_call_id": "c2", "content": "value none"},
        {"role": "assistant", "content": "done"}],
    # the follow-up repeats a passage of the reasoning the template drops
    "follow-up repeats reasoning": [
        {"role": "user", "content": "fix the parser"},
        {"role": "assistant", "content": "done", "reasoning_content": "the split fails on empty input"},
        {"role": "user", "content": "the split fails on empty input"},
        {"role": "assistant", "content": "fixed", "reasoning_content": "check again"}],
    # the follow-up repeats a tool result
    "follow-up repeats a tool result": [
        {"role": "user", "content": "run the tests"},
        {"role": "assistant", "content": "", "reasoning_content": "run them", "tool_calls": [call("c1")]},
        {"role": "tool", "tool_call_id": "c1", "content": "error trace line"},
        {"role": "assistant", "content": "they fail"},
        {"role": "user", "content": "error trace line"},
        {"role": "assistant", "content": "look at the trace", "reasoning_content": "why"}],
    "empty reasoning": [
        {"role": "user", "content": "fix the parser"},
        {"role": "assistant", "content": "done", "reasoning_content": ""},
        {"role": "user", "content": "and the tests"},
        {"role": "assistant", "content": "tests pass", "reasoning_content": ""}],
    "reasoning in the content": [
        {"role": "user", "content": "fix the parser"},
        {"role": "assistant", "content": "<think>check the split</think>done"},
        {"role": "user", "content": "and the tests"},
        {"role": "assistant", "content": "<think>run pytest</think>tests pass"}],
    # no system message: the template inserts its default system prompt (and always a BOS)
    "template system prompt and BOS": [
        {"role": "user", "content": "read the config"},
        {"role": "assistant", "content": "value none", "reasoning_content": "read it"}],
}


@pytest.mark.parametrize("name", list(CASES))
def test_exact_form_cases(qwen, tmp_path, name):
    msgs = CASES[name]
    trajs, report = convert(qwen, [{"id": "c", "messages": msgs}], tmp_path)
    assert_exact(qwen, [{"messages": msgs}], trajs)
    assert all(decode(qwen, t.tokens).startswith("<|bos|><|system|>\nYou are a helpful assistant.<|end|>\n")
               for t in trajs)
    turns = [k for k, m in enumerate(msgs) if m["role"] == "assistant"]
    for context, _ in trajectory_calls(trajs):    # every message is in every later call's prompt
        text = decode(qwen, context)
        k = turns[text.count("<|assistant|>\n") - 1]
        for m in msgs[:k]:
            assert m["content"].split("</think>")[-1] in text, (k, m)
    assert report.calls == sum(m["role"] == "assistant" for m in msgs)
    assert report.targets == sum(len(g) for c in engine_calls(qwen, msgs) for g in c[1:])


def test_parallel_tool_results_are_all_seen(qwen, tmp_path):
    msgs = CASES["parallel tool results"]
    trajs, _ = convert(qwen, [{"id": "p", "messages": msgs}], tmp_path)
    assert len(trajs) == 1     # the grouped block extends the first call: one trajectory
    assert "<tool_response>\ntests pass\n</tool_response>\n<tool_response>\nvalue none\n</tool_response>\n<|end|>" \
        in decode(qwen, trajs[0].tokens)


@pytest.mark.parametrize("name", ["follow-up repeats reasoning", "parallel tool results"])
def test_single_trajectory_form_loses_no_message_silently(qwen, tmp_path, name):
    """Where the single-trajectory form cannot place a message it refuses the row (it used to drop it)."""
    msgs = CASES[name]
    try:
        trajs, _ = read_messages([write_rows(tmp_path / "s.jsonl", [{"id": "s", "messages": msgs}])], qwen,
                                 form=SINGLE)
    except TreeFormatError as e:
        assert e.field.startswith("messages[")
        return
    text = decode(qwen, trajs[0].tokens)
    for m in msgs:
        assert m["content"].split("</think>")[-1] in text


# ---- property: over random conversations and templates the exact form is the engine's calls -------------------

TEXT = st.lists(st.sampled_from(WORDS), min_size=1, max_size=5).map(" ".join)


@st.composite
def conversation(draw):
    msgs, calls = [], 0
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(TEXT)})
    for _ in range(draw(st.integers(1, 3))):
        msgs.append({"role": "user", "content": draw(TEXT)})
        steps = draw(st.integers(1, 3))
        for s in range(steps):
            m = {"role": "assistant", "content": draw(TEXT)}
            style = draw(st.sampled_from(["field", "content", "empty", "none"]))
            if style == "field":
                m["reasoning_content"] = draw(TEXT)
            elif style == "content":
                m["content"] = f"<think>{draw(TEXT)}</think>{m['content']}"
            elif style == "empty":
                m["reasoning_content"] = ""
            n = draw(st.integers(0, 2)) if s < steps - 1 else 0
            ids = [f"c{calls + j}" for j in range(n)]
            calls += n
            if ids:
                m["tool_calls"] = [call(c, cmd=draw(TEXT)) for c in ids]
            msgs.append(m)
            msgs.extend({"role": "tool", "tool_call_id": c, "content": draw(TEXT)} for c in ids)
    return msgs


@st.composite
def group(draw):
    """One to three conversations, each later one sharing a prefix of the first."""
    first = draw(conversation())
    rows = [first]
    for _ in range(draw(st.integers(0, 2))):
        k = draw(st.integers(1, len(first)))
        rest = [m for m in draw(conversation()) if m["role"] != "system" and "tool_calls" not in m
                and m["role"] != "tool"]
        rows.append(first[:k] + rest)
    return [{"id": f"r{j}", "group": "g", "messages": m} for j, m in enumerate(rows)]


@pytest.mark.parametrize("template", ["qwen", "plain", "reasoning"])
def test_property_exact_form_is_the_engine_calls(qwen, plain, tmp_path_factory, template):
    if template == "reasoning":
        tok = load_chat_tokenizer(build_tokenizer(str(tmp_path_factory.mktemp("rt")), qwen_corpus(),
                                                  template=REASONING_TEMPLATE))
    else:
        tok = {"qwen": qwen, "plain": plain}[template]

    branched = []

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(group())
    def check(rows):
        chat, report = ChatTokenizer(tok), TokenizeReport()
        trajs = [t for r in rows for t in row_to_trajectories(r, chat, report)]
        # the union of the trajectories' calls is, token for token, the engine's calls, each once
        assert_exact(tok, rows, trajs)
        assert report.calls == sum(len(engine_calls(tok, r["messages"])) for r in rows)
        build_forest(trajs)     # ids unique, one group: the branches merge with what they share
        branched.append(report.branches)

    check()
    # the templates that re-render history did so on some of the conversations; the plain one never
    assert (sum(branched) > 0) == (template != "plain")


# ---- refusals: a message the template loses, a completion not after its prompt -----------------------------------

DROPS_DEVELOPER = CHAT_TEMPLATE.replace("{% else %}<|{{ m['role'] }}|>",
                                        "{% elif m['role'] != 'developer' %}<|{{ m['role'] }}|>")
NOT_AFTER_PROMPT = CHAT_TEMPLATE.replace("{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
                                         "{% if add_generation_prompt %}<|assistant|> {% endif %}")


@pytest.mark.parametrize("template,messages,k,needle", [
    (DROPS_DEVELOPER, [USER, {"role": "developer", "content": "be brief"}, {"role": "assistant", "content": "ok"}],
     1, "renders nothing of this message"),
    (NOT_AFTER_PROMPT, [USER, {"role": "assistant", "content": "ok"}], 1, "after the prompt of its call"),
])
def test_exact_form_refuses_what_it_cannot_make_exact(tmp_path, capsys, template, messages, k, needle):
    d = build_tokenizer(str(tmp_path / "tok"), qwen_corpus(), template=template)
    work = tmp_path / "w"
    work.mkdir()
    rows = [_row([USER], id="ok/0"), _row(messages)]
    src = write_rows(work / "bad.jsonl", rows)
    with pytest.raises(TreeFormatError) as e:
        read_messages([src], load_chat_tokenizer(d))
    assert (e.value.line, e.value.trajectory, e.value.field) == (2, "bad/0", f"messages[{k}]")
    code, _, err = run_tool(load_tool("convert_trajectories"), capsys, "--input", src, "--output", work / "ds",
                            "--tokenizer", d)
    assert_one_error(code, err, "bad.jsonl:2", "'bad/0'", f"messages[{k}]", needle)
    assert sorted(os.listdir(work)) == ["bad.jsonl"]


def test_engine_tokens_of_a_branching_conversation_are_refused(qwen, tmp_path, capsys):
    ids = qwen.encode(qwen.apply_chat_template(FOLLOW_UP, tokenize=False), add_special_tokens=False)
    src = write_rows(tmp_path / "e.jsonl", [{"id": "e", "messages": FOLLOW_UP, "tokens": ids}])
    with pytest.raises(TreeFormatError) as e:
        read_messages([src], qwen)
    assert e.value.field == "tokens" and "2 trajectories" in str(e.value) and "message 3" in str(e.value)


# ---- tokenizers that ship code ---------------------------------------------------------------------------------------

SHIPPED = '''from transformers import PreTrainedTokenizerFast


class ShippedTokenizer(PreTrainedTokenizerFast):
    """A tokenizer class the directory ships: transformers runs this file only when trusted."""
    shipped = True
'''


def test_tokenizer_that_ships_code_needs_trust_remote_code(tok_dir, tmp_path, capsys):
    import shutil
    d = tmp_path / "shipped"
    shutil.copytree(tok_dir, d)
    (d / "shipped_tokenizer.py").write_text(SHIPPED)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class="ShippedTokenizer",
               auto_map={"AutoTokenizer": [None, "shipped_tokenizer.ShippedTokenizer"]})
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TreeFormatError, match="ships its own code .*--trust-remote-code"):
        load_chat_tokenizer(str(d))
    tok = load_chat_tokenizer(str(d), trust_remote_code=True)
    assert type(tok).__name__ == "ShippedTokenizer" and tok.shipped
    src = write_rows(tmp_path / "m.jsonl", synthesize_agent_logs(CFG)[:2])
    for tool, args in (("convert_trajectories", ("--output", tmp_path / "ds")), ("tree_stats", ())):
        code, _, err = run_tool(load_tool(tool), capsys, "--input", src, "--tokenizer", d, *args)
        assert_one_error(code, err, "shipped", "ships its own code", "--trust-remote-code")
        code, out, _ = run_tool(load_tool(tool), capsys, "--input", src, "--tokenizer", d, "--trust-remote-code",
                                *args, "--json")
        assert code == 0 and json.loads(out)["num_trajectories"] == 2


# ---- the summary: per input, calls, branching and both forms side by side -------------------------------------------

REASONING_CFG = AgentLogConfig(num_tasks=2, samples_per_task=2, min_turns=2, max_turns=4, prompt_words=12,
                               action_words=6, observation_words=8, reasoning_words=6, followup_prob=0.4, seed=7)


def test_generator_reasoning_and_followups():
    rows = synthesize_agent_logs(REASONING_CFG)
    assert rows == synthesize_agent_logs(REASONING_CFG)
    turns = [m for r in rows for m in r["messages"] if m["role"] == "assistant"]
    assert turns and all(m["reasoning_content"] for m in turns)
    follow = [k for r in rows for k, m in enumerate(r["messages"]) if m["role"] == "user" and k > 1]
    assert follow and all(r["messages"][k - 1]["role"] == "tool" for r in rows for k, m in
                          enumerate(r["messages"]) if m["role"] == "user" and k > 1)
    plain_rows = synthesize_agent_logs(CFG)       # off by default
    assert not any("reasoning_content" in m or (m["role"] == "user" and k > 1)
                   for r in plain_rows for k, m in enumerate(r["messages"]))
    with pytest.raises(ValueError, match="followup_prob"):
        synthesize_agent_logs(AgentLogConfig(followup_prob=1.5))


def test_summary_per_input_both_forms(qwen, tmp_path, capsys):
    rows = synthesize_agent_logs(REASONING_CFG)
    half = len(rows) // 2
    files = [write_rows(tmp_path / "a.jsonl", rows[:half]), write_rows(tmp_path / "b.jsonl", rows[half:])]
    d = qwen.name_or_path
    code, out, _ = run_tool(load_tool("convert_trajectories"), capsys, "--input", *files, "--output", tmp_path / "ds",
                            "--tokenizer", d, "--json")
    assert code == 0
    conv = json.loads(out)
    assert [r["input"] for r in conv["inputs"]] == files
    for r, f in zip(conv["inputs"], files):
        exact, rep = read_messages([f], qwen, form=EXACT)
        single, _ = read_messages([f], qwen, form=SINGLE)
        want = {k: build_forest(ts).stats() for k, ts in (("exact", exact), ("single_trajectory", single))}
        mine = rows[:half] if f == files[0] else rows[half:]
        assert r["calls"] == rep.calls == sum(m["role"] == "assistant" for row in mine for m in row["messages"])
        assert r["conversations"] == len(mine)
        assert r["trajectories"] == len(exact) == len(single) + r["branch_trajectories"]
        assert r["branch_trajectories"] == rep.branches > 0 and r["branch_tokens"] == rep.branch_tokens > 0
        # the calls of the branches: every call of a trajectory other than a conversation's first
        firsts = {t.id for t in exact if "#" not in str(t.id)}
        assert r["branch_calls"] == sum(len(engine_calls(qwen, row["messages"])) for row in mine) - len(
            trajectory_calls([t for t in exact if t.id in firsts])) >= r["branch_trajectories"]
        for form in ("exact", "single_trajectory"):
            assert r[form]["unique_tokens"] == want[form]["unique_tokens"]
            assert r[form]["compression"] == pytest.approx(want[form]["compression"])
        assert_exact(qwen, mine, exact)
    assert conv["unique_tokens"] == build_forest(
        [t for f in files for t in read_messages([f], qwen)[0]]).stats()["unique_tokens"]
    code, out, _ = run_tool(load_tool("tree_stats"), capsys, "--input", *files, "--tokenizer", d, "--drift", "--json")
    assert code == 0 and json.loads(out)["messages"] == conv["inputs"]
    code, out, _ = run_tool(load_tool("convert_trajectories"), capsys, "--input", files[0], "--output",
                            tmp_path / "ds2", "--tokenizer", d)
    r = conv["inputs"][0]
    assert code == 0 and (f"{r['branch_trajectories']:,} of them by re-render branching" in out
                          and f"single-trajectory form (trained context differs from the rollout's) "
                              f"{r['single_trajectory']['unique_tokens']:,}" in out)
    # the opt-in form: one trajectory per conversation
    code, out, _ = run_tool(load_tool("convert_trajectories"), capsys, "--input", files[0], "--output",
                            tmp_path / "ds3", "--tokenizer", d, "--single-trajectory-context-differs-from-rollout",
                            "--json")
    assert code == 0 and json.loads(out)["num_trajectories"] == half
    assert json.loads(out)["inputs"] == conv["inputs"][:1]
    code, _, err = run_tool(load_tool("tree_stats"), capsys, "--input", files[0],
                            "--single-trajectory-context-differs-from-rollout")
    assert_one_error(code, err, "--single-trajectory-context-differs-from-rollout needs --tokenizer")


def test_messages_after_the_last_call(qwen, plain, tmp_path):
    """Messages no call saw: context when the whole rendering extends the last trajectory, else counted."""
    tail = CASES["parallel tool results"][:4]           # ends with the tool results of the first call
    (t,), report = convert(plain, [{"id": "t", "messages": tail}], tmp_path)
    assert decode(plain, t.tokens) == plain.apply_chat_template(tail, tokenize=False) and report.unseen == 0
    assert decode(plain, t.tokens[t.loss_mask == 1]).endswith("<|end|>") and t.loss_mask[-1] == 0
    (t,), report = convert(qwen, [{"id": "u", "messages": FOLLOW_UP[:3]}], tmp_path)   # the follow-up drops reasoning
    assert "and the tests" not in decode(qwen, t.tokens) and report.unseen == 1
    assert any("1 messages after the last call" in line for line in report.lines())
    (t,), report = convert(qwen, [{"id": "v", "messages": FOLLOW_UP[:1]}], tmp_path)    # no call: context only
    assert decode(qwen, t.tokens) == qwen.apply_chat_template(FOLLOW_UP[:1], tokenize=False)
    assert not t.loss_mask.any() and report.calls == 0


def test_synthesizer_reasoning_flags(qwen, tmp_path, capsys):
    src = tmp_path / "r.jsonl"
    code, out, _ = run_tool(load_tool("synthesize_rollouts"), capsys, "--format", "messages", "--output", src,
                            "--num-tasks", 1, "--prompt-median", 12, "--action-median", 6, "--observation-median", 8,
                            "--reasoning-median", 5, "--followup-prob", 0.5, "--json")
    assert code == 0 and json.loads(out)["config"]["followup_prob"] == 0.5
    rows = [json.loads(line) for line in open(src)]
    assert all(m.get("reasoning_content") for r in rows for m in r["messages"] if m["role"] == "assistant")
    # engine tokens of one sequence cannot hold a conversation whose template re-renders its history
    code, _, err = run_tool(load_tool("synthesize_rollouts"), capsys, "--format", "messages", "--output",
                            tmp_path / "e.jsonl", "--num-tasks", 1, "--reasoning-median", 5, "--followup-prob", 1.0,
                            "--tokenizer", qwen.name_or_path)
    assert_one_error(code, err, "re-renders the history")
    code, _, err = run_tool(load_tool("synthesize_rollouts"), capsys, "--output", tmp_path / "t.jsonl",
                            "--followup-prob", 0.5)
    assert_one_error(code, err, "need --format messages")
    code, _, err = run_tool(load_tool("synthesize_rollouts"), capsys, "--format", "messages", "--output",
                            tmp_path / "t.jsonl", "--followup-prob", 2)
    assert_one_error(code, err, "--followup-prob must be in [0, 1]")
    assert sorted(os.listdir(tmp_path)) == ["r.jsonl"]
