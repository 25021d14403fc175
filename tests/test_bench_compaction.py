"""benchmarks/bench_compaction.py at tiny sizes: every mode's record, the row identities of both
forms, visible pairs, the same first loss in tree and expanded mode, a refused windows mode
recorded; bad flags refused in one line.

The smoke run trains one Step-wise set under sliding-window compaction (events in every trace,
re-prefilled samples, sharing between steps) with the tiny model on the CPU (CUDA where visible:
the benchmark measures where the driver trains).  No wall-clock time is asserted.
"""
import json
import math
import re

import pytest
import torch

from tool_runner import assert_one_error, load_tool, run_tool

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = ["--device", DEVICE, "--preset", "tiny", "--max-tokens", "600", "--prompt-median", "80",
        "--action-median", "15", "--observation-median", "30", "--keep-prefix", "16", "--keep-last", "32",
        "--summary-tokens", "16", "--kda-backend", "reference", "--attention-backend", "reference"]
MODES = ("reprefill_expanded", "reprefill_tree_within", "kv_expanded", "kv_tree_within", "kv_tree_windows")
FIELDS = ("step_seconds", "trajectory_tokens_per_s", "rows_computed", "visible_pairs", "peak_memory_gib",
          "predicted_peak_gib", "piece_memory_gib", "loss_first_step", "loss_after_one_step")


@pytest.fixture(scope="module")
def bc():
    return load_tool("bench_compaction", "benchmarks")


@pytest.fixture(scope="module")
def smoke(bc, tmp_path_factory):
    out = tmp_path_factory.mktemp("compaction") / "c.json"
    bc.main(TINY + ["--schemes", "step-wise", "--strategies", "sliding-window", "--budgets", "160",
                    "--microbatch-tokens", "2048", "--out", str(out)])
    return json.loads(out.read_text())


def test_every_mode_has_every_field(smoke):
    (name, row), = smoke["sets"].items()
    assert name == "step-wise/sliding-window/160" and row["evict_chunk"] == 40
    assert tuple(row["modes"]) == MODES
    for key in MODES:
        m = row["modes"][key]
        assert set(FIELDS) <= set(m), key
        assert (m["peak_memory_gib"] is None) == (DEVICE == "cpu") == (m["alloc_retries"] is None)
        assert math.isfinite(m["loss_first_step"]) and math.isfinite(m["loss_after_one_step"])
        # one numerator for both forms: the traces' tokens
        assert m["trajectory_tokens_per_s"] == pytest.approx(row["trace_tokens"] / m["step_seconds"])
    d = row["derived"]
    for key in ("kv_within_over_kv_expanded", "kv_within_over_reprefill_tree", "kv_within_over_reprefill_expanded",
                "kv_windows_over_kv_expanded", "kv_windows_over_reprefill_tree"):
        assert all(v is None or v > 0 for v in d[key].values()), key
    assert d["kv_within_over_kv_expanded"]["compression"] > 1
    assert (d["kv_within_over_kv_expanded"]["peak_memory_ratio"] is None) == (DEVICE == "cpu")


def test_rows_of_both_forms_and_visible_pairs(smoke):
    (row,) = smoke["sets"].values()
    N, extra, modes = row["trace_tokens"], row["reprefilled_tokens"], row["modes"]
    kv, rp = row["forms"]["kv"], row["forms"]["reprefill"]
    assert N == kv["expanded_tokens"] and kv["compaction_events"] > 0 and extra > 0
    assert modes["kv_expanded"]["rows_computed"] == N                        # exactly the trace tokens
    assert modes["reprefill_expanded"]["rows_computed"] == N + extra == rp["expanded_tokens"]
    assert modes["kv_tree_within"]["rows_computed"] == kv["unique_tokens"] < N     # one microbatch holds the tree
    assert row["derived"]["rows_check"]["ok"]
    for form in ("kv", "reprefill"):
        tree, exp = modes[f"{form}_tree_within"], modes[f"{form}_expanded"]
        assert tree["visible_pairs"] <= exp["visible_pairs"]
        assert exp["visible_pairs"] == row["forms"][form]["visible_pairs_expanded"]
        # tree mode computes the same step: the loss at the initial weights is expanded mode's
        assert tree["loss_first_step"] == pytest.approx(exp["loss_first_step"], rel=1e-5)
    assert modes["kv_tree_within"]["visible_pairs"] == kv["visible_pairs_tree"] < kv["visible_pairs_expanded"]
    windows = modes["kv_tree_windows"]
    assert windows["rows_computed"] <= modes["kv_tree_within"]["rows_computed"]
    assert windows["visible_pairs"] <= modes["kv_expanded"]["visible_pairs"]
    assert windows["loss_first_step"] == pytest.approx(modes["kv_expanded"]["loss_first_step"], rel=1e-5)


