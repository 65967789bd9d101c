"""The ``[train.backend]`` table: which train backend runs the optimizer steps, picked by ``type``.

- ``type = "torch"`` (:class:`TorchBackendConfig`): one process, CPU
  (:mod:`loong_train.backends.torch_backend`);
- ``type = "fsdp"`` (:class:`FsdpBackendConfig`): the torch backend's step over ``ranks`` Ray
  actors, parameters sharded with FSDP2 (:mod:`loong_train.backends.fsdp`);
- ``type = "megatron"`` (:class:`MegatronBackendConfig`): megatron-core over ``tp * pp * dp``
  processes (:mod:`loong_train.backends.megatron`; the ``loong-train[megatron]`` extra).

Pure msgspec (no torch): recipes validate without loading a backend. Whether an extra is
installed is checked by :func:`require_installed`, which the backend's build and the controller's
preflight call, not by validation.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

import msgspec

from loong_core.config import ConfigError

__all__ = [
    "BackendConfig",
    "FsdpBackendConfig",
    "LoraConfig",
    "MegatronBackendConfig",
    "TorchBackendConfig",
    "require_installed",
]


class _Backend(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type"):
    @property
    def type(self) -> str:
        """The table's ``type`` (the Struct's tag)."""
        return str(type(self).__struct_config__.tag)

    @property
    def trainer_gpus(self) -> float:
        """GPUs Ray reserves for the trainer actor: all the trainer's (``gpus``), unless ranks
        of their own reserve some."""
        return self.gpus


class TorchBackendConfig(_Backend, tag="torch"):
    """``[train.backend] type = "torch"``: the trainer's own process, on CPU. A batch's rows are
    packed end to end into micro-batches of at most ``max_tokens_per_micro_batch`` tokens (a
    longer row goes alone; 0: the whole batch at once), whose gradients add up to the batch's:
    it bounds the activations' memory, not the result."""

    max_tokens_per_micro_batch: int = 8192

    def __post_init__(self) -> None:
        if self.max_tokens_per_micro_batch < 0:
            raise ValueError(
                f"max_tokens_per_micro_batch must be >= 0, got {self.max_tokens_per_micro_batch}"
            )

    @property
    def gpus(self) -> float:
        """GPUs the trainer uses: none."""
        return 0.0


class FsdpBackendConfig(_Backend, tag="fsdp"):
    """``[train.backend] type = "fsdp"``: data parallelism over ``ranks`` processes, each a Ray
    actor reserving ``train.threads`` CPUs, its parameters, gradients and AdamW state sharded with
    FSDP2 (CPU under gloo for now). The actors form a placement group of one bundle per rank,
    placed by ``placement`` (Ray's strategies: ``"PACK"`` keeps ranks on as few nodes as fit,
    ``"SPREAD"`` spreads them where it can, ``"STRICT_PACK"`` / ``"STRICT_SPREAD"`` insist);
    rank 0's node is the rendezvous. ``max_tokens_per_micro_batch`` as for ``"torch"``, per rank.
    ``placement_timeout_s``: how long to wait for the cluster to place every rank."""

    ranks: int = 2
    max_tokens_per_micro_batch: int = 8192
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    placement_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.max_tokens_per_micro_batch < 0 or self.placement_timeout_s <= 0:
            raise ValueError(
                f"expected ranks >= 1, max_tokens_per_micro_batch >= 0 and placement_timeout_s > 0, got "
                f"ranks {self.ranks}, max_tokens_per_micro_batch {self.max_tokens_per_micro_batch}, "
                f"placement_timeout_s {self.placement_timeout_s}"
            )

    @property
    def gpus(self) -> float:
        """GPUs the trainer uses: none (CPU under gloo for now)."""
        return 0.0


