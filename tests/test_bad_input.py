"""Invariant 5: every bad input gets a TreeFormatError naming file, line, trajectory and field."""
import gzip
import json
import os

import numpy as np
import pytest

from megatron_harts.tree_data import (TreeDataset, TreeFormatError, build_forest, make_trajectory,
                                      read_trajectories, write_dataset)


def write_lines(tmp_path, lines, name="in.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return str(p)


def rec(**kw):
    base = {"id": "a", "tokens": [1, 2, 3]}
    base.update(kw)
    return json.dumps(base)


def expect(tmp_path, lines, field, *, line=None, trajectory=None, vocab_size=None, contains=None):
    path = write_lines(tmp_path, lines)
    with pytest.raises(TreeFormatError) as ei:
        build_forest(read_trajectories([path], vocab_size=vocab_size))
    e = ei.value
    msg = str(e)
    assert e.file == path and path in msg
    if field is not None:
        assert e.field == field and f"'{field}'" in msg
    if line is not None:
        assert e.line == line and f":{line}" in msg
    if trajectory is not None:
        assert e.trajectory == trajectory and repr(trajectory) in msg
    if contains:
        assert contains in msg
    assert "\n" not in msg
    return e


def test_malformed_json(tmp_path):
    expect(tmp_path, [rec(), '{"id": "b", "tokens": [1, 2'], None, line=2, contains="malformed JSON")


def test_not_an_object(tmp_path):
    expect(tmp_path, ["[1, 2, 3]"], None, line=1, contains="JSON object")


def test_missing_tokens(tmp_path):
    expect(tmp_path, [rec(), json.dumps({"id": "b"})], "tokens", line=2, trajectory="b", contains="missing")


def test_missing_id(tmp_path):
    expect(tmp_path, [json.dumps({"tokens": [1]})], "id", line=1, contains="missing")


def test_non_integer_token(tmp_path):
    expect(tmp_path, [rec(tokens=[1, 2.5, 3])], "tokens", line=1, trajectory="a", contains="element 1")


def test_string_token(tmp_path):
    expect(tmp_path, [rec(tokens=[1, "x"])], "tokens", line=1, trajectory="a", contains="not an integer")


def test_negative_token(tmp_path):
    expect(tmp_path, [rec(tokens=[1, -4])], "tokens", line=1, trajectory="a", contains=">= 0")


def test_token_beyond_vocab(tmp_path):
    expect(tmp_path, [rec(tokens=[1, 2, 70])], "tokens", line=1, trajectory="a", vocab_size=64,
           contains="--vocab-size 64")


def test_loss_mask_length_mismatch(tmp_path):
    expect(tmp_path, [rec(loss_mask=[0, 1])], "loss_mask", trajectory="a", contains="has 2 entries")


def test_loss_mask_values(tmp_path):
    expect(tmp_path, [rec(loss_mask=[0, 2, 1])], "loss_mask", trajectory="a", contains="0 or 1")


def test_old_logprobs_length_mismatch(tmp_path):
    expect(tmp_path, [rec(old_logprobs=[0.0, -1.0, -2.0, -3.0])], "old_logprobs", trajectory="a",
           contains="has 4 entries")


def test_old_logprobs_missing_where_trained(tmp_path):
    expect(tmp_path, [rec(old_logprobs=[None, None, -1.0])], "old_logprobs", trajectory="a", contains="entry 1")


def test_per_token_advantage_length_mismatch(tmp_path):
    expect(tmp_path, [rec(advantage=[1.0])], "advantage", trajectory="a")


def test_duplicate_ids(tmp_path):
    expect(tmp_path, [rec(), rec(tokens=[4])], "id", line=2, trajectory="a", contains="duplicate")


def test_parent_does_not_exist(tmp_path):
    expect(tmp_path, [rec(), rec(id="b", parent={"id": "zz", "at": 1})], "parent", line=2, trajectory="b",
           contains="does not exist")


def test_parent_tokens_disagree(tmp_path):
    expect(tmp_path, [rec(), rec(id="b", tokens=[1, 9, 3], parent={"id": "a", "at": 2})], "parent", line=2,
           trajectory="b", contains="disagree")


def test_parent_cycle(tmp_path):
    expect(tmp_path, [rec(parent={"id": "b", "at": 1}), rec(id="b", parent={"id": "a", "at": 1})], "parent",
           contains="cycle")


def test_parent_self_cycle(tmp_path):
    expect(tmp_path, [rec(parent={"id": "a", "at": 1})], "parent", trajectory="a", contains="cycle")


def test_parent_at_out_of_range(tmp_path):
    expect(tmp_path, [rec(), rec(id="b", parent={"id": "a", "at": 9})], "parent", trajectory="b")


def test_empty_trajectory(tmp_path):
    expect(tmp_path, [rec(tokens=[])], "tokens", line=1, trajectory="a", contains="empty")


def test_malformed_parquet(tmp_path):
    p = tmp_path / "bad.parquet"
    p.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(TreeFormatError) as ei:
        read_trajectories([str(p)])
    assert ei.value.file == str(p) and "malformed Parquet" in str(ei.value)


def test_parquet_row_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "tokens": [[1, 2], [3, -1]]}), str(p))
    with pytest.raises(TreeFormatError) as ei:
        read_trajectories([str(p)])
    assert ei.value.line == 2 and ei.value.trajectory == "b" and ei.value.field == "tokens"


