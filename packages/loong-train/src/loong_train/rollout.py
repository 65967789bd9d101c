"""A rollout worker: an engine plus an AgentFlow runner, usable in-process or as a Ray actor."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from loong_agentflow import EpisodeLimits, EpisodeSpec, ToolAgent, run_episodes
from loong_core.protocols import SamplingParams
from loong_core.records import WeightManifest
from loong_train.engines.embedded import EmbeddedEngine
from loong_train.models.qwen3 import Qwen3ForCausalLM
from loong_train.tasks import calc
from loong_train.tokenizer import load_tokenizer
from loong_transfermesh import TransportConfig, open_receiver

__all__ = ["HFCodec", "RolloutWorker"]


class HFCodec:
    """A Hugging Face tokenizer as an AgentFlow ``TextCodec`` (no special tokens added)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


class RolloutWorker:
    """Runs white-box tool-agent episodes on an embedded engine; receives weights by manifest."""

    def __init__(
        self,
        model_path: str,
        *,
        seed: int,
        sampling: dict[str, Any],
        limits: dict[str, Any],
        transport: TransportConfig | None = None,
        threads: int = 1,
        worker_id: int = 0,
    ) -> None:
        torch.set_num_threads(threads)
        self.worker_id, self._model_path = worker_id, model_path
        tokenizer = load_tokenizer(model_path)
        self.codec = HFCodec(tokenizer)
        self.engine = EmbeddedEngine(
            Qwen3ForCausalLM.from_pretrained(model_path), seed=seed, pad_id=tokenizer.pad_token_id
        )
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.sampling = SamplingParams(**sampling, stop_token_ids=[end])
        self.limits = EpisodeLimits(**limits)
        self.agent = ToolAgent(calc.tool_registry(), calc.reward)
        self.receiver = open_receiver(transport or TransportConfig())

    def rollout(self, specs: list[EpisodeSpec]) -> dict[str, Any]:
        """Run episodes; returns their trajectories and the call's wall-clock span."""
        start = time.time()
        out = asyncio.run(
            run_episodes(self.agent, specs, self.engine, self.codec, self.sampling, self.limits)
        )
        end = time.time()
        return {
            "trajectories": out,
            "start": start,
            "end": end,
            "version": self.engine.weight_version,
            "worker": self.worker_id,
        }

    def apply_weights(self, manifest: WeightManifest) -> dict[str, float]:
        """Receive an update through TransferMesh. Ray runs an actor's calls one
        at a time, so the update lands between rollout calls: no generation sees mixed weights."""
        start = time.time()
        self.receiver.apply(dict(self.engine.model.named_parameters()), version=manifest.version)
        self.engine.set_version(manifest.version)
        end = time.time()
        return {
            "apply_s": end - start,
            "start": start,
            "end": end,
            "version": manifest.version,
            "worker": self.worker_id,
        }

    def model_path(self) -> str:
        return self._model_path

    def weight_version(self) -> int:
        return self.engine.weight_version
