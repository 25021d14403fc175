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


@pytest.fixture(scope="module")
def verl_world():
    """A one-process gloo world made before verl's worker looks for one (verl would ask for NCCL), and the
    launcher variables verl's Worker reads; both undone at the end."""
    import torch.distributed as dist
    mp = pytest.MonkeyPatch()
    for k, v in dict(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        mp.setenv(k, v)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()
    mp.undo()


def _close(w):
    w.engine.trainer.close()


def _params(w):
    return {n: p.detach().clone() for n, p in w.engine.model.module.named_parameters()}


def _grads(w):
    return {n: p.main_grad.detach().clone() for n, p in w.engine.model.module.named_parameters()}


def _train_inputs(b):
    from verl.utils import tensordict_utils as tu
    tu.assign_non_tensor(b, global_batch_size=6, mini_batch_size=6, epochs=2, seed=3, calculate_entropy=True,
                         dataloader_kwargs={"shuffle": False})
    return b


def test_registry_returns_our_engine():
    from verl.workers.engine.base import EngineRegistry
    assert EngineRegistry.get_engine_cls("language_model", "megatron_harts") is harts_verl.MegatronHartsEngine
    assert harts_verl.registered() is harts_verl.MegatronHartsEngine


def test_refused_settings_name_themselves(verl_world):
    e = harts_verl.MegatronHartsEngine(
        model_config=_ModelConfig(), optimizer_config=harts_verl.MegatronHartsOptimizerConfig(lr_warmup_steps=5),
        engine_config=harts_verl.MegatronHartsEngineConfig(harts_args=FLAGS, param_offload=True))
    with pytest.raises(harts_verl.VerlEngineError, match=r"^error: megatron_harts engine: engine param_offload"):
        e.initialize()
    e = harts_verl.MegatronHartsEngine(
        model_config=_ModelConfig(), optimizer_config=harts_verl.MegatronHartsOptimizerConfig(lr_warmup_steps=5),
        engine_config=harts_verl.MegatronHartsEngineConfig(harts_args=FLAGS))
    with pytest.raises(harts_verl.VerlEngineError, match="lr_warmup_steps"):
        e.initialize()
    e = harts_verl.MegatronHartsEngine(
        model_config=_ModelConfig(), optimizer_config=harts_verl.MegatronHartsOptimizerConfig(),
        engine_config=harts_verl.MegatronHartsEngineConfig(harts_args=FLAGS + ["--lr", "1"]))
    with pytest.raises(harts_verl.VerlEngineError, match="harts_args --lr"):
        e.initialize()
    with pytest.raises(harts_verl.VerlEngineError, match="tree_sharing"):
        harts_verl.MegatronHartsEngineConfig(tree_sharing="trees")


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_train_mini_batch_tree_equals_expanded(verl_world, agg):
    """verl's TrainingWorker: 2 epochs x 2 mini-batches of 3 micro-batches each (groups sharing prompts and a
    first turn): the same per-micro-batch losses, metrics, gradient norms, last gradients and final weights in
    tree (within, windows) and expanded mode."""
    runs = {}
    for sharing in ("off", "within", "windows"):
        w, _ = _worker(sharing, agg)
        try:
            out = w.train_mini_batch(_train_inputs(_batch(_samples())))
            runs[sharing] = (out["metrics"], _grads(w), _params(w))
        finally:
            _close(w)
    m0, g0, p0 = runs["off"]
    assert len(m0["loss"]) == 4 and len(m0["grad_norm"]) == 4 and m0["kl_loss"][0] > 0
    assert any(float(g.abs().max()) > 0 for g in g0.values())
    for sharing in ("within", "windows"):
        m, g, p = runs[sharing]
        for key in ("loss", "grad_norm", "actor/pg_loss", "actor/entropy_loss", "kl_loss", "actor/ppo_kl"):
            np.testing.assert_allclose(np.asarray(m[key], dtype=np.float64), np.asarray(m0[key], dtype=np.float64),
                                       rtol=0, atol=1e-10, err_msg=f"{sharing} {key}")
        for n in g0:
            torch.testing.assert_close(g[n], g0[n], rtol=0, atol=1e-10, msg=lambda s: f"{sharing} grad {n}: {s}")
            torch.testing.assert_close(p[n], p0[n], rtol=0, atol=1e-10, msg=lambda s: f"{sharing} param {n}: {s}")
