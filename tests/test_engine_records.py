"""Engine token records: per-call prompt and completion ids merged by prefix into trajectories with no
re-tokenization, completion log-probs as old_logprobs, a contradicting prompt as a branch, bad records refused."""
import json
import os

import numpy as np
import pytest

from chat_tokenizer import QWEN_LIKE_TEMPLATE, build_tokenizer
from megatron_harts.tree_data import TreeDataset, TreeFormatError, build_forest
from megatron_harts.tree_data.engine_records import read_engine_records
from megatron_harts.tree_data.messages import load_chat_tokenizer, read_messages
from test_messages import FOLLOW_UP, engine_calls, qwen_corpus, write_rows
from tool_runner import assert_one_error, load_tool, run_tool


def rec(conv, prompt, completion, logprobs=None, **kw):
    r = {"conversation": conv, "prompt_token_ids": prompt, "completion_token_ids": completion, **kw}
    if logprobs is not None:
        r["completion_logprobs"] = logprobs
    return r


def test_calls_merge_by_prefix_and_branch(tmp_path):
    rows = [rec("a", [1, 2, 3], [4, 5], [-0.1, -0.2], call=0, group="g", reward=1.0, advantage=0.5),
            rec("b", [1, 2, 3], [7], [-0.3], group="g"),
            # a later call's prompt extends the previous prompt and completion: the same trajectory
            rec("a", [1, 2, 3, 4, 5, 6], [8, 9], [-0.4, -0.5], call=1, group="g", reward=1.0),
            # a prompt that contradicts the earlier calls (re-rendered history): a branch sharing [1, 2]
            rec("a", [1, 2, 10, 6, 8, 9, 11], [12], [-0.6], call=2)]
    # the calls may come in any order across files: 'call' orders them
    trajs, report = read_engine_records([write_rows(tmp_path / "x.jsonl", rows[2:]),
                                         write_rows(tmp_path / "y.jsonl", rows[:2])])
    by = {t.id: t for t in trajs}
    assert sorted(by) == ["a", "a#1", "b"]
    a, branch = by["a"], by["a#1"]
    assert a.tokens.tolist() == [1, 2, 3, 4, 5, 6, 8, 9] and a.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 1, 1]
    assert np.allclose(a.old_logprobs[a.loss_mask == 1], [-0.1, -0.2, -0.4, -0.5])
    assert np.isnan(a.old_logprobs[a.loss_mask == 0]).all()
    assert branch.tokens.tolist() == [1, 2, 10, 6, 8, 9, 11, 12] and branch.loss_mask.tolist() == [0] * 7 + [1]
    assert (a.group, a.reward, a.advantage, branch.group, branch.reward) == ("g", 1.0, 0.5, "g", 1.0)
    assert report.to_dict() == {"conversations": 2, "calls": 4, "trajectories": 3, "branch_trajectories": 1,
                                "branch_tokens": 5,   # the branch re-renders a's tokens 2..6 (its prompt: 7)
                                "branch_calls": 1}
    assert "1 start where a prompt does not extend the previous call (e.g. 'a')" in report.lines()[0]
    # each completion is a target once: 6 targets over 3 trajectories; the tree shares [1, 2] and [1, 2, 3]
    assert sum(int(t.loss_mask.sum()) for t in trajs) == 6
    assert build_forest(trajs).stats()["unique_tokens"] == 8 + 1 + 6


def test_records_equal_the_exact_form_of_the_messages(tmp_path):
    """Records written from the engine's calls of a conversation give the exact form's trajectories."""
    tok = load_chat_tokenizer(build_tokenizer(str(tmp_path / "tok"), qwen_corpus(), template=QWEN_LIKE_TEMPLATE))
    calls = engine_calls(tok, FOLLOW_UP)
    rows = [rec("r", list(p), list(c), [-0.5] * len(c)) for p, c in calls]
    got, _ = read_engine_records([write_rows(tmp_path / "r.jsonl", rows)])
    want, _ = read_messages([write_rows(tmp_path / "m.jsonl", [{"id": "r", "messages": FOLLOW_UP}])], tok)
    assert [t.id for t in got] == [t.id for t in want] == ["r", "r#1"]
    for g, w in zip(got, want):
        assert g.tokens.tolist() == w.tokens.tolist() and g.loss_mask.tolist() == w.loss_mask.tolist()
        assert np.allclose(g.old_logprobs[g.loss_mask == 1], -0.5)


