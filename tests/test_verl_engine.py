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

def _flags(seed=7):
    return list(MODEL) + ["--seed", str(seed), "--seq-length", "64", "--log-interval", "1000"]


FLAGS = _flags()


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


def _worker(sharing, loss_agg_mode="token-mean", harts_args=None, load_weights=None):
    """verl's TrainingWorker over our engine, with verl's ppo_loss (KL to a reference, entropy bonus)."""
    from functools import partial

    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss
    actor = harts_verl.MegatronHartsActorConfig(loss_agg_mode=loss_agg_mode, use_kl_loss=True, kl_loss_coef=0.05,
                                               kl_loss_type="low_var_kl", entropy_coeff=0.01, clip_ratio_high=0.28,
                                               ppo_micro_batch_size_per_gpu=2)
    engine = harts_verl.MegatronHartsEngineConfig(harts_args=harts_args or FLAGS, tree_sharing=sharing,
                                                  tree_microbatch_tokens=64, load_weights=load_weights,
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
    launcher variables verl's Worker reads; both undone at the end.  verl's Worker also writes
    LOCAL_WORLD_SIZE and REDIS_STORE_SERVER_HOST into the environment when it is built: they are set
    here to the values it writes, so no test changes the environment and the module's end restores it."""
    import torch.distributed as dist
    mp = pytest.MonkeyPatch()
    for k, v in dict(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
                     LOCAL_WORLD_SIZE="1", REDIS_STORE_SERVER_HOST="127.0.0.1").items():
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
            tokens = w.engine.last_batch_tokens         # the last mini-batch's log-prob pass
            if sharing == "off":
                assert tokens["computed"] == tokens["trajectory"]
            else:       # the groups' shared prompts and turns ran once
                assert tokens["computed"] < tokens["trajectory"], tokens
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


def _hf_from_engine(w):
    """transformers' KimiLinearForCausalLM (fp64) loaded from the engine's weight-sync stream."""
    from megatron_harts.models.hf_convert import kimi_linear_hf_config
    t = w.engine.trainer
    gen, peft = w.engine.get_per_tensor_param()
    assert peft is None
    cfg = kimi_linear_hf_config(t.config, t.vocab_size)
    cfg._experts_implementation = "eager"          # grouped_mm takes no fp64
    hf = transformers.KimiLinearForCausalLM(cfg).double()
    missing, unexpected = hf.load_state_dict(dict(gen), strict=False)
    assert not missing and not unexpected
    return hf


def _hf_outputs(hf, ids):
    """verl's convention per sample: log_probs[t] = log p(ids[t+1] | ids[:t+1]) and the entropy at t; 0 at the end."""
    logits = hf(ids[None]).logits[0].double()
    logp = logits.log_softmax(-1)
    lp = torch.cat([logp[:-1].gather(1, ids[1:, None])[:, 0], logp.new_zeros(1)])
    ent = torch.cat([-(logp.exp() * logp).sum(-1)[:-1], logp.new_zeros(1)])
    return lp, ent


def _plain_outputs(module, ids):
    """One sample alone through our model (a packed batch of one sequence, autograd on): verl's convention."""
    from megatron_harts.models.packed import TreePackedSeqParams
    L = int(ids.shape[0])
    psp = TreePackedSeqParams.for_sequences([L])
    lp, ent = module(ids[None], psp.position_ids[None], packed_seq_params=psp, pair_row=torch.arange(L - 1),
                     pair_token=ids[1:].clone(), return_entropy=True)
    return torch.cat([lp, lp.new_zeros(1)]), torch.cat([ent[:L - 1], ent.new_zeros(1)])


def test_infer_batch_and_weight_sync_match_transformers(verl_world, tmp_path):
    """infer_batch's log-probs and entropies equal transformers' KimiLinearForCausalLM loaded from the engine's
    get_per_tensor_param stream (transformers keeps dt_bias and the router in float32: 1e-6)."""
    from verl.utils import tensordict_utils as tu
    w, _ = _worker("within")
    try:
        hf = _hf_from_engine(w).eval()
        b = _batch(_samples())
        tu.assign_non_tensor(b, calculate_entropy=True, compute_loss=False)
        out = w.infer_batch(b)
        with torch.no_grad():
            ref = [_hf_outputs(hf, ids) for ids in _batch(_samples())["input_ids"].unbind()]
        for i, (lp, ent) in enumerate(ref):
            torch.testing.assert_close(out["log_probs"][i], lp, rtol=0, atol=1e-6, msg=lambda s: f"lp {i}: {s}")
            torch.testing.assert_close(out["entropy"][i], ent, rtol=0, atol=1e-6, msg=lambda s: f"ent {i}: {s}")
        w.engine.trainer.export_hf(str(tmp_path / "hf"))
    finally:
        _close(w)
    # the other direction: an engine of another seed starting from that transformers directory
    w2, _ = _worker("off", harts_args=_flags(11), load_weights=str(tmp_path / "hf"))
    try:
        b = _batch(_samples())
        tu.assign_non_tensor(b, calculate_entropy=False, compute_loss=False)
        again = w2.infer_batch(b)
        for i in range(len(ref)):
            # transformers keeps dt_bias and the router in float32: the reloaded weights differ there by rounding
            torch.testing.assert_close(again["log_probs"][i], out["log_probs"][i], rtol=0, atol=1e-6)
        assert not torch.equal(again["log_probs"].values(), torch.zeros_like(again["log_probs"].values()))
    finally:
        _close(w2)


@pytest.mark.parametrize("sharing", ["within", "off"])
def test_loss_and_gradients_equal_plain_per_sample_ppo_loss(verl_world, sharing):
    """infer_batch's log-probs and one forward_backward_batch's per-micro-batch losses and every gradient equal
    (1e-10) a plain per-sample computation: each sample alone through our model, verl's own micro-batches and
    normalisation, verl's ppo_loss (KL, entropy bonus, clipping), one backward per micro-batch."""
    from functools import partial

    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches
    from verl.workers.utils.losses import ppo_loss
    w, actor = _worker(sharing)
    try:
        module = w.engine.model.module
        b = _batch(_samples())
        tu.assign_non_tensor(b, calculate_entropy=True, compute_loss=False)
        out = w.infer_batch(b)
        with torch.no_grad():
            for i, ids in enumerate(_batch(_samples())["input_ids"].unbind()):
                lp, ent = _plain_outputs(module, ids)
                torch.testing.assert_close(out["log_probs"][i], lp, rtol=0, atol=1e-10)
                torch.testing.assert_close(out["entropy"][i], ent, rtol=0, atol=1e-10)

        def prepared():       # verl's keys as its worker sets them
            d = _batch(_samples())
            tu.assign_non_tensor(d, calculate_entropy=True, global_batch_size=12, use_dynamic_bsz=False,
                                 micro_batch_size_per_gpu=2, use_remove_padding=True)
            return d
        loss_fn = partial(ppo_loss, actor)
        w.engine.optimizer_zero_grad()
        with w.engine.train_mode():
            res = w.engine.forward_backward_batch(prepared(), loss_fn, forward_only=False)
        ours = _grads(w)
        assert any(float(g.abs().max()) > 0 for g in ours.values())

        w.engine.optimizer_zero_grad()
        d = prepared()
        tu.assign_non_tensor(d, batch_num_tokens=int(d["loss_mask"].sum()), dp_size=1)
        mbs, _ = prepare_micro_batches(d)
        assert len(mbs) == 6 and len(res["loss"]) == 6
        nested = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)
        for k, mb in enumerate(mbs):
            outs = [_plain_outputs(module, ids) for ids in mb["input_ids"].unbind()]
            loss, _ = loss_fn(model_output={"log_probs": nested([o[0] for o in outs]),
                                            "entropy": nested([o[1] for o in outs])}, data=mb)
            loss.backward()
            assert abs(loss.item() - res["loss"][k]) < 1e-10
        plain = _grads(w)
        for n in ours:
            torch.testing.assert_close(ours[n], plain[n], rtol=0, atol=1e-10, msg=lambda s: f"grad {n}: {s}")
    finally:
        _close(w)


