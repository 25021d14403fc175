"""Checkpoint save/load (megatron_harts.training.checkpointing) on two gloo processes (data parallel 2).

One spawned run executes every scenario (the plain and the distributed optimizer) and records the
outcomes; the tests below assert on them.  The core property: training 2 steps, saving, training
2 more, versus loading into a fresh model/optimizer/scheduler (other initialization) and training
the same 2 steps, gives bitwise equal losses and parameters; the RNG draws after the load equal
those after the save.

megatron's optimizers run on the CPU inside ``megatron_cpu_runtime`` (CUDA-literal tensor factories,
grad clipping); the distributed optimizer also checks ``param.type()`` against ``torch.cuda.*Tensor``
names, which ``CudaAsCpu`` (test-only) answers for CPU tensors.  It accepts fp16/bf16/fp32
parameters only, so its scenario runs in fp32 (bitwise reproducibility does not need fp64); the
plain optimizer's runs in fp64.
"""
import json
import os
import random
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import megatron_harts.patches as patches
from megatron_harts.models.model import build_hybrid_model
from megatron_harts.training import checkpointing as ck

from hybrid_tiny import VOCAB, randomize_, tiny_config
from megatron_cpu import free_port, megatron_cpu
from multiproc import run_ranks

WORLD = 2
KINDS = ("plain", "distributed")


class CudaAsCpu(TorchFunctionMode):
    """``t.type()`` of a CPU tensor reads as its CUDA name ("torch.cuda.FloatTensor"), which is what
    megatron's DistributedOptimizer requires of every parameter (test-only, like the CPU runtime)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def empty_moe_tracker():
    """megatron's MoE aux-loss tracker is a module global sized by the first model that logs into it:
    in-process tests of these 2-layer models leave it empty for the next test (most models have 4)."""
    from megatron.core.transformer.moe import moe_utils
    moe_utils.get_moe_layer_wise_logging_tracker().clear()


@pytest.fixture
def moe_tracker_emptied():
    yield
    empty_moe_tracker()


def _config(kind, **kw):
    dtype = torch.float64 if kind == "plain" else torch.float32
    return tiny_config(dtype=dtype, num_layers=2, **kw)


def build_training(kind, seed, **cfg_kw):
    """DDP-wrapped 2-layer hybrid (KDA + MLA, dense then MoE), megatron's Adam, a warmup+cosine schedule."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    distributed = kind == "distributed"
    cfg = _config(kind, **cfg_kw)
    module = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), seed=seed)
    model = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=distributed), module)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, min_lr=1e-3, weight_decay=0.01,
                                                 clip_grad=1.0, params_dtype=cfg.params_dtype,
                                                 use_distributed_optimizer=distributed), [model])
    sched = OptimizerParamScheduler(opt, init_lr=2e-3, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=2,
                                    lr_decay_steps=8, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                    wd_incr_steps=8, wd_incr_style="constant")
    return model, opt, sched


