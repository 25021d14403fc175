"""megatron_harts as a verl engine (megatron_harts/integrations/verl.py, docs/verl.md): verl's own
TrainingWorker drives it on the CPU (one gloo process, fp64 tiny model); tree == expanded == a plain
per-sample computation with verl's ppo_loss through transformers' KimiLinearForCausalLM."""
import copy

import numpy as np
import pytest
import torch

try:
    import verl  # noqa: F401
    from tensordict import TensorDict
    from megatron_harts.integrations import verl as harts_verl
except ImportError as _e:       # the optional extra is not installed
    pytest.skip(f"verl is not importable ({_e}); pip install -e '.[verl]'", allow_module_level=True)

from test_training_driver import MODEL

transformers = pytest.importorskip("transformers")

FLAGS = [f for f in MODEL] + ["--seed", "7", "--seq-length", "64", "--log-interval", "1000"]


class _ModelConfig(dict):
    """The slice of verl's HFModelConfig the worker reads (no HF checkpoint: the model is ours)."""
    def __getattr__(self, k):
        try:
            return self[k]
        except KeyError:
            raise AttributeError(k) from None

    def __setattr__(self, k, v):
        self[k] = v


def _samples(seed=0):
    """4 prompts x 3 responses; responses of a prompt share their first turn (a multi-turn fork)."""
    rng = np.random.default_rng(seed)
    out = []
    for p in range(4):
        prompt = rng.integers(1, 64, int(rng.integers(4, 8))).tolist()
        turn = rng.integers(1, 64, 5).tolist()
        for r in range(3):
            resp = turn + rng.integers(1, 64, int(rng.integers(2, 9))).tolist() if r < 2 else \
                rng.integers(1, 64, int(rng.integers(3, 10))).tolist()
            mask = [1] * len(resp)
            if r < 2:
                mask[5:7] = [0, 0]          # a tool-output span of the second turn: not trained
            out.append((f"p{p}", prompt, resp, mask))
    return out


def _batch(samples, seed=1):
    from verl.utils import tensordict_utils as tu
    rng = np.random.default_rng(seed)
    nt = lambda xs, dt: torch.nested.as_nested_tensor([torch.tensor(x, dtype=dt) for x in xs], layout=torch.jagged)
    ids = [p + r for _, p, r, _ in samples]
    resp_mask = [m for *_, m in samples]
    td = TensorDict({
        "input_ids": nt(ids, torch.int64),
        "position_ids": nt([list(range(len(x))) for x in ids], torch.int64),
        "prompts": nt([p for _, p, _, _ in samples], torch.int64),
        "responses": nt([r for _, _, r, _ in samples], torch.int64),
        "response_mask": nt(resp_mask, torch.int64),
        "loss_mask": nt([[0] * len(p) + m for _, p, _, m in samples], torch.int64),
        "old_log_probs": nt([(-4.2 + rng.normal(0, 0.3, len(r))).tolist() for _, _, r, _ in samples], torch.float64),
        "ref_log_prob": nt([(-4.1 + rng.normal(0, 0.3, len(r))).tolist() for _, _, r, _ in samples], torch.float64),
        "advantages": nt([[float(rng.normal())] * len(r) for _, _, r, _ in samples], torch.float64),
    }, batch_size=len(samples))
    tu.assign_non_tensor(td, uid=[u for u, *_ in samples])
    return td


def _worker(sharing, loss_agg_mode="token-mean"):
    """verl's TrainingWorker over our engine, with verl's ppo_loss (KL to a reference, entropy bonus)."""
    from functools import partial

    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss
    actor = harts_verl.MegatronHartsActorConfig(loss_agg_mode=loss_agg_mode, use_kl_loss=True, kl_loss_coef=0.05,
                                               kl_loss_type="low_var_kl", entropy_coeff=0.01, clip_ratio_high=0.28,
                                               ppo_micro_batch_size_per_gpu=2)
    engine = harts_verl.MegatronHartsEngineConfig(harts_args=FLAGS, tree_sharing=sharing, tree_microbatch_tokens=64,
                                                  micro_batch_size_per_gpu=2, infer_micro_batch_size_per_gpu=3)
    optim = harts_verl.MegatronHartsOptimizerConfig(lr=1e-3, weight_decay=0.0, clip_grad=0.0)
    cfg = TrainingWorkerConfig(model_type="language_model", model_config=_ModelConfig(use_remove_padding=True),
                               engine_config=engine, optimizer_config=optim)
    w = TrainingWorker(cfg)
    w.device_name = "cpu"       # verl picks "cuda" when no accelerator is found
    w.reset()
    w.set_loss_fn(partial(ppo_loss, actor))
    return w, actor
