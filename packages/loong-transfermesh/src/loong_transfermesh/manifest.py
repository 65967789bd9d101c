"""Bucket layout, checksums and manifest validation shared by every transport.

A layout packs named tensors, in order, into flat byte buckets of at most ``bucket_bytes``
(a tensor larger than a bucket gets a bucket of its own). Offsets are 64-byte aligned and every
bucket size is a multiple of 64, so every tensor view is aligned for any dtype.

Bucket checksum (``sum64``): the sum of the bucket read as little-endian unsigned 64-bit words,
modulo 2**64. It catches torn writes and transport corruption (any change confined to one word
is always caught) at about a third of the cost of a memory copy, which CRC-32 (about 1.5x a copy
here) does not allow on the hot path. It is an integrity check, not a cryptographic one.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from loong_core.records import TensorEntry, WeightManifest

__all__ = [
    "ManifestMismatch",
    "TransferFailed",
    "bucket_starts",
    "build_manifest",
    "check_against",
    "dtype_name",
    "install",
    "pack_tensor",
    "rendezvous_store",
    "sum64",
    "tensor_views",
    "torch_dtype",
]

_ALIGN = 64
_CHUNK = 1 << 20  # write-then-checksum granularity: the chunk is still in cache


class ManifestMismatch(ValueError):
    """A manifest or bucket does not match what the receiver holds; nothing was applied."""


class TransferFailed(RuntimeError):
    """An update did not arrive whole (sender died, timed out, slot reused); nothing was applied
    and the receiver still holds its previous version."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ManifestMismatch(f"unknown dtype {name!r}")
    return dtype


def build_manifest(named: Mapping[str, torch.Tensor], version: int, bucket_bytes: int) -> WeightManifest:
    """Lay out ``named`` into buckets; checksums are filled in by the sender after packing."""
    entries: list[TensorEntry] = []
    sizes: list[int] = []
    offset = bucket_bytes  # forces a first bucket
    for name, t in named.items():
        nbytes = t.numel() * t.element_size()
        if not sizes or (offset + nbytes > bucket_bytes and offset > 0):
            sizes.append(0)
            offset = 0
        entries.append(TensorEntry(name, list(t.shape), dtype_name(t.dtype), len(sizes) - 1, offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
        sizes[-1] = offset
    return WeightManifest(version=version, tensors=entries, bucket_sizes=sizes)


def check_against(manifest: WeightManifest, targets: Mapping[str, torch.Tensor]) -> None:
    """Raise ManifestMismatch naming the first tensor whose name, shape or dtype differs."""
    manifest.validate()
    for e in manifest.tensors:
        t = targets.get(e.name)
        if t is None:
            raise ManifestMismatch(f"tensor {e.name!r} is not in the receiver's model")
        if list(t.shape) != e.shape:
            raise ManifestMismatch(
                f"tensor {e.name!r}: shape {e.shape} does not match receiver's {list(t.shape)}"
            )
        if dtype_name(t.dtype) != e.dtype:
            raise ManifestMismatch(
                f"tensor {e.name!r}: dtype {e.dtype} does not match receiver's {dtype_name(t.dtype)}"
            )


def sum64(buf: torch.Tensor) -> int:
    """Sum of a contiguous uint8 CPU tensor (length a multiple of 8) as uint64 words, mod 2**64."""
    return int(np.add.reduce(buf.numpy().view(np.uint64), dtype=np.uint64))


def bucket_starts(manifest: WeightManifest) -> list[int]:
    """Byte offset of each bucket when the buckets are laid out back to back."""
    starts, pos = [], 0
    for size in manifest.bucket_sizes:
        starts.append(pos)
        pos += size
    return starts


def pack_tensor(flat: torch.Tensor, begin: int, nbytes: int, tensor: torch.Tensor, checksum: bool) -> int:
    """Copy ``tensor`` into the uint8 tensor ``flat`` at ``begin`` (64-byte aligned); returns the
    sum64 of its 64-byte-padded extent (0 without ``checksum``), computed chunk by chunk right
    after each chunk is written, so the checksum reads from cache instead of memory."""
    extent = -(-nbytes // _ALIGN) * _ALIGN
    if not tensor.is_contiguous() or nbytes <= _CHUNK:
        flat[begin : begin + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        return sum64(flat[begin : begin + extent]) if checksum else 0
    src, total = tensor.detach().reshape(-1).view(torch.uint8), 0
    for lo in range(0, nbytes, _CHUNK):
        hi = min(lo + _CHUNK, nbytes)
        flat[begin + lo : begin + hi].copy_(src[lo:hi])
        if checksum:
            total += sum64(flat[begin + lo : begin + (hi if hi < nbytes else extent)])
    return total % (1 << 64)


def tensor_views(flat: torch.Tensor, manifest: WeightManifest, base: int = 0) -> dict[str, torch.Tensor]:
    """Each tensor of ``manifest`` as a view of the packed bytes ``flat`` (buckets from ``base``)."""
    starts = bucket_starts(manifest)
    out = {}
    for e in manifest.tensors:
        begin = base + starts[e.bucket] + e.offset
        out[e.name] = flat[begin : begin + e.nbytes].view(torch_dtype(e.dtype)).view(e.shape)
    return out


def install(targets: Mapping[str, torch.Tensor], views: Mapping[str, torch.Tensor], mode: str) -> None:
    """Expose a verified update: ``copy`` it into the targets, or (``zero_copy``) make the targets
    views of it by swapping their ``.data``."""
    for name, view in views.items():
        if mode == "copy":
            targets[name].copy_(view)
        else:
            targets[name].data = view


def rendezvous_store(address: str, world: int, is_master: bool, timeout_s: float):
    """A ``torch.distributed.TCPStore`` at ``host:port`` (the GPU transports' side channel)."""
    import datetime

    from torch.distributed import TCPStore

    host, _, port = address.rpartition(":")
    timeout = datetime.timedelta(seconds=timeout_s)
    return TCPStore(host, int(port), world, is_master, timeout=timeout, wait_for_workers=False)
