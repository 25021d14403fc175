"""Logit probes: the logits a run gives a fixed sample of target tokens, written so that two runs
(tree vs expanded mode, a rerun, another parallel layout) can be compared token by token.

A probe is a forward-only pass over one planned global batch, in the run's own mode and through
its own schedule (windows, pipeline stages, expert-parallel lockstep included).  It records, for
every sampled target token (trajectory id, position of the predicted token), the full logit
vector of the row that predicts it: this rank's vocabulary shard under tensor parallelism.

Invariants:

- The sample depends on the trajectories alone (:func:`sample_mask`: a hash of trajectory id and
  position against a stride from the forest's target count), so every mode and layout probes the
  same tokens.
- Each sampled target is recorded exactly once over the data-parallel replicas: a microbatch
  records only the targets it owns (recomputed context rows of another microbatch's targets and
  idle expert-parallel slots record nothing).
- Files: ``DIR/iter_<iteration, 7 digits>/rank_<global rank, 5 digits>.pt``, each a dict with
  ``keys`` (list of (trajectory id, position)), ``logits`` ([n, vocab / tp], the model's dtype),
  ``tp_rank``, ``tp_size``; only last-pipeline-stage ranks write.  The oracle's probe (an upcast copy
  of the initial weights, :func:`oracle_logits`) goes to ``DIR/oracle/iter_<iteration>/``.  :func:`load_probe` joins a
  directory's shards back into full vocabulary rows and :func:`compare_probes` compares two.
"""
from __future__ import annotations

import glob
import os
import zlib
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

__all__ = ["sample_mask", "sample_stride", "probe_logits", "oracle_dtype", "oracle_logits", "write_probe",
           "load_probe", "compare_probes", "ProbeError", "ORACLE_DIR", "OUTLIER_DEFICIT"]

#: where ``--tree-logit-probe-oracle`` writes the upcast oracle's probe, inside the probe directory
ORACLE_DIR = "oracle"
#: a token whose logit cosine deficit exceeds this is counted apart by :func:`compare_probes`: rounding alone
#: stays orders of magnitude below it, a discrete change (an MoE router choosing another expert) does not
OUTLIER_DEFICIT = 1e-3

_MIX = np.uint64(0x9E3779B97F4A7C15)


class ProbeError(ValueError):
    """A probe directory that cannot be read or compared; the message names the path."""


