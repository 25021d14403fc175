"""The training driver end to end on CPU: DP=2 gloo runs of a tiny hybrid MoE model, fp64.

- tree mode (``--tree-sharing within`` and ``windows``) and expanded mode (``off``) give the same
  losses and the same parameters after every step (PPO with KL and entropy terms);
- a run resumed from a checkpoint reproduces the uninterrupted run's losses and parameters;
- ``--exit-signal-handler``: SIGTERM saves a checkpoint after the current iteration and stops;
- a non-finite loss stops the run naming the iteration, before the weights change, and the last
  good checkpoint stays the latest.
"""
import os
import signal

import numpy as np
import pytest
import torch

from multiproc import run_ranks

from megatron_harts.tree_data import build_forest, make_trajectory, write_dataset

MODEL = ("--num-layers 4 --hidden-size 32 --num-attention-heads 2 --ffn-hidden-size 48 --swiglu "
         "--disable-bias-linear --multi-latent-attention --kv-lora-rank 16 --qk-head-dim 8 "
         "--qk-pos-emb-head-dim 4 --v-head-dim 8 --linear-attention-freq 2 --linear-key-head-dim 8 "
         "--linear-value-head-dim 8 --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 16 "
         "--moe-shared-expert-intermediate-size 16 "
         "--moe-layer-freq ([0]+[1]*3) --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
         "--moe-aux-loss-coeff 0 --vocab-size 64 --make-vocab-size-divisible-by 1 "
         "--untie-embeddings-and-output-weights --fp64 --distributed-backend gloo --tree-chunk-size 8").split()


def rollouts(seed=0):
    """Three trees with long shared prompts (so 48-row microbatches must split them), PPO metadata."""
    rng = np.random.default_rng(seed)
    trajs = []
    for task in range(3):
        prompt = rng.integers(0, 64, int(rng.integers(18, 26))).tolist()
        for b in range(int(rng.integers(3, 6))):
            turn = prompt + rng.integers(0, 64, int(rng.integers(4, 9))).tolist()
            for s in range(2):
                toks = turn + rng.integers(0, 64, int(rng.integers(2, 8))).tolist()
                n = len(toks)
                mask = [0] * len(prompt) + [1] * (n - len(prompt))
                trajs.append(make_trajectory({
                    "id": f"t{task}/b{b}/s{s}", "tokens": toks, "loss_mask": mask,
                    "old_logprobs": (-np.abs(rng.normal(2.0, 0.5, n))).tolist(),
                    "advantage": float(rng.normal()), "weight": float(rng.uniform(0.5, 1.5))}))
    return trajs


def write_rollouts(path):
    forest = build_forest(rollouts())
    write_dataset(forest, str(path))
    return forest


def argv(data, sharing, *extra):
    planner = {"off": "ffd", "within": "l1", "windows": "l1l2"}[sharing]
    return MODEL + ["--data-path", str(data), "--global-batch-size", "16", "--train-iters", "3",
                    "--seq-length", "48", "--tree-microbatch-tokens", "48", "--tree-sharing", sharing,
                    "--tree-planner", planner, "--lr", "3e-3", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
                    "--seed", "7", "--log-interval", "1", "--rl-objective", "ppo", "--clip-ratio-low", "0.2",
                    "--clip-ratio-high", "0.28", "--kl-coef", "0.05", "--kl-to", "old", "--entropy-coef", "0.01",
                    "--loss-agg-mode", "seq-mean-token-mean", *extra]


def _world(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)


def spawn(worker, tmp_path, *extra):
    """Run ``worker(rank, 2, port, data, *extra, out)`` on 2 gloo processes; what rank 0 saved to out."""
    from megatron_cpu import free_port
    data = tmp_path / "rollouts"
    write_rollouts(data)
    out = tmp_path / "out.pt"
    run_ranks(worker, 2, (free_port(), str(data), *(str(e) for e in extra), str(out)), timeout=300)
    return torch.load(out, weights_only=False)