def test_bench_verl_smoke_on_the_cpu(tmp_path):
    """benchmarks/bench_verl.py on a tiny fp64 model: every mode runs verl's update, the same first loss."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_verl.py"), "--model-args",
                        " ".join(MODEL), "--modes", "within", "off", "--prompts", "2", "--group", "3",
                        "--prompt-tokens", "6", "--turn-tokens", "4", "--tool-tokens", "2", "--response-tokens", "5",
                        "--micro-batch", "3", "--microbatch-tokens", "64", "--iters", "1", "--warmup", "0",
                        "--out", str(out)], capture_output=True, text=True, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["modes"]) == {"within", "off"} and res["samples"] == 6
    assert abs(res["modes"]["within"]["first_loss"] - res["modes"]["off"]["first_loss"]) < 1e-10
    assert res["modes"]["within"]["update_speedup"] > 0
    bad = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_verl.py"), "--micro-batch", "5",
                          "--prompts", "2", "--group", "3"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --micro-batch 5")


def test_recipe_config_groups_build_our_dataclasses():
    """The config lines of docs/verl.md, through verl's omega_conf_to_dataclass (what its trainer calls)."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    actor = OmegaConf.create({
        "_target_": "megatron_harts.integrations.verl.MegatronHartsActorConfig", "strategy": "megatron_harts",
        "use_dynamic_bsz": False, "ppo_micro_batch_size_per_gpu": 8,
        "engine": {"_target_": "megatron_harts.integrations.verl.MegatronHartsEngineConfig",
                   "load_weights": "/models/kimi", "harts_args": ["--num-layers", "27"], "tree_sharing": "within",
                   "tree_microbatch_tokens": 16384},
        "optim": {"_target_": "megatron_harts.integrations.verl.MegatronHartsOptimizerConfig", "lr": 1e-6,
                  "clip_grad": 1.0}})
    cfg = omega_conf_to_dataclass(actor)
    assert isinstance(cfg, harts_verl.MegatronHartsActorConfig) and cfg.strategy == "megatron_harts"
    assert isinstance(cfg.engine, harts_verl.MegatronHartsEngineConfig) and cfg.engine.strategy == "megatron_harts"
    assert cfg.engine.tree_microbatch_tokens == 16384 and list(cfg.engine.harts_args) == ["--num-layers", "27"]
    assert isinstance(cfg.optim, harts_verl.MegatronHartsOptimizerConfig) and cfg.optim.lr == 1e-6
    assert harts_verl._refusals(cfg.engine, cfg.optim, None) == []


