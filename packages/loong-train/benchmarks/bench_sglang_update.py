"""Time per weight update into an SGLang-compatible server: the trainer pushing straight into it
(``[rollout.engine] weights = "direct"``) against today's path through a rollout worker's host
copy, and the physical floor, in the same run; and what each path costs a rollout worker in
resident memory.

The server is ``loong-train serve-sglang`` (the embedded engine behind SGLang's HTTP API, its own
process, one torch thread), serving a Qwen3-shaped model of about 360 MB in fp32. Cases
(``extra_info["case"]``):

- ``floor_memcpy``: one memcpy of the model's bytes between two preallocated, touched buffers.
- ``direct``: :class:`loong_transfermesh.SGLangServers` pushes the trainer's tensors into the
  server (pause, gloo broadcast per bucket, version check, continue).
- ``via_worker``: what ``weights = "worker"`` does per update: TransferMesh shm push from the
  trainer's tensors, the worker's apply into its host copy, then the worker's
  :class:`~loong_transfermesh.SGLangWeightPusher` push from that copy into the server (the three
  run one after another in the pipeline; here in one process, the copies being the same).
- ``lora_via_worker``: the same with LoRA adapters alone (rank 16, every linear layer) into a
  server started with ``--enable-lora``, loaded as a new adapter per version.

``test_worker_rss`` starts a :class:`~loong_train.workers.rollout.RolloutWorker` as a Ray actor
in each mode on the same model and records its resident memory (``VmRSS``, its own process,
not the server's) after one update: the direct worker holds no model.

Run: ``uv run pytest packages/loong-train/benchmarks/bench_sglang_update.py --benchmark-enable --dist no
-q -s``. With benchmarks disabled (the default test run) the cases run once on a small model, as
a smoke test of the harness.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from loong_core.net import free_port
from loong_train.models.decoder import CausalLM, DecoderConfig
from loong_train.tiny.tokenizer import build_tokenizer
from loong_transfermesh import (
    SGLangPusherConfig,
    SGLangServers,
    SGLangWeightPusher,
    ShmReceiver,
    ShmSender,
)

torch.set_num_threads(1)
pytestmark = pytest.mark.integration  # each case starts a server process

BIG = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 6}  # about 360 MB fp32
SMALL = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2}


def _smoke(config: pytest.Config) -> bool:
    return config.getoption("benchmark_disable") and not config.getoption("benchmark_enable")


@pytest.fixture(scope="module")
def model_dir(request, tmp_path_factory) -> Path:
    """A random-init Qwen3-shaped checkpoint with a char tokenizer (Hugging Face layout)."""
    path = tmp_path_factory.mktemp("sglang-update")
    build_tokenizer(path, "char", [], 0)
    sizes = SMALL if _smoke(request.config) else BIG
    heads = sizes["hidden_size"] // 64
    model = CausalLM(
        DecoderConfig(
            vocab_size=128, num_attention_heads=heads, num_key_value_heads=heads // 2, head_dim=64, **sizes
        )
    )
    model.init_weights(0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def trainer_weights(model_dir) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in CausalLM.from_pretrained(model_dir).named_parameters()}


@contextlib.contextmanager
def _serve(model_dir: Path, *flags: str) -> Iterator[str]:
    """``loong-train serve-sglang`` (with ``flags``) in its own process, once healthy."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "loong_train.cli",
        "serve-sglang",
        str(model_dir),
        "--port",
        str(port),
        *flags,
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, "serve-sglang exited"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            assert time.monotonic() < deadline, "serve-sglang not healthy within 300 s"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def server(model_dir) -> Iterator[str]:
    with _serve(model_dir) as url:
        yield url


def _nbytes(named: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in named.values())


def _versions() -> Iterator[int]:
    """Fresh version numbers across cases (the server only ever moves forward)."""
    yield from range(1, 10**6)


VERSIONS = _versions()


RESULTS: dict[str, float] = {}  # case -> best seconds per update (this run), for ``test_ratios``


def _run(benchmark, named, case: str, step, rounds: int = 3) -> None:
    benchmark.extra_info.update(case=case, bytes=_nbytes(named), tensors=len(named))
    times = []

    def timed(version: int) -> None:
        start = time.perf_counter()
        step(version)
        times.append(time.perf_counter() - start)

    benchmark.pedantic(lambda: timed(next(VERSIONS)), rounds=rounds, iterations=1, warmup_rounds=1)
    RESULTS[case] = min(times[1:] or times)  # the warm-up round is not counted (benchmarks off: one call)


