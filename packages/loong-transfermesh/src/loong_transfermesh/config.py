"""TransferMesh's configuration: the ``[transport]`` table that picks a transport, and how the
SGLang pusher reaches its servers. Pure msgspec: importing it loads no torch."""

from __future__ import annotations

from typing import Literal

import msgspec

from loong_core.net import free_port

__all__ = ["SGLangPusherConfig", "TransportConfig"]


class TransportConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How weights travel (the ``[transport]`` table of a recipe).

    - ``type``: ``shm``, ``tcp``, ``nccl`` or ``cuda_ipc``.
    - ``name``: the shared-memory name (``shm``), or the channel name for GPU transports.
    - ``bucket_mb``: bucket size; tensors are packed into buckets of at most this many MiB.
    - ``checksum``: compute and verify a sum64 checksum per bucket; unset means the transport's
      default (``tcp``: on; ``shm``: off, as sender and receivers share the same memory).
    - ``mode``: receivers ``copy`` into their tensors, or make them ``zero_copy`` views of the
      transport's buffers (``shm``: the shared slot; ``tcp``: the receive buffer).
    - ``address``: ``tcp`` sender's ``host:port`` (port 0 picks a free one); loopback by default.
    - ``key``: shared secret receivers present; required when the address is not loopback.
    - ``timeout_s``: how long a receiver waits for an update before reporting it failed.
    - ``delta``: ``tcp`` only: send zstd-compressed XOR deltas against each receiver's previous
      version, for slow links (extra ``[delta]``).
    """

    type: Literal["shm", "tcp", "nccl", "cuda_ipc"] = "shm"
    name: str = "loong"
    bucket_mb: float = 64.0
    checksum: bool | None = None
    mode: Literal["copy", "zero_copy"] = "copy"
    address: str = "127.0.0.1:0"
    key: str = ""
    timeout_s: float = 60.0
    delta: bool = False

    def __post_init__(self) -> None:
        if self.bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {self.bucket_mb}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.delta and self.type != "tcp":
            raise ValueError(f"delta works with type 'tcp', not {self.type!r}")

    def must_have_applied(self, version: int) -> int:
        """The version every receiver must have applied (or a newer one) before ``version`` may be
        pushed, because the push reuses that version's buffer; -1: no such rule.

        ``shm`` alternates two slots by version parity, so ``version`` overwrites the slot of
        ``version - 2``: ``copy`` receivers must be done reading it; ``zero_copy`` receivers view
        the slot they applied last until they apply the next, so they must hold ``version - 1``.
        ``tcp`` receivers own their buffers (background receivers keep the viewed one apart).
        """
        if self.type != "shm":
            return -1
        return version - (1 if self.mode == "zero_copy" else 2)

    def with_free_port(self) -> TransportConfig:
        """``tcp`` bound to port 0: the same config with a free port chosen now, so receivers can
        be given the address before the sender binds it (they connect once it listens)."""
        host, _, port = self.address.rpartition(":")
        if self.type != "tcp" or port != "0":
            return self
        return msgspec.structs.replace(self, address=f"{host}:{free_port(host)}")

    @property
    def bucket_bytes(self) -> int:
        return max(64, int(self.bucket_mb * (1 << 20)))


class SGLangPusherConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where the servers are and how to reach them.

    ``urls``: base URLs of the servers (``http://host:port``). ``ranks_per_engine``: each server's
    tensor-parallel size. ``master_address``/``master_port``: the trainer's rendezvous, reachable
    from every server. ``bucket_bytes``: upper bound of one broadcast (a larger tensor goes alone).
    ``pause_mode``: SGLang's ``/pause_generation`` mode (``in_place`` keeps requests running
    across the update, ``retract`` re-prefills them, ``abort`` returns them early).
    ``load_format``: ``flattened_bucket`` (one broadcast per bucket) or ``direct`` (one broadcast
    per tensor, in ``names`` order: for SGLang versions without flattened buckets).
    ``flush_cache``: after the last bucket, ask each server to drop its KV/prefix cache
    (``POST /flush_cache``; skipped by servers that still hold requests, see the module docstring).
    ``backend``: ``gloo`` or ``nccl`` broadcast over a weight-update group; ``tensor`` sends each
    bucket to ``/update_weights_from_tensor`` instead (CUDA IPC handles to a server on the same
    GPU; :mod:`loong_transfermesh.sglang`).
    """

    urls: list[str]
    master_address: str = "127.0.0.1"
    master_port: int = 29600
    backend: str = "gloo"
    group_name: str = "weight_update_group"
    ranks_per_engine: int = 1
    bucket_bytes: int = 512 << 20
    api_key: str | None = None
    timeout_s: float = 600.0
    pause: bool = True
    pause_mode: str = "in_place"
    flush_cache: bool = True
    load_format: str = "flattened_bucket"

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("urls must name at least one server")
        if self.backend not in ("gloo", "nccl", "tensor"):
            raise ValueError(f"backend must be 'gloo', 'nccl' or 'tensor', got {self.backend!r}")
        if self.pause_mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause_mode must be abort, retract or in_place, got {self.pause_mode!r}")
        if self.load_format not in ("flattened_bucket", "direct"):
            raise ValueError(f"load_format must be flattened_bucket or direct, got {self.load_format!r}")
        if self.ranks_per_engine < 1 or self.bucket_bytes < 1:
            raise ValueError("ranks_per_engine and bucket_bytes must be >= 1")
