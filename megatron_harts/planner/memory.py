"""Activation memory of a training step: a per-row bytes model and the sharing windows' keep/recompute choice.

Pure Python and numpy (no torch), so a plan can be sized anywhere.  Two parts:

* **Bytes per row.**  :class:`ModelShape` holds the shapes that set a row's saved activations (hidden,
  KDA heads and head dim, MLA's latent and head dims, the MLPs' widths, top-k, experts, element size,
  tensor-parallel size, full recomputation); :func:`activation_bytes_per_row` gives the bytes a row
  keeps for the backward per layer kind, :func:`saved_bytes_per_row` those of a microbatch the step
  runs with the run's recomputation, :func:`graph_bytes_per_row` those of a sharing-window producer
  that keeps its graph (it runs without recomputation), :func:`export_bytes` the bytes a
  producer's exports take, :func:`attention_bytes` what a microbatch's MLA attention over its context
  and key paths adds, and :func:`output_bytes` the output layer's log-probs, which
  :func:`step_peak_bytes` sets beside the activations where a layer's backward would run.
  The default memory budget of ``--tree-memory-budget`` is :func:`default_budget_bytes`: the row
  budget times :func:`saved_bytes_per_row`, what expanded training's largest microbatch under the same
  row budget keeps.
* **Which producers keep their graph.**  :func:`plan_window_memory` walks a replica's step in execution
  order (``StepItem``: rows, producer, export bytes, pieces' reads) and decides per window, in
  producer order, whether its producer keeps its activation graph until its window closes (fast) or
  runs under ``no_grad`` and is recomputed at window close: a window is kept when, with it kept, the
  predicted live bytes stay within the budget at every point of its window; the predicted peak of the
  chosen step comes with it.  The same walk decides, per piece of a long path that later pieces read
  (``planner.pieces``), whether it keeps its graph (whole or in part) from its forward until its
  backward once its readers are done (one forward) or runs under ``no_grad`` and again with its
  backward (``piece_keep``); the pieces'
  budget is ``--tree-piece-memory`` (default :func:`device_activation_budget` on a GPU).  The decision
  depends only on the step's items and the numbers above, so every rank that runs the same items
  decides the same.

An estimate: allocator rounding, transient buffers and kernel workspaces are not in it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .pieces import piece_backward_points

__all__ = ["ModelShape", "activation_bytes_per_row", "saved_bytes_per_row", "graph_bytes_per_row", "export_bytes",
           "layer_graph_bytes_per_row", "layer_input_bytes_per_row",
           "forward_end_bytes_per_row", "attention_bytes", "default_budget_bytes", "state_bytes_per_parameter",
           "output_bytes", "step_peak_bytes", "device_activation_budget", "StepItem", "WindowMemoryPlan",
           "plan_window_memory", "PIECE_KEEP", "GIB"]

GIB = 2 ** 30


@dataclass(frozen=True)
class ModelShape:
    """The shapes a row's activations depend on.  ``layer_kinds``: per layer (attention, MLP), attention
    "kda" or "mla", MLP "dense" or "moe"; ``element_bytes``: bytes of an activation element (2 for bf16,
    4 fp32, 8 fp64); ``recompute``: "full" when every layer is recomputed in the backward (megatron's
    ``--recompute-granularity full``, ``recompute_layers`` layers a unit), else None; ``tp``: the
    tensor-parallel size (each rank keeps a 1/tp share of a row's activations, sequence parallelism
    sharding the hidden-size ones); ``kda_input_recompute``: the KDA layers' convs and q/k/v activations
    run again in the backward (``models.cores.KDACore``)."""
    hidden: int
    heads: int
    lin_heads: int
    lin_head: int
    kv_lora: int
    qk: int
    rope: int
    v: int
    ffn: int
    moe_ffn: int
    shared_ffn: int
    experts: int
    topk: int
    layer_kinds: Tuple[Tuple[str, str], ...] = field(default=())
    element_bytes: int = 2
    recompute: Optional[str] = None
    recompute_layers: int = 1
    tp: int = 1
    kda_input_recompute: bool = True

    @classmethod
    def from_config(cls, cfg) -> "ModelShape":
        """The shape of a ``models.config.HybridConfig`` (read by attribute name)."""
        dtype = str(getattr(cfg, "params_dtype", "torch.float32"))
        element = 2 if ("bfloat16" in dtype or "float16" in dtype) else 8 if "float64" in dtype else 4
        kinds = tuple(zip(cfg.resolved_layer_types(), cfg.resolved_mlp_types()))
        moe_ffn = getattr(cfg, "moe_ffn_hidden_size", None) or cfg.ffn_hidden_size
        shared = getattr(cfg, "moe_shared_expert_intermediate_size", None) or 0
        rec = "full" if getattr(cfg, "recompute_granularity", None) == "full" else None
        return cls(hidden=cfg.hidden_size, heads=cfg.num_attention_heads, lin_heads=cfg.linear_num_heads,
                   lin_head=cfg.linear_head_dim, kv_lora=cfg.kv_lora_rank, qk=cfg.qk_nope_head_dim,
                   rope=cfg.qk_rope_head_dim, v=cfg.v_head_dim, ffn=cfg.ffn_hidden_size, moe_ffn=moe_ffn,
                   shared_ffn=shared, experts=getattr(cfg, "num_moe_experts", None) or 0,
                   topk=getattr(cfg, "moe_router_topk", None) or 0, layer_kinds=kinds, element_bytes=element,
                   recompute=rec, recompute_layers=int(getattr(cfg, "recompute_num_layers", None) or 1),
                   tp=int(getattr(cfg, "tensor_model_parallel_size", 1) or 1),
                   kda_input_recompute=bool(getattr(cfg, "kda_input_recompute", True)))

    @classmethod
    def from_preset(cls, p: Dict, element_bytes: int = 2) -> "ModelShape":
        """The shape of a benchmark preset (``benchmarks/bench_throughput.py``'s ``PRESETS`` entries: every 4th
        layer MLA, the first MLP dense)."""
        kinds = tuple(("mla" if (i + 1) % 4 == 0 else "kda", "dense" if i == 0 else "moe") for i in range(p["layers"]))
        return cls(hidden=p["hidden"], heads=p["heads"], lin_heads=p.get("lin_heads", p["heads"]),
                   lin_head=p["lin_head"], kv_lora=p["kv_lora"], qk=p["qk"], rope=p["rope"], v=p["v"], ffn=p["ffn"],
                   moe_ffn=p["moe_ffn"], shared_ffn=p.get("shared_ffn", p["moe_ffn"]), experts=p["experts"],
                   topk=p["topk"], layer_kinds=kinds, element_bytes=element_bytes, recompute=p.get("recompute"))


def activation_bytes_per_row(s: ModelShape) -> Dict[str, int]:
    """Bytes of a row's saved activations per layer part in a forward without recomputation (what the backward
    keeps), from the shapes: ``e`` = ``element_bytes`` an element, ``f`` = max(4, e) where the kernels keep
    fp32.  KDA: norm, q/k/v before the conv (under ``kda_input_recompute`` the rest of the conv, activations and
    the recurrence's q/k/v are released and computed again in the backward; without it the conv outputs of q,
    k and v that the SiLU and L2 norm keep and the recurrence's q/k/v, or its calls' copies), the two low-rank
    gates and their outputs, beta, the core's output, its norm and gate, and the fp32 decay cumsum and chunk
    matrices (2 x 64 per head); MLA: norm, queries, latent and rope key, its norm, keys/values, output,
    projection, fp32 log-sum-exp; MoE: the norm's input, normalized rows and output (3 x hidden), per top-k copy
    the fc1 output (2 x width) the weighted SwiGLU keeps beside an fp32 prob (fc1's input, the permuted tokens,
    is gathered again from the norm's output in the backward: ``models.dispatcher``; fc2's input, the
    activation's output, is computed again from those two: ``models.experts``), the shared expert's fc1 output
    and activation, the router's fp32 scores, sum and top-k probs (top-k and aux-loss paths: 2 x (experts + 1 +
    top-k)) and the int64 routing indices (per row 4 x top-k and one per expert: the dispatcher's sort); dense
    MLP: the norm's three, fc1 output and activation.  The MLP parts are held to the bytes a bf16 forward saves
    (``tests/test_memory_budget.py``: on the CPU the norm keeps an fp32 copy of its input instead of the input,
    which the test adds).  Divided by ``tp`` (rounded up)."""
    e, f = s.element_bytes, max(4, s.element_bytes)
    h, H, d, Hk = s.hidden, s.heads, s.lin_head, s.lin_heads
    hd = Hk * d
    conv = 3 * hd if s.kda_input_recompute else 9 * hd
    kda = e * (2 * h + conv + 2 * d + 2 * hd + Hk + 3 * hd) + f * (hd + 2 * 64 * Hk)
    mla = e * (2 * h + H * (s.qk + s.rope) + 2 * (s.kv_lora + s.rope) + H * (s.qk + s.v) + H * s.v) + f * H
    moe = e * (3 * h + s.topk * 2 * s.moe_ffn + 3 * s.shared_ffn) + f * 2 * (s.topk + s.experts + 1) \
        + 8 * (4 * s.topk + s.experts)
    dense = e * (3 * h + 3 * s.ffn)
    return {k: -(-v // s.tp) for k, v in (("kda", kda), ("mla", mla), ("moe", moe), ("dense", dense))}


def graph_bytes_per_row(s: ModelShape) -> int:
    """Bytes a row keeps over all layers when its forward runs without recomputation (a window producer's
    graph, whatever the run's recomputation)."""
    return sum(layer_graph_bytes_per_row(s))


def layer_graph_bytes_per_row(s: ModelShape) -> List[int]:
    """Per layer, in order, the bytes a row keeps for that layer's backward without recomputation."""
    act = activation_bytes_per_row(s)
    return [act[a] + act[m] for a, m in s.layer_kinds]


def layer_input_bytes_per_row(s: ModelShape) -> int:
    """Bytes a row keeps for a layer whose forward runs again in the backward: its input (hidden x e,
    1/tp of it)."""
    return -(-s.hidden * s.element_bytes // s.tp)


def saved_bytes_per_row(s: ModelShape) -> int:
    """Bytes a row of a microbatch keeps at the peak of its backward under the run's recomputation: the
    whole graph without it; with full recomputation each unit's input (hidden x e, 1/tp of it) plus one
    unit's activations while its backward runs."""
    if s.recompute != "full":
        return graph_bytes_per_row(s)
    act = activation_bytes_per_row(s)
    return forward_end_bytes_per_row(s) + _largest_unit(s, [act[a] + act[m] for a, m in s.layer_kinds])


def _largest_unit(s: ModelShape, per_layer: Sequence[int]) -> int:
    """The largest sum of ``per_layer`` over one recompute unit (``recompute_layers`` consecutive layers)."""
    n = max(1, int(s.recompute_layers))
    return max((sum(per_layer[i:i + n]) for i in range(0, len(per_layer), n)), default=0)


def export_bytes(s: ModelShape, rows: int, conv_rows: int, replay_rows: int, states: int) -> int:
    """Bytes of a producer's exports (``models.packed.ExportSpec``'s row counts): per MLA layer the
    key/value latent (kv_lora + rope, replicated over tensor-parallel ranks) of ``rows``; per KDA layer
    q/k/v before the conv at ``conv_rows``, q, k, v, the decay g (heads x head dim each) and beta at
    ``replay_rows``, and one fp32 (or wider) state (heads x head dim x head dim) per ``states``, KDA's
    split over tensor-parallel ranks."""
    e, f = s.element_bytes, max(4, s.element_bytes)
    hd = s.lin_heads * s.lin_head
    mla = rows * (s.kv_lora + s.rope) * e
    kda = conv_rows * 3 * hd * e + replay_rows * (4 * hd + s.lin_heads) * e + states * hd * s.lin_head * f
    n_mla = sum(a == "mla" for a, _ in s.layer_kinds)
    return n_mla * mla + -(-((len(s.layer_kinds) - n_mla) * kda) // s.tp)


def state_bytes_per_parameter(element_bytes: int, optimizer_shards: int = 1) -> float:
    """Bytes a parameter holds between steps under megatron-core's optimizer with Adam: the weight
    (``element_bytes``), its gradient buffer (fp32, or the weight's dtype when wider), and, with 16-bit
    weights, an fp32 main copy beside Adam's two moments in the main dtype (fp32 or wider); the
    optimizer's share divided by ``optimizer_shards`` (the distributed optimizer's data-parallel size).
    bf16: 2 + 4 + 12 = 18 bytes with one shard."""
    f = max(4, element_bytes)
    optimizer = (f + 2 * f) if element_bytes < 4 else 2 * f
    return element_bytes + f + optimizer / max(1, int(optimizer_shards))


def output_bytes(hidden: int, vocab: int, element_bytes: int, chunk_rows: int, rows: int) -> int:
    """Bytes the output layer's log-probs add at their peak (forward and backward) for a microbatch of
    ``rows`` rows: the output weight's gradient accumulator and one chunk's weight-gradient product, both
    [vocab, hidden] in the statistics dtype (fp32 or wider); per chunk row one statistics-dtype and one
    activation-dtype row of vocab logits; the final hidden states' gradient.  Matches the op's measured
    peak above its start on an H200 (benchmarks/bench_logprobs.py at vocabulary 163,840, hidden 2304,
    bf16: benchmarks/results/scale-h200/logprobs-h200.json) within 4% for chunks of 256-4096 rows."""
    f = max(4, element_bytes)
    return vocab * hidden * 2 * f + chunk_rows * vocab * (f + element_bytes) + rows * hidden * element_bytes


def forward_end_bytes_per_row(s: ModelShape) -> int:
    """Bytes a row of a microbatch keeps when its forward ends, before its backward starts: each
    recompute unit's input with full recomputation, the whole graph without."""
    if s.recompute != "full":
        return graph_bytes_per_row(s)
    units = -(-len(s.layer_kinds) // max(1, int(s.recompute_layers)))
    return units * layer_input_bytes_per_row(s)


def attention_bytes(s: ModelShape, *, rows: int, context_rows: int, gathered: int) -> int:
    """Bytes a microbatch's MLA attention holds beyond :func:`activation_bytes_per_row` at the peak of an
    MLA layer's backward, through the varlen kernels over key paths: ``rows`` query rows,
    ``context_rows`` keys of a producer or earlier pieces, ``gathered`` key rows the paths gather
    (``ops.key_paths.gathered_key_count``).  Per MLA layer whose graph is alive (one recompute unit's
    with full recomputation, every one without) the context keys and values up-projected from the
    exported latent, heads x (q/k + v); in the layer whose backward runs the larger of the kernel's
    phase (gathered keys, values and their gradients at its head width W = max(q/k, v):
    4 x gathered x heads x W) and the summing back (the gathered gradients, 2 x gathered x heads x W,
    beside the keys' fp32 sums over rows + context rows; the chunk being widened, at most 1 GiB, is left
    out).  Divided by ``tp``; 0 without MLA layers."""
    mla = [a == "mla" for a, _ in s.layer_kinds]
    if not any(mla) or gathered <= 0:
        return 0
    alive = _largest_unit(s, mla) if s.recompute == "full" else sum(mla)
    e, f = s.element_bytes, max(4, s.element_bytes)
    dqk, W = s.qk + s.rope, max(s.qk + s.rope, s.v)
    context = context_rows * s.heads * (dqk + s.v) * e
    backward = max(4 * gathered * s.heads * W * e,
                   2 * gathered * s.heads * W * e + (rows + context_rows) * s.heads * dqk * f)
    return -(-(alive * context + backward) // s.tp)


def step_peak_bytes(s: ModelShape, *, state_bytes: float, activation_bytes: float, output: int,
                    largest_rows: int) -> float:
    """A step's predicted peak: the parameter state beside the larger of the activation peak
    (``activation_bytes``, :func:`plan_window_memory`'s) and the output layer's phase, where the
    largest microbatch's forward has ended (its :func:`forward_end_bytes_per_row`) and the log-probs
    run (``output``, :func:`output_bytes`) in place of a recompute unit's backward."""
    unit = largest_rows * (saved_bytes_per_row(s) - forward_end_bytes_per_row(s))
    return state_bytes + activation_bytes + max(0.0, float(output) - unit)


def default_budget_bytes(s: ModelShape, row_budget: int) -> int:
    """The default ``--tree-memory-budget``: what expanded training keeps for its largest microbatch under
    the same row budget (``row_budget`` rows, each :func:`saved_bytes_per_row`)."""
    return int(row_budget) * saved_bytes_per_row(s)


def device_activation_budget(device_bytes: int, state_bytes: float, fraction: float = 0.85) -> int:
    """The activation bytes a step may keep on a device of ``device_bytes``: ``fraction`` of it less the
    parameter state (``state_bytes``, :func:`state_bytes_per_parameter` times this rank's parameters); at
    least 1.  The rest is for what the model leaves out: memory outside PyTorch's allocator (the CUDA
    context, kernel images, library workspaces: 3.1 GiB on an H100 in a step with flash-attn-4 and fla),
    the allocator's reserved but unused blocks (1.7 GiB there), transient buffers, and the model's own
    error (a long compaction step at preset h200 that the model put at 90% of an H100 allocated 95%)."""
    return max(1, int(float(fraction) * int(device_bytes) - float(state_bytes)))


@dataclass(frozen=True)
class StepItem:
    """One microbatch of a replica's step, in execution order, as the memory plan sees it: ``rows``
    (its layout's rows), ``producer`` (position of the window producer it reads, or None),
    ``export_bytes`` (a window producer's or a read piece's exports, 0 otherwise), ``reads``
    (positions of the earlier pieces it reads, for pieces of long paths), ``read_later`` (a piece
    some later piece reads) and ``attention_bytes`` (its MLA attention's bytes beyond the per-row
    model, :func:`attention_bytes`)."""
    rows: int
    producer: Optional[int] = None
    export_bytes: int = 0
    reads: Tuple[int, ...] = ()
    read_later: bool = False
    attention_bytes: int = 0


@dataclass
class WindowMemoryPlan:
    """The keep/recompute choice of a step's windows and its predicted live activation bytes.

    ``recompute``: producer positions whose forward runs under ``no_grad`` and again at window close;
    ``kept``: the others; ``predicted_peak_bytes``: the largest predicted live bytes over the step
    (running microbatch's saved activations, kept producers' graphs, exports and their gradients);
    ``budget_bytes``: the budget it was chosen for (None: no budget, every window as forced);
    ``export_bytes``: per item its predicted exports (0 where it exports nothing); ``kept_pieces``: read
    pieces of long paths that keep their graph from their forward to their backward (one forward);
    ``recomputed_pieces``: read pieces whose forward runs under ``no_grad`` and again with their backward;
    ``piece_layers``: per kept piece the number of its first layers whose forward runs again in its
    backward (0: the whole graph kept)."""
    recompute: Tuple[int, ...]
    kept: Tuple[int, ...]
    predicted_peak_bytes: int
    budget_bytes: Optional[int]
    export_bytes: Tuple[int, ...] = ()
    kept_pieces: Tuple[int, ...] = ()
    recomputed_pieces: Tuple[int, ...] = ()
    piece_layers: Dict[int, int] = field(default_factory=dict)


PIECE_KEEP = ("auto", "all", "none")


def _keep_within(base: np.ndarray, candidates, keep, budget: float) -> Tuple[np.ndarray, List[int]]:
    """Greedy keeping in the given order: ``keep(live, c)`` adds what keeping ``c`` holds to the live-bytes
    profile ``live``; ``c`` is kept where no phase it raises goes above ``budget``.  Returns the profile with
    the kept candidates' bytes and the kept candidates."""
    kept: List[int] = []
    for c in candidates:
        trial = base.copy()
        keep(trial, c)
        if _fits(base, trial, budget):
            base = trial
            kept.append(c)
    return base, kept


def _fits(base: np.ndarray, trial: np.ndarray, budget: float) -> bool:
    """No phase that ``trial`` raises above ``base`` goes above ``budget``."""
    raised = trial > base
    return not raised.any() or float(trial[raised].max()) <= budget


def plan_window_memory(items: Sequence[StepItem], *, saved_per_row: int, graph_per_row: int,
                       budget_bytes: Optional[int] = None, force: Optional[bool] = None,
                       recompute: Optional[Sequence[int]] = None, piece_keep="none",
                       piece_graph_per_row: Optional[int] = None,
                       piece_budget_bytes: Optional[int] = None,
                       piece_layer_bytes: Optional[Sequence[int]] = None,
                       layer_input_bytes: int = 0) -> WindowMemoryPlan:
    """Choose, per sharing window of a replica's step, whether its producer keeps its graph, and per read
    piece of a long path whether it keeps its graph; predict the step's live activation bytes (module
    docstring).

    Phases, in execution order: the run of every item, after the last consumer of a window its close, and
    after an item the backwards of the read pieces whose readers it completes
    (``planner.pieces.piece_backward_points``), last first.  Live bytes of a phase: the running item's
    ``rows x saved_per_row`` and its ``attention_bytes``; per open window its exports and their gradients (2
    x export bytes); a kept producer's graph (``rows x graph_per_row``: a kept producer runs without
    recomputation) from its forward to its close; a recomputed producer's ``rows x saved_per_row`` at its
    close only (it runs again with the run's recomputation), beside its export gradients; a read piece's
    exports from its run to its backward; at a read piece's backward its ``rows x saved_per_row`` and
    attention bytes (a recomputed piece runs its forward again there, a kept one runs the backward of its
    graph), and from its run to its backward a kept piece's graph (``rows x piece_graph_per_row``, default
    ``saved_per_row``: what a row keeps when its forward ends under the run's recomputation,
    :func:`forward_end_bytes_per_row`) and attention bytes.

    Windows: ``force`` True recomputes every producer, False keeps every one; None decides with
    ``budget_bytes``: windows in producer order, each kept when every phase its keeping raises stays
    within the budget, with the windows decided before it (``budget_bytes`` None: keep all).
    ``recompute``: exactly these producers recompute (``force`` and the budget are then not consulted),
    for the prediction of a given choice.  Pieces: ``piece_keep`` "none" recomputes every read piece,
    "all" keeps every one, "auto" decides in step order within ``piece_budget_bytes`` by the windows'
    rule (after the windows' choice); a collection of positions keeps exactly those read pieces, a
    mapping ``{position: N}`` keeps those pieces with their first N layers recomputed (below).

    Part of a graph: with ``piece_layer_bytes`` (per layer, in order, the graph bytes a row keeps; the run
    recomputes nothing) "auto" keeps a read piece that does not fit whole with its first N layers
    recomputed in its backward (megatron's block recomputation), the fewest N with which it fits: it
    holds ``rows x (sum of piece_layer_bytes[N:] + N x layer_input_bytes)`` and its attention bytes, and
    its backward runs the forward of N layers again (``piece_layers``).  Without it a piece is kept whole
    or recomputed.
    """
    n = len(items)
    consumers: Dict[int, List[int]] = {}
    for i, it in enumerate(items):
        if it.producer is not None:
            p = int(it.producer)
            if not 0 <= p < i:
                raise ValueError(f"plan_window_memory: item {i} reads producer {p}, which does not run before it")
            consumers.setdefault(p, []).append(i)
    # pieces: the read pieces and where their backwards run (an item reading a later one refused there)
    read = sorted(i for i, it in enumerate(items) if it.read_later)
    backward_at = piece_backward_points([it.reads for it in items])   # item -> read pieces' backwards after it
    if sorted(p for ps in backward_at.values() for p in ps) != read:
        raise ValueError("plan_window_memory: the items read later (read_later) are not the items read (reads)")
    # phase index: run of item i, then the closes of the windows whose last consumer is i, then the read
    # pieces' backwards whose readers are done
    run_phase, close_phase, back_phase, k = [0] * n, {}, {}, 0
    last = {p: cs[-1] for p, cs in consumers.items()}
    closes_at: Dict[int, List[int]] = {}
    for p, c in last.items():
        closes_at.setdefault(c, []).append(p)
    for i in range(n):
        run_phase[i] = k
        k += 1
        for p in sorted(closes_at.get(i, ())):
            close_phase[p] = k
            k += 1
        for p in backward_at.get(i, ()):
            back_phase[p] = k
            k += 1
    base = np.zeros(k, dtype=np.float64)
    attn = [it.attention_bytes for it in items]
    # running microbatches (a producer's run is added with its window below)
    for i, it in enumerate(items):
        if i not in consumers:
            base[run_phase[i]] += it.rows * saved_per_row + attn[i]
    # read pieces: exports live from the run to the backward, the backward's activations at it
    for i in read:
        r, b = run_phase[i], back_phase[i]
        base[r + 1:b + 1] += items[i].export_bytes
        base[b] += items[i].rows * saved_per_row + attn[i]
    delta: Dict[int, Tuple[int, int, float, float, float]] = {}
    for p in consumers:
        act, ex = items[p].rows * graph_per_row, float(items[p].export_bytes)
        saved = items[p].rows * saved_per_row
        r, c = run_phase[p], close_phase[p]
        # recomputed: a no_grad forward (no more than a microbatch's saved bytes), its exports and their
        # gradients held, at close its forward and backward (the run's recomputation) beside the gradients
        base[r] += saved + ex + attn[p]
        base[r + 1:c] += 2 * ex
        base[c] += saved + ex + attn[p]
        # kept: its graph from its forward to its close, the exports' values too at its close
        delta[p] = (r, c, max(0.0, act - saved), act, ex)

    def add(live, p):
        r, c, dr, act, ex = delta[p]
        live[r] += dr
        live[r + 1:c] += act
        live[c] += ex
    kept: List[int] = []
    if recompute is not None:
        chosen = {int(p) for p in recompute}
        if not chosen <= set(consumers):
            raise ValueError(f"plan_window_memory: recompute names items that are no window's producer: "
                             f"{sorted(chosen - set(consumers))}")
        kept = [p for p in sorted(consumers) if p not in chosen]
        for p in kept:
            add(base, p)
    elif force is False or (force is None and budget_bytes is None):
        kept = sorted(consumers)
        for p in kept:
            add(base, p)
    elif force is None:
        base, kept = _keep_within(base, sorted(consumers), add, budget_bytes)
    recompute = tuple(p for p in sorted(consumers) if p not in set(kept))
    # pieces: a kept read piece holds its graph (or, its first n layers recomputed, part of it) from its run
    # to its backward
    held = saved_per_row if piece_graph_per_row is None else int(piece_graph_per_row)
    per_layer = None if piece_layer_bytes is None else [int(b) for b in piece_layer_bytes]

    def held_per_row(n: int) -> int:
        return held if not n else sum(per_layer[n:]) + n * int(layer_input_bytes)

    def hold(live, i, n=0):
        live[run_phase[i] + 1:back_phase[i]] += items[i].rows * held_per_row(n) + attn[i]
    layers: Dict[int, int] = {}                     # kept pieces -> first layers recomputed (0: all kept)
    if isinstance(piece_keep, str):
        if piece_keep not in PIECE_KEEP:
            raise ValueError(f"plan_window_memory: piece_keep must be one of {PIECE_KEEP} or positions, got "
                             f"{piece_keep!r}")
        if piece_keep == "auto" and piece_budget_bytes is None:
            raise ValueError("plan_window_memory: piece_keep 'auto' needs piece_budget_bytes")
        if piece_keep == "all":
            layers = {i: 0 for i in read}
        elif piece_keep == "auto":
            options = range(1 if per_layer is None else len(per_layer))
            for i in read:
                for n in options:
                    trial = base.copy()
                    hold(trial, i, n)
                    if _fits(base, trial, piece_budget_bytes):
                        layers[i], base = n, trial
                        break
    else:
        chosen = dict(piece_keep) if isinstance(piece_keep, Mapping) else {int(i): 0 for i in piece_keep}
        chosen = {int(i): int(n) for i, n in chosen.items()}
        if not set(chosen) <= set(read):
            raise ValueError(f"plan_window_memory: piece_keep names items that are no read piece: "
                             f"{sorted(set(chosen) - set(read))}")
        if any(n for n in chosen.values()) and per_layer is None:
            raise ValueError("plan_window_memory: a piece keeping part of its graph needs a run without "
                             "--recompute-granularity (piece_layer_bytes)")
        if any(not 0 <= n < (1 if per_layer is None else len(per_layer)) for n in chosen.values()):
            raise ValueError(f"plan_window_memory: piece_keep's recomputed layers must lie in [0, layers), got {chosen}")
        layers = dict(sorted(chosen.items()))
    if piece_keep != "auto":
        for i, n in layers.items():
            hold(base, i, n)
    kept_pieces = sorted(layers)
    return WindowMemoryPlan(recompute, tuple(kept), int(base.max()) if k else 0,
                            None if budget_bytes is None else int(budget_bytes),
                            tuple(int(it.export_bytes) for it in items), tuple(kept_pieces),
                            tuple(i for i in read if i not in layers), {i: n for i, n in layers.items() if n})
