"""Delta transport: bit-exact chains of deltas, full updates for new or reconnected receivers,
payloads that shrink when few bits change, per-tensor checksums, all over loopback TCP."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("zstandard")

from loong_transfermesh import ManifestMismatch, TransportConfig, open_receiver, open_sender
from loong_transfermesh.delta import DeltaReceiver, DeltaSender

torch.set_num_threads(1)


def _state(step: int) -> dict[str, torch.Tensor]:
    """A training run in miniature: each step nudges a few weights a little."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 64, generator=g)
    b = torch.randn(64, generator=g).to(torch.bfloat16)
    for s in range(step):
        g2 = torch.Generator().manual_seed(100 + s)
        idx = torch.randint(0, w.numel(), (40,), generator=g2)
        w.view(-1)[idx] += 1e-3 * torch.randn(40, generator=g2)
    return {"w": w, "b": b, "odd": torch.arange(7, dtype=torch.int16) + step}


def _zeros() -> dict[str, torch.Tensor]:
    return {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in _state(0).items()}


def _apply(receiver, targets, **kw) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["version"] = receiver.apply(targets, **kw)
        except Exception as e:
            out["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


@pytest.fixture
def sender() -> Iterator[DeltaSender]:
    s = open_sender(TransportConfig(type="tcp", delta=True))
    yield s
    s.close()


def _push(sender, receivers, targets, version: int) -> None:
    threads = [_apply(r, t) for r, t in zip(receivers, targets, strict=True)]
    sender.push(_state(version), version=version)
    for thread, out in threads:
        thread.join(timeout=30)
        assert out == {"version": version}, out


def _equal(a, b) -> bool:
    return all(
        torch.equal(
            a[k].view(torch.uint8) if a[k].dtype == torch.bfloat16 else a[k],
            b[k].view(torch.uint8) if b[k].dtype == torch.bfloat16 else b[k],
        )
        for k in a
    )


def test_a_chain_of_deltas_is_bit_exact_and_small(sender: DeltaSender) -> None:
    receiver = open_receiver(TransportConfig(type="tcp", delta=True), address=sender.address)
    assert isinstance(receiver, DeltaReceiver)
    sender.wait_for_receivers(1)
    targets = _zeros()
    for version in range(1, 6):
        _push(sender, [receiver], [targets], version)
        assert _equal(targets, _state(version))
    full, delta = sender.last_payload_bytes["full"], sender.last_payload_bytes["delta"]
    assert delta < full / 5, (delta, full)  # 40 changed floats out of 16k compress far better


def test_a_late_receiver_gets_a_full_update_then_deltas(sender: DeltaSender) -> None:
    early = DeltaReceiver(sender.address, timeout_s=10)
    sender.wait_for_receivers(1)
    t_early = _zeros()
    _push(sender, [early], [t_early], 1)
    late = DeltaReceiver(sender.address, timeout_s=10)
    sender.wait_for_receivers(2)
    t_late = _zeros()
    _push(sender, [early, late], [t_early, t_late], 2)  # early: delta, late: full
    _push(sender, [early, late], [t_early, t_late], 3)  # both: deltas
    assert _equal(t_early, _state(3)) and _equal(t_late, _state(3))


def test_skipped_versions_still_advance_the_base(sender: DeltaSender) -> None:
    receiver = DeltaReceiver(sender.address, timeout_s=10)
    sender.wait_for_receivers(1)
    targets = _zeros()
    thread, out = _apply(receiver, targets, version=3)
    for version in (1, 2, 3):
        sender.push(_state(version), version=version)
    thread.join(timeout=30)
    assert out == {"version": 3} and _equal(targets, _state(3))


def test_a_corrupted_delta_names_the_tensor_and_the_next_update_is_full(
    sender: DeltaSender, monkeypatch
) -> None:
    receiver = DeltaReceiver(sender.address, timeout_s=10)
    sender.wait_for_receivers(1)
    targets = _zeros()
    _push(sender, [receiver], [targets], 1)
    real = receiver._decompressor

    class Flipping:  # corrupts the first byte of "w" after decompression
        def decompress(self, payload: bytes) -> bytes:
            raw = bytearray(real.decompress(payload))
            raw[0] ^= 0x01
            return bytes(raw)

    monkeypatch.setattr(receiver, "_decompressor", Flipping())
    thread, out = _apply(receiver, targets)
    sender.push(_state(2), version=2)
    thread.join(timeout=30)
    assert isinstance(out["error"], ManifestMismatch) and "'w' checksum mismatch" in str(out["error"])
    assert _equal(targets, _state(1)) and receiver.version == 1  # untouched
    monkeypatch.setattr(receiver, "_decompressor", real)
    thread, out = _apply(receiver, targets)  # reconnects: the sender sees a new receiver
    sender.wait_for_receivers(2)  # the new connection (the closed one is dropped on the next send)
    sender.push(_state(3), version=3)
    thread.join(timeout=30)
    assert out == {"version": 3} and _equal(targets, _state(3))


def test_delta_is_only_for_tcp() -> None:
    with pytest.raises(ValueError, match="delta works with type 'tcp'"):
        TransportConfig(type="shm", delta=True)