def test_plugin_entry_point_registers_the_engine():
    """setup.py's "verl.plugins" entry point (verl loads every one at import) names this module."""
    import os
    import re
    from importlib.metadata import EntryPoint
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(root, "setup.py")).read()
    m = re.search(r'"verl\.plugins":\s*\["(\w+)\s*=\s*([\w.]+)"\]', text)
    assert m, "setup.py declares no verl.plugins entry point"
    module = EntryPoint(m.group(1), m.group(2), "verl.plugins").load()
    assert module.MegatronHartsEngine is harts_verl.MegatronHartsEngine
    assert re.search(r'"verl":\s*\["verl==' + re.escape(harts_verl.TESTED_VERL) + '"', text)


def test_checkpoint_round_trip(verl_world, tmp_path):
    """save_checkpoint, an update, load_checkpoint: the saved weights again, and the same next update."""
    w, _ = _worker("within")
    try:
        w.train_mini_batch(_train_inputs(_batch(_samples(seed=5))))     # an optimizer state to save
        w.save_checkpoint(str(tmp_path / "ckpt"), global_step=3)
        saved = _params(w)
        first = w.train_mini_batch(_train_inputs(_batch(_samples())))["metrics"]["loss"]
        assert any(not torch.equal(v, saved[n]) for n, v in _params(w).items())
        w.load_checkpoint(str(tmp_path / "ckpt"))
        assert w.engine.trainer.iteration == 3
        for n, v in _params(w).items():
            assert torch.equal(v, saved[n]), n
        again = w.train_mini_batch(_train_inputs(_batch(_samples())))["metrics"]["loss"]
        np.testing.assert_allclose(again, first, rtol=0, atol=1e-12)
    finally:
        _close(w)


