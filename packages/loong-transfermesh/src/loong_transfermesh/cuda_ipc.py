"""GPU transport for colocated processes: the trainer's packed update is shared with engines on
the same GPU through CUDA IPC memory handles, so the bytes never leave device memory.

The sender packs each version into one of two preallocated device buffers (by version parity, the
same double buffer as ``shm``), waits for the packing to finish, and publishes the manifest plus
the buffer's IPC handle (plain bytes and integers, no pickle) in a ``torch.distributed.TCPStore``
on loopback. A receiver opens the handle once per buffer and copies the update into its tensors
(``copy``) or makes them views of the shared buffer (``zero_copy``; then every receiver must have
applied ``v + 1`` before ``v + 2`` is pushed, as with ``shm``).

Lifecycle::

    sender = CudaIpcSender("127.0.0.1:29710", receivers=1)    # trainer process, GPU 0
    receiver = CudaIpcReceiver("127.0.0.1:29710")            # engine process, same GPU
    sender.push(dict(model.named_parameters()), version=1)
    receiver.apply(dict(engine.named_parameters()))          # -> 1
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
import torch

from loong_core.records import WeightManifest
from loong_transfermesh.manifest import (
    bucket_starts,
    build_manifest,
    check_against,
    install,
    pack_tensor,
    rendezvous_store,
    tensor_views,
)

__all__ = ["CudaIpcReceiver", "CudaIpcSender"]


class _Shared(msgspec.Struct, frozen=True):
    """A version's manifest and the IPC handle of the device buffer holding it."""

    manifest: WeightManifest
    handle: list  # torch.UntypedStorage._share_cuda_() fields: ints, bytes and a bool


class CudaIpcSender:
    def __init__(
        self,
        address: str,
        receivers: int,
        device: int = 0,
        bucket_bytes: int = 256 << 20,
        timeout_s: float = 300.0,
    ) -> None:
        self.device, self.bucket_bytes = torch.device("cuda", device), bucket_bytes
        self._store = rendezvous_store(address, receivers + 1, True, timeout_s)
        self._buffers: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def push(self, named: Mapping[str, torch.Tensor], version: int) -> WeightManifest:
        manifest = build_manifest(named, version, self.bucket_bytes)
        flat = self._buffers.get(version % 2)
        if flat is None or flat.numel() < manifest.total_bytes:  # allocated once per parity
            flat = self._buffers[version % 2] = torch.zeros(
                manifest.total_bytes, dtype=torch.uint8, device=self.device
            )
        starts = bucket_starts(manifest)
        for e, tensor in zip(manifest.tensors, named.values(), strict=True):
            pack_tensor(flat, starts[e.bucket] + e.offset, e.nbytes, tensor.to(self.device), False)
        torch.cuda.current_stream(self.device).synchronize()  # receivers read finished bytes only
        handle = list(flat.untyped_storage()._share_cuda_())
        shared = _Shared(manifest, handle)
        self._store.set(f"loong-tm/ipc/{version}", msgspec.msgpack.encode(shared))
        self._store.set("loong-tm/latest", str(version))
        return manifest

    def close(self) -> None:
        self._buffers.clear()


class CudaIpcReceiver:
    def __init__(self, address: str, mode: str = "copy", timeout_s: float = 300.0) -> None:
        self.mode, self.version = mode, -1
        self._store = rendezvous_store(address, 1, False, timeout_s)
        self._opened: dict[tuple, torch.Tensor] = {}  # (handle, size, offset) -> flat view

    @torch.no_grad()
    def apply(self, targets: Mapping[str, torch.Tensor], version: int | None = None) -> int:
        version = int(self._store.get("loong-tm/latest")) if version is None else version
        shared = msgspec.msgpack.decode(self._store.get(f"loong-tm/ipc/{version}"), type=_Shared)
        check_against(shared.manifest, targets)
        install(targets, tensor_views(self._open(shared.handle), shared.manifest), self.mode)
        self.version = version
        return version

    def newest(self) -> int:
        """The version the targets hold (this transport keeps no other)."""
        return self.version

    def _open(self, handle: list) -> torch.Tensor:
        # Small buffers share one caching-allocator segment, hence one IPC handle: a buffer is
        # the handle's segment at an offset, so (handle, size, offset) names it.
        key = (bytes(handle[1]), handle[2], handle[3])
        if key not in self._opened:
            storage = torch.UntypedStorage._new_shared_cuda(*handle)
            self._opened[key] = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        return self._opened[key]

    def close(self) -> None:
        self._opened.clear()
