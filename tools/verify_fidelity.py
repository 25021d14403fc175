#!/usr/bin/env python3
"""Tree mode vs expanded mode on the same weights (docs/design.md invariant 1), optionally vs transformers.

Builds the hybrid model from a preset (--preset tiny|small|h200, weights from --init and --seed) or
from a transformers Kimi-Linear checkpoint directory (--hf-checkpoint DIR, converted on the fly),
reads trajectories (--input FILE, JSONL/Parquet) or generates a small SWE-like set (--synthetic,
the repo's generator scaled to the model's vocabulary), runs expanded mode and tree mode, and
reports per-target log-prob (max, mean, median and the number of targets over the tolerance, for
every comparison), RL-loss, gradient, MoE aux-loss and tokens-per-expert differences and the
token-wise logit cosine.  The RL loss (megatron_harts/testing/fidelity.py, ``pg_loss``) is
sum over targets of -weight * advantage * logprob (PPO-clip with the ratio to old_logprobs where
present) / number of targets, the same formula in both modes.

--dtype bfloat16 also runs expanded mode on an fp32 copy of the same weights (the oracle) and
reports both bf16 runs against it (``*_tree_vs_fp32``, ``*_expanded_vs_fp32``: logit cosine,
max/mean/median log-prob difference, loss, gradients); tree vs expanded in bf16 is then information.

--oracle hf also runs transformers' KimiLinearForCausalLM on the same weights, each trajectory on
its own (compaction events applied to its MLA layers), and compares expanded mode with it.  It
runs in float64 through transformers' plain torch code, also where fla or causal-conv1d is
installed (transformers would otherwise hand its tensors to their Triton kernels, which compute in
fp32/TF32 on CUDA, take no float64 and fail on CPU tensors), on the CPU (--oracle-device cpu, the
default) or the GPU (--oracle-device cuda: faster for large models).

Preset weights (--init): "megatron" = the model as built (init_method_std 0.02, fla's KDA init),
"random" = N(0, 0.2^2) matrices (a chaotic network: stronger for the exact fp64/fp32 tolerances,
but it blows bf16 rounding up to a ~1-7% cosine deficit that hides errors of that size).
Default: random for float64/float32, megatron for bfloat16.

Exit status: 0 when within the design's tolerance for --dtype (fp64: relative 1e-10, fp32: 1e-5,
the transformers oracle at 1e-5 for both; bf16, against the fp32 oracle: 1 - logit cosine of tree
<= 1.5 x expanded's + 1e-6, and mean |log-prob difference| of tree <= 2 x expanded's + 1e-5; see
fidelity.py for why), 1 otherwise (the last line then starts with FAIL and names what failed),
2 on bad input (one ``error:`` line).
"""
import argparse
import json
import logging
import math
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_harts.cli import ArgumentParser, CliError, print_table, require_path, run  # noqa: E402

DTYPES = ("float64", "float32", "bfloat16")
DEVICES = ("cpu", "cuda")
from megatron_harts.tree_data.synthetic import COMPACTIONS  # noqa: E402
KEYS = ("max_logprob_abs_diff", "max_grad_rel_diff", "loss_abs_diff", "aux_loss_abs_diff", "tokens_per_expert_equal",
        "logit_cosine", "oracle_max_logprob_abs_diff")


def quiet_libraries():
    """megatron-core warns at import about missing TE/apex and logs spec notes: not the user's concern."""
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    warnings.filterwarnings("ignore", message="full scope is deprecated")
    warnings.filterwarnings("ignore", message="MLP requires ffn_hidden_size")
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("megatron").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:        # transformers' own switch, not the environment (tests run this tool in their process)
        from transformers.utils import logging as hf_logging
    except ImportError:     # no transformers: nothing of it to quiet (--oracle hf says what it needs)
        return
    hf_logging.set_verbosity_error()


#: --synthetic --compaction: the set's context budget and the strategies' knobs, scaled to its 48-token
#: trajectories (every strategy compacts several times per trajectory)
SYNTHETIC_COMPACTION = dict(context_budget=20, keep_prefix=4, keep_last=6, evict_chunk=5, summary_tokens=3)


def synthetic_trajectories(vocab_size: int, seed: int, compaction: str = "none"):
    """A small tree-step SWE-like set (prompt, branching action/observation turns) in ``vocab_size``,
    with the compaction events of ``compaction`` (the synthesizer's strategies) where the live
    context would exceed :data:`SYNTHETIC_COMPACTION`'s budget."""
    from megatron_harts.tree_data.synthetic import SweConfig, synthesize_swe
    cfg = SweConfig(scheme="tree-step", num_tasks=2, samples_per_task=2, prompt_median=12, min_turns=2, max_turns=3,
                    action_median=4, observation_median=5, branch_prob=0.6, branch_factor=2, max_leaves=3,
                    max_tokens=48, vocab_size=vocab_size, seed=seed, compaction=compaction,
                    **SYNTHETIC_COMPACTION)
    return synthesize_swe(cfg)


