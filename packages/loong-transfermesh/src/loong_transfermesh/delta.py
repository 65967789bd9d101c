"""Delta transport for slow links: each update travels as the XOR of its packed bytes against the
previous version the receiver holds, compressed with zstd, with a sum64 checksum per tensor
(extra ``[delta]``).

Between two RL steps most bits of most weights do not change (high exponent and sign bits above
all), so the XOR is mostly zeros and compresses well; on a fast link the compression costs more
than it saves, so use ``tcp`` there. The sender keeps the previous version's packed bytes and,
per receiver, the version that receiver last got whole: a receiver that is new, reconnected or
behind gets a full (compressed) update instead of a delta. Frames reuse ``tcp``'s handshake::

    sender -> receiver   manifest_len flags manifest base_version payload_len payload checksums
    (base_version = 2**64 - 1 for a full update; checksums: one u64 per tensor, manifest order)

Lifecycle::

    sender = DeltaSender("0.0.0.0:29650", key=secret)
    receiver = DeltaReceiver("trainer-host:29650", key=secret)
    sender.wait_for_receivers(1)
    sender.push(dict(model.named_parameters()), version=1)   # full
    receiver.apply(dict(engine.named_parameters()))         # -> 1
    sender.push(dict(model.named_parameters()), version=2)   # delta against 1
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Mapping

import torch

from loong_core.records import WeightManifest, decode, encode
from loong_transfermesh.manifest import (
    ManifestMismatch,
    TransferFailed,
    bucket_starts,
    build_manifest,
    check_against,
    pack_tensor,
    sum64,
)
from loong_transfermesh.tcp import _HEAD, TcpReceiver, TcpSender, _recv_exact

__all__ = ["DeltaReceiver", "DeltaSender"]

_FULL = (1 << 64) - 1


def _zstd():
    try:
        import zstandard
    except ImportError:
        raise ImportError(
            "the delta transport needs zstandard: pip install 'loong-transfermesh[delta]'"
        ) from None
    return zstandard


def _xor(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = a ^ b`` over uint8 tensors whose length is a multiple of 8 (as int64 words)."""
    return torch.bitwise_xor(a.view(torch.int64), b.view(torch.int64), out=out.view(torch.int64)).view(
        torch.uint8
    )