def test_windows_refused_by_the_driver_is_recorded(bc, tmp_path, monkeypatch):
    """A driver that refuses the traces in sharing windows (PlanningError): that mode is recorded
    as not run, with the driver's reason, and every other mode runs."""
    from megatron_harts.planner.microbatch import PlanningError
    from megatron_harts.training.trainer import Trainer
    plan = Trainer._plan

    def refusing(self, forest):
        if self.settings.sharing == "windows":
            raise PlanningError("no windows here")
        return plan(self, forest)
    monkeypatch.setattr(Trainer, "_plan", refusing)
    out = tmp_path / "c.json"
    bc.main(TINY + ["--schemes", "tree-step", "--strategies", "summary", "--budgets", "160", "--max-tokens", "300",
                    "--tree-sharing", "windows", "--out", str(out)])
    (row,) = json.loads(out.read_text())["sets"].values()
    assert list(row["modes"]) == ["reprefill_expanded", "reprefill_tree_within", "kv_expanded", "kv_tree_windows"]
    assert row["modes"]["kv_tree_windows"] == {
        "skipped": "the driver refuses this data with --tree-sharing windows: no windows here"}
    assert row["derived"]["rows_check"]["ok"] and "kv_windows_over_kv_expanded" not in row["derived"]


def test_plan_only_records_a_windows_refusal(bc, tmp_path, monkeypatch, capsys):
    """--plan-only where the driver's planner refuses the traces in sharing windows: that mode is recorded
    as not planned, with the reason, and the others are planned."""
    import megatron_harts.training.step as step
    from megatron_harts.planner.microbatch import PlanningError
    plan = step.plan_step

    def refusing(forest, settings, dp):
        if settings.sharing == "windows":
            raise PlanningError("no windows here")
        return plan(forest, settings, dp)
    monkeypatch.setattr(step, "plan_step", refusing)
    out = tmp_path / "c.json"
    code, stdout, err = run_tool(bc, capsys, *TINY, "--schemes", "tree-step", "--strategies", "summary", "--budgets",
                                 "160", "--max-tokens", "300", "--tree-sharing", "within", "windows", "--plan-only",
                                 "--out", out)
    assert code in (0, None), err
    (row,) = json.loads(out.read_text())["sets"].values()
    assert row["plans"]["kv_tree_windows"] == {
        "skipped": "the driver refuses this data with --tree-sharing windows: no windows here"}
    assert all(row["plans"][k]["rows"] > 0 for k in ("reprefill_expanded", "kv_expanded", "kv_tree_within"))
    assert "kv_tree_windows           not planned" in stdout


