"""Weight mapping between transformers' KimiLinearForCausalLM and the hybrid model (TP = EP = 1 names).

``hf_to_megatron(hf_state, config)`` returns a state dict for ``HybridModel``
(full, unsharded tensors: the names and shapes of a TP = EP = 1 model);
``megatron_to_hf(state, config)`` is its inverse.  Both are exact (copies,
concatenations and splits only), so a round trip is the identity.  The
checkpoint converter (tools/) builds on these and shards for TP/EP.

Mapping per layer i (``L = model.layers.{i}`` in transformers, ``M = decoder.layers.{i}`` here):

- norms: ``L.input_layernorm`` -> ``M.input_layernorm``, ``L.post_attention_layernorm`` ->
  ``M.pre_mlp_layernorm``; ``model.norm`` -> ``decoder.final_layernorm``;
  ``model.embed_tokens`` -> ``embedding.word_embeddings``; ``lm_head`` -> ``output_layer``.
- KDA: see the table in models/kda.py; ``conv1d.weight [3C, 1, K]`` splits into
  ``conv_q/k/v_weight [C, K]`` (channels ordered q, k, v).
- MLA: see the table in models/mla.py.
- dense MLP: ``linear_fc1 = cat(gate_proj, up_proj)`` (megatron's SwiGLU takes the
  first half as the gate), ``linear_fc2 = down_proj``.
- MoE: ``mlp.gate.weight`` -> ``mlp.router.weight``, ``mlp.gate.e_score_correction_bias`` ->
  ``mlp.router.expert_bias``; expert e: ``experts.gate_up_proj[e]`` (gate rows first) ->
  ``experts.local_experts.{e}.linear_fc1``, ``experts.down_proj[e]`` -> ``...linear_fc2``;
  ``shared_experts`` like a dense MLP -> ``mlp.shared_experts``.
"""
from __future__ import annotations

import re
from typing import Callable, Dict, List, Optional, Tuple

import torch

Rule = Tuple[str, List[str], Callable, Callable]   # ours, hf keys, hf->ours, ours->hf


def _same(*xs):
    return xs[0]


def _unsame(x):
    return [x]


def _cat(*xs):
    return torch.cat(xs, dim=0)


def _split_half(x):
    return list(x.chunk(2, dim=0))


