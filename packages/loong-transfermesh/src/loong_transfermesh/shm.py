"""Same-host transport: the sender writes each update once into shared memory, any number of
receivers on the host read it.

Two slots (files under ``/dev/shm``) alternate by version parity, so receivers can still read
version ``v`` while the sender writes ``v + 1``; the owner makes sure every receiver applied
``v`` before ``v + 2`` is pushed. Slots are allocated and touched once and reused across
updates. The manifest (small) travels by any channel; bytes never leave shared memory.
The rule the owner keeps: every receiver has applied version ``v`` before ``v + 2`` is pushed.

Lifecycle::

    sender = ShmSender("run-42")                 # trainer side
    manifest = sender.push(model.state_dict(), version=1)
    receiver = ShmReceiver()                     # engine side, any process on the host
    receiver.apply(manifest, dict(model.named_parameters()))  # validates, then copies
    sender.close()                               # unlinks the slots
"""

from __future__ import annotations

import atexit
import mmap
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from loong_core.records import WeightManifest
from loong_transfermesh.manifest import ManifestMismatch, build_manifest, check_against, crc32, torch_dtype

__all__ = ["ShmReceiver", "ShmSender", "remove_slots"]

_SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


def _slot_path(name: str, slot: int) -> Path:
    return _SHM_DIR / f"loong-tm-{name}-{slot}"


def _map(path: Path, size: int, create: bool) -> tuple[mmap.mmap, torch.Tensor]:
    flags = os.O_RDWR | (os.O_CREAT if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, max(size, 1))
        mm = mmap.mmap(fd, max(size, 1))
    finally:
        os.close(fd)
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


class ShmSender:
    """Writes named tensors into a shared-memory slot and returns the manifest describing them."""

    def __init__(self, name: str, bucket_bytes: int = 64 << 20) -> None:
        self.name, self.bucket_bytes = name, bucket_bytes
        self._slots: dict[int, tuple[mmap.mmap, torch.Tensor]] = {}
        atexit.register(self.close)

    def push(self, named: Mapping[str, torch.Tensor], version: int) -> WeightManifest:
        manifest = build_manifest(named, version, self.bucket_bytes)
        flat = self._slot(version % 2, manifest.total_bytes)
        starts = _bucket_starts(manifest)
        for entry, tensor in zip(manifest.tensors, named.values(), strict=True):
            begin = starts[entry.bucket] + entry.offset
            flat[begin : begin + entry.nbytes].copy_(tensor.detach().reshape(-1).view(torch.uint8))
        manifest.checksums = [
            crc32(flat[s : s + n]) for s, n in zip(starts, manifest.bucket_sizes, strict=True)
        ]
        return manifest

    def _slot(self, slot: int, size: int) -> torch.Tensor:
        held = self._slots.get(slot)
        if held is None or held[1].numel() < size:
            mm, flat = _map(_slot_path(self.name, slot), size, create=True)
            flat.zero_()  # touch every page once, here, not during the first update
            self._slots[slot] = (mm, flat)
        return self._slots[slot][1][:size]

    def close(self) -> None:
        self._slots.clear()
        remove_slots(self.name)


def remove_slots(name: str) -> None:
    """Unlink the shared-memory slots of transport ``name`` (safe to call from any process,
    e.g. the owner cleaning up after a sender process died)."""
    for slot in (0, 1):
        _slot_path(name, slot).unlink(missing_ok=True)


class ShmReceiver:
    """Validates a manifest against local tensors, verifies checksums, then copies in."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.version = -1

    def read(self, manifest: WeightManifest) -> dict[str, torch.Tensor]:
        """Views of every tensor in the slot (valid until the sender reuses the slot)."""
        path = _slot_path(self.name, manifest.version % 2)
        if not path.exists():
            raise ManifestMismatch(f"no shared-memory slot {path} for version {manifest.version}")
        _, flat = _map(path, manifest.total_bytes, create=False)
        starts = _bucket_starts(manifest)
        for i, (s, n) in enumerate(zip(starts, manifest.bucket_sizes, strict=True)):
            if manifest.checksums and crc32(flat[s : s + n]) != manifest.checksums[i]:
                names = [e.name for e in manifest.tensors if e.bucket == i]
                raise ManifestMismatch(f"bucket {i} checksum mismatch (tensors {names[:3]}...)")
        out = {}
        for e in manifest.tensors:
            begin = starts[e.bucket] + e.offset
            out[e.name] = flat[begin : begin + e.nbytes].view(torch_dtype(e.dtype)).view(e.shape)
        return out

    @torch.no_grad()
    def apply(self, manifest: WeightManifest, targets: Mapping[str, torch.Tensor]) -> int:
        """Copy the update into ``targets``; nothing is written unless all of it validates."""
        check_against(manifest, targets)
        for name, tensor in self.read(manifest).items():
            targets[name].copy_(tensor)
        self.version = manifest.version
        return self.version


def _bucket_starts(manifest: WeightManifest) -> list[int]:
    starts, pos = [], 0
    for size in manifest.bucket_sizes:
        starts.append(pos)
        pos += size
    return starts
