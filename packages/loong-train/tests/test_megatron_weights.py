"""Megatron weight conversion: HF -> megatron shards round-trip through ``megatron_to_hf`` (TP 1/2,
pipeline stages, tied and untied embeddings, a vocabulary that needs padding)."""

from __future__ import annotations

import pytest
import torch
from megatron_testkit import FAMILIES, tiny_model

from loong_train.backends.megatron.weights import hf_to_megatron
from loong_transfermesh import MegatronLayout, megatron_to_hf


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("tied", [True, False])
def test_hf_to_megatron_round_trips_through_megatron_to_hf(tp, pp, tied, family):
    model = tiny_model(tied, layers=4, family=family)
    hf = model.hf_state_dict()
    layout = MegatronLayout.from_hf_config(model.config.to_hf(), tp=tp)
    padded, per_stage, back = 38 if tp == 2 else 37, 4 // pp, {}
    for stage in range(pp):
        shards = [
            hf_to_megatron(
                hf,
                layout,
                tp_rank=r,
                first_layer=stage * per_stage,
                num_layers=per_stage,
                pre_process=stage == 0,
                post_process=stage == pp - 1,
                padded_vocab=padded,
            )
            for r in range(tp)
        ]
        assert {s["decoder.layers.0.self_attention.linear_qkv.weight"].shape[0] for s in shards} == {
            (4 // 2 + 2) * 16 * 2 // tp
        }
        back |= dict(megatron_to_hf(shards, layout, layer_offset=stage * per_stage))
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
