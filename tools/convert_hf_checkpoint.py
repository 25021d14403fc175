#!/usr/bin/env python3
"""Convert between a transformers Kimi-Linear checkpoint and the hybrid model's Megatron checkpoint.

hf-to-megatron: --input is a transformers ``kimi_linear`` directory (config.json and
model.safetensors, or shards with model.safetensors.index.json).  --output gets Megatron-LM's
layout of a release checkpoint:

  OUTPUT/latest_checkpointed_iteration.txt        "release"
  OUTPUT/hf_config.json                           the transformers config (for the way back)
  OUTPUT/megatron_harts_checkpoint.json           format, TP size, vocab size, tensor dtypes
  OUTPUT/release/mp_rank_XX/model_optim_rng.pt    --format torch: {"model": state dict} per TP rank
  OUTPUT/release/                                 --format dist: megatron-core dist checkpoint
                                                  (TP-agnostic; load with any TP that divides)

megatron-to-hf reads that layout (any TP for torch) and writes a transformers directory.
Conversion is exact: HF -> Megatron -> HF reproduces every tensor bitwise and config.json's
fields (unless --dtype casts).  Bad input gets one ``error:`` line naming the file, tensor,
field or flag, exit status 2, and no output directory (it is written under a temporary name
and renamed at the end).
"""
import argparse
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_harts.cli import ArgumentParser, CliError, print_json, require_path, run  # noqa: E402

TRACKER = "latest_checkpointed_iteration.txt"
HF_CONFIG_COPY = "hf_config.json"
META = "megatron_harts_checkpoint.json"
# the hybrid's layers differ (KDA/MLA, dense/MoE): one dist-checkpoint key per layer, not stacked
SHARDED_METADATA = {"non_homogeneous_layers": True}
DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")


def quiet_megatron():
    """megatron-core warns at import about missing TE/apex and logs spec notes: not the user's concern."""
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message="full scope is deprecated")
    warnings.filterwarnings("ignore", message="MLP requires ffn_hidden_size")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    # through the libraries' own switches, not the environment (tests run this tool in their process)
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    disable_progress_bars()


def _torch_dtype(name):
    import torch
    return None if name == "auto" else getattr(torch, name)


def _cast(state, dtype):
    if dtype is None:
        return state
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}


def _set_dtype_field(raw: dict, dtype_name: str) -> dict:
    raw = dict(raw)
    if dtype_name != "auto":
        for key in ("dtype", "torch_dtype"):
            if key in raw:
                raw[key] = dtype_name
        if "dtype" not in raw and "torch_dtype" not in raw:
            raw["dtype"] = dtype_name
    return raw


def _no_init(tensor):
    return tensor


def _skeleton(hf_cfg, params_dtype):
    """The TP = 1 model (no initialization) and its config: tensor names, shapes, partition axes."""
    from megatron_harts.models import build_hybrid_model, hybrid_config_from_hf
    from megatron_harts.models.hf_convert import CheckpointError
    try:
        # megatron marks TP-split tensors (partition_dim) only while initializing them: initialize, with
        # no-op init methods (the values are overwritten anyway)
        cfg = hybrid_config_from_hf(hf_cfg, params_dtype=params_dtype, use_cpu_initialization=True,
                                    perform_initialization=True, init_method=_no_init,
                                    output_layer_init_method=_no_init, embedding_init_method=_no_init)
        model = build_hybrid_model(cfg, vocab_size=hf_cfg.vocab_size)
    except ValueError as e:
        raise CheckpointError(f"config.json: {e}") from None
    return cfg, model


