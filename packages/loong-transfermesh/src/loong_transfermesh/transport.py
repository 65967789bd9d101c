"""The two halves of every transport, and the config that picks one.

A sender takes named tensors and a version; a receiver applies a version to local tensors (a
model's ``named_parameters()`` or any named buffers) and reports it. Every transport packs
tensors into 64-byte-aligned buckets (``manifest.build_manifest``), ships the manifest first,
validates it against the receiver's tensors before any byte is applied, verifies a checksum per
bucket, and exposes a version only once all of it arrived: a receiver never holds half an update.

Transports, one module each: ``shm`` (same host, write once, read by many), ``tcp`` (across hosts
without GPUs), ``nccl`` (GPU broadcast of flat buckets through cupy, extra ``[nccl]``) and
``cuda_ipc`` (colocated GPU processes sharing device memory). GPU modules import lazily.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch

from loong_core.records import WeightManifest
from loong_transfermesh.config import TransportConfig

__all__ = ["WeightReceiver", "WeightSender", "open_receiver", "open_sender"]


@runtime_checkable
class WeightSender(Protocol):
    """Publishes versions. ``push`` returns once the update is handed to the transport."""

    def push(self, named: Mapping[str, torch.Tensor], version: int) -> WeightManifest: ...

    def close(self) -> None: ...


@runtime_checkable
class WeightReceiver(Protocol):
    """Applies versions, all or nothing; ``version`` is the one its tensors hold (-1: none)."""

    version: int

    def apply(self, targets: Mapping[str, torch.Tensor], version: int | None = None) -> int: ...

    def close(self) -> None: ...


def open_sender(config: TransportConfig) -> WeightSender:
    """The sending half of ``config.type``."""
    if config.type == "shm":
        from loong_transfermesh.shm import ShmSender

        return ShmSender(config.name, config.bucket_bytes, bool(config.checksum))
    if config.type == "tcp" and config.delta:
        from loong_transfermesh.delta import DeltaSender

        return DeltaSender(config.address, key=config.key)
    if config.type == "tcp":
        from loong_transfermesh.tcp import TcpSender

        return TcpSender(config.address, config.bucket_bytes, config.checksum is not False, config.key)
    raise ValueError(f"transport {config.type!r} has no standalone sender here; use its module directly")


def open_receiver(config: TransportConfig, address: str | None = None) -> WeightReceiver:
    """The receiving half of ``config.type``; ``address`` is the ``tcp`` sender's bound address."""
    if config.type == "shm":
        from loong_transfermesh.shm import ShmReceiver

        return ShmReceiver(config.name, config.mode, config.timeout_s)
    if config.type == "tcp" and config.delta:
        from loong_transfermesh.delta import DeltaReceiver

        return DeltaReceiver(address or config.address, config.timeout_s, config.key)
    if config.type == "tcp":
        from loong_transfermesh.tcp import TcpReceiver

        return TcpReceiver(address or config.address, config.timeout_s, config.key, config.mode)
    raise ValueError(f"transport {config.type!r} has no standalone receiver here; use its module directly")
