"""Export trained weights to transformers' Kimi-Linear format (for the rollout engine).

``export_hf_checkpoint(model, config, vocab_size, path)`` is collective over the world: every
rank contributes its shards, global rank 0 writes ``path`` (``config.json`` + safetensors, the
format ``tools/convert_hf_checkpoint.py`` reads back).

Invariants: the exported state is exactly the full (TP = EP = 1) state of the model: expert
shards are gathered over the expert-parallel group (local expert ``i`` of EP rank ``e`` is
global expert ``e * num_local + i``), tensor-parallel shards over the tensor (or expert-tensor)
group and merged by ``models.hf_convert.merge_tp_shards``; replicated tensors are checked equal.
The vocabulary is the model's padded one.  Pipeline parallelism is refused (each stage would
hold part of the layers; gather them with tools/convert_hf_checkpoint.py from a checkpoint).
"""
from __future__ import annotations

import re
from typing import Dict, List

import torch
import torch.distributed as dist

__all__ = ["export_hf_checkpoint", "full_state_dict"]

_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def _gather(t: torch.Tensor, group) -> List[torch.Tensor]:
    size = dist.get_world_size(group)
    if size == 1:
        return [t.detach()]
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return parts


def full_state_dict(model, config) -> Dict[str, torch.Tensor]:
    """The full (TP = EP = 1) state of a HybridModel from its shards (collective; every rank gets a CPU copy)."""
    from megatron.core import parallel_state as ps
    from ..models.hf_convert import merge_tp_shards
    if ps.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError("export to transformers: --pipeline-model-parallel-size > 1 is not supported here; save a "
                         "checkpoint and convert it with tools/convert_hf_checkpoint.py")
    tp_group, etp_group = ps.get_tensor_model_parallel_group(), ps.get_expert_tensor_parallel_group()
    ep_group = ps.get_expert_model_parallel_group()
    ep = dist.get_world_size(ep_group)
    n_local = (config.num_moe_experts or 0) // ep
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    dense: List[Dict[str, torch.Tensor]] = []
    expert: List[Dict[str, torch.Tensor]] = []
    info_dense, info_expert = {}, {}
    for name in sorted(tensors):
        t = tensors[name]
        is_expert = _EXPERT.search(name) is not None
        group = etp_group if is_expert else tp_group
        size = dist.get_world_size(group)
        split = bool(getattr(t, "tensor_model_parallel", False)) and size > 1
        dim = int(t.partition_dim) if split else None
        shape = list(t.shape)
        if dim is not None:
            shape[dim] *= size
        parts = _gather(t, group)
        if is_expert:
            # every EP rank's copy of this local expert, renamed to its global index
            for e, tensor_parts in enumerate(zip(*[_gather(p, ep_group) for p in parts])):
                m = _EXPERT.search(name)
                g = e * n_local + int(m.group(1))
                gname = name[:m.start()] + f".local_experts.{g}." + name[m.end():]
                info_expert[gname] = (tuple(shape), dim)
                while len(expert) < len(tensor_parts):
                    expert.append({})
                for r, p in enumerate(tensor_parts):
                    expert[r][gname] = p
        else:
            info_dense[name] = (tuple(shape), dim)
            while len(dense) < len(parts):
                dense.append({})
            for r, p in enumerate(parts):
                dense[r][name] = p
    full = merge_tp_shards(dense, info_dense, config)
    if expert:
        full.update(merge_tp_shards(expert, info_expert, config))
    if "output_layer.weight" not in full:          # tied embeddings: transformers stores lm_head anyway
        full["output_layer.weight"] = full["embedding.word_embeddings.weight"]
    return {k: v.detach().to("cpu", copy=True) for k, v in full.items()}


def export_hf_checkpoint(model, config, vocab_size: int, path: str) -> None:
    """Write ``model`` (a HybridModel, unwrapped) as a transformers Kimi-Linear directory at ``path``."""
    from ..models.hf_convert import kimi_linear_hf_config, megatron_to_hf, save_hf_checkpoint
    if config.num_moe_experts and not config.moe_shared_expert_intermediate_size:
        raise ValueError("export to transformers: Kimi-Linear's MoE layers have a shared expert; this model has none "
                         "(--moe-shared-expert-intermediate-size)")
    full = full_state_dict(model, config)
    if dist.get_rank() == 0:
        hf_state = megatron_to_hf(full, config)
        dtype = next(iter(hf_state.values())).dtype
        cfg = kimi_linear_hf_config(config, vocab_size).to_dict()
        cfg["torch_dtype"] = str(dtype).replace("torch.", "")
        save_hf_checkpoint(path, cfg, hf_state)
    dist.barrier()
