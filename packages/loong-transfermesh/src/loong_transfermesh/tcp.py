"""Cross-host transport without GPUs: the sender streams buckets over TCP to every connected
receiver, packing bucket ``i + 1`` while bucket ``i`` is on the wire.

Wire format, per connection (all integers little-endian u64)::

    receiver -> sender   b"LTM1" key_len key           (once; the sender answers b"OK")
    sender -> receiver   manifest_len flags manifest   (per update; flags bit 0: checksummed)
                         bucket_0 bytes, checksum_0, bucket_1 bytes, checksum_1, ...

The sender binds loopback by default; binding any other address requires a ``key`` that every
receiver must present. A receiver in ``copy`` mode copies each update into its tensors; in ``zero_copy`` mode its tensors
become views of the receive buffer (two alternate, so the next update never lands under a view in
use), which saves the copy. Receivers may connect at any time and get every update pushed after
they connected; one that fails mid-update (or whose manifest does not match) is dropped by the
sender or drains the update, and reconnects on its next ``apply``.

Lifecycle::

    sender = TcpSender("0.0.0.0:29600", key=secret)        # trainer host
    receiver = TcpReceiver("trainer-host:29600", key=secret)  # each engine host
    sender.wait_for_receivers(1)
    sender.push(dict(model.named_parameters()), version=1)    # returns when every receiver has it
    receiver.apply(dict(engine.named_parameters()))          # -> 1
"""

from __future__ import annotations

import contextlib
import hmac
import socket
import struct
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import torch

from loong_core.config import is_loopback
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

__all__ = ["TcpReceiver", "TcpSender"]

_HELLO = b"LTM1"
_U64 = struct.Struct("<Q")
_HEAD = struct.Struct("<QQ")
_SOCK_BUF = 4 << 20