def test_bad_flags_are_one_error_line(bc, capsys, tmp_path):
    code, out, err = run_tool(bc, capsys, "--no-such-flag")
    assert_one_error(code, err, "--no-such-flag")
    for argv, needles in (
            (["--budgets", "1"], ["--budgets", "1"]),
            (["--iters", "0"], ["--iters"]),
            (["--strategies", "lru"], ["--strategies", "lru"]),
            (["--out", str(tmp_path / "no_dir" / "c.json")], ["--out", "no_dir"]),
            (["--budgets", "64", "--keep-prefix", "60"], ["--budgets 64", "--keep-prefix (60)", "--evict-chunk (16)"]),
            (["--budgets", "256", "--microbatch-tokens", "0"], ["--microbatch-tokens", ">= 1"]),
            (["--budgets", "256", "--memory-profile", "--piece-study"], ["--memory-profile", "GPU"])):
        code, out, err = run_tool(bc, capsys, *TINY, *argv, "--out", str(tmp_path / "c.json")) \
            if "--out" not in argv else run_tool(bc, capsys, *TINY, *argv)
        assert_one_error(code, err, *needles)
        assert out == "" and list(tmp_path.iterdir()) == []


def test_profile_and_forms_kv(bc, tmp_path):
    out, prof = tmp_path / "c.json", tmp_path / "profile.txt"
    bc.main(TINY + ["--schemes", "tree-step", "--strategies", "summary", "--budgets", "160", "--tree-sharing",
                    "within", "--forms", "kv", "--microbatch-tokens", "2048", "--warmup", "0", "--out", str(out),
                    "--profile", str(prof)])
    (row,) = json.loads(out.read_text())["sets"].values()
    text = prof.read_text()
    assert list(row["modes"]) == ["kv_expanded", "kv_tree_within"]      # --forms kv, --tree-sharing within
    for key in row["modes"]:
        p = row["modes"][key]["profile"]
        assert p["wall_seconds"] > 0 and p["kernel_seconds"] >= 0, key
        assert f"===== tree-step/summary/160 {key}: wall" in text
    d = row["derived"]
    assert "kernel_speedup" in d["kv_within_over_kv_expanded"] and "kv_within_over_reprefill_tree" not in d
    assert d["rows_check"]["ok"] and d["rows_check"]["reprefill_expanded_rows"] is None


def test_traces_longer_than_the_row_budget_train_in_pieces(bc, tmp_path):
    """A row budget below the longest trace: every mode trains (the traces in pieces, the re-prefill
    samples packed), the row identities hold and no microbatch passes the budget."""
    out = tmp_path / "c.json"
    bc.main(TINY + ["--schemes", "tree-step", "--strategies", "sliding-window", "--budgets", "160",
                    "--microbatch-tokens", "256", "--warmup", "0", "--out", str(out)])
    res = json.loads(out.read_text())
    (row,) = res["sets"].values()
    assert row["forms"]["kv"]["max_trajectory_tokens"] > 256
    assert row["derived"]["rows_check"]["ok"]
    for key, m in row["modes"].items():
        assert m["largest_microbatch_rows"] <= 256, key
    first = {m["loss_first_step"] for m in row["modes"].values() if m["form"] == "kv"}
    assert max(first) - min(first) < 1e-4


def documented_long_commands():
    """docs/benchmarks.md's long-mixed commands as argv lists (``python benchmarks/bench_compaction.py``
    dropped): the CPU one (``--scale``) and the GPU ones."""
    import os
    import re
    import shlex
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(root, "docs", "benchmarks.md")).read()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for cmd in re.sub(r"\\\n", " ", block).splitlines():
            if "--set long-mixed" in cmd:
                argv = shlex.split(cmd, comments=True)
                assert argv[:2] == ["python", "benchmarks/bench_compaction.py"], cmd
                out.append(argv[2:])
    return out


#: the long mixed set scaled down to CPU size as docs/benchmarks.md runs it: 2 groups (sliding-window,
#: summary) of 2 traces forking at random turns, the KV-streams modes, the tiny model
(LONG,) = [c for c in documented_long_commands() if "cpu" in c]
LONG = LONG[:LONG.index("--out")] + LONG[LONG.index("--out") + 2:]


