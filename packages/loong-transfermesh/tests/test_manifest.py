"""Bucket layout against a hand-worked case, its structural invariants, and check_against's errors."""

from __future__ import annotations

import itertools
import struct

import pytest
import torch

from loong_core.records import TensorEntry
from loong_transfermesh import ManifestMismatch, build_manifest, check_against
from loong_transfermesh.manifest import dtype_name, pack_tensor, sum64, torch_dtype

torch.set_num_threads(1)


def _layout_case() -> dict[str, torch.Tensor]:
    return {
        "a": torch.zeros(10),  # 40 B
        "b": torch.zeros(5, 6),  # 120 B
        "c": torch.zeros(2, 5, dtype=torch.int64),  # 80 B
        "d": torch.zeros(100),  # 400 B: larger than a bucket
        "e": torch.zeros(3, dtype=torch.bfloat16),  # 6 B
        "f": torch.tensor(1.5),  # 0-dim, 4 B
        "g": torch.zeros(16, dtype=torch.int64),  # 128 B: exactly fills what is left
        "h": torch.zeros(1),  # 4 B
    }


def test_layout_hand_worked_256_byte_buckets() -> None:
    # By hand, offsets rounded up to 64 after each tensor:
    #   bucket 0: a@0 (40 -> 64), b@64 (120 -> 192); c would end at 272 > 256    -> size 192
    #   bucket 1: c@0 (80 -> 128); d would end at 528                               -> size 128
    #   bucket 2: d@0 alone (400 -> 448); e would start past the bucket             -> size 448
    #   bucket 3: e@0 (6 -> 64), f@64 (4 -> 128), g@128 (128 -> 256, exact fit)     -> size 256
    #   bucket 4: h@0 (4 -> 64)                                                     -> size 64
    m = build_manifest(_layout_case(), version=5, bucket_bytes=256)
    want = [
        TensorEntry("a", [10], "float32", 0, 0, 40),
        TensorEntry("b", [5, 6], "float32", 0, 64, 120),
        TensorEntry("c", [2, 5], "int64", 1, 0, 80),
        TensorEntry("d", [100], "float32", 2, 0, 400),
        TensorEntry("e", [3], "bfloat16", 3, 0, 6),
        TensorEntry("f", [], "float32", 3, 64, 4),
        TensorEntry("g", [16], "int64", 3, 128, 128),
        TensorEntry("h", [1], "float32", 4, 0, 4),
    ]
    assert m.tensors == want
    assert m.bucket_sizes == [192, 128, 448, 256, 64]
    assert (m.version, m.checksums, m.total_bytes) == (5, [], 1088)
    m.validate()


def test_one_big_bucket_holds_everything() -> None:
    m = build_manifest(_layout_case(), version=0, bucket_bytes=64 << 20)
    assert {e.bucket for e in m.tensors} == {0}
    assert [e.offset for e in m.tensors] == [0, 64, 192, 320, 768, 832, 896, 1024]
    assert m.bucket_sizes == [1088]


@pytest.mark.parametrize("bucket_bytes", [64, 128, 256, 1024, 4096])
def test_layout_invariants(bucket_bytes: int) -> None:
    gen = torch.Generator().manual_seed(bucket_bytes)
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float64]
    named = {
        f"t{i}": torch.zeros(int(torch.randint(1, 300, (1,), generator=gen)), dtype=dtypes[i % 5])
        for i in range(25)
    }
    m = build_manifest(named, version=1, bucket_bytes=bucket_bytes)
    m.validate()
    assert [e.name for e in m.tensors] == list(named)
    by_bucket: dict[int, list[TensorEntry]] = {}
    for e, t in zip(m.tensors, named.values(), strict=True):
        assert e.nbytes == t.numel() * t.element_size()
        assert e.offset % 64 == 0
        assert e.offset + e.nbytes <= m.bucket_sizes[e.bucket]
        by_bucket.setdefault(e.bucket, []).append(e)
    assert sorted(by_bucket) == list(range(len(m.bucket_sizes)))  # buckets are used in order, none empty
    for entries in by_bucket.values():
        spans = sorted((e.offset, e.offset + e.nbytes) for e in entries)
        assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))
        # a bucket exceeds the limit only when it holds a single oversized tensor
        if len(entries) > 1:
            assert spans[-1][1] <= bucket_bytes
    assert all(s % 64 == 0 for s in m.bucket_sizes)


def test_layout_with_an_empty_first_tensor() -> None:
    m = build_manifest({"empty": torch.zeros(0), "a": torch.zeros(3)}, version=1, bucket_bytes=256)
    assert m.tensors == [
        TensorEntry("empty", [0], "float32", 0, 0, 0),
        TensorEntry("a", [3], "float32", 0, 0, 12),
    ]


