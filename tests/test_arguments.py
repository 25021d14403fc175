"""megatron_harts.training.arguments: Megatron-LM flag compatibility, refusals, builders (CPU, fast)."""
import json
import math
import re
import shlex
import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron_harts import megatron_lm
from megatron_harts.cli import CliError
from megatron_harts.training import arguments as A
from megatron_harts.training.arguments import ArgumentsError, parse_args

# a Kimi-Linear-shaped launch line in the style of Megatron-LM's examples/ scripts
KIMI_LINE = """
    --num-layers 24 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16
    --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
    --normalization RMSNorm --norm-epsilon 1e-5 --init-method-std 0.02
    --attention-dropout 0.0 --hidden-dropout 0.0 --position-embedding-type none
    --vocab-size 163840 --make-vocab-size-divisible-by 128 --seq-length 8192 --max-position-embeddings 8192
    --multi-latent-attention --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128
    --linear-attention-freq 4 --linear-num-key-heads 16 --linear-num-value-heads 16
    --linear-key-head-dim 128 --linear-value-head-dim 128 --linear-conv-kernel-dim 4
    --num-experts 64 --moe-ffn-hidden-size 1024 --moe-router-topk 8 --moe-layer-freq ([0]+[1]*23)
    --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3
    --moe-router-topk-scaling-factor 2.446 --moe-router-num-groups 8 --moe-router-group-topk 4
    --moe-aux-loss-coeff 1e-3 --moe-shared-expert-intermediate-size 1024
    --moe-token-dispatcher-type alltoall --moe-router-dtype fp32
    --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1
    --expert-model-parallel-size 8 --context-parallel-size 1
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    --distributed-backend nccl --distributed-timeout-minutes 30
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    --train-iters 1000 --global-batch-size 256 --micro-batch-size 1 --seed 42 --bf16
    --optimizer adam --lr 1e-5 --min-lr 1e-6 --lr-decay-style cosine --lr-warmup-iters 50
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0
    --save /tmp/ckpt --load /tmp/ckpt --save-interval 100 --ckpt-format torch_dist
    --log-interval 10 --tensorboard-dir /tmp/tb --log-throughput
    --data-path /data/rollouts --tokenizer-type NullTokenizer --split 100,0,0
    --use-mcore-models --no-masked-softmax-fusion --no-gradient-accumulation-fusion --transformer-impl local
    --tree-sharing within --tree-microbatch-tokens 16384
"""

# the smallest complete command line
BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --vocab-size 100 --train-iters 100 "
        "--global-batch-size 8 --lr 1e-4 --data-path rollouts.jsonl --seq-length 128")


def parse(extra="", base=BASE, **kw):
    return parse_args(shlex.split(base + " " + extra), **kw)


def refused(extra, *needles, base=BASE, **kw):
    """parse_args raises ArgumentsError whose message contains every needle; returns the message."""
    with pytest.raises(ArgumentsError) as ei:
        parse(extra, base=base, **kw)
    msg = str(ei.value)
    assert msg.startswith("harts-pretrain: "), msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# ---------------------------------------------------------------------------------------------
# a real launch line
# ---------------------------------------------------------------------------------------------

def test_kimi_launch_line_namespace():
    args = parse_args(shlex.split(KIMI_LINE))
    assert args.layer_types == ["kda", "kda", "kda", "mla"] * 6
    assert args.mlp_types == ["dense"] + ["moe"] * 23
    assert args.params_dtype is torch.bfloat16 and args.bf16 and not args.fp64
    assert args.padded_vocab_size == 163840
    assert args.linear_num_heads == 16 and args.linear_head_dim == 128
    assert args.data_path == "/data/rollouts"
    assert args.tree_sharing == "within" and args.tree_mode and args.tree_planner == "l1"
    assert args.tree_microbatch_tokens == 16384 and args.tree_chunk_size == 64 and args.tree_replay
    assert args.tree_kda_backend == "auto" and args.tree_attention_backend == "auto"
    assert args.expert_tensor_parallel_size == 2          # Megatron-LM: defaults to TP
    assert args.lr_decay_iters == 1000                    # Megatron-LM: defaults to --train-iters
    assert args.start_weight_decay == args.end_weight_decay == 0.1
    assert args.moe_aux_loss_coeff == 1e-3                # single-entry lists become scalars
    assert args.moe_router_load_balancing_type == "aux_loss"
    assert args.rl_objective == "ppo" and args.clip_ratio_low == args.clip_ratio_high == 0.2
    assert args.save_interval == 100 and args.global_batch_size == 256