def test_long_mixed_set_end_to_end(bc, tmp_path, capsys):
    """--set long-mixed, scaled down, KV-streams expanded and tree: the set holds what it promises
    (strategies mixed over its groups, forks after compaction events, the longest trace above the row
    budget, so traces train in pieces), every mode's figures and its profiled step's split, --json's
    stdout the results alone."""
    out = tmp_path / "c.json"
    code, stdout, err = run_tool(bc, capsys, *LONG, "--device", DEVICE, "--out", out, "--json")
    assert code in (0, None), err
    res = json.loads(stdout)
    assert res == json.loads(out.read_text())
    (name, row), = res["sets"].items()
    assert name == "long-mixed/20" and row["budget"] == 20 and row["evict_chunk"] == 10
    assert row["strategies"] == {"sliding-window": 1, "summary": 1}
    assert row["groups"] == {"task0": 2, "task1": 2} and row["forks"] == 2
    assert row["forks_after_events"] >= 1
    assert row["microbatch_tokens"] == 82 < row["longest_trace_tokens"]
    kv = row["forms"]["kv"]
    assert kv["compaction_events"] > 0 and kv["num_trajectories"] == 4
    assert row["reprefilled_tokens"] > 0 and row["trace_tokens"] == kv["expanded_tokens"]
    assert list(row["modes"]) == ["kv_expanded", "kv_tree_within"]
    for key, m in row["modes"].items():
        assert set(FIELDS) <= set(m), key
        assert m["largest_microbatch_rows"] <= 82 and m["piece_microbatches"] > 0, key
        # on the CPU the pieces' default memory keeps no read piece's graph: they run their forward again
        assert m["read_pieces"] > m["kept_pieces"] >= 0 and m["piece_extra_forward_rows"] > 0, key
        s = m["split"]
        assert set(s["seconds"]) == {"attention_forward", "attention_backward", "kda", "gemm",
                                     "pieces_extra_forward", "other", "host"}
        device = sum(v for b, v in s["seconds"].items() if b != "host")
        assert s["device_seconds"] == pytest.approx(device) and 0 < s["busy_seconds"] <= s["wall_seconds"]
        assert s["seconds"]["host"] == pytest.approx(s["wall_seconds"] - s["busy_seconds"])
        for bucket in ("attention_forward", "attention_backward", "kda", "gemm", "pieces_extra_forward"):
            assert s["seconds"][bucket] > 0, (key, bucket)
    assert row["modes"]["kv_tree_within"]["rows_computed"] < row["modes"]["kv_expanded"]["rows_computed"]
    assert row["derived"]["rows_check"]["ok"]
    assert "attn fwd" in err and "kv_tree_within" in err and "2 forks" in err      # the tables, on stderr


def test_documented_gpu_commands_parse(bc, tmp_path):
    """The GPU commands of docs/benchmarks.md parse (on this machine's device) into the long set at the
    budget each names, the four modes, the split on, the 32k row budget."""
    gpu = [c for c in documented_long_commands() if "--scale" not in c and "--plan-only" not in c]
    assert sorted(c[c.index("--budgets") + 1] for c in gpu) == ["4096", "8192"]
    for argv in gpu:
        argv[argv.index("--out") + 1] = str(tmp_path / "c.json")
        a = bc.parse(argv + ["--device", "cpu"])
        assert a.set == "long-mixed" and a.split and a.microbatch_tokens == 32768 and a.tree_sharing == ["within"]
        assert a.forms == ["reprefill", "kv"] and (a.num_tasks, a.samples_per_task, a.max_tokens) == (6, 4, 74000)


def test_documented_half_size_commands_parse(bc, tmp_path):
    """docs/benchmarks.md's half-size GPU commands (the piece study, the interval kernels): the long set
    at budget 8192 (4096 scaled), row budget 16,384 scaled from 32,768, no split."""
    (argv,) = [c for c in documented_long_commands() if "--piece-study" in c]
    argv[argv.index("--out") + 1] = str(tmp_path / "c.json")
    argv[argv.index("--profile") + 1] = str(tmp_path / "profile.txt")
    a = bc.parse(argv + ["--device", "cpu"])
    assert a.profile and a.piece_study and not a.split and a.scale == 0.5 and a.budgets == [4096] and a.microbatch_tokens == 16384
    (argv,) = [c for c in documented_long_commands() if "interval" in c]
    argv[argv.index("--out") + 1] = str(tmp_path / "c.json")
    a = bc.parse(argv + ["--device", "cpu"])
    assert a.attention_backend == "interval" and a.forms == ["reprefill", "kv"] and a.budgets == [4096]
    assert a.microbatch_tokens == 16384 and not a.split


