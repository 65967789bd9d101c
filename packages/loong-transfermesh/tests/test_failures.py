"""A sender process killed in the middle of an update: receivers keep the previous version intact,
report the failed update, and take the next update from a restarted sender. Real processes, real
SIGKILL; the sender is made to stall after its second tensor so the kill lands mid-update."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import uuid

import pytest
import torch

from loong_transfermesh import ShmReceiver, ShmSender, TcpReceiver, TcpSender, TransferFailed
from loong_transfermesh.shm import _SHM_DIR

torch.set_num_threads(1)

_SENDER = textwrap.dedent(
    """
    import sys, time, torch
    import loong_transfermesh.shm as shm, loong_transfermesh.tcp as tcp
    from loong_transfermesh import ShmSender, TcpSender

    torch.set_num_threads(1)
    kind, where = sys.argv[1], sys.argv[2]
    def state(v):
        return {f"w{i}": torch.full((64,), float(v * 10 + i)) for i in range(6)}
    sender = ShmSender(where, bucket_bytes=256) if kind == "shm" else TcpSender(where, bucket_bytes=256)
    print(sender.address if kind == "tcp" else where, flush=True)
    if kind == "tcp":
        sender.wait_for_receivers(1)
    sender.push(state(1), version=1)
    print("pushed 1", flush=True)
    if kind == "tcp":
        time.sleep(0.5)  # the receiver applies 1, then waits for 2
    module = shm if kind == "shm" else tcp
    real, count = module.pack_tensor, [0]
    def stall(*args):
        count[0] += 1
        if count[0] == 3:
            print("stalled", flush=True)
            time.sleep(600)
        return real(*args)
    module.pack_tensor = stall
    sender.push(state(2), version=2)
    """
)


def _state(v: int) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((64,), float(v * 10 + i)) for i in range(6)}


def _start(kind: str, where: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", _SENDER, kind, where], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def _expect(proc: subprocess.Popen, line: str) -> None:
    got = proc.stdout.readline().strip()
    assert got == line, f"sender said {got!r}, expected {line!r}"


@pytest.mark.integration
def test_shm_sender_killed_mid_update() -> None:
    name = f"test-kill-{uuid.uuid4().hex[:10]}"
    proc, _ = _start("shm", name)
    try:
        _expect(proc, "pushed 1")
        receiver, targets = ShmReceiver(name, timeout_s=30), {k: torch.zeros(64) for k in _state(0)}
        assert receiver.apply(targets, version=1) == 1
        _expect(proc, "stalled")  # version 2's header and first bucket are in shared memory
        proc.kill()
        proc.wait()
        with pytest.raises(
            TransferFailed, match=r"sender process \d+ died before writing bucket 2 of version 2"
        ):
            receiver.apply(targets, version=2)
        assert receiver.version == 1
        assert all(torch.equal(targets[k], v) for k, v in _state(1).items())  # intact
        restarted = ShmSender(name, bucket_bytes=256)  # the owner restarts the trainer
        restarted.push(_state(3), version=3)
        assert receiver.apply(targets) == 3
        assert all(torch.equal(targets[k], v) for k, v in _state(3).items())
        restarted.close()
        assert list(_SHM_DIR.glob(f"loong-tm-{name}-*")) == []  # no leaked segment
    finally:
        proc.kill()


@pytest.mark.integration
def test_tcp_sender_killed_mid_update() -> None:
    proc, address = _start("tcp", "127.0.0.1:0")
    try:
        receiver, targets = TcpReceiver(address, timeout_s=30), {k: torch.zeros(64) for k in _state(0)}
        assert receiver.apply(targets) == 1
        _expect(proc, "pushed 1")
        failure: dict = {}

        def wait_for_two() -> None:
            try:
                receiver.apply(targets)
            except TransferFailed as e:
                failure["error"] = e

        thread = threading.Thread(target=wait_for_two)
        thread.start()
        _expect(proc, "stalled")
        proc.kill()
        proc.wait()
        thread.join(timeout=30)
        assert "update 2 broke off in bucket" in str(failure["error"])
        assert receiver.version == 1
        assert all(torch.equal(targets[k], v) for k, v in _state(1).items())
        restarted = TcpSender(address, bucket_bytes=256)  # same port
        try:
            thread = threading.Thread(target=lambda: failure.update(v=receiver.apply(targets)))
            thread.start()  # reconnects
            restarted.wait_for_receivers(1)
            restarted.push(_state(3), version=3)
            thread.join(timeout=30)
            assert failure["v"] == 3
            assert all(torch.equal(targets[k], v) for k, v in _state(3).items())
        finally:
            restarted.close()
    finally:
        proc.kill()