def hf_to_megatron_dir(args, tmp):
    import torch
    from megatron_harts.models import hf_convert as hc
    from megatron_harts.testing.cpu_runtime import megatron_cpu_runtime

    dtype = _torch_dtype(args.dtype)
    raw, hf_state = hc.load_hf_checkpoint(args.input)
    hf_cfg = hc.kimi_linear_config_from_dict(raw, os.path.join(args.input, hc.HF_CONFIG))
    floats = [v.dtype for v in hf_state.values() if v.is_floating_point()]
    params_dtype = dtype or (max(set(floats), key=floats.count) if floats else torch.float32)
    with megatron_cpu_runtime():
        cfg, model = _skeleton(hf_cfg, params_dtype)
        info = hc.tp_partition_info(model)
        hc.check_tp_divisible(info, cfg, hf_cfg.vocab_size, args.tp)
        try:
            full = hc.hf_to_megatron(hf_state, cfg)
        except KeyError as e:
            raise hc.CheckpointError(f"{args.input}: {e.args[0]}") from None
        for ours, value in full.items():
            if tuple(value.shape) != info[ours][0]:
                raise hc.CheckpointError(f"{args.input}: {ours} has shape {tuple(value.shape)}, "
                                         f"config.json implies {info[ours][0]}")
        full = _cast(full, dtype)
        state_keys = list(model.state_dict().keys())
        release = os.path.join(tmp, "release")
        if args.format == "torch":
            for r, shard in enumerate(hc.shard_for_tp(full, info, cfg, args.tp)):
                sd = {k: shard[k] if k in shard else None for k in state_keys if k in shard or k.endswith("_extra_state")}
                rank_dir = os.path.join(release, f"mp_rank_{r:02d}")
                os.makedirs(rank_dir)
                torch.save({"model": sd, "checkpoint_version": 3.0, "iteration": 0, "tp_rank": r,
                            "tp_size": args.tp}, os.path.join(rank_dir, "model_optim_rng.pt"))
        else:
            from megatron.core import dist_checkpointing
            tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
            with torch.no_grad():
                for k, v in full.items():
                    tensors[k].data = v.clone()
            os.makedirs(release)
            dist_checkpointing.save(model.sharded_state_dict(metadata=SHARDED_METADATA), release)
    with open(os.path.join(tmp, TRACKER), "w") as f:
        f.write("release\n")
    with open(os.path.join(tmp, HF_CONFIG_COPY), "w") as f:
        json.dump(_set_dtype_field(raw, args.dtype), f, indent=2, sort_keys=True)
        f.write("\n")
    meta = {"format": args.format, "tp": args.tp, "vocab_size": hf_cfg.vocab_size,
            "dtypes": {k: str(v.dtype).replace("torch.", "") for k, v in full.items()}}
    with open(os.path.join(tmp, META), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.write("\n")
    return {"direction": "hf-to-megatron", "format": args.format, "tp": args.tp, "tensors": len(full),
            "parameters": int(sum(v.numel() for v in full.values()))}


def _iteration_dir(path):
    from megatron_harts.models.hf_convert import CheckpointError
    tracker = os.path.join(path, TRACKER)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such directory")
    if not os.path.isfile(tracker):
        raise CheckpointError(f"{tracker}: no such file (a Megatron checkpoint directory has one)")
    with open(tracker) as f:
        it = f.read().strip()
    if it == "release":
        return os.path.join(path, "release")
    if not it.isdigit():
        raise CheckpointError(f"{tracker}: expected 'release' or an iteration number, got {it!r}")
    return os.path.join(path, f"iter_{int(it):07d}")


def megatron_to_hf_dir(args, tmp):
    import torch
    from megatron_harts.models import hf_convert as hc
    from megatron_harts.testing.cpu_runtime import megatron_cpu_runtime

    it_dir = _iteration_dir(args.input)
    cfg_path = os.path.join(args.input, HF_CONFIG_COPY)
    if not os.path.isfile(cfg_path):
        raise hc.CheckpointError(f"{cfg_path}: no such file (the transformers config of the checkpoint)")
    with open(cfg_path) as f:
        try:
            raw = json.load(f)
        except ValueError as e:
            raise hc.CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict) or raw.get("model_type") != "kimi_linear":
        raise hc.CheckpointError(f"{cfg_path}: field 'model_type' is not 'kimi_linear'")
    hf_cfg = hc.kimi_linear_config_from_dict(raw, cfg_path)
    meta = {}
    if os.path.isfile(os.path.join(args.input, META)):
        with open(os.path.join(args.input, META)) as f:
            meta = json.load(f)
    recorded = meta.get("dtypes", {})
    dtype = _torch_dtype(args.dtype)
    is_dist = os.path.isfile(os.path.join(it_dir, "metadata.json"))
    ranks = sorted(d for d in os.listdir(it_dir) if d.startswith("mp_rank_")) if os.path.isdir(it_dir) else []
    if not is_dist and not ranks:
        raise hc.CheckpointError(f"{it_dir}: neither a dist checkpoint (metadata.json) nor mp_rank_XX directories")
    floats = [getattr(torch, d) for d in recorded.values()]
    params_dtype = max(set(floats), key=floats.count) if floats else torch.float32
    with megatron_cpu_runtime():
        cfg, model = _skeleton(hf_cfg, params_dtype)
        info = hc.tp_partition_info(model)
        if is_dist:
            from megatron.core import dist_checkpointing
            tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
            for k, d in recorded.items():
                if k in tensors:
                    tensors[k].data = tensors[k].data.to(getattr(torch, d))
            try:
                dist_checkpointing.load(model.sharded_state_dict(metadata=SHARDED_METADATA), it_dir)
            except Exception as e:      # megatron raises assorted types for unreadable/mismatched checkpoints
                raise hc.CheckpointError(f"{it_dir}: cannot load the dist checkpoint ({type(e).__name__}: "
                                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
            full = {k: v.detach().clone() for k, v in tensors.items() if k in info and
                    not k.endswith("local_tokens_per_expert")}
        else:
            expect = [f"mp_rank_{r:02d}" for r in range(len(ranks))]
            if ranks != expect:
                raise hc.CheckpointError(f"{it_dir}: TP rank directories {ranks} are not {expect}")
            shards = []
            for d in ranks:
                fp = os.path.join(it_dir, d, "model_optim_rng.pt")
                if not os.path.isfile(fp):
                    raise hc.CheckpointError(f"{fp}: no such file")
                try:
                    ck = torch.load(fp, map_location="cpu", weights_only=True)
                    sd = ck["model"]
                except Exception as e:  # torch.load's errors for truncated/foreign files vary by version
                    raise hc.CheckpointError(f"{fp}: not a Megatron torch checkpoint ({type(e).__name__})") from None
                shards.append({k: v for k, v in sd.items() if isinstance(v, torch.Tensor)})
            tp = len(shards)
            hc.check_tp_divisible(info, cfg, hf_cfg.vocab_size, tp)
            for r, s in enumerate(shards):
                for k, v in s.items():
                    if k not in info:
                        raise hc.CheckpointError(f"{os.path.join(it_dir, ranks[r])}: unexpected tensor {k!r}")
                    shape, dim = info[k]
                    local = tuple(n // tp if i == dim else n for i, n in enumerate(shape))
                    if tuple(v.shape) != local:
                        raise hc.CheckpointError(f"{os.path.join(it_dir, ranks[r], 'model_optim_rng.pt')}: tensor "
                                                 f"{k!r} has shape {tuple(v.shape)}, expected {local} for TP={tp}")
            full = hc.merge_tp_shards(shards, info, cfg)
        needed = {ours for ours, *_ in hc._rules(cfg)}
        missing = sorted(needed - set(full))
        if missing:
            raise hc.CheckpointError(f"{it_dir}: tensor {missing[0]!r} is missing")
    hf_state = _cast(hc.megatron_to_hf(full, cfg), dtype)
    hc.save_hf_checkpoint(tmp, _set_dtype_field(raw, args.dtype), hf_state,
                          max_shard_size=f"{int(args.max_shard_gb * 1024)}MB")
    return {"direction": "megatron-to-hf", "format": "dist" if is_dist else "torch",
            "tp": None if is_dist else len(ranks), "tensors": len(hf_state),
            "parameters": int(sum(v.numel() for v in hf_state.values()))}


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--direction", required=True, metavar="hf-to-megatron|megatron-to-hf")
    ap.add_argument("--input", required=True, metavar="DIR", help="checkpoint directory to read")
    ap.add_argument("--output", required=True, metavar="DIR", help="directory to create (must not exist)")
    ap.add_argument("--tp", type=int, default=1, metavar="N",
                    help="tensor-parallel size of the written torch checkpoint (default 1)")
    ap.add_argument("--format", default="torch", metavar="torch|dist",
                    help="Megatron checkpoint format written by hf-to-megatron (default torch); "
                         "megatron-to-hf detects it")
    ap.add_argument("--dtype", default="auto", metavar="|".join(DTYPES),
                    help="cast floating tensors (default auto: keep the stored dtypes, bitwise)")
    ap.add_argument("--max-shard-gb", type=float, default=5.0,
                    help="megatron-to-hf: safetensors shard size limit in GiB (default 5)")
    ap.add_argument("--json", action="store_true", help="print a summary as JSON")
    args = ap.parse_args(argv)
    if args.direction not in ("hf-to-megatron", "megatron-to-hf"):
        raise CliError(f"--direction must be hf-to-megatron or megatron-to-hf, got {args.direction!r}")
    if args.format not in ("torch", "dist"):
        raise CliError(f"--format must be torch or dist, got {args.format!r}")
    if args.dtype not in DTYPES:
        raise CliError(f"--dtype must be one of {', '.join(DTYPES)}, got {args.dtype!r}")
    if args.tp not in (1, 2, 4, 8, 16):
        raise CliError(f"--tp must be 1, 2, 4, 8 or 16, got {args.tp}")
    if args.format == "dist" and args.direction == "hf-to-megatron" and importlib.util.find_spec("psutil") is None:
        raise CliError("--format dist: megatron-core's dist-checkpoint writer needs psutil (pip install psutil)")
    if args.max_shard_gb <= 0:
        raise CliError(f"--max-shard-gb must be > 0, got {args.max_shard_gb}")
    require_path(args.input, "--input", kind="dir")
    out = os.path.abspath(args.output)
    if os.path.exists(out):
        raise CliError(f"--output {args.output} already exists")
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise CliError(f"--output {args.output}: parent directory {parent} does not exist")
    quiet_megatron()
    import megatron_harts.patches as patches
    from megatron_harts.models.hf_convert import CheckpointError

    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    patches.apply()
    try:
        convert = hf_to_megatron_dir if args.direction == "hf-to-megatron" else megatron_to_hf_dir
        summary = convert(args, tmp)
        os.rename(tmp, out)
    except CheckpointError as e:
        raise CliError(str(e)) from None
    finally:
        patches.undo()
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
    summary["output"] = out
    if args.json:
        print_json(summary)
    else:
        print(f"wrote {out}: {summary['tensors']} tensors, {summary['parameters']:,} parameters "
              f"({summary['direction']}, {summary['format']}" + (f", TP={summary['tp']})" if summary["tp"] else ")"))
    return 0


if __name__ == "__main__":
    run(main)
