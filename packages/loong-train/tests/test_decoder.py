"""Loong's decoder family against Hugging Face transformers' own classes as the reference:
Qwen3, Qwen2, Llama (with llama3 rope scaling) and Mistral, random-init by transformers, and the
embedded engine's logprobs on each family (and on the generic path's)."""

import pytest
import torch
from train_testkit import DECODER_SHAPE, tiny_hf_checkpoint

from loong_train.models.decoder import CausalLM, DecoderConfig, RMSNorm


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [576, 64])  # a hidden state; a head (Qwen3's QK-norm)
def test_rms_norm_equals_transformers_to_the_bit(dtype, width):
    """The norm (one ``F.rms_norm`` call for the normalisation) gives transformers' bits: forward
    in float32 and bfloat16, gradients of input and weight in float32 (the trainer's dtype)."""
    transformers = pytest.importorskip("transformers")
    gen = torch.Generator().manual_seed(0)
    ours, theirs = RMSNorm(width, 1e-5), transformers.models.llama.modeling_llama.LlamaRMSNorm(width, 1e-5)
    with torch.no_grad():
        ours.weight.copy_(1 + 0.1 * torch.randn(width, generator=gen))
        theirs.weight.copy_(ours.weight)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    for shape in [(128, 1, width), (2, 300, width), (3, 9, 7, width)]:
        x = (torch.randn(shape, generator=gen) * 8 * torch.rand(*shape[:-1], 1, generator=gen)).to(dtype)
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, ref = ours(a), theirs(b)
        assert torch.equal(out, ref)
        if dtype == torch.float32:
            grad = torch.randn(shape, generator=gen)
            mine = torch.autograd.grad(out, (a, ours.weight), grad)
            reference = torch.autograd.grad(ref, (b, theirs.weight), grad)
            assert all(torch.equal(m, r) for m, r in zip(mine, reference, strict=True))


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
        getattr(transformers, config_class)(**DECODER_SHAPE, **extra)
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
            {**DECODER_SHAPE, "model_type": "mistral", "sliding_window": 16},
            r"sliding-window attention is not implemented",
        ),
        (
            {**DECODER_SHAPE, "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
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


def _peaked_reference(family: str, path, dtype: torch.dtype = torch.float32):
    """A ``transformers`` model of ``family`` with normal(0, 0.3) weights (peaked distributions),
    rounded to ``dtype`` and kept in float32, saved to ``path``."""
    import transformers

    config_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, config_class)(**DECODER_SHAPE, **extra)
    )
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(p.normal_(0, 0.3).to(dtype))
    reference.eval().save_pretrained(path)
    return reference


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama", "mistral", "gpt2", "phi"])
def test_the_engine_samples_each_familys_transformers_logprobs(tmp_path, family):
    """Whatever path a family takes, the embedded engine's logprobs (left-padded batch, rows
    joining mid-batch, a pause and resume in between) equal those of ``transformers``' own model
    run on each finished sequence alone."""
    import asyncio

    from loong_core.protocols import SamplingParams
    from loong_train.engines.embedded.engine import EmbeddedEngine
    from loong_train.models.auto import load_causal_lm

    if family in FAMILIES:
        reference = _peaked_reference(family, tmp_path)
    else:
        reference = tiny_hf_checkpoint(tmp_path, family, vocab_size=DECODER_SHAPE["vocab_size"])
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


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_a_bfloat16_engine_samples_its_rounded_weights_logprobs(tmp_path, family):
    """``[rollout.engine] dtype = "bfloat16"``: the engine's logprobs (prefill, then decode steps
    against a bfloat16 KV cache) are those of ``transformers``' model holding the same rounded
    weights, computed in float64, to bfloat16 activation rounding; a float32 engine on those
    weights meets float32 rounding, so the bound is bfloat16's own."""
    from loong_core.protocols import SamplingParams
    from loong_train.engines.base import cast_parameters
    from loong_train.engines.embedded.engine import EmbeddedEngine
    from loong_train.models.auto import load_causal_lm

    reference = _peaked_reference(family, tmp_path, torch.bfloat16).double()  # weights bfloat16 holds exactly
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [9, 9, 2, 7], [3] * 180]  # the last: far positions
    gaps = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = cast_parameters(load_causal_lm(tmp_path), dtype)
        assert {b.dtype for b in model.buffers()} <= {torch.float32}  # rotary frequencies stay float32
        engine = EmbeddedEngine(model, seed=0)
        spans = engine.generate_batch(prompts, [SamplingParams(max_new_tokens=40)] * len(prompts))
        worst = 0.0
        for prompt, span in zip(prompts, spans, strict=True):
            ids = torch.tensor([prompt + span.token_ids])
            with torch.no_grad():
                logp = torch.log_softmax(reference(ids).logits, -1)[0, len(prompt) - 1 : -1]
            want = logp.gather(-1, torch.tensor(span.token_ids)[:, None]).squeeze(-1)
            worst = max(worst, (torch.tensor(span.logprobs, dtype=torch.float64) - want).abs().max().item())
        gaps[dtype] = worst
    assert gaps[torch.float32] < 1e-4
    assert 1e-3 < gaps[torch.bfloat16] < 0.1
