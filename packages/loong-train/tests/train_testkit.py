"""Shared test helpers for loong-train.

- ``tiny_config()`` is the shape most engine and server tests use (2 layers, 4 query heads over
  2 KV heads of width 8, hidden 32); keyword arguments change any field. ``tiny_qwen3(seed, std)``
  builds and initialises one (``std`` larger than a trained model's, so logprobs are far from
  uniform and a wrong computation shows).
- ``SMALL_RUN`` and ``assert_same_run``: a few-step ``tiny-calc-agent`` run whose every step moves
  the weights by what it sampled, and the comparison of two such runs (every non-timing metric,
  the ledger, the final weights). An untrained tiny model never earns a reward, so GRPO
  advantages are 0; a k1 KL penalty to the initial model (its gradient is that of the sampled
  tokens' logprobs) makes every step depend on what was sampled, so a run that sampled or
  trained anything differently shows it.
- ``tensorboard_scalars`` and ``wandb_history``: what the loggers wrote, read back with each
  tool's own reader.
- ``serve_engine`` (an embedded engine behind its SGLang-compatible app, on loopback),
  ``PROMPT_IDS`` and ``forward_logprobs``, the float64 reference of the server tests.
- ``DATA_ROWS`` and ``write_jsonl``: the rows of the ``task = "data"`` tests (conftest's ``data``
  fixture writes them to ``data.jsonl``)."""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import os
import random
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import uvicorn
from safetensors.torch import load_file

from loong_core.net import free_port
from loong_train.models.decoder import CausalLM, DecoderConfig

if TYPE_CHECKING:
    from loong_train.engines.embedded.engine import EmbeddedEngine

__all__ = [
    "COMPARED",
    "DATA_ROWS",
    "PROMPT_IDS",
    "SMALL_RUN",
    "assert_same_run",
    "forward_logprobs",
    "ledger",
    "serve_engine",
    "tensorboard_scalars",
    "tiny_config",
    "tiny_qwen3",
    "wandb_history",
    "write_jsonl",
]

SMALL_RUN = [
    "warmstart.steps=0",
    "train.batch_groups=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=12",
    "rollout.max_model_tokens=24",
    "eval.every=2",
    "eval.num_tasks=4",
    "loss.kl_coef=0.5",
    "loss.kl_estimator=k1",
]
COMPARED = [  # every metric that is not a timing
    "reward_mean",
    "loss",
    "grad_norm",
    "lr",
    "pg_loss",
    "clip_frac",
    "mismatch_kl",
    "onpolicy_mismatch_kl",
    "mismatch_abs_logp",
    "staleness_mean",
    "staleness_max",
    "samples",
    "response_tokens_mean",
    "kl",
    "kl_loss",
]


def ledger(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]


def assert_same_run(a: list[dict], b: list[dict], run_a: Path, run_b: Path) -> None:
    """Metrics rows ``a`` and ``b`` (every non-timing key), ledgers and final weights of the runs
    in ``run_a`` and ``run_b`` agree."""
    for ra, rb in zip(a, b, strict=True):
        for key in COMPARED:
            assert ra[key] == pytest.approx(rb[key], abs=1e-6), (ra["step"], key)
    assert ledger(run_a) == ledger(run_b)
    final = run_a / "checkpoints" / "final"
    name = (
        "adapter_model.safetensors" if (final / "adapter_config.json").exists() else "model.safetensors"
    )  # LoRA
    wa = load_file(final / name)
    wb = load_file(run_b / "checkpoints" / "final" / name)
    assert wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa)


_SHAPE = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}


def server_port(count: int) -> int:
    """A port base for ``count`` servers on loopback, free now and below the OS's ephemeral range:
    a server killed and relaunched on its port finds it free again (a port from that range, where
    :func:`loong_core.net.free_port` picks, can meanwhile become any outgoing connection's source)."""
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ranges.read_text().split()[0]) if ranges.exists() else 32768
    for base in random.sample(range(20000, low - count), 500):
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + count):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} free consecutive ports between 20000 and {low}")


def sglang_python() -> str | None:
    """The interpreter that runs SGLang: ``SGLANG_PYTHON`` (SGLang's own environment, as
    docs/gpu.md recommends), else this one if it imports ``sglang``; None when there is none."""
    if python := os.environ.get("SGLANG_PYTHON"):
        return python
    return sys.executable if importlib.util.find_spec("sglang") is not None else None


NEEDS_REAL_SGLANG = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(sglang_python() is None, reason="no SGLang: set SGLANG_PYTHON to its interpreter"),
]
"""The marks of a test against a real SGLang server (``gpu``; skipped without CUDA or SGLang)."""


def real_sglang_config(model_path: Path, log_path: Path):
    """How the GPU tests launch a real SGLang server on a tiny checkpoint: token ids in and out,
    bfloat16, a fifth of the GPU, no CUDA graphs, and ``/health`` without generation, as
    ``SGLangRollout`` launches it (a paused server stays healthy)."""
    from loong_train.engines.sglang.supervisor import SGLangServerConfig, sglang_launch_command

    args = [
        "--skip-tokenizer-init",
        "--dtype",
        "bfloat16",
        "--mem-fraction-static",
        "0.2",
        "--disable-cuda-graph",
    ]
    port = free_port()
    return SGLangServerConfig(
        model_path=str(model_path), command=sglang_launch_command(sglang_python()), port=port, args=args,
        log_path=str(log_path), startup_timeout_s=300, health_interval_s=2.0,
        env={"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"},
    )  # fmt: skip


