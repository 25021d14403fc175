"""The KDA and MLA cores (models/cores.py): spec slots that alone read the packed-sequence params.

``row_mode`` is the one decision of a mode; the cores are megatron-core spec slots
(``KDASubmodules.core``, ``MLASubmodules.core_attention``) that a spec can replace, and they hold no
parameters (the checkpoint and the transformers mapping do not change).
"""
import dataclasses

import pytest
import torch

from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_harts.models import KDACore, MLACoreAttention, row_mode
from megatron_harts.models.kda import KDASubmodules, KimiDeltaAttention
from megatron_harts.models.layer import hybrid_block_spec
from megatron_harts.models.mla import MLASubmodules, TreeMLA
from megatron_harts.models.model import HybridModel, build_hybrid_model
from megatron_harts.models.packed import TreePackedSeqParams

from hybrid_tiny import VOCAB, randomize_, tiny_config, tiny_forest, tree_inputs


def test_row_mode_of_each_kind_of_params():
    assert row_mode(None).kind == "batched" and not row_mode(None).tree
    seq = TreePackedSeqParams.for_sequences([3, 2])
    assert row_mode(seq).kind == "packed" and row_mode(seq).pad_rows == 0
    assert row_mode(seq.padded(3)).pad_rows == 3 and row_mode(seq.padded(3)).kind == "packed"
    lay, psp = tree_inputs(tiny_forest(0), tiny_config())
    m = row_mode(psp)
    assert (m.kind, m.tree, m.producer, m.consumer, m.pad_rows) == ("tree", True, False, False, 0)
    assert row_mode(psp.padded(2)).pad_rows == 2
    marker = object()           # the roles come from the params' export fields, one each
    assert row_mode(dataclasses.replace(psp, export_spec=marker)).producer
    assert not row_mode(dataclasses.replace(psp, export_spec=marker)).consumer
    assert row_mode(dataclasses.replace(psp, consumer_index=marker)).consumer


def test_default_spec_wires_the_cores_and_they_hold_no_parameters(cpu_world):
    assert KDASubmodules().core is KDACore and MLASubmodules().core_attention is MLACoreAttention
    model = build_hybrid_model(tiny_config(), vocab_size=VOCAB)
    kinds = []
    for layer in model.decoder.layers:
        att = layer.self_attention
        core = att.core if isinstance(att, KimiDeltaAttention) else att.core_attention
        kinds.append(type(core))
        assert not list(core.parameters()) and not list(core.buffers())
    assert kinds == [KDACore, MLACoreAttention, KDACore, MLACoreAttention]
    assert not any(".core." in n or ".core_attention." in n for n in model.state_dict())


class _RecordingKDACore(KDACore):
    calls = []

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        type(self).calls.append((self.layer_number, row_mode(args[6] if len(args) > 6 else
                                                             kwargs.get("packed_seq_params")).kind))
        return out


class _RecordingMLACore(MLACoreAttention):
    calls = []

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        type(self).calls.append((self.layer_number, row_mode(args[4] if len(args) > 4 else
                                                             kwargs.get("packed_seq_params")).kind))
        return out


def _with_recording_cores(cfg):
    spec = hybrid_block_spec(cfg)
    for layer in spec.layer_specs:
        att = layer.submodules.self_attention
        if att.module is KimiDeltaAttention:
            att.submodules = KDASubmodules(core=ModuleSpec(module=_RecordingKDACore))
        else:
            assert att.module is TreeMLA
            att.submodules = MLASubmodules(core_attention=_RecordingMLACore)
    return spec


def test_a_spec_replaces_the_cores_and_the_layers_call_them_in_every_mode(cpu_world):
    cfg = tiny_config()
    torch.manual_seed(0)
    ref = randomize_(build_hybrid_model(cfg, vocab_size=VOCAB), 3)
    model = HybridModel(config=cfg, transformer_layer_spec=_with_recording_cores(cfg), vocab_size=VOCAB,
                        max_sequence_length=1 << 20, position_embedding_type="none")
    model.load_state_dict(ref.state_dict())
    lay, psp = tree_inputs(tiny_forest(0), cfg)
    _RecordingKDACore.calls.clear()
    _RecordingMLACore.calls.clear()
    with torch.no_grad():
        got = model(lay.tokens[None], lay.position_ids[None], packed_seq_params=psp,
                    pair_row=lay.pair_row, pair_token=lay.pair_token)
        want = ref(lay.tokens[None], lay.position_ids[None], packed_seq_params=psp,
                   pair_row=lay.pair_row, pair_token=lay.pair_token)
        ids = lay.tokens[None, :5]
        model(ids, None, pair_row=None)                               # batched [1, 5]
    assert torch.equal(got, want)
    assert _RecordingKDACore.calls == [(1, "tree"), (3, "tree"), (1, "batched"), (3, "batched")]
    assert _RecordingMLACore.calls == [(2, "tree"), (4, "tree"), (2, "batched"), (4, "batched")]


@pytest.mark.parametrize("core", [KDACore, MLACoreAttention])
def test_tree_cores_refuse_batched_rows(cpu_world, core):
    cfg = tiny_config()
    lay, psp = tree_inputs(tiny_forest(0), cfg)
    n = 2 * int(lay.num_rows)
    if core is KDACore:
        c = KDACore(cfg, layer_number=1)
        args = (torch.zeros(n, 16), torch.zeros(n, 16), torch.zeros(n, 16), torch.zeros(n, 2, 8), torch.zeros(n, 2),
                (torch.zeros(16, 4),) * 3, psp)
    else:
        c = MLACoreAttention(cfg, layer_number=2, softmax_scale=1.0)
        args = (torch.zeros(n, 2, 12), torch.zeros(n, 16), torch.zeros(n, 1, 4), lambda a, b: (None, None), psp)
    with pytest.raises(ValueError, match="tree mode needs the rows as \\[R, 1, h\\], got b=2"):
        c(*args, shape=(int(lay.num_rows), 2))
