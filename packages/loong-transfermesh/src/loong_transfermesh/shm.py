"""Same-host transport: the sender writes each bucket once into shared memory and any number of
receivers on the host read it, concurrently and while the sender is still writing later buckets.

A transport ``name`` owns two slots (files under ``/dev/shm``) that alternate by version parity.
A slot holds a header, the manifest, a stamp per bucket and the bucket bytes::

    [header 64 B: magic, version, sender pid, manifest bytes, buckets, data offset, checksummed]
    [manifest (msgpack)] [stamps: (version, checksum) per bucket] ... [buckets, 4 KiB aligned]

Pushing version ``v`` into slot ``v % 2``: invalidate the header, write the manifest and reset
the stamps, publish the header version, then per bucket copy the tensors in, optionally checksum
it (sum64, while its bytes are still in cache) and stamp it with ``v``.

Checksums are off by default here: sender and receivers share the same pages, so there is no
link to corrupt bytes, and a torn write (sender died, slot reused) is caught by the stamps and
the final header check. Turning them on costs the sender about 0.6x of a memcpy and every
receiver a read of the update. A receiver waits for the header,
validates the manifest against its own tensors, then follows the stamps bucket by bucket, so its
reading overlaps the sender's writing. Nothing reaches the receiver's tensors until every bucket
has arrived and verified, and the slot still holds ``v`` (it was not reused during the read).

Receiver modes:

- ``copy``: the update is copied into the receiver's tensors (any tensors; one extra copy).
- ``zero_copy``: the receiver's tensors become views into the slot (``tensor.data`` is swapped),
  so an update costs the sender's single write. Use parameters (``model.named_parameters()``),
  whose ``.data`` the model reads.

The rule the owner keeps (the two slots are a double buffer): in ``copy`` mode every receiver has
applied ``v`` before ``v + 2`` is pushed; in ``zero_copy`` mode every receiver has applied ``v + 1``
before ``v + 2`` is pushed (the receivers still read version ``v``'s slot until they swap).

Lifecycle::

    sender = ShmSender("run-42")                          # trainer process
    sender.push(dict(model.named_parameters()), version=1)
    receiver = ShmReceiver("run-42")                      # any process on the host
    receiver.apply(dict(engine.named_parameters()))       # -> 1 (waits for it if needed)
    sender.close()                                        # unlinks the slots (also at exit)
"""

from __future__ import annotations

import atexit
import mmap
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import torch

from loong_core.records import WeightManifest, decode, encode
from loong_transfermesh.manifest import (
    ManifestMismatch,
    TransferFailed,
    bucket_starts,
    build_manifest,
    check_against,
    install,
    pack_tensor,
    sum64,
    tensor_views,
)

__all__ = ["ShmReceiver", "ShmSender", "remove_slots"]

_SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
_MAGIC = int.from_bytes(b"LOONGTM1", "little")
_HEADER = 64
_PAGE = 4096
_RETIRED = -2  # header version of a slot file the sender replaced with a larger one
_MAGIC_F, _VERSION_F, _PID_F, _MANIFEST_F, _BUCKETS_F, _DATA_F, _CHECKSUM_F = range(7)


def _slot_path(name: str, slot: int) -> Path:
    return _SHM_DIR / f"loong-tm-{name}-{slot}"


def remove_slots(name: str) -> None:
    """Unlink the slots of transport ``name`` (safe from any process, e.g. an owner cleaning up
    after a sender died). Receivers that still map a slot keep their mapping."""
    for slot in (0, 1):
        path = _slot_path(name, slot)
        path.unlink(missing_ok=True)
        for staging in path.parent.glob(f"{path.name}.*.new"):  # a sender died while growing a slot
            staging.unlink(missing_ok=True)


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


class _Slot:
    """One mapped slot file: header and stamp views, and the flat byte tensor of the file."""

    def __init__(self, path: Path, size: int | None = None) -> None:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if size else 0), 0o600)
        try:
            if size:
                os.ftruncate(fd, size)
            stat = os.fstat(fd)
            self.inode, self.size = stat.st_ino, stat.st_size
            self._mm = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.flat = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.header = self.flat[:_HEADER].view(torch.int64)

    @property
    def data(self) -> int:
        """Offset of the first bucket."""
        return int(self.header[_DATA_F])

    def stamps(self, manifest_nbytes: int, buckets: int) -> torch.Tensor:
        """``[buckets, 2]`` int64: (version, checksum bits) of each bucket."""
        begin = _align(_HEADER + manifest_nbytes, 8)
        return self.flat[begin : begin + 16 * buckets].view(torch.int64).view(buckets, 2)


