"""The generic path (``transformers`` models outside Loong's decoder family): which path a checkpoint
takes and why, the checks made before any work, remote code, and training through it."""

import re

import pytest
import torch
from train_testkit import DECODER_SHAPE, GENERIC, tiny_hf_checkpoint

from loong_train.models.decoder import CausalLM, DecoderConfig


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
        ({**DECODER_SHAPE, "model_type": "qwen3"}, "fast", r"model_type 'qwen3': Loong's decoder family"),
        (
            {**DECODER_SHAPE, "model_type": "gpt2"},
            "generic",
            r"'gpt2' is not one of Loong's decoder families",
        ),
        (
            {**DECODER_SHAPE, "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
            "generic",
            r"a feature Loong's decoder lacks \(rope scaling 'yarn'",
        ),
        (
            {**DECODER_SHAPE, "model_type": "my_lm", "auto_map": {"AutoModelForCausalLM": "m.M"}},
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
        ({**DECODER_SHAPE, "model_type": "mistral", "sliding_window": 16}, r"sliding_window = 16 < max_position_embeddings"),
        ({**DECODER_SHAPE, "model_type": "gemma2", "layer_types": ["sliding_attention", "full_attention"]}, r"layer_types \['sliding_attention'\]"),
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
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**{**DECODER_SHAPE, "vocab_size": 103})
    ).eval()
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
