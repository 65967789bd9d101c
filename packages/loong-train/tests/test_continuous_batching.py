"""Continuous batching in the embedded engine: rows join and leave between decode steps.

References: the same request run alone on a fresh engine (same per-request seed), and the model's
own full forward pass with a float64 log-softmax.
"""

import asyncio
import copy
import random

import pytest
import torch
from train_testkit import tiny_family_model

from loong_core.protocols import SamplingParams
from loong_train.engines.embedded.batching import SHARED_PREFIX_MIN, BatchStats, Request, RunningBatch
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


def _forward_logprobs(model, prompt, tokens, temperature=1.0):
    """float64 ``log_softmax(logits / T)`` of each of ``tokens`` after ``prompt`` ([len(tokens)])."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).double()[0, len(prompt) - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def _alone(model, prompt, sampling, seed):
    return EmbeddedEngine(model).generate_batch([prompt], [sampling], seeds=[seed])[0]


def _assert_same(got, want):
    """Same tokens; logprobs equal up to float32 rounding. Not bitwise: CPU matmul kernels round a
    row differently for different row counts (measured up to 7e-7 per output of a [n, 128] x
    [128, 384] product, n = 1 vs 8), so bitwise equality would need batch-invariant kernels."""
    assert got.token_ids == want.token_ids
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), rtol=0, atol=1e-5)


def _workload(n, seed):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 40) for _ in range(rng.randint(1, 14))] for _ in range(n)]
    samplings = [
        SamplingParams(
            max_new_tokens=rng.choice([1, 2, 3, 5, 8, 30]),
            temperature=rng.choice([0.7, 1.0, 1.3]),
            top_p=rng.choice([1.0, 0.9]),
            stop_token_ids=rng.choice([[], [7]]),
        )
        for _ in range(n)
    ]
    return prompts, samplings


def test_requests_joining_and_leaving_mid_batch_equal_each_alone_and_the_forward_pass():
    model = _model()
    engine = EmbeddedEngine(model, seed=3, max_batch=4)
    prompts, samplings = _workload(14, seed=0)
    rng = random.Random(1)
    arrivals = sorted(rng.randrange(0, 40) for _ in prompts)  # decode step of arrival
    seen = []

    async def arrive(i):
        while engine.stats.steps < arrivals[i] and engine.running + engine.queued:
            await asyncio.sleep(0)
        seen.append(engine.running)
        return await engine.generate(prompts[i], samplings[i], seed=100 + i)

    async def run():
        return await asyncio.gather(*(arrive(i) for i in range(len(prompts))))

    spans = asyncio.run(run())
    assert any(0 < rows < 4 for rows in seen)  # some arrived while others were running
    for i, span in enumerate(spans):
        _assert_same(span, _alone(model, prompts[i], samplings[i], 100 + i))
        want = _forward_logprobs(model, prompts[i], span.token_ids, samplings[i].temperature)
        torch.testing.assert_close(torch.tensor(span.logprobs, dtype=torch.float64), want, rtol=0, atol=1e-5)
    assert engine.stats.tokens == sum(len(s.token_ids) for s in spans)


def test_static_and_continuous_batching_give_the_same_completions_in_fewer_steps():
    model = _model(1)
    prompts, samplings = _workload(16, seed=2)
    runs = {}
    for continuous in (False, True):
        engine = EmbeddedEngine(model, seed=9, max_batch=4, continuous=continuous)
        runs[continuous] = (engine.generate_batch(prompts, samplings), engine.stats)
    (static, static_stats), (cont, cont_stats) = runs[False], runs[True]
    for a, b in zip(static, cont, strict=True):
        _assert_same(b, a)
    assert static_stats.tokens == cont_stats.tokens
    assert cont_stats.steps < static_stats.steps
    assert cont_stats.mean_occupancy > static_stats.mean_occupancy


def test_a_long_stream_of_requests_keeps_the_cache_narrow():
    model = _model(2)
    rng = random.Random(4)
    prompts = [[rng.randrange(1, 40) for _ in range(rng.randint(1, 14))] for _ in range(60)]
    samplings = [SamplingParams(max_new_tokens=rng.randint(1, 8)) for _ in prompts]
    requests = [
        Request(p, s, torch.Generator().manual_seed(i))
        for i, (p, s) in enumerate(zip(prompts, samplings, strict=True))
    ]
    batch, queue, widths = RunningBatch(model, 0, BatchStats()), list(requests), []
    while queue or batch.rows:
        room = 3 - len(batch.rows)
        batch.step(queue[:room], [], 0, 0)
        queue = queue[room:]
        widths.append(batch.cache.max_len if batch.cache else 0)
    # A row's context spans at most 14 + 8 columns and the cache grows only to twice the columns in
    # use (plus the next one): it is shifted left as rows leave, not grown forever.
    assert len(widths) > 60 and max(widths) <= 2 * (14 + 8 + 1)
    for i, r in enumerate(requests):
        _assert_same(r.span(), _alone(model, prompts[i], samplings[i], i))


def test_contexts_sharing_a_prefix_compute_it_once_and_equal_each_alone():
    """Joining rows that share a prefix (a chat template's system turn) compute it once, then each
    its own rest, joining an empty batch and a running one; a repeated context still copies its
    first. Each row equals its request alone (no sharing there) and the forward pass."""
    model = _model(3)
    rng = random.Random(7)
    system = [rng.randrange(1, 40) for _ in range(SHARED_PREFIX_MIN + 3)]
    first = [system + [rng.randrange(1, 40) for _ in range(n)] for n in (1, 4, 2, 6)]
    first.append(list(first[1]))  # a second sample of one prompt
    later = [system[:SHARED_PREFIX_MIN] + [rng.randrange(1, 40) for _ in range(n)] for n in (9, 3, 12)]
    short = [system[:2] + [rng.randrange(1, 40) for _ in range(n)] for n in (3, 5)]  # under the minimum
    prompts = first + later + short
    samplings = [SamplingParams(max_new_tokens=rng.randint(2, 9), temperature=0.9) for _ in prompts]
    requests = [
        Request(p, sp, torch.Generator().manual_seed(i))
        for i, (p, sp) in enumerate(zip(prompts, samplings, strict=True))
    ]
    stats = BatchStats()
    batch = RunningBatch(model, 0, stats)
    joins = {0: requests[:5], 2: requests[5:8], 4: requests[8:]}
    step, running, computed = 0, {}, {}
    while step in joins or batch.rows:
        running[step] = len(batch.rows)
        if step == 3:
            again = list({tuple(r.prompt + r.token_ids): None for r in batch.rows})
        # step 3: new weights (the same values), so the running rows, sharing the system turn, are
        # prefilled again with what they sampled so far
        batch.step(joins.get(step, []), [], 0, int(step >= 3))
        computed[step] = stats.prefill_tokens
        step += 1
    assert running[2] and running[3] and running[4]  # the later rows join a running batch

    def shared(contexts):  # an independent count: the longest prefix all share, short of a last token
        n = 0
        while n < min(map(len, contexts)) - 1 and len({c[n] for c in contexts}) == 1:
            n += 1
        return n if n >= SHARED_PREFIX_MIN else 0

    assert (
        shared(first[:4]) >= SHARED_PREFIX_MIN + 3
        and shared(later) >= SHARED_PREFIX_MIN
        and shared(short) == 0
    )
    hand = 0
    for group in (first[:4], later):  # the repeat is copied, not computed
        s = shared(group)
        hand += s + sum(len(c) - s for c in group)
    assert computed[2] == hand
    assert computed[4] - computed[3] == sum(map(len, short))  # under the minimum: each computes all
    s = shared(again)
    assert s >= SHARED_PREFIX_MIN and computed[3] - computed[2] == s + sum(len(c) - s for c in again)
    for i, r in enumerate(requests):
        _assert_same(r.span(), _alone(model, prompts[i], samplings[i], i))
        want = _forward_logprobs(model, prompts[i], r.token_ids, samplings[i].temperature)
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), want, rtol=0, atol=1e-5)


def test_pause_holds_between_steps_and_resume_continues_under_the_new_version():
    old, new = _model(0), _model(5)
    engine = EmbeddedEngine(copy.deepcopy(old), seed=0)
    prompt, sampling = [4, 5, 6], SamplingParams(max_new_tokens=200, temperature=0.9)

    async def run():
        first = asyncio.create_task(engine.generate(prompt, sampling))
        while engine.stats.steps < 4:
            await asyncio.sleep(0)
        engine.pause()
        await engine.wait_idle()
        held = engine.stats.steps
        queued = asyncio.create_task(engine.generate([9, 8], SamplingParams(max_new_tokens=3)))
        await asyncio.sleep(0.05)
        assert engine.stats.steps == held and not first.done() and not queued.done()
        engine.load_weights(dict(new.named_parameters()), version=1)
        engine.resume()
        return await first, await queued, held

    span, later, held = asyncio.run(run())
    assert 4 <= held < 200
    assert span.weight_version == 1 and span.versions == [0] * held + [1] * (200 - held)
    lps = torch.tensor(span.logprobs, dtype=torch.float64)
    before = _forward_logprobs(old, prompt, span.token_ids, 0.9)[:held]
    after = _forward_logprobs(new, prompt, span.token_ids, 0.9)[held:]
    torch.testing.assert_close(lps, torch.cat([before, after]), rtol=0, atol=1e-5)
    assert later.weight_version == 1 and later.versions == []


def test_an_abandoned_request_leaves_and_the_others_are_unchanged():
    model = _model()
    engine = EmbeddedEngine(model, seed=0)
    keep = ([1, 2, 3], SamplingParams(max_new_tokens=30))

    async def run():
        dropped = asyncio.create_task(engine.generate([5, 6], SamplingParams(max_new_tokens=300), seed=1))
        kept = asyncio.create_task(engine.generate(*keep, seed=2))
        while engine.stats.steps < 3:
            await asyncio.sleep(0)
        dropped.cancel()
        return await kept

    span = asyncio.run(run())
    _assert_same(span, _alone(model, *keep, seed=2))
    assert engine.stats.tokens < 30 + 100  # the abandoned row stopped long before its 300 tokens


def test_a_stream_yields_each_token_as_sampled_and_closing_it_frees_the_row():
    """``stream``: deltas concatenate to what the request gives alone (same seed); they arrive
    while the request still runs; closing the stream early takes its row out of the batch while
    a neighbour runs on unchanged."""
    model = _model()
    sampling = SamplingParams(max_new_tokens=30)
    want = _alone(model, [1, 2, 3], sampling, seed=11)
    neighbour_want = _alone(model, [4, 5], sampling, seed=12)

    async def main():
        engine = EmbeddedEngine(model)
        deltas, running = [], []
        async for delta in engine.stream([1, 2, 3], sampling, seed=11):
            deltas.append(delta)
            running.append(engine.running)
        neighbour = asyncio.ensure_future(engine.generate([4, 5], sampling, seed=12))
        early = engine.stream([1, 2, 3], sampling, seed=11)
        first = await anext(early)
        await early.aclose()
        for _ in range(100):
            if engine.running <= 1:
                break
            await asyncio.sleep(0.01)
        left = engine.running
        return deltas, running, first, left, await neighbour

    deltas, running, first, left, neighbour = asyncio.run(main())
    ids = [t for d in deltas for t in d.token_ids]
    lps = [x for d in deltas for x in d.logprobs]
    assert ids == want.token_ids and len(deltas) > 1 and running[0] == 1  # the first arrived mid-request
    torch.testing.assert_close(torch.tensor(lps), torch.tensor(want.logprobs), rtol=0, atol=1e-5)
    assert first.token_ids == want.token_ids[: len(first.token_ids)] and left <= 1
    _assert_same(neighbour, neighbour_want)