@contextlib.contextmanager
def serve_in_thread(app) -> Iterator[str]:
    """``app`` on a uvicorn server in a daemon thread, on a free loopback port; yields its URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


def wait_relaunched(supervisor, ready: Callable[[], bool], what: str) -> None:
    """Until ``supervisor`` relaunched its killed server and ``ready()`` holds. The deadline only
    guards against a hang: a relaunch imports torch afresh, slow on a busy machine."""
    deadline = time.monotonic() + 180
    while not (supervisor.restarts and ready()):
        assert time.monotonic() < deadline, f"no relaunch {what}:\n{supervisor.log_tail()}"
        time.sleep(0.1)


PROMPT_IDS = [3, 14, 15, 9, 26, 5]


@contextlib.contextmanager
def serve_engine(engine: EmbeddedEngine, **kwargs) -> Iterator[tuple[str, Any]]:
    """The engine's SGLang-compatible app (``build_app(engine, **kwargs)``) on a uvicorn server in a
    thread; yields (base url, server state)."""
    from loong_train.engines.embedded.http_app import build_app

    app = build_app(engine, **kwargs)
    with serve_in_thread(app) as url:
        yield url, getattr(app, "app", app).state.sglang


def forward_logprobs(model: CausalLM, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1 in float64 ([len(ids) - 1])."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).double()[0, :-1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)


def tiny_config(**fields: Any) -> DecoderConfig:
    return DecoderConfig(**{**_SHAPE, **fields})


def tiny_qwen3(seed: int = 0, std: float = 0.3, **fields: Any) -> CausalLM:
    model = CausalLM(tiny_config(**fields))
    model.init_weights(seed, std=std)
    return model


DATA_ROWS = [{"prompt": f"what is {i}+1?", "answer": str(i + 1), "metadata": {"n": i}} for i in range(20)]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def wandb_history(run_dir: Path) -> list[dict[str, float]]:
    """The ``history`` records of the one offline run under ``run_dir/wandb``: the file is a
    7-byte header, then 32 KiB blocks of chunks ``crc32c (4) | length (2) | kind (1) | bytes``
    (kind 1: a whole record; 2, 3, 4: its first, middle, last chunk), each record a ``Record``."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data, pos, block, chunks, rows = Path(path).read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        if (left := block - pos % block) < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # block padding
            pos += left
            continue
        chunks, pos = (b"" if kind in (1, 2) else chunks) + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record.FromString(chunks)
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
    return rows


HF_FAMILIES = {  # tiny transformers configs: two fast families with their config-driven features, two generic
    "qwen2": ("Qwen2Config", {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2}),
    "llama": ("LlamaConfig", {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "rope_parameters": {
                                  "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
                                  "rope_theta": 500000.0}}),
    "mistral": ("MistralConfig", {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": None}),
    "gpt2": ("GPT2Config", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512}),
    "phi": ("PhiConfig", {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "partial_rotary_factor": 0.5}),
}  # fmt: skip
GENERIC = ("gpt2", "phi")  # families only the generic path runs
DECODER_SHAPE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
"""The transformers config fields of the decoder-family tests (a family adds its own)."""


def tiny_hf_checkpoint(
    path: Path,
    family: str = "gpt2",
    seed: int = 0,
    std: float = 0.3,
    vocab_size: int = 40,
    eos: int | None = None,
):
    """Save a random-init tiny ``transformers`` model of ``family`` (:data:`HF_FAMILIES`) to
    ``path`` (``eos``: its end-of-turn id, by default the last id); returns the reference model
    itself, in eval mode."""
    import torch
    import transformers

    config_class, shape = HF_FAMILIES[family]
    torch.manual_seed(seed)
    reference = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, config_class)(
            vocab_size=vocab_size,
            bos_token_id=0,
            eos_token_id=vocab_size - 1 if eos is None else eos,
            **shape,
        )
    )
    with torch.no_grad():  # larger weights than transformers' init (biases too), so sampled tokens vary
        for p in reference.parameters():
            p.normal_(0, std)
    reference.eval().save_pretrained(path)
    return reference


def tiny_hf(family: str = "gpt2", seed: int = 0, std: float = 0.3, vocab_size: int = 40):
    """:func:`tiny_hf_checkpoint` loaded back on the path Loong picks for it (fast or generic)."""
    import tempfile

    from loong_train.models.auto import load_causal_lm

    with tempfile.TemporaryDirectory() as path:
        tiny_hf_checkpoint(Path(path), family, seed, std, vocab_size)
        return load_causal_lm(path)


def tiny_family_model(family: str, seed: int = 0, vocab_size: int = 40):
    """A tiny model of ``family``: Loong's own Qwen3 for ``"qwen3"``, else :func:`tiny_hf`."""
    if family == "qwen3":
        return tiny_qwen3(seed, vocab_size=vocab_size)
    return tiny_hf(family, seed, vocab_size=vocab_size)
