"""tools/convert_hf_checkpoint.py: transformers Kimi-Linear <-> Megatron checkpoints (torch TP shards, dist).

A tiny random KimiLinearForCausalLM is built from a config and saved with save_pretrained
(sharded, original Kimi naming on disk); no hub access.
"""
import glob
import json
import os

import pytest
import torch
import torch.distributed as dist

import megatron_harts.patches as patches
from megatron_harts.models.hf_convert import kimi_linear_hf_config, shard_full_state
from megatron_harts.models.model import build_hybrid_model

from hybrid_tiny import VOCAB, tiny_config
from megatron_cpu import free_port, megatron_cpu
from multiproc import run_ranks
from tool_runner import assert_one_error, load_tool, run_tool

transformers = pytest.importorskip("transformers")


TOOL = load_tool("convert_hf_checkpoint")


def convert(capsys, *argv):
    """Run the tool as its __main__ does; returns (exit status, stdout, stderr)."""
    return run_tool(TOOL, capsys, *argv)


# transformers' MLA latent norms (q_a_layernorm, kv_a_layernorm) always use eps 1e-6, ours use
# layernorm_epsilon: equal models need rms_norm_eps = 1e-6 until the MLA module takes that eps
# (test_mla_latent_norm_eps_differs_from_transformers pins the difference)
EPS = 1e-6


def _cfg(eps=EPS):
    return tiny_config(dtype=torch.float32, q_lora_rank=12, layernorm_epsilon=eps)


def _save_hf(d, eps=EPS, dtype=torch.float32):
    torch.manual_seed(0)
    model = transformers.KimiLinearForCausalLM(kimi_linear_hf_config(_cfg(eps), VOCAB)).float()
    with torch.no_grad():       # non-trivial norms and expert biases (init leaves them 1 / 0)
        for n, p in model.named_parameters():
            if "norm" in n or "A_log" in n or "dt_bias" in n:
                p.add_(0.1 * torch.randn_like(p))
        for n, b in model.named_buffers():
            if "e_score_correction_bias" in n:
                b.copy_(0.05 * torch.randn_like(b))
    model.to(dtype).save_pretrained(d, max_shard_size="40KB")
    return d


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = _save_hf(tmp_path_factory.mktemp("hf") / "kimi")
    assert os.path.isfile(d / "model.safetensors.index.json")       # sharded on disk
    return d


def _safetensors(d):
    from safetensors.torch import load_file
    out = {}
    for f in glob.glob(os.path.join(d, "*.safetensors")):
        out.update(load_file(f))
    return out


def _assert_same_checkpoint(a, b):
    sa, sb = _safetensors(a), _safetensors(b)
    assert set(sa) == set(sb) and len(sa) > 50
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    with open(os.path.join(a, "config.json")) as fa, open(os.path.join(b, "config.json")) as fb:
        assert json.load(fa) == json.load(fb)