def _rules(config) -> List[Rule]:
    rules: List[Rule] = [("embedding.word_embeddings.weight", ["model.embed_tokens.weight"], _same, _unsame),
                         ("decoder.final_layernorm.weight", ["model.norm.weight"], _same, _unsame),
                         ("output_layer.weight", ["lm_head.weight"], _same, _unsame)]
    attn, mlps = config.resolved_layer_types(), config.resolved_mlp_types()
    C = config.linear_num_heads * config.linear_head_dim
    for i, (a, m) in enumerate(zip(attn, mlps)):
        L, M = f"model.layers.{i}", f"decoder.layers.{i}"
        rules += [(f"{M}.input_layernorm.weight", [f"{L}.input_layernorm.weight"], _same, _unsame),
                  (f"{M}.pre_mlp_layernorm.weight", [f"{L}.post_attention_layernorm.weight"], _same, _unsame)]
        A, H = f"{M}.self_attention", f"{L}.self_attn"
        if a == "kda":
            for ours, hf in (("linear_q", "q_proj"), ("linear_k", "k_proj"), ("linear_v", "v_proj"),
                             ("linear_f_a", "forget_gate.f_a_proj"), ("linear_f_b", "forget_gate.f_b_proj"),
                             ("linear_beta", "b_proj"), ("linear_g_a", "g_a_proj"), ("linear_g_b", "g_b_proj"),
                             ("linear_proj", "o_proj")):
                rules.append((f"{A}.{ours}.weight", [f"{H}.{hf}.weight"], _same, _unsame))
            rules += [(f"{A}.A_log", [f"{H}.forget_gate.A_log"], _same, _unsame),
                      (f"{A}.dt_bias", [f"{H}.forget_gate.dt_bias"], _same, _unsame),
                      (f"{A}.out_norm_weight", [f"{H}.o_norm.weight"], _same, _unsame)]
            for j, part in enumerate("qkv"):
                rules.append((f"{A}.conv_{part}_weight", [f"{H}.conv1d.weight"],
                              (lambda w, j=j: w[j * C:(j + 1) * C, 0].clone()), None))
        else:
            pairs = [("linear_kv_down_proj.weight", "kv_a_proj_with_mqa.weight"),
                     ("kv_layernorm_weight", "kv_a_layernorm.weight"),
                     ("linear_kv_up_proj.weight", "kv_b_proj.weight"), ("linear_proj.weight", "o_proj.weight")]
            if config.q_lora_rank is None:
                pairs.append(("linear_q_proj.weight", "q_proj.weight"))
            else:
                pairs += [("linear_q_down_proj.weight", "q_a_proj.weight"),
                          ("q_layernorm_weight", "q_a_layernorm.weight"),
                          ("linear_q_up_proj.weight", "q_b_proj.weight")]
            rules += [(f"{A}.{o}", [f"{H}.{h}"], _same, _unsame) for o, h in pairs]
        P, G = f"{M}.mlp", f"{L}.mlp"
        if m == "dense":
            rules += [(f"{P}.linear_fc1.weight", [f"{G}.gate_proj.weight", f"{G}.up_proj.weight"], _cat, _split_half),
                      (f"{P}.linear_fc2.weight", [f"{G}.down_proj.weight"], _same, _unsame)]
        else:
            rules += [(f"{P}.router.weight", [f"{G}.gate.weight"], _same, _unsame),
                      (f"{P}.router.expert_bias", [f"{G}.gate.e_score_correction_bias"], _same, _unsame),
                      (f"{P}.shared_experts.linear_fc1.weight",
                       [f"{G}.shared_experts.gate_proj.weight", f"{G}.shared_experts.up_proj.weight"], _cat, _split_half),
                      (f"{P}.shared_experts.linear_fc2.weight", [f"{G}.shared_experts.down_proj.weight"], _same, _unsame)]
            for e in range(config.num_moe_experts):
                X = f"{P}.experts.local_experts.{e}"
                rules += [(f"{X}.linear_fc1.weight", [f"{G}.experts.gate_up_proj"], (lambda w, e=e: w[e].clone()), None),
                          (f"{X}.linear_fc2.weight", [f"{G}.experts.down_proj"], (lambda w, e=e: w[e].clone()), None)]
    return rules


def hf_to_megatron(hf_state: Dict[str, torch.Tensor], config) -> Dict[str, torch.Tensor]:
    """State dict of a TP = EP = 1 HybridModel from a KimiLinearForCausalLM state dict.

    Raises KeyError naming the first transformers key that is missing.
    """
    out = {}
    for ours, hf_keys, to_ours, _ in _rules(config):
        missing = [k for k in hf_keys if k not in hf_state]
        if missing:
            raise KeyError(f"transformers checkpoint lacks {missing[0]!r} (needed for {ours!r})")
        out[ours] = to_ours(*(hf_state[k] for k in hf_keys))
    return out