def sample_stride(num_targets: int, max_tokens: int) -> int:
    """Keep about one target in ``stride`` so that at most ~``max_tokens`` are probed."""
    return max(1, -(-int(num_targets) // max(int(max_tokens), 1)))


def sample_mask(traj_ids: List[Any], target_traj: np.ndarray, target_position: np.ndarray, stride: int) -> np.ndarray:
    """Whether each target (trajectory ``traj_ids[target_traj[i]]``, position ``target_position[i]``) is
    in the probe: a function of the trajectory id and the position only (module invariant)."""
    seeds = np.array([zlib.crc32(str(t).encode()) for t in traj_ids], dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = seeds[np.asarray(target_traj, dtype=np.int64)] * _MIX + np.asarray(target_position).astype(np.uint64)
        h ^= h >> np.uint64(29)
        h *= _MIX
        h ^= h >> np.uint64(32)
    return (h % np.uint64(stride)) == 0


def _probe_step(stride: int, captured: Dict[Tuple[Any, int], torch.Tensor]):
    """``forward_step_func`` of a probe: logits of the owned, sampled targets into ``captured``."""
    from .step import _unwrap

    def forward_step(data_iterator, model):
        mb, psp = next(data_iterator)
        batch = mb.layout
        out = model(batch.tokens[None], batch.position_ids[None], packed_seq_params=psp)
        if not _unwrap(model).post_process:
            return out, None
        logits = out[:, 0]
        keep = sample_mask(batch.traj_ids, batch.target_traj.cpu().numpy(), batch.target_position.cpu().numpy(),
                           stride)
        if mb.owned is not None:
            keep &= mb.owned.cpu().numpy().astype(bool)
        idx = np.nonzero(keep)[0]
        if idx.size:
            rows = batch.target_row[torch.as_tensor(idx, device=batch.target_row.device)]
            picked = logits[rows].detach().cpu()
            for j, i in enumerate(idx.tolist()):
                key = (batch.traj_ids[int(batch.target_traj[i])], int(batch.target_position[i]))
                captured[key] = picked[j]

        def loss_func(output):
            return output.sum() * 0.0, {}
        return out, loss_func
    return forward_step


def probe_logits(model: list, forest, plan, settings, *,
                 max_tokens: int = 1024) -> Dict[Tuple[Any, int], torch.Tensor]:
    """This rank's probe of a planned global batch (module docstring): {(trajectory id, position): logits}.

    Collective over the model-parallel groups (every rank of the step's world must call it with the
    same ``forest`` and ``plan``); the model is put in eval mode for the pass and restored after.
    """
    from megatron.core import parallel_state

    from ..rl.objectives import forest_normalizer
    from .step import replica_microbatches, run_forward_only

    replica = parallel_state.get_data_parallel_rank()
    items = replica_microbatches(forest, plan, replica, settings,
                                 aligned=parallel_state.get_expert_model_parallel_world_size() > 1)
    stride = sample_stride(forest_normalizer(forest).num_tokens, max_tokens)
    captured: Dict[Tuple[Any, int], torch.Tensor] = {}
    run_forward_only(model[0], items, _probe_step(stride, captured), settings)
    return captured


def oracle_dtype(params_dtype: torch.dtype) -> torch.dtype:
    """The oracle's dtype: fp32 for bf16/fp16 models, fp64 for fp32 (and fp64) models."""
    return torch.float32 if params_dtype in (torch.bfloat16, torch.float16) else torch.float64


def oracle_logits(module, config, forest, plan, settings, *, max_tokens: int = 1024):
    """The probe of the same tokens by an upcast copy of ``module``'s weights (``testing.fidelity.upcast_model``:
    exact copy in :func:`oracle_dtype`, plain-torch KDA and SDPA tree attention, no TF32), in the run's own
    mode and layout: the reference that bf16 rounding is measured against (docs/design.md invariant 1;
    ``testing/fidelity.py`` states the bf16 rule).  Collective like :func:`probe_logits`."""
    from megatron.core import parallel_state

    from ..testing.fidelity import full_fp32_matmuls, upcast_model
    dtype = oracle_dtype(config.params_dtype)
    build = None
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:     # this stage's chunk, as the run built it
        from ..schedules.pipeline import build_stage_model

        def stage(cfg):
            return build_stage_model(cfg, module.vocab_size,
                                     share_embeddings_and_output_weights=module.share_embeddings_and_output_weights)
        build = stage
    up, _ = upcast_model(module, config, dtype, build=build, kda_backend="reference", tree_attention_backend="sdpa",
                         moe_router_dtype="fp64" if dtype == torch.float64 else "fp32")
    try:
        with full_fp32_matmuls():
            return probe_logits([up], forest, plan, settings, max_tokens=max_tokens)
    finally:
        del up
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def write_probe(directory: str, iteration: int, captured: Dict[Tuple[Any, int], torch.Tensor]) -> Optional[str]:
    """Write this rank's probe (last pipeline stage only); returns the file written, or None."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not parallel_state.is_pipeline_last_stage():
        return None
    keys = sorted(captured, key=lambda k: (str(k[0]), k[1]))
    logits = torch.stack([captured[k] for k in keys]) if keys else torch.zeros(0, 0)
    sub = os.path.join(directory, f"iter_{iteration:07d}")
    os.makedirs(sub, exist_ok=True)
    path = os.path.join(sub, f"rank_{dist.get_rank():05d}.pt")
    tmp = path + ".tmp"
    torch.save({"keys": keys, "logits": logits, "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                "tp_size": parallel_state.get_tensor_model_parallel_world_size()}, tmp)
    os.replace(tmp, path)
    return path


def load_probe(directory: str) -> Dict[Tuple[Any, int], torch.Tensor]:
    """The probe of one iteration directory, vocabulary shards joined: {(trajectory id, position): logits (fp64)}."""
    files = sorted(glob.glob(os.path.join(directory, "rank_*.pt")))
    if not files:
        raise ProbeError(f"{directory}: no probe files (rank_*.pt) there")
    shards: Dict[int, Dict[Tuple[Any, int], torch.Tensor]] = {}
    tp_size = None
    for f in files:
        try:
            d = torch.load(f, map_location="cpu", weights_only=True)
            keys, logits, tp_rank, size = d["keys"], d["logits"], int(d["tp_rank"]), int(d["tp_size"])
        except Exception as e:      # a truncated or foreign file: name it
            raise ProbeError(f"{f}: not a probe file ({type(e).__name__}: {e})") from None
        if tp_size is not None and size != tp_size:
            raise ProbeError(f"{f}: tp_size {size}, other files of {directory} have {tp_size}")
        tp_size = size
        part = shards.setdefault(tp_rank, {})
        for j, k in enumerate(keys):
            if tuple(k) in part:
                raise ProbeError(f"{f}: token {tuple(k)} recorded twice for tensor-parallel rank {tp_rank}")
            part[tuple(k)] = logits[j]
    if sorted(shards) != list(range(tp_size)):
        raise ProbeError(f"{directory}: tensor-parallel ranks {sorted(shards)} of {tp_size} present")
    keys = set(shards[0])
    for r, part in shards.items():
        if set(part) != keys:
            raise ProbeError(f"{directory}: tensor-parallel rank {r} holds other tokens than rank 0")
    return {k: torch.cat([shards[r][k].double() for r in range(tp_size)]) for k in keys}


def compare_probes(dir_a: str, dir_b: str) -> Dict[str, float]:
    """Token-wise comparison of two probes of the same tokens: mean / min cosine of the logit vectors,
    mean and max |logit difference|, token count.  Both must hold the same tokens and vocabulary size."""
    a, b = load_probe(dir_a), load_probe(dir_b)
    if set(a) != set(b):
        only = sorted(set(a) ^ set(b), key=lambda k: (str(k[0]), k[1]))[:3]
        raise ProbeError(f"{dir_a} and {dir_b} probe different tokens (e.g. {only}): not the same batch or sample")
    keys = sorted(a, key=lambda k: (str(k[0]), k[1]))
    if not keys:
        raise ProbeError(f"{dir_a}: the probe holds no tokens")
    xa, xb = torch.stack([a[k] for k in keys]), torch.stack([b[k] for k in keys])
    if xa.shape != xb.shape:
        raise ProbeError(f"{dir_a} and {dir_b}: logit rows of {xa.shape[1]} vs {xb.shape[1]} entries")
    cos = torch.nn.functional.cosine_similarity(xa, xb, dim=-1)
    diff = (xa - xb).abs()
    deficit = 1.0 - cos
    return {"tokens": len(keys), "logit_cosine_mean": float(cos.mean()), "logit_cosine_min": float(cos.min()),
            "logit_cosine_deficit_median": float(deficit.median()),
            "tokens_deficit_over_1e-3": int((deficit > OUTLIER_DEFICIT).sum()),
            "logit_abs_diff_mean": float(diff.mean()), "logit_abs_diff_max": float(diff.max())}