def summary_lines(report) -> list:
    """One line per log-prob comparison of ``report``: max, mean, median |difference| and how many
    targets exceed the tolerance (where the comparison has a per-target tolerance)."""
    comparisons = [("tree vs expanded", "{}")]
    if report.get("oracle_max_logprob_abs_diff") is not None:
        comparisons.append((f"expanded vs transformers ({report['oracle_device']}, {report['oracle_dtype']})",
                            "oracle_{}"))
    if report.get("dtype") == "bfloat16":
        comparisons += [("tree bf16 vs fp32 oracle", "{}_tree_vs_fp32"),
                        ("expanded bf16 vs fp32 oracle", "{}_expanded_vs_fp32")]
    lines = []
    for label, key in comparisons:
        line = (f"log-prob |difference|, {label}: max {report[key.format('max_logprob_abs_diff')]:.3e}, "
                f"mean {report[key.format('mean_logprob_abs_diff')]:.3e}, "
                f"median {report[key.format('median_logprob_abs_diff')]:.3e}")
        over = report.get(key.format("logprob_targets_over_tolerance"))
        if over is not None:
            line += f", {over} of {report['num_targets']} targets over tolerance"
        lines.append(line)
    return lines


def _json_safe(report):
    return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in report.items()}


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None, metavar="tiny|small|h200",
                     help="model preset (default tiny; h200: the throughput benchmark's model, ~15 GB on a CPU)")
    src.add_argument("--hf-checkpoint", default=None, metavar="DIR", help="transformers kimi_linear checkpoint")
    data = ap.add_mutually_exclusive_group(required=True)
    data.add_argument("--input", default=None, metavar="FILE", help="trajectories (.jsonl, .jsonl.gz, .parquet)")
    data.add_argument("--synthetic", action="store_true", help="generate a small SWE-like trajectory set")
    ap.add_argument("--compaction", default="none", choices=COMPACTIONS, metavar="|".join(COMPACTIONS),
                    help="with --synthetic: compaction traces of this strategy (KV eviction in the MLA layers; "
                         "default none)")
    ap.add_argument("--dtype", default="float64", metavar="|".join(DTYPES), help="model dtype (default float64)")
    ap.add_argument("--device", default="cpu", metavar="|".join(DEVICES), help="default cpu")
    ap.add_argument("--oracle", default=None, metavar="hf",
                    help="also compare expanded mode with transformers' KimiLinearForCausalLM")
    ap.add_argument("--oracle-device", default=None, metavar="|".join(DEVICES),
                    help="where the transformers oracle runs, in float64 on transformers' plain torch code "
                         "(default cpu)")
    ap.add_argument("--init", default=None, metavar="megatron|random",
                    help="preset weights (default: random for float64/float32, megatron for bfloat16)")
    ap.add_argument("--seed", type=int, default=0, help="weights (presets) and synthetic data seed")
    ap.add_argument("--per-layer", action="store_true",
                    help="with --dtype bfloat16: also where the rounding grows, per decoder layer: the relative "
                         "error of the attention, MLP and layer outputs and the fraction of positions whose MoE "
                         "experts differ from the fp32 oracle's, for tree and expanded mode (report key per_layer)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    quiet_libraries()
    from megatron_harts.testing.fidelity import DEFAULT_INIT, INITS, PRESETS
    preset = args.preset or ("tiny" if args.hf_checkpoint is None else None)
    if preset is not None and preset not in PRESETS:
        raise CliError(f"--preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    if args.dtype not in DTYPES:
        raise CliError(f"--dtype must be one of {', '.join(DTYPES)}, got {args.dtype!r}")
    if args.device not in DEVICES:
        raise CliError(f"--device must be cpu or cuda, got {args.device!r}")
    if args.per_layer and args.dtype != "bfloat16":
        raise CliError(f"--per-layer compares bf16 rounding with an fp32 oracle: it needs --dtype bfloat16, got "
                       f"{args.dtype}")
    if args.oracle not in (None, "hf"):
        raise CliError(f"--oracle must be hf, got {args.oracle!r}")
    if args.oracle_device is not None and args.oracle is None:
        raise CliError("--oracle-device: there is no oracle to place (add --oracle hf)")
    oracle_device = args.oracle_device or "cpu"
    if oracle_device not in DEVICES:
        raise CliError(f"--oracle-device must be cpu or cuda, got {oracle_device!r}")
    if args.init is not None and args.init not in INITS:
        raise CliError(f"--init must be one of {', '.join(INITS)}, got {args.init!r}")
    if args.init is not None and args.hf_checkpoint is not None:
        raise CliError("--init: the weights come from --hf-checkpoint")
    init = None if args.hf_checkpoint is not None else (args.init or DEFAULT_INIT[args.dtype])
    if args.input is not None:
        require_path(args.input, "--input")
    import torch

    for flag, device in (("--device", args.device), ("--oracle-device", oracle_device)):
        if device == "cuda" and not torch.cuda.is_available():
            raise CliError(f"{flag} cuda: no CUDA device is available")
    import megatron_harts.patches as patches
    from megatron_harts.layout import build_layout
    from megatron_harts.models import build_hybrid_model, hf_convert
    from megatron_harts.testing import fidelity
    from megatron_harts.testing.cpu_runtime import single_process_megatron
    from megatron_harts.tree_data import build_forest, read_trajectories

    dtype = getattr(torch, args.dtype)
    if args.hf_checkpoint is not None or args.oracle is not None:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    hf_state = None
    if args.hf_checkpoint is not None:
        try:
            raw, hf_state = hf_convert.load_hf_checkpoint(args.hf_checkpoint)
        except hf_convert.CheckpointError as e:
            raise CliError(str(e)) from None
        hf_cfg = hf_convert.kimi_linear_config_from_dict(raw)
        vocab = hf_cfg.vocab_size
    else:
        vocab = PRESETS[preset]["vocab_size"]
    if args.compaction != "none" and not args.synthetic:
        raise CliError("--compaction generates compaction traces with --synthetic; --input files carry their own "
                       "'compactions' events")
    trajs = synthetic_trajectories(vocab, args.seed, args.compaction) if args.synthetic else \
        read_trajectories([args.input], vocab_size=vocab)
    if not trajs:
        raise CliError(f"--input {args.input}: no trajectories")
    forest = build_forest(trajs)
    stats = forest.stats()
    layout = build_layout(forest)
    if layout.num_targets == 0:
        raise CliError(f"--input {args.input}: no trajectory has a training target (loss_mask is all 0)")
    patches.apply()
    try:
        with single_process_megatron(args.device, seed=args.seed):
            if hf_state is not None:
                try:
                    cfg = hf_convert.hybrid_config_from_hf(
                        hf_cfg, **fidelity.measurement_overrides(dtype, args.device))
                    model = build_hybrid_model(cfg, vocab_size=vocab)
                    hf_convert.load_hf_weights(model, hf_state, cfg)
                except (KeyError, ValueError) as e:
                    raise CliError(f"--hf-checkpoint {args.hf_checkpoint}: {e}") from None
            else:
                cfg, _ = fidelity.preset_config(preset, dtype, args.device)
                model = build_hybrid_model(cfg, vocab_size=vocab)
                fidelity.initialize_weights(model, init, args.seed)
            if args.device == "cuda":
                model = model.cuda()
            model.train()
            fp32_oracle = None
            if args.dtype == "bfloat16":
                tree, expanded, fp32_oracle = fidelity.run_bf16(model, forest, layout, cfg, args.device)
            else:
                expanded = fidelity.run_expanded(model, forest, layout, cfg, args.device)
                tree = fidelity.run_tree(model, layout, cfg, args.device)
            oracle = None
            if args.oracle == "hf":
                oracle = fidelity.oracle_logprobs(model, cfg, vocab, forest, layout, device=oracle_device)
            report = fidelity.fidelity_report(tree, expanded, args.dtype, fp32_oracle=fp32_oracle,
                                              oracle_logprobs=oracle)
            if args.per_layer:
                report["per_layer"] = fidelity.layer_errors(model, forest, layout, cfg, args.device)
    finally:
        patches.undo()
    report.update(model=preset or args.hf_checkpoint, init=init, device=args.device,
                  oracle_device=oracle_device if args.oracle else None,
                  oracle_dtype="float64" if args.oracle else None,
                  num_trajectories=layout.num_trajectories, rows=layout.num_rows,
                  expanded_tokens=layout.num_expanded_tokens,
                  **{k: stats[k] for k in ("compaction_events", "visible_pairs_tree", "visible_pairs_expanded")})
    if args.json:
        print(json.dumps(_json_safe(report), indent=2, sort_keys=True))
    else:
        per_layer = report.pop("per_layer", None)
        rows = [(k, (f"{v:.8f}" if "cosine" in k else f"{v:.3e}") if isinstance(v, float) else v)
                for k, v in sorted(report.items())]
        print_table(rows, header=("measure", "value"))
        if per_layer is not None:
            def pair(e, x, key):
                return "" if key not in e else f"{e[key]:.4f} / {x[key]:.4f}"
            print()
            print_table([(e["layer"], *(pair(e, x, key) for key in ("attention", "mlp", "output", "routing_flips")))
                         for e, x in zip(per_layer["tree"], per_layer["expanded"])],
                        header=("layer", "attention", "mlp", "output", "routing flips"))
            print("(tree / expanded, each against the fp32 oracle: relative error; fraction of positions "
                  "whose experts differ)")
        print()
        for line in summary_lines(report):
            print(line)
        print("PASS" if report["pass"] else f"FAIL: {', '.join(report['failed'])}")
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    run(main)