def assert_same_steps(steps, ref, what, terms=()):
    """Two runs' (metrics, parameters) per step: equal losses (and ``terms``) and parameters to 1e-10."""
    assert len(steps) == len(ref) > 0, what
    for i, ((m, params), (m_ref, params_ref)) in enumerate(zip(steps, ref)):
        at = f"{what}, step {i + 1}"
        assert m["trajectories"] == m_ref["trajectories"] and m["target_tokens"] == m_ref["target_tokens"], at
        for k in ("loss", *terms):
            assert abs(m[k] - m_ref[k]) <= 1e-10 * max(abs(m_ref[k]), 1e-12), f"{at}: {k}"
        for name, p in params_ref.items():
            torch.testing.assert_close(params[name], p, rtol=1e-10, atol=1e-12, msg=f"{at}: {name}")


def _params(trainer):
    from megatron_harts.training.export import full_state_dict
    if trainer.args.pipeline_model_parallel_size > 1:       # this stage's own parameters
        return {k: v.detach().clone() for k, v in trainer.model[0].module.named_parameters()}
    return {k: v.clone() for k, v in full_state_dict(trainer.model[0].module, trainer.config).items()}


def _equality_worker(rank, world, port, data, out):
    from megatron_harts.training.trainer import Trainer
    _world(rank, world, port)
    runs = {}
    for sharing in ("off", "within", "windows"):
        with Trainer.from_args(argv(data, sharing), require_data=True) as t:
            steps = []
            for _ in range(3):
                m = t.train_iteration()
                steps.append((m, _params(t)))
            runs[sharing] = steps
    if rank == 0:
        torch.save(runs, out)


def test_dp2_tree_modes_equal_expanded(tmp_path):
    runs = spawn(_equality_worker, tmp_path)
    ref = runs["off"]
    for sharing in ("within", "windows"):
        assert_same_steps(runs[sharing], ref, f"{sharing} vs off",
                          terms=("objective/pg_loss", "objective/kl", "objective/entropy"))
    # the comparison is not vacuous: the weights moved, tree modes shared rows, windows ran
    first, last = ref[0][1], ref[-1][1]
    assert any(not torch.equal(first[k], last[k]) for k in first)
    assert all(m["compression"] > 1.0 for m, _ in runs["within"])
    assert all(m["compression"] <= 1.0 for m, _ in runs["off"])
    # windows: here L2's windows would need recomputed context over the 48-row budget on DP 2, so the
    # driver keeps L1's plan (training/step.py executed_rows; tests/test_plan_step.py); the PP 2 driver
    # test (DP 1) runs windows
    computed = {k: sum(m["computed_tokens"] for m, _ in runs[k]) for k in runs}
    assert computed["windows"] <= computed["within"] < computed["off"], computed


def _idle_replica_worker(rank, world, port, data, out):
    from megatron_harts.training.trainer import Trainer
    _world(rank, world, port)
    one = rollouts()[:1]                      # one microbatch: replica 1 has none this step
    flags = [f for f in argv(data, "within") if f != str(data)]
    flags = flags[:flags.index("--data-path")] + flags[flags.index("--data-path") + 1:]
    flags[flags.index("--global-batch-size") + 1] = "1"
    with Trainer.from_args(flags) as t:
        steps = [t.step(one) for _ in range(2)]
    if rank == 0:
        torch.save(steps, out)


def test_replica_without_microbatches_takes_part_in_the_step(tmp_path):
    """DP 2, a global batch of one trajectory: the idle replica joins every reduction (it hung at
    the MoE load all-reduce when only replicas with microbatches counted experts)."""
    steps = spawn(_idle_replica_worker, tmp_path)
    assert [m["trajectories"] for m in steps] == [1, 1]
    assert all(np.isfinite(m["loss"]) for m in steps)
    assert steps[0]["loss"] != steps[1]["loss"]          # the update ran


