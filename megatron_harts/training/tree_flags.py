"""The tree-sharing flags of the training driver (``--tree-*``), declared once as a typed flag group.

``TreeFlags`` is a frozen dataclass whose fields are the flags (``megatron_harts.flags``): name,
type, default, help and constraints in one declaration, from which ``training.arguments``
generates the argparse options.  The constraints among these flags are checked in
``__post_init__`` (so a ``TreeFlags`` built in code is checked as one built from a command line);
those involving other flags (pipeline or expert parallelism, ``--seq-length``, files) are the
driver's (``training.arguments``).

Field names are those of the configs the fields feed, so they are copied by name
(``flags.shared_fields``): ``sharing``, ``microbatch_tokens``, ``planner``, ``replay``,
``pp_schedule``, ``recompute_producers``, ``piece_keep`` into ``training.step.SharingSettings``;
``kda_chunk_size``, ``kda_backend``, ``fused_kernels``, ``kda_input_recompute``, ``tree_kda_call_plan``,
``tree_attention_backend``, ``logprob_chunk_rows`` into ``models.config.HybridConfig`` (after ``auto``
backends are resolved).  The others are read by the trainer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..flags import check_group, flag
from ..planner.baselines import CALL_PLANS
from ..planner.memory import PIECE_KEEP

__all__ = ["TreeFlags", "SHARING_MODES", "PLANNERS", "PLANNERS_BY_SHARING", "KDA_BACKEND_CHOICES",
           "ATTENTION_BACKEND_CHOICES", "PP_SCHEDULES"]

SHARING_MODES = ("off", "within", "windows")
PLANNERS = ("l1", "l1l2", "ffd", "ortools")
#: planners allowed per sharing mode; the first is the default
PLANNERS_BY_SHARING = {"off": ("ffd",), "within": ("l1", "ortools"), "windows": ("l1l2",)}
KDA_BACKEND_CHOICES = ("auto", "reference", "fla")
#: ``auto`` and ``models.config.ATTENTION_BACKENDS`` (tests hold the two equal)
ATTENTION_BACKEND_CHOICES = ("auto", "reference", "sdpa", "flex", "varlen", "interval", "fa4")
#: pipeline schedules of sharing windows (``schedules.pipeline.SCHEDULES``, which tests hold equal); the first
#: is the default
PP_SCHEDULES = ("consumer-1f1b", "overlap", "non-overlap")

_PLANNER_WHY = {"ffd": "ffd packs whole trajectories without sharing: use --tree-sharing off",
                "l1l2": "L2 plans cross-microbatch sharing windows: use --tree-sharing windows",
                "l1": "L1 plans sharing within microbatches: use --tree-sharing within",
                "ortools": "the OR-Tools baseline plans sharing within microbatches: use --tree-sharing within"}


@dataclass(frozen=True)
class TreeFlags:
    """The ``--tree-*`` flags (module docstring).  ``planner`` None resolves to the sharing mode's
    default; ``microbatch_tokens`` None is resolved by the driver (``--seq-length``)."""
    sharing: str = flag(
        "within", "--tree-sharing", "off: expanded training (trajectories packed FFD); within (default): shared "
        "prefixes computed once per microbatch; windows: also across microbatches (producer/consumer windows; with "
        "--pipeline-model-parallel-size > 1 the --tree-pp-schedule)", choices=SHARING_MODES)
    microbatch_tokens: Optional[int] = flag(
        None, "--tree-microbatch-tokens", "row budget of one microbatch (default --seq-length)", minimum=1,
        metavar="N")
    planner: Optional[str] = flag(
        None, "--tree-planner", "microbatch planner: off -> ffd; within -> l1 (default) or ortools (OR-Tools + FFD "
        "baseline); windows -> l1l2", choices=PLANNERS)
    kda_chunk_size: int = flag(
        64, "--tree-chunk-size", "KDA chunk size B (default 64, fla's; chunks start at multiples of B on every path)",
        minimum=1, metavar="N")
    replay: bool = flag(
        True, "--no-tree-replay", "ablation: start KDA sequences at fork points without replaying to a chunk "
        "boundary (tree == expanded to rounding only)")
    fused_kernels: bool = flag(
        True, "--no-tree-fused-kernels", "eager torch ops instead of one fused Triton kernel each for the KDA "
        "layers' elementwise chains (forget gate, q/k SiLU + L2 norm, gated output norm), the sigmoid router's "
        "top-k and the MoE combine's gather and sum (fused by default on the GPU; never on the CPU or in fp64)")
    kda_input_recompute: bool = flag(
        True, "--no-tree-kda-input-recompute", "keep what the KDA layers' short convs and q/k/v activations save "
        "for the backward (by default only their inputs are kept and they run again in the backward: on the GPU 6 x "
        "heads x head dim elements a row and KDA layer less, for one more forward of the convs, activations and the "
        "tree calls' row gathers; the same values, the gradients to rounding)")
    kda_backend: str = flag(
        "auto", "--tree-kda-backend", "KDA kernels: auto (default: fla on CUDA, reference otherwise or with --fp64), "
        "reference (plain torch) or fla (needs CUDA)", choices=KDA_BACKEND_CHOICES)
    tree_kda_call_plan: str = flag(
        CALL_PLANS[0], "--tree-kda-call-plan", "ablation of the KDA call plan: harts (default: the call planner's "
        "fewest calls, with replay), per-depth (one call per fork level) or node-wise (one call per segment depth, "
        "Node-wise LA); the ablations run without replay and need --tree-sharing within", choices=CALL_PLANS)
    tree_attention_backend: str = flag(
        "auto", "--tree-attention-backend", "MLA tree attention: auto (default on CUDA: fa4 where flash-attn-4 "
        "runs and the model is --bf16, else flex up to q/k head dim 128 and varlen above; sdpa otherwise or with --fp64), sdpa, reference, "
        "flex (needs CUDA), varlen (flash-attention varlen kernels over gathered key paths on CUDA, their "
        "plain-torch reference elsewhere), interval (Triton kernels reading keys in place over the tiles "
        "holding visible pairs; needs CUDA and Triton, fp16/bf16/fp32) or fa4 (flash-attn-4's block-sparse kernels "
        "over those tiles; needs a Hopper GPU with flash-attn-4 and --bf16)", choices=ATTENTION_BACKEND_CHOICES)
    triton_max_configs: int = flag(
        0, "--tree-triton-max-configs", "with the fla KDA backend: every Triton autotuner tries at most N "
        "configurations (default 0: all, ~150 per fla kernel; numerics do not depend on it, the first step's "
        "compile time and the kernels' speed do)", minimum=0, metavar="N")
    logprob_chunk_rows: Optional[int] = flag(
        None, "--tree-logprob-chunk-rows", "rows per logits chunk of the output layer's log-probs (tree and expanded "
        "mode alike; the [rows, vocab] logits never exist whole, a chunk's fp32 logits take N x vocab x 4 bytes, "
        "twice in the backward). Default: 256 MiB of fp32 logits per chunk (409 rows at a 163,840-token "
        "vocabulary); the values do not depend on it, the speed and the peak memory do "
        "(benchmarks/bench_logprobs.py times the choices)", minimum=1, metavar="N")
    pp_schedule: str = flag(
        PP_SCHEDULES[0], "--tree-pp-schedule", "pipeline schedule (--pipeline-model-parallel-size > 1): "
        "consumer-1f1b (default: consumers in 1F1B order, overlapping windows, each producer backward right after "
        "its last consumer's), overlap (overlapping windows, backward-first) or non-overlap (each window drained "
        "before the next)", choices=PP_SCHEDULES)
    recompute_producers: bool = flag(
        False, "--tree-recompute-producers", "with --tree-sharing windows: a producer's first forward keeps only "
        "the exports its consumers read; its forward runs again, with its backward, when its window closes (the "
        "same gradients; no producer activations alive while its consumers run, for one more producer forward)")
    memory_budget_gib: Optional[float] = flag(
        None, "--tree-memory-budget", "with --tree-sharing windows: the step's activation memory budget in GiB (a "
        "window's producer keeps its activations until its window closes while the predicted live activations, "
        "exports and the running microbatch's activations fit it; the other producers are recomputed at window "
        "close; the same gradients either way). Default: what expanded training keeps for its largest microbatch "
        "under the same row budget (--tree-microbatch-tokens x the model's activation bytes per row)",
        minimum=0, metavar="GIB")
    piece_keep: str = flag(
        "auto", "--tree-piece-keep", "trajectories longer than --tree-microbatch-tokens train in pieces; a piece that "
        "later pieces read either keeps its activation graph until its backward at its chain's end (one forward; "
        "under --recompute-granularity full the graph holds the layers' inputs only) or keeps only its exports and "
        "runs its forward again with its backward (less memory, one more forward of its rows): all keeps every one, "
        "none recomputes every one, auto (default) keeps them in step order while the memory model's predicted live "
        "activations fit --tree-piece-memory, a piece that does not fit whole with its first layers recomputed in "
        "its backward (the fewest that fit; runs without --recompute-granularity). The same loss and gradients "
        "either way; the step logs piece_extra_forward_rows", choices=PIECE_KEEP)
    piece_memory_gib: Optional[float] = flag(
        None, "--tree-piece-memory", "with --tree-piece-keep auto: the activation memory in GiB that the pieces' "
        "kept graphs, exports and running piece may take. Default: on a GPU 85%% of its memory less the parameter "
        "state (weights, gradients, optimizer state) the memory model predicts; on the CPU what expanded training "
        "keeps for its largest microbatch (--tree-microbatch-tokens x the model's activation bytes per row)",
        minimum=0, metavar="GIB")
    plan_report: Optional[str] = flag(
        None, "--tree-plan-report", "append each step's plan metrics to this file (one JSON object per line)",
        metavar="PATH")
    logit_probe: Optional[str] = flag(
        None, "--tree-logit-probe", "write the logits of a fixed sample of the first global batch's target tokens "
        "before the first step and after the last (DIR/iter_N/rank_R.pt), for comparing runs with "
        "tools/compare_runs.py (fidelity across modes and parallel layouts)", metavar="DIR")
    logit_probe_tokens: int = flag(
        1024, "--tree-logit-probe-tokens", "about how many target tokens the logit probe samples (default 1024)",
        minimum=1, metavar="N")
    logit_probe_oracle: bool = flag(
        False, "--tree-logit-probe-oracle", "with --tree-logit-probe: the first probe also runs an upcast copy of "
        "the weights (fp32 for bf16/fp16 models, fp64 for fp32; plain-torch kernels, no TF32) into DIR/oracle/, the "
        "reference that bf16 rounding is measured against")
    cost_calibration: Optional[str] = flag(
        None, "--tree-cost-calibration", "microbatch cost-model calibration (JSON, tools' save_calibration) the "
        "planner uses; its chunk_size must equal --tree-chunk-size", metavar="PATH")
    dataset_shuffle: bool = flag(
        True, "--tree-dataset-shuffle", "draw each iteration's trees in a --seed shuffled order (default on)")

    def __post_init__(self):
        check_group(self)
        allowed = PLANNERS_BY_SHARING[self.sharing]
        if self.planner is None:
            object.__setattr__(self, "planner", allowed[0])
        elif self.planner not in allowed:
            raise ValueError(f"--tree-planner {self.planner} does not go with --tree-sharing {self.sharing} "
                             f"({_PLANNER_WHY[self.planner]}; allowed: {', '.join(allowed)})")
        if not self.tree_mode and not self.replay:
            raise ValueError("--no-tree-replay needs tree sharing: with --tree-sharing off there is no replay")
        if self.tree_kda_call_plan != CALL_PLANS[0] and self.sharing != "within":
            why = ("expanded training runs no tree KDA calls" if self.sharing == "off" else
                   "sharing-window producers and consumers run harts plans only")
            raise ValueError(f"--tree-kda-call-plan {self.tree_kda_call_plan} needs --tree-sharing within (with "
                             f"--tree-sharing {self.sharing} {why})")
        if self.recompute_producers and self.sharing != "windows":
            raise ValueError(f"--tree-recompute-producers needs --tree-sharing windows (with --tree-sharing "
                             f"{self.sharing} there are no producers)")
        if self.memory_budget_gib is not None:
            if self.memory_budget_gib <= 0:
                raise ValueError(f"--tree-memory-budget {self.memory_budget_gib:g}: must be a positive number of GiB")
            if self.sharing != "windows":
                raise ValueError(f"--tree-memory-budget needs --tree-sharing windows (with --tree-sharing "
                                 f"{self.sharing} there are no producers to keep or recompute)")
            if self.recompute_producers:
                raise ValueError("--tree-memory-budget with --tree-recompute-producers: the flag recomputes every "
                                 "producer whatever the budget; give one of them")
        if self.piece_memory_gib is not None:
            if self.piece_memory_gib <= 0:
                raise ValueError(f"--tree-piece-memory {self.piece_memory_gib:g}: must be a positive number of GiB")
            if self.piece_keep != "auto":
                raise ValueError(f"--tree-piece-memory with --tree-piece-keep {self.piece_keep}: the budget decides "
                                 "only under --tree-piece-keep auto")
        if self.logit_probe_oracle and self.logit_probe is None:
            raise ValueError("--tree-logit-probe-oracle needs --tree-logit-probe DIR")

    @property
    def tree_mode(self) -> bool:
        """Whether prefixes are shared (``--tree-sharing`` within or windows)."""
        return self.sharing != "off"