def _split(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address must be 'host:port', got {address!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)


class TcpSender:
    """Listens for receivers and streams every pushed version to all of them. ``receivers``: how
    many the owner expects; a push first waits up to ``wait_s`` for that many to be connected (one
    that connects later gets the versions pushed after it, and :meth:`catch_up` sends it the
    newest one before that)."""

    def __init__(
        self,
        address: str = "127.0.0.1:0",
        bucket_bytes: int = 64 << 20,
        checksum: bool = True,
        key: str = "",
        receivers: int = 0,
        wait_s: float = 60.0,
    ) -> None:
        host, port = _split(address)
        self.expected, self.wait_s = receivers, wait_s
        if not is_loopback(host) and not key:
            raise ValueError(f"a tcp sender bound to {host} (not loopback) needs a key; set transport.key")
        self.bucket_bytes, self.checksum, self._key = bucket_bytes, checksum, key.encode()
        self._server = socket.create_server((host, port))
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._peers: list[socket.socket] = []
        self._sent: dict[socket.socket, int] = {}  # the newest version streamed to each peer
        self._lock = threading.Lock()
        self._staging: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8)] * 2
        self._packer = ThreadPoolExecutor(1, thread_name_prefix="tcp-send")
        self._fanout = ThreadPoolExecutor(8, thread_name_prefix="tcp-peer")
        threading.Thread(target=self._accept_loop, daemon=True, name="tcp-accept").start()

    @property
    def receivers(self) -> int:
        with self._lock:
            return len(self._peers)

    def wait_for_receivers(self, count: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.receivers < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.receivers} of {count} receivers connected to {self.address}")
            time.sleep(0.005)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            try:
                conn.settimeout(5.0)
                if _recv_exact(conn, 4) != _HELLO:
                    raise ConnectionError("not a TransferMesh receiver")
                (length,) = _U64.unpack(_recv_exact(conn, 8))
                if length > 4096:
                    raise ConnectionError("key too long")
                key = _recv_exact(conn, length)
                if not hmac.compare_digest(key, self._key):
                    raise ConnectionError("wrong key")
                conn.sendall(b"OK")
                conn.settimeout(None)
                _tune(conn)
            except OSError:
                conn.close()
                continue
            with self._lock:
                self._peers.append(conn)
                self._sent[conn] = -1

    def push(self, named: Mapping[str, torch.Tensor], version: int) -> WeightManifest:
        """Stream ``version`` to every connected receiver; returns its manifest (with checksums).
        A receiver that fails during the update is dropped (it reconnects on its next apply)."""
        if self.receivers < self.expected:  # a receiver still connecting would miss this version
            with contextlib.suppress(TimeoutError):  # one gone for good must not stop the others
                self.wait_for_receivers(self.expected, self.wait_s)
        with self._lock:
            peers = list(self._peers)
        return self._stream(named, version, peers)

    def catch_up(self, named: Mapping[str, torch.Tensor], version: int) -> int:
        """Stream ``version`` (``named`` must hold it) to the receivers that connected after it
        was pushed, such as a restarted engine's; returns how many it reached."""
        with self._lock:
            behind = [p for p in self._peers if self._sent.get(p, -1) < version]
        if behind:
            self._stream(named, version, behind)
        with self._lock:
            return sum(1 for p in behind if self._sent.get(p) == version)

    @torch.no_grad()
    def _stream(
        self, named: Mapping[str, torch.Tensor], version: int, peers: list[socket.socket]
    ) -> WeightManifest:
        manifest = build_manifest(named, version, self.bucket_bytes)
        blob = encode(manifest)
        dead: set[socket.socket] = set(self._send(peers, [_HEAD.pack(len(blob), int(self.checksum)), blob]))
        self._reserve(max(manifest.bucket_sizes, default=0))
        sums, tensors, sending = [], list(named.values()), [None, None]
        by_bucket: list[list[int]] = [[] for _ in manifest.bucket_sizes]
        for i, entry in enumerate(manifest.tensors):
            by_bucket[entry.bucket].append(i)
        for b, members in enumerate(by_bucket):
            flat, previous = self._staging[b % 2], sending[b % 2]
            if previous is not None:
                dead.update(previous.result())  # that staging buffer is free again
            total = 0
            for i in members:
                e = manifest.tensors[i]
                total += pack_tensor(flat, e.offset, e.nbytes, tensors[i], self.checksum)
            sums.append(total % (1 << 64))
            view = memoryview(flat[: manifest.bucket_sizes[b]].numpy())
            live = [p for p in peers if p not in dead]
            sending[b % 2] = self._packer.submit(self._send, live, [view, _U64.pack(sums[-1])])
        for pending in sending:
            if pending is not None:
                dead.update(pending.result())
        self._drop(dead)
        with self._lock:
            for peer in peers:
                if peer in self._sent:
                    self._sent[peer] = max(self._sent[peer], version)
        if self.checksum:
            manifest.checksums = sums
        return manifest

    def _send(self, peers: list[socket.socket], parts: list) -> list[socket.socket]:
        """Send ``parts`` to every peer concurrently; returns the peers that failed."""

        def one(peer: socket.socket) -> socket.socket | None:
            try:
                for part in parts:
                    peer.sendall(part)
            except OSError:
                return peer
            return None

        if len(peers) == 1:
            return [p for p in [one(peers[0])] if p is not None]
        futures: list[Future] = [self._fanout.submit(one, p) for p in peers]
        return [f.result() for f in futures if f.result() is not None]

    def _reserve(self, size: int) -> None:
        if self._staging[0].numel() < size:  # allocated and touched once, reused by every update
            self._staging = [torch.zeros(size, dtype=torch.uint8) for _ in range(2)]

    def _drop(self, dead: set[socket.socket]) -> None:
        if not dead:
            return
        with self._lock:
            self._peers = [p for p in self._peers if p not in dead]
            for peer in dead:
                self._sent.pop(peer, None)
        for peer in dead:
            peer.close()

    def close(self) -> None:
        self._server.close()
        with self._lock:
            peers, self._peers, self._sent = self._peers, [], {}
        for peer in peers:
            peer.close()
        self._packer.shutdown(wait=False)
        self._fanout.shutdown(wait=False)


