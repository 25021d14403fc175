"""Tensor parallelism with sequence parallelism (TP=2, SP) and expert parallelism (EP=2): two gloo
processes each; tree and expanded mode against the single-process model with the same weights."""
import os

import pytest
import torch
import torch.distributed as dist

import megatron_harts.patches as patches
from megatron_harts.models.hf_convert import shard_full_state
from megatron_harts.models.model import build_hybrid_model

from hybrid_tiny import VOCAB, expanded_inputs, randomize_, tiny_config, tiny_forest, tree_inputs
from megatron_cpu import free_port, megatron_cpu
from multiproc import run_ranks

FOREST = dict(seed=0, n=4)      # 34 compact rows, 54 expanded tokens: both even (SP splits rows over 2 ranks)
# (tp, ep, sequence parallel, model kind): MoE + TP needs SP in megatron; a dense model runs TP without SP
SETUPS = [(2, 1, True, "moe"), (1, 2, False, "moe"), (2, 1, False, "dense")]


def _config(kind, **kw):
    if kind == "dense":
        return tiny_config(mlp_types=["dense"] * 4, **kw)
    return tiny_config(**kw)


def _forward_backward(model, cfg, tree: bool, tp_group=None):
    from megatron.core.transformer.moe.moe_utils import (clear_aux_losses_tracker,
                                                         get_moe_layer_wise_logging_tracker)
    forest = tiny_forest(**FOREST)
    lay, psp = tree_inputs(forest, cfg)
    ids, pos, epsp, erows, etok, _ = expanded_inputs(lay, forest)
    clear_aux_losses_tracker()
    model.zero_grad(set_to_none=True)
    if tree:
        lp = model(lay.tokens[None], lay.position_ids[None], packed_seq_params=psp, pair_row=lay.pair_row,
                   pair_token=lay.pair_token)[lay.target_pair]
    else:
        lp = model(ids, pos, packed_seq_params=epsp, pair_row=erows, pair_token=etok)
    coeffs = torch.randn(lp.shape[0], generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    (coeffs * lp).sum().backward()
    if tp_group is not None and cfg.sequence_parallel:
        # what megatron's finalize_model_grads does for sequence-parallel (replicated) weights
        for p in model.parameters():
            if p.grad is not None and getattr(p, "sequence_parallel", False):
                dist.all_reduce(p.grad, group=tp_group)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    tracker = get_moe_layer_wise_logging_tracker()
    aux = tracker["load_balancing_loss"]["values"].clone() if "load_balancing_loss" in tracker else torch.zeros(1)
    routers = [l.mlp.router for l in model.decoder.layers if l.is_moe_layer]
    tpe = torch.stack([r.last_tokens_per_expert for r in routers]) if routers else torch.zeros(1)
    if tp_group is not None and cfg.sequence_parallel:
        # under SP each rank routes its slice of the rows: per-rank aux losses and counts add up
        # (megatron's tracker reduces them over the tp_cp group when it logs)
        dist.all_reduce(aux, group=tp_group)
        dist.all_reduce(tpe, group=tp_group)
    return {"lp": lp.detach(), "grads": grads, "aux": aux, "tpe": tpe}


def _worker(rank, world, port, setups, ref_path, out_dir):
    """One gloo process: for each setup of SETUPS, megatron's groups, the sharded model, both modes."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ref = torch.load(ref_path, weights_only=False)
    try:
        from megatron.core import parallel_state as ps
        patches.apply()
        for tp, ep, sp, kind in setups:
            with megatron_cpu(tp=tp, ep=ep, init_world=False):
                cfg = _config(kind, tensor_model_parallel_size=tp, sequence_parallel=sp, expert_model_parallel_size=ep)
                model = build_hybrid_model(cfg, vocab_size=VOCAB)
                ranks = dict(tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp,
                             ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ep)
                if tp > 1:
                    # distributed checkpoints see the head-sharded KDA tensors as slices of the full ones
                    sd = model.decoder.layers[0].self_attention.sharded_state_dict(prefix="a.")
                    h_local = cfg.linear_num_heads // tp
                    assert sd["a.A_log"].global_shape == (1, 1, cfg.linear_num_heads, 1)
                    assert sd["a.A_log"].global_offset == (0, 0, ranks["tp_rank"] * h_local, 0)
                    assert sd["a.conv_k_weight"].global_offset[0] == ranks["tp_rank"] * h_local * cfg.linear_head_dim
                    assert sd["a.linear_f_a.weight"].global_offset == (0, 0)      # replicated
                ref_k = ref[kind]
                local = shard_full_state(ref_k["state"], model, cfg, **ranks)
                tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
                assert {n for n, _ in model.named_parameters()} <= set(local)
                with torch.no_grad():
                    for n, v in local.items():
                        tensors[n].copy_(v)
                result = {}
                for mode in ("tree", "expanded"):
                    got = _forward_backward(model, cfg, mode == "tree", ps.get_tensor_model_parallel_group())
                    want = ref_k[mode]
                    expect = shard_full_state(want["grads"], model, cfg, **ranks)
                    rel = {}
                    for n, g in got["grads"].items():
                        e = expect[n] * (ep if ".local_experts." in n else 1)   # EP ranks hold the same batch here
                        rel[n] = float((g - e).abs().max() / e.abs().max().clamp_min(1e-300))
                    result[mode] = {"lp": float((got["lp"] - want["lp"]).abs().max()),
                                    "aux": float((got["aux"] - want["aux"]).abs().max()),
                                    "tpe": float((got["tpe"] - want["tpe"]).abs().max()),
                                    "grad_rel": rel, "num_grads": len(got["grads"])}
                torch.save(result, os.path.join(out_dir, f"tp{tp}_ep{ep}_{kind}_rank{rank}.pt"))
    finally:
        patches.undo()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process fp64 results (TP = EP = 1) and the full weights, saved for the workers."""
    path = tmp_path_factory.mktemp("ref") / "ref.pt"
    patches.apply()
    try:
        with megatron_cpu():
            ref = {}
            for kind in ("moe", "dense"):
                cfg = _config(kind)
                model = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 5)
                state = {n: t.detach().clone() for n, t in
                         {**dict(model.named_parameters()), **dict(model.named_buffers())}.items()}
                ref[kind] = {"state": state, "tree": _forward_backward(model, cfg, True),
                             "expanded": _forward_backward(model, cfg, False)}
            torch.save(ref, path)
    finally:
        patches.undo()
    return path