def test_gzip_jsonl_is_read(tmp_path):
    p = tmp_path / "t.jsonl.gz"
    with gzip.open(p, "wt") as fh:
        fh.write(rec() + "\n")
    assert read_trajectories([str(p)])[0].tokens.tolist() == [1, 2, 3]


def test_unknown_fields_warn_once(tmp_path):
    path = write_lines(tmp_path, [rec(foo=1), rec(id="b", bar=2, foo=3)])
    with pytest.warns(UserWarning, match="bar, foo") as rec_w:
        read_trajectories([path])
    assert len(rec_w) == 1


def _dataset(tmp_path):
    trajs = [make_trajectory({"id": i, "tokens": [1, 2, i + 3], "old_logprobs": [0.0, -1.0, -2.0]})
             for i in range(4)] + [make_trajectory({"id": "z", "tokens": [7, 7]})]
    prefix = str(tmp_path / "ds")
    write_dataset(build_forest(trajs), prefix)
    return prefix


def test_truncated_dataset(tmp_path):
    prefix = _dataset(tmp_path)
    with open(prefix + ".bin", "r+b") as fh:
        fh.truncate(os.path.getsize(prefix + ".bin") - 8)
    with pytest.raises(TreeFormatError) as ei:
        TreeDataset(prefix)
    assert ei.value.file == prefix + ".bin" and "truncated" in str(ei.value)


def test_corrupt_dataset_bin(tmp_path):
    prefix = _dataset(tmp_path)
    ds = TreeDataset(prefix)
    tok_off = ds.header["bin"]["tokens"][0]
    del ds
    with open(prefix + ".bin", "r+b") as fh:
        fh.seek(tok_off)
        fh.write(b"\xff")
    ds = TreeDataset(prefix)
    with pytest.raises(TreeFormatError) as ei:
        ds[0]
    assert ei.value.field == "checksum" and "tree 0" in str(ei.value) and ei.value.file == prefix + ".bin"
    ds[1]  # other trees stay readable


def test_corrupt_dataset_idx(tmp_path):
    prefix = _dataset(tmp_path)
    data = bytearray(open(prefix + ".idx", "rb").read())
    data[len(data) // 2] ^= 0x55
    open(prefix + ".idx", "wb").write(bytes(data))
    with pytest.raises(TreeFormatError) as ei:
        TreeDataset(prefix)
    assert ei.value.field == "checksum" and ei.value.file == prefix + ".idx"


def test_truncated_idx(tmp_path):
    prefix = _dataset(tmp_path)
    data = open(prefix + ".idx", "rb").read()
    open(prefix + ".idx", "wb").write(data[: len(data) - 40])
    with pytest.raises(TreeFormatError):
        TreeDataset(prefix)


def test_make_trajectory_rejects_loss_on_first_token():
    with pytest.raises(TreeFormatError) as ei:
        make_trajectory({"id": "x", "tokens": [1, 2], "loss_mask": [1, 1]})
    assert ei.value.field == "loss_mask"


def test_numpy_inputs_accepted():
    t = make_trajectory({"id": "x", "tokens": np.array([3, 4], dtype=np.int32)})
    assert t.tokens.dtype == np.int64
