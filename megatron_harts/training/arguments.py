"""Command-line arguments of ``pretrain_tree_gpt.py`` (Megatron-LM's flag names, plus tree sharing).

``pretrain_tree_gpt.py`` replaces Megatron-LM's ``pretrain_gpt.py`` for hybrid KDA/MLA MoE
models trained on rollout trees, on megatron-core alone.  Launch scripts keep their flags:
wherever Megatron-LM has a flag we accept it under the same name, type and meaning.  Every
command-line word ends up in exactly one of four places:

- a flag we support: parsed as Megatron-LM parses it (a few defaults differ, listed below);
- a Megatron-LM flag we do not support (``MEGATRON_LM_FLAGS``, the option names of Megatron-LM
  core_v0.16.1 and of its main branch, extracted from ``megatron/training/arguments.py``):
  ``harts-pretrain: --X is a Megatron-LM flag that megatron_harts does not support (reason)``;
  some of those are accepted with their default or a harmless value only
  (``--context-parallel-size 1``, ``--micro-batch-size 1``, ``--tokenizer-type NullTokenizer``,
  ``--ckpt-format torch_dist``, ``--transformer-impl local``, ``--eval-iters 0``, ...);
- anything else: ``harts-pretrain: unrecognized arguments: --foo --bar`` (all of them);
- ``--help``: the flags by group, then exit 0.

Every refusal is an ``ArgumentsError`` (a ValueError) raised by ``parse_args``;
``parse_args_or_exit`` prints it as one ``error:`` line and exits with status 2.

Defaults that differ from Megatron-LM's (its default has no path here, or contradicts the model):
``--normalization RMSNorm``; ``--position-embedding-type none`` (Kimi-Linear's MLA is NoPE;
``rope`` applies plain RoPE to the ``--qk-pos-emb-head-dim`` dims); ``--attention-dropout 0``
and ``--hidden-dropout 0`` (tree sharing needs no dropout: a shared row and its per-trajectory
copies would draw different masks); ``--micro-batch-size 1``; ``--linear-attention-freq 4``
(Kimi-Linear's 3 KDA : 1 MLA; Megatron-LM only reads it with an experimental attention
variant); linear-attention head count defaults to ``--num-attention-heads`` (Megatron-LM's 16
key / 32 value heads are unequal, which KDA cannot do).  ``--vocab-size`` is the model's
vocabulary: unlike Megatron-LM's NullTokenizer no EOD id is added (trajectories are token ids);
``padded_vocab_size`` pads it to a multiple of ``--make-vocab-size-divisible-by`` x TP as
Megatron-LM does.  ``--sequence-parallel`` at ``--tensor-model-parallel-size 1`` is turned off
with a warning, as Megatron-LM does.  ``--global-batch-size`` counts trajectories.  ``--data-path``
takes one dataset prefix or trajectory file (weighted blends are refused); ``--split`` is accepted
for train-only splits (``100,0,0``) since there is no evaluation.  ``--save`` needs
``--save-interval`` and the reverse.  Fusion switch-offs (``--no-masked-softmax-fusion``, ...)
and ``--use-mcore-models`` are accepted without effect: nothing is fused, models are megatron-core.

Hybrid pattern: ``--linear-attention-freq N`` makes every N-th layer (1-based) full attention
(MLA) and the others linear attention (KDA), as in Megatron-LM; a list pattern such as
``"([1]*3+[0]*1)*6"`` gives one entry per layer, 1 = KDA, 0 = MLA.  ``--moe-layer-freq N``:
layer i (0-based) is MoE iff ``i % N == 0``; a list pattern, 1 = MoE, 0 = dense
(``"([0]+[1]*23)"``: a dense first layer).  Full-attention layers are always MLA
(``--multi-latent-attention`` is implied and may be given).  KDA has one head count and one
head dim for keys and values: ``--linear-num-key-heads``/``--linear-num-value-heads`` (and the
head-dim pair) must agree; when one of a pair is given the other follows it.

Our flags, declared once as typed flag groups (``megatron_harts.flags``; ``FLAG_GROUPS``): each is a
frozen dataclass whose fields carry the flag's name, type, default, help and constraints; the
options of the "tree sharing" and "RL objective" groups are generated from them, and the parsed
values are copied into them by field name.  ``parse_args`` leaves the checked instances on the
namespace: ``args.tree`` (``training.tree_flags.TreeFlags``: the ``--tree-*`` flags, planner and
microbatch budget resolved), ``args.objective`` (``rl.objectives.ObjectiveConfig``) and
``args.rl_update`` (``training.rl_update.RLUpdateConfig``); their values also sit at the flags'
argparse destinations (``tree_sharing``, ``tree_planner``, ``clip_ratio_low``, ...).  A group's own
constraints live in its dataclass; those that involve other flags (pipeline and expert
parallelism, ``--seq-length``, files, whether a flag was given) are checked here.

Tree sharing: ``--tree-sharing {off,within,windows}`` (default within).  ``off`` is expanded
training: whole trajectories packed first-fit-decreasing (planner ``ffd``, the only one allowed).
``within`` shares prefixes inside a microbatch: planner ``l1`` (default) or ``ortools`` (the
OR-Tools + FFD baseline over trees; needs the ``ortools`` package when planning).  ``windows``
adds cross-microbatch sharing windows: planner ``l1l2`` (default and only choice).
``--tree-microbatch-tokens`` is the row budget of a microbatch (default ``--seq-length``,
Megatron-LM's tokens per microbatch at micro-batch size 1); a longer trajectory is cut into pieces.
``--tree-kda-backend`` / ``--tree-attention-backend`` default to ``auto``: fla / flex on CUDA
(not with ``--fp64``), reference / sdpa otherwise; ``fla`` and ``flex`` need CUDA, checked when
the model config is built (``hybrid_config``, ``resolved_backends``), not at parse time.
``--tree-kda-call-plan {harts,per-depth,node-wise}`` (default harts) is the KDA call ablation:
``per-depth`` (one call per fork level) and ``node-wise`` (one call per segment depth, the paper's
"Node-wise LA") run the same tree step with replay-free baseline plans (``planner/baselines.py``)
instead of the call planner's; same losses and gradients, more KDA calls (the step's
``kda_calls``).  They need ``--tree-sharing within`` (sharing windows run harts plans only).

Namespace attributes the driver reads besides Megatron-LM's names and the groups: ``params_dtype``
(torch dtype), ``fp64``, ``padded_vocab_size``, ``layer_types``, ``mlp_types``,
``linear_num_heads``, ``linear_head_dim``, ``data_path`` (one string, or None), ``tree_mode``
(sharing != off), ``no_tree_replay`` (the negation of ``tree_replay``).
Resolved like Megatron-LM does: ``ffn_hidden_size``, ``moe_ffn_hidden_size``,
``expert_tensor_parallel_size``, ``lr_decay_iters``, ``start_weight_decay``/``end_weight_decay``,
``max_position_embeddings``, ``num_experts`` (0 -> None), single-entry
``moe_router_load_balancing_type`` / ``moe_aux_loss_coeff`` lists -> scalars.

Builders: ``hybrid_config`` (HybridConfig, validated by ``models.model.validate_config``),
``optimizer_config``, ``ddp_config``, ``scheduler_kwargs`` (OptimizerParamScheduler's arguments;
its steps count iterations: step it by 1 per iteration), ``data_parallel_size``,
``cost_model``, ``objective_kwargs``, ``rl_update_kwargs``.

Megatron-LM's flag names, the reasons for refusing them and the settings accepted with some values
only are one table of data, ``megatron_harts.megatron_lm``, which the model's ``validate_config``
reads too.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import os
import re
import signal
import sys
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..cli import CliError
from ..flags import (add_flag_group, finite_float, flag_fields, group_kwargs, int_at_least, set_namespace,
                     shared_fields)
from ..megatron_lm import MEGATRON_LM_FLAGS, NO_EVAL, SETTINGS, unsupported_reason
from ..ops.key_paths import FA4_VERSION, FLASH_MAX_HEAD_DIM, fa4_available
from ..rl.objectives import ObjectiveConfig
from .rl_update import RLUpdateConfig
from .tree_flags import PLANNERS, PLANNERS_BY_SHARING, PP_SCHEDULES, SHARING_MODES, TreeFlags

__all__ = [
    "ArgumentsError", "ArgumentsWarning", "MEGATRON_LM_FLAGS", "OWN_FLAGS", "TREE_SHARING_MODES",
    "TREE_PLANNERS", "PLANNERS_BY_SHARING", "build_parser", "parse_args", "parse_args_or_exit",
    "hybrid_config", "optimizer_config", "ddp_config", "scheduler_kwargs", "data_parallel_size",
    "padded_vocab_size", "cost_model", "objective_kwargs", "rl_update_kwargs", "add_flag_group",
    "resolved_backends", "supported_flags",
    "unsupported_reason", "GROUP_TITLES", "FLAG_GROUPS",
]

PROG = "harts-pretrain"


class ArgumentsError(CliError, ValueError):
    """A refused command line; the message names the flag(s).  ``megatron_harts.cli.run`` and
    ``parse_args_or_exit`` print it as one ``error:`` line (exit status 2)."""


class ArgumentsWarning(UserWarning):
    """A flag changed or overridden the way Megatron-LM does it (e.g. --sequence-parallel at TP 1)."""


# ---------------------------------------------------------------------------------------------
# our own flags: the typed flag groups (their choices are declared with them)
# ---------------------------------------------------------------------------------------------
TREE_SHARING_MODES = SHARING_MODES
TREE_PLANNERS = PLANNERS
TREE_PP_SCHEDULES = PP_SCHEDULES

#: the typed flag groups (``megatron_harts.flags``): argparse group title, dataclass, namespace attribute
#: holding the parsed instance
FLAG_GROUPS = (("tree sharing", TreeFlags, "tree"), ("RL objective", ObjectiveConfig, "objective"),
               ("RL objective", RLUpdateConfig, "rl_update"))

#: the flags megatron_harts adds (none of them is a Megatron-LM flag)
OWN_FLAGS = frozenset({"--fp64"}) | frozenset(o for _, cls, _ in FLAG_GROUPS for spec in flag_fields(cls)
                                              for o in spec.option_strings)


# ---------------------------------------------------------------------------------------------
# value parsers (argparse types)
# ---------------------------------------------------------------------------------------------
_PATTERN_LIMIT = 1 << 16


def _eval_pattern(text: str):
    """A per-layer 0/1 pattern written as a Python list expression: list literals of integers,
    ``+`` and ``*`` and parentheses, e.g. ``([1]*3+[0])*6``.  Evaluated on the syntax tree
    (no ``eval``); results longer than 65536 entries are refused."""
    if not re.fullmatch(r"[\d\s\[\],()+*]+", text):
        raise ValueError("only integers, [ ], commas, parentheses, + and * are allowed")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise ValueError("not a list expression") from None

    def ev(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            items = [ev(e) for e in node.elts]
            if any(not isinstance(i, int) for i in items):
                raise ValueError("list entries must be integers")
            return items
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Add):
                if isinstance(a, list) != isinstance(b, list):
                    raise ValueError("cannot add a list and an integer")
                out = a + b
            else:
                if isinstance(a, list) and isinstance(b, list):
                    raise ValueError("cannot multiply two lists")
                n = a if isinstance(b, list) else b
                if isinstance(a, list) or isinstance(b, list):
                    seq = b if isinstance(b, list) else a
                    if n < 0 or len(seq) * n > _PATTERN_LIMIT:
                        raise ValueError(f"the pattern would have more than {_PATTERN_LIMIT} entries")
                elif abs(a) > _PATTERN_LIMIT or abs(b) > _PATTERN_LIMIT:
                    raise ValueError("integer too large")
                out = a * b
            if isinstance(out, list) and len(out) > _PATTERN_LIMIT:
                raise ValueError(f"the pattern would have more than {_PATTERN_LIMIT} entries")
            return out
        raise ValueError("not a list expression")

    value = ev(tree.body)
    if not isinstance(value, list):
        raise ValueError("the expression must give a list")
    return value


def _layer_pattern(text: str):
    """``N`` (an integer >= 1) or a 0/1 list expression (see ``_eval_pattern``)."""
    s = str(text).strip()
    if re.fullmatch(r"[+]?\d+", s):
        n = int(s)
        if n < 1:
            raise argparse.ArgumentTypeError(f"must be an integer >= 1 or a list pattern, got {text!r}")
        return n
    try:
        value = _eval_pattern(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"invalid pattern {text!r}: {e}") from None
    if not value or any(v not in (0, 1) for v in value):
        raise argparse.ArgumentTypeError(f"invalid pattern {text!r}: entries must be 0 or 1")
    return value


def _signal_name(text: str) -> signal.Signals:
    name = str(text).strip().upper()
    if not name.startswith("SIG"):
        name = "SIG" + name
    try:
        return signal.Signals[name]
    except KeyError:
        raise argparse.ArgumentTypeError(f"unknown signal {text!r} (e.g. SIGTERM, SIGUSR1)") from None


_POSINT = int_at_least(1)
_NONNEG_INT = int_at_least(0)
_FLOAT = finite_float()
_NONNEG_FLOAT = finite_float(0.0)


# ---------------------------------------------------------------------------------------------
# the parser
# ---------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse that raises ArgumentsError instead of printing and exiting (``--help`` still
    prints and exits 0)."""

    def error(self, message: str):
        raise ArgumentsError(f"{self.prog}: {message}")


