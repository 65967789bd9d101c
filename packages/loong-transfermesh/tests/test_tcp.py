"""TCP transport: bit-exact streaming to several receivers, late joiners, keys, bad manifests and
corrupted buckets (the stream stays in step), all over real loopback sockets."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from loong_core.net import free_port
from loong_transfermesh import ManifestMismatch, TcpReceiver, TcpSender, TransferFailed

torch.set_num_threads(1)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(50, 8, generator=g),
        "norm": torch.randn(8, generator=g).to(torch.bfloat16),
        "steps": torch.randint(0, 1 << 40, (3,), generator=g),
        "t": torch.randn(8, 4, generator=g).t(),  # non-contiguous source
        "scalar": torch.tensor(float("nan")),
    }


def _zeros(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    raw = lambda t: t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()  # noqa: E731
    return a.keys() == b.keys() and all(raw(a[k]) == raw(b[k]) for k in a)


@pytest.fixture
def sender() -> Iterator[TcpSender]:
    s = TcpSender("127.0.0.1:0", bucket_bytes=512)  # several buckets
    yield s
    s.close()


def _apply_in_thread(receiver: TcpReceiver, targets, **kw) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["version"] = receiver.apply(targets, **kw)
        except Exception as e:  # reported to the test thread
            out["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_streams_bit_exact_to_several_receivers(sender: TcpSender) -> None:
    receivers = [TcpReceiver(sender.address, timeout_s=10) for _ in range(3)]
    sender.wait_for_receivers(3)
    for version in (1, 2):
        state = _state(version)
        targets = [_zeros(state) for _ in receivers]
        threads = [_apply_in_thread(r, t) for r, t in zip(receivers, targets, strict=True)]
        manifest = sender.push(state, version=version)
        assert len(manifest.bucket_sizes) > 1 and len(manifest.checksums) == len(manifest.bucket_sizes)
        for (thread, out), t in zip(threads, targets, strict=True):
            thread.join(timeout=30)
            assert out == {"version": version}
            assert _same(t, state)


def test_a_late_receiver_gets_the_next_update(sender: TcpSender) -> None:
    sender.push(_state(1), version=1)  # nobody listening: nothing blocks
    late = TcpReceiver(sender.address, timeout_s=10)
    sender.wait_for_receivers(1)
    targets = _zeros(_state(2))
    thread, out = _apply_in_thread(late, targets)
    sender.push(_state(2), version=2)
    thread.join(timeout=30)
    assert out == {"version": 2} and _same(targets, _state(2))


def test_catch_up_sends_the_newest_version_only_to_receivers_that_missed_it(sender: TcpSender) -> None:
    """A restarted engine connects after version 2 was pushed: ``catch_up`` streams version 2 to
    it alone (the receiver that had it gets nothing twice), then both take version 3 as usual."""
    early = TcpReceiver(sender.address, timeout_s=10, background=True)
    sender.wait_for_receivers(1)
    sender.push(_state(1), version=1)
    sender.push(_state(2), version=2)
    late = TcpReceiver(sender.address, timeout_s=10, background=True)
    sender.wait_for_receivers(2)
    assert sender.catch_up(_state(2), version=2) == 1
    assert sender.catch_up(_state(2), version=2) == 0  # nobody behind any more
    targets = _zeros(_state(0))
    assert late.apply(targets, version=2) == 2 and _same(targets, _state(2))
    assert early.apply(_zeros(_state(0))) == 2  # it had it: caught up were the others only
    sender.push(_state(3), version=3)
    for receiver in (early, late):
        got = _zeros(_state(0))
        assert receiver.apply(got, version=3) == 3 and _same(got, _state(3))
        receiver.close()


def test_apply_with_a_version_skips_older_updates(sender: TcpSender) -> None:
    receiver = TcpReceiver(sender.address, timeout_s=10)
    sender.wait_for_receivers(1)
    targets = _zeros(_state(0))
    thread, out = _apply_in_thread(receiver, targets, version=3)
    for version in (1, 2, 3):
        sender.push(_state(version), version=version)
    thread.join(timeout=30)
    assert out == {"version": 3} and _same(targets, _state(3))


def test_mismatched_manifest_is_rejected_and_the_stream_stays_in_step(sender: TcpSender) -> None:
    receiver = TcpReceiver(sender.address, timeout_s=10)
    sender.wait_for_receivers(1)
    wrong = _zeros(_state(0))
    wrong["embed"] = torch.zeros(50, 9)
    before = {k: v.clone() for k, v in wrong.items()}
    thread, out = _apply_in_thread(receiver, wrong)
    sender.push(_state(1), version=1)
    thread.join(timeout=30)
    assert isinstance(out["error"], ManifestMismatch)
    assert "tensor 'embed': shape [50, 8]" in str(out["error"])
    assert _same(wrong, before) and receiver.version == -1
    good = _zeros(_state(0))
    thread, out = _apply_in_thread(receiver, good)
    sender.push(_state(2), version=2)
    thread.join(timeout=30)
    assert out == {"version": 2} and _same(good, _state(2))


def test_a_corrupted_bucket_is_rejected_before_any_byte(sender: TcpSender, monkeypatch) -> None:
    import loong_transfermesh.tcp as tcp

    real = tcp.pack_tensor
    corrupt = {"on": True}

    def pack_then_flip(flat, begin, nbytes, tensor, checksum):
        total = real(flat, begin, nbytes, tensor, checksum)
        if corrupt["on"] and tensor.dtype == torch.int64:  # corrupt the bytes after checksumming
            flat[begin] ^= 0xFF
        return total

    monkeypatch.setattr(tcp, "pack_tensor", pack_then_flip)
    receiver = TcpReceiver(sender.address, timeout_s=10)
    sender.wait_for_receivers(1)
    targets = _zeros(_state(0))
    thread, out = _apply_in_thread(receiver, targets)
    sender.push(_state(1), version=1)
    thread.join(timeout=30)
    assert isinstance(out["error"], ManifestMismatch) and "checksum mismatch" in str(out["error"])
    assert "steps" in str(out["error"])
    assert _same(targets, _zeros(_state(0)))
    corrupt["on"] = False
    thread, out = _apply_in_thread(receiver, targets)
    sender.push(_state(2), version=2)
    thread.join(timeout=30)
    assert out == {"version": 2} and _same(targets, _state(2))


def test_wrong_key_is_refused() -> None:
    sender = TcpSender("127.0.0.1:0", key="right")
    try:
        receiver = TcpReceiver(sender.address, timeout_s=5, key="wrong")
        with pytest.raises(TransferFailed):
            receiver.apply(_zeros(_state(0)))
        assert sender.receivers == 0
        ok = TcpReceiver(sender.address, timeout_s=5, key="right")
        sender.wait_for_receivers(1)
        ok.close()
    finally:
        sender.close()


def test_exposed_address_needs_a_key() -> None:
    with pytest.raises(ValueError, match="needs a key"):
        TcpSender("0.0.0.0:0")
    with pytest.raises(ValueError, match="host:port"):
        TcpSender("localhost")


def test_a_stranger_connection_does_not_disturb_the_sender(sender: TcpSender) -> None:
    host, port = sender.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as stranger:
        stranger.sendall(b"GET / HTTP/1.1\r\n\r\n")
    receiver = TcpReceiver(sender.address, timeout_s=10)
    sender.wait_for_receivers(1)
    targets = _zeros(_state(5))
    thread, out = _apply_in_thread(receiver, targets)
    sender.push(_state(5), version=5)
    thread.join(timeout=30)
    assert out == {"version": 5} and sender.receivers == 1


def test_zero_copy_targets_view_alternating_receive_buffers(sender: TcpSender) -> None:
    receiver = TcpReceiver(sender.address, timeout_s=10, mode="zero_copy")
    sender.wait_for_receivers(1)
    params = {k: torch.nn.Parameter(v, requires_grad=False) for k, v in _zeros(_state(0)).items()}
    pointers = []
    for version in (1, 2, 3):
        thread, out = _apply_in_thread(receiver, params)
        sender.push(_state(version), version=version)
        thread.join(timeout=30)
        assert out == {"version": version}
        assert _same({k: p.data for k, p in params.items()}, _state(version))
        pointers.append(params["embed"].data_ptr())
    assert pointers[0] == pointers[2] != pointers[1]  # two buffers, alternating


# -- background receivers: pushes never wait for apply ---------------------------------------------


def test_a_background_receiver_lets_pushes_return_and_applies_the_newest(sender: TcpSender) -> None:
    receiver = TcpReceiver(sender.address, timeout_s=10, background=True)
    sender.wait_for_receivers(1)
    for version in (1, 2, 3):  # no apply in between: the receiving thread takes every update
        sender.push(_state(version), version=version)
    targets = _zeros(_state(0))
    assert receiver.apply(targets, version=3) == 3 and _same(targets, _state(3))
    assert receiver.newest() == 3
    thread, out = _apply_in_thread(receiver, targets)  # the next one: waits for version 4
    sender.push(_state(4), version=4)
    thread.join(timeout=30)
    assert out == {"version": 4} and _same(targets, _state(4))
    receiver.close()


def test_zero_copy_background_targets_keep_their_bytes_while_later_updates_land(sender: TcpSender) -> None:
    receiver = TcpReceiver(sender.address, timeout_s=10, mode="zero_copy", background=True)
    sender.wait_for_receivers(1)
    params = {k: torch.nn.Parameter(v, requires_grad=False) for k, v in _zeros(_state(0)).items()}
    for version in range(1, 7):
        sender.push(_state(version), version=version)
        if version % 3 == 1:
            receiver.apply(params, version=version)
        applied = version - (version - 1) % 3  # the version the targets view
        deadline = time.monotonic() + 60
        while receiver.newest() < version and time.monotonic() < deadline:
            time.sleep(0.005)
        assert _same({k: p.data for k, p in params.items()}, _state(applied)), version
    receiver.close()


def test_a_background_receiver_reports_a_corrupted_update_and_takes_the_next(sender, monkeypatch) -> None:
    import loong_transfermesh.tcp as tcp

    real, corrupt = tcp.pack_tensor, {"on": True}

    def pack_then_flip(flat, begin, nbytes, tensor, checksum):
        total = real(flat, begin, nbytes, tensor, checksum)
        if corrupt["on"] and tensor.dtype == torch.int64:
            flat[begin] ^= 0xFF
        return total

    monkeypatch.setattr(tcp, "pack_tensor", pack_then_flip)
    receiver = TcpReceiver(sender.address, timeout_s=10, background=True)
    sender.wait_for_receivers(1)
    sender.push(_state(1), version=1)
    targets = _zeros(_state(0))
    with pytest.raises(ManifestMismatch, match="checksum mismatch"):
        receiver.apply(targets, version=1)
    assert _same(targets, _zeros(_state(0)))
    corrupt["on"] = False
    sender.push(_state(2), version=2)
    assert receiver.apply(targets) == 2 and _same(targets, _state(2))
    receiver.close()


def test_a_background_receiver_connects_to_a_sender_that_starts_later_and_times_out_clearly() -> None:
    address = f"127.0.0.1:{free_port()}"
    receiver = TcpReceiver(address, timeout_s=0.3, background=True)
    with pytest.raises(TransferFailed, match=r"no update >= 0 from 127\.0\.0\.1:\d+ within 0\.3 s"):
        receiver.apply(_zeros(_state(0)))
    sender = TcpSender(address)
    try:
        sender.wait_for_receivers(1, timeout_s=10)
        sender.push(_state(1), version=1)
        receiver.timeout_s = 10
        targets = _zeros(_state(0))
        assert receiver.apply(targets) == 1 and _same(targets, _state(1))
    finally:
        receiver.close()
        sender.close()


def test_a_push_waits_for_the_receivers_the_owner_expects() -> None:
    address = f"127.0.0.1:{free_port()}"
    sender = TcpSender(address, receivers=1, wait_s=10)
    pushed = threading.Event()
    thread = threading.Thread(target=lambda: (sender.push(_state(1), version=1), pushed.set()))
    thread.start()
    time.sleep(0.2)
    assert not pushed.is_set()  # waiting for its receiver
    receiver = TcpReceiver(address, timeout_s=10, background=True)
    thread.join(timeout=30)
    targets = _zeros(_state(0))
    assert receiver.apply(targets, version=1) == 1 and _same(targets, _state(1))
    receiver.close()
    late = TcpSender("127.0.0.1:0", receivers=1, wait_s=0.2)  # nobody comes: the push goes on
    late.push(_state(1), version=1)
    late.close()
    sender.close()
