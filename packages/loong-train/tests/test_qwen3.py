"""Loong's Qwen3 against Hugging Face transformers' Qwen3ForCausalLM as the reference."""

import pytest
import torch

from loong_train.models.qwen3 import Qwen3Config, Qwen3ForCausalLM


@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_transformers(tmp_path, tied):
    transformers = pytest.importorskip("transformers")
    cfg = Qwen3Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=tied,
    )
    model = Qwen3ForCausalLM(cfg)
    model.init_weights(seed=3, std=0.2)
    model.save_pretrained(tmp_path)
    reference = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, cfg.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(ids), reference(ids).logits
    assert ours.shape == theirs.shape == (3, 17, 97)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_save_and_load_round_trip(tmp_path):
    model = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=50,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        )
    )
    model.init_weights(seed=1)
    model.save_pretrained(tmp_path)
    loaded = Qwen3ForCausalLM.from_pretrained(tmp_path)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_loads_a_checkpoint_sharded_by_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    config = Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)  # fmt: skip
    model = Qwen3ForCausalLM(config)
    model.init_weights(seed=2)
    model.save_pretrained(tmp_path / "one")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")  # the hub's layout for big models
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    loaded = Qwen3ForCausalLM.from_pretrained(tmp_path / "sharded")
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_rejects_non_qwen3_config(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="expected a Qwen3 config"):
        Qwen3ForCausalLM.from_pretrained(tmp_path)