def test_kimi_launch_line_hybrid_config(no_cuda):
    from megatron_harts.models.config import HybridConfig

    args = parse_args(shlex.split(KIMI_LINE))
    cfg = A.hybrid_config(args, world_size=16)
    assert isinstance(cfg, HybridConfig)
    assert cfg.resolved_layer_types() == ["kda", "kda", "kda", "mla"] * 6
    assert cfg.resolved_mlp_types() == ["dense"] + ["moe"] * 23
    expect = dict(
        num_layers=24, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=16, normalization="RMSNorm",
        layernorm_epsilon=1e-5, gated_linear_unit=True, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=0.02, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        bf16=True, fp16=False, tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
        expert_model_parallel_size=8, expert_tensor_parallel_size=2, context_parallel_size=1,
        sequence_parallel=True, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
        num_moe_experts=64, moe_ffn_hidden_size=1024, moe_router_topk=8, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-3, moe_router_topk_scaling_factor=2.446,
        moe_router_num_groups=8, moe_router_group_topk=4, moe_aux_loss_coeff=1e-3, moe_z_loss_coeff=None,
        moe_router_load_balancing_type="aux_loss", moe_shared_expert_intermediate_size=1024,
        moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32", moe_grouped_gemm=False,
        moe_expert_capacity_factor=None, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, mla_rope=False, linear_num_heads=16, linear_head_dim=128,
        linear_conv_kernel_dim=4, kda_chunk_size=64, kda_backend="reference", tree_attention_backend="sdpa",
        tree_mode=True, calculate_per_token_loss=True, use_cpu_initialization=True,
        gradient_accumulation_fusion=False)
    for field, value in expect.items():
        assert getattr(cfg, field) == value, field
    assert cfg.activation_func is F.silu


def test_mlp_and_attention_defaults_follow_megatron_lm():
    args = parse()
    assert args.ffn_hidden_size == 4 * 64                      # no --swiglu: 4h
    assert parse("--swiglu --hidden-size 96").ffn_hidden_size == int(4 * 96 * 2 / 3 / 64) * 64
    assert args.normalization == "RMSNorm" and args.position_embedding_type == "none"
    assert args.hidden_dropout == args.attention_dropout == 0.0
    assert args.linear_num_heads == 4 and args.linear_head_dim == 128   # heads follow --num-attention-heads
    assert args.mlp_types == ["dense"] * 4
    assert args.num_experts is None and parse("--num-experts 0").num_experts is None
    assert parse("--num-experts 4").moe_ffn_hidden_size == args.ffn_hidden_size
    assert args.max_position_embeddings == 128
    cfg = A.hybrid_config(args)
    assert cfg.activation_func is F.gelu and not cfg.gated_linear_unit and cfg.add_bias_linear
    rope = parse("--position-embedding-type rope --rotary-base 50000")
    cfg = A.hybrid_config(rope)
    assert cfg.mla_rope and cfg.mla_rotary_base == 50000.0


def test_linear_attention_freq_patterns():
    # Megatron-LM's int N: layer i (0-based) is full attention iff (i + 1) % N == 0
    assert parse("--num-layers 8 --linear-attention-freq 4").layer_types == (["kda"] * 3 + ["mla"]) * 2
    assert parse("--num-layers 6 --linear-attention-freq 2").layer_types == ["kda", "mla"] * 3
    assert parse("--linear-attention-freq 1").layer_types == ["mla"] * 4        # all full attention
    assert parse("--linear-attention-freq 5").layer_types == ["kda"] * 4        # no full attention
    # list patterns: 1 = linear attention (KDA), 0 = full attention (MLA)
    assert parse("--num-layers 8 --linear-attention-freq ([1]*3+[0]*1)*2").layer_types == \
        ["kda", "kda", "kda", "mla"] * 2
    assert parse("--linear-attention-freq [0,1,1,0]").layer_types == ["mla", "kda", "kda", "mla"]
    # KDA head flags: one of a pair given, the other follows
    args = parse("--linear-num-value-heads 2 --linear-key-head-dim 16")
    assert args.linear_num_heads == 2 and args.linear_head_dim == 16


def test_moe_layer_freq_patterns():
    # Megatron-LM's int N: layer i is MoE iff i % N == 0 (default 1: every layer)
    assert parse("--num-experts 4").mlp_types == ["moe"] * 4
    assert parse("--num-experts 4 --moe-layer-freq 2").mlp_types == ["moe", "dense", "moe", "dense"]
    assert parse("--num-experts 4 --moe-layer-freq ([0]+[1]*3)").mlp_types == ["dense", "moe", "moe", "moe"]
    assert A.hybrid_config(parse("--num-experts 4 --moe-layer-freq [1,1,0,0]")).resolved_mlp_types() == \
        ["moe", "moe", "dense", "dense"]


def test_equals_form_and_megatron_aliases():
    args = parse("--lr=3e-4 --override-opt-param-scheduler --save /tmp/c --persistent-save-interval 5")
    assert args.lr == 3e-4 and args.override_opt_param_scheduler and args.save_interval == 5
    args = parse("--use-checkpoint-opt_param-scheduler --no-load-optim --finetune --exit-signal-handler "
                 "--exit-signal SIGUSR1 --no-bias-swiglu-fusion --no-rope-fusion --no-persist-layer-norm "
                 "--no-create-attention-mask-in-dataloader --attention-backend auto --eval-iters 0")
    assert args.use_checkpoint_opt_param_scheduler and args.no_load_optim and args.finetune
    assert args.exit_signal.name == "SIGUSR1"


