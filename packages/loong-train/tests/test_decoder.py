"""Loong's decoder family against Hugging Face transformers' own classes as the reference:
Qwen3, Qwen2, Llama (with llama3 rope scaling) and Mistral, random-init by transformers; and the
choice between it and the generic path (any other ``transformers`` model)."""

import re

import pytest
import torch
from train_testkit import GENERIC, tiny_hf_checkpoint

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


def test_the_generic_path_trains_on_the_gradients_transformers_computes(tmp_path):
    """One policy-gradient step of the torch backend on a GPT-2: the gradient of every parameter
    equals the one autograd gives through the transformers model itself for the hand-written
    on-policy loss -sum(adv * log p(token)) / tokens (ratio 1, nothing clipped)."""
    from loong_core.records import TrainBatch
    from loong_train.backends.torch_backend import TorchBackend
    from loong_train.models.auto import load_causal_lm

    reference = tiny_hf_checkpoint(tmp_path, "gpt2", std=0.02, vocab_size=37)  # eval: no dropout
    ids = torch.randint(0, 37, (2, 6), generator=torch.Generator().manual_seed(3))
    adv = torch.tensor([[0.0, 0.7, 0.7, 0.7, 0.7, 0.0], [0.0, -1.3, -1.3, -1.3, 0.0, 0.0]])
    mask = (adv != 0).float()
    logp = torch.log_softmax(reference(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    logp = torch.cat([torch.zeros(2, 1), logp], 1)
    (-(adv * logp * mask).sum() / mask.sum()).backward()
    behaviour = (logp * mask).detach()
    batch = TrainBatch(
        token_ids=ids.flatten().tolist(),
        loss_mask=mask.flatten().int().tolist(),
        advantages=adv.flatten().tolist(),
        behaviour_logprobs=behaviour.flatten().tolist(),
        versions=[0] * 12,
        row_lens=[6, 6],
        sample_ids=["a", "b"],
        policy_version=0,
    )
    backend = TorchBackend(load_causal_lm(tmp_path), lr=1e-3, grad_clip=1e9)
    backend.train_step(batch)
    theirs = dict(reference.named_parameters())
    for name, p in backend.model.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-4, atol=1e-7, msg=name)


def test_a_generic_model_with_the_megatron_backend_is_refused_naming_both(tmp_path):
    from loong_core.config import ConfigError
    from loong_train.config import load_recipe
    from loong_train.controller import run
    from loong_train.tiny.tokenizer import build_tokenizer

    build_tokenizer(tmp_path / "gpt2")
    tiny_hf_checkpoint(tmp_path / "gpt2", "gpt2", vocab_size=103)
    recipe = load_recipe(
        "tiny-calc-agent", [f"model.path={tmp_path / 'gpt2'}", 'train.backend.type="megatron"']
    )
    with pytest.raises(
        ConfigError, match=r"train\.backend\.type = 'megatron' .* model\.path .* generic path"
    ):
        run(recipe, tmp_path / "run", tmp_path / "cache")


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
        (_remote, r"model_type 'my_decoder' needs the checkpoint's own code \(auto_map \['AutoModelForCausalLM'\]\); set \[model\] trust_remote_code = true"),
        (lambda p: (p / "tokenizer.json").unlink(), r"the tokenizer does not load"),
    ],
)  # fmt: skip
def test_a_checkpoint_the_workers_could_not_load_is_refused_naming_the_file(tmp_path, break_it, error):
    from loong_core.config import ConfigError
    from loong_train.models.checkpoint import check_checkpoint

    path = _checkpoint(tmp_path)
    assert check_checkpoint(path).path == "fast"
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


