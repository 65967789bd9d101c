"""Loong's decoder family against Hugging Face transformers' own classes as the reference:
Qwen3, Qwen2, Llama (with llama3 rope scaling) and Mistral, random-init by transformers."""

import pytest
import torch

from loong_train.models.decoder import CausalLM, DecoderConfig


@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_transformers(tmp_path, tied):
    transformers = pytest.importorskip("transformers")
    cfg = DecoderConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=tied,
    )
    model = CausalLM(cfg)
    model.init_weights(seed=3, std=0.2)
    model.save_pretrained(tmp_path)
    reference = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, cfg.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(ids), reference(ids).logits
    assert ours.shape == theirs.shape == (3, 17, 97)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_save_and_load_round_trip(tmp_path):
    model = CausalLM(
        DecoderConfig(
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
    loaded = CausalLM.from_pretrained(tmp_path)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_loads_a_checkpoint_sharded_by_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    config = DecoderConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)  # fmt: skip
    model = CausalLM(config)
    model.init_weights(seed=2)
    model.save_pretrained(tmp_path / "one")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")  # the hub's layout for big models
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    loaded = CausalLM.from_pretrained(tmp_path / "sharded")
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


SHAPE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 500000.0}  # fmt: skip
FAMILIES = {
    "qwen3": ("Qwen3Config", {"head_dim": 16, "tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),
    "llama": ("LlamaConfig", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": False}),
    "mistral": ("MistralConfig", {"sliding_window": None, "head_dim": 16}),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_matches_transformers_and_exports_back_bit_exactly(tmp_path, family):
    transformers = pytest.importorskip("transformers")
    config_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, config_class)(**SHAPE, **extra)
    )
    with torch.no_grad():  # transformers initialises biases to 0: give them values, so they count
        for name, p in reference.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    reference.eval().save_pretrained(tmp_path / "hf")
    ours = CausalLM.from_pretrained(tmp_path / "hf")
    assert ours.config.model_type == family
    ids = torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(1))  # past the llama3 window
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), reference(ids).logits, rtol=1e-5, atol=1e-5)
    ours.save_pretrained(tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert type(back) is type(reference)
    theirs = reference.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in back.state_dict().items())


@pytest.mark.parametrize(
    ("config", "error"),
    [
        ({"model_type": "gpt2"}, r"model_type 'gpt2' is not one of the decoder families Loong implements"),
        (
            {**SHAPE, "model_type": "mistral", "sliding_window": 16},
            r"sliding-window attention is not implemented",
        ),
        (
            {**SHAPE, "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
            r"rope scaling 'yarn'",
        ),
    ],
)
def test_configs_it_cannot_run_are_refused_by_name(tmp_path, config, error):
    import json

    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=error):
        CausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"has no config\.json"):
        CausalLM.from_pretrained(tmp_path / "nowhere")


@pytest.mark.integration
def test_a_llama_checkpoint_trains_through_the_torch_backend_and_the_embedded_engine(tmp_path):
    """Three RL steps of a random-init tiny Llama (built by transformers, char tokenizer): the
    engine generates with it, the trainer trains it, and the final checkpoint loads back into
    transformers as a Llama."""
    import json

    transformers = pytest.importorskip("transformers")
    from loong_train.config import load_recipe
    from loong_train.controller import run
    from loong_train.models.tokenizer import load_tokenizer
    from loong_train.tiny.tokenizer import build_tokenizer

    ckpt = tmp_path / "llama"
    build_tokenizer(ckpt)
    shape = {**SHAPE, "vocab_size": len(load_tokenizer(ckpt))}
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**shape, tie_word_embeddings=True)
    ).save_pretrained(ckpt)
    sets = [f"model.path={ckpt}", "train.steps=3", "train.batch_groups=2", "rollout.group_size=2",
            "rollout.max_new_tokens=12", "rollout.max_model_tokens=24", "eval.every=3", "eval.num_tasks=4"]  # fmt: skip
    out = run(load_recipe("tiny-calc-agent", sets), tmp_path / "run", tmp_path / "cache")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["mismatch_kl"] < 1e-9
    final = transformers.AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "final")
    assert type(final).__name__ == "LlamaForCausalLM"


def _checkpoint(path, short=0):
    """A tiny Loong checkpoint with the char tokenizer: what a user's directory holds."""
    from loong_train.models.tokenizer import load_tokenizer
    from loong_train.tiny.tokenizer import build_tokenizer

    build_tokenizer(path)
    config = DecoderConfig(vocab_size=len(load_tokenizer(path)) - short, hidden_size=32, intermediate_size=48,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
    model = CausalLM(config)
    model.init_weights(seed=0)
    model.save_pretrained(path)
    return path


def _shard(path):
    import json

    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    weight_map = {n: f"model-0000{1 + i}-of-00002.safetensors" for i, n in enumerate(names)}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _remote(path):
    import json

    config = json.loads((path / "config.json").read_text())
    config |= {"model_type": "my_decoder", "auto_map": {"AutoModelForCausalLM": "modeling.MyDecoder"}}
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("break_it", "error"),
    [
        (lambda p: (p / "config.json").unlink(), r"no config\.json \(expected a Hugging Face checkpoint directory\)"),
        (lambda p: (p / "model.safetensors").unlink(), r"has no weights: expected model\.safetensors or model\.safetensors\.index\.json"),
        (_shard, r"model\.safetensors\.index\.json lists shards the directory lacks: model-00002-of-00002\.safetensors"),
        (_remote, r"model_type 'my_decoder' needs the checkpoint's own code \(auto_map \['AutoModelForCausalLM'\]\).*never runs"),
        (lambda p: (p / "tokenizer.json").unlink(), r"the tokenizer does not load"),
    ],
)  # fmt: skip
def test_a_checkpoint_the_workers_could_not_load_is_refused_naming_the_file(tmp_path, break_it, error):
    from loong_core.config import ConfigError
    from loong_train.models.checkpoint import check_checkpoint

    path = _checkpoint(tmp_path)
    assert check_checkpoint(path).vocab_size == 103  # 96 characters, 3 special and 4 tool tokens
    break_it(path)
    with pytest.raises(ConfigError, match=error):
        check_checkpoint(path)


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_before_any_work(tmp_path):
    import ray

    from loong_core.config import ConfigError
    from loong_train.config import load_recipe
    from loong_train.controller import run

    path = _checkpoint(tmp_path / "model", short=3)  # the char tokenizer has 103 tokens
    recipe = load_recipe("tiny-calc-agent", [f"model.path={path}"])
    with pytest.raises(
        ConfigError, match=r"the tokenizer has 103 tokens but config\.json's vocab_size is 100"
    ):
        run(recipe, tmp_path / "run", tmp_path / "cache")
    assert not ray.is_initialized() and not (tmp_path / "run").exists()