def _resume_worker(rank, world, port, data, ckpt, pp, out):
    from megatron_harts.training.trainer import Trainer
    _world(rank, world, port)
    results = {}
    base = argv(data, "windows", "--pipeline-model-parallel-size", pp)
    with Trainer.from_args(base, require_data=True) as t:
        results["straight"] = [(t.train_iteration(), _params(t)) for _ in range(3)]
    with Trainer.from_args(base + ["--save", ckpt, "--save-interval", "2", "--exit-interval", "2"],
                           require_data=True) as t:
        t.train()
    with Trainer.from_args(base + ["--load", ckpt], require_data=True) as t:
        assert t.iteration == 2
        results["resumed"] = [(t.train_iteration(), _params(t))]
    torch.save(results, f"{out}.{rank}")
    if rank == 0:
        torch.save(results, out)


@pytest.mark.parametrize("pp", [1, 2])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, pp):
    """DP 2, and PP 2 (each stage saves and loads its own layers of one checkpoint)."""
    r = spawn(_resume_worker, tmp_path, tmp_path / "ckpt", pp)
    other = torch.load(f"{tmp_path / 'out.pt'}.1", weights_only=False)
    if pp == 2:      # stage 1's own parameters too
        (_, p1), (_, p1_ref) = other["resumed"][0], other["straight"][2]
        assert set(p1) and all(torch.equal(p1[k], p1_ref[k]) for k in p1_ref)
    (m, params), (m_ref, params_ref) = r["resumed"][0], r["straight"][2]
    assert m["iteration"] == 3 and m["loss"] == m_ref["loss"]
    for name in params_ref:
        assert torch.equal(params[name], params_ref[name]), name


def _signal_worker(rank, world, port, data, ckpt, out):
    from megatron_harts.training.trainer import Trainer
    _world(rank, world, port)
    with Trainer.from_args(argv(data, "within", "--save", ckpt, "--save-interval", "100", "--train-iters", "3",
                                "--exit-signal-handler"), require_data=True) as t:
        if rank == 1:                       # one rank receives the signal: every rank stops together
            signal.raise_signal(signal.SIGTERM)
        t.train()
        if rank == 0:
            torch.save({"iteration": t.iteration, "saved": t.last_saved}, out)


def test_sigterm_saves_and_stops(tmp_path):
    from megatron_harts.training.checkpointing import latest_iteration
    r = spawn(_signal_worker, tmp_path, tmp_path / "ckpt")
    assert r == {"iteration": 1, "saved": 1}
    assert latest_iteration(str(tmp_path / "ckpt")) == 1


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(tmp_path, capsys):
    from megatron_harts.training.checkpointing import latest_iteration
    from megatron_harts.training.trainer import Trainer, TrainingError
    data = tmp_path / "rollouts"
    write_rollouts(data)
    ckpt = str(tmp_path / "ckpt")
    with Trainer.from_args(argv(data, "within", "--save", ckpt, "--save-interval", "1"), require_data=True) as t:
        t.train_iteration()
        t.save()
        with torch.no_grad():
            t.model[0].module.embedding.word_embeddings.weight[:] = float("nan")
        before = {k: v.clone() for k, v in t.model[0].module.named_parameters()}
        with pytest.raises(TrainingError, match=r"iteration 2: the loss is nan .*last good checkpoint is iteration 1"):
            t.train_iteration()
        after = dict(t.model[0].module.named_parameters())
        for k, v in before.items():
            assert torch.equal(v, after[k]) or (torch.isnan(v).all() and torch.isnan(after[k]).all()), k
    assert latest_iteration(ckpt) == 1


