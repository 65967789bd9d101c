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
from loong_transfermesh.manifest import TransferFailed

__all__ = ["WeightReceiver", "WeightSender", "catch_up", "open_receiver", "open_sender"]


@runtime_checkable
class WeightSender(Protocol):
    """Publishes versions. ``push`` returns once the update is handed to the transport."""

    def push(self, named: Mapping[str, torch.Tensor], version: int) -> WeightManifest: ...

    def close(self) -> None: ...


@runtime_checkable
class WeightReceiver(Protocol):
    """Applies versions, all or nothing; ``version`` is the one its tensors hold (-1: none);
    ``newest()`` the newest it could apply now without waiting (its own, or one the transport
    holds for it: an shm slot, a staged background receive)."""

    version: int

    def apply(self, targets: Mapping[str, torch.Tensor], version: int | None = None) -> int: ...

    def newest(self) -> int: ...

    def close(self) -> None: ...


def open_sender(config: TransportConfig, receivers: int = 0) -> WeightSender:
    """The sending half of ``config.type``; ``receivers``: how many the owner will connect (a
    ``tcp`` push waits up to ``timeout_s`` for them, so none misses a version while connecting)."""
    if config.type == "shm":
        from loong_transfermesh.shm import ShmSender

        return ShmSender(config.name, config.bucket_bytes, bool(config.checksum))
    if config.type == "tcp" and config.delta:
        from loong_transfermesh.delta import DeltaSender

        return DeltaSender(config.address, key=config.key)
    if config.type == "tcp":
        from loong_transfermesh.tcp import TcpSender

        checksum = config.checksum is not False
        return TcpSender(
            config.address, config.bucket_bytes, checksum, config.key, receivers, config.timeout_s
        )
    raise ValueError(f"transport {config.type!r} has no standalone sender here; use its module directly")


def open_receiver(
    config: TransportConfig, address: str | None = None, *, background: bool = False
) -> WeightReceiver:
    """The receiving half of ``config.type``; ``address`` is the ``tcp`` sender's bound address.

    ``background``: updates are taken off the transport as they are pushed, so a push never waits
    for the receiver to call ``apply`` (what an owner needs whose receivers apply at times of their
    own, e.g. between rollout calls). ``shm`` is that way already (the slots hold the update);
    ``tcp`` then receives on a thread of its own (:class:`~loong_transfermesh.tcp.TcpReceiver`).
    """
    if config.type == "tcp" and config.delta and background:
        raise ValueError(
            "tcp delta receivers read the stream inside apply: background receiving needs delta = false"
        )
    if config.type == "shm":
        from loong_transfermesh.shm import ShmReceiver

        return ShmReceiver(config.name, config.mode, config.timeout_s)
    if config.type == "tcp" and config.delta:
        from loong_transfermesh.delta import DeltaReceiver

        return DeltaReceiver(address or config.address, config.timeout_s, config.key)
    if config.type == "tcp":
        from loong_transfermesh.tcp import TcpReceiver

        return TcpReceiver(address or config.address, config.timeout_s, config.key, config.mode, background)
    raise ValueError(f"transport {config.type!r} has no standalone receiver here; use its module directly")


def catch_up(
    config: TransportConfig, targets: Mapping[str, torch.Tensor], held: int, address: str | None = None
) -> int:
    """For a receiver that starts after versions were pushed (a restarted engine): apply the newest
    version the transport still holds, if newer than ``held``; returns the version the targets hold.

    ``shm`` keeps the last two versions in its slots: the newest is read with a copy (never a view:
    the owner's reuse rule, :meth:`TransportConfig.must_have_applied`, does not count this reader, so
    its slot may be reused after the read; reused during it, the read fails and the next attempt takes
    the newer version). Streaming transports keep nothing: the next push brings the receiver up to date.
    """
    if config.type != "shm":
        return held
    from loong_transfermesh.shm import ShmReceiver

    receiver = ShmReceiver(config.name, "copy", config.timeout_s)
    try:
        for attempt in range(5):
            if receiver.newest() <= held:
                return held
            try:
                return receiver.apply(targets)
            except TransferFailed:
                if attempt == 4:
                    raise
        return held
    finally:
        receiver.close()