# ---------------------------------------------------------------------------------------------
# refusals: unknown flags, unsupported Megatron-LM flags, values, combinations
# ---------------------------------------------------------------------------------------------

def test_unknown_flags_are_named_together():
    msg = refused("--foo --bar 3 --baz=x", "unrecognized arguments: --foo --bar --baz")
    assert "Megatron-LM" not in msg
    msg = refused("--lr-decay-styel cosine", "unrecognized arguments: --lr-decay-styel", "--lr-decay-style?")
    refused("stray", "unrecognized arguments: stray")


def test_abbreviations_are_not_accepted():
    # argparse would expand a unique prefix; Megatron-LM disables that and so do we
    refused("--tree-shar off", "unrecognized arguments: --tree-shar")
    refused("--lr-warmup 5", "unrecognized arguments: --lr-warmup")


def test_unsupported_megatron_flags_with_reasons():
    refused("--fp8-format hybrid",
            "--fp8-format (fp8 needs Transformer Engine", "is a Megatron-LM flag that megatron_harts does not support")
    refused("--fp16", "--fp16", "use --bf16")
    refused("--num-layers-per-virtual-pipeline-stage 2", "--num-layers-per-virtual-pipeline-stage", "virtual")
    refused("--moe-grouped-gemm", "--moe-grouped-gemm", "SequentialMLP")
    refused("--grpo-kl-beta 0.1", "--grpo-kl-beta", "use --kl-coef")
    refused("--train-samples 1000", "--train-samples", "--train-iters")
    refused("--wandb-project p", "--wandb-project", "TensorBoard")
    # no specific reason known: still named as a Megatron-LM flag
    refused("--manual-gc", "--manual-gc is a Megatron-LM flag that megatron_harts does not support")
    # several, together with unknown ones, all named in one message
    msg = refused("--fp8-format=e4m3 --foo --qk-layernorm --fp16",
                  "--fp8-format", "--qk-layernorm", "--fp16", "are Megatron-LM flags", "unrecognized arguments: --foo")
    assert "\n" not in msg


def test_every_unsupported_megatron_flag_is_refused_by_name():
    unsupported = sorted(A.MEGATRON_LM_FLAGS - A.supported_flags())
    assert len(unsupported) > 500
    msg = refused(" ".join(unsupported), "are Megatron-LM flags that megatron_harts does not support")
    assert "unrecognized" not in msg
    named = set(msg.split(": ", 1)[1].replace(",", " ").split())
    assert set(unsupported) <= named


def test_flag_tables_are_consistent():
    supported = A.supported_flags()
    # every flag we accept is Megatron-LM's or listed as ours, and ours are not Megatron-LM's
    assert supported - {"--help"} - A.OWN_FLAGS <= A.MEGATRON_LM_FLAGS
    assert not (A.OWN_FLAGS & A.MEGATRON_LM_FLAGS)
    assert A.OWN_FLAGS <= supported
    assert set(megatron_lm.UNSUPPORTED_REASONS) <= A.MEGATRON_LM_FLAGS - supported
    for flag in ("--num-layers", "--moe-layer-freq", "--linear-attention-freq", "--fp8-format",
                 "--override-opt_param-scheduler", "--exit-signal-handler", "--tensorboard-dir"):
        assert flag in A.MEGATRON_LM_FLAGS


@pytest.mark.parametrize("extra, needles", [
    ("--context-parallel-size 2", ("--context-parallel-size 2", "context-parallel", "accepted: 1")),
    ("--micro-batch-size 4", ("--micro-batch-size 4", "--tree-microbatch-tokens")),
    ("--tokenizer-type GPT2BPETokenizer", ("--tokenizer-type GPT2BPETokenizer", "NullTokenizer")),
    ("--ckpt-format torch", ("--ckpt-format torch", "torch_dist")),
    ("--normalization LayerNorm", ("--normalization LayerNorm", "RMSNorm")),
    ("--position-embedding-type learned_absolute", ("--position-embedding-type learned_absolute", "none or rope")),
    ("--optimizer muon", ("--optimizer muon", "adam or sgd")),
    ("--moe-token-dispatcher-type flex", ("--moe-token-dispatcher-type flex", "DeepEP")),
    ("--transformer-impl transformer_engine", ("--transformer-impl transformer_engine", "local")),
    ("--eval-iters 10", ("--eval-iters 10", "evaluation")),
    ("--split 949,50,1", ("--split 949,50,1", "100,0,0")),
    ("--rope-type yarn", ("--rope-type yarn", "plain RoPE")),
])
def test_megatron_flags_accepted_with_some_values_only(extra, needles):
    refused(extra, "is a Megatron-LM setting that megatron_harts does not support", *needles)


def test_harmless_values_of_restricted_flags_parse():
    args = parse("--context-parallel-size 1 --micro-batch-size 1 --tokenizer-type NullTokenizer "
                 "--ckpt-format torch_dist --split 100,0,0 --distributed-backend gloo --rope-type rope")
    assert args.context_parallel_size == 1 and args.distributed_backend == "gloo"


