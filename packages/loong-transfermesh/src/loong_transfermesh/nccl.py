"""GPU transport: NCCL broadcast of flat buckets through cupy's NCCL bindings (extra ``[nccl]``).

Rank 0 is the sender; ranks 1..N are receivers, each on its own GPU (any host). The NCCL unique
id and every manifest travel through a ``torch.distributed.TCPStore`` hosted by the sender, so
no process group of the training job is touched. Per update the sender publishes the manifest,
then packs bucket ``i + 1`` into the second of two preallocated device buffers on a copy stream
while bucket ``i`` is broadcast on the NCCL stream. Receivers broadcast into a device staging
buffer of the whole update and expose it only when every bucket arrived: ``copy`` mode copies
into their tensors, ``zero_copy`` makes them views of the staging buffer (two alternate).

cupy is imported only when a communicator is created; on a machine without CUDA nothing here
runs (the tests are marked ``gpu``).

Lifecycle::

    sender = NcclSender("10.0.0.1:29700", receivers=4, device=0)   # trainer, rank 0
    receiver = NcclReceiver("10.0.0.1:29700", rank=1, receivers=4, device=0)  # each engine
    sender.push(dict(model.named_parameters()), version=1)
    receiver.apply(dict(engine.named_parameters()))              # -> 1
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import torch

from loong_core.records import WeightManifest, decode, encode
from loong_transfermesh.manifest import (
    bucket_starts,
    build_manifest,
    check_against,
    install,
    pack_tensor,
    rendezvous_store,
    tensor_views,
)

__all__ = ["NcclReceiver", "NcclSender"]


def _communicator(store, world: int, rank: int, device: torch.device):
    from cupy.cuda import Device, nccl

    if rank == 0:
        store.set("loong-tm/nccl-id", json.dumps(list(nccl.get_unique_id())))
    unique_id = tuple(json.loads(store.get("loong-tm/nccl-id")))
    with Device(device.index):
        return nccl.NcclCommunicator(world, unique_id, rank)


def _broadcast(comm, buf: torch.Tensor, stream: torch.cuda.Stream) -> None:
    from cupy.cuda import nccl

    comm.bcast(buf.data_ptr(), buf.numel(), nccl.NCCL_UINT8, 0, stream.cuda_stream)


class NcclSender:
    """Rank 0: broadcasts every pushed version to all receivers."""

    def __init__(
        self,
        address: str,
        receivers: int,
        device: int = 0,
        bucket_bytes: int = 256 << 20,
        timeout_s: float = 300.0,
    ) -> None:
        self.device = torch.device("cuda", device)
        self.bucket_bytes = bucket_bytes
        self._store = rendezvous_store(address, receivers + 1, True, timeout_s)
        self._comm = _communicator(self._store, receivers + 1, 0, self.device)
        self._staging = [torch.empty(0, dtype=torch.uint8, device=self.device)] * 2
        self._copy = torch.cuda.Stream(self.device)
        self._send = torch.cuda.Stream(self.device)

    @torch.no_grad()
    def push(self, named: Mapping[str, torch.Tensor], version: int) -> WeightManifest:
        manifest = build_manifest(named, version, self.bucket_bytes)
        self._store.set(f"loong-tm/manifest/{version}", encode(manifest))
        self._store.set("loong-tm/latest", str(version))
        largest = max(manifest.bucket_sizes, default=0)
        if self._staging[0].numel() < largest:  # allocated once, reused by every update
            self._staging = [torch.zeros(largest, dtype=torch.uint8, device=self.device) for _ in range(2)]
        tensors = list(named.values())
        self._copy.wait_stream(torch.cuda.current_stream(self.device))  # the tensors are final
        sent = [torch.cuda.Event(), torch.cuda.Event()]
        for b, size in enumerate(manifest.bucket_sizes):
            buf = self._staging[b % 2]
            with torch.cuda.stream(self._copy):
                self._copy.wait_event(sent[b % 2])  # the broadcast of bucket b - 2 is done with buf
                for i, e in enumerate(manifest.tensors):
                    if e.bucket == b:
                        pack_tensor(
                            buf, e.offset, e.nbytes, tensors[i].to(self.device, non_blocking=True), False
                        )
                packed = torch.cuda.Event()
                packed.record(self._copy)
            self._send.wait_event(packed)
            _broadcast(self._comm, buf[:size], self._send)
            sent[b % 2].record(self._send)
        self._send.synchronize()
        return manifest

    def close(self) -> None:
        self._comm = None


class NcclReceiver:
    """Rank ``rank`` (1..receivers): receives broadcast updates into a device staging buffer."""

    def __init__(
        self,
        address: str,
        rank: int,
        receivers: int,
        device: int = 0,
        mode: str = "copy",
        timeout_s: float = 300.0,
    ) -> None:
        self.device, self.mode, self.version = torch.device("cuda", device), mode, -1
        self._store = rendezvous_store(address, receivers + 1, False, timeout_s)
        self._comm = _communicator(self._store, receivers + 1, rank, self.device)
        self._staging = [torch.empty(0, dtype=torch.uint8, device=self.device)] * (
            2 if mode == "zero_copy" else 1
        )
        self._turn = 0
        self._stream = torch.cuda.Stream(self.device)

    def newest(self) -> int:
        """The version the targets hold (a broadcast is received only inside ``apply``)."""
        return self.version

    @torch.no_grad()
    def apply(self, targets: Mapping[str, torch.Tensor], version: int | None = None) -> int:
        """Receive ``version`` (default: the next one) and apply it; every receiver of the group
        must call this for every pushed version, since a broadcast needs all ranks."""
        version = self.version + 1 if version is None else version
        manifest = decode(self._store.get(f"loong-tm/manifest/{version}"), WeightManifest)
        check_against(manifest, targets)  # a mismatch here leaves the group out of step: fatal
        if self._staging[self._turn].numel() < manifest.total_bytes:  # all turns allocated at once
            self._staging = [
                torch.zeros(manifest.total_bytes, dtype=torch.uint8, device=self.device)
                for _ in self._staging
            ]
        staging = self._staging[self._turn]
        starts = bucket_starts(manifest)
        for start, size in zip(starts, manifest.bucket_sizes, strict=True):
            _broadcast(self._comm, staging[start : start + size], self._stream)
        self._stream.synchronize()
        install(targets, tensor_views(staging, manifest), self.mode)
        self._turn = (self._turn + 1) % len(self._staging)
        self.version = version
        return version

    def close(self) -> None:
        self._comm = None
