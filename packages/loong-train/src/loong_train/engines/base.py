"""The engine seam of a rollout worker: what it needs from an engine, and the factory that builds one.

Every engine is a ``loong_core.protocols.RolloutEngine`` (``generate`` with logprobs and the
weight version, ``pause``/``resume``) plus what a worker does around generation:

- ``model``: the torch module whose parameters TransferMesh writes an update into (the embedded
  engine's own model; for a server, a host copy that ``set_version`` then pushes into it); None
  for a server the trainer pushes into itself (``weights = "direct"``);
- ``adapter``: for an engine that serves LoRA adapters itself (an SGLang server through its LoRA
  API), the adapter tensors an adapter-only update is written into, else None;
- ``set_version(v)``: the weights in ``model`` (or ``adapter``) are now version ``v``: serve them
  (neither: wait until the engine serves ``v``);
- ``mid_call_updates``: whether an update may land between decode steps of a running call
  (:class:`~loong_train.engines.embedded.host.EngineHost`), or only between calls;
- ``check()``: raise if the engine can no longer serve (a server its supervisor gave up on), so the
  rollout call fails rather than only its episodes; ``close()``.

:func:`build_engine` picks the engine by ``[rollout.engine] type`` (:mod:`loong_train.engines.config`):
``embedded`` (:mod:`loong_train.engines.embedded.engine`) or ``sglang``
(:mod:`loong_train.engines.sglang.rollout`, imported only when chosen).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from loong_core.protocols import SamplingParams
from loong_core.records import TokenSpan
from loong_train.engines.config import EngineConfig, SGLangEngineConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from loong_train.backends.config import LoraConfig
    from loong_train.engines.embedded.host import EngineHost

__all__ = ["WorkerEngine", "build_engine", "build_host", "cast_parameters", "engine_dtype", "native_bfloat16"]

log = logging.getLogger(__name__)


class WorkerEngine(Protocol):
    model: nn.Module | None
    adapter: dict[str, torch.Tensor] | None
    mid_call_updates: bool

    @property
    def weight_version(self) -> int: ...

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> TokenSpan: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def set_version(self, version: int) -> None: ...

    def check(self) -> None: ...

    def close(self) -> None: ...


def build_engine(
    config: EngineConfig,
    model_path: str,
    *,
    seed: int,
    pad_id: int,
    worker_id: int = 0,
    log_dir: str = "",
    trust_remote_code: bool = False,
    version: int = 0,
    lora: LoraConfig | None = None,
    adapter: str = "",
) -> WorkerEngine:
    """The engine ``config.type`` names, serving the checkpoint at ``model_path`` (a server logs
    into ``log_dir``; ``version``: the checkpoint's) on the implementation
    :func:`~loong_train.models.auto.load_causal_lm` picks.
    ``lora``: updates are adapters alone (``adapter``: the resumed checkpoint's); an SGLang server
    serves them through its LoRA API, the embedded engine's worker merges them."""
    if isinstance(config, SGLangEngineConfig):
        from loong_train.engines.sglang.rollout import SGLangRollout

        return SGLangRollout(
            model_path,
            config,
            worker_id=worker_id,
            log_dir=log_dir,
            seed=seed,
            trust_remote_code=trust_remote_code,
            version=version,
            lora=lora,
            adapter=adapter,
        )
    from loong_train.engines.embedded.engine import EmbeddedEngine
    from loong_train.models.auto import load_causal_lm

    model = cast_parameters(load_causal_lm(model_path, trust_remote_code), engine_dtype(config.dtype))
    return EmbeddedEngine(model, seed=seed, pad_id=pad_id)


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` with its parameters in ``dtype`` and its buffers as they were: the rotary
    frequencies stay float32 (``Module.to`` would round them too, and a bfloat16 frequency is
    off by a tenth of a radian by position 128)."""
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def native_bfloat16() -> bool:
    """Whether this CPU has native bfloat16 products (AVX512-BF16 or AMX)."""
    import torch

    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def engine_dtype(setting: str) -> torch.dtype:
    """The embedded engine's dtype for ``[rollout.engine] dtype`` on this CPU: ``"auto"`` is
    bfloat16 where the CPU has native bfloat16 products (AVX512-BF16 or AMX), float32 elsewhere
    (there bfloat16 products run several times slower than float32's); logged."""
    import torch

    native = native_bfloat16()
    if setting == "auto":
        setting = "bfloat16" if native else "float32"
        log.info("[rollout.engine] dtype = 'auto': %s (native bfloat16 products: %s)", setting, native)
    elif setting == "bfloat16" and not native:
        log.warning(
            "[rollout.engine] dtype = 'bfloat16': this CPU has no native bfloat16 products (AVX512-BF16 "
            "or AMX), so the engine runs several times slower than in float32 ('auto' picks float32 here)"
        )
    return getattr(torch, setting)


def build_host(engine: WorkerEngine) -> EngineHost | None:
    """For an engine whose updates may land mid-call, the host that runs white-box rollouts on
    it and swaps weights between decode steps (:mod:`loong_train.engines.embedded.host`); None
    for an engine updated between calls only."""
    if not engine.mid_call_updates:
        return None
    from loong_train.engines.embedded.host import EngineHost

    return EngineHost(engine)