def megatron_to_hf(state: Dict[str, torch.Tensor], config) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_megatron` (KimiLinearForCausalLM names and shapes)."""
    out: Dict[str, torch.Tensor] = {}
    attn, mlps = config.resolved_layer_types(), config.resolved_mlp_types()
    for ours, hf_keys, _, to_hf in _rules(config):
        if to_hf is not None:
            for k, v in zip(hf_keys, to_hf(state[ours])):
                out[k] = v
    for i, (a, m) in enumerate(zip(attn, mlps)):
        M, L = f"decoder.layers.{i}", f"model.layers.{i}"
        if a == "kda":
            A = f"{M}.self_attention"
            out[f"{L}.self_attn.conv1d.weight"] = torch.cat(
                [state[f"{A}.conv_{p}_weight"] for p in "qkv"], dim=0).unsqueeze(1)
        if m == "moe":
            X = f"{M}.mlp.experts.local_experts"
            n = config.num_moe_experts
            out[f"{L}.mlp.experts.gate_up_proj"] = torch.stack([state[f"{X}.{e}.linear_fc1.weight"] for e in range(n)])
            out[f"{L}.mlp.experts.down_proj"] = torch.stack([state[f"{X}.{e}.linear_fc2.weight"] for e in range(n)])
    return out


def load_hf_weights(model, hf_state: Dict[str, torch.Tensor], config) -> None:
    """Copy a KimiLinearForCausalLM state dict into a TP = EP = 1 HybridModel (every tensor checked)."""
    ours = hf_to_megatron(hf_state, config)
    target = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name, value in ours.items():
        if name not in target:
            raise KeyError(f"HybridModel has no tensor {name!r}")
        if tuple(target[name].shape) != tuple(value.shape):
            raise ValueError(f"{name}: shape {tuple(value.shape)} from transformers, model has {tuple(target[name].shape)}")
        with torch.no_grad():
            target[name].copy_(value)
    uncovered = [n for n, _ in model.named_parameters() if n not in ours]
    if uncovered:
        raise KeyError(f"no transformers weight maps to {uncovered[0]!r}")


def kimi_linear_hf_config(config, vocab_size: int, **overrides):
    """transformers ``KimiLinearConfig`` describing the same architecture as ``config`` (tests, export)."""
    from transformers import KimiLinearConfig
    attn, mlps = config.resolved_layer_types(), config.resolved_mlp_types()
    n_shared = 0
    if config.moe_shared_expert_intermediate_size:
        n_shared = config.moe_shared_expert_intermediate_size // config.moe_ffn_hidden_size
    kw = dict(vocab_size=vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
              moe_intermediate_size=config.moe_ffn_hidden_size or config.ffn_hidden_size,
              num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
              num_key_value_heads=config.num_attention_heads, n_shared_experts=n_shared,
              routed_scaling_factor=config.moe_router_topk_scaling_factor or 1.0,
              kv_lora_rank=config.kv_lora_rank, q_lora_rank=config.q_lora_rank,
              qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
              qk_nope_head_dim=config.qk_nope_head_dim, n_group=config.moe_router_num_groups or 1,
              topk_group=config.moe_router_group_topk or 1, num_experts_per_tok=config.moe_router_topk,
              norm_topk_prob=config.moe_router_norm_topk_prob, hidden_act="silu", rms_norm_eps=config.layernorm_epsilon,
              tie_word_embeddings=False, num_local_experts=config.num_moe_experts or 1,
              linear_head_dim=config.linear_head_dim, linear_num_heads=config.linear_num_heads,
              linear_conv_kernel_dim=config.linear_conv_kernel_dim,
              layer_types=["linear_attention" if a == "kda" else "full_attention" for a in attn],
              mlp_layer_types=["dense" if m == "dense" else "sparse" for m in mlps],
              pad_token_id=None, bos_token_id=None, eos_token_id=None)
    kw.update(overrides)
    return KimiLinearConfig(**kw)


def shard_full_state(full: Dict[str, torch.Tensor], model, config, *, tp_rank: int = 0, tp_size: int = 1,
                     ep_rank: int = 0, ep_size: int = 1, etp_rank: int = None, etp_size: int = None
                     ) -> Dict[str, torch.Tensor]:
    """This rank's tensors of ``model`` (built with TP/EP) from a full TP = EP = 1 state dict.

    Reads megatron's partition attributes (``tensor_model_parallel``, ``partition_dim``) of the
    built model.  Gated first MLP layers (SwiGLU, ``config.gated_linear_unit``) hold
    ``[gate_r; up_r]`` per rank, so both halves are split.  Expert ``local_experts.{i}`` of EP
    rank e is global expert ``e * num_local + i``; experts split over the expert-TP group
    (``etp_*``, default the TP group).
    """
    import re
    etp_rank = tp_rank if etp_rank is None else etp_rank
    etp_size = tp_size if etp_size is None else etp_size
    n_local = (config.num_moe_experts or 0) // max(ep_size, 1)
    out = {}
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name, local in tensors.items():
        src = name
        expert = re.search(r"\.local_experts\.(\d+)\.", name)
        if expert:
            g = ep_rank * n_local + int(expert.group(1))
            src = name[:expert.start()] + f".local_experts.{g}." + name[expert.end():]
        if src not in full:
            continue
        value = full[src]
        if tuple(value.shape) != tuple(local.shape):
            rank, size = (etp_rank, etp_size) if expert else (tp_rank, tp_size)
            dim = getattr(local, "partition_dim", 0)
            if config.gated_linear_unit and name.endswith("linear_fc1.weight"):
                value = torch.cat([h.chunk(size, dim=dim)[rank] for h in value.chunk(2, dim=0)], dim=0)
            else:
                value = value.chunk(size, dim=dim)[rank]
            if tuple(value.shape) != tuple(local.shape):
                raise ValueError(f"{name}: cannot shard {tuple(full[src].shape)} into {tuple(local.shape)}")
        out[name] = value.clone()
    return out


def hybrid_config_from_hf(hf_config, **overrides):
    """HybridConfig of the architecture a transformers ``KimiLinearConfig`` describes.

    Megatron-side settings (parallelism, dtypes, recomputation, ...) come from ``overrides``.
    Kimi-Linear routes with sigmoid scores, an expert-score correction bias, groups and a
    routed scaling factor, renormalizing the top-k weights when ``norm_topk_prob``.
    """
    import torch.nn.functional as F

    from .config import HybridConfig
    c = hf_config
    if c.num_key_value_heads != c.num_attention_heads:
        raise ValueError("KimiLinearConfig.num_key_value_heads must equal num_attention_heads (MLA)")
    if c.hidden_act != "silu":
        raise ValueError(f"KimiLinearConfig.hidden_act {c.hidden_act!r}: only silu (SwiGLU) is supported")
    sparse = [t == "sparse" for t in c.mlp_layer_types]
    kw = dict(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.intermediate_size,
              num_attention_heads=c.num_attention_heads, normalization="RMSNorm", layernorm_epsilon=c.rms_norm_eps,
              gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
              attention_dropout=0.0, linear_num_heads=c.linear_num_heads, linear_head_dim=c.linear_head_dim,
              linear_conv_kernel_dim=c.linear_conv_kernel_dim, q_lora_rank=c.q_lora_rank,
              kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
              qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, mla_rope=False,
              layer_types=["mla" if t == "full_attention" else "kda" for t in c.layer_types],
              mlp_types=["moe" if s else "dense" for s in sparse])
    if any(sparse):
        kw.update(num_moe_experts=c.num_local_experts, moe_router_topk=c.num_experts_per_tok,
                  moe_ffn_hidden_size=c.moe_intermediate_size,
                  moe_shared_expert_intermediate_size=(c.moe_intermediate_size * c.n_shared_experts
                                                       if c.n_shared_experts else None),
                  moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_router_norm_topk_prob=bool(c.norm_topk_prob),
                  moe_router_topk_scaling_factor=c.routed_scaling_factor,
                  moe_router_num_groups=c.n_group if c.n_group and c.n_group > 1 else None,
                  moe_router_group_topk=c.topk_group if c.n_group and c.n_group > 1 else None,
                  moe_router_dtype="fp32", moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    kw.update(overrides)
    return HybridConfig(**kw)


# ---------------------------------------------------------------------------
# checkpoint files: transformers directories, TP shards of a full state dict
# ---------------------------------------------------------------------------

HF_CONFIG = "config.json"
HF_SINGLE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A bad checkpoint or conversion request; the message names the file, tensor, field or flag."""


def read_hf_config(path: str) -> dict:
    """The JSON of ``path/config.json``, checked to describe a transformers ``kimi_linear`` model."""
    import json
    import os
    cfg_path = os.path.join(path, HF_CONFIG)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such directory")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{cfg_path}: no such file (a transformers checkpoint directory has one)")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict) or raw.get("model_type") != "kimi_linear":
        got = raw.get("model_type") if isinstance(raw, dict) else type(raw).__name__
        raise CheckpointError(f"{cfg_path}: field 'model_type' is {got!r}, expected 'kimi_linear'")
    if raw.get("tie_word_embeddings"):
        raise CheckpointError(f"{cfg_path}: field 'tie_word_embeddings' is true; only untied embeddings "
                              "(Kimi-Linear's) are supported")
    return raw


def kimi_linear_config_from_dict(raw: dict, where: str = HF_CONFIG):
    """transformers ``KimiLinearConfig`` from config.json's dict (errors name ``where``)."""
    from transformers import KimiLinearConfig
    try:
        return KimiLinearConfig.from_dict(dict(raw))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from None


def load_hf_checkpoint(path: str, dtype=None) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """config.json's dict and the in-memory state dict (KimiLinearForCausalLM names) of a directory.

    transformers stores Kimi-Linear in the original checkpoint naming (``block_sparse_moe``,
    per-expert ``w1/w2/w3``, separate ``q/k/v_conv1d``); its loader converts that exactly
    (renames, concatenations), so the tensors are the stored values, in their stored dtype unless
    ``dtype`` is given.  Missing, unexpected or mis-shaped tensors raise CheckpointError.
    """
    import os
    import warnings
    from transformers import KimiLinearForCausalLM
    raw = read_hf_config(path)
    hf_cfg = kimi_linear_config_from_dict(raw, os.path.join(path, HF_CONFIG))
    if not (os.path.isfile(os.path.join(path, HF_SINGLE)) or os.path.isfile(os.path.join(path, HF_INDEX))):
        raise CheckpointError(f"{path}: neither {HF_SINGLE} nor {HF_INDEX} exists")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, info = KimiLinearForCausalLM.from_pretrained(
                path, config=hf_cfg, dtype=dtype if dtype is not None else "auto", output_loading_info=True,
                ignore_mismatched_sizes=True, experts_implementation="eager")
    except (OSError, ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: cannot load the safetensors files ({first})") from None
    for kind in ("missing_keys", "mismatched_keys", "unexpected_keys"):
        bad = sorted(info.get(kind) or [], key=str)
        if bad:
            what = {"missing_keys": "is missing", "mismatched_keys": "has a shape config.json does not imply",
                    "unexpected_keys": "is not part of the architecture config.json describes"}[kind]
            name = bad[0][0] if isinstance(bad[0], tuple) else bad[0]
            raise CheckpointError(f"{path}: tensor {name!r} {what}")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if dtype is None:
        # transformers upcasts some modules (_keep_in_fp32_modules) on load: give back the stored dtypes
        stored = _stored_dtypes(path)
        state = {k: (v.to(stored[_disk_key(k)]) if _disk_key(k) in stored else v) for k, v in state.items()}
    return raw, state


_DISK_RULES = [(re.compile(r"\.forget_gate\."), "."),
               (re.compile(r"\.block_sparse_moe\."), ".mlp."),
               (re.compile(r"\.self_attn\.[qkv]_conv1d\."), ".self_attn.conv1d."),
               (re.compile(r"\.experts\.\d+\.w[13]\.weight$"), ".experts.gate_up_proj"),
               (re.compile(r"\.experts\.\d+\.w2\.weight$"), ".experts.down_proj")]


def _disk_key(name: str) -> str:
    """A name in one spelling shared by the stored (original Kimi) and the loaded (transformers) naming."""
    for pattern, repl in _DISK_RULES:
        name = pattern.sub(repl, name)
    return name


def _stored_dtypes(path: str) -> Dict[str, torch.dtype]:
    """dtype of every stored tensor (safetensors headers), keyed by :func:`_disk_key`."""
    import glob
    import os
    from safetensors import safe_open
    out: Dict[str, torch.dtype] = {}
    for fp in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(fp, framework="pt") as f:
            for k in f.keys():
                code = f.get_slice(k).get_dtype()
                if code in _SAFETENSORS_DTYPES:
                    out[_disk_key(k)] = _SAFETENSORS_DTYPES[code]
    return out


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def save_hf_checkpoint(path: str, config_json: dict, state: Dict[str, torch.Tensor],
                       max_shard_size: str = "5GB") -> None:
    """Write a transformers Kimi-Linear directory (config.json as given, safetensors via transformers).

    The model is assembled without initialization (``assign``: the tensors themselves), so the stored
    values and dtypes are exactly ``state``'s.
    """
    import json
    import os
    import warnings
    from transformers import KimiLinearForCausalLM
    hf_cfg = kimi_linear_config_from_dict(config_json)
    with torch.device("meta"):
        model = KimiLinearForCausalLM(hf_cfg)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise CheckpointError(f"state for transformers lacks {missing[:1]} / has extra {unexpected[:1]}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(path, max_shard_size=max_shard_size)
    with open(os.path.join(path, HF_CONFIG), "w") as f:      # the fields exactly as they came
        json.dump(config_json, f, indent=2, sort_keys=True)
        f.write("\n")


class _ShapeOnlyModel:
    """Meta tensors with a TP rank's local shapes and megatron's partition attributes (for shard_full_state)."""

    def __init__(self, info: Dict[str, Tuple[Tuple[int, ...], Optional[int]]], tp_size: int):
        self.params = {}
        for name, (shape, dim) in info.items():
            local = list(shape)
            if dim is not None:
                local[dim] //= tp_size
            t = torch.empty(local, device="meta")
            if dim is not None:
                t.partition_dim = dim
            self.params[name] = t

    def named_parameters(self):
        return iter(self.params.items())

    def named_buffers(self):
        return iter(())


def tp_partition_info(model) -> Dict[str, Tuple[Tuple[int, ...], Optional[int]]]:
    """Full shape and TP split axis (None: replicated) of every tensor of a TP = EP = 1 HybridModel."""
    out = {}
    for name, t in {**dict(model.named_parameters()), **dict(model.named_buffers())}.items():
        split = bool(getattr(t, "tensor_model_parallel", False))
        out[name] = (tuple(t.shape), int(t.partition_dim) if split else None)
    return out


def check_tp_divisible(info, config, vocab_size: int, tp_size: int) -> None:
    """Raise CheckpointError naming the config field (or tensor) that ``--tp tp_size`` does not divide."""
    if tp_size < 1:
        raise CheckpointError(f"--tp must be >= 1, got {tp_size}")
    fields = [("num_attention_heads", config.num_attention_heads), ("linear_num_heads", config.linear_num_heads),
              ("vocab_size", vocab_size), ("intermediate_size", config.ffn_hidden_size)]
    if config.num_moe_experts:
        fields.append(("moe_intermediate_size", config.moe_ffn_hidden_size))
    for field, value in fields:
        if value % tp_size:
            raise CheckpointError(f"--tp {tp_size} does not divide config.json field {field!r} = {value}")
    for name, (shape, dim) in info.items():
        if dim is not None and shape[dim] % tp_size:
            raise CheckpointError(f"--tp {tp_size} does not divide dimension {dim} of {name} {shape}")


def shard_for_tp(full: Dict[str, torch.Tensor], info, config, tp_size: int) -> List[Dict[str, torch.Tensor]]:
    """Per-TP-rank state dicts of ``full`` (what :func:`shard_full_state` gives a model built with TP = tp_size).

    ``info`` is :func:`tp_partition_info` of the TP = 1 model: megatron marks the same tensors as
    TP-split at every TP size, so the local shapes follow without building the TP model.
    """
    proxy = _ShapeOnlyModel({k: v for k, v in info.items() if k in full}, tp_size)
    return [shard_full_state(full, proxy, config, tp_rank=r, tp_size=tp_size) for r in range(tp_size)]


def merge_tp_shards(shards: List[Dict[str, torch.Tensor]], info, config) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`shard_for_tp`: the full (TP = 1) tensors from every rank's state dict.

    Replicated tensors must be equal on all ranks (bitwise); split ones are concatenated along
    their partition axis (gated ``linear_fc1``: gate halves first, then up halves).
    """
    tp = len(shards)
    out = {}
    for name, (shape, dim) in info.items():
        have = [r for r, s in enumerate(shards) if name in s]
        if not have:
            continue
        if len(have) != tp:
            missing = next(r for r in range(tp) if r not in have)
            raise CheckpointError(f"TP rank {missing} lacks {name!r}")
        parts = [s[name] for s in shards]
        if dim is None or tp == 1:
            for r, p in enumerate(parts[1:], 1):
                if p.shape != parts[0].shape or not torch.equal(p, parts[0]):
                    raise CheckpointError(f"{name!r} is replicated over TP but rank {r} differs from rank 0")
            value = parts[0]
        elif config.gated_linear_unit and name.endswith("linear_fc1.weight"):
            halves = [p.chunk(2, dim=0) for p in parts]
            value = torch.cat([torch.cat([h[0] for h in halves], dim=dim), torch.cat([h[1] for h in halves], dim=dim)],
                              dim=0)
        else:
            value = torch.cat(parts, dim=dim)
        if tuple(value.shape) != tuple(shape):
            raise CheckpointError(f"{name!r}: TP shards give shape {tuple(value.shape)}, the model has {shape}")
        out[name] = value
    return out
