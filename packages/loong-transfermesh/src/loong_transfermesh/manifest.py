"""Bucket layout and manifest validation shared by every transport.

A layout packs named tensors, in order, into flat byte buckets of at most ``bucket_bytes``
(a tensor larger than a bucket gets a bucket of its own). Offsets are 64-byte aligned so every
tensor view is aligned for any dtype.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import torch

from loong_core.records import TensorEntry, WeightManifest

__all__ = ["ManifestMismatch", "build_manifest", "check_against", "crc32", "dtype_name", "torch_dtype"]

_ALIGN = 64


class ManifestMismatch(ValueError):
    """A manifest or bucket does not match what the receiver holds; nothing was applied."""


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


def crc32(buf: torch.Tensor) -> int:
    """CRC-32 of a contiguous uint8 CPU tensor."""
    return zlib.crc32(memoryview(buf.numpy()))