def test_full_size_long_set_holds_what_docs_say(bc, tmp_path):
    """The set at full size (synthesized only, no training): 24 traces of up to ~74k tokens in 6
    groups, two of each strategy, forks after events, the longest trace above the row budget, and
    docs/benchmarks.md's figures at both budgets."""
    a = bc.parse(["--device", "cpu", "--set", "long-mixed", "--out", str(tmp_path / "c.json")])
    documented = {8192: (1310172, 883670, 213, 154, 18, 15, 1778396, 1177388),
                  4096: (1096697, 696126, 412, 267, 18, 18, 1638393, 961358)}
    assert a.budgets == [4096, 8192]
    for budget in a.budgets:
        s = bc.build_long_set(a, budget)
        kv, rp = s["forests"]["kv"], s["forests"]["reprefill"]
        assert kv.num_trajectories == 24 and s["groups"] == {f"task{g}": 4 for g in range(6)}
        assert sorted(s["group_strategies"].values()) == sorted(["sliding-window", "markovian", "summary"] * 2)
        assert 64000 < int(kv.traj_length.max()) <= 74000 and int(kv.traj_length.max()) > a.microbatch_tokens
        st = kv.stats()
        assert (s["N"], kv.num_rows, st["compaction_events"], st["compaction_events_tree"], s["forks"],
                s["forks_after_events"], s["N"] + s["reprefilled"], rp.num_rows) == documented[budget]


def test_long_mixed_refuses_grid_flags(bc, capsys, tmp_path):
    for argv, needle in ((["--schemes", "step-wise"], "--schemes"), (["--branch-prob", "0.5"], "--branch-prob"),
                         (["--scale", "0"], "--scale")):
        code, out, err = run_tool(bc, capsys, *LONG, "--device", DEVICE, *argv, "--out", str(tmp_path / "c.json"))
        assert_one_error(code, err, needle)
        assert out == "" and list(tmp_path.iterdir()) == []


def test_piece_study(bc, tmp_path, capsys):
    """--piece-study on the CPU-sized long set: the traces in tree mode at the row budget keeping the
    read pieces' graphs where the memory allows (here all: no extra forward), recomputing them (an
    extra forward), and uncut above the longest trace (no pieces); the same first loss in all three;
    the ratios over the uncut step."""
    out = tmp_path / "c.json"
    code, stdout, err = run_tool(bc, capsys, *LONG, "--device", DEVICE, "--piece-study", "--no-split",
                                 "--warmup", "0", "--driver-flags", "--tree-piece-memory 64", "--out", out)
    assert code in (0, None), err
    (row,) = json.loads(out.read_text())["sets"].values()
    assert row["modes"] == {}
    st = row["piece_study"]
    longest = row["longest_trace_tokens"]
    assert st["row_budget"] == 82 < longest and st["uncut_row_budget"] == 4096 * math.ceil((longest + 1) / 4096)
    assert st["auto"]["read_pieces"] == st["auto"]["kept_pieces"] > 0 and st["auto"]["piece_extra_forward_rows"] == 0
    assert st["none"]["read_pieces"] > st["none"]["kept_pieces"] == 0 and st["none"]["piece_extra_forward_rows"] > 0
    assert st["uncut"]["piece_microbatches"] == 0 and st["uncut"]["largest_microbatch_rows"] >= longest
    first = [st[k]["loss_first_step"] for k in ("auto", "none", "uncut")]
    assert max(first) - min(first) < 1e-4
    for k in ("auto", "none"):
        assert st[f"{k}_over_uncut"] == pytest.approx(st[k]["step_seconds"] / st["uncut"]["step_seconds"])
    assert "keeping graphs" in stdout and "uncut at" in stdout
    for argv, needle in ((["--piece-study-above", "100"], "--piece-study-above"),
                         (["--piece-study", "--piece-study-above", "100"], "below the longest trace"),
                         (["--piece-study", "--microbatch-tokens", "100000"], "fits the row budget"),
                         (["--piece-study", "--driver-flags", "--tree-piece-keep none"], "--tree-piece-keep")):
        bad = tmp_path / "bad.json"
        code, o, e = run_tool(bc, capsys, *LONG, "--device", DEVICE, *argv, "--out", bad)
        assert_one_error(code, e, needle)
        assert o == "" and not bad.exists()


