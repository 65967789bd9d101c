"""End-to-end weight-sync time: from the sender holding the tensors to every receiver's tensors
holding them with the new version visible, against the physical floor and the usual baselines,
in the same run.

Payload: a Qwen-like bf16 tensor mix (embedding, per-layer attention and MLP matrices, many small
norm vectors) of 256 MiB or 1 GiB, to 1 or 4 receiver processes. Cases (``extra_info["case"]``):

- ``floor_memcpy``: one memcpy of the same bytes between two preallocated, touched buffers.
- ``shm``, ``shm_zero_copy``, ``tcp``, ``tcp_zero_copy``: Loong TransferMesh with its defaults
  (checksums off for ``shm``, on for ``tcp``); ``shm_checksum``: ``shm`` with checksums on.
- ``floor_flat_gloo``: one torch.distributed gloo broadcast of a flat buffer of the same bytes
  (the floor for ``tcp``).
- ``baseline_per_tensor_gloo``: one gloo broadcast per tensor, straight into the receivers'
  tensors (what early RL frameworks did).
- ``baseline_ray``: ``ray.put`` of the state dict, each receiver actor ``ray.get``s it and copies
  it into its tensors.

Run: ``uv run pytest packages/loong-transfermesh/benchmarks --benchmark-enable --dist no -q``. With
benchmarks disabled (the default test run) each case runs once on a 16 MiB payload with one
receiver, as a smoke test of the harness.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from loong_core.net import free_port
from loong_transfermesh import ShmSender, TcpSender

torch.set_num_threads(1)

_PEER = Path(__file__).with_name("_peer.py")
MIB = 1 << 20


def qwen_like(total_bytes: int) -> dict[str, torch.Tensor]:
    """bf16 tensors shaped like a Qwen3 checkpoint (hidden 1024, 16 heads, 8 KV heads, MLP 3072),
    with as many layers as fit ``total_bytes`` after an embedding of about an eighth of it."""
    hidden, heads, kv, dim, mlp = 1024, 16, 8, 64, 3072
    layer = {
        "input_layernorm.weight": [hidden],
        "self_attn.q_proj.weight": [heads * dim, hidden],
        "self_attn.k_proj.weight": [kv * dim, hidden],
        "self_attn.v_proj.weight": [kv * dim, hidden],
        "self_attn.q_norm.weight": [dim],
        "self_attn.k_norm.weight": [dim],
        "self_attn.o_proj.weight": [hidden, heads * dim],
        "post_attention_layernorm.weight": [hidden],
        "mlp.gate_proj.weight": [mlp, hidden],
        "mlp.up_proj.weight": [mlp, hidden],
        "mlp.down_proj.weight": [hidden, mlp],
    }
    per_layer = sum(torch.Size(s).numel() * 2 for s in layer.values())
    vocab = max(1, total_bytes // 8 // (hidden * 2))
    layers = max(1, (total_bytes - vocab * hidden * 2 - hidden * 2) // per_layer)
    g = torch.Generator().manual_seed(0)
    out = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g).to(torch.bfloat16)}
    for i in range(layers):
        for name, shape in layer.items():
            out[f"model.layers.{i}.{name}"] = torch.randn(shape, generator=g).to(torch.bfloat16)
    out["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    return out


class Peers:
    """Receiver processes driven line by line over pipes."""

    def __init__(self, spec: Path, case: str, args_per_peer: list[list[str]]) -> None:
        self.procs = [
            subprocess.Popen(
                [sys.executable, str(_PEER), str(spec), case, *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for args in args_per_peer
        ]
        for p in self.procs:
            assert p.stdout.readline().strip() == "ready", f"peer {case} failed to start"

    def go(self, version: int) -> None:
        for p in self.procs:
            p.stdin.write(f"go {version}\n")
            p.stdin.flush()

    def wait(self, version: int) -> None:
        for p in self.procs:
            line = p.stdout.readline().strip()
            assert line == f"done {version}", f"peer said {line!r}"

    def close(self) -> None:
        for p in self.procs:
            p.stdin.close()
        for p in self.procs:
            p.wait(timeout=60)


def _smoke(config: pytest.Config) -> bool:
    return config.getoption("benchmark_disable") and not config.getoption("benchmark_enable")


@pytest.fixture(autouse=True)
def _one_smoke_per_case(request) -> None:
    """Benchmarks disabled: one receiver, the smaller payload only."""
    params = getattr(request.node, "callspec", None)
    params = params.params if params else {}
    if _smoke(request.config) and (params.get("receivers", 1) > 1 or params.get("payload", 256) > 256):
        pytest.skip("benchmarks disabled: smoke run covers one receiver, one payload")


@pytest.fixture(scope="module", params=[256, 1024], ids=["256MiB", "1GiB"])
def payload(request, tmp_path_factory) -> Iterator[tuple[dict[str, torch.Tensor], Path]]:
    state = qwen_like((16 if _smoke(request.config) else request.param) * MIB)
    spec = tmp_path_factory.mktemp("spec") / "spec.json"
    spec.write_text(
        json.dumps([[k, list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in state.items()])
    )
    yield state, spec


def _nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _record(benchmark, case: str, state, receivers: int) -> None:
    benchmark.extra_info.update(case=case, bytes=_nbytes(state), receivers=receivers, tensors=len(state))


def _run(benchmark, step, rounds: int = 5) -> None:
    """Two warm-up rounds: the first two versions create and touch both double-buffer halves."""
    version = iter(range(1, 1000))
    benchmark.pedantic(lambda: step(next(version)), rounds=rounds, iterations=1, warmup_rounds=2)


def test_floor_memcpy(benchmark, payload) -> None:
    state, _ = payload
    n = _nbytes(state)
    src, dst = torch.ones(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    _record(benchmark, "floor_memcpy", state, 1)
    _run(benchmark, lambda _v: dst.copy_(src), rounds=7)


@pytest.mark.parametrize("receivers", [1, 4])
@pytest.mark.parametrize("mode", ["copy", "zero_copy", "checksum"])
def test_shm(benchmark, payload, receivers: int, mode: str) -> None:
    """``checksum``: copy mode with per-bucket checksums turned on (off by default for shm)."""
    state, spec = payload
    name = f"bench-{uuid.uuid4().hex[:8]}"
    sender = ShmSender(name, checksum=mode == "checksum")
    peers = Peers(spec, "shm", [[name, "zero_copy" if mode == "zero_copy" else "copy"]] * receivers)

    def step(version: int) -> None:
        peers.go(version)  # receivers start first and stream behind the sender
        sender.push(state, version)
        peers.wait(version)

    try:
        case = {"copy": "shm", "zero_copy": "shm_zero_copy", "checksum": "shm_checksum"}[mode]
        _record(benchmark, case, state, receivers)
        _run(benchmark, step)
    finally:
        peers.close()
        sender.close()


@pytest.mark.parametrize("receivers", [1, 4])
@pytest.mark.parametrize("mode", ["copy", "zero_copy"])
def test_tcp(benchmark, payload, receivers: int, mode: str) -> None:
    state, spec = payload
    sender = TcpSender("127.0.0.1:0")
    peers = Peers(spec, "tcp", [[sender.address, mode]] * receivers)
    sender.wait_for_receivers(receivers)

    def step(version: int) -> None:
        peers.go(version)
        sender.push(state, version)
        peers.wait(version)

    try:
        _record(benchmark, "tcp" if mode == "copy" else "tcp_zero_copy", state, receivers)
        _run(benchmark, step)
    finally:
        peers.close()
        sender.close()


@pytest.mark.parametrize("receivers", [1, 4])
@pytest.mark.parametrize("case", ["gloo_flat", "gloo_per_tensor"])
def test_gloo(benchmark, payload, receivers: int, case: str) -> None:
    """Rank 0 (the sender) is a peer process too; every rank starts on ``go``."""
    state, spec = payload
    port, world = free_port(), receivers + 1
    peers = Peers(spec, case, [[str(rank), str(world), str(port)] for rank in range(world)])

    def step(version: int) -> None:
        peers.go(version)
        peers.wait(version)

    try:
        name = "floor_flat_gloo" if case == "gloo_flat" else "baseline_per_tensor_gloo"
        _record(benchmark, name, state, receivers)
        _run(benchmark, step)
    finally:
        peers.close()


@pytest.mark.parametrize("receivers", [1, 4])
def test_ray(benchmark, payload, receivers: int) -> None:
    ray = pytest.importorskip("ray")
    state, _ = payload

    @ray.remote(num_cpus=0)
    class Receiver:
        def __init__(self, shapes: dict) -> None:
            torch.set_num_threads(1)
            self.targets = {k: torch.zeros(s, dtype=d) for k, (s, d) in shapes.items()}

        def apply(self, refs: list) -> int:
            for k, v in ray.get(refs[0]).items():
                self.targets[k].copy_(v)
            return 1

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        shapes = {k: (v.shape, v.dtype) for k, v in state.items()}
        actors = [Receiver.remote(shapes) for _ in range(receivers)]
        ray.get([a.__ray_ready__.remote() for a in actors])

        def step(_version: int) -> None:
            ref = ray.put(state)
            ray.get([a.apply.remote([ref]) for a in actors])

        _record(benchmark, "baseline_ray", state, receivers)
        _run(benchmark, step)
    finally:
        ray.shutdown()
