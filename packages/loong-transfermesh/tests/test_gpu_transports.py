"""GPU transports on real hardware: CUDA IPC between two processes on one GPU, NCCL broadcast
across two GPUs. Marked ``gpu``: skipped without CUDA (and without cupy or a second GPU for NCCL);
``tools/gpu_check.sh`` runs them on a GPU machine."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from loong_core.net import free_port

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _state(version: int, device: str = "cuda:0") -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(version)
    return {
        "embed": torch.randn(1000, 64, generator=g).to(torch.bfloat16).to(device),
        "norm": torch.randn(64, generator=g).to(device),
        "proj": torch.randn(64, 300, generator=g).t().to(device),  # non-contiguous
    }


_RECEIVER = textwrap.dedent(
    """
    import hashlib, sys, torch
    kind, address, mode, device = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    shapes = {"embed": ((1000, 64), torch.bfloat16), "norm": ((64,), torch.float32), "proj": ((300, 64), torch.float32)}
    targets = {k: torch.nn.Parameter(torch.zeros(s, dtype=d, device=f"cuda:{device}"), requires_grad=False)
               for k, (s, d) in shapes.items()}
    if kind == "ipc":
        from loong_transfermesh.cuda_ipc import CudaIpcReceiver
        receiver = CudaIpcReceiver(address, mode=mode)
    else:
        from loong_transfermesh.nccl import NcclReceiver
        receiver = NcclReceiver(address, rank=1, receivers=1, device=device, mode=mode)
    for version in (1, 2):
        receiver.apply(targets, version=version)
        digest = hashlib.sha256()
        for k in sorted(targets):
            digest.update(targets[k].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        print(version, digest.hexdigest(), flush=True)
    """
)


def _digest(state: dict[str, torch.Tensor]) -> str:
    import hashlib

    digest = hashlib.sha256()
    for k in sorted(state):
        digest.update(state[k].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _run(kind: str, sender_factory, mode: str, receiver_device: int) -> None:
    address = f"127.0.0.1:{free_port()}"
    child = subprocess.Popen(  # first: creating an NCCL sender waits for its receivers
        [sys.executable, "-c", _RECEIVER, kind, address, mode, str(receiver_device)],
        stdout=subprocess.PIPE,
        text=True,
    )
    sender = sender_factory(address)
    try:
        for version in (1, 2):
            state = _state(version)
            sender.push(state, version=version)
            got_version, digest = child.stdout.readline().split()
            assert int(got_version) == version
            assert digest == _digest(state)
    finally:
        child.wait(timeout=120)
        sender.close()
    assert child.returncode == 0


@needs_cuda
@pytest.mark.parametrize("mode", ["copy", "zero_copy"])
def test_cuda_ipc_two_processes_one_gpu(mode: str) -> None:
    from loong_transfermesh.cuda_ipc import CudaIpcSender

    _run("ipc", lambda address: CudaIpcSender(address, receivers=1, bucket_bytes=64 << 10), mode, 0)


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
@pytest.mark.parametrize("mode", ["copy", "zero_copy"])
def test_nccl_broadcast_two_gpus(mode: str) -> None:
    pytest.importorskip("cupy")
    from loong_transfermesh.nccl import NcclSender

    _run("nccl", lambda address: NcclSender(address, receivers=1, device=0, bucket_bytes=64 << 10), mode, 1)