GROUP_TITLES = ("model shape", "MLA / KDA hybrid layers", "MoE", "parallelism", "training",
                "optimizer and learning-rate schedule", "checkpointing", "logging", "data",
                "tree sharing", "RL objective", "Megatron-LM compatibility")


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The argparse parser of the flags we accept (``parse_args`` adds the refusals and checks)."""
    p = _Parser(prog=prog, allow_abbrev=False, usage="%(prog)s [flags]  (Megatron-LM's flag names; see --help)",
                description="Train a hybrid KDA/MLA MoE model on rollout trees (drop-in for Megatron-LM's "
                            "pretrain_gpt.py flags; Megatron-LM flags without a path here are refused by name).")
    g = {t: p.add_argument_group(t) for t in GROUP_TITLES}

    m = g["model shape"]
    m.add_argument("--num-layers", type=_POSINT, default=None, help="number of transformer layers (required)")
    m.add_argument("--hidden-size", type=_POSINT, default=None, help="hidden size (required)")
    m.add_argument("--ffn-hidden-size", type=_POSINT, default=None,
                   help="dense MLP hidden size (default: 4 x hidden, or with --swiglu int(8 x hidden / 3 / 64) x 64)")
    m.add_argument("--num-attention-heads", type=_POSINT, default=None,
                   help="attention heads of the MLA layers (required; also the KDA head count unless "
                        "--linear-num-key-heads is given)")
    m.add_argument("--kv-channels", type=_POSINT, default=None,
                   help="per-head projection size of standard attention (default hidden / heads); MLA sizes "
                        "its heads with --qk-head-dim / --v-head-dim instead")
    m.add_argument("--max-position-embeddings", type=_POSINT, default=None,
                   help="longest position the RoPE tables cover (default --seq-length)")
    m.add_argument("--vocab-size", type=_POSINT, default=None,
                   help="vocabulary size of the token ids (required; no EOD id is added)")
    m.add_argument("--make-vocab-size-divisible-by", type=_POSINT, default=128,
                   help="pad the vocabulary to a multiple of this times the TP size (default 128)")
    m.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="RMSNorm",
                   help="RMSNorm only (the default here)")
    m.add_argument("--norm-epsilon", dest="layernorm_epsilon", type=_NONNEG_FLOAT, default=1e-5,
                   help="epsilon of the RMSNorm layers (default 1e-5)")
    m.add_argument("--swiglu", action="store_true", help="gated SiLU MLPs (SwiGLU); GELU MLPs otherwise")
    m.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false",
                   help="no biases in the linear layers")
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="separate output-layer weights (tied to the input embedding otherwise)")
    m.add_argument("--init-method-std", type=_NONNEG_FLOAT, default=0.02,
                   help="std of the normal weight initialization (default 0.02)")
    m.add_argument("--attention-dropout", type=_NONNEG_FLOAT, default=0.0,
                   help="attention dropout (default 0; must be 0 with tree sharing)")
    m.add_argument("--hidden-dropout", type=_NONNEG_FLOAT, default=0.0,
                   help="hidden-state dropout (default 0; must be 0 with tree sharing)")
    m.add_argument("--position-embedding-type",
                   choices=("learned_absolute", "rope", "yarn", "mrope", "relative", "none"), default="none",
                   help="none (default: NoPE MLA, as Kimi-Linear) or rope (RoPE on the MLA rope dims)")
    m.add_argument("--rotary-base", type=_POSINT, default=10000, help="RoPE base (default 10000)")
    m.add_argument("--rope-type", choices=("rope", "yarn"), default=None, help="rope only (plain RoPE)")

    h = g["MLA / KDA hybrid layers"]
    h.add_argument("--multi-latent-attention", action="store_true",
                   help="full-attention layers are MLA (always true here; accepted for compatibility)")
    h.add_argument("--q-lora-rank", type=_POSINT, default=None,
                   help="rank of the MLA query down-projection (default: none, full-rank queries)")
    h.add_argument("--kv-lora-rank", type=_POSINT, default=32, help="rank of the MLA key/value latent (default 32)")
    h.add_argument("--qk-head-dim", type=_POSINT, default=128,
                   help="MLA query/key head dim without the rope part (default 128)")
    h.add_argument("--qk-pos-emb-head-dim", type=_POSINT, default=64,
                   help="MLA query/key head dim of the rope part (default 64)")
    h.add_argument("--v-head-dim", type=_POSINT, default=128, help="MLA value head dim (default 128)")
    h.add_argument("--linear-attention-freq", type=_layer_pattern, default=4,
                   help="N: every N-th layer is MLA, the others KDA (default 4 = 3 KDA : 1 MLA); or a "
                        "list pattern, one entry per layer, 1 = KDA, 0 = MLA, e.g. \"([1]*3+[0]*1)*6\"")
    h.add_argument("--linear-num-key-heads", type=_POSINT, default=None,
                   help="KDA heads (default --num-attention-heads); KDA has as many value heads")
    h.add_argument("--linear-num-value-heads", type=_POSINT, default=None,
                   help="KDA value heads: must equal --linear-num-key-heads")
    h.add_argument("--linear-key-head-dim", type=_POSINT, default=None, help="KDA head dim (default 128)")
    h.add_argument("--linear-value-head-dim", type=_POSINT, default=None,
                   help="KDA value head dim: must equal --linear-key-head-dim")
    h.add_argument("--linear-conv-kernel-dim", type=_POSINT, default=4,
                   help="kernel size of KDA's causal short convolution (default 4)")

    e = g["MoE"]
    e.add_argument("--num-experts", type=_NONNEG_INT, default=None, help="routed experts per MoE layer (none: dense)")
    e.add_argument("--moe-ffn-hidden-size", type=_POSINT, default=None,
                   help="hidden size of one expert (default --ffn-hidden-size)")
    e.add_argument("--moe-layer-freq", type=_layer_pattern, default=None,
                   help="N: layer i is MoE iff i %% N == 0 (default 1: all); or a list pattern, 1 = MoE, "
                        "0 = dense, e.g. \"([0]+[1]*23)\"")
    e.add_argument("--moe-router-topk", type=_POSINT, default=2, help="experts per token (default 2)")
    e.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"), default="softmax",
                   help="router score function (default softmax; Kimi-Linear: sigmoid)")
    e.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free load balancing with a per-expert routing bias")
    e.add_argument("--moe-router-bias-update-rate", type=_NONNEG_FLOAT, default=1e-3,
                   help="update rate of the expert bias (default 1e-3)")
    e.add_argument("--moe-router-topk-scaling-factor", type=_FLOAT, default=None,
                   help="scale of the top-k routing weights (Kimi-Linear's routed_scaling_factor)")
    e.add_argument("--moe-router-num-groups", type=_POSINT, default=None, help="expert groups of group-limited routing")
    e.add_argument("--moe-router-group-topk", type=_POSINT, default=None, help="groups selected per token")
    e.add_argument("--moe-aux-loss-coeff", type=_NONNEG_FLOAT, nargs="+", default=0.0,
                   help="aux loss coefficient(s), one per --moe-router-load-balancing-type (default 0)")
    e.add_argument("--moe-z-loss-coeff", type=_NONNEG_FLOAT, default=None, help="router z-loss coefficient")
    e.add_argument("--moe-router-load-balancing-type", nargs="+", default="aux_loss", metavar="TYPE",
                   choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"),
                   help="load-balancing loss(es): aux_loss (default), seq_aux_loss, global_aux_loss, sinkhorn or "
                        "none (tree sharing: aux_loss or none)")
    e.add_argument("--moe-shared-expert-intermediate-size", type=_POSINT, default=None,
                   help="hidden size of the shared expert (none: no shared expert)")
    e.add_argument("--moe-token-dispatcher-type", choices=("allgather", "alltoall", "flex"), default="allgather",
                   help="allgather (default) or alltoall")
    e.add_argument("--moe-router-dtype", choices=("fp32", "fp64"), default=None,
                   help="router compute dtype (default: fp64 with --fp64, else the model dtype)")
    e.add_argument("--moe-expert-capacity-factor", type=_FLOAT, default=None,
                   help="expert capacity (token dropping): refused with tree sharing, which must equal "
                        "expanded training")
    e.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="pad expert inputs to the capacity (token dropping; refused with tree sharing)")
    e.add_argument("--moe-token-drop-policy", choices=("probs", "position"), default="probs",
                   help="which tokens capacity dropping drops (default probs)")

    par = g["parallelism"]
    par.add_argument("--tensor-model-parallel-size", type=_POSINT, default=1, help="TP size (default 1)")
    par.add_argument("--pipeline-model-parallel-size", type=_POSINT, default=1, help="PP size (default 1)")
    par.add_argument("--expert-model-parallel-size", type=_POSINT, default=1, help="EP size (default 1)")
    par.add_argument("--expert-tensor-parallel-size", type=_POSINT, default=None,
                     help="TP size of the experts (default --tensor-model-parallel-size)")
    par.add_argument("--context-parallel-size", type=_POSINT, default=1, help="1 only")
    par.add_argument("--sequence-parallel", action="store_true",
                     help="sequence parallelism (needs TP > 1; at TP 1 it is turned off with a warning, as in "
                          "Megatron-LM; required for MoE with TP > 1)")
    par.add_argument("--use-distributed-optimizer", action="store_true",
                     help="shard optimizer state over data-parallel ranks")
    par.add_argument("--overlap-grad-reduce", action="store_true", help="overlap the gradient reduce with backward")
    par.add_argument("--overlap-param-gather", action="store_true",
                     help="overlap the parameter all-gather with forward (needs --use-distributed-optimizer "
                          "and --overlap-grad-reduce)")
    par.add_argument("--distributed-backend", choices=("nccl", "gloo"), default="nccl",
                     help="torch.distributed backend (default nccl)")
    par.add_argument("--distributed-timeout-minutes", type=_POSINT, default=10,
                     help="collective timeout in minutes (default 10)")

    t = g["training"]
    t.add_argument("--train-iters", type=_POSINT, default=None, help="training iterations (required)")
    t.add_argument("--global-batch-size", type=_POSINT, default=None,
                   help="trajectories per iteration, over all data-parallel ranks (required)")
    t.add_argument("--micro-batch-size", type=_POSINT, default=1,
                   help="1 only: microbatches hold up to --tree-microbatch-tokens rows")
    t.add_argument("--seed", type=int, default=1234, help="random seed (default 1234)")
    t.add_argument("--bf16", action="store_true", help="bfloat16 parameters and compute (fp32 gradient reduction)")
    t.add_argument("--fp64", action="store_true",
                   help="float64 parameters and compute (exactness checks on CPU); excludes --bf16")
    t.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="reduce gradients in fp32 (always on with --bf16)")
    t.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false", help="do not check the loss and gradients for NaN")
    t.add_argument("--use-cpu-initialization", action="store_true",
                   help="initialize weights on the CPU (always on without CUDA)")
    t.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="activation recomputation: full layers or selected modules")
    t.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                   help="full recomputation: uniform (groups of --recompute-num-layers) or block (the first "
                        "--recompute-num-layers layers of each stage)")
    t.add_argument("--recompute-num-layers", type=_POSINT, default=None, help="layers per recomputation unit")
    t.add_argument("--recompute-modules", nargs="+", default=None, metavar="MODULE",
                   help="selective recomputation: megatron-core module names the hybrid model recomputes "
                        "(layernorm, mlp, moe, shared_experts); required with --recompute-granularity selective "
                        "(megatron-core's default, core_attn, is refused: the KDA and MLA cores do not recompute "
                        "on their own)")
    t.add_argument("--exit-interval", type=_POSINT, default=None, help="exit after an iteration divisible by this")
    t.add_argument("--exit-duration-in-mins", type=_POSINT, default=None, help="exit after this many minutes")
    t.add_argument("--exit-signal-handler", action="store_true",
                   help="on --exit-signal, save a checkpoint and exit at the end of the iteration")
    t.add_argument("--exit-signal", type=_signal_name, default=signal.SIGTERM,
                   help="signal --exit-signal-handler catches (default SIGTERM)")

    o = g["optimizer and learning-rate schedule"]
    o.add_argument("--optimizer", choices=("adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon"),
                   default="adam", help="adam (AdamW, default) or sgd")
    o.add_argument("--lr", type=_NONNEG_FLOAT, default=None, help="peak learning rate (required)")
    o.add_argument("--min-lr", type=_NONNEG_FLOAT, default=0.0, help="learning rate at the end of decay (default 0)")
    o.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"),
                   default="linear", help="decay after warmup (default linear)")
    o.add_argument("--lr-decay-iters", type=_POSINT, default=None,
                   help="decay length in iterations (default --train-iters)")
    o.add_argument("--lr-wsd-decay-style", choices=("exponential", "linear", "cosine", "minus_sqrt"),
                   default="exponential", help="annealing shape of WSD (default exponential)")
    o.add_argument("--lr-wsd-decay-iters", type=_POSINT, default=None,
                   help="WSD: annealing iterations at the end of the decay (required with WSD)")
    o.add_argument("--lr-warmup-iters", type=_NONNEG_INT, default=0, help="linear warmup iterations (default 0)")
    o.add_argument("--lr-warmup-fraction", type=_NONNEG_FLOAT, default=None,
                   help="warmup as a fraction of the decay iterations (excludes --lr-warmup-iters)")
    o.add_argument("--lr-warmup-init", type=_NONNEG_FLOAT, default=0.0,
                   help="learning rate at warmup start (default 0)")
    o.add_argument("--weight-decay", type=_NONNEG_FLOAT, default=0.01, help="weight decay (default 0.01)")
    o.add_argument("--start-weight-decay", type=_NONNEG_FLOAT, default=None,
                   help="weight decay at the start (non-constant --weight-decay-incr-style)")
    o.add_argument("--end-weight-decay", type=_NONNEG_FLOAT, default=None,
                   help="weight decay at the end (non-constant --weight-decay-incr-style)")
    o.add_argument("--weight-decay-incr-style", choices=("constant", "linear", "cosine"), default="constant",
                   help="weight-decay schedule over --train-iters (default constant)")
    o.add_argument("--adam-beta1", type=_FLOAT, default=0.9, help="Adam beta1 (default 0.9)")
    o.add_argument("--adam-beta2", type=_FLOAT, default=0.999, help="Adam beta2 (default 0.999)")
    o.add_argument("--adam-eps", type=_NONNEG_FLOAT, default=1e-8, help="Adam epsilon (default 1e-8)")
    o.add_argument("--sgd-momentum", type=_NONNEG_FLOAT, default=0.9, help="SGD momentum (default 0.9)")
    o.add_argument("--clip-grad", type=_NONNEG_FLOAT, default=1.0, help="global gradient-norm clip (default 1; 0: off)")
    o.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   dest="override_opt_param_scheduler", action="store_true",
                   help="take the schedule from these flags, not from the checkpoint")
    o.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true",
                   help="take the schedule from the checkpoint")

    c = g["checkpointing"]
    c.add_argument("--save", default=None, help="checkpoint directory to save to")
    c.add_argument("--load", default=None, help="checkpoint directory to load from")
    c.add_argument("--save-interval", "--persistent-save-interval", dest="save_interval", type=_POSINT, default=None,
                   help="save every this many iterations (needs --save)")
    c.add_argument("--no-save-optim", action="store_true", default=None, help="do not save the optimizer state")
    c.add_argument("--no-save-rng", action="store_true", default=None, help="do not save the RNG state")
    c.add_argument("--no-load-optim", action="store_true", default=None, help="do not load the optimizer state")
    c.add_argument("--no-load-rng", action="store_true", default=None, help="do not load the RNG state")
    c.add_argument("--finetune", action="store_true",
                   help="load the weights only and start at iteration 0 (no optimizer or RNG state)")
    c.add_argument("--ckpt-format", choices=("torch", "torch_dist", "torch_dcp", "fsdp_dtensor"),
                   default="torch_dist", help="torch_dist only")
    c.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="exit when --load holds no checkpoint (instead of starting from scratch)")
    c.add_argument("--ckpt-step", type=_NONNEG_INT, default=None,
                   help="load the checkpoint of this iteration from --load, whatever its tracker file names "
                        "(e.g. to resume from an earlier one when the newest is damaged)")

    lg = g["logging"]
    lg.add_argument("--log-interval", type=_POSINT, default=100,
                    help="print metrics every this many iterations (default 100)")
    lg.add_argument("--tensorboard-dir", default=None, help="write TensorBoard events here")
    lg.add_argument("--tensorboard-log-interval", type=_POSINT, default=1,
                    help="write TensorBoard scalars every this many iterations (default 1)")
    lg.add_argument("--log-throughput", action="store_true", help="log tokens/s and rows/s")

    d = g["data"]
    d.add_argument("--data-path", nargs="*", default=None,
                   help="one dataset prefix or trajectory file (required unless trajectories are fed in memory)")
    d.add_argument("--seq-length", type=_POSINT, default=None,
                   help="longest trajectory in tokens (optional; default budget of --tree-microbatch-tokens)")
    d.add_argument("--tokenizer-type", default=None, metavar="NAME",
                   choices=("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
                            "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer",
                            "MultimodalTokenizer", "NullTokenizer", "NullMultimodalTokenizer", "SFTTokenizer"),
                   help="NullTokenizer only (token ids in, no tokenizer)")
    d.add_argument("--split", default=None, help="train-only splits only (e.g. 100,0,0): there is no evaluation")
    d.add_argument("--eval-iters", type=_NONNEG_INT, default=0, help="0 only: there is no evaluation loop")

    for title, cls, _ in FLAG_GROUPS:
        add_flag_group(g[title], cls)

    cm = g["Megatron-LM compatibility"]
    cm.add_argument("--use-mcore-models", dest="deprecated_use_mcore_models", action="store_true",
                    help="accepted, no effect (models are always megatron-core)")
    cm.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion",
                    action="store_false",
                    help="linears without the weight gradient accumulated into the fp32 main gradient by their "
                         "GEMM (megatron's gradient-accumulation fusion, through torch: megatron_harts.patches."
                         "wgrad_accumulation); fused by default on the GPU, never on the CPU")
    cm.add_argument("--no-bias-swiglu-fusion", dest="bias_swiglu_fusion", action="store_false",
                    help="SwiGLU MLPs and experts without megatron's fused (torch.compile'd) SwiGLU; fused by "
                         "default on the GPU, never on the CPU")
    for flag, dest in (("--no-masked-softmax-fusion", "masked_softmax_fusion"),
                       ("--no-bias-gelu-fusion", "bias_gelu_fusion"),
                       ("--no-bias-dropout-fusion", "bias_dropout_fusion"),
                       ("--no-rope-fusion", "apply_rope_fusion"),
                       ("--no-persist-layer-norm", "no_persist_layer_norm"),
                       ("--no-create-attention-mask-in-dataloader", "create_attention_mask_in_dataloader")):
        if dest == "no_persist_layer_norm":
            cm.add_argument(flag, dest=dest, action="store_true", help="accepted, no effect (nothing is fused)")
        else:
            cm.add_argument(flag, dest=dest, action="store_false", help="accepted, no effect (nothing is fused)"
                            if "fusion" in flag else "accepted, no effect (no masks are built in the loader)")
    cm.add_argument("--transformer-impl", choices=("local", "transformer_engine", "inference_optimized"),
                    default="local", help="local only (no Transformer Engine)")
    cm.add_argument("--attention-backend", choices=("flash", "fused", "unfused", "local", "auto"), default="auto",
                    help="auto only: full attention runs through --tree-attention-backend")
    _set_metavars(p)
    return p


_PATH_DESTS = {"save", "load", "tensorboard_dir", "data_path"}


def _set_metavars(parser: argparse.ArgumentParser) -> None:
    """Short placeholders in --help (N, X, PATH, ...) instead of the upper-cased destinations."""
    ints = {_POSINT, _NONNEG_INT, int}
    floats = {_FLOAT, _NONNEG_FLOAT}
    for a in parser._actions:
        if not a.option_strings or a.nargs == 0 or a.choices is not None or a.metavar is not None:
            continue
        if a.type in ints:
            a.metavar = "N"
        elif a.type in floats:
            a.metavar = "X"
        elif a.type is _layer_pattern:
            a.metavar = "PATTERN"
        elif a.type is _signal_name:
            a.metavar = "SIGNAL"
        elif a.dest in _PATH_DESTS:
            a.metavar = "PATH"
        elif a.type is None:
            a.metavar = "VALUE"


def supported_flags(parser: Optional[argparse.ArgumentParser] = None) -> frozenset:
    """Every option string the parser accepts (Megatron-LM's and ours)."""
    parser = parser or build_parser()
    return frozenset(o for a in parser._actions for o in a.option_strings if o.startswith("--"))


def _dest_flags(parser: argparse.ArgumentParser) -> Dict[str, str]:
    return {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}


# ---------------------------------------------------------------------------------------------
# parsing
# ---------------------------------------------------------------------------------------------
_NUMBER = re.compile(r"^-\d+(\.\d*)?([eE][-+]?\d+)?$|^-\.\d+([eE][-+]?\d+)?$")


def _refuse_leftovers(extras: Sequence[str], parser: argparse.ArgumentParser) -> None:
    """Classify what argparse did not consume: Megatron-LM flags we refuse, unknown words."""
    unsupported: List[str] = []
    unknown: List[str] = []
    after_flag = False
    for word in extras:
        if word.startswith("-") and word != "-" and not _NUMBER.match(word):
            name = word.split("=", 1)[0]
            (unsupported if name in MEGATRON_LM_FLAGS else unknown).append(name)
            after_flag = "=" not in word
        elif not after_flag:
            unknown.append(word)     # a stray value: nothing before it takes it
    msgs = []
    if unsupported:
        unsupported = list(dict.fromkeys(unsupported))
        parts = []
        for f in unsupported:
            r = unsupported_reason(f)
            parts.append(f"{f} ({r})" if r else f)
        if len(unsupported) == 1:
            msgs.append(f"{parts[0]} is a Megatron-LM flag that megatron_harts does not support")
        else:
            msgs.append(f"{', '.join(parts)} are Megatron-LM flags that megatron_harts does not support")
    if unknown:
        unknown = list(dict.fromkeys(unknown))
        known = sorted(supported_flags(parser))
        hints = []
        for u in unknown:
            close = difflib.get_close_matches(u, known, n=1, cutoff=0.85) if u.startswith("--") else []
            if close:
                hints.append(f"{u} -> {close[0]}?")
        hint = f" (did you mean: {'; '.join(hints)})" if hints else ""
        msgs.append(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if msgs:
        raise ArgumentsError(f"{PROG}: " + "; ".join(msgs))


def _fail(message: str):
    raise ArgumentsError(f"{PROG}: {message}")


def _check_accepted_values(args: argparse.Namespace) -> None:
    """The Megatron-LM settings checked on the parsed flags (those with a configuration field are
    checked by the model's ``validate_config``, reached through ``_build_config``)."""
    for setting in SETTINGS:
        msg = None if setting.config_field else setting.refusal(getattr(args, setting.dest))
        if msg:
            _fail(msg)
    if args.split is not None:
        try:
            weights = [float(x) for x in re.split(r"[,/]", args.split) if x.strip()]
        except ValueError:
            weights = []
        if not weights or weights[0] <= 0 or any(w != 0 for w in weights[1:]):
            _fail(f"--split {args.split} is a Megatron-LM setting that megatron_harts does not support: "
                  f"{NO_EVAL}, all data trains (accepted: a train-only split such as 100,0,0)")


def _check_data_path(args: argparse.Namespace, require_data: bool) -> None:
    paths = args.data_path
    if paths is None or len(paths) == 0:
        if paths is not None:
            _fail("--data-path needs a value: one dataset prefix or trajectory file")
        if require_data:
            _fail("--data-path is required: one dataset prefix or trajectory file")
        args.data_path = None
        return
    if len(paths) > 1:
        def is_number(s):
            try:
                float(s)
                return True
            except ValueError:
                return False
        if len(paths) % 2 == 0 and all(is_number(w) for w in paths[0::2]):
            _fail(f"--data-path {' '.join(paths)}: weighted dataset blends are not supported: give one dataset "
                  "prefix or trajectory file")
        _fail(f"--data-path got {len(paths)} paths: give one dataset prefix or trajectory file")
    args.data_path = paths[0]


def _required(args: argparse.Namespace, *pairs: Tuple[str, str]) -> None:
    missing = [flag for dest, flag in pairs if getattr(args, dest) is None]
    if missing:
        _fail(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required")


def _layer_types(args: argparse.Namespace) -> List[str]:
    freq = args.linear_attention_freq
    n = args.num_layers
    if isinstance(freq, int):
        return ["mla" if (i + 1) % freq == 0 else "kda" for i in range(n)]
    if len(freq) != n:
        _fail(f"--linear-attention-freq pattern has {len(freq)} entries but --num-layers is {n}")
    return ["kda" if v == 1 else "mla" for v in freq]


def _mlp_types(args: argparse.Namespace) -> List[str]:
    n = args.num_layers
    freq = args.moe_layer_freq
    if not args.num_experts:
        if freq is not None:
            _fail("--moe-layer-freq needs --num-experts")
        return ["dense"] * n
    freq = 1 if freq is None else freq
    if isinstance(freq, int):
        return ["moe" if i % freq == 0 else "dense" for i in range(n)]
    if len(freq) != n:
        _fail(f"--moe-layer-freq pattern has {len(freq)} entries but --num-layers is {n}")
    return ["moe" if v == 1 else "dense" for v in freq]


def _pair(args: argparse.Namespace, a: str, b: str, flag_a: str, flag_b: str, default: int, what: str) -> int:
    va, vb = getattr(args, a), getattr(args, b)
    if va is None and vb is None:
        return default
    if va is None or vb is None:
        return va if vb is None else vb
    if va != vb:
        _fail(f"{flag_a} {va} != {flag_b} {vb}: KDA uses one {what} for keys and values")
    return va


def padded_vocab_size(args: argparse.Namespace) -> int:
    """``--vocab-size`` rounded up to a multiple of ``--make-vocab-size-divisible-by`` x TP
    (Megatron-LM's padding; no EOD id is added)."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return -(-args.vocab_size // multiple) * multiple


def _resolve(args: argparse.Namespace, require_data: bool) -> None:
    """Megatron-LM's derived values and our cross-flag checks (in place)."""
    _required(args, ("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"),
              ("num_attention_heads", "--num-attention-heads"), ("vocab_size", "--vocab-size"),
              ("train_iters", "--train-iters"), ("global_batch_size", "--global-batch-size"), ("lr", "--lr"))
    _check_data_path(args, require_data)

    # precision
    if args.bf16 and args.fp64:
        _fail("--bf16 and --fp64 exclude each other")
    if args.fp64 and args.accumulate_allreduce_grads_in_fp32:
        _fail("--accumulate-allreduce-grads-in-fp32 with --fp64 would reduce float64 gradients in float32")
    args.params_dtype = torch.bfloat16 if args.bf16 else (torch.float64 if args.fp64 else torch.float32)
    if args.fp64 and args.moe_router_dtype is None:
        args.moe_router_dtype = "fp64"

    # model shape (Megatron-LM's defaults)
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = (int(4 * args.hidden_size * 2 / 3 / 64) * 64 if args.swiglu else 4 * args.hidden_size)
        if args.ffn_hidden_size < 1:
            _fail(f"--ffn-hidden-size: the default for --hidden-size {args.hidden_size} with --swiglu is 0; give it")
    if args.num_experts == 0:
        args.num_experts = None
    if args.num_experts is not None and args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    elif args.seq_length is not None and args.max_position_embeddings < args.seq_length:
        _fail(f"--max-position-embeddings {args.max_position_embeddings} < --seq-length {args.seq_length}")
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        v = getattr(args, name)
        if isinstance(v, list) and len(v) == 1:
            setattr(args, name, v[0])
    args.padded_vocab_size = padded_vocab_size(args)

    # hybrid pattern
    args.layer_types = _layer_types(args)
    args.mlp_types = _mlp_types(args)
    args.linear_num_heads = _pair(args, "linear_num_key_heads", "linear_num_value_heads", "--linear-num-key-heads",
                                  "--linear-num-value-heads", args.num_attention_heads, "head count")
    args.linear_head_dim = _pair(args, "linear_key_head_dim", "linear_value_head_dim", "--linear-key-head-dim",
                                 "--linear-value-head-dim", 128, "head dim")

    # parallelism
    tp = args.tensor_model_parallel_size
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp
    if args.sequence_parallel and tp == 1:
        warnings.warn("--sequence-parallel has no effect with --tensor-model-parallel-size 1: turned off "
                      "(as Megatron-LM does)", ArgumentsWarning, stacklevel=3)
        args.sequence_parallel = False
    if args.num_experts and tp > 1 and not args.sequence_parallel:
        _fail(f"MoE (--num-experts) with --tensor-model-parallel-size {tp} needs --sequence-parallel "
              "(a megatron-core requirement)")
    if args.expert_model_parallel_size > 1:
        if not args.num_experts:
            _fail("--expert-model-parallel-size > 1 needs --num-experts")
        if args.num_experts % args.expert_model_parallel_size:
            _fail(f"--num-experts {args.num_experts} is not divisible by --expert-model-parallel-size "
                  f"{args.expert_model_parallel_size}")
    if "kda" in args.layer_types and args.linear_num_heads % tp:
        _fail(f"the KDA head count {args.linear_num_heads} (--linear-num-key-heads, default --num-attention-heads) "
              f"is not divisible by --tensor-model-parallel-size {tp}")
    if args.overlap_param_gather and not (args.use_distributed_optimizer and args.overlap_grad_reduce):
        _fail("--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce")

    # schedule
    if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
        _fail("give one of --lr-warmup-fraction and --lr-warmup-iters")
    if args.lr_warmup_fraction is not None and args.lr_warmup_fraction >= 1:
        _fail(f"--lr-warmup-fraction {args.lr_warmup_fraction} must be < 1")
    if args.min_lr > args.lr:
        _fail(f"--min-lr {args.min_lr} > --lr {args.lr}")
    if args.lr_warmup_init > args.lr:
        _fail(f"--lr-warmup-init {args.lr_warmup_init} > --lr {args.lr}")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    warmup = _warmup_steps(args)
    if warmup >= args.lr_decay_iters:
        _fail(f"the warmup ({warmup:g} iterations: --lr-warmup-iters / --lr-warmup-fraction) must be shorter than "
              f"the decay (--lr-decay-iters, default --train-iters: {args.lr_decay_iters})")
    if args.lr_decay_style == "WSD":
        if args.lr_wsd_decay_iters is None:
            _fail("--lr-decay-style WSD needs --lr-wsd-decay-iters")
        if args.lr_wsd_decay_iters > args.lr_decay_iters:
            _fail(f"--lr-wsd-decay-iters {args.lr_wsd_decay_iters} > --lr-decay-iters {args.lr_decay_iters}")
    elif args.lr_wsd_decay_iters is not None:
        _fail("--lr-wsd-decay-iters needs --lr-decay-style WSD")
    if args.weight_decay_incr_style == "constant":
        if args.start_weight_decay is not None or args.end_weight_decay is not None:
            _fail("--start-weight-decay / --end-weight-decay need a non-constant --weight-decay-incr-style "
                  "(constant uses --weight-decay)")
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
    else:
        if args.start_weight_decay is None or args.end_weight_decay is None:
            _fail(f"--weight-decay-incr-style {args.weight_decay_incr_style} needs --start-weight-decay and "
                  "--end-weight-decay")
        if args.end_weight_decay < args.start_weight_decay:
            _fail(f"--end-weight-decay {args.end_weight_decay} < --start-weight-decay {args.start_weight_decay}")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        _fail("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude each other")

    # checkpoints
    if args.save_interval is not None and args.save is None:
        _fail("--save-interval needs --save")
    if args.save is not None and args.save_interval is None:
        _fail("--save needs --save-interval (as in Megatron-LM)")
    if args.ckpt_step is not None and args.load is None:
        _fail("--ckpt-step needs --load (the directory holding that iteration's checkpoint)")

    # tree sharing: the group's own constraints in TreeFlags, those involving other flags here
    tree = _group(TreeFlags, args)
    pp, ep = args.pipeline_model_parallel_size, args.expert_model_parallel_size
    if tree.recompute_producers and pp > 1:
        _fail(f"--tree-recompute-producers: the pipeline schedules (--pipeline-model-parallel-size {pp}) keep "
              "producers' activations; use pipeline size 1")
    if tree.memory_budget_gib is not None and pp > 1:
        _fail(f"--tree-memory-budget: the pipeline schedules (--pipeline-model-parallel-size {pp}) keep every "
              "producer's activations until its window closes; a per-window choice runs with pipeline size 1")
    if ep > 1 and args.num_experts:
        # the replicas of an expert-parallel group exchange tokens in every MoE layer of every microbatch:
        # microbatches of different sizes need the all-to-all dispatcher, and every replica runs the same
        # number of microbatches (idle slots run a placeholder) in lockstep, which sharing windows break
        if args.moe_token_dispatcher_type != "alltoall":
            _fail(f"--expert-model-parallel-size {ep} needs --moe-token-dispatcher-type alltoall (microbatches "
                  f"differ in size across the replicas that exchange tokens; {args.moe_token_dispatcher_type} needs "
                  "equal sizes)")
        if tree.sharing == "windows":
            _fail(f"--tree-sharing windows with --expert-model-parallel-size {ep}: window closes are not aligned "
                  "across the replicas of an expert-parallel group yet; use --tree-sharing within")
    if tree.microbatch_tokens is None:
        if args.seq_length is None:
            _fail("--tree-microbatch-tokens (or --seq-length, its default) is required")
        tree = dataclasses.replace(tree, microbatch_tokens=args.seq_length)
    elif args.seq_length is not None and tree.microbatch_tokens < args.seq_length and ep > 1:
        # a longer trajectory is cut into pieces (docs/training.md), which the replicas of an expert-parallel
        # group cannot run in lockstep
        _fail(f"--tree-microbatch-tokens {tree.microbatch_tokens} < --seq-length {args.seq_length} with "
              f"--expert-model-parallel-size {ep}: a trajectory must fit one microbatch there (longer ones are cut "
              "into pieces only without expert parallelism)")
    if tree.plan_report is not None:
        parent = os.path.dirname(os.path.abspath(tree.plan_report))
        if not os.path.isdir(parent):
            _fail(f"--tree-plan-report {tree.plan_report}: directory {parent} does not exist")
    if tree.logit_probe is not None:
        parent = os.path.dirname(os.path.abspath(tree.logit_probe))
        if not os.path.isdir(parent):
            _fail(f"--tree-logit-probe {tree.logit_probe}: directory {parent} does not exist")
        if os.path.exists(tree.logit_probe) and not os.path.isdir(tree.logit_probe):
            _fail(f"--tree-logit-probe {tree.logit_probe}: exists and is not a directory")
    _set_group(args, "tree", tree)
    args.tree_mode = tree.tree_mode
    args.no_tree_replay = not tree.replay
    if tree.cost_calibration is not None:
        cost_model(args)    # read and check now, before any process group starts

    # RL objective: the groups' constraints in ObjectiveConfig and RLUpdateConfig, those involving other
    # flags (or whether a flag was given at all) here
    if args.rl_objective != "ppo":
        given = [f for f, v in (("--clip-ratio-low", args.clip_ratio_low), ("--clip-ratio-high", args.clip_ratio_high))
                 if v is not None]
        if given:
            _fail(f"{', '.join(given)} only appl{'ies' if len(given) == 1 else 'y'} to --rl-objective ppo")
    if args.loss_agg_mode == "seq-mean-token-sum-norm" and args.rl_loss_norm_length is None:
        args.rl_loss_norm_length = args.seq_length
    objective = _group(ObjectiveConfig, args)
    update = _group(RLUpdateConfig, args)
    if update.ref_load is not None and not os.path.isdir(update.ref_load):
        _fail(f"--ref-load {update.ref_load}: no such directory")
    kl_ref = objective.kl_coef > 0 and objective.kl_to == "ref"
    if update.ref_load is not None and not kl_ref:
        _fail(f"--ref-load {update.ref_load} is read only for the KL penalty: give --kl-coef > 0 (with --kl-to ref)")
    _set_group(args, "objective", objective)
    _set_group(args, "rl_update", update)


def _group(cls, args: argparse.Namespace):
    """Flag group ``cls`` from the parsed flags (by field name); its refusals as ``ArgumentsError``
    (without the dataclass field the message ends with)."""
    try:
        return cls(**group_kwargs(cls, args))
    except ValueError as e:
        _fail(re.sub(rf" \({cls.__name__}\.[a-z_]+\)$", "", str(e)))


def _set_group(args: argparse.Namespace, attr: str, instance) -> None:
    """Keep the group instance as ``args.<attr>`` and its values at their flags' destinations."""
    setattr(args, attr, instance)
    set_namespace(args, instance)


def _warmup_steps(args: argparse.Namespace) -> float:
    if args.lr_warmup_fraction is not None:
        return args.lr_warmup_fraction * args.lr_decay_iters
    return args.lr_warmup_iters


def parse_args(argv: Optional[Sequence[str]] = None, *, require_data: bool = True) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``) into a checked namespace (module docstring).

    ``require_data=False``: ``--data-path`` is optional (trajectories fed in memory).  Raises
    ``ArgumentsError``; ``--help`` prints the flags and raises ``SystemExit(0)``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    _refuse_leftovers(extras, parser)
    _check_accepted_values(args)
    _resolve(args, require_data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # megatron-core's import and config notices: shown at build time
        _build_config(args, kda_backend=None, attention_backend=None, use_cpu_initialization=True)
    return args


def parse_args_or_exit(argv: Optional[Sequence[str]] = None, *, require_data: bool = True) -> argparse.Namespace:
    """``parse_args`` for a ``main``: a refusal prints one ``error:`` line on stderr and exits 2;
    our warnings print as one ``warning:`` line each."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ArgumentsWarning)
        try:
            args = parse_args(argv, require_data=require_data)
        except ArgumentsError as e:
            args = e
    for w in caught:
        if issubclass(w.category, ArgumentsWarning):
            print(f"warning: {w.message}", file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    if isinstance(args, ArgumentsError):
        print(f"error: {args}", file=sys.stderr)
        sys.exit(2)
    return args


# ---------------------------------------------------------------------------------------------
# builders
# ---------------------------------------------------------------------------------------------
def data_parallel_size(args: argparse.Namespace, world_size: int) -> int:
    """The data-parallel size of ``world_size`` ranks; refuses sizes the parallel layout cannot use."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if not isinstance(world_size, int) or world_size < 1:
        _fail(f"world size must be a positive integer, got {world_size!r}")
    if world_size % (tp * pp * cp):
        _fail(f"the world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
              f"--pipeline-model-parallel-size {pp}")
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    if args.num_experts and world_size % (ep * etp * pp):
        _fail(f"the world size {world_size} is not divisible by --expert-model-parallel-size {ep} x "
              f"--expert-tensor-parallel-size {etp} x --pipeline-model-parallel-size {pp}")
    return world_size // (tp * pp * cp)


#: the largest MLA q/k head dim (nope + rope) at which ``auto`` takes FlexAttention on CUDA without
#: flash-attn-4; above it ``varlen``.  Where flash-attn-4 runs (``ops.key_paths.fa4_available``) and the
#: model is bf16, ``auto`` takes ``fa4`` (its block-sparse kernels) at every head dim: on one H100 (bf16,
#: MLA 192/128, 20k-32k rows) fwd+bwd per visible pair over causal SDPA's 1.19-1.70x against 1.29-2.07x
#: for flash-attn-4 over gathered key paths, on trees and compaction layouts alike.  Without it, measured
#: on an H200 (torch 2.11, bf16, 16 heads,
#: ~30k-row SWE trees, fwd+bwd, time per visible pair over causal SDPA's): q/k 128: flex 1.85-1.95x,
#: varlen with torch's flash kernels 2.07-2.20x, with flash-attn-4 1.24-1.35x; q/k 192 / v 128: flex
#: 3.77-3.88x (its Triton kernel pads 192 to 256), varlen 2.53-2.76x, with flash-attn-4 1.26-1.37x.
#: Head dims beyond the flash kernels' (``ops.key_paths.FLASH_MAX_HEAD_DIM``) stay on flex.
FLEX_MAX_QK_HEAD_DIM = 128


def resolved_backends(args: argparse.Namespace, *, cuda: Optional[bool] = None) -> Tuple[str, str]:
    """(KDA backend, tree-attention backend) for this machine; ``auto`` picks fla and fa4 where
    flash-attn-4 runs and the model is bf16, else flex (q/k head dims up to ``FLEX_MAX_QK_HEAD_DIM``) or varlen (above) on
    CUDA, reference / sdpa with --fp64 or without CUDA.  Refuses fla / flex / varlen's flash kernel where they cannot run."""
    import importlib.util

    from ..ops.tree_kda import KDA_BACKENDS

    cuda = torch.cuda.is_available() if cuda is None else cuda
    tree = args.tree
    kda, attn = tree.kda_backend, tree.tree_attention_backend
    fast = cuda and not args.fp64
    # fla registers itself in KDA_BACKENDS when fla-core is installed (found, not imported: no Triton on CPUs)
    fla_installed = "fla" in KDA_BACKENDS or importlib.util.find_spec("fla") is not None
    if kda == "auto":
        kda = "fla" if fast and fla_installed else "reference"
        if fast and not fla_installed:      # said once a process (the default warning filter)
            warnings.warn("--tree-kda-backend auto: fla-core is not installed, so KDA runs the plain torch "
                          "reference on CUDA, far slower (pip install fla-core==0.6.0)", RuntimeWarning,
                          stacklevel=2)
    if attn == "auto":
        qk_dim = args.qk_head_dim + args.qk_pos_emb_head_dim
        v_dim = args.v_head_dim
        varlen = FLEX_MAX_QK_HEAD_DIM < qk_dim and max(qk_dim, v_dim) <= FLASH_MAX_HEAD_DIM
        if fast and args.bf16 and fa4_available("cuda", (qk_dim, v_dim or qk_dim)):
            attn = "fa4"
        else:
            attn = ("varlen" if varlen else "flex") if fast else "sdpa"
    if kda == "fla":
        if not cuda:
            _fail("--tree-kda-backend fla needs CUDA (use reference on the CPU)")
        if not fla_installed:
            _fail("--tree-kda-backend fla: fla-core is not installed here (pip install fla-core==0.6.0)")
        if tree.kda_chunk_size != 64:
            _fail(f"--tree-kda-backend fla runs chunks of 64: --tree-chunk-size {tree.kda_chunk_size} needs the "
                  "reference backend")
    if attn == "flex" and not cuda:
        _fail("--tree-attention-backend flex needs CUDA (use sdpa or reference on the CPU)")
    if attn == "interval":
        from ..ops.interval_attention import interval_available
        reason = interval_available("cuda" if cuda else "cpu")
        if reason is not None:
            _fail(f"--tree-attention-backend interval: {reason} (use sdpa or reference on the CPU)")
        if args.fp64:
            _fail("--tree-attention-backend interval runs fp16, bf16 or fp32: with --fp64 use sdpa or reference")
    if attn == "fa4":
        qk_dim = args.qk_head_dim + args.qk_pos_emb_head_dim
        dims = (qk_dim, args.v_head_dim or qk_dim)
        if not (cuda and fa4_available("cuda", dims)):
            _fail(f"--tree-attention-backend fa4 needs a Hopper GPU with flash-attn-4 {FA4_VERSION} installed and "
                  f"q/k, v head dims {dims} in its range (use varlen, flex or sdpa)")
        if not args.bf16:
            _fail("--tree-attention-backend fa4 runs bf16: add --bf16, or use varlen, flex or sdpa in "
                  + ("fp64" if args.fp64 else "fp32"))
    return kda, attn


def _config_error(err: BaseException, parser: argparse.ArgumentParser) -> ArgumentsError:
    """megatron-core's message, with the flags of the config fields it names."""
    msg = str(err).strip() or type(err).__name__
    if msg.startswith("--") or " --" in msg:
        return ArgumentsError(f"{PROG}: {msg}")
    flags = _dest_flags(parser)
    aliases = {"num_moe_experts": "--num-experts", "qk_nope_head_dim": "--qk-head-dim",
               "qk_rope_head_dim": "--qk-pos-emb-head-dim", "layernorm_epsilon": "--norm-epsilon",
               "gated_linear_unit": "--swiglu", "linear_num_heads": "--linear-num-key-heads",
               "linear_head_dim": "--linear-key-head-dim"}
    aliases.update({spec.field: spec.name for spec in flag_fields(TreeFlags)})
    named = []
    for field in sorted(set(re.findall(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)+", msg))):
        flag = aliases.get(field) or flags.get(field)
        if flag:
            named.append(f"{field} = {flag}")
    suffix = f" [{'; '.join(named)}]" if named else ""
    return ArgumentsError(f"{PROG}: megatron-core refused the configuration: {msg}{suffix}")


def _build_config(args: argparse.Namespace, *, kda_backend: Optional[str], attention_backend: Optional[str],
                  use_cpu_initialization: bool, cuda: bool = False):
    import torch.nn.functional as F

    from ..models.config import HybridConfig
    from ..models.model import validate_config
    from ..patches import wgrad_accumulation

    kw = dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, kv_channels=args.kv_channels,
        normalization=args.normalization, layernorm_epsilon=args.layernorm_epsilon,
        gated_linear_unit=args.swiglu, activation_func=F.silu if args.swiglu else F.gelu,
        # megatron's fused (torch.compile'd) SwiGLU, with the experts' routing weights folded in, on the GPU
        bias_activation_fusion=bool(cuda and args.swiglu and args.bias_swiglu_fusion),
        add_bias_linear=args.add_bias_linear, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
        params_dtype=args.params_dtype, pipeline_dtype=args.params_dtype, bf16=args.bf16, fp16=False,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        context_parallel_size=args.context_parallel_size, sequence_parallel=args.sequence_parallel,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        num_moe_experts=args.num_experts, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_router_topk=args.moe_router_topk, moe_router_score_function=args.moe_router_score_function,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_router_num_groups=args.moe_router_num_groups, moe_router_group_topk=args.moe_router_group_topk,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff, moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type, moe_router_dtype=args.moe_router_dtype,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        moe_token_drop_policy=args.moe_token_drop_policy, moe_grouped_gemm=False,
        q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank, qk_nope_head_dim=args.qk_head_dim,
        qk_rope_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim,
        mla_rope=args.position_embedding_type == "rope", mla_rotary_base=float(args.rotary_base),
        linear_num_heads=args.linear_num_heads, linear_head_dim=args.linear_head_dim,
        linear_conv_kernel_dim=args.linear_conv_kernel_dim,
        layer_types=list(args.layer_types), mlp_types=list(args.mlp_types), tree_mode=args.tree.tree_mode,
        calculate_per_token_loss=True, use_cpu_initialization=use_cpu_initialization,
        gradient_accumulation_fusion=bool(cuda and args.gradient_accumulation_fusion
                                          and wgrad_accumulation.available()),
        deallocate_pipeline_outputs=True,
    )
    if args.recompute_modules is not None:
        kw["recompute_modules"] = list(args.recompute_modules)
    # the tree flags that configure the model, by field name (kda_chunk_size, the backends, ...)
    tree = dataclasses.replace(args.tree, kda_backend=kda_backend or "reference",
                               tree_attention_backend=attention_backend or "sdpa")
    kw.update(shared_fields(tree, HybridConfig))
    try:
        config = HybridConfig(**kw)
        validate_config(config)
    except (ValueError, AssertionError, TypeError) as e:
        raise _config_error(e, build_parser()) from None
    return config


def hybrid_config(args: argparse.Namespace, *, world_size: Optional[int] = None, device: Optional[str] = None,
                  use_cpu_initialization: Optional[bool] = None):
    """The model's ``HybridConfig`` from parsed flags, checked by ``models.model.validate_config``.

    ``world_size``: checked against the parallel sizes when given.  ``device``: the device type
    the model runs on ("cuda" or "cpu"; default: "cuda" when available).  Backends ``auto`` are
    resolved for it (``resolved_backends``); ``use_cpu_initialization`` defaults to
    ``--use-cpu-initialization`` or "not on CUDA".  Raises ``ArgumentsError`` naming the flags.
    """
    if world_size is not None:
        data_parallel_size(args, world_size)
    if device is not None and device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    cuda = torch.cuda.is_available() if device is None else device == "cuda"
    kda, attn = resolved_backends(args, cuda=cuda)
    if use_cpu_initialization is None:
        use_cpu_initialization = bool(args.use_cpu_initialization) or not cuda
    return _build_config(args, kda_backend=kda, attention_backend=attn, use_cpu_initialization=use_cpu_initialization,
                         cuda=cuda)


def optimizer_config(args: argparse.Namespace):
    """megatron-core's optimizer config (``AdamOptimizerConfig`` / ``SGDOptimizerConfig``, both
    ``OptimizerConfig``) as Megatron-LM builds it from the same flags (Adam is AdamW)."""
    from megatron.core.optimizer import AdamOptimizerConfig, SGDOptimizerConfig

    common = dict(lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, bf16=args.bf16, fp16=False,
                  params_dtype=args.params_dtype, use_distributed_optimizer=args.use_distributed_optimizer,
                  overlap_param_gather=args.overlap_param_gather, clip_grad=args.clip_grad)
    if args.optimizer == "adam":
        return AdamOptimizerConfig(adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                                   **common)
    return SGDOptimizerConfig(sgd_momentum=args.sgd_momentum, **common)


def ddp_config(args: argparse.Namespace, *, data_parallel_size: int = 1):
    """megatron-core's ``DistributedDataParallelConfig``: gradients reduced in fp32 with --bf16 (or
    --accumulate-allreduce-grads-in-fp32), in the parameter dtype otherwise; buckets as Megatron-LM
    sizes them when overlapping the reduce (one bucket otherwise)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    bucket = max(40_000_000, 1_000_000 * data_parallel_size) if args.overlap_grad_reduce else None
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=bool(args.bf16 or args.accumulate_allreduce_grads_in_fp32),
        overlap_grad_reduce=args.overlap_grad_reduce, overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad, bucket_size=bucket)


def scheduler_kwargs(args: argparse.Namespace) -> dict:
    """Keyword arguments of megatron-core's ``OptimizerParamScheduler(optimizer, **kwargs)``.

    Megatron-LM's iteration-based schedule, in iterations: warmup ``--lr-warmup-iters`` (or
    ``--lr-warmup-fraction`` x decay), decay ``--lr-decay-iters`` (default ``--train-iters``),
    weight-decay ramp over ``--train-iters``.  Steps count iterations, not samples: call
    ``scheduler.step(1)`` once per iteration.  (Megatron-LM counts samples, steps of
    global-batch-size; every ratio, hence every learning rate, is the same.)
    """
    return dict(
        init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=_warmup_steps(args), lr_decay_steps=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style, start_wd=args.start_weight_decay, end_wd=args.end_weight_decay,
        wd_incr_steps=args.train_iters, wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        wsd_decay_steps=args.lr_wsd_decay_iters if args.lr_decay_style == "WSD" else None,
        lr_wsd_decay_style=args.lr_wsd_decay_style if args.lr_decay_style == "WSD" else None,
    )


def cost_model(args: argparse.Namespace):
    """The planner's ``CostModel``: ``--tree-cost-calibration`` (when given) at ``--tree-chunk-size``."""
    from ..planner.cost_model import CalibrationError, CostModel, load_calibration

    tree = args.tree
    if tree.cost_calibration is None:
        return CostModel(chunk_size=tree.kda_chunk_size)
    try:
        model = load_calibration(tree.cost_calibration)
    except CalibrationError as e:
        _fail(f"--tree-cost-calibration {e}")
    if model.chunk_size != tree.kda_chunk_size:
        _fail(f"--tree-cost-calibration {tree.cost_calibration} was fitted at chunk size {model.chunk_size}, "
              f"but --tree-chunk-size is {tree.kda_chunk_size}: calibrate at the training chunk size")
    return model


def objective_kwargs(args: argparse.Namespace) -> dict:
    """Keyword arguments of ``rl.objectives.ObjectiveConfig`` (copied by field name)."""
    return group_kwargs(ObjectiveConfig, args)


def rl_update_kwargs(args: argparse.Namespace) -> dict:
    """Keyword arguments of ``training.rl_update.RLUpdateConfig`` (copied by field name)."""
    return group_kwargs(RLUpdateConfig, args)