class TcpReceiver:
    """Connects to a TcpSender and applies the updates it streams, all or nothing.

    By default the stream is read inside :meth:`apply`, so a sender's push waits for receivers to
    call it. With ``background=True`` a thread reads every update into a staging buffer as it is
    pushed (the push returns once each receiver has the bytes, whenever it applies), reconnecting
    when the sender goes away; :meth:`apply` then installs the newest staged update (waiting for
    one at least ``version`` if given). Buffers: the update being received, the one staged, the
    one being installed and, in ``zero_copy`` mode, the one the targets view never share memory.
    """

    def __init__(
        self,
        address: str,
        timeout_s: float = 60.0,
        key: str = "",
        mode: str = "copy",
        background: bool = False,
    ) -> None:
        if mode not in ("copy", "zero_copy"):
            raise ValueError(f"mode must be 'copy' or 'zero_copy', got {mode!r}")
        self.host, self.port = _split(address)
        self.timeout_s, self._key, self.mode = timeout_s, key.encode(), mode
        self.version = -1
        self._sock: socket.socket | None = None
        # zero_copy: targets view one buffer while the next update lands in another
        count = (2 if mode == "zero_copy" else 1) + int(background)
        self._staging = [torch.empty(0, dtype=torch.uint8)] * count
        self._turn = 0
        self._verifier = ThreadPoolExecutor(1, thread_name_prefix="tcp-verify")
        self._cond = threading.Condition()
        self._staged: _Staged | None = None
        self._busy: set[int] = set()  # buffers being installed or viewed by the targets
        self._closed = False
        self._thread: threading.Thread | None = None
        self._background = background
        try:
            self._connect()
        except (OSError, TransferFailed):
            self._sock = None  # the sender may start later (or refuse us): apply says so
        if background:
            self._thread = threading.Thread(target=self._receive_loop, daemon=True, name="tcp-receive")
            self._thread.start()

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
            _tune(sock)
            try:
                sock.sendall(_HELLO + _U64.pack(len(self._key)) + self._key)
                if _recv_exact(sock, 2) != b"OK":
                    raise EOFError("not a TransferMesh sender")
            except (OSError, EOFError):
                sock.close()
                raise TransferFailed(
                    f"sender at {self.host}:{self.port} refused the handshake (wrong key?)"
                ) from None
            if self._background:
                sock.settimeout(None)  # the thread waits for pushes as long as it takes
            self._sock = sock
        return self._sock

    @torch.no_grad()
    def apply(self, targets: Mapping[str, torch.Tensor], version: int | None = None) -> int:
        """Receive the next update (skipping older ones if ``version`` is given) and apply it.
        Raises ManifestMismatch or TransferFailed; either way no target was touched."""
        if self._thread is not None:
            return self._apply_staged(targets, version)
        try:
            sock = self._connect()
            manifest, checked = self._read_manifest(sock)
            while version is not None and manifest.version < version:
                self._receive(sock, manifest, checked, self._turn)  # drained, never applied
                manifest, checked = self._read_manifest(sock)
        except (OSError, EOFError) as e:
            self._reset()
            raise TransferFailed(f"no update from {self.host}:{self.port}: {e}") from e
        try:
            check_against(manifest, targets)
        except ManifestMismatch:
            self._receive(sock, manifest, checked, self._turn)  # keep the stream in step
            raise
        flat = self._receive(sock, manifest, checked, self._turn)
        install(targets, tensor_views(flat, manifest), self.mode)
        self._turn = (self._turn + 1) % len(self._staging)
        self.version = manifest.version
        return self.version

    def newest(self) -> int:
        """The newest version this receiver holds or has staged (-1: none)."""
        with self._cond:
            return max(self.version, self._staged.manifest.version if self._staged else -1)

    def _apply_staged(self, targets: Mapping[str, torch.Tensor], version: int | None) -> int:
        wanted = self.version + 1 if version is None else version
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while self._staged is None or self._staged.manifest.version < wanted:
                if (left := deadline - time.monotonic()) <= 0:
                    raise TransferFailed(
                        f"no update >= {wanted} from {self.host}:{self.port} within {self.timeout_s} s"
                    )
                self._cond.wait(left)
            staged, self._staged = self._staged, None
            self._busy.add(staged.buffer)
        try:
            if staged.error is not None:
                raise staged.error
            check_against(staged.manifest, targets)
            install(targets, tensor_views(staged.flat, staged.manifest), self.mode)
        except BaseException:
            with self._cond:
                self._busy.discard(staged.buffer)
            raise
        with self._cond:  # zero_copy: the targets now view this buffer and no longer the previous
            self._busy = {staged.buffer} if self.mode == "zero_copy" else set()
            self.version = staged.manifest.version
        return self.version

    def _receive_loop(self) -> None:
        while not self._closed:
            try:
                sock = self._connect()
                manifest, checked = self._read_manifest(sock)
                with self._cond:  # not busy, and not the staged one unless nothing else is free
                    free = [b for b in range(len(self._staging)) if b not in self._busy]
                    staged = self._staged.buffer if self._staged else -1
                    buffer = next((b for b in free if b != staged), free[0])
                    if buffer == staged:
                        self._staged = None
                error: ManifestMismatch | None = None
                try:
                    flat = self._receive(sock, manifest, checked, buffer)
                except ManifestMismatch as e:  # a corrupted bucket: apply reports it for this version
                    flat, error = self._staging[buffer], e
                with self._cond:
                    self._staged = _Staged(manifest, buffer, flat, error)
                    self._cond.notify_all()
            except (OSError, EOFError, TransferFailed, msgspec.DecodeError, ValueError):
                self._reset()
                if not self._closed:
                    time.sleep(0.05)  # the sender is not up yet or went away: connect again

    def _read_manifest(self, sock: socket.socket) -> tuple[WeightManifest, bool]:
        size, flags = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
        manifest = decode(_recv_exact(sock, size), WeightManifest)
        manifest.validate()
        return manifest, bool(flags & 1)

    def _receive(
        self, sock: socket.socket, manifest: WeightManifest, checked: bool, buffer: int
    ) -> torch.Tensor:
        """Receive every bucket into the reused staging ``buffer`` and verify them."""
        if self._staging[buffer].numel() < manifest.total_bytes:
            self._staging[buffer] = torch.zeros(manifest.total_bytes, dtype=torch.uint8)
        staging, verified = self._staging[buffer], []
        for b, (start, size) in enumerate(zip(bucket_starts(manifest), manifest.bucket_sizes, strict=True)):
            bucket = staging[start : start + size]
            try:
                _recv_into(sock, memoryview(bucket.numpy()))
                (expected,) = _U64.unpack(_recv_exact(sock, 8))
            except (OSError, EOFError) as e:
                self._reset()
                raise TransferFailed(
                    f"update {manifest.version} broke off in bucket {b} of {len(manifest.bucket_sizes)}: {e}"
                ) from e
            if checked:  # verified on another thread while the next bucket arrives
                verified.append((b, expected, self._verifier.submit(sum64, bucket)))
        for b, expected, total in verified:
            if total.result() != expected:
                names = [e.name for e in manifest.tensors if e.bucket == b]
                raise ManifestMismatch(f"bucket {b} checksum mismatch (tensors {', '.join(names[:4])})")
        return staging

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None

    def close(self) -> None:
        self._closed = True
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes the receiving thread
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._reset()


@dataclass(frozen=True)
class _Staged:
    """A received update waiting for ``apply``: its manifest, staging buffer and bytes (or the
    checksum failure that apply raises)."""

    manifest: WeightManifest
    buffer: int
    flat: torch.Tensor
    error: ManifestMismatch | None


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("sender closed the connection")
        got += n


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)