@pytest.mark.parametrize("extra, needles", [
    ("--tree-sharing foo", ("--tree-sharing", "foo")),
    ("--tree-planner greedy", ("--tree-planner", "greedy")),
    ("--tree-chunk-size 0", ("--tree-chunk-size", ">= 1")),
    ("--tree-microbatch-tokens -5", ("--tree-microbatch-tokens",)),
    ("--tree-kda-backend triton", ("--tree-kda-backend",)),
    ("--loss-agg-mode mean", ("--loss-agg-mode",)),
    ("--lr nan", ("--lr", "finite")),
    ("--num-layers two", ("--num-layers",)),
    ("--linear-attention-freq __import__('os')", ("--linear-attention-freq", "invalid pattern")),
    ("--linear-attention-freq [1]*100000", ("--linear-attention-freq", "65536")),
    ("--linear-attention-freq [1,2,0,1]", ("--linear-attention-freq", "0 or 1")),
    ("--linear-attention-freq 0", ("--linear-attention-freq", ">= 1")),
    ("--linear-attention-freq [1,0]", ("--linear-attention-freq", "2 entries", "--num-layers is 4")),
    ("--num-experts 4 --moe-layer-freq [1,0,1]", ("--moe-layer-freq", "3 entries")),
    ("--exit-signal SIGFOO", ("--exit-signal", "SIGFOO")),
])
def test_bad_values_name_the_flag(extra, needles):
    refused(extra, *needles)


@pytest.mark.parametrize("extra, needles", [
    ("--bf16 --fp64", ("--bf16", "--fp64")),
    ("--fp64 --accumulate-allreduce-grads-in-fp32", ("--fp64", "--accumulate-allreduce-grads-in-fp32")),
    ("--num-experts 4 --tensor-model-parallel-size 2", ("--tensor-model-parallel-size 2", "--sequence-parallel")),
    ("--num-experts 6 --expert-model-parallel-size 4", ("--num-experts 6", "--expert-model-parallel-size 4")),
    ("--expert-model-parallel-size 2", ("--expert-model-parallel-size", "--num-experts")),
    ("--num-experts 4 --expert-model-parallel-size 2", ("--expert-model-parallel-size 2",
                                                        "--moe-token-dispatcher-type alltoall")),
    ("--num-experts 4 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --tree-sharing windows",
     ("--tree-sharing windows", "--expert-model-parallel-size 2", "--tree-sharing within")),
    ("--tree-pp-schedule gpipe", ("--tree-pp-schedule", "consumer-1f1b")),
    ("--tree-sharing off --tree-planner l1l2", ("--tree-planner l1l2", "--tree-sharing off", "allowed: ffd")),
    ("--tree-sharing within --tree-planner l1l2", ("--tree-planner l1l2", "--tree-sharing windows")),
    ("--tree-sharing within --tree-planner ffd", ("--tree-planner ffd", "--tree-sharing off")),
    ("--tree-sharing windows --tree-planner l1", ("--tree-planner l1", "allowed: l1l2")),
    ("--tree-sharing off --no-tree-replay", ("--no-tree-replay", "--tree-sharing off")),
    ("--tree-microbatch-tokens 64 --num-experts 4 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall",
     ("--tree-microbatch-tokens 64", "--seq-length 128", "--expert-model-parallel-size 2", "pieces")),
    ("--save-interval 10", ("--save-interval", "--save")),
    ("--save /tmp/x", ("--save", "--save-interval")),
    ("--linear-num-key-heads 4 --linear-num-value-heads 8", ("--linear-num-key-heads 4", "--linear-num-value-heads 8")),
    ("--linear-key-head-dim 64 --linear-value-head-dim 128", ("--linear-key-head-dim 64", "--linear-value-head-dim")),
    ("--num-attention-heads 6 --tensor-model-parallel-size 4 --sequence-parallel", ("--tensor-model-parallel-size",)),
    ("--moe-layer-freq 2", ("--moe-layer-freq", "--num-experts")),
    ("--lr-warmup-iters 5 --lr-warmup-fraction 0.1", ("--lr-warmup-fraction", "--lr-warmup-iters")),
    ("--lr-warmup-iters 100", ("warmup", "--lr-decay-iters")),
    ("--min-lr 1e-3", ("--min-lr", "--lr")),
    ("--lr-decay-style WSD", ("WSD", "--lr-wsd-decay-iters")),
    ("--weight-decay-incr-style linear --start-weight-decay 0.0", ("--end-weight-decay",)),
    ("--start-weight-decay 0.1", ("--start-weight-decay", "--weight-decay-incr-style")),
    ("--override-opt_param-scheduler --use-checkpoint-opt_param-scheduler", ("--override-opt_param-scheduler",)),
    ("--overlap-param-gather", ("--overlap-param-gather", "--use-distributed-optimizer")),
    ("--max-position-embeddings 64", ("--max-position-embeddings 64", "--seq-length 128")),
    ("--rl-objective sft --clip-ratio-low 0.1", ("--clip-ratio-low", "--rl-objective ppo")),
    ("--clip-ratio-low 1.5", ("--clip-ratio-low",)),
    ("--data-path 0.3 a 0.7 b", ("--data-path", "weighted", "one dataset prefix")),
    ("--data-path a b", ("--data-path", "2 paths")),
    ("--tree-plan-report /nonexistent/dir/plan.jsonl", ("--tree-plan-report", "does not exist")),
])
def test_bad_combinations_name_the_flags(extra, needles):
    refused(extra, *needles)


