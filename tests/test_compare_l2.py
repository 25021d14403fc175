"""benchmarks/compare_l2.py on its quick set against the reference plans it ships with (the commands of
docs/microbatch_planner.md, section L2): a row per instance, every plan valid (the benchmark validates it)
and no longer, in modelled step and tokens, than L1's; the comparison's summary over every instance, the
search no worse than the reference on nine in ten.  No wall-clock time is asserted."""
import json
import os
import re

from tool_runner import ROOT, load_tool

REFERENCE = os.path.join(ROOT, "benchmarks", "results", "l2-staged-reference.json")


def test_quick_set_against_the_reference(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))  # compare_l2 reads bench_planner's batches
    cl = load_tool("compare_l2", "benchmarks")
    rows = cl.measure(True)
    assert len(rows) == 10 * 4 * 2                  # 4 benchmark batches and 6 random forests, DP 1-8, windows on/off
    for r in rows:
        assert r["step"] <= r["l1_step"] * (1 + 1e-12) and r["tokens"] <= r["l1_tokens"], r
    path = tmp_path / "l2.json"
    path.write_text(json.dumps(rows))
    capsys.readouterr()
    cl.compare(REFERENCE, str(path))
    out = capsys.readouterr().out
    m = re.search(r"instances (\d+); no worse: (\d+)", out)
    assert m is not None, out
    n, no_worse = int(m[1]), int(m[2])
    assert n == len(rows)                           # the quick set's instances all in the reference
    assert no_worse >= 0.9 * n