@pytest.mark.parametrize(
    ("config", "path", "reason"),
    [
        ({**SHAPE, "model_type": "qwen3"}, "fast", r"model_type 'qwen3': Loong's decoder family"),
        ({**SHAPE, "model_type": "gpt2"}, "generic", r"'gpt2' is not one of Loong's decoder families"),
        (
            {**SHAPE, "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
            "generic",
            r"a feature Loong's decoder lacks \(rope scaling 'yarn'",
        ),
        (
            {**SHAPE, "model_type": "my_lm", "auto_map": {"AutoModelForCausalLM": "m.M"}},
            "generic",
            r"own code",
        ),
    ],
)
def test_each_checkpoint_takes_the_path_its_config_calls_for_and_says_why(config, path, reason):
    from loong_train.models.auto import choose

    choice = choose(config, trust_remote_code=True)
    assert choice.path == path
    assert re.search(reason, choice.reason), choice.reason


@pytest.mark.parametrize(
    ("config", "error"),
    [
        ({"model_type": "my_lm", "auto_map": {"AutoModelForCausalLM": "m.M"}}, r"set \[model\] trust_remote_code = true"),
        ({"model_type": "not_a_model"}, r"'not_a_model' is neither one of Loong's decoder families .* nor a model transformers knows"),
        ({**SHAPE, "model_type": "mistral", "sliding_window": 16}, r"sliding_window = 16 < max_position_embeddings"),
        ({**SHAPE, "model_type": "gemma2", "layer_types": ["sliding_attention", "full_attention"]}, r"layer_types \['sliding_attention'\]"),
    ],
)  # fmt: skip
def test_a_model_neither_path_can_run_is_refused_naming_the_setting(config, error):
    from loong_train.models.auto import choose

    with pytest.raises(ValueError, match=error):
        choose(config)


@pytest.mark.parametrize("family", list(GENERIC))
def test_a_model_only_transformers_implements_runs_and_exports_back_bit_exactly(tmp_path, family):
    """The generic path: the model ``transformers`` builds (dropout and all) computes the logits,
    in eval mode and in train mode (dropout is off, so they are equal), and the export is the
    same class with the same config and bit-identical weights."""
    import json

    import transformers

    from loong_train.models.auto import load_causal_lm
    from loong_train.models.generic import HFCausalLM

    reference = tiny_hf_checkpoint(tmp_path / "hf", family, vocab_size=101)
    ours = load_causal_lm(tmp_path / "hf")
    assert isinstance(ours, HFCausalLM) and ours.config.model_type == family
    ids = torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(ids).logits
        torch.testing.assert_close(ours.train()(ids), want, rtol=0, atol=0)
    ours.save_pretrained(tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert type(back) is type(reference)
    theirs = reference.state_dict()
    assert back.state_dict().keys() == theirs.keys()
    assert all(torch.equal(v, theirs[k]) for k, v in back.state_dict().items())
    saved, original = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("ours", "hf"))
    assert {k: saved[k] for k in original if "drop" in k} == {
        k: v for k, v in original.items() if "drop" in k
    }
    assert not (tmp_path / "ours" / "generation_config.json").exists()


def test_remote_code_runs_only_with_the_switch(tmp_path):
    """A checkpoint that ships its own modeling file (``auto_map``): refused before any work
    without ``trust_remote_code``, loaded with it; the code here subclasses Llama, so the logits
    must equal that Llama's."""
    import json

    import transformers

    from loong_core.config import ConfigError
    from loong_train.models.auto import load_causal_lm
    from loong_train.models.checkpoint import check_checkpoint
    from loong_train.tiny.tokenizer import build_tokenizer

    path = tmp_path / "remote"
    build_tokenizer(path)
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SHAPE, "vocab_size": 103})).eval()
    llama.save_pretrained(path)
    (path / "modeling_tiny.py").write_text(
        "from transformers import LlamaConfig, LlamaForCausalLM\n\n\n"
        "class TinyConfig(LlamaConfig):\n    model_type = 'tiny_remote'\n\n\n"
        "class TinyForCausalLM(LlamaForCausalLM):\n    config_class = TinyConfig\n"
    )
    config = json.loads((path / "config.json").read_text())
    config |= {"model_type": "tiny_remote", "architectures": ["TinyForCausalLM"], "auto_map": {
        "AutoConfig": "modeling_tiny.TinyConfig", "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"}}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"set \[model\] trust_remote_code = true"):
        check_checkpoint(path)
    assert check_checkpoint(path, trust_remote_code=True).path == "generic"
    ours = load_causal_lm(path, trust_remote_code=True)
    assert type(ours.inner).__name__ == "TinyForCausalLM"
    ids = torch.randint(0, 103, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), llama(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama", "mistral", "gpt2", "phi"])
def test_the_engine_samples_each_familys_transformers_logprobs(tmp_path, family):
    """Whatever path a family takes, the embedded engine's logprobs (left-padded batch, rows
    joining mid-batch, a pause and resume in between) equal those of ``transformers``' own model
    run on each finished sequence alone."""
    import asyncio

    import transformers

    from loong_core.protocols import SamplingParams
    from loong_train.engines.embedded.engine import EmbeddedEngine
    from loong_train.models.auto import load_causal_lm

    if family in FAMILIES:
        config_class, extra = FAMILIES[family]
        torch.manual_seed(0)
        reference = transformers.AutoModelForCausalLM.from_config(
            getattr(transformers, config_class)(**SHAPE, **extra)
        )
        with torch.no_grad():
            for p in reference.parameters():
                p.normal_(0, 0.3)
        reference.eval().save_pretrained(tmp_path)
    else:
        reference = tiny_hf_checkpoint(tmp_path, family, vocab_size=SHAPE["vocab_size"])
    engine = EmbeddedEngine(load_causal_lm(tmp_path), seed=0, max_batch=3)
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [9, 9, 2, 7], [3, 1]]
    sampling = SamplingParams(max_new_tokens=40)

    async def run():
        first = [asyncio.create_task(engine.generate(p, sampling)) for p in prompts[:3]]
        while engine.stats.steps < 5:
            await asyncio.sleep(0)
        engine.pause()
        await engine.wait_idle()
        later = [asyncio.create_task(engine.generate(p, sampling)) for p in prompts[3:]]  # join on resume
        await asyncio.sleep(0.01)
        engine.resume()
        return await asyncio.gather(*first, *later)

    spans = asyncio.run(run())
    for prompt, span in zip(prompts, spans, strict=True):
        ids = torch.tensor([prompt + span.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(reference(ids).logits.double(), -1)[0, len(prompt) - 1 : -1]
        want = logp.gather(-1, torch.tensor(span.token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(span.logprobs, dtype=torch.float64), want, rtol=0, atol=1e-5)