def test_tree_mode_refusals_come_from_the_model_checks():
    # capacity-factor token dropping cannot equal expanded training: refused with sharing only
    refused("--num-experts 4 --moe-expert-capacity-factor 1.0", "--moe-expert-capacity-factor", "tree sharing")
    args = parse("--num-experts 4 --moe-expert-capacity-factor 1.0 --tree-sharing off")
    assert not args.tree_mode and args.tree_planner == "ffd"
    assert A.hybrid_config(args).moe_expert_capacity_factor == 1.0
    refused("--hidden-dropout 0.1", "--hidden-dropout", "tree sharing")
    assert parse("--hidden-dropout 0.1 --tree-sharing off").hidden_dropout == 0.1
    refused("--num-experts 4 --moe-router-load-balancing-type sinkhorn", "--moe-router-load-balancing-type", "sinkhorn")
    # megatron-core's own checks get the flags of the fields they name
    refused("--recompute-granularity full", "megatron-core refused", "--recompute-granularity", "--recompute-method")
    refused("--num-attention-heads 6 --linear-num-key-heads 4 --tensor-model-parallel-size 4 --sequence-parallel",
            "--num-attention-heads", "--tensor-model-parallel-size")


def test_required_flags():
    for flag in ("--num-layers 4", "--train-iters 100", "--global-batch-size 8", "--lr 1e-4", "--vocab-size 100"):
        refused("", flag.split()[0], "required", base=BASE.replace(flag, ""))
    refused("", "--data-path is required", base=BASE.replace("--data-path rollouts.jsonl", ""))
    args = parse(base=BASE.replace("--data-path rollouts.jsonl", ""), require_data=False)
    assert args.data_path is None
    refused("", "--tree-microbatch-tokens", "--seq-length", base=BASE.replace("--seq-length 128", ""))
    args = parse("--tree-microbatch-tokens 4096", base=BASE.replace("--seq-length 128", ""))
    assert args.tree_microbatch_tokens == 4096 and args.seq_length is None


def test_sequence_parallel_at_tp1_is_turned_off_with_a_warning():
    with pytest.warns(A.ArgumentsWarning, match="--sequence-parallel"):
        args = parse("--sequence-parallel")
    assert not args.sequence_parallel
    with warnings.catch_warnings():
        warnings.simplefilter("error", A.ArgumentsWarning)
        assert parse("--sequence-parallel --tensor-model-parallel-size 2").sequence_parallel


def test_planner_defaults_follow_the_sharing_mode():
    assert parse().tree_planner == "l1"
    assert parse("--tree-sharing off").tree_planner == "ffd"
    assert parse("--tree-sharing windows").tree_planner == "l1l2"
    assert parse("--tree-planner ortools").tree_planner == "ortools"
    args = parse("--no-tree-replay")
    assert args.no_tree_replay and not args.tree_replay
    assert parse().tree_replay and not parse().no_tree_replay
    assert not parse("--no-tree-dataset-shuffle").tree_dataset_shuffle and parse().tree_dataset_shuffle


def test_arguments_error_is_a_value_error_and_a_cli_error():
    assert issubclass(ArgumentsError, ValueError) and issubclass(ArgumentsError, CliError)


# ---------------------------------------------------------------------------------------------
# --help and the main-style wrapper
# ---------------------------------------------------------------------------------------------

