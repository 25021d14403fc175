"""Typed flag groups (megatron_harts.flags) and the Megatron-LM flag table (megatron_harts.megatron_lm):
the driver's options are generated from the groups, parsed values go back into them by field name,
each constraint lives in one place and ends as one ``error:`` line naming the flag."""
import argparse
import dataclasses
import shlex
from typing import Optional

import numpy as np
import pytest

from megatron_harts import megatron_lm
from megatron_harts.flags import (add_flag_group, check_group, flag, flag_fields, group_kwargs, set_namespace,
                                  shared_fields)
from megatron_harts.rl.objectives import ObjectiveConfig
from megatron_harts.training import arguments as A
from megatron_harts.training.rl_update import RLUpdateConfig
from megatron_harts.training.tree_flags import TreeFlags

from test_arguments import BASE, parse, refused

GROUPS = [cls for _, cls, _ in A.FLAG_GROUPS]


@dataclasses.dataclass(frozen=True)
class _Demo:
    count: int = flag(2, "--demo-count", "how many (default 2)", minimum=1)
    ratio: float = flag(0.5, "--demo-ratio", "a ratio", minimum=0, exclusive_maximum=1)
    cap: Optional[float] = flag(None, "--demo-cap", "a cap", exclusive_minimum=0.0)
    mode: str = flag("a", "--demo-mode", "a or b", choices=("a", "b"))
    fast: bool = flag(False, "--demo-fast", "go fast")
    keep: bool = flag(True, "--no-demo-keep", "do not keep")
    both: bool = flag(True, "--demo-both", "on by default")
    note: str = "not a flag"

    def __post_init__(self):
        check_group(self)


def _actions(parser):
    return {o: a for a in parser._actions for o in a.option_strings}


@pytest.mark.parametrize("cls", GROUPS, ids=lambda c: c.__name__)
def test_every_group_field_is_an_option_of_the_driver(cls):
    parser = A.build_parser()
    actions = _actions(parser)
    help_text = parser.format_help()
    specs = list(flag_fields(cls))
    assert specs and len({s.name for s in specs}) == len(specs)
    for spec in specs:
        for option in spec.option_strings:
            assert option in actions and option in help_text and option in A.OWN_FLAGS, option
        action = actions[spec.name]
        assert action.dest == spec.dest and action.help.startswith(spec.help), spec.name
        assert action.default == spec.parser_default, spec.name
        assert tuple(action.choices) == spec.choices if spec.choices else action.choices is None, spec.name
        assert spec.name not in megatron_lm.MEGATRON_LM_FLAGS
    # the dataclass defaults are what the driver resolves when no flag is given
    args = parse()
    attr = next(a for _, c, a in A.FLAG_GROUPS if c is cls)
    got = getattr(args, attr)
    assert isinstance(got, cls)
    for spec in specs:
        if spec.field not in ("microbatch_tokens", "planner"):     # resolved from --seq-length / --tree-sharing
            assert getattr(got, spec.field) == spec.default, spec.field
        assert getattr(args, spec.dest) == getattr(got, spec.field), spec.dest


@pytest.mark.parametrize("cls, extra", [
    (TreeFlags, "--tree-sharing windows --tree-microbatch-tokens 96 --tree-chunk-size 32 --tree-pp-schedule overlap "
                "--tree-memory-budget 1.5 --tree-logprob-chunk-rows 7 --no-tree-dataset-shuffle"),
    (TreeFlags, "--tree-sharing off --tree-kda-backend reference --tree-attention-backend varlen"),
    (TreeFlags, "--no-tree-replay --tree-kda-call-plan node-wise --tree-triton-max-configs 3"),
    (ObjectiveConfig, "--clip-ratio-low 0.1 --clip-ratio-high 0.28 --kl-coef 0.01 --kl-to old --kl-estimator k2 "
                      "--entropy-coef 0.001 --loss-agg-mode seq-mean-token-sum-norm --rl-ratio-level sequence"),
    (ObjectiveConfig, "--rl-objective sft --loss-agg-mode seq-mean-token-mean"),
    (RLUpdateConfig, "--rl-mini-batches 4 --rl-epochs 2 --ref-placement offload"),
])
def test_group_kwargs_round_trips(cls, extra):
    args = parse(extra)
    attr = next(a for _, c, a in A.FLAG_GROUPS if c is cls)
    group = getattr(args, attr)
    assert cls(**group_kwargs(cls, args)) == group
    ns = argparse.Namespace()
    set_namespace(ns, group)
    assert set(vars(ns)) == {s.dest for s in flag_fields(cls)}
    assert cls(**group_kwargs(cls, ns)) == group
    assert group != cls() or not extra