class MegatronBackendConfig(_Backend, tag="megatron"):
    """``[train.backend] type = "megatron"``: megatron-core with ``tp``-way tensor, ``pp``-way
    pipeline and ``dp``-way data parallelism over ``tp * pp * dp`` ranks; batches are split
    into micro-batches of ``micro_batch_rows`` rows (0: one micro-batch per data-parallel rank).
    Rank 0 is the trainer's own process, ranks 1.. are Ray actors in a placement group placed by
    ``placement`` (as for ``"fsdp"``; ``"PACK"`` keeps a model-parallel group on one node where
    it fits), each reserving ``train.threads`` CPUs; the world meets at rank 0's node address.
    ``gpus``: the trainer's GPUs in all, one per rank (0: CPU under gloo; with one rank, a
    fraction shares its GPU with a rollout worker)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch_rows: int = 0
    gpus: float = 0.0
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    placement_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.micro_batch_rows < 0:
            raise ValueError(f"micro_batch_rows must be >= 0, got {self.micro_batch_rows}")
        if self.gpus < 0 or (self.gpus > 1 and self.gpus % 1):
            raise ValueError(f"gpus must be a fraction of one GPU or a whole number, got {self.gpus}")
        if self.gpus not in (0, self.world) and not (self.world == 1 and self.gpus < 1):
            raise ValueError(
                f"gpus = {self.gpus}: with tp * pp * dp = {self.world} ranks, one GPU per rank "
                f"(gpus = {self.world}), none (0, CPU), or with one rank a fraction of one"
            )
        if self.placement_timeout_s <= 0:
            raise ValueError(f"placement_timeout_s must be > 0, got {self.placement_timeout_s}")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def trainer_gpus(self) -> float:
        """GPUs Ray reserves for the trainer actor: rank 0's (the other ranks reserve their own)."""
        return self.gpus / self.world


BackendConfig = TorchBackendConfig | FsdpBackendConfig | MegatronBackendConfig


class LoraConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[train.lora]``: train low-rank adapters instead of the whole model (``rank = 0``, the
    default: off), with ``peft``'s LoRA (:mod:`loong_train.backends.lora`). ``alpha``: the scale's
    numerator (the update is ``alpha / rank * B @ A``; 0: ``2 * rank``); ``dropout`` on the
    adapter's input; ``target_modules``: module names (``["q_proj", "v_proj"]``) or
    ``"all-linear"`` (every linear layer but the LM head). ``sync``: what a weight update sends,
    the adapters alone (``"adapter"``; engines merge them into their copy of the base weights) or
    every weight with the adapter merged in (``"merged"``). ``save_merged``: the final checkpoint
    also holds the merged model under ``merged/``. The torch backend only."""

    rank: int = 0
    alpha: float = 0.0
    dropout: float = 0.0
    target_modules: list[str] | str = "all-linear"
    sync: Literal["adapter", "merged"] = "adapter"
    save_merged: bool = False

    def __post_init__(self) -> None:
        if self.rank < 0 or self.alpha < 0 or not 0 <= self.dropout < 1:
            raise ValueError(
                f"expected rank >= 0, alpha >= 0 and 0 <= dropout < 1, got rank {self.rank}, "
                f"alpha {self.alpha}, dropout {self.dropout}"
            )
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            raise ValueError(
                f"target_modules must be a list of module names or 'all-linear', got {self.target_modules!r}"
            )
        if not self.target_modules:
            raise ValueError("target_modules is empty: name the modules to adapt, or 'all-linear'")
        defaults = {f.name: f.default for f in msgspec.structs.fields(self) if f.name != "rank"}
        if not self.rank and (given := [f for f, d in defaults.items() if getattr(self, f) != d]):
            raise ValueError(
                f"rank = 0 turns LoRA off, but {', '.join(given)} {'is' if len(given) == 1 else 'are'} "
                "set: give rank > 0 to train adapters, or leave the table out"
            )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """``alpha / rank``: what multiplies ``B @ A``."""
        return (self.alpha or 2 * self.rank) / self.rank


def require_installed(config: BackendConfig) -> None:
    """Raise ConfigError, naming the extra to install, when ``config``'s backend is not installed."""
    if isinstance(config, MegatronBackendConfig) and not _have_megatron_core():
        raise ConfigError(
            "train.backend.type = 'megatron' needs megatron-core, which is not installed "
            "(install the extra: pip install 'loong-train[megatron]')"
        )


def _have_megatron_core() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:  # no ``megatron`` package at all
        return False