def test_help_exits_0_and_lists_the_groups(capsys):
    with pytest.raises(SystemExit) as ei:
        parse_args(["--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    for title in ("model shape", "MLA / KDA hybrid layers", "MoE", "parallelism", "training",
                  "optimizer and learning-rate schedule", "checkpointing", "logging", "data", "tree sharing",
                  "RL objective"):
        assert f"\n{title}:\n" in out, title
    for flag in ("--tree-sharing", "--linear-attention-freq", "--moe-layer-freq", "--rl-objective", "--fp64"):
        assert flag in out


@pytest.mark.parametrize("argv, needle", [
    (["--foo", "--bar"], "unrecognized arguments: --foo --bar"),
    (["--fp8-format", "hybrid"], "--fp8-format"),
    (["--tree-sharing", "foo"], "--tree-sharing"),
])
def test_parse_args_or_exit_prints_one_error_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as ei:
        A.parse_args_or_exit(shlex.split(BASE) + argv)
    assert ei.value.code == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: harts-pretrain: "), captured.err
    assert needle in lines[0]
    assert "Traceback" not in captured.err and captured.out == ""


def test_parse_args_or_exit_prints_warnings_as_lines(capsys):
    args = A.parse_args_or_exit(shlex.split(BASE) + ["--sequence-parallel"])
    assert not args.sequence_parallel
    err = capsys.readouterr().err
    assert "warning: --sequence-parallel has no effect" in err


# ---------------------------------------------------------------------------------------------
# builders
# ---------------------------------------------------------------------------------------------

def test_fp64_config(no_cuda):
    args = parse("--fp64 --num-experts 4 --swiglu")
    assert args.params_dtype is torch.float64 and args.moe_router_dtype == "fp64"
    cfg = A.hybrid_config(args)
    assert cfg.params_dtype is torch.float64 and cfg.pipeline_dtype is torch.float64 and not cfg.bf16
    assert cfg.moe_router_dtype == "fp64" and cfg.use_cpu_initialization
    assert A.ddp_config(args).grad_reduce_in_fp32 is False
    assert A.optimizer_config(args).params_dtype is torch.float64
    assert parse().params_dtype is torch.float32


@pytest.mark.filterwarnings("ignore:--tree-kda-backend auto. fla-core is not installed:RuntimeWarning")
def test_backends_are_resolved_and_checked_at_build_time(no_cuda):
    # parse time accepts fla / flex (the driver may run elsewhere); building the config refuses them here
    args = parse("--tree-kda-backend fla")
    with pytest.raises(ArgumentsError, match="--tree-kda-backend fla needs CUDA"):
        A.hybrid_config(args)
    args = parse("--tree-attention-backend flex")
    with pytest.raises(ArgumentsError, match="--tree-attention-backend flex needs CUDA"):
        A.hybrid_config(args)
    assert A.resolved_backends(parse()) == ("reference", "sdpa")
    cfg = A.hybrid_config(parse(), device="cpu")
    assert (cfg.kda_backend, cfg.tree_attention_backend, cfg.use_cpu_initialization) == ("reference", "sdpa", True)
    with pytest.raises(ArgumentsError, match="--tree-attention-backend flex needs CUDA"):
        A.hybrid_config(parse("--tree-attention-backend flex"), device="cpu")
    assert A.hybrid_config(parse("--tree-attention-backend reference")).tree_attention_backend == "reference"
    # interval: Triton kernels on CUDA; refused where they cannot run, and with --fp64
    from megatron_harts.ops.interval_attention import interval_available
    with pytest.raises(ArgumentsError, match=re.escape("--tree-attention-backend interval: " + interval_available("cpu"))):
        A.hybrid_config(parse("--tree-attention-backend interval"), device="cpu")
    if interval_available("cuda") is None:
        assert A.resolved_backends(parse("--tree-attention-backend interval"), cuda=True)[1] == "interval"
        with pytest.raises(ArgumentsError, match="interval runs fp16, bf16 or fp32"):
            A.resolved_backends(parse("--fp64 --tree-attention-backend interval"), cuda=True)
    # fa4: flash-attn-4's block-sparse kernels, refused where flash-attn-4 does not run
    with pytest.raises(ArgumentsError, match="--tree-attention-backend fa4 needs a Hopper GPU with flash-attn-4"):
        A.hybrid_config(parse("--tree-attention-backend fa4"), device="cpu")
    # on CUDA, auto picks varlen above q/k head dim 128 (here 128 + 64 rope), flex up to it (and fla
    # where fla-core is registered), except with --fp64
    import importlib.util
    fla = importlib.util.find_spec("fla") is not None
    if fla:
        assert A.resolved_backends(parse(), cuda=True) == ("fla", "varlen")
    else:       # the slow path is said, not taken silently
        with pytest.warns(RuntimeWarning, match="fla-core is not installed, so KDA runs the plain torch reference"):
            assert A.resolved_backends(parse(), cuda=True) == ("reference", "varlen")
    assert A.resolved_backends(parse("--qk-head-dim 64"), cuda=True)[1] == "flex"
    assert A.resolved_backends(parse("--qk-head-dim 256"), cuda=True)[1] == "flex"   # past the flash kernels
    assert A.resolved_backends(parse("--fp64"), cuda=True) == ("reference", "sdpa")
    if not fla:
        with pytest.raises(ArgumentsError, match="fla-core is not installed"):
            A.resolved_backends(parse("--tree-kda-backend fla"), cuda=True)
    else:
        with pytest.raises(ArgumentsError, match="--tree-chunk-size 32"):
            A.resolved_backends(parse("--tree-kda-backend fla --tree-chunk-size 32"), cuda=True)


def test_swiglu_fusion_on_the_gpu_unless_turned_off():
    """megatron's fused SwiGLU (``bias_activation_fusion``) for --swiglu models on CUDA by default,
    off with --no-bias-swiglu-fusion, never on the CPU or without SwiGLU."""
    kw = "--num-experts 4 --tree-kda-backend reference --tree-attention-backend reference"
    assert A.hybrid_config(parse(f"{kw} --swiglu"), device="cuda").bias_activation_fusion is True
    off = A.hybrid_config(parse(f"{kw} --swiglu --no-bias-swiglu-fusion"), device="cuda")
    assert off.bias_activation_fusion is False
    assert A.hybrid_config(parse(f"{kw} --swiglu"), device="cpu").bias_activation_fusion is False
    assert A.hybrid_config(parse(kw), device="cuda").bias_activation_fusion is False


@pytest.mark.filterwarnings("ignore:--tree-kda-backend auto. fla-core is not installed:RuntimeWarning")
def test_auto_attention_takes_fa4_where_fa4_runs(monkeypatch):
    """Where flash-attn-4 runs (stubbed here: CPU) and the model is bf16, auto takes its block-sparse
    backend (fa4) at every head dim fa4 takes, flex beyond them, sdpa with --fp64; in fp32 the
    backends without flash-attn-4 (its kernels run bf16), and --tree-attention-backend fa4 is refused."""
    from megatron_harts.ops import key_paths
    calls = []

    def fa4_runs(device, dims):
        calls.append((str(device), tuple(dims)))
        return all(8 <= d <= key_paths.FA4_MAX_HEAD_DIM and d % 8 == 0 for d in dims) and dims[-1] <= dims[0]

    monkeypatch.setattr(A, "fa4_available", fa4_runs)
    assert A.resolved_backends(parse("--bf16 --qk-head-dim 64"), cuda=True)[1] == "fa4"    # flex without fa4
    assert calls[-1] == ("cuda", (64 + 64, 128))
    assert A.resolved_backends(parse("--bf16"), cuda=True)[1] == "fa4"
    assert A.resolved_backends(parse("--bf16 --qk-head-dim 256"), cuda=True)[1] == "flex"    # 320: past fa4 too
    assert A.resolved_backends(parse("--fp64"), cuda=True)[1] == "sdpa"
    assert A.resolved_backends(parse("--bf16 --qk-head-dim 64"), cuda=False)[1] == "sdpa"
    assert A.resolved_backends(parse("--qk-head-dim 64"), cuda=True)[1] == "flex"     # fp32
    assert A.resolved_backends(parse(), cuda=True)[1] == "varlen"                     # fp32, q/k 192
    with pytest.raises(ArgumentsError, match="--tree-attention-backend fa4 runs bf16: add --bf16"):
        A.resolved_backends(parse("--tree-attention-backend fa4"), cuda=True)
    assert A.resolved_backends(parse("--bf16 --tree-attention-backend fa4"), cuda=True)[1] == "fa4"


def test_data_parallel_size():
    args = parse_args(shlex.split(KIMI_LINE))
    assert A.data_parallel_size(args, 16) == 8
    with pytest.raises(ArgumentsError, match="world size 5 is not divisible by --tensor-model-parallel-size 2"):
        A.data_parallel_size(args, 5)
    with pytest.raises(ArgumentsError, match="--expert-model-parallel-size 8"):
        A.data_parallel_size(args, 4)      # EP 8 x ETP 2 does not divide 4
    with pytest.raises(ArgumentsError, match="world size 5"):
        A.hybrid_config(args, world_size=5)


def test_padded_vocab_size():
    assert parse().padded_vocab_size == 128
    assert parse("--vocab-size 130 --tensor-model-parallel-size 2 --num-attention-heads 4").padded_vocab_size == 256
    assert parse("--vocab-size 130 --make-vocab-size-divisible-by 1").padded_vocab_size == 130


def test_optimizer_config():
    from megatron.core.optimizer import OptimizerConfig

    args = parse_args(shlex.split(KIMI_LINE))
    oc = A.optimizer_config(args)
    assert isinstance(oc, OptimizerConfig) and oc.optimizer == "adam"
    assert (oc.lr, oc.min_lr, oc.weight_decay, oc.adam_beta1, oc.adam_beta2, oc.adam_eps, oc.clip_grad) == \
        (1e-5, 1e-6, 0.1, 0.9, 0.95, 1e-8, 1.0)
    assert oc.bf16 and not oc.fp16 and oc.params_dtype is torch.bfloat16
    assert oc.use_distributed_optimizer and oc.overlap_param_gather
    sgd = A.optimizer_config(parse("--optimizer sgd --sgd-momentum 0.5 --clip-grad 0"))
    assert sgd.optimizer == "sgd" and sgd.sgd_momentum == 0.5 and sgd.clip_grad == 0.0 and not sgd.bf16


def test_ddp_config():
    dc = A.ddp_config(parse_args(shlex.split(KIMI_LINE)), data_parallel_size=8)
    assert dc.grad_reduce_in_fp32 and dc.overlap_grad_reduce and dc.overlap_param_gather
    assert dc.use_distributed_optimizer and dc.check_for_nan_in_grad and dc.bucket_size == 40_000_000
    dc = A.ddp_config(parse("--no-check-for-nan-in-loss-and-grad"))
    assert not dc.grad_reduce_in_fp32 and not dc.overlap_grad_reduce and not dc.use_distributed_optimizer
    assert not dc.check_for_nan_in_grad and dc.bucket_size is None
    assert A.ddp_config(parse("--accumulate-allreduce-grads-in-fp32")).grad_reduce_in_fp32


def _scheduler(args):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    return opt, OptimizerParamScheduler(opt, **A.scheduler_kwargs(args))


def _lrs(args, iterations):
    """The learning rate in force at each iteration (the scheduler stepped by 1 per iteration)."""
    opt, sched = _scheduler(args)
    out, done = {}, 0
    for it in sorted(iterations):
        sched.step(it - done)
        done = it
        out[it] = opt.param_groups[0]["lr"]
    return out


def test_scheduler_warmup_then_cosine():
    args = parse_args(shlex.split(KIMI_LINE))      # lr 1e-5, min 1e-6, warmup 50, cosine over 1000 iterations
    kw = A.scheduler_kwargs(args)
    assert (kw["lr_warmup_steps"], kw["lr_decay_steps"], kw["wd_incr_steps"]) == (50, 1000, 1000)
    assert kw["lr_decay_style"] == "cosine" and kw["init_lr"] == 0.0

    def expected(it, lr=1e-5, min_lr=1e-6, warm=50, decay=1000):
        if it <= warm:
            return lr * it / warm
        if it > decay:
            return min_lr
        ratio = (it - warm) / (decay - warm)
        return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (lr - min_lr)

    its = [0, 1, 25, 50, 51, 300, 525, 999, 1000, 1001, 1500]
    for it, lr in _lrs(args, its).items():
        assert lr == pytest.approx(expected(it), rel=1e-12, abs=1e-18), it


def test_scheduler_warmup_fraction_linear_and_weight_decay_ramp():
    args = parse("--lr 1e-3 --lr-warmup-fraction 0.1 --lr-warmup-init 1e-4 --lr-decay-iters 80 "
                 "--weight-decay-incr-style linear --start-weight-decay 0.0 --end-weight-decay 0.1")
    kw = A.scheduler_kwargs(args)
    assert kw["lr_warmup_steps"] == pytest.approx(8.0) and kw["lr_decay_steps"] == 80
    opt, sched = _scheduler(args)
    sched.step(4)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-4 + (1e-3 - 1e-4) * 4 / 8)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.1 * 4 / 100)
    sched.step(40)                 # iteration 44: linear decay from 8 to 80
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * (1 - (44 - 8) / 72))
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.1 * 44 / 100)