def test_parsed_values_land_in_the_configs_by_field_name(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    from megatron_harts.models.config import ATTENTION_BACKENDS, HybridConfig
    from megatron_harts.training.step import SharingSettings
    from megatron_harts.training.tree_flags import ATTENTION_BACKEND_CHOICES
    assert ATTENTION_BACKEND_CHOICES == ("auto",) + ATTENTION_BACKENDS
    # exactly these tree fields configure the model and the step (a new field of the same name as a config
    # field would be copied too: it must be meant)
    tree = TreeFlags()
    assert set(shared_fields(tree, HybridConfig)) == {"kda_chunk_size", "kda_backend", "fused_kernels",
                                                     "kda_input_recompute", "tree_kda_call_plan",
                                                     "tree_attention_backend", "logprob_chunk_rows"}
    assert set(shared_fields(tree, SharingSettings)) == {"sharing", "microbatch_tokens", "planner", "replay",
                                                        "pp_schedule", "recompute_producers", "piece_keep"}
    args = parse("--tree-chunk-size 16 --tree-logprob-chunk-rows 9 --tree-kda-call-plan per-depth "
                 "--tree-attention-backend reference")
    cfg = A.hybrid_config(args, device="cpu")
    assert (cfg.kda_chunk_size, cfg.logprob_chunk_rows, cfg.tree_kda_call_plan, cfg.tree_attention_backend,
            cfg.kda_backend, cfg.tree_mode) == (16, 9, "per-depth", "reference", "reference", True)
    settings = SharingSettings(**shared_fields(args.tree, SharingSettings), piece_budget_bytes=1 << 30)
    assert settings.piece_keep == "auto"
    assert (settings.sharing, settings.planner, settings.microbatch_tokens, settings.replay) == \
        ("within", "l1", 128, True)
    assert ObjectiveConfig(**A.objective_kwargs(args)) == args.objective
    assert RLUpdateConfig(**A.rl_update_kwargs(args)) == args.rl_update


@pytest.mark.parametrize("extra, needles", [
    # bounds and choices from the declarations (argparse)
    ("--rl-epochs 0", ("--rl-epochs", ">= 1")),
    ("--clip-ratio-low 1", ("--clip-ratio-low", "< 1")),
    ("--entropy-coef -0.1", ("--entropy-coef", ">= 0")),
    ("--tree-memory-budget -1", ("--tree-memory-budget", ">= 0")),
    ("--tree-pp-schedule gpipe", ("--tree-pp-schedule", "gpipe")),
    # a group's own constraints (its __post_init__)
    ("--tree-memory-budget 0 --tree-sharing windows", ("--tree-memory-budget 0", "positive")),
    ("--tree-recompute-producers", ("--tree-recompute-producers", "--tree-sharing windows")),
    ("--tree-sharing windows --tree-kda-call-plan per-depth", ("--tree-kda-call-plan per-depth", "within")),
    ("--tree-logit-probe-oracle", ("--tree-logit-probe-oracle", "--tree-logit-probe DIR")),
    ("--rl-objective sft --rl-old-logprobs recompute", ("--rl-old-logprobs recompute", "--rl-objective ppo")),
    ("--loss-agg-mode seq-mean-token-sum-norm --rl-loss-norm-length 0", ("--rl-loss-norm-length",)),
    # constraints with other flags (the driver)
    ("--tree-sharing windows --tree-recompute-producers --pipeline-model-parallel-size 2",
     ("--tree-recompute-producers", "--pipeline-model-parallel-size 2")),
    ("--rl-objective sft --clip-ratio-high 0.3", ("--clip-ratio-high", "--rl-objective ppo")),
])
def test_a_violated_constraint_is_one_error_line_naming_the_flag(extra, needles, capsys):
    with pytest.raises(SystemExit) as ei:
        A.parse_args_or_exit(shlex.split(BASE + " " + extra))
    assert ei.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: harts-pretrain: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert "TreeFlags." not in lines[0] and "ObjectiveConfig." not in lines[0]


def test_programmatic_groups_get_the_same_checks():
    with pytest.raises(ValueError, match="--no-tree-replay needs tree sharing"):
        TreeFlags(sharing="off", replay=False)
    with pytest.raises(ValueError, match=r"--tree-planner l1 does not go with --tree-sharing windows"):
        TreeFlags(sharing="windows", planner="l1")
    with pytest.raises(ValueError, match=r"--tree-chunk-size must be >= 1, got 0 \(TreeFlags.kda_chunk_size\)"):
        TreeFlags(kda_chunk_size=0)
    assert TreeFlags(sharing="windows").planner == "l1l2" and TreeFlags(sharing="off").planner == "ffd"
    assert not TreeFlags(sharing="off").tree_mode and TreeFlags().tree_mode
    # numpy numbers are numbers; ints become floats in float fields
    cfg = ObjectiveConfig(kl_coef=np.float64(0.5), clip_ratio_low=np.int64(0))
    assert cfg.kl_coef == 0.5 and type(cfg.clip_ratio_low) is float
    with pytest.raises(ValueError, match="--kl-coef must be a number"):
        ObjectiveConfig(kl_coef="1")


def test_flag_declarations_generate_argparse_options():
    parser = argparse.ArgumentParser(prog="demo")
    add_flag_group(parser, _Demo)
    assert "--demo-keep" not in _actions(parser) and {"--no-demo-keep", "--demo-both", "--no-demo-both"} <= \
        set(_actions(parser))
    ns = parser.parse_args([])
    assert _Demo(**group_kwargs(_Demo, ns)) == _Demo()
    ns = parser.parse_args(["--demo-count", "3", "--demo-ratio", "0.25", "--demo-cap", "2", "--demo-mode", "b",
                            "--demo-fast", "--no-demo-keep", "--no-demo-both"])
    assert _Demo(**group_kwargs(_Demo, ns)) == _Demo(count=3, ratio=0.25, cap=2.0, mode="b", fast=True, keep=False,
                                                     both=False)
    assert [s.dest for s in flag_fields(_Demo)] == ["demo_count", "demo_ratio", "demo_cap", "demo_mode",
                                                    "demo_fast", "demo_keep", "demo_both"]
    text = parser.format_help()
    assert "--demo-count N" not in text and "--demo-count INT" in text and "(default 2)" in text
    assert "a ratio (default 0.5)" in text.replace("\n", " ").replace("  ", " ")
    for bad in (["--demo-count", "0"], ["--demo-ratio", "1"], ["--demo-cap", "0"], ["--demo-mode", "c"],
                ["--demo-ratio", "inf"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    for kw, msg in [({"count": 0}, "--demo-count must be >= 1, got 0 (_Demo.count)"),
                    ({"ratio": 1.0}, "--demo-ratio must be in [0, 1), got 1.0 (_Demo.ratio)"),
                    ({"cap": 0}, "--demo-cap must be > 0.0, got 0.0 (_Demo.cap)"),
                    ({"mode": "c"}, "--demo-mode must be one of a, b, got 'c' (_Demo.mode)"),
                    ({"fast": 1}, "--demo-fast must be true or false"),
                    ({"count": 2.5}, "--demo-count must be an integer"),
                    ({"mode": None}, "--demo-mode needs a value")]:
        with pytest.raises(ValueError) as ei:
            _Demo(**kw)
        assert msg in str(ei.value)


def test_megatron_lm_table_is_read_by_the_parser_and_the_model():
    from hybrid_tiny import tiny_config
    from megatron_harts.models.model import validate_config
    supported = A.supported_flags()
    # every setting names a Megatron-LM flag the parser accepts; config-checked ones name a HybridConfig field
    from megatron_harts.models.config import HybridConfig
    fields = {f.name for f in dataclasses.fields(HybridConfig)}
    for s in megatron_lm.SETTINGS:
        assert s.flag in megatron_lm.MEGATRON_LM_FLAGS and s.flag in supported
        assert s.config_field is None or s.config_field in fields
        assert s.refusal(s.accepted[0]) is None
    for field, name, ok, reason in megatron_lm.CONFIG_REFUSALS:
        assert field in fields and name in megatron_lm.MEGATRON_LM_FLAGS
        assert reason or megatron_lm.unsupported_reason(name), name
    # the programmatic path (a HybridConfig built in code) gets the refusals the command line gets
    validate_config(tiny_config())
    for overrides, needles in [({"normalization": "LayerNorm"}, ("--normalization LayerNorm", "accepted: RMSNorm")),
                               ({"context_parallel_size": 2}, ("--context-parallel-size 2", "context-parallel")),
                               ({"qk_layernorm": True}, ("--qk-layernorm", "QK layer norm")),
                               ({"moe_grouped_gemm": True}, ("--moe-grouped-gemm", "SequentialMLP")),
                               ({"window_size": (4, 0)}, ("--window-size", "sliding-window")),
                               ({"recompute_granularity": "selective"}, ("--recompute-modules core_attn",
                                                                         "do not recompute on their own"))]:
        try:
            cfg = tiny_config(**overrides)
        except (ValueError, AssertionError) as e:      # megatron-core's own check came first
            pytest.fail(f"{overrides}: {e}")
        with pytest.raises(ValueError) as ei:
            validate_config(cfg)
        for n in needles:
            assert n in str(ei.value), (n, str(ei.value))
    # ... and the command line gets them from the same rows
    refused("--normalization LayerNorm", "is a Megatron-LM setting that megatron_harts does not support",
            "the hybrid model uses RMSNorm", "accepted: RMSNorm")
    refused("--qk-layernorm", "--qk-layernorm (" + megatron_lm.unsupported_reason("--qk-layernorm"))
    refused("--recompute-granularity selective", "--recompute-modules core_attn", "layernorm, mlp, moe, shared_experts")


def test_dataset_shuffle_flag_reaches_the_loader(tmp_path):
    from test_training_driver import argv, write_rollouts
    from megatron_harts.training.trainer import Trainer
    data = tmp_path / "rollouts"
    write_rollouts(data)
    with Trainer.from_args(argv(data, "within", "--no-tree-dataset-shuffle"), require_data=True) as t:
        assert t.args.tree.dataset_shuffle is False and t.open_loader().shuffle is False
        assert t.settings.microbatch_tokens == 48 and t.settings.planner == "l1"


@pytest.mark.parametrize("module", ["megatron_harts.flags", "megatron_harts.megatron_lm"])
def test_flag_modules_stand_alone(module):
    """Every layer may import them: they import no torch and nothing else of megatron_harts."""
    import subprocess
    import sys
    code = (f"import sys, importlib; importlib.import_module({module!r}); "
            f"print(sorted(m for m in sys.modules if m.startswith('megatron_harts.') and m != {module!r})); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]" and out[1] == "False", out