DP_AGGS = ("token-mean", "seq-mean-token-sum-norm")
DP_METRICS = ("grad_norm", "actor/pg_loss", "actor/entropy_loss", "kl_loss", "actor/ppo_kl",
              "actor/pg_clipfrac")


def _dp_run(agg, rank=0, world=1):
    """One rank of a data-parallel group of ``world``: its share of the batch as verl's dispatch cuts it
    (``chunk_tensordict``: contiguous, here whole ``uid`` groups), infer_batch on it, then train_mini_batch
    (the whole batch is one mini-batch, 2 epochs: 2 optimizer steps, micro-batches of 2 samples)."""
    from verl.utils import tensordict_utils as tu
    samples = _samples()
    share = len(samples) // world
    uids = [u for u, *_ in samples]
    mine = uids[rank * share:(rank + 1) * share]
    assert not set(mine) & set(uids[:rank * share] + uids[(rank + 1) * share:]), "a uid group split over ranks"
    w, actor = _worker("within", agg)
    try:
        b = tu.chunk_tensordict(_batch(samples), world)[rank]
        assert harts_verl._uids(b) == mine
        tu.assign_non_tensor(b, calculate_entropy=True, compute_loss=False)
        inf = w.infer_batch(b)
        lps = [x.clone() for x in inf["log_probs"].unbind()]
        ents = [x.clone() for x in inf["entropy"].unbind()]
        b = tu.chunk_tensordict(_batch(samples), world)[rank]
        tu.assign_non_tensor(b, global_batch_size=len(samples), mini_batch_size=len(samples), epochs=2, seed=3,
                             calculate_entropy=True, dataloader_kwargs={"shuffle": False})
        m = w.train_mini_batch(b)["metrics"]
        tokens = w.engine.last_batch_tokens
        return {"log_probs": lps, "entropy": ents, "grads": _grads(w), "params": _params(w), "tokens": tokens,
                "metrics": {k: np.asarray(m[k], dtype=np.float64).tolist() for k in DP_METRICS + ("loss",)},
                "coef": (actor.entropy_coeff, actor.kl_loss_coef)}
    finally:
        _close(w)


