"""Megatron-core -> Hugging Face conversion against an independent reference: Megatron shards
are assembled here row by row from Hugging Face tensors with explicit loops (the documented
megatron-core layout), then converted back; plus a hand-labelled fused-QKV example and a strict
load into transformers' Qwen3ForCausalLM."""

from __future__ import annotations

import pytest
import torch

from loong_transfermesh.layout import MegatronLayout, megatron_to_hf

torch.set_num_threads(1)

CONFIG = {
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_hidden_layers": 2,
    "vocab_size": 50,
    "tie_word_embeddings": False,
}


def _hf_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    c = CONFIG
    h, d, heads, kv, ffn = (
        c["hidden_size"],
        c["head_dim"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["intermediate_size"],
    )
    out = {"model.embed_tokens.weight": torch.randn(c["vocab_size"], h, generator=g)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": torch.randn(h, generator=g),
            p + "self_attn.q_proj.weight": torch.randn(heads * d, h, generator=g),
            p + "self_attn.k_proj.weight": torch.randn(kv * d, h, generator=g),
            p + "self_attn.v_proj.weight": torch.randn(kv * d, h, generator=g),
            p + "self_attn.q_norm.weight": torch.randn(d, generator=g),
            p + "self_attn.k_norm.weight": torch.randn(d, generator=g),
            p + "self_attn.o_proj.weight": torch.randn(h, heads * d, generator=g),
            p + "post_attention_layernorm.weight": torch.randn(h, generator=g),
            p + "mlp.gate_proj.weight": torch.randn(ffn, h, generator=g),
            p + "mlp.up_proj.weight": torch.randn(ffn, h, generator=g),
            p + "mlp.down_proj.weight": torch.randn(h, ffn, generator=g),
        }
    out["model.norm.weight"] = torch.randn(h, generator=g)
    out["lm_head.weight"] = torch.randn(c["vocab_size"], h, generator=g)
    return out


def _megatron_shards(hf: dict[str, torch.Tensor], tp: int, te_norms: bool) -> list[dict[str, torch.Tensor]]:
    """Reference: build each rank's megatron-core state dict row by row."""
    c = CONFIG
    d, heads, kv, ffn = (
        c["head_dim"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["intermediate_size"],
    )
    per_group, padded = heads // kv, -(-c["vocab_size"] // (128 * tp)) * 128 * tp
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]

    def pad_vocab(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, torch.full((padded - t.shape[0], t.shape[1]), 7.0)])

    for r in range(tp):
        s = shards[r]
        rows = padded // tp
        s["embedding.word_embeddings.weight"] = pad_vocab(hf["model.embed_tokens.weight"])[
            r * rows : (r + 1) * rows
        ]
        for i in range(c["num_hidden_layers"]):
            p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
            q, k, v = (hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
            fused = []
            for group in range(r * kv // tp, (r + 1) * kv // tp):
                for head in range(group * per_group, (group + 1) * per_group):
                    fused += [q[head * d + j] for j in range(d)]
                fused += [k[group * d + j] for j in range(d)]
                fused += [v[group * d + j] for j in range(d)]
            s[m + "self_attention.linear_qkv.weight"] = torch.stack(fused)
            norm_in = "self_attention.linear_qkv.layer_norm_weight" if te_norms else "input_layernorm.weight"
            norm_mlp = "mlp.linear_fc1.layer_norm_weight" if te_norms else "pre_mlp_layernorm.weight"
            s[m + norm_in] = hf[p + "input_layernorm.weight"]
            s[m + "self_attention.q_layernorm.weight"] = hf[p + "self_attn.q_norm.weight"]
            s[m + "self_attention.k_layernorm.weight"] = hf[p + "self_attn.k_norm.weight"]
            cols = heads * d // tp
            s[m + "self_attention.linear_proj.weight"] = hf[p + "self_attn.o_proj.weight"][
                :, r * cols : (r + 1) * cols
            ]
            s[m + norm_mlp] = hf[p + "post_attention_layernorm.weight"]
            f = ffn // tp
            gate, up = hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]
            s[m + "mlp.linear_fc1.weight"] = torch.cat([gate[r * f : (r + 1) * f], up[r * f : (r + 1) * f]])
            s[m + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"][:, r * f : (r + 1) * f]
            s[m + "self_attention.linear_proj._extra_state"] = torch.empty(0)
        s["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        s["output_layer.weight"] = pad_vocab(hf["lm_head.weight"])[r * rows : (r + 1) * rows]
    return shards


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("te_norms", [True, False])
def test_converts_tp_shards_back_to_hugging_face_exactly(tp: int, te_norms: bool) -> None:
    hf = _hf_state()
    got = dict(
        megatron_to_hf(_megatron_shards(hf, tp, te_norms), MegatronLayout.from_hf_config(CONFIG, tp=tp))
    )
    assert sorted(got) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(got[name], tensor), name


def test_hand_labelled_fused_qkv() -> None:
    """4 heads, 2 groups, head_dim 1, hidden 1: rows q0 q1 k0 v0 | q2 q3 k1 v1 (tp=2: one group each)."""
    labels = {"q0": 10, "q1": 11, "k0": 20, "v0": 30, "q2": 12, "q3": 13, "k1": 21, "v1": 31}
    order = ["q0", "q1", "k0", "v0", "q2", "q3", "k1", "v1"]
    fused = torch.tensor([[float(labels[x])] for x in order])
    layout = MegatronLayout(num_attention_heads=4, num_query_groups=2, head_dim=1, vocab_size=1, tp=2)
    shards = [
        {"decoder.layers.0.self_attention.linear_qkv.weight": fused[:4]},
        {"decoder.layers.0.self_attention.linear_qkv.weight": fused[4:]},
    ]
    got = dict(megatron_to_hf(shards, layout, layer_offset=5))
    assert got["model.layers.5.self_attn.q_proj.weight"].flatten().tolist() == [10, 11, 12, 13]
    assert got["model.layers.5.self_attn.k_proj.weight"].flatten().tolist() == [20, 21]
    assert got["model.layers.5.self_attn.v_proj.weight"].flatten().tolist() == [30, 31]


def test_the_result_loads_strictly_into_transformers_qwen3() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(**CONFIG, rms_norm_eps=1e-6)
    model = transformers.Qwen3ForCausalLM(config)
    hf = {k: v.clone() for k, v in model.state_dict().items()}
    converted = dict(
        megatron_to_hf(_megatron_shards(hf, 2, True), MegatronLayout.from_hf_config(CONFIG, tp=2))
    )
    model.load_state_dict(converted, strict=True)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, hf[name]), name


def test_unknown_tensors_and_bad_layouts_are_named() -> None:
    layout = MegatronLayout.from_hf_config(CONFIG)
    with pytest.raises(
        ValueError, match=r"no Hugging Face name for megatron tensor 'decoder\.layers\.0\.mystery'"
    ):
        list(megatron_to_hf([{"decoder.layers.0.mystery": torch.zeros(1)}], layout))
    with pytest.raises(ValueError, match="expected 1 tensor-parallel shards, got 2"):
        list(megatron_to_hf([{}, {}], layout))
    with pytest.raises(ValueError, match="groups % tp == 0"):
        MegatronLayout.from_hf_config(CONFIG, tp=4)
