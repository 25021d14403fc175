#!/usr/bin/env python3
"""A GRPO update through verl's TrainingWorker on the megatron_harts engine: tree against expanded.

Builds one synthetic GRPO batch (``--prompts`` prompts of ``--prompt-tokens`` tokens, ``--group``
responses each; a response is a shared first turn of ``--turn-tokens`` tokens, a tool output of
``--tool-tokens`` untrained tokens, then its own ``--response-tokens`` tokens), and for each mode
(``--modes``: tree sharing ``within``/``windows`` and ``off``, expanded) a verl ``TrainingWorker``
over ``MegatronHartsEngine`` (docs/verl.md) with verl's ``ppo_loss`` (GRPO settings: token-mean,
KL loss to reference log-probs, clip 0.2/0.28).  Each mode runs ``--warmup`` untimed and ``--iters``
timed ``train_mini_batch`` calls (one epoch, one mini-batch, micro-batches of
``--micro-batch`` samples: what verl's actor update does) and one timed ``infer_batch`` (old
log-probs); CUDA is synchronized around each.  Reports the median seconds per mode and the ratio
expanded / tree per tree mode, plus the first update's loss in every mode (equal up to rounding).

Model: ``--model-args`` (the trainer's model flags, one string), by default a small Kimi-Linear-style
hybrid in bf16 on CUDA.  Writes one JSON object (``--out``; ``--json`` prints it).  On the CPU with
``--model-args`` of a tiny fp64 model it is a smoke run.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from megatron_harts.cli import ArgumentParser, CliError, output_path, run  # noqa: E402

DEFAULT_MODEL = (
    "--num-layers 8 --hidden-size 1024 --num-attention-heads 8 --ffn-hidden-size 2816 --swiglu "
    "--disable-bias-linear --multi-latent-attention --kv-lora-rank 256 --qk-head-dim 64 --qk-pos-emb-head-dim 32 "
    "--v-head-dim 64 --linear-attention-freq 4 --linear-key-head-dim 64 --linear-value-head-dim 64 "
    "--num-experts 16 --moe-router-topk 2 --moe-ffn-hidden-size 512 --moe-shared-expert-intermediate-size 512 "
    "--moe-layer-freq ([0]+[1]*7) --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
    "--moe-aux-loss-coeff 0 --vocab-size 32000 --make-vocab-size-divisible-by 128 "
    "--untie-embeddings-and-output-weights --bf16")


def _batch(a, rng, vocab):
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    ids, prompts, responses, masks = [], [], [], []
    for _ in range(a.prompts):
        prompt = rng.integers(1, vocab, a.prompt_tokens).tolist()
        turn = rng.integers(1, vocab, a.turn_tokens).tolist()
        for _ in range(a.group):
            resp = turn + rng.integers(1, vocab, a.tool_tokens + a.response_tokens).tolist()
            mask = [1] * a.turn_tokens + [0] * a.tool_tokens + [1] * a.response_tokens
            ids.append(prompt + resp)
            prompts.append(prompt)
            responses.append(resp)
            masks.append(mask)

    def nt(xs, dtype):
        return torch.nested.as_nested_tensor([torch.tensor(x, dtype=dtype) for x in xs], layout=torch.jagged)
    n = len(ids)
    adv = rng.normal(size=n)
    td = TensorDict({
        "input_ids": nt(ids, torch.int64), "position_ids": nt([list(range(len(x))) for x in ids], torch.int64),
        "prompts": nt(prompts, torch.int64), "responses": nt(responses, torch.int64),
        "response_mask": nt(masks, torch.int64),
        "loss_mask": nt([[0] * len(p) + m for p, m in zip(prompts, masks)], torch.int64),
        "old_log_probs": nt([(-6.0 + rng.normal(0, 0.3, len(r))).tolist() for r in responses], torch.float32),
        "ref_log_prob": nt([(-6.0 + rng.normal(0, 0.3, len(r))).tolist() for r in responses], torch.float32),
        "advantages": nt([[float(adv[i])] * len(r) for i, r in enumerate(responses)], torch.float32),
    }, batch_size=n)
    tu.assign_non_tensor(td, uid=[f"p{i // a.group}" for i in range(n)])
    return td


def _worker(a, sharing, model_args):
    from functools import partial

    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    from megatron_harts.integrations import verl as hv
    actor = hv.MegatronHartsActorConfig(loss_agg_mode="token-mean", use_kl_loss=True, kl_loss_coef=0.001,
                                        kl_loss_type="low_var_kl", clip_ratio_high=0.28,
                                        ppo_micro_batch_size_per_gpu=a.micro_batch)
    engine = hv.MegatronHartsEngineConfig(harts_args=model_args + ["--seed", "1"], tree_sharing=sharing,
                                          tree_microbatch_tokens=a.microbatch_tokens,
                                          micro_batch_size_per_gpu=a.micro_batch,
                                          infer_micro_batch_size_per_gpu=a.micro_batch)
    optim = hv.MegatronHartsOptimizerConfig(lr=1e-6, weight_decay=0.0, clip_grad=1.0)
    cfg = TrainingWorkerConfig(model_type="language_model", model_config=_ModelConfig(use_remove_padding=True),
                               engine_config=engine, optimizer_config=optim)
    w = TrainingWorker(cfg)
    w.device_name = "cuda" if torch.cuda.is_available() else "cpu"
    w.reset()
    w.set_loss_fn(partial(ppo_loss, actor))
    return w


class _ModelConfig(dict):
    """What verl's worker reads of its model config (the model itself is the engine's)."""
    def __getattr__(self, k):
        try:
            return self[k]
        except KeyError:
            raise AttributeError(k) from None

    def __setattr__(self, k, v):
        self[k] = v


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn):
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return time.perf_counter() - t0, out


def main(argv=None):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-args", default=DEFAULT_MODEL, help="the trainer's model flags, one string "
                    "(default: a small Kimi-Linear-style hybrid in bf16)")
    ap.add_argument("--modes", nargs="+", default=["within", "off"], choices=("off", "within", "windows"),
                    help="tree sharing modes to run; off is expanded (default: within off)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per batch (default 8)")
    ap.add_argument("--group", type=int, default=8, help="responses per prompt (default 8)")
    ap.add_argument("--prompt-tokens", type=int, default=1024, help="tokens per prompt (default 1024)")
    ap.add_argument("--turn-tokens", type=int, default=512, help="shared first-turn tokens (default 512)")
    ap.add_argument("--tool-tokens", type=int, default=256, help="untrained tool-output tokens (default 256)")
    ap.add_argument("--response-tokens", type=int, default=512, help="own tokens per response (default 512)")
    ap.add_argument("--micro-batch", type=int, default=8, help="verl micro-batch size (default 8)")
    ap.add_argument("--microbatch-tokens", type=int, default=16384,
                    help="the engine's --tree-microbatch-tokens (default 16384)")
    ap.add_argument("--iters", type=int, default=3, help="timed updates per mode (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed updates first (default 1)")
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/verl-<time>.json)")
    ap.add_argument("--json", action="store_true", help="print the results JSON")
    a = ap.parse_args(argv)
    for flag in ("prompts", "group", "prompt_tokens", "turn_tokens", "response_tokens", "micro_batch",
                 "microbatch_tokens", "iters"):
        if getattr(a, flag) < 1:
            raise CliError(f"--{flag.replace('_', '-')} {getattr(a, flag)}: must be >= 1")
    if a.tool_tokens < 0 or a.warmup < 0:
        raise CliError("--tool-tokens and --warmup must be >= 0")
    if (a.prompts * a.group) % a.micro_batch:
        raise CliError(f"--micro-batch {a.micro_batch}: must divide the batch ({a.prompts * a.group} samples)")
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                time.strftime("verl-%Y%m%d-%H%M%S.json"))
    if a.out:
        output_path(out, "--out")
    else:
        os.makedirs(os.path.dirname(out), exist_ok=True)
    try:
        import verl  # noqa: F401
    except ImportError as e:
        raise CliError(f"verl is not importable ({e}): pip install -e '.[verl]' (docs/verl.md)") from None

    import torch.distributed as dist
    from verl.utils import tensordict_utils as tu
    # verl's Worker reads the launcher's variables; a world of one when run alone
    for k, v in dict(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517").items():
        os.environ.setdefault(k, v)
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    model_args = a.model_args.split()
    n = a.prompts * a.group
    results = {"modes": {}, "samples": n, "batch_tokens": None,
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
               "args": vars(a)}
    for mode in a.modes:
        w = _worker(a, mode, model_args)
        try:
            times, losses = [], []
            for i in range(a.warmup + a.iters):
                b = _batch(a, np.random.default_rng(0), w.engine.trainer.vocab_size)
                results["batch_tokens"] = int(b["input_ids"].offsets()[-1])
                tu.assign_non_tensor(b, global_batch_size=n, mini_batch_size=n, epochs=1, seed=0,
                                     dataloader_kwargs={"shuffle": False})
                dt, o = _timed(lambda: w.train_mini_batch(b))
                losses.append(float(np.sum(o["metrics"]["loss"])))
                if i >= a.warmup:
                    times.append(dt)
            b = _batch(a, np.random.default_rng(0), w.engine.trainer.vocab_size)
            tu.assign_non_tensor(b, compute_loss=False)
            infer, _ = _timed(lambda: w.infer_batch(b))
        finally:
            w.engine.trainer.close()
        results["modes"][mode] = {"update_seconds": statistics.median(times), "all_update_seconds": times,
                                  "infer_seconds": infer, "first_loss": losses[0]}
        print(f"{mode}: update {statistics.median(times):.3f} s (median of {len(times)}), old log-probs "
              f"{infer:.3f} s, first loss {losses[0]:.6g}", flush=True)
    if "off" in results["modes"]:
        base = results["modes"]["off"]
        for mode, r in results["modes"].items():
            if mode != "off":
                r["update_speedup"] = base["update_seconds"] / r["update_seconds"]
                r["infer_speedup"] = base["infer_seconds"] / r["infer_seconds"]
                print(f"{mode}: update {r['update_speedup']:.2f}x, old log-probs {r['infer_speedup']:.2f}x "
                      "faster than expanded")
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {out}")
    if a.json:
        print(json.dumps(results))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    run(main)