def test_layout_with_an_empty_later_tensor() -> None:
    m = build_manifest({"a": torch.zeros(3), "empty": torch.zeros(0, 4)}, version=1, bucket_bytes=256)
    assert m.tensors == [
        TensorEntry("a", [3], "float32", 0, 0, 12),
        TensorEntry("empty", [0, 4], "float32", 0, 64, 0),
    ]
    m.validate()


def _targets() -> dict[str, torch.Tensor]:
    return {
        "w": torch.zeros(2, 3),
        "b": torch.zeros(3, dtype=torch.bfloat16),
        "n": torch.zeros((), dtype=torch.int64),
    }


def test_check_against_accepts_a_match() -> None:
    check_against(build_manifest(_targets(), 1, 256), _targets())


@pytest.mark.parametrize(
    ("receiver", "message"),
    [
        (
            {"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)},
            "tensor 'n' is not in the receiver's model",
        ),
        (
            {**_targets(), "w": torch.zeros(3, 2)},
            r"tensor 'w': shape \[2, 3\] does not match receiver's \[3, 2\]",
        ),
        ({**_targets(), "b": torch.zeros(3)}, "tensor 'b': dtype bfloat16 does not match receiver's float32"),
        ({**_targets(), "n": torch.zeros(1, dtype=torch.int64)}, r"tensor 'n': shape \[\] does not match"),
    ],
    ids=["missing", "shape", "dtype", "0-dim-vs-1-dim"],
)
def test_check_against_names_the_mismatch(receiver: dict[str, torch.Tensor], message: str) -> None:
    with pytest.raises(ManifestMismatch, match=message):
        check_against(build_manifest(_targets(), 1, 256), receiver)


def test_check_against_validates_the_manifest_first() -> None:
    m = build_manifest(_targets(), 1, 256)
    m.bucket_sizes = [8]
    with pytest.raises(ValueError, match="outside its bucket"):
        check_against(m, _targets())


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]
)
def test_dtype_names_round_trip(dtype: torch.dtype) -> None:
    assert torch_dtype(dtype_name(dtype)) is dtype


@pytest.mark.parametrize("name", ["float99", "Tensor", "nn", ""])
def test_unknown_dtype_is_a_mismatch(name: str) -> None:
    with pytest.raises(ManifestMismatch, match="unknown dtype"):
        torch_dtype(name)


def _sum64_reference(data: bytes) -> int:
    """Plain-Python sum64: little-endian u64 words added with Python's unbounded ints, then mod 2**64."""
    return sum(struct.unpack(f"<{len(data) // 8}Q", data)) % (1 << 64)


def test_sum64_matches_a_python_reference_and_wraps() -> None:
    data = bytes(range(256)) * 3 + b"\xff" * 64  # the all-ones words overflow 2**64 many times
    assert sum64(torch.frombuffer(bytearray(data), dtype=torch.uint8)) == _sum64_reference(data)
    assert sum64(torch.frombuffer(bytearray(data), dtype=torch.uint8)) < 1 << 64
    # hand-worked: words 1 and 2**64 - 1 wrap to 0
    two = struct.pack("<QQ", 1, (1 << 64) - 1)
    assert sum64(torch.frombuffer(bytearray(two), dtype=torch.uint8)) == 0


def test_sum64_catches_any_single_flipped_byte() -> None:
    data = bytearray(bytes(range(256)) * 4)
    clean = sum64(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    for position in range(0, len(data), 37):
        data[position] ^= 0x5A
        assert sum64(torch.frombuffer(bytearray(data), dtype=torch.uint8)) != clean, position
        data[position] ^= 0x5A


@pytest.mark.parametrize("nbytes_elems", [3, 1000, 300_000])  # small, and larger than one 1 MiB chunk
@pytest.mark.parametrize("contiguous", [True, False])
def test_pack_tensor_writes_bytes_and_checksums_the_padded_extent(
    nbytes_elems: int, contiguous: bool
) -> None:
    g = torch.Generator().manual_seed(nbytes_elems)
    src = torch.randn(nbytes_elems, 2, generator=g)
    src = src if contiguous else src.t()
    nbytes = src.numel() * 4
    flat = torch.full((64 + nbytes + 64 + 64,), 0xAB, dtype=torch.uint8)
    total = pack_tensor(flat, 64, nbytes, src, checksum=True)
    raw = src.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    assert flat[64 : 64 + nbytes].numpy().tobytes() == raw
    extent = -(-nbytes // 64) * 64
    assert total == _sum64_reference(flat[64 : 64 + extent].numpy().tobytes())
    assert flat[:64].eq(0xAB).all()  # nothing written before the tensor
    assert pack_tensor(flat, 64, nbytes, src, checksum=False) == 0
