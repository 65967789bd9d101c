"""The fast path against the generic path on the same checkpoint, with the matmul floor.

One random-init Llama checkpoint (hidden 256, 4 layers, 8 heads, 4 key/value heads, vocab 256),
saved by ``transformers``, loaded twice: by Loong's decoder (``fast``) and by
:class:`~loong_train.models.generic.HFCausalLM` (``generic``: ``transformers``' own Llama behind the
same interface). One torch thread. Cases (``extra_info["case"]``):

- ``generate``: the embedded engine serves 32 requests (prompts of 8 to 24 tokens, 32 new tokens
  each, temperature 1) at ``max_batch`` 8: prefill, KV-cache decode and continuous batching.
- ``train``: a forward and backward pass of the training logprobs over 8 rows of 128 tokens.
- ``train`` / ``floor``: the same pass through the checkpoint's linear layers alone (every weight
  matrix against the batch's activations, forward plus the two backward products), which any
  implementation must do: the physical floor on this CPU.

``extra_info``: ``tokens_per_s`` (best of three rounds). Run:
``uv run pytest packages/loong-train/benchmarks/bench_models.py --benchmark-enable --dist no -q -s``
(disabled, as in the default test run, each case runs once).
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest
import torch

from loong_core.protocols import SamplingParams
from loong_train.backends.torch_backend import token_logprobs
from loong_train.engines.embedded.engine import EmbeddedEngine
from loong_train.models.decoder import CausalLM
from loong_train.models.generic import HFCausalLM

VOCAB, ROWS, LENGTH = 256, 8, 128


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    import transformers

    path = tmp_path_factory.mktemp("llama")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _load(path: Path, impl: str):
    return CausalLM.from_pretrained(path) if impl == "fast" else HFCausalLM.from_pretrained(path)


async def _serve(engine: EmbeddedEngine) -> int:
    rng = random.Random(0)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(8, 24))] for _ in range(32)]
    sampling = SamplingParams(max_new_tokens=32)
    spans = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
    return sum(len(s.token_ids) for s in spans)


def _train_pass(model) -> int:
    ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(0))
    token_logprobs(model, ids).sum().backward()
    model.zero_grad(set_to_none=True)
    return ROWS * LENGTH


def _floor_pass(weights: list[torch.Tensor]) -> int:
    """Every weight matrix [out, in] against [tokens, in] activations: the forward product and
    the two backward ones (input and weight gradients)."""
    tokens = ROWS * LENGTH
    for w in weights:
        x = torch.randn(tokens, w.shape[1])
        y = x @ w.T
        _ = y @ w  # grad of the input
        _ = y.T @ x  # grad of the weight
    return tokens


CASES = [
    ("generate", "fast"),
    ("generate", "generic"),
    ("train", "fast"),
    ("train", "generic"),
    ("train", "floor"),
]


@pytest.mark.parametrize(("workload", "impl"), CASES)
def test_model_throughput(benchmark, checkpoint: Path, workload: str, impl: str) -> None:
    torch.set_num_threads(1)
    if impl == "floor":
        model = CausalLM.from_pretrained(checkpoint)
        weights = [p.detach() for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n]
        work = lambda: _floor_pass(weights)  # noqa: E731
    elif workload == "train":
        model = _load(checkpoint, impl).train()
        work = lambda: _train_pass(model)  # noqa: E731
    else:
        model = _load(checkpoint, impl).eval()
        work = lambda: asyncio.run(_serve(EmbeddedEngine(model, seed=0, max_batch=8)))  # noqa: E731
    best: list[float] = []

    def run() -> None:
        start = time.perf_counter()
        tokens = work()
        rate = tokens / (time.perf_counter() - start)
        best[:] = [max(best[0], rate)] if best else [rate]

    benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)
    benchmark.extra_info.update(workload=workload, case=impl, tokens_per_s=best[0])
    print(f"\n{workload} {impl}: {best[0]:.0f} tokens/s")
