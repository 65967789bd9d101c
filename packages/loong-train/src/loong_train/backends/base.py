"""The train-backend seam: what the trainer needs from a backend, and the factory that builds one.

Lifecycle (what :class:`~loong_train.workers.trainer.TrainerWorker` does)::

    backend = build_backend(model_path, BackendOptions(...))
    lp = backend.logprobs(batch)            # [rows, max_len], column 0 is 0
    metrics = backend.train_step(batch)     # one optimizer step
    sender.push(backend.named_weights(), v) # Hugging Face names, shapes and dtypes
    backend.save_state(ckpt)                # resumable: HF weights + optimizer state files
    backend.load_state(ckpt)                # a fresh backend continues from it
    backend.save_pretrained(final)          # HF weights and config only
    backend.close()

State is saved into a directory rather than returned as a dict because a distributed backend's
optimizer state lives on many ranks: each rank writes and reads its own files there.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import torch

from loong_core.records import TrainBatch
from loong_train.algo.config import LossConfig
from loong_train.backends.config import (
    BackendConfig,
    FsdpBackendConfig,
    LoraConfig,
    MegatronBackendConfig,
    TorchBackendConfig,
    require_installed,
)

if TYPE_CHECKING:
    from loong_train.models.decoder import DecoderConfig

__all__ = ["BackendOptions", "RankDriver", "RankLost", "TrainBackend", "backend_problem", "build_backend"]


class TrainBackend(Protocol):
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Recomputed logprob of every token given its prefix, right-padded: ``[rows, max_len]``
        (column 0 is 0; what a padding position holds is unspecified)."""
        ...

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on ``batch``; returns loss, gradient norm, learning rate and the
        train-inference mismatch statistics."""
        ...

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The whole model in Hugging Face naming (what TransferMesh sends to the engines)."""
        ...

    def save_pretrained(self, path: str | Path) -> None:
        """A Hugging Face checkpoint (``config.json`` + weights) of the current model."""
        ...

    def save_state(self, path: str | Path) -> None:
        """``save_pretrained(path)`` plus what a resumed run needs: optimizer, LR scheduler, step count."""
        ...

    def load_state(self, path: str | Path) -> None:
        """Continue from ``save_state(path)``: weights copied in place (a KL reference stays the
        initial model), optimizer, scheduler and step count restored."""
        ...

    def close(self) -> None: ...


class RankLost(RuntimeError):
    """A rank of a :class:`RankDriver` died during a call (its process, or its node): the
    trainer cannot go on. The message names the rank and its node."""


class RankDriver:
    """A :class:`TrainBackend` whose ranks run elsewhere (followers of this process, Ray actors):
    every call goes to all of them through ``_call(name, *args)``, which returns rank 0's result.
    A subclass defines ``_call`` and ``close``."""

    def _call(self, name: str, *args: object) -> Any:
        raise NotImplementedError(f"{type(self).__name__}._call")

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self._call("logprobs", batch)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        return self._call("train_step", batch)

    def named_weights(self) -> dict[str, torch.Tensor]:
        return self._call("named_weights")

    def save_pretrained(self, path: str | Path) -> None:
        self._call("save_pretrained", path)

    def save_state(self, path: str | Path) -> None:
        self._call("save_state", path)

    def load_state(self, path: str | Path) -> None:
        self._call("load_state", path)


class BackendOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What a backend is built with: its ``[train.backend]`` table, the optimizer settings of
    ``[train]``, the ``[loss]`` table, the rollout temperature (logprobs are of
    ``logits / temperature``, as the engines sample), its threads and ``[model] trust_remote_code``."""

    backend: BackendConfig = TorchBackendConfig()
    lr: float = 1e-4
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    loss: LossConfig = LossConfig()
    temperature: float = 1.0
    threads: int = 1
    trust_remote_code: bool = False
    lora: LoraConfig = LoraConfig()


def build_backend(model_path: str, options: BackendOptions) -> TrainBackend:
    """The backend ``options.backend.type`` names, loaded from the checkpoint at ``model_path``."""
    require_installed(options.backend)
    common = {
        "lr": options.lr,
        "warmup_steps": options.warmup_steps,
        "weight_decay": options.weight_decay,
        "grad_clip": options.grad_clip,
        "loss": options.loss,
        "temperature": options.temperature,
    }
    if isinstance(b := options.backend, MegatronBackendConfig):  # megatron-core is imported only here
        from loong_train.backends.megatron.driver import MegatronDriver

        return MegatronDriver(
            model_path,
            tp=b.tp,
            pp=b.pp,
            dp=b.dp,
            threads=options.threads,
            gpus=b.gpus,
            placement=b.placement,
            placement_timeout_s=b.placement_timeout_s,
            micro_batch_rows=b.micro_batch_rows,
            **common,
        )
    if isinstance(b, FsdpBackendConfig):
        from loong_train.backends.fsdp_ranks import FsdpDriver

        return FsdpDriver(
            model_path,
            ranks=b.ranks,
            threads=options.threads,
            placement=b.placement,
            placement_timeout_s=b.placement_timeout_s,
            trust_remote_code=options.trust_remote_code,
            max_tokens_per_micro_batch=b.max_tokens_per_micro_batch,
            **common,
        )
    from loong_train.backends.torch_backend import TorchBackend

    return TorchBackend.from_pretrained(
        model_path,
        trust_remote_code=options.trust_remote_code,
        max_tokens_per_micro_batch=b.max_tokens_per_micro_batch,
        lora=options.lora,
        **common,
    )


def backend_problem(config: BackendConfig, model: DecoderConfig) -> str:
    """Why the backend ``config`` names cannot train a decoder-family model of config ``model``
    ('' when it can), asked without building the backend or importing megatron-core."""
    if isinstance(config, MegatronBackendConfig):
        from loong_train.backends.megatron.model import megatron_problem

        return megatron_problem(model)
    return ""