def test_parallel_equals_single_process(reference, tmp_path):
    """In the same two processes: TP=2 with SP (all-gather dispatcher, expert TP=2), EP=2, and a
    dense model with TP=2 without SP (the copy-to-TP-region path of the attention modules)."""
    run_ranks(_worker, 2, (free_port(), SETUPS, str(reference), str(tmp_path)), timeout=300)
    for tp, ep, sp, kind in SETUPS:
        for rank in range(2):
            res = torch.load(tmp_path / f"tp{tp}_ep{ep}_{kind}_rank{rank}.pt", weights_only=False)
            for mode in ("tree", "expanded"):
                r = res[mode]
                assert r["num_grads"] > (80 if kind == "moe" else 40)
                assert r["lp"] < 1e-11, (tp, ep, rank, mode, r["lp"])
                assert r["aux"] < 1e-11 and r["tpe"] == 0, (tp, ep, rank, mode, r["aux"], r["tpe"])
                worst = max(r["grad_rel"].items(), key=lambda kv: kv[1])
                assert worst[1] < 1e-10, (tp, ep, rank, mode, worst)
                print(f"{tp=} {ep=} {sp=} {kind} rank {rank} {mode}: log-prob max abs diff {r['lp']:.1e}, worst gradient "
                      f"relative diff {worst[1]:.1e} ({worst[0]})")