def _out_of_memory_in(bc, monkeypatch, needle: str) -> None:
    """``bc.measure`` raising CUDA's out-of-memory error for the run whose title holds ``needle``."""
    real = bc.measure

    def measure(argv, forest, n, a, title):
        if needle in title:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 506.00 MiB.\nmore detail")
        return real(argv, forest, n, a, title)
    monkeypatch.setattr(bc, "measure", measure)


def test_a_mode_out_of_memory_is_a_row_not_the_end(bc, tmp_path, capsys, monkeypatch):
    """A mode that runs out of GPU memory is recorded as not run, with the error's first line and the
    knobs that keep less; the other modes still run; ratios that need it are left out and the rows
    check says it could not check."""
    _out_of_memory_in(bc, monkeypatch, "kv_expanded")
    out = tmp_path / "c.json"
    code, stdout, err = run_tool(bc, capsys, *TINY, "--schemes", "step-wise", "--strategies", "sliding-window",
                                 "--budgets", "160", "--microbatch-tokens", "2048", "--forms", "kv",
                                 "--tree-sharing", "within", "--warmup", "0", "--out", out)
    assert code in (0, None), err
    (row,) = json.loads(out.read_text())["sets"].values()
    skipped = row["modes"]["kv_expanded"]["skipped"]
    assert skipped.startswith("out of GPU memory: CUDA out of memory. Tried to allocate 506.00 MiB.")
    assert "more detail" not in skipped and "--tree-piece-memory" in skipped
    assert row["modes"]["kv_tree_within"]["step_seconds"] > 0
    assert row["derived"] == {"rows_check": {"N": row["trace_tokens"], "reprefilled_tokens": row["reprefilled_tokens"],
                                             "kv_expanded_rows": None, "reprefill_expanded_rows": None, "ok": None}}
    assert re.search(r"^kv_expanded +not run$", stdout, re.M) and "not checked" in stdout


def test_piece_study_run_out_of_memory(bc, tmp_path, capsys, monkeypatch):
    """--piece-study whose uncut run does not fit the GPU: the two piece runs are measured, the uncut run
    is recorded as not run, and no ratio over it is made up."""
    _out_of_memory_in(bc, monkeypatch, "piece study uncut")
    out = tmp_path / "c.json"
    code, stdout, err = run_tool(bc, capsys, *LONG, "--device", DEVICE, "--piece-study", "--no-split",
                                 "--warmup", "0", "--driver-flags", "--tree-piece-memory 64", "--out", out)
    assert code in (0, None), err
    st = json.loads(out.read_text())["sets"]
    (row,) = st.values()
    st = row["piece_study"]
    assert st["uncut"]["skipped"].startswith("out of GPU memory: CUDA out of memory.")
    assert st["auto"]["step_seconds"] > 0 and st["none"]["step_seconds"] > 0
    assert "auto_over_uncut" not in st and "none_over_uncut" not in st
    assert "uncut at" in stdout and "not run (out of GPU memory)" in stdout