def test_scheduler_wsd():
    args = parse("--lr-decay-style WSD --lr-wsd-decay-iters 20 --lr-wsd-decay-style linear")
    kw = A.scheduler_kwargs(args)
    assert kw["wsd_decay_steps"] == 20 and kw["lr_wsd_decay_style"] == "linear"
    lrs = _lrs(args, [50, 80, 90, 100])
    assert lrs[50] == lrs[80] == pytest.approx(1e-4)
    assert lrs[90] == pytest.approx(0.5e-4) and lrs[100] == pytest.approx(0.0)
    assert A.scheduler_kwargs(parse())["wsd_decay_steps"] is None


def test_cost_model_and_calibration(tmp_path):
    from megatron_harts.planner.cost_model import CostCoefficients, CostModel, save_calibration

    assert A.cost_model(parse("--tree-chunk-size 32")) == CostModel(chunk_size=32)
    coef = CostCoefficients(microbatch=0.01, row=2e-5, attention_pair=1e-9, kda_call=3e-3,
                            kda_replay_token=4e-6, logits_row=5e-6)
    good = tmp_path / "cal.json"
    save_calibration(str(good), CostModel(coefficients=coef, chunk_size=64))
    model = A.cost_model(parse(f"--tree-cost-calibration {good}"))
    assert model.coefficients == coef and model.chunk_size == 64
    refused(f"--tree-cost-calibration {good} --tree-chunk-size 32", "--tree-cost-calibration", "chunk size 64",
            "--tree-chunk-size is 32")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something else"}))
    refused(f"--tree-cost-calibration {bad}", "--tree-cost-calibration", str(bad))