def _dp_rank_main(rank, world, out):
    """A child process's rank (launched by the test with its launcher variables in its environment)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    try:
        torch.save({agg: _dp_run(agg, rank, world) for agg in DP_AGGS}, out)
    finally:
        dist.destroy_process_group()


def _launch_dp_ranks(world, tmp_path, timeout=900):
    """``world`` ranks, each a fresh interpreter running _dp_rank_main over a gloo rendezvous on a free port;
    the variables verl's Worker reads are given in each child's environment (this process's is not written)."""
    import os
    import subprocess
    import sys
    import time
    from megatron_harts.testing.cpu_runtime import free_port
    here = os.path.dirname(os.path.abspath(__file__))
    port = str(free_port())
    path = os.pathsep.join([here] + [p for p in sys.path if p])
    procs, logs = [], []
    try:
        for r in range(world):
            env = dict(os.environ, PYTHONPATH=path, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                       LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1",
                       REDIS_STORE_SERVER_HOST="127.0.0.1")
            log = open(tmp_path / f"rank{r}.log", "w")
            logs.append(log)
            code = f"import test_verl_engine as t; t._dp_rank_main({r}, {world}, {str(tmp_path / f'rank{r}.pt')!r})"
            procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdout=log,
                                          stderr=subprocess.STDOUT, cwd=str(tmp_path)))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:      # a failed rank ends the run (its peer would wait in gloo)
            codes = [p.poll() for p in procs]
            if all(c == 0 for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.5)
        codes = [p.poll() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    if any(c != 0 for c in codes):
        tails = "\n".join(f"rank {r} (exit {c}):\n" + (tmp_path / f"rank{r}.log").read_text()[-3000:]
                          for r, c in enumerate(codes))
        pytest.fail(f"data-parallel ranks failed:\n{tails}")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def test_data_parallel_two_ranks_equal_one_process(verl_world, tmp_path):
    """Data parallelism 2 (two gloo processes, each rank given its half of the batch: two whole uid groups,
    contiguous as verl's dispatch chunks it) equals one process on the whole batch, in tree mode: infer_batch's
    log-probs and entropies for each rank's rows; train_mini_batch's metrics as verl aggregates them over ranks
    and micro-batches (micro-batches of 2 samples: the same micro-batches at both sizes, so even
    seq-mean-token-sum-norm's per-micro-batch horizon agrees), the gradient norms, the last reduced gradients
    and the weights after 2 optimizer steps, to 1e-10 in fp64.  verl normalises by the loss tokens over all
    ranks (``batch_num_tokens``) and scales each rank's loss by ``dp_size`` for an averaging reduce; the engine
    divides that back out for the trainer's summing reduce.  The one exception is verl's own: TrainingWorker
    sums the micro-batch losses into a float32 tensor (``torch.tensor`` of Python floats) before averaging over
    ranks, so the ``loss`` it reports agrees to the float32 rounding of a sum of six (rtol 2e-6), and is
    checked against its fp64 terms (pg_loss - entropy_coeff * entropy_loss + kl_loss_coef * kl_loss)."""
    ranks = _launch_dp_ranks(2, tmp_path)
    share = len(_samples()) // 2
    for agg in DP_AGGS:
        one = _dp_run(agg)
        assert one["metrics"]["kl_loss"][0] > 0 and len(one["metrics"]["loss"]) == 2
        assert any(float(g.abs().max()) > 0 for g in one["grads"].values())
        for r, res in enumerate(ranks):
            two = res[agg]
            assert two["tokens"]["computed"] < two["tokens"]["trajectory"], two["tokens"]   # prefixes shared
            for i in range(share):
                row = r * share + i
                torch.testing.assert_close(two["log_probs"][i], one["log_probs"][row], rtol=0, atol=1e-10,
                                           msg=lambda s: f"{agg} rank {r} log-probs of row {row}: {s}")
                torch.testing.assert_close(two["entropy"][i], one["entropy"][row], rtol=0, atol=1e-10,
                                           msg=lambda s: f"{agg} rank {r} entropy of row {row}: {s}")
            for key in DP_METRICS:
                np.testing.assert_allclose(two["metrics"][key], one["metrics"][key], rtol=0, atol=1e-10,
                                           err_msg=f"{agg} rank {r} {key}")
            for n in one["params"]:
                torch.testing.assert_close(two["grads"][n], one["grads"][n], rtol=0, atol=1e-10,
                                           msg=lambda s: f"{agg} rank {r} grad {n}: {s}")
                torch.testing.assert_close(two["params"][n], one["params"][n], rtol=0, atol=1e-10,
                                           msg=lambda s: f"{agg} rank {r} param {n}: {s}")
            for res_ in (one, two):      # the float32 loss verl reports: its fp64 terms to float32 rounding
                (ce, ck), mm = res_["coef"], res_["metrics"]
                terms = np.asarray(mm["actor/pg_loss"]) - ce * np.asarray(mm["actor/entropy_loss"]) + \
                    ck * np.asarray(mm["kl_loss"])
                np.testing.assert_allclose(mm["loss"], terms, rtol=2e-6, atol=0, err_msg=f"{agg} loss terms")
            np.testing.assert_allclose(two["metrics"]["loss"], one["metrics"]["loss"], rtol=2e-6, atol=0,
                                       err_msg=f"{agg} rank {r} loss")