def test_plan_only_is_what_the_run_decides(bc, tmp_path, capsys):
    """--plan-only plans each mode and makes the schedule's memory choice without training, the way the
    driver does it: on the CPU-sized long set with a pieces' budget that keeps some read pieces only in
    part, its read / kept / partly kept pieces and the rows whose forward runs again are the trained
    run's; the rows are the trained rows; it writes a table and no step figures.  --device-memory-gib
    sizes a GPU run (its bf16 model, its memory) on a machine without one."""
    flags = ["--device", "cpu", "--driver-flags", "--tree-piece-memory 0.001", "--tree-sharing", "within"]
    planned, trained = tmp_path / "p.json", tmp_path / "t.json"
    code, stdout, err = run_tool(bc, capsys, *LONG, *flags, "--plan-only", "--out", planned)
    assert code in (0, None), err
    assert "(planned, not trained)" in stdout
    code, _, err = run_tool(bc, capsys, *LONG, *flags, "--no-split", "--iters", "1", "--out", trained)
    assert code in (0, None), err
    (p_row,) = json.loads(planned.read_text())["sets"].values()
    (t_row,) = json.loads(trained.read_text())["sets"].values()
    assert p_row["modes"] == {} and set(p_row["plans"]) == {"kv_expanded", "kv_tree_within"}
    partly = 0
    for key, plan in p_row["plans"].items():
        run = t_row["modes"][key]
        for field in ("read_pieces", "kept_pieces", "partly_kept_pieces", "piece_extra_forward_rows"):
            assert plan[field] == run[field], (key, field, plan[field], run[field])
        assert plan["rows"] == run["rows_computed"] and plan["piece_memory_gib"] == pytest.approx(0.001)
        partly += plan["partly_kept_pieces"]
    assert partly > 0 and p_row["plans"]["kv_expanded"]["read_pieces"] > 0
    gpu = tmp_path / "g.json"
    code, _, err = run_tool(bc, capsys, *LONG, "--device", "cuda", "--preset", "h200", "--plan-only",
                            "--device-memory-gib", "80", "--out", gpu)
    assert code in (0, None), err
    (g_row,) = json.loads(gpu.read_text())["sets"].values()
    state = g_row["plans"]["kv_expanded"]["state_gib"]
    assert g_row["plans"]["kv_tree_within"]["piece_memory_gib"] == pytest.approx(0.85 * 80 - state, rel=1e-6)
    for argv, needle in ((["--device-memory-gib", "80"], "--device-memory-gib"),
                         (["--plan-only", "--piece-study"], "--plan-only and --piece-study"),
                         (["--device", "cpu", "--plan-only", "--device-memory-gib", "80"], "--device-memory-gib"),
                         (["--device", "cuda", "--plan-only", "--device-memory-gib", "-1"], "--device-memory-gib")):
        bad = tmp_path / "bad.json"
        code, o, e = run_tool(bc, capsys, *LONG, *argv, "--out", bad)
        assert_one_error(code, e, needle)
        assert o == "" and not bad.exists()


def test_documented_plan_only_commands(bc, tmp_path, capsys):
    """docs/benchmarks.md's --plan-only commands run as written (the full-size set, no GPU needed) and
    give its table: per mode the read / kept / partly kept pieces, the rows run forward again and the
    predicted peak, for an H100's and an H200's memory."""
    import os
    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                             "benchmarks.md")).read()
    table = text[text.index("| mode | pieces: read / kept / in part, H100"):]
    table = table[:table.index("\n\n")]
    doc = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        doc[cells[0]] = cells[1:]
    names = {"reprefill_expanded": "re-prefill, expanded", "reprefill_tree_within": "re-prefill, tree",
             "kv_expanded": "KV-streams, expanded", "kv_tree_within": "KV-streams, tree (within)"}
    commands = [c for c in documented_long_commands() if "--plan-only" in c]
    assert len(commands) == 2
    got = []
    for argv in commands:
        argv[argv.index("--out") + 1] = str(tmp_path / "plan.json")
        code, _, err = run_tool(bc, capsys, *argv)
        assert code in (0, None), err
        (row,) = json.loads((tmp_path / "plan.json").read_text())["sets"].values()
        got.append(row["plans"])
    for key, name in names.items():
        h100, h200 = got[0][key], got[1][key]
        pieces = lambda m: "-" if not m["read_pieces"] else \
            f"{m['read_pieces']} / {m['kept_pieces']} / {m['partly_kept_pieces']}"
        assert doc[name][:4] == [pieces(h100), f"{h100['piece_extra_forward_rows']:,}", pieces(h200),
                                 f"{h200['piece_extra_forward_rows']:,}"], name
        assert doc[name][4] == f"{h100['predicted_peak_gib']:.1f} / {h200['predicted_peak_gib']:.1f} GiB", name