def _tensor_sums(flat: torch.Tensor, manifest: WeightManifest) -> list[int]:
    starts = bucket_starts(manifest)
    return [sum64(flat[starts[e.bucket] + e.offset :][: -(-e.nbytes // 64) * 64]) for e in manifest.tensors]


class DeltaSender(TcpSender):
    """A TcpSender whose updates are zstd-compressed XOR deltas against each receiver's version."""

    def __init__(self, address: str = "127.0.0.1:0", level: int = 3, key: str = "") -> None:
        super().__init__(address, bucket_bytes=64 << 20, checksum=True, key=key)
        self._compressor = _zstd().ZstdCompressor(level=level)
        self._packed = [torch.empty(0, dtype=torch.uint8)] * 2  # this version and the previous one
        self._previous: tuple[int, list] | None = None  # (version, layout) of self._packed[1]
        self._holds: dict[socket.socket, int] = {}  # receiver -> version it holds whole
        self.last_payload_bytes: dict[str, int] = {}  # "full" / "delta" -> bytes of the last push

    @torch.no_grad()
    def push(self, named: Mapping[str, torch.Tensor], version: int) -> WeightManifest:
        manifest = build_manifest(named, version, self.bucket_bytes)
        current = self._pack(named, manifest)
        layout = [(e.name, e.shape, e.dtype, e.bucket, e.offset) for e in manifest.tensors]
        sums = _tensor_sums(current, manifest)
        with self._lock:
            peers = list(self._peers)
        frames: dict[int, list] = {}
        dead = []
        for peer in peers:
            base = self._holds.get(peer)
            delta = self._previous is not None and base == self._previous[0] and layout == self._previous[1]
            key = base if delta else _FULL
            if key not in frames:
                frames[key] = self._frame(manifest, current, key, sums)
            dead += self._send([peer], frames[key])
        for peer in peers:
            if peer not in dead:
                self._holds[peer] = version
        self._drop(set(dead))
        self._packed = [self._packed[1], current]
        self._previous = (version, layout)
        manifest.checksums = []
        return manifest

    def _pack(self, named: Mapping[str, torch.Tensor], manifest: WeightManifest) -> torch.Tensor:
        spare = self._packed[0]
        if spare.numel() < manifest.total_bytes:
            spare = torch.zeros(manifest.total_bytes, dtype=torch.uint8)
        flat, starts = spare[: manifest.total_bytes], bucket_starts(manifest)
        flat.zero_()  # padding is part of the delta: keep it zero
        for e, tensor in zip(manifest.tensors, named.values(), strict=True):
            pack_tensor(flat, starts[e.bucket] + e.offset, e.nbytes, tensor, checksum=False)
        return flat

    def _frame(self, manifest: WeightManifest, current: torch.Tensor, base: int, sums: list[int]) -> list:
        if base == _FULL:
            raw = current
        else:
            raw = _xor(current, self._packed[1][: current.numel()], torch.empty_like(current))
        payload = self._compressor.compress(memoryview(raw.numpy()))
        self.last_payload_bytes["full" if base == _FULL else "delta"] = len(payload)
        blob = encode(manifest)
        return [
            _HEAD.pack(len(blob), 1),
            blob,
            struct.pack("<QQ", base, len(payload)),
            payload,
            struct.pack(f"<{len(sums)}Q", *sums),
        ]

    def close(self) -> None:
        super().close()
        self._holds.clear()


class DeltaReceiver(TcpReceiver):
    """Applies DeltaSender updates: decompress, XOR onto the version it holds, verify each tensor."""

    def __init__(self, address: str, timeout_s: float = 60.0, key: str = "") -> None:
        super().__init__(address, timeout_s, key, mode="copy")
        self._decompressor = _zstd().ZstdDecompressor()
        self._held = torch.empty(0, dtype=torch.uint8)  # packed bytes of the last update received
        self._held_version = -1  # what the sender believes this receiver holds

    @torch.no_grad()
    def apply(self, targets: Mapping[str, torch.Tensor], version: int | None = None) -> int:
        """Receive the next update (skipping older ones if ``version`` is given: they still advance
        the base the next delta applies to) and apply it, all or nothing."""
        try:
            sock = self._connect()
            while True:
                manifest, base, payload, sums = self._read(sock)
                rebuilt = self._rebuild(manifest, base, payload)
                if _tensor_sums(rebuilt, manifest) != sums:
                    self._reset()  # a fresh connection makes the sender send a full update
                    self._held_version = -1
                    bad = [
                        e.name
                        for e, got, want in zip(
                            manifest.tensors, _tensor_sums(rebuilt, manifest), sums, strict=True
                        )
                        if got != want
                    ]
                    raise ManifestMismatch(f"tensor {bad[0]!r} checksum mismatch after the delta")
                self._held, self._held_version = rebuilt, manifest.version
                if version is None or manifest.version >= version:
                    break
        except (OSError, EOFError) as e:
            self._reset()
            self._held_version = -1
            raise TransferFailed(f"no update from {self.host}:{self.port}: {e}") from e
        check_against(manifest, targets)
        starts = bucket_starts(manifest)
        for e in manifest.tensors:
            view = rebuilt[starts[e.bucket] + e.offset :][: e.nbytes]
            targets[e.name].copy_(view.view(targets[e.name].dtype).view(e.shape))
        self.version = manifest.version
        return self.version

    def _read(self, sock: socket.socket) -> tuple[WeightManifest, int, bytes, list[int]]:
        size, _ = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
        manifest = decode(_recv_exact(sock, size), WeightManifest)
        manifest.validate()
        base, length = struct.unpack("<QQ", _recv_exact(sock, 16))
        payload = _recv_exact(sock, length)
        n = len(manifest.tensors)
        sums = list(struct.unpack(f"<{n}Q", _recv_exact(sock, 8 * n))) if n else []
        return manifest, base, payload, sums

    def _rebuild(self, manifest: WeightManifest, base: int, payload: bytes) -> torch.Tensor:
        """The packed bytes of ``manifest.version`` (a fresh buffer; the held one is untouched)."""
        raw = torch.frombuffer(bytearray(self._decompressor.decompress(payload)), dtype=torch.uint8)
        if raw.numel() != manifest.total_bytes:
            raise ManifestMismatch(
                f"update {manifest.version}: payload is {raw.numel()} bytes, manifest says {manifest.total_bytes}"
            )
        if base == _FULL:
            return raw
        if base != self._held_version or self._held.numel() != raw.numel():
            held, self._held_version = self._held_version, -1
            self._reset()
            raise TransferFailed(
                f"update {manifest.version} is a delta against {base}, this receiver holds {held}"
            )
        return _xor(raw, self._held, raw)