def test_floor_memcpy(benchmark, trainer_weights) -> None:
    n = _nbytes(trainer_weights)
    src, dst = torch.ones(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    _run(benchmark, trainer_weights, "floor_memcpy", lambda _v: dst.copy_(src), rounds=5)


def test_direct(benchmark, trainer_weights, server) -> None:
    servers = SGLangServers(SGLangPusherConfig(urls=[server]))

    def update(version: int) -> None:
        assert servers.push(trainer_weights, version) == {}

    try:
        _run(benchmark, trainer_weights, "direct", update)
    finally:
        servers.close()


def test_via_worker(benchmark, trainer_weights, server) -> None:
    name = f"bench-sglang-{uuid.uuid4().hex[:8]}"
    sender, receiver = ShmSender(name), ShmReceiver(name)
    host_copy = {
        k: torch.nn.Parameter(torch.zeros_like(v), requires_grad=False) for k, v in trainer_weights.items()
    }
    pusher = SGLangWeightPusher(SGLangPusherConfig(urls=[server], master_port=free_port()))
    pusher.connect()

    def update(version: int) -> None:
        sender.push(trainer_weights, version)  # the trainer
        receiver.apply(host_copy, version=version)  # the worker's host copy
        pusher.push(host_copy, version)  # the worker's push into its server

    try:
        _run(benchmark, trainer_weights, "via_worker", update)
    finally:
        with contextlib.suppress(Exception):
            pusher.close()
        pusher.shutdown()
        receiver.close()
        sender.close()


def test_lora_via_worker(benchmark, model_dir) -> None:
    """``[train.lora] sync = "adapter"`` into a server started with ``--enable-lora``: the adapter
    (rank 16, every linear layer) from the trainer over shm into the worker's buffers, then loaded
    into the server as a new adapter (``/load_lora_adapter_from_tensors``) and the previous one
    unloaded. The stand-in merges an adapter into its weights when the first request names it,
    which is not counted here (``bench_real_model.py -k weight_update`` times that merge)."""
    from loong_train.models.adapters import PEFT_PREFIX, adapted_modules
    from loong_transfermesh import adapter_shapes

    model = CausalLM.from_pretrained(model_dir)
    modules, transposed = adapted_modules(model, "all-linear")
    shapes = adapter_shapes(dict(model.named_parameters()), modules, 16, transposed)
    adapter = {n: torch.randn(shape) * 0.01 for n, shape in shapes.items()}
    buffers = {n: torch.zeros(shape) for n, shape in shapes.items()}
    n = _nbytes(adapter)
    src, dst = torch.ones(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    dst.copy_(src)
    RESULTS["floor_memcpy_lora"] = min(_seconds(lambda: dst.copy_(src)) for _ in range(5))
    config = {
        "peft_type": "LORA",
        "r": 16,
        "lora_alpha": 32,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}),
    }
    name = f"bench-lora-{uuid.uuid4().hex[:8]}"
    sender, receiver = ShmSender(name), ShmReceiver(name)
    served = []

    with _serve(model_dir, "--enable-lora") as url:
        pusher = SGLangWeightPusher(SGLangPusherConfig(urls=[url], backend="tensor"))

        def update(version: int) -> None:
            sender.push(adapter, version)  # the trainer
            receiver.apply(buffers, version=version)  # the worker's buffers
            pusher.load_adapter(f"v{version}", {PEFT_PREFIX + k: t for k, t in buffers.items()}, config)
            if served:
                pusher.unload_adapter(served.pop())
            served.append(f"v{version}")

        try:
            _run(benchmark, adapter, "lora_via_worker", update)
        finally:
            pusher.shutdown()
            receiver.close()
            sender.close()


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def test_ratios(capsys) -> None:
    """Runs after the three timed cases (this module's order): each case and its ratio to the floor."""
    cases = ("floor_memcpy", "direct", "via_worker")
    if not set(cases) <= set(RESULTS):
        pytest.skip("needs the three timed cases in this run")
    with capsys.disabled():
        print()
        for case in cases:
            seconds = RESULTS[case]
            print(
                f"{case}: {seconds * 1e3:.1f} ms per update, {seconds / RESULTS['floor_memcpy']:.1f}x memcpy"
            )
        print(f"via_worker / direct: {RESULTS['via_worker'] / RESULTS['direct']:.2f}")
        if "lora_via_worker" in RESULTS:
            lora = RESULTS["lora_via_worker"]
            print(
                f"lora_via_worker: {lora * 1e3:.1f} ms per update, "
                f"{lora / RESULTS['floor_memcpy_lora']:.0f}x a memcpy of the adapter, "
                f"{lora / RESULTS['via_worker']:.3f} of via_worker"
            )
    assert all(RESULTS[c] > 0 for c in cases)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@pytest.mark.parametrize("weights", ["worker", "direct"])
def test_worker_rss(benchmark, model_dir, trainer_weights, weights: str) -> None:
    """A RolloutWorker actor on the model, after one update in its mode: its resident memory."""
    import ray

    from loong_core.records import WeightManifest
    from loong_train.engines.config import SGLangEngineConfig
    from loong_train.workers.rollout import RolloutWorker
    from loong_transfermesh import TransportConfig

    config = SGLangEngineConfig(port_base=free_port(), weights=weights)
    transport = TransportConfig(name=f"bench-rss-{uuid.uuid4().hex[:8]}")
    sender = ShmSender(transport.name) if weights == "worker" else None  # the trainer's side
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
    worker = ray.remote(RolloutWorker).remote(
        str(model_dir),
        seed=0,
        sampling={"temperature": 1.0, "max_new_tokens": 8},
        limits={"max_turns": 1, "max_model_tokens": 32},
        transport=transport,
        engine=config,
    )
    try:
        pid = ray.get(worker.pid.remote())
        if weights == "direct":
            servers = SGLangServers(config.pusher(1))
            assert servers.push(trainer_weights, 1) == {}
            servers.close()
            manifest = WeightManifest(version=1, tensors=[], bucket_sizes=[])
        else:
            manifest = sender.push(trainer_weights, 1)
        ray.get(worker.apply_weights.remote(manifest))
        rss = _rss_mb(pid)
        benchmark.extra_info.update(
            case=f"worker_rss_{weights}", rss_mb=rss, model_mb=_nbytes(trainer_weights) / 2**20
        )
        benchmark.pedantic(lambda: _rss_mb(pid), rounds=1, iterations=1)
        print(
            f"\nRolloutWorker ({weights}): VmRSS {rss:.0f} MB, model {_nbytes(trainer_weights) / 2**20:.0f} MB"
        )
    finally:
        ray.get(worker.close.remote())
        ray.kill(worker)
        ray.shutdown()
        if sender is not None:
            sender.close()