def test_memory_profile_rows_in_the_table(bc):
    """A mode's --memory-profile record (the GPU's allocator history) is summed up under the table: its
    peak above the step's start and its six largest allocation sites, largest first as recorded."""
    mode = {"rows_computed": 10, "visible_pairs": 55, "piece_microbatches": 0, "step_seconds": 1.0,
            "peak_memory_gib": 2.0, "predicted_peak_gib": 1.9,
            "memory_profile": {"peak_bytes": 3 * 2**30, "allocated_at_start_bytes": 2**30,
                               "sites": {f"site{i}.py:1 (f)": (8 - i) * 2**28 for i in range(8)}}}
    table = bc.mode_table({"modes": {"kv_expanded": mode, "kv_tree_within": {"skipped": "out of memory"}}})
    lines = table.splitlines()
    at = lines.index("alive at the profiled step's peak, by allocation site")
    assert lines[at + 1] == "kv_expanded: 3.00 GiB above the step's start (1.00 GiB)"
    assert [ln.split()[-2] for ln in lines[at + 2:]] == [f"site{i}.py:1" for i in range(6)]
    assert lines[at + 2].split()[0] == "2.000"


def test_documented_long_set_table_is_the_recorded_run():
    """docs/benchmarks.md's long-set tables and README's long row are the figures of the recorded run
    (benchmarks/results/compaction-long-h100-split/: the re-prefill modes, then the KV-streams modes, on
    one node): rows, step seconds, peaks and the predicted peaks per mode, the device time by what runs,
    and the README's three ratios."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    modes = {}
    for part in ("reprefill", "kv"):
        run = json.loads((root / f"benchmarks/results/compaction-long-h100-split/long-8192-{part}.json").read_text())
        modes.update(run["sets"]["long-mixed/8192"]["modes"])
    docs = (root / "docs/benchmarks.md").read_text()
    names = {"reprefill_expanded": "re-prefill, expanded", "reprefill_tree_within": "re-prefill, tree",
             "kv_expanded": "KV-streams, expanded", "kv_tree_within": "KV-streams, tree (within)"}
    for key, label in names.items():
        m = modes[key]
        (line,) = [ln for ln in docs.splitlines() if ln.startswith(f"| {label} | {m['rows_computed']:,} |")]
        assert f"| {m['step_seconds']:.2f} s | {m['peak_memory_gib']:.1f} GiB ({m['predicted_peak_gib']:.1f}) |" \
            in line, line
        sec = m["split"]["seconds"]
        cols = [sec[k] for k in ("attention_forward", "attention_backward", "kda", "gemm", "pieces_extra_forward",
                                 "other")] + [m["split"]["busy_seconds"]]
        idle = m["step_seconds"] - m["split"]["busy_seconds"]
        cells = " | ".join("0" if c == 0 else f"{c:.2f}" for c in cols)
        (split_line,) = [ln for ln in docs.splitlines() if ln.startswith(f"| {label} | {cells} |")]
        assert split_line.endswith(f"| {idle:.2f} s ({idle / m['step_seconds']:.0%}) |"), split_line
    readme = (root / "README.md").read_text()
    (row,) = [ln for ln in readme.splitlines() if ln.startswith("| long mixed:")]
    t = {k: modes[k]["step_seconds"] for k in names}
    ratios = [t["kv_expanded"] / t["kv_tree_within"], t["reprefill_expanded"] / t["kv_tree_within"],
              t["reprefill_tree_within"] / t["kv_tree_within"]]
    assert row.endswith(" | ".join(f"{r:.2f}x" for r in ratios) + " |"), row