def _batch(rank, kind, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    ids = torch.randint(0, VOCAB, (2, 8), generator=g)
    coef = torch.randn(8, 2, VOCAB, generator=g, dtype=_config(kind).params_dtype)
    return ids, coef


def train_steps(model, opt, sched, rank, kind, steps):
    """Deterministic synthetic steps (fixed tokens, loss = sum of logits x fixed coefficients)."""
    from megatron.core.distributed import finalize_model_grads
    losses = []
    for step in steps:
        ids, coef = _batch(rank, kind, step)
        model.zero_grad_buffer()
        opt.zero_grad()
        loss = (model(ids, None) * coef).sum()
        loss.backward()
        finalize_model_grads([model])
        ok, _, _ = opt.step()
        assert ok
        sched.step(1)
        losses.append(float(loss))
    return losses


def _params(model):
    """Parameters and the routers' expert biases (updated outside the optimizer, by finalize_model_grads)."""
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    out.update({n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("expert_bias")})
    return out


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _draws():
    from megatron.core.tensor_parallel import random as mrandom
    tracker = mrandom.get_cuda_rng_tracker()
    with tracker.fork():
        tracked = torch.rand(3, dtype=torch.float64).tolist()
    return [random.random(), float(np.random.rand()), torch.rand(3, dtype=torch.float64).tolist(), tracked]


def _scramble_rng(seed):
    from megatron.core.tensor_parallel import random as mrandom
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.set_states({k: torch.Generator().manual_seed(seed + i).get_state()
                        for i, k in enumerate(tracker.get_states())})


def _expect_error(fn):
    try:
        fn()
    except ck.CheckpointError as e:
        return str(e)
    return None


def _listing(d):
    """The directory's entries once every rank got here (and before any rank changes it again)."""
    dist.barrier()
    names = sorted(os.listdir(d))
    dist.barrier()
    return names


def _scenario(kind, rank, root, extra):
    """Save/continue/resume, failed saves, overwrite, finetune; returns what the tests check."""
    out = {}
    d = os.path.join(root, kind)
    a = build_training(kind, seed=1)
    _scramble_rng(7 + rank)
    out["losses_before"] = train_steps(*a, rank, kind, [0, 1])
    saved_params = _params(a[0])
    ck.save_checkpoint(d, 2, [a[0]], a[1], a[2], extra_state=extra)
    out["tracker_after_save"] = ck.latest_iteration(d)
    out["listing_after_save"] = _listing(d)
    out["draws_after_save"] = _draws()
    out["losses_continued"] = train_steps(*a, rank, kind, [2, 3])
    continued = _params(a[0])

    b = build_training(kind, seed=2)
    out["fresh_differs"] = not _same(_params(b[0]), saved_params)
    _scramble_rng(99 + rank)
    it, got_extra = ck.load_checkpoint(d, [b[0]], b[1], b[2])
    out["loaded"] = [it, got_extra]
    out["loaded_params_equal"] = _same(_params(b[0]), saved_params)
    out["scheduler_steps"] = [a[2].num_steps, b[2].num_steps]
    out["draws_after_load"] = _draws()
    out["losses_resumed"] = train_steps(*b, rank, kind, [2, 3])
    out["resumed_params_equal"] = _same(_params(b[0]), continued)
    if rank == 0:
        torch.save(continued, os.path.join(root, f"{kind}_params_iter4.pt"))

    # failed saves of iteration 4: the checkpoint of iteration 2 and the tracker stay as they were
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    failures = {}
    original_write = filesystem_async._write_item

    def broken_write(*args, **kw):
        raise OSError(28, "No space left on device (injected)")

    if rank == 1:
        filesystem_async._write_item = broken_write
    try:
        failures["write_rank1"] = _expect_error(lambda: ck.save_checkpoint(d, 4, [a[0]], a[1], a[2], extra_state=extra))
    finally:
        filesystem_async._write_item = original_write
    out["listing_after_write_failure"] = _listing(d)

    original_tracker = ck._write_tracker

    def broken_tracker(*args):
        raise OSError(5, "Input/output error (injected)")

    if rank == 0:
        ck._write_tracker = broken_tracker
    try:
        failures["tracker_rank0"] = _expect_error(lambda: ck.save_checkpoint(d, 4, [a[0]], a[1], a[2],
                                                                             extra_state=extra))
    finally:
        ck._write_tracker = original_tracker
    out["listing_after_tracker_failure"] = _listing(d)
    failures["extra_differs"] = _expect_error(lambda: ck.save_checkpoint(
        d, 4, [a[0]], a[1], a[2], extra_state=dict(extra, rank=rank)))
    failures["extra_not_json"] = _expect_error(lambda: ck.save_checkpoint(
        d, 4, [a[0]], a[1], a[2], extra_state={"x": {1, 2}} if rank == 1 else extra))
    out["failures"] = failures
    out["listing_after_failures"] = _listing(d)
    out["tracker_after_failures"] = ck.latest_iteration(d)
    # what a killed save leaves behind: ignored by loading, removed by the next save
    if rank == 0:
        os.makedirs(os.path.join(d, "iter_0000006.tmp-killed"))
        with open(os.path.join(d, "iter_0000006.tmp-killed", "__0_0.distcp"), "wb") as f:
            f.write(b"partial")
        with open(os.path.join(d, ck.TRACKER_FILENAME + ".tmp-killed"), "w") as f:
            f.write("6")
    dist.barrier()
    c = build_training(kind, seed=3)
    out["after_failures_loaded"] = ck.load_checkpoint(d, [c[0]], c[1], c[2])[0]
    out["after_failures_params_equal"] = _same(_params(c[0]), saved_params)

    # a good save of 4, then the same iteration again (the old directory is replaced)
    ck.save_checkpoint(d, 4, [a[0]], a[1], a[2], extra_state=dict(extra, step=4))
    ck.save_checkpoint(d, 4, [a[0]], a[1], a[2], extra_state=dict(extra, step=44))
    out["listing_after_resave"] = _listing(d)
    out["tracker_after_resave"] = ck.latest_iteration(d)

    # finetune: weights only
    e = build_training(kind, seed=4)
    rng_before = torch.get_rng_state()
    out["finetune"] = list(ck.load_checkpoint(d, [e[0]], e[1], e[2], finetune=True))
    out["finetune_params_equal"] = _same(_params(e[0]), continued)
    out["finetune_rng_untouched"] = torch.equal(torch.get_rng_state(), rng_before)
    out["finetune_scheduler_steps"] = e[2].num_steps
    out["finetune_losses"] = train_steps(*e, rank, kind, [4])
    return out


def _error_scenarios(rank, root):
    from megatron.core import dist_checkpointing
    out = {}
    kind = "plain"
    m = build_training(kind, seed=5)
    empty = os.path.join(root, "empty")
    if rank == 0:
        os.makedirs(empty)
    dist.barrier()
    out["empty"] = ck.load_checkpoint(empty, [m[0]], m[1], m[2])
    missing = os.path.join(root, "missing")
    corrupt = os.path.join(root, "corrupt")
    if rank == 0:
        os.makedirs(missing)
        with open(os.path.join(missing, ck.TRACKER_FILENAME), "w") as f:
            f.write("7\n")
        os.makedirs(corrupt)
        with open(os.path.join(corrupt, ck.TRACKER_FILENAME), "w") as f:
            f.write("iter_7?\n")
    dist.barrier()
    out["missing_dir"] = _expect_error(lambda: ck.load_checkpoint(missing, [m[0]], m[1], m[2]))
    out["corrupt_tracker"] = _expect_error(lambda: ck.load_checkpoint(corrupt, [m[0]], m[1], m[2]))
    try:
        ck.latest_iteration(corrupt)
        out["latest_corrupt"] = None
    except ck.CheckpointError as e:
        out["latest_corrupt"] = str(e)
    # a model of another shape (MoE expert width 24 instead of 16)
    other = build_training(kind, seed=5, moe_ffn_hidden_size=24)
    out["other_shape"] = _expect_error(lambda: ck.load_checkpoint(os.path.join(root, kind), [other[0]], other[1],
                                                                   other[2]))
    # a distributed-optimizer checkpoint into the plain optimizer
    out["other_optimizer"] = _expect_error(lambda: ck.load_checkpoint(os.path.join(root, "distributed"), [m[0]],
                                                                       m[1], m[2]))
    # NaN parameters are not saved
    with torch.no_grad():
        next(m[0].parameters()).view(-1)[0] = float("nan")
    out["nan"] = _expect_error(lambda: ck.save_checkpoint(os.path.join(root, "nan"), 1, [m[0]], m[1], m[2]))
    out["nan_listing"] = _listing(os.path.join(root, "nan")) if os.path.isdir(os.path.join(root, "nan")) else []
    # a release checkpoint (tools/convert_hf_checkpoint.py --format dist): weights only
    r = build_training(kind, seed=6)
    rel = os.path.join(root, "release_ckpt")
    if rank == 0:
        os.makedirs(os.path.join(rel, "release"))
        with open(os.path.join(rel, ck.TRACKER_FILENAME), "w") as f:
            f.write("release\n")
    dist.barrier()
    dist_checkpointing.save(r[0].module.sharded_state_dict(metadata={"non_homogeneous_layers": True}),
                            os.path.join(rel, "release"))
    s = build_training(kind, seed=7)
    out["release"] = list(ck.load_checkpoint(rel, [s[0]], s[1], s[2]))
    out["release_params_equal"] = _same(_params(s[0]), _params(r[0]))
    return out


def _worker(rank, world, port, root, out_dir):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        patches.apply()
        with megatron_cpu(init_world=False), CudaAsCpu():
            extra = {"consumed_trajectories": 64, "loader": {"epoch": 0, "offset": 17}, "args": {"lr": 0.01}}
            for kind in KINDS:
                try:
                    results[kind] = _scenario(kind, rank, root, extra)
                except Exception:
                    results[kind] = {"crash": traceback.format_exc()}
            try:
                results["errors"] = _error_scenarios(rank, root)
            except Exception:
                results["errors"] = {"crash": traceback.format_exc()}
    finally:
        patches.undo()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    out_dir = str(tmp_path_factory.mktemp("results"))
    run_ranks(_worker, WORLD, (free_port(), root, out_dir), timeout=240)
    per_rank = []
    for r in range(WORLD):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            per_rank.append(json.load(f))
    return {"root": root, "ranks": per_rank}


def _kind(results, kind):
    out = []
    for r, res in enumerate(results["ranks"]):
        assert "crash" not in res[kind], f"rank {r}: {res[kind]['crash']}"
        out.append(res[kind])
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_resume_reproduces_the_uninterrupted_run(results, kind):
    for r, res in enumerate(_kind(results, kind)):
        assert res["fresh_differs"]
        assert res["tracker_after_save"] == 2
        assert res["listing_after_save"] == ["iter_0000002", ck.TRACKER_FILENAME]
        assert res["loaded"][0] == 2
        assert res["loaded_params_equal"], f"rank {r}"
        assert res["scheduler_steps"][1] == 2
        assert res["losses_resumed"] == res["losses_continued"], f"rank {r}"     # bitwise (float ==)
        assert res["resumed_params_equal"], f"rank {r}"
    losses = [res["losses_continued"] for res in _kind(results, kind)]
    assert losses[0] != losses[1]        # the ranks train on different data


@pytest.mark.parametrize("kind", KINDS)
def test_rng_and_extra_state_round_trip(results, kind):
    for res in _kind(results, kind):
        assert res["draws_after_load"] == res["draws_after_save"]
        assert res["loaded"][1] == {"consumed_trajectories": 64, "loader": {"epoch": 0, "offset": 17},
                                    "args": {"lr": 0.01}}
    draws = [res["draws_after_save"] for res in _kind(results, kind)]
    assert draws[0] != draws[1]          # per-rank RNG states, each restored on its own rank


@pytest.mark.parametrize("kind", KINDS)
def test_failed_saves_leave_the_last_checkpoint(results, kind):
    ranks = _kind(results, kind)
    for r, res in enumerate(ranks):
        f = res["failures"]
        assert f["write_rank1"] and "No space left on device (injected)" in f["write_rank1"], f["write_rank1"]
        assert "rank 1" in f["write_rank1"]
        assert f["tracker_rank0"] and "Input/output error (injected)" in f["tracker_rank0"]
        assert f["extra_differs"] and "extra_state differs" in f["extra_differs"]
        assert f["extra_not_json"] and "rank 1" in f["extra_not_json"] and "JSON" in f["extra_not_json"]
        for key in ("listing_after_write_failure", "listing_after_tracker_failure", "listing_after_failures"):
            assert res[key] == ["iter_0000002", ck.TRACKER_FILENAME], (key, res[key])
        assert res["tracker_after_failures"] == 2
        assert res["after_failures_loaded"] == 2 and res["after_failures_params_equal"]
    # every rank raised the same error
    assert ranks[0]["failures"] == ranks[1]["failures"]


@pytest.mark.parametrize("kind", KINDS)
def test_resave_same_iteration_and_finetune(results, kind):
    for res in _kind(results, kind):
        assert res["listing_after_resave"] == ["iter_0000002", "iter_0000004", ck.TRACKER_FILENAME]
        assert res["tracker_after_resave"] == 4
        assert res["finetune"] == [0, {}]
        assert res["finetune_params_equal"]
        assert res["finetune_rng_untouched"]
        assert res["finetune_scheduler_steps"] == 0
        assert all(np.isfinite(res["finetune_losses"]))


def test_load_errors(results):
    for r, res in enumerate(results["ranks"]):
        e = res["errors"]
        assert "crash" not in e, f"rank {r}: {e['crash']}"
        assert e["empty"] is None
        root = results["root"]
        missing = os.path.join(root, "missing")
        assert missing in e["missing_dir"] and "iter_0000007" in e["missing_dir"]
        assert "does not exist" in e["missing_dir"]
        assert "corrupt tracker" in e["corrupt_tracker"] and "iter_7?" in e["corrupt_tracker"]
        assert os.path.join(root, "corrupt", ck.TRACKER_FILENAME) in e["corrupt_tracker"]
        assert "corrupt tracker" in e["latest_corrupt"]
        msg = e["other_shape"]
        assert msg and "\n" not in msg and "does not match the model" in msg and "tensor '" in msg, msg
        assert os.path.join(root, "plain", "iter_0000004") in msg
        assert "distributed optimizer" in e["other_optimizer"] and "load_optim=False" in e["other_optimizer"]
        assert "NaN" in e["nan"] and e["nan_listing"] == []
        assert e["release"] == [0, {}] and e["release_params_equal"]
    assert results["ranks"][0]["errors"]["other_shape"] == results["ranks"][1]["errors"]["other_shape"]


@pytest.mark.parametrize("kind", KINDS)
def test_other_world_size_loads_weights_and_optimizer_not_rng(results, cpu_world, moe_tracker_emptied, kind):
    """The 2-process checkpoint of iteration 4 in a world of one (data parallel 1): weights and the
    optimizer (the distributed one resharded over data parallelism) load; the per-rank RNG states
    are refused with a warning."""
    _kind(results, kind)
    root = results["root"]
    want = torch.load(os.path.join(root, f"{kind}_params_iter4.pt"))
    with CudaAsCpu():
        m = build_training(kind, seed=8)
        rng = torch.get_rng_state()
        with pytest.warns(UserWarning, match="parallel layout"):
            it, extra = ck.load_checkpoint(os.path.join(root, kind), [m[0]], m[1], m[2])
        assert it == 4 and extra["step"] == 44
        assert torch.equal(torch.get_rng_state(), rng)
        assert _same(_params(m[0]), want)
        assert m[2].num_steps == 4
        assert all(np.isfinite(train_steps(*m, 0, kind, [4])))