BAD = [
    ("conversation", {"prompt_token_ids": [1], "completion_token_ids": [2]}, "conversation", "is missing"),
    ("prompt", rec("c", [], [2]), "prompt_token_ids", "is empty"),
    ("ids", rec("c", [1, "x"], [2]), "prompt_token_ids", "list of token ids"),
    ("completion", rec("c", [1], None), "completion_token_ids", "is missing"),
    ("logprobs", rec("c", [1], [2, 3], [-0.1]), "completion_logprobs", "2 finite numbers"),
    ("reward", rec("c", [1, 2], [3], reward=0.0), "reward", "belongs to the conversation"),
    ("some logprobs", rec("c", [1, 2], [3]), "completion_logprobs", "given on other calls"),
    ("trainable", rec("c", [1, 2], [3], trainable=1), "trainable", "true or false"),
]


@pytest.mark.parametrize("name,bad,field,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_records(tmp_path, capsys, name, bad, field, needle):
    rows = [rec("c", [1], [2], [-0.1], reward=1.0), bad]
    src = write_rows(tmp_path / "bad.jsonl", rows)
    with pytest.raises(TreeFormatError) as e:
        read_engine_records([src])
    assert (e.value.file, e.value.field) == (src, field) and e.value.line in (1, 2)
    code, _, err = run_tool(load_tool("convert_trajectories"), capsys, "--input", src, "--output", tmp_path / "ds")
    assert_one_error(code, err, "bad.jsonl:", f"field '{field}'", needle)
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]


def test_call_numbers(tmp_path):
    rows = [rec("c", [1], [2], call=0), rec("c", [1, 2], [3], call=0)]
    with pytest.raises(TreeFormatError, match="call 0 appears twice"):
        read_engine_records([write_rows(tmp_path / "d.jsonl", rows)])
    rows = [rec("c", [1], [2], call=0), rec("c", [1, 2], [3])]
    with pytest.raises(TreeFormatError, match="is missing here but given on other calls"):
        read_engine_records([write_rows(tmp_path / "m.jsonl", rows)])


def test_tools_take_records(tmp_path, capsys):
    rows = [rec("a", [1, 2, 3], [4, 5], [-0.1, -0.2], group="g"), rec("a", [1, 2, 3, 4, 5, 6], [8], [-0.3]),
            rec("a", [1, 2, 9], [10], [-0.4]), rec("b", [1, 2, 3], [7], [-0.5], group="g")]
    src = write_rows(tmp_path / "calls.jsonl", rows)
    code, out, _ = run_tool(load_tool("convert_trajectories"), capsys, "--input", src, "--output", tmp_path / "ds",
                            "--json")
    assert code == 0
    conv = json.loads(out)
    assert conv["records"] == {"conversations": 2, "calls": 4, "trajectories": 3, "branch_trajectories": 1,
                               "branch_tokens": 1, "branch_calls": 1}
    (inp,) = conv["inputs"]
    assert inp["kind"] == "records" and inp["calls"] == 4 and inp["single_trajectory"] is None
    assert inp["exact"]["unique_tokens"] == conv["unique_tokens"] == 10
    ds = TreeDataset(str(tmp_path / "ds"))
    assert ds.stats()["num_trajectories"] == 3
    code, out, _ = run_tool(load_tool("convert_trajectories"), capsys, "--input", src, "--output", tmp_path / "ds2")
    assert code == 0 and "engine records: 4 calls of 2 conversations -> 3 trajectories" in out
    code, out, _ = run_tool(load_tool("tree_stats"), capsys, "--input", src, "--json")
    assert code == 0 and json.loads(out)["unique_tokens"] == 10
