"""The embedded engine: batched left-padded KV-cache decoding equals unpadded full forwards.

Continuous batching (rows joining and leaving, pause, versions) is tested in
``test_continuous_batching.py``.
"""

import asyncio

import pytest
import torch
from train_testkit import tiny_family_model

from loong_core.protocols import SamplingParams
from loong_core.records import SpanSource
from loong_train.engines.embedded.engine import EmbeddedEngine


@pytest.fixture(params=["qwen3", "qwen2", "llama", "gpt2"], autouse=True)
def _family(request, monkeypatch):
    """Every test runs on Loong's decoder (a tiny Qwen3 of its own; a Qwen2 with q/k/v biases and
    a Llama with llama3 rope scaling, built by ``transformers``) and on the generic path (a tiny
    GPT-2 through ``transformers``, whose full forward is then the reference)."""
    monkeypatch.setitem(_FAMILY, "name", request.param)


_FAMILY = {"name": "qwen3"}


def _model(seed=0):
    return tiny_family_model(_FAMILY["name"], seed, vocab_size=40)


def test_batched_logprobs_equal_unpadded_full_forward():
    model = _model()
    engine = EmbeddedEngine(model, seed=1)
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4]]
    spans = engine.generate_batch(prompts, [SamplingParams(max_new_tokens=12)] * 3)
    for prompt, span in zip(prompts, spans, strict=True):
        assert len(span.token_ids) == len(span.logprobs) == 12
        ids = torch.tensor([prompt + span.token_ids])
        with torch.no_grad():
            full = torch.log_softmax(model(ids).double(), -1)[0, len(prompt) - 1 : -1]
        want = full.gather(-1, torch.tensor(span.token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(span.logprobs, dtype=torch.float64), want, rtol=0, atol=1e-5)


def test_a_group_of_one_prompt_is_prefilled_once_and_samples_as_alone():
    """Rows with the same prompt joining together (a GRPO group) share one prefill; each still
    samples what it samples alone with its seed, and its logprobs are the full forward's."""
    model = _model()
    group, other = [2, 7, 1, 9], [3, 3]
    prompts = [group, other, group, group]
    seeds = [11, 12, 13, 14]
    sampling = SamplingParams(max_new_tokens=6)
    together = EmbeddedEngine(model, seed=0).generate_batch(prompts, [sampling] * 4, seeds)
    for prompt, seed, span in zip(prompts, seeds, together, strict=True):
        alone = EmbeddedEngine(model, seed=0).generate_batch([prompt], [sampling], [seed])[0]
        assert span.token_ids == alone.token_ids
        ids = torch.tensor([prompt + span.token_ids])
        with torch.no_grad():
            full = torch.log_softmax(model(ids).double(), -1)[0, len(prompt) - 1 : -1]
        want = full.gather(-1, torch.tensor(span.token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(span.logprobs, dtype=torch.float64), want, rtol=0, atol=1e-5)
    assert len({tuple(s.token_ids) for s in together[::2] + together[3:]}) > 1  # the seeds differ


def test_temperature_scales_the_reported_logprobs():
    model = _model()
    engine = EmbeddedEngine(model, seed=2)
    prompt = [3, 1, 4]
    span = engine.generate_batch([prompt], [SamplingParams(max_new_tokens=5, temperature=0.7)])[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + span.token_ids])).double()[0, len(prompt) - 1 : -1] / 0.7
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(span.token_ids)[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(span.logprobs, dtype=torch.float64), want, rtol=0, atol=1e-5)


def test_stop_tokens_end_each_row_on_its_own():
    model = _model()
    engine = EmbeddedEngine(model, seed=0)
    free = engine.generate_batch([[1, 2]], [SamplingParams(max_new_tokens=30)])[0].token_ids
    stop = free[4]  # a token the sampler is about to produce (same seed, same prompt)
    engine = EmbeddedEngine(model, seed=0)
    span = engine.generate_batch([[1, 2]], [SamplingParams(max_new_tokens=30, stop_token_ids=[stop])])[0]
    assert span.token_ids == free[: free.index(stop) + 1]


def test_version_stamp_and_concurrent_requests_share_a_batch():
    model = _model()
    engine = EmbeddedEngine(model, seed=0)
    engine.load_weights({k: v.clone() for k, v in model.named_parameters()}, version=7)

    async def many():
        return await asyncio.gather(
            *(engine.generate([1, i], SamplingParams(max_new_tokens=3)) for i in range(5))
        )

    spans = asyncio.run(many())
    assert (engine.stats.steps, engine.stats.tokens) == (3, 15)  # all five joined the first step
    assert all(s.weight_version == 7 and s.versions == [] and s.source is SpanSource.MODEL for s in spans)