def test_pretrain_cli_one_error_line(tmp_path, capsys):
    """Bad flags and bad data end in one error line and exit status 2 (no traceback)."""
    from megatron_harts.training.pretrain import console_main
    import sys
    data = tmp_path / "rollouts"
    write_rollouts(data)
    cases = [(argv(data, "within", "--no-such-flag"), "unrecognized arguments: --no-such-flag"),
             (argv(tmp_path / "missing", "within"), "missing"),
             (argv(data, "within", "--global-batch-size", "2"), "--global-batch-size"),
             (argv(data, "within", "--use-distributed-optimizer"), "--use-distributed-optimizer needs CUDA")]
    for args, needle in cases:
        old = sys.argv
        sys.argv = ["pretrain_tree_gpt.py", *args]
        try:
            with pytest.raises(SystemExit) as e:
                console_main()
        finally:
            sys.argv = old
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error:") and needle in err[0], err


def test_pretrain_out_of_memory_is_one_error_line(tmp_path, capsys, monkeypatch):
    """A GPU out-of-memory error in training ends the driver in one error line naming the iteration,
    torch's message and the flags that lower a step's memory (the error raised here stands in for the
    allocator's, which a CPU run cannot produce)."""
    import sys
    from megatron_harts.training.pretrain import console_main
    from megatron_harts.training.trainer import Trainer
    data = tmp_path / "rollouts"
    write_rollouts(data)
    real = Trainer.train_iteration
    calls = []

    def failing(self, *a, **k):
        calls.append(self.iteration)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 146.00 MiB. GPU 0 has a total "
                                         "capacity of 79.18 GiB\nmore detail")
        return real(self, *a, **k)
    monkeypatch.setattr(Trainer, "train_iteration", failing)
    monkeypatch.setattr(sys, "argv", ["pretrain_tree_gpt.py", *argv(data, "within", "--train-iters", "3")])
    with pytest.raises(SystemExit) as e:
        console_main()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("error: out of GPU memory in iteration 2: CUDA out of memory. Tried to allocate")
    assert "--tree-microbatch-tokens (now" in err[0] and "--tree-piece-keep none" in err[0]
    assert "more detail" not in err[0]


def test_library_step_tensorboard_and_hf_export(tmp_path):
    """The RL-loop entry: step() on in-memory trajectories, TensorBoard scalars, transformers export."""
    pytest.importorskip("transformers")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from megatron_harts.models.hf_convert import hf_to_megatron, load_hf_checkpoint
    from megatron_harts.training.export import full_state_dict
    from megatron_harts.training.trainer import Trainer
    args = [a for a in argv("unused", "within", "--tensorboard-dir", str(tmp_path / "tb"), "--tree-plan-report",
                            str(tmp_path / "plan.jsonl"))]
    i = args.index("--data-path")
    del args[i:i + 2]
    records = [{"id": t.id, "tokens": t.tokens.tolist(), "loss_mask": t.loss_mask.tolist(),
                "old_logprobs": t.old_logprobs.tolist(), "advantage": t.advantage, "weight": t.weight}
               for t in rollouts()[:10]]
    with Trainer.from_args(args) as t:
        before = full_state_dict(t.model[0].module, t.config)
        m1 = t.step(records)
        m2 = t.step(records)
        assert m1["iteration"] == 1 and m2["iteration"] == 2 and m1["trajectories"] == 10
        assert m1["compression"] > 1.0 and np.isfinite(m2["loss"]) and m1["loss"] != m2["loss"]
        t.export_hf(str(tmp_path / "hf"))
        after = full_state_dict(t.model[0].module, t.config)
        assert any(not torch.equal(before[k], after[k]) for k in before)
        _, hf_state = load_hf_checkpoint(str(tmp_path / "hf"))
        back = hf_to_megatron(hf_state, t.config)
        assert set(back) <= set(after) and len(back) > 0
        for k, v in back.items():
            # transformers keeps dt_bias, the router weight and its bias in fp32 whatever the model dtype
            fp32 = any(k.endswith(n) for n in ("dt_bias", "router.weight", "router.expert_bias"))
            want = after[k].float().to(v.dtype) if fp32 else after[k]
            assert torch.equal(v, want), k
    tb = EventAccumulator(str(tmp_path / "tb"))
    tb.Reload()
    assert {"loss", "lr", "compression", "objective/pg_loss"} <= set(tb.Tags()["scalars"])
    assert [e.step for e in tb.Scalars("loss")] == [1, 2]
    lines = (tmp_path / "plan.jsonl").read_text().splitlines()
    assert len(lines) == 2 and '"kda_calls"' in lines[0]


