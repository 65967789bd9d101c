"""Embedded-engine throughput on a long-tailed workload: static versus continuous batching, with
the full-occupancy ceiling, in the same run.

Workload: 64 requests arriving at once (``asyncio.gather`` of ``engine.generate``), prompts of 8 to
24 tokens, ``max_new_tokens`` drawn from a log-normal (median 16, sigma 1, clipped to [2, 256]; no
stop tokens, so every request runs to its length), at most 16 rows per step, on the tiny recipe's
model size (hidden 128, 4 layers) with one torch thread. Cases (``extra_info["case"]``):

- ``static_batch``: ``continuous=False``: a batch of 16 runs until its longest row finishes before
  the next 16 are admitted (finished rows still leave it, so this baseline is slightly faster than
  the old engine, which kept decoding them).
- ``continuous``: rows join between decode steps as others finish.
- ``full_occupancy``: the same number of tokens with every length equal to the mean, so every step
  runs 16 rows: the ceiling for this batch size.

``extra_info``: ``tokens_per_s`` (generated tokens over wall seconds, best round),
``mean_occupancy`` (rows per decode step), ``steps``, ``tokens``. Run:
``uv run pytest packages/loong-train/benchmarks/bench_engine.py --benchmark-enable -q -s``
(disabled, as in the default test run, each case runs once).
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from loong_core.protocols import SamplingParams
from loong_train.engines.embedded import EmbeddedEngine
from loong_train.models.qwen3 import Qwen3Config, Qwen3ForCausalLM

REQUESTS, MAX_BATCH = 64, 16


def _model() -> Qwen3ForCausalLM:
    cfg = Qwen3Config(vocab_size=64, hidden_size=128, intermediate_size=384, num_hidden_layers=4)
    model = Qwen3ForCausalLM(cfg)
    model.init_weights(0)
    return model


def _workload(uniform: bool) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 64) for _ in range(rng.randint(8, 24))] for _ in range(REQUESTS)]
    lengths = [min(256, max(2, round(rng.lognormvariate(2.77, 1.0)))) for _ in range(REQUESTS)]
    if uniform:
        lengths = [sum(lengths) // REQUESTS] * REQUESTS
    return prompts, [SamplingParams(max_new_tokens=n) for n in lengths]


def _run_once(model, continuous: bool, uniform: bool) -> tuple[float, EmbeddedEngine]:
    prompts, samplings = _workload(uniform)
    engine = EmbeddedEngine(model, seed=0, max_batch=MAX_BATCH, continuous=continuous)

    async def all_at_once():
        await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, samplings, strict=True)))

    start = time.perf_counter()
    asyncio.run(all_at_once())
    return time.perf_counter() - start, engine


@pytest.mark.parametrize("case", ["static_batch", "continuous", "full_occupancy"])
def test_engine_throughput(benchmark, case: str) -> None:
    torch.set_num_threads(1)
    model = _model()
    best: list = []

    def run():
        seconds, engine = _run_once(model, case != "static_batch", case == "full_occupancy")
        if not best or seconds < best[0]:
            best[:] = [seconds, engine.stats]

    benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)
    seconds, stats = best
    benchmark.extra_info.update(
        case=case,
        tokens_per_s=stats.tokens / seconds,
        mean_occupancy=stats.mean_occupancy,
        steps=stats.steps,
        tokens=stats.tokens,
        requests=REQUESTS,
        max_batch=MAX_BATCH,
    )
    print(f"\n{case}: {stats.tokens / seconds:.0f} tokens/s, occupancy {stats.mean_occupancy:.2f}")