def _shard_worker(rank, world, port, ckpt, out_dir):
    """A real TP=2 model: the converter's rank file equals shard_full_state of the TP=1 state, and loads strictly."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    patches.apply()
    try:
        with megatron_cpu(tp=2, init_world=False):
            cfg = tiny_config(dtype=torch.float32, q_lora_rank=12, tensor_model_parallel_size=2,
                              sequence_parallel=True)
            model = build_hybrid_model(cfg, vocab_size=VOCAB)
            full = torch.load(os.path.join(ckpt["tp1"], "release", "mp_rank_00", "model_optim_rng.pt"))["model"]
            mine = torch.load(os.path.join(ckpt["tp2"], "release", f"mp_rank_{rank:02d}", "model_optim_rng.pt"))
            expect = shard_full_state({k: v for k, v in full.items() if v is not None}, model, cfg, tp_rank=rank,
                                      tp_size=2)
            got = {k: v for k, v in mine["model"].items() if v is not None}
            result = {"same_keys": set(got) == set(expect), "n": len(got),
                      "equal": all(torch.equal(got[k], expect[k]) for k in expect),
                      "split": sum(got[k].shape != full[k].shape for k in got), "tp_size": mine["tp_size"]}
            model.load_state_dict(mine["model"], strict=True)
            torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        patches.undo()
        dist.destroy_process_group()


def test_round_trip_bitwise_and_tp2_shards(hf_dir, tmp_path, capsys):
    tp1, tp2 = tmp_path / "mg1", tmp_path / "mg2"
    code, out, err = convert(capsys, "--direction", "hf-to-megatron", "--input", hf_dir, "--output", tp1, "--json")
    assert code == 0, err
    assert json.loads(out)["tp"] == 1
    assert convert(capsys, "--direction", "hf-to-megatron", "--input", hf_dir, "--output", tp2, "--tp", 2)[0] == 0
    assert sorted(os.listdir(tp2 / "release")) == ["mp_rank_00", "mp_rank_01"]
    assert (tp2 / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    for src, back in ((tp1, tmp_path / "back1"), (tp2, tmp_path / "back2")):
        code, _, err = convert(capsys, "--direction", "megatron-to-hf", "--input", src, "--output", back)
        assert code == 0, err
        _assert_same_checkpoint(hf_dir, back)
    run_ranks(_shard_worker, 2, (free_port(), {"tp1": str(tp1), "tp2": str(tp2)}, str(tmp_path)))
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert r["same_keys"] and r["equal"] and r["tp_size"] == 2, r
        assert r["split"] > 40                # most tensors really are split over the two ranks


def test_dist_checkpoint_round_trip(hf_dir, tmp_path, capsys):
    pytest.importorskip("psutil")           # megatron-core's dist-checkpoint writer needs it
    code, _, err = convert(capsys, "--direction", "hf-to-megatron", "--input", hf_dir, "--output",
                           tmp_path / "dist", "--format", "dist")
    assert code == 0, err
    assert os.path.isfile(tmp_path / "dist" / "release" / "metadata.json")
    code, _, err = convert(capsys, "--direction", "megatron-to-hf", "--input", tmp_path / "dist", "--output",
                           tmp_path / "back")
    assert code == 0, err
    _assert_same_checkpoint(hf_dir, tmp_path / "back")


def test_bf16_round_trip_keeps_stored_dtypes(tmp_path, capsys):
    """transformers loads some modules upcast to fp32 (dt_bias, router): the stored bf16 comes back."""
    src = _save_hf(tmp_path / "bf16", dtype=torch.bfloat16)
    assert {v.dtype for v in _safetensors(src).values()} == {torch.bfloat16}
    assert convert(capsys, "--direction", "hf-to-megatron", "--input", src, "--output", tmp_path / "mg", "--tp", 2)[0] == 0
    shard = torch.load(tmp_path / "mg" / "release" / "mp_rank_01" / "model_optim_rng.pt")["model"]
    assert {v.dtype for v in shard.values() if v is not None} == {torch.bfloat16}
    assert convert(capsys, "--direction", "megatron-to-hf", "--input", tmp_path / "mg", "--output", tmp_path / "b")[0] == 0
    _assert_same_checkpoint(src, tmp_path / "b")


def _converted_vs_transformers(hf_dir, tmp_path, capsys, eps=EPS):
    assert convert(capsys, "--direction", "hf-to-megatron", "--input", hf_dir, "--output", tmp_path / "mg")[0] == 0
    sd = torch.load(tmp_path / "mg" / "release" / "mp_rank_00" / "model_optim_rng.pt")["model"]
    hf = transformers.KimiLinearForCausalLM.from_pretrained(hf_dir).float().eval()
    tokens = torch.tensor([[3, 17, 5, 29, 0, 8, 8, 21, 14, 2, 30, 11]])
    patches.apply()
    try:
        with megatron_cpu():
            model = build_hybrid_model(_cfg(eps), vocab_size=VOCAB).eval()
            model.load_state_dict(sd, strict=True)
            with torch.no_grad():
                ours = model(tokens, torch.arange(12)[None])[:, 0].log_softmax(-1)     # [s, V]
                ref = hf(tokens).logits[0].log_softmax(-1)
    finally:
        patches.undo()
    assert float(ref.std()) > 0.01
    return ours, ref


def test_converted_state_gives_transformers_logprobs(hf_dir, tmp_path, capsys):
    ours, ref = _converted_vs_transformers(hf_dir, tmp_path, capsys)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_mla_latent_norm_eps_matches_transformers(tmp_path, capsys):
    """Kimi-Linear normalizes the MLA q/kv latents with eps 1e-6 whatever rms_norm_eps is; so do we."""
    d = _save_hf(tmp_path / "kimi_eps5", eps=1e-5)
    ours, ref = _converted_vs_transformers(d, tmp_path, capsys, eps=1e-5)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_bad_input_one_error_no_output(hf_dir, tmp_path, capsys):
    import shutil
    out = tmp_path / "out"
    args = ["--direction", "hf-to-megatron", "--output", out]
    assert_one_error(*convert(capsys, *args, "--input", tmp_path / "nope")[::2], "nope")
    assert_one_error(*convert(capsys, *args, "--input", hf_dir, "--tp", 4)[::2], "--tp 4", "num_attention_heads")
    assert_one_error(*convert(capsys, *args, "--input", hf_dir, "--tp", 3)[::2], "--tp")
    assert_one_error(*convert(capsys, *args, "--input", hf_dir, "--format", "zarr")[::2], "--format")
    other = tmp_path / "other"
    shutil.copytree(hf_dir, other)
    raw = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**raw, "model_type": "llama"}))
    assert_one_error(*convert(capsys, *args, "--input", other)[::2], "config.json", "model_type")
    (other / "config.json").write_text(json.dumps({**raw, "intermediate_size": 64}))
    assert_one_error(*convert(capsys, *args, "--input", other)[::2], str(other), "mlp")
    (other / "config.json").write_text(json.dumps(raw))
    for f in glob.glob(str(other / "*.safetensors")):
        os.remove(f)
    os.remove(other / "model.safetensors.index.json")
    assert_one_error(*convert(capsys, *args, "--input", other)[::2], "model.safetensors")
    assert_one_error(*convert(capsys, "--direction", "megatron-to-hf", "--input", hf_dir, "--output", out)[::2],
               "latest_checkpointed_iteration.txt")
    assert sorted(os.listdir(tmp_path)) == ["other"]         # no output, no temporary directory left
