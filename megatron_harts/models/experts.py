"""MoE experts: megatron-core's ``SequentialMLP`` computed with two grouped GEMMs.

``GroupedSequentialMLP`` *is* a ``SequentialMLP``: same ``local_experts.{i}``
MLPs (``linear_fc1`` a ColumnParallelLinear, ``linear_fc2`` a RowParallelLinear,
``is_expert=True`` on the expert-TP group), same parameters, names, shapes,
partition attributes, ``sharded_state_dict`` and checkpoint format.  Only the
forward differs: instead of one small GEMM pair per local expert (a Python
loop, a split and a cat), all local experts run in

    fc1:  h = grouped_mm(x, stack_e(W1_e)^T, offs)       # [M, F1], one launch
    act:  a = MLP's activation of h, times the probs     # row-wise, as MLP does it
    fc2:  y = grouped_mm(a, stack_e(W2_e)^T, offs)       # [M, H], one launch

with ``offs = cumsum(tokens_per_expert)`` (``torch._grouped_mm``).  The stacked
weights are built per call from the experts' own parameters (a copy, cheap
compared with the GEMMs) inside :class:`_GroupedLinear`, an autograd function
whose inputs are the individual weight parameters.  Under megatron DDP (the
weights carry ``main_grad`` and ``grad_added_to_main_grad``) the backward adds
the stacked weight gradient into every expert's ``main_grad`` in one foreach
call and marks them added, so DDP's post-hooks (still fired through each
weight's grad accumulator) skip their per-expert adds: the same values, bitwise,
as the per-expert linears' gradients without ``gradient_accumulation_fusion``
(bf16 wgrad promoted to ``main_grad``'s dtype, then added), with one launch per
linear instead of one per expert; with the fusion on (the dense linears then
accumulate fp32 products, ``patches.wgrad_accumulation``) the experts keep that
unfused rounding (``_grouped_mm`` writes its output in its inputs' dtype).  Without DDP the gradients come back through
ordinary autograd into ``.grad``.  The backward
re-stacks the weights instead of saving the stacked copy, so activation memory
does not grow by a copy of every expert's weights per MoE layer.

What the per-expert linears do and the grouped path reproduces (megatron-core
0.16.1): with ``is_expert=True`` and expert TP or EP > 1 the linears set
``explicit_expert_comm`` and perform no communication at all (no input copy,
no dgrad all-reduce, no sequence-parallel gather, no output reduction: the
token dispatcher does the expert-TP reduction); with both sizes 1 their
``copy_to``/``reduce_from`` regions act on a group of one, i.e. are identities.
So each rank computes plain local matmuls on its shards, and so does the
grouped path, with the local shard shapes.  The activation mirrors
``MLP.forward`` without bias: ``bias_activation_fusion`` uses the same
weighted SwiGLU / quick-GEGLU fused functions on the same rows; otherwise
GLU (clamp, ``glu_linear_offset``) or the plain activation, then
``(act * probs.unsqueeze(-1)).to(act.dtype)`` (the probs' dtype, usually fp32,
takes part in the product and the result is cast back), as MLP does.  All of
these are row-wise, so per row they are the same operations as per expert.

The reference is ``SequentialMLP.forward`` itself (:meth:`reference_forward`);
:meth:`fallback_reason` decides, per call, whether the grouped path applies.
It falls back (the reason is a plain string; ``None`` means grouped) for:
torch without ``_grouped_mm``; ``use_grouped_mm = False``; fewer than 2 local
experts (one GEMM pair already); fp8/fp4 (quantization padding);
``moe_apply_probs_on_input``; TE activations or CPU offloading; expert modules other than
exactly MLP / ColumnParallelLinear / RowParallelLinear, or with biases
(``add_bias_linear``); fused bias-activation cases MLP itself would refuse;
autocast; input dtypes other than bf16/fp16/fp32 (fp64 keeps the reference,
bitwise) or weights of another dtype or device; feature sizes (hidden, fc1
out, fc2 in, fc2 out) not multiples of 16 bytes (``_grouped_mm``'s stride
alignment; padding them would copy the weights again, so it falls back);
zero tokens in total; and token counts (when on the CPU) that do not add up to
the rows (the reference then raises the same error as before).  Experts with
zero tokens are fine: their outputs are empty and their weight gradients are
set to exactly zero (a zero-size group's wgrad is not trusted from the kernel).

On CUDA, ``_grouped_mm`` runs its CUTLASS grouped kernel for bf16 on sm90/sm100;
fp16/fp32 (or other GPUs) take torch's own fallback, a C++ loop of per-group GEMMs
after one device-to-host copy of the offsets (the reference's ``tolist`` syncs too).
On CPU it is that same loop (the tests see the grouped path equal the reference
bitwise there), so only the GPU kernel's summation order can differ from the reference.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional

import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_bias_geglu import quick_gelu, weighted_bias_quick_geglu_impl
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import SequentialMLP

_GROUPED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_HAVE_GROUPED_MM = hasattr(torch, "_grouped_mm")


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` with exact row-major strides and a 16-byte aligned start (what ``_grouped_mm`` accepts)."""
    expected = (t.shape[1], 1) if t.dim() == 2 else None
    if t.stride() == expected and t.data_ptr() % 16 == 0:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def _gather_rows(source: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """fc1's input built again from the dispatch's source rows."""
    return source.index_select(0, rows)


class _GroupedLinear(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ W_e^T`` for all experts e in one ``_grouped_mm``.

    Inputs: ``x`` [M, K] (rows grouped by expert), ``offs`` [G] int32 (cumulative row
    counts, ``offs[-1] == M``), ``empty`` [G] bool (experts with no rows), ``main_grad_only``,
    ``rebuild`` (None, or ``(fn, tensors)`` with ``x`` bitwise ``fn(*tensors)``: the backward keeps
    ``tensors`` and builds ``x`` again instead of keeping it; fc1 keeps the dispatch's source and rows
    and gathers again, fc2 keeps the fc1 output and probs the activation keeps anyway and runs the
    activation again), then the G weights [N, K] as autograd inputs.  Gradients: ``dx = grouped_mm(dy, W)``,
    ``dW = grouped_mm(dy^T, x)`` (2d x 2d over the row groups), empty experts' ``dW`` exactly zero.

    ``main_grad_only``: None, or the G weights as a tuple, *not* autograd inputs (no weight after
    it): their gradients go only into their ``main_grad`` (:func:`_add_to_main_grads`), so the
    backward creates no gradient for them and autograd runs no grad accumulator (nor DDP hook) of
    any expert weight (:func:`expert_grad_hooks_off` says when that is right).
    """

    @staticmethod
    def forward(ctx, x, offs, empty, main_grad_only, rebuild, *weights):
        if main_grad_only is not None:
            weights = main_grad_only
        w = torch.stack(weights)                                   # [G, N, K]
        kept = (x,) if rebuild is None else tuple(t.detach() for t in rebuild[1])
        ctx.save_for_backward(offs, empty, *kept, *weights)
        ctx.rebuild, ctx.kept = (None if rebuild is None else rebuild[0]), len(kept)
        ctx.main_grad_only = main_grad_only is not None
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)  # [M, N]

    @staticmethod
    def backward(ctx, dy):
        offs, empty, *rest = ctx.saved_tensors
        kept, weights = rest[:ctx.kept], rest[ctx.kept:]
        if ctx.rebuild is None:
            x = kept[0]
        else:
            with torch.no_grad():
                x = ctx.rebuild(*kept)
        dy = _dense(dy)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = torch._grouped_mm(dy, torch.stack(weights), offs=offs)      # [M, K]
        weight_needs = [True] * len(weights) if ctx.main_grad_only else ctx.needs_input_grad[5:]
        dws = [None] * (0 if ctx.main_grad_only else len(weights))
        if any(weight_needs):
            dw = torch._grouped_mm(dy.t(), x, offs=offs)                      # [G, N, K]
            dw.masked_fill_(empty.view(-1, 1, 1), 0)
            if ctx.main_grad_only:
                _add_to_main_grads(weights, dw)
            elif _accumulates_into_main_grad(weights, weight_needs):
                _add_to_main_grads(weights, dw)
                dws = _placeholder_grads(weights, dw)
            else:
                dws = [g if need else None for g, need in zip(dw.unbind(0), weight_needs)]
        return (dx, None, None, None, None, *dws)


def _accumulates_into_main_grad(weights, needs_grad) -> bool:
    """Whether the weights' gradients go straight into megatron DDP's ``main_grad`` buffers: every
    weight needs its gradient, has a ``main_grad`` of one dtype and device, carries DDP's
    ``grad_added_to_main_grad`` flag and no ``zero_out_wgrad`` request."""
    if not all(needs_grad):
        return False
    ref = getattr(weights[0], "main_grad", None)
    if ref is None:
        return False
    for w in weights:
        g = getattr(w, "main_grad", None)
        if g is None or g.dtype != ref.dtype or g.device != ref.device or g.shape != w.shape \
                or not hasattr(w, "grad_added_to_main_grad") or getattr(w, "zero_out_wgrad", False):
            return False
    return True


def _add_to_main_grads(weights, dw: torch.Tensor) -> None:
    """Add the stacked weight gradients ``dw`` [G, N, K] into the weights' ``main_grad`` in one
    multi-tensor launch.

    Invariant: every ``main_grad`` ends bitwise where DDP's hook would put it
    (``main_grad.add_(grad)`` promotes ``grad`` to ``main_grad``'s dtype before adding; so does this),
    with one kernel for the conversion and the foreach kernels instead of one add per expert.
    """
    mains = [w.main_grad for w in weights]
    torch._foreach_add_(mains, list(dw.to(mains[0].dtype).unbind(0)))
    for w in weights:
        w.grad_added_to_main_grad = True


def _placeholder_grads(weights, dw: torch.Tensor) -> List[torch.Tensor]:
    """Gradients for weights whose gradients are already in ``main_grad``: uninitialized, like
    megatron's fused linears' ``grad_weight``; they only let the weights' grad accumulators run,
    which fires DDP's hooks (bucket readiness), and the hooks skip them."""
    return [torch.empty(w.shape, dtype=dw.dtype, device=dw.device) for w in weights]


@contextlib.contextmanager
def expert_grad_hooks_off(model):
    """Within the block the grouped experts of ``model`` whose weights have DDP's ``main_grad`` add
    their weight gradients there and take no further part in autograd (``_GroupedLinear``'s
    ``main_grad_only``): per backward no grad accumulator, no placeholder gradient and no DDP hook per
    expert weight.  For backward passes inside DDP's ``no_sync`` only: there the hooks of a weight
    already added into ``main_grad`` only clear its ``.grad`` (bucket readiness is counted on the last
    microbatch, outside ``no_sync``).  The flags are restored after the block."""
    mlps = [m for m in model.modules() if isinstance(m, GroupedSequentialMLP)]
    saved = [m.__dict__.get("weight_grad_hooks") for m in mlps]
    for m in mlps:
        m.weight_grad_hooks = False
    try:
        yield
    finally:
        for m, v in zip(mlps, saved):
            if v is None:
                del m.weight_grad_hooks
            else:
                m.weight_grad_hooks = v


class GroupedSequentialMLP(SequentialMLP):
    """SequentialMLP (same parameters and checkpoints) whose forward uses two grouped GEMMs.

    See the module docstring for the computation, the equivalence argument and the
    fallback rules.  Set ``use_grouped_mm = False`` on an instance to force the reference.
    """

    use_grouped_mm: bool = True
    #: fc2's backward computes its input (the activation's output) again from the fc1 output and probs,
    #: which the activation keeps anyway, instead of keeping it (off: fc2 keeps it, as a linear does)
    rebuild_fc2_input: bool = True
    #: weights added into DDP's ``main_grad`` still get placeholder gradients (``expert_grad_hooks_off``)
    weight_grad_hooks: bool = True
    #: the MoE layer's all-gather dispatcher (``models.dispatcher``), set by the layer: where its
    #: ``permuted_from`` holds ``(permuted, source, rows)`` of the microbatch in flight and fc1's input is
    #: ``permuted``, fc1 keeps ``source`` and ``rows`` for its backward instead
    dispatcher = None

    # ------------------------------------------------------------------ dispatch
    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        if self.fallback_reason(permuted_local_hidden_states, tokens_per_expert, permuted_probs) is None:
            return self.grouped_forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        return self.reference_forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)

    def reference_forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        """megatron-core's SequentialMLP.forward: one MLP call per local expert."""
        return SequentialMLP.forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs)

    def fallback_reason(self, x: torch.Tensor, tokens_per_expert: torch.Tensor,
                        probs: torch.Tensor) -> Optional[str]:
        """Why this call must take the reference path, or None when the grouped path applies."""
        cfg = self.config
        if not _HAVE_GROUPED_MM:
            return "torch has no _grouped_mm"
        if not self.use_grouped_mm:
            return "use_grouped_mm is off"
        if self.num_local_experts < 2:
            return "a single local expert is one GEMM pair already"
        if cfg.fp8 or cfg.fp4:
            return "fp8/fp4 quantization"
        if cfg.moe_apply_probs_on_input:
            return "moe_apply_probs_on_input"
        if cfg.use_te_activation_func or getattr(cfg, "cpu_offloading", False):
            return "TE activation or CPU offloading"
        for e in self.local_experts:
            if type(e) is not MLP or type(e.linear_fc1) is not ColumnParallelLinear \
                    or type(e.linear_fc2) is not RowParallelLinear:
                return "expert modules are not exactly MLP(ColumnParallelLinear, RowParallelLinear)"
            if e.linear_fc1.bias is not None or e.linear_fc2.bias is not None:
                return "biases in the expert linears (add_bias_linear)"
            if e.linear_fc1.weight is None or e.linear_fc1.gather_output or not e.linear_fc2.input_is_parallel:
                return "expert linears not in their MLP configuration"
        expert = self.local_experts[0]
        if cfg.bias_activation_fusion and not (
                cfg.gated_linear_unit and expert.activation_func in (F.silu, quick_gelu)):
            return "bias_activation_fusion with an activation MLP refuses for weighted experts"
        if torch.is_autocast_enabled(x.device.type):
            return "autocast"
        if x.dtype not in _GROUPED_DTYPES:
            return f"dtype {x.dtype} (grouped GEMM takes bf16/fp16/fp32)"
        if x.dim() != 2:
            return "input is not [tokens, hidden]"
        if x.shape[0] == 0:
            return "no tokens"
        weights = [p for e in self.local_experts for p in (e.linear_fc1.weight, e.linear_fc2.weight)]
        if any(w.dtype != x.dtype or w.device != x.device for w in weights):
            return "weights of another dtype or device than the input"
        f1, k = expert.linear_fc1.weight.shape
        h_out, f2 = expert.linear_fc2.weight.shape
        align = 16 // x.element_size()
        if any(d % align for d in (k, f1, f2, h_out)):
            return f"feature sizes {(k, f1, f2, h_out)} are not multiples of {align} elements (16 bytes)"
        if tokens_per_expert.device.type == "cpu" and (
                tokens_per_expert.numel() != self.num_local_experts
                or int(tokens_per_expert.sum()) != x.shape[0]):
            return "token counts do not match the rows"
        return None

    # ------------------------------------------------------------------ fast path
    def _activation(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """MLP.forward's activation-with-probs branch, bias-free (row-wise, so per row identical)."""
        cfg = self.config
        expert = self.local_experts[0]
        if cfg.bias_activation_fusion:
            if expert.activation_func == F.silu and cfg.gated_linear_unit:
                return weighted_bias_swiglu_impl(h, None, probs.unsqueeze(-1), cfg.activation_func_fp8_input_store)
            return weighted_bias_quick_geglu_impl(h, None, probs.unsqueeze(-1), cfg.activation_func_fp8_input_store,
                                                  cfg.glu_linear_offset, cfg.activation_func_clamp_value)
        if cfg.gated_linear_unit:
            x_glu, x_linear = torch.chunk(h, 2, dim=-1)
            if (val := cfg.activation_func_clamp_value) is not None:
                x_glu = x_glu.clamp(min=None, max=val)
                x_linear = x_linear.clamp(min=-val, max=val)
            a = cfg.activation_func(x_glu) * (x_linear + cfg.glu_linear_offset)
        else:
            a = expert.activation_func(h)
        original_dtype = a.dtype
        a = a * probs.unsqueeze(-1)
        return a.to(original_dtype)

    def _linear(self, x, offs, empty, weights: List[torch.Tensor], rebuild=None) -> torch.Tensor:
        """One grouped linear; its weights out of autograd (``main_grad_only``) where
        :func:`expert_grad_hooks_off` asks for it, every weight accumulates into ``main_grad`` and the
        input takes part in autograd (the output's backward, which adds the weight gradients, runs).
        ``rebuild``: ``(fn, tensors)`` that build ``x`` again in the backward, kept instead of ``x``."""
        if not self.weight_grad_hooks and torch.is_grad_enabled() and x.requires_grad and \
                _accumulates_into_main_grad(weights, [w.requires_grad for w in weights]):
            return _GroupedLinear.apply(x, offs, empty, tuple(weights), rebuild)
        return _GroupedLinear.apply(x, offs, empty, None, rebuild, *weights)

    def grouped_forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        """All local experts in two grouped GEMMs (call only when ``fallback_reason`` is None)."""
        x = _dense(permuted_local_hidden_states)
        # computed where the counts live (the dispatchers hand them over on the CPU), then moved:
        # fresh pageable tensors, so the non-blocking copies neither stall the stream nor race
        offs = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32).to(x.device, non_blocking=True)
        empty = (tokens_per_expert == 0).to(x.device, non_blocking=True)
        fc1: List[torch.Tensor] = [e.linear_fc1.weight for e in self.local_experts]
        fc2: List[torch.Tensor] = [e.linear_fc2.weight for e in self.local_experts]
        given = getattr(self.dispatcher, "permuted_from", None)
        # x is the dispatch's gather: fc1 keeps its source and rows instead
        gathered = (_gather_rows, given[1:]) if given is not None and given[0] is x else None
        h = self._linear(x, offs, empty, fc1, gathered)
        a = self._activation_out(h, permuted_probs)
        # fc2 keeps the activation's inputs (which the activation keeps for its own backward) instead
        # of its output: per routed row one fc2-input width less activation memory, for one more
        # elementwise activation in the backward (not where the activation keeps its input in fp8)
        rebuild = self.rebuild_fc2_input and not self.config.activation_func_fp8_input_store
        y = self._linear(a, offs, empty, fc2, (self._activation_out, (h, permuted_probs)) if rebuild else None)
        return y, None

    def _activation_out(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """fc2's input: the activation of ``h`` times ``probs``, dense (the same values every call)."""
        return _dense(self._activation(h, probs))