def test_objective_kwargs():
    from megatron_harts.rl import ObjectiveConfig
    assert ObjectiveConfig(**A.objective_kwargs(parse())) == ObjectiveConfig()
    kw = A.objective_kwargs(parse("--clip-ratio-low 0.1 --clip-ratio-high 0.28 --kl-coef 0.01 --kl-to old "
                                  "--entropy-coef 0.001 "
                                  "--loss-agg-mode seq-mean-token-sum"))
    assert (kw["clip_ratio_low"], kw["clip_ratio_high"], kw["kl_coef"], kw["entropy_coef"], kw["loss_agg_mode"]) == \
        (0.1, 0.28, 0.01, 0.001, "seq-mean-token-sum")
    assert A.objective_kwargs(parse("--rl-objective sft"))["kind"] == "sft"


def test_windows_with_pipeline_parallelism_and_pp_schedule():
    args = parse("--tree-sharing windows --pipeline-model-parallel-size 2")
    assert args.tree_sharing == "windows" and args.pipeline_model_parallel_size == 2
    assert args.tree_pp_schedule == "consumer-1f1b"
    for schedule in ("overlap", "non-overlap"):
        assert parse(f"--tree-sharing windows --pipeline-model-parallel-size 2 --tree-pp-schedule {schedule}"
                     ).tree_pp_schedule == schedule
    from megatron_harts.schedules.pipeline import SCHEDULES
    assert A.TREE_PP_SCHEDULES == SCHEDULES