def _parallel_worker(rank, world, port, data, out):
    from megatron_harts.training.trainer import Trainer
    _world(rank, world, port)
    runs = {}
    layouts = {"tp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
               # 20 trajectories a step: the within plan of step 1 leaves one replica an idle slot
               "ep2": ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
                       "--global-batch-size", "20"]}
    for name, par in layouts.items():
        for sharing in ("off", "within"):
            with Trainer.from_args(argv(data, sharing, "--train-iters", "2", *par), require_data=True) as t:
                steps = []
                for _ in range(2):
                    m = t.train_iteration()
                    steps.append((m, _params(t)))
                runs[(name, sharing)] = steps
    if rank == 0:
        torch.save(runs, out)


def test_tensor_sequence_and_expert_parallel_tree_equals_expanded(tmp_path):
    """TP=2 with sequence parallelism (microbatch rows padded to a multiple of 2) and EP=2 x DP=2
    (all-to-all dispatcher; idle slots run a placeholder so both replicas exchange tokens in lockstep):
    tree mode gives expanded mode's losses and full (gathered) parameters, step by step."""
    runs = spawn(_parallel_worker, tmp_path)
    assert_same_steps(runs[("tp2", "within")], runs[("tp2", "off")], "tp2: within vs off")
    assert_same_steps(runs[("ep2", "within")], runs[("ep2", "off")], "ep2: within vs off")
    assert runs[("tp2", "within")][0][0]["compression"] > 1.0


def _pieces_worker(rank, world, port, data, out):
    from megatron_harts.training.trainer import Trainer
    _world(rank, world, port)
    runs = {}
    for name, sharing, budget in (("ref", "off", "48"), ("off", "off", "16"), ("within", "within", "16"),
                                  ("windows", "windows", "16")):
        flags = argv(data, sharing)
        flags[flags.index("--tree-microbatch-tokens") + 1] = budget
        flags[flags.index("--train-iters") + 1] = "2"
        with Trainer.from_args(flags, require_data=True) as t:
            runs[name] = [(t.train_iteration(), _params(t)) for _ in range(2)]
    if rank == 0:
        torch.save(runs, out)


@pytest.mark.slow
def test_dp2_trajectories_longer_than_the_budget_train_in_pieces(tmp_path):
    """DP 2, a 16-row budget under trajectories of up to 43 tokens: every tree is cut into pieces (chains
    placed on both replicas), in every sharing mode the losses, objective terms, MoE load and the
    parameters after each step equal expanded training with a budget that holds every trajectory."""
    runs = spawn(_pieces_worker, tmp_path)
    ref = runs["ref"]
    for name in ("off", "within", "windows"):
        assert_same_steps(runs[name], ref, f"pieces ({name}) vs uncut expanded",
                          terms=("objective/pg_loss", "objective/kl", "objective/entropy",
                                 "moe_load_max_over_mean"))
    # not vacuous: expanded mode ran more (smaller) microbatches, tree modes still shared rows
    assert all(m["microbatches"] > m_ref["microbatches"] for (m, _), (m_ref, _) in zip(runs["off"], ref))
    assert all(m["computed_tokens"] == m_ref["computed_tokens"] for (m, _), (m_ref, _) in zip(runs["off"], ref))
    for name in ("within", "windows"):
        assert all(m["computed_tokens"] < m_ref["computed_tokens"] for (m, _), (m_ref, _) in zip(runs[name], ref))