class ShmSender:
    """Writes named tensors into a shared-memory slot; buffers are allocated once and reused."""

    def __init__(self, name: str, bucket_bytes: int = 64 << 20, checksum: bool = False) -> None:
        self.name, self.bucket_bytes, self.checksum = name, bucket_bytes, checksum
        self._slots: dict[int, _Slot] = {}
        atexit.register(self.close)

    @torch.no_grad()
    def push(self, named: Mapping[str, torch.Tensor], version: int) -> WeightManifest:
        """Write version ``version``; returns its manifest with the bucket checksums filled in."""
        manifest = build_manifest(named, version, self.bucket_bytes)
        blob = encode(manifest)
        slot = self._slot(version % 2, len(blob), manifest)
        head = slot.header
        head[_VERSION_F] = -1
        slot.flat[_HEADER : _HEADER + len(blob)].copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
        stamps = slot.stamps(len(blob), len(manifest.bucket_sizes))
        stamps[:, 0] = -1
        data = slot.data
        head[_MANIFEST_F], head[_BUCKETS_F] = len(blob), len(manifest.bucket_sizes)
        head[_PID_F], head[_CHECKSUM_F] = os.getpid(), int(self.checksum)
        head[_VERSION_F] = version
        sums = [0] * len(manifest.bucket_sizes)
        tensors = list(named.values())
        starts = bucket_starts(manifest)
        for i, entry in enumerate(manifest.tensors):
            begin = data + starts[entry.bucket] + entry.offset
            sums[entry.bucket] += pack_tensor(slot.flat, begin, entry.nbytes, tensors[i], self.checksum)
            last = i + 1 == len(manifest.tensors) or manifest.tensors[i + 1].bucket != entry.bucket
            if last:
                stamps[entry.bucket, 1] = _as_int64(sums[entry.bucket] % (1 << 64))
                stamps[entry.bucket, 0] = version
        if self.checksum:
            manifest.checksums = [s % (1 << 64) for s in sums]
        return manifest

    def _slot(self, index: int, manifest_nbytes: int, manifest: WeightManifest) -> _Slot:
        need_data = _align(_HEADER + manifest_nbytes + 8 + 16 * len(manifest.bucket_sizes), _PAGE)
        held = self._slots.get(index)
        if held is None or held.data < need_data or held.size < held.data + manifest.total_bytes:
            data = _align(need_data + need_data // 4, _PAGE)  # room for the manifest to grow
            path = _slot_path(self.name, index)
            staging = path.with_name(f"{path.name}.{os.getpid()}.new")
            held = _Slot(staging, data + manifest.total_bytes)
            held.flat.zero_()  # touch every page once, here, not during an update
            held.header[_MAGIC_F], held.header[_DATA_F], held.header[_VERSION_F] = _MAGIC, data, -1
            old = self._slots.get(index)
            if old is not None:
                old.header[_VERSION_F] = _RETIRED  # receivers waiting on the old file reopen
            os.replace(staging, path)  # appears whole; receivers mapping the old file keep it
            self._slots[index] = held
        return held

    def close(self) -> None:
        self._slots.clear()
        remove_slots(self.name)


def _as_int64(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


Mode = Literal["copy", "zero_copy"]


class ShmReceiver:
    """Applies versions from the slots of transport ``name`` to local tensors, all or nothing."""

    def __init__(self, name: str, mode: Mode = "copy", timeout_s: float = 60.0) -> None:
        if mode not in ("copy", "zero_copy"):
            raise ValueError(f"mode must be 'copy' or 'zero_copy', got {mode!r}")
        self.name, self.mode, self.timeout_s = name, mode, timeout_s
        self.version = -1
        self._slots: dict[int, _Slot] = {}

    @torch.no_grad()
    def apply(self, targets: Mapping[str, torch.Tensor], version: int | None = None) -> int:
        """Apply ``version`` (default: the newest in the slots, newer than ours) to ``targets``;
        waits while the sender is still writing it. Returns the version now applied.

        Raises ManifestMismatch (names, shapes, dtypes or a checksum differ) or TransferFailed
        (sender died, timed out, or the slot was reused); either way no target was touched."""
        version = self._newest() if version is None else version
        deadline = time.monotonic() + self.timeout_s
        while True:  # the sender may not have created the slot yet, or may replace it
            slot = self._open(version % 2, deadline)
            head = slot.header
            _wait(
                lambda h=head: int(h[_VERSION_F]) in (version, _RETIRED),
                head,
                version,
                deadline,
                "its manifest",
            )
            if int(head[_VERSION_F]) == version:
                break
        nbytes = int(head[_MANIFEST_F])
        manifest = decode(slot.flat[_HEADER : _HEADER + nbytes].numpy().tobytes(), WeightManifest)
        check_against(manifest, targets)
        stamps = slot.stamps(nbytes, len(manifest.bucket_sizes))
        data, starts, verify = slot.data, bucket_starts(manifest), bool(head[_CHECKSUM_F])
        for b, (start, size) in enumerate(zip(starts, manifest.bucket_sizes, strict=True)):
            _wait(lambda b=b: int(stamps[b, 0]) == version, head, version, deadline, f"bucket {b}")
            expected = int(stamps[b, 1]) % (1 << 64)
            if verify and sum64(slot.flat[data + start : data + start + size]) != expected:
                names = [e.name for e in manifest.tensors if e.bucket == b]
                raise ManifestMismatch(f"bucket {b} checksum mismatch (tensors {', '.join(names[:4])})")
        views = tensor_views(slot.flat, manifest, data)
        if int(head[_VERSION_F]) != version:
            raise TransferFailed(f"slot of version {version} was reused while reading it")
        install(targets, views, self.mode)
        self.version = version
        return version

    def read(self, version: int) -> dict[str, torch.Tensor]:
        """Views of every tensor of a fully written ``version`` (valid until its slot is reused)."""
        slot = self._open(version % 2)
        head = slot.header
        if int(head[_VERSION_F]) != version:
            raise TransferFailed(f"version {version} is not in its slot (found {int(head[_VERSION_F])})")
        nbytes = int(head[_MANIFEST_F])
        manifest = decode(slot.flat[_HEADER : _HEADER + nbytes].numpy().tobytes(), WeightManifest)
        return tensor_views(slot.flat, manifest, slot.data)

    def newest(self) -> int:
        """The newest version in the slots (its buckets may still be arriving), -1 when none is:
        nothing pushed yet under this name, or only a push in its first moments."""
        found = [-1]
        for index in (0, 1):
            try:
                found.append(int(self._open(index).header[_VERSION_F]))
            except TransferFailed:
                continue
        return max(found)

    def _newest(self) -> int:
        newest = self.newest()
        if newest <= self.version:
            raise TransferFailed(f"no version newer than {self.version} in shared memory '{self.name}'")
        return newest

    def _open(self, index: int, deadline: float | None = None) -> _Slot:
        """Map slot ``index`` (again if the sender replaced it), waiting until ``deadline`` for
        it to appear."""
        path = _slot_path(self.name, index)
        while True:
            try:
                stat = path.stat()
                break
            except FileNotFoundError:
                if deadline is None or time.monotonic() > deadline:
                    raise TransferFailed(f"no shared-memory slot {path}: has the sender pushed?") from None
                time.sleep(0.001)
        held = self._slots.get(index)
        if held is None or held.inode != stat.st_ino or held.size != stat.st_size:
            held = self._slots[index] = _Slot(path)
            if int(held.header[_MAGIC_F]) != _MAGIC:
                raise TransferFailed(f"{path} is not a Loong TransferMesh slot")
        return held

    def close(self) -> None:
        self._slots.clear()


def _wait(ready, head: torch.Tensor, version: int, deadline: float, what: str) -> None:
    """Poll until ``ready()``; fail fast if the slot moved past ``version`` or the sender process
    is gone. The sleep between polls grows with the time already waited (a twentieth of it, at
    most 1 ms), so a long update costs a waiting receiver little CPU and a short one little delay."""
    pid, polls, start = int(head[_PID_F]), 0, time.monotonic()
    while not ready():
        current = int(head[_VERSION_F])
        if current > version:
            raise TransferFailed(f"version {version} was overwritten by {current} before it was read")
        polls += 1
        now = time.monotonic()
        if polls % 64 == 0:
            if now > deadline:
                raise TransferFailed(f"timed out waiting for {what} of version {version}")
            pid = int(head[_PID_F]) or pid
            if pid and not _alive(pid):
                raise TransferFailed(f"sender process {pid} died before writing {what} of version {version}")
        time.sleep(min(0.001, (now - start) / 20))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
