"""``loong-train serve-sglang`` processes updated by Loong's weight pushers (gloo groups, tensor
requests) bit for bit, and servers or trainers killed mid-update."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import subprocess
import sys
import time

import httpx
import msgspec
import pytest
import torch
from train_testkit import PROMPT_IDS, forward_logprobs, tiny_config, tiny_qwen3

from loong_agentflow.sglang_client import SGLangClientConfig, SGLangEngine
from loong_core.net import free_port
from loong_core.protocols import SamplingParams
from loong_train.models.decoder import CausalLM
from loong_transfermesh.sglang import SGLangPusherConfig, SGLangUpdateError, SGLangWeightPusher

CFG = tiny_config()


def _launch(model_dir, port: int | None = None) -> tuple[subprocess.Popen, str]:
    """``loong-train serve-sglang`` in its own process (a gloo group needs two), once healthy."""
    port = port or free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "loong_train.cli", "serve-sglang", str(model_dir), "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited: {proc.stdout.read().decode()}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health").status_code == 200:
                return proc, url
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"server at {url} not healthy within 120 s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        proc.wait(10)
    proc.stdout.close()


@pytest.fixture
def server_process(model_dir):
    proc, url = _launch(model_dir)
    yield url
    _stop(proc)


def _served_weights(url: str, names) -> dict[str, torch.Tensor]:
    get = lambda n: httpx.post(f"{url}/get_weights_by_name", json={"name": n, "truncate_size": 10**9}).json()  # noqa: E731
    return {n: torch.tensor(get(n)) for n in names}


@pytest.mark.integration
def test_distributed_update_is_bit_exact_and_versioned(server_process):
    url = server_process
    new = {k: v.detach().clone() for k, v in tiny_qwen3(23).named_parameters()}
    config = SGLangPusherConfig(urls=[url], master_port=free_port(), bucket_bytes=8 << 10, timeout_s=60)
    pusher = SGLangWeightPusher(config)
    pusher.connect()

    async def generate_across_update():
        client = SGLangEngine(SGLangClientConfig(url=url))
        try:
            task = asyncio.create_task(client.generate(PROMPT_IDS, SamplingParams(max_new_tokens=4)))
            await asyncio.to_thread(pusher.push, new, 3)
            before = await task
            after = await client.generate(PROMPT_IDS, SamplingParams(max_new_tokens=4))
            return before, after, client.weight_version
        finally:
            await client.aclose()

    before, after, seen = asyncio.run(generate_across_update())
    assert before.weight_version in (0, 3) and after.weight_version == 3 == seen
    assert pusher.cache_flushed in ([True], [False])  # False: the update overtook the generation
    served = _served_weights(url, new)
    assert all(torch.equal(served[k], v) for k, v in new.items())
    scored = httpx.post(
        f"{url}/generate",
        json={
            "input_ids": PROMPT_IDS,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    ).json()["meta_info"]
    reference = CausalLM(CFG)
    reference.load_state_dict(new, strict=False)
    want = forward_logprobs(reference.eval(), PROMPT_IDS)
    got = torch.tensor([t[0] for t in scored["input_token_logprobs"][1:]], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

    wrong = {"model.norm.weight": torch.ones(CFG.hidden_size + 1)}
    with pytest.raises(SGLangUpdateError, match=r"model\.norm\.weight"):
        pusher.push(wrong, 4)
    assert httpx.get(f"{url}/get_weight_version").json()["weight_version"] == "3"
    assert torch.equal(
        _served_weights(url, ["model.norm.weight"])["model.norm.weight"], new["model.norm.weight"]
    )
    pusher.shutdown()

    # Per-tensor broadcasts (SGLang versions without flattened buckets), through a fresh group.
    direct = SGLangWeightPusher(
        msgspec.structs.replace(config, load_format="direct", master_port=free_port())
    )
    direct.connect()
    newer = {k: v.detach().clone() for k, v in tiny_qwen3(29).named_parameters()}
    direct.push(newer, 7)
    assert direct.cache_flushed == [True]  # nothing in flight: the server flushed
    served = _served_weights(url, newer)
    assert all(torch.equal(served[k], v) for k, v in newer.items())
    direct.shutdown()
    assert httpx.get(f"{url}/health").status_code == 200


def _version(url: str) -> str:
    return httpx.get(f"{url}/get_weight_version").json()["weight_version"]


def _holds(url: str, named: dict[str, torch.Tensor]) -> bool:
    served = _served_weights(url, named)
    return all(torch.equal(served[k], v) for k, v in named.items())


@pytest.mark.integration
def test_servers_get_direct_pushes_and_one_that_dies_fails_alone_then_catches_up(model_dir):
    """Two server processes, one group each (``SGLangServers``): after every push both hold the
    trainer's tensors bit for bit. One is killed while a push of many small buckets runs: the
    other gets the version, the push names the dead one; relaunched (serving its checkpoint,
    version 0), ``catch_up`` brings it to the newest version through a fresh group."""
    from loong_transfermesh import SGLangServers

    (proc_a, a), (proc_b, b) = _launch(model_dir), _launch(model_dir)
    servers = SGLangServers(SGLangPusherConfig(urls=[a, b], bucket_bytes=4 << 10, timeout_s=60))
    try:
        for version, seed in ((1, 31), (2, 37)):
            named = {k: v.detach().clone() for k, v in tiny_qwen3(seed).named_parameters()}
            assert servers.push(named, version) == {}
            assert _version(a) == _version(b) == str(version) and servers.versions == {a: version, b: version}
            assert _holds(a, named) and _holds(b, named)

        newest = {k: v.detach().clone() for k, v in tiny_qwen3(41).named_parameters()}
        with contextlib.ExitStack() as stack:
            pool = stack.enter_context(concurrent.futures.ThreadPoolExecutor(1))
            push = pool.submit(servers.push, newest, 3)
            time.sleep(0.05)  # before or during its buckets: either way only b's push fails
            proc_b.kill()
            failed = push.result(timeout=120)
        assert list(failed) == [b] and servers.versions == {a: 3, b: None}
        assert _version(a) == "3" and _holds(a, newest)

        _stop(proc_b)
        failed = servers.push(newest, 3)  # b is down: refused at once, not after a rendezvous timeout
        assert list(failed) == [b] and "does not answer" in failed[b] and servers.versions[a] == 3
        proc_b, _ = _launch(model_dir, port=int(b.rsplit(":", 1)[1]))
        assert _version(b) == "0"
        assert servers.catch_up(newest, 3) == {}  # a already serves 3: only b is pushed
        assert _version(b) == "3" and _holds(b, newest) and servers.versions == {a: 3, b: 3}
    finally:
        servers.close()
        _stop(proc_a)
        _stop(proc_b)


@pytest.mark.integration
def test_tensor_backend_updates_through_the_request_bit_for_bit(server_process):
    """``backend = "tensor"`` (no group): each bucket goes to ``/update_weights_from_tensor``; CPU
    tensors travel as ``torch.save`` bytes (on a GPU they would be CUDA IPC handles: the gpu
    tests). Several buckets, the version arrives with the last."""
    from loong_transfermesh import SGLangServers

    url = server_process
    servers = SGLangServers(
        SGLangPusherConfig(urls=[url], backend="tensor", bucket_bytes=16 << 10, timeout_s=60)
    )
    try:
        for version, seed in ((1, 59), (2, 61)):
            named = {k: v.detach().clone() for k, v in tiny_qwen3(seed).named_parameters()}
            assert servers.push(named, version) == {}
            assert _version(url) == str(version) and _holds(url, named)
    finally:
        servers.close()


_DYING_TRAINER = """
import sys, time
import torch
from loong_transfermesh.sglang import SGLangPusherConfig, SGLangWeightPusher

url, port = sys.argv[1], int(sys.argv[2])
named = torch.load(sys.argv[3])
pusher = SGLangWeightPusher(SGLangPusherConfig(urls=[url], master_port=port, bucket_bytes=4 << 10))
pusher.connect()
send = pusher._send_bucket

def slow_send(items, version):  # every bucket announced, then a pause: the parent kills us here
    send(items, version)
    print("bucket", flush=True)
    time.sleep(30)

pusher._send_bucket = slow_send
pusher.push(named, 9)
"""


@pytest.mark.integration
def test_a_trainer_killed_mid_update_leaves_the_server_paused_until_a_full_version_lands(
    server_process, tmp_path
):
    """A pusher process is killed after its first bucket: the server still reports the previous
    version and runs no request on the half-updated weights (the update's pause holds them); a
    new trainer's push through a fresh group completes the version, bit for bit, and requests
    run again on it."""
    from loong_transfermesh import SGLangServers

    url = server_process
    servers = SGLangServers(SGLangPusherConfig(urls=[url], timeout_s=60))
    try:
        first = {k: v.detach().clone() for k, v in tiny_qwen3(43).named_parameters()}
        assert servers.push(first, 1) == {}
        torch.save({k: v.detach().clone() for k, v in tiny_qwen3(47).named_parameters()}, tmp_path / "w.pt")
        script = [sys.executable, "-c", _DYING_TRAINER, url, str(free_port()), str(tmp_path / "w.pt")]
        trainer = subprocess.Popen(script, stdout=subprocess.PIPE, text=True)
        assert trainer.stdout.readline().strip() == "bucket"
        trainer.kill()
        trainer.wait()
        trainer.stdout.close()
        assert _version(url) == "1"
        body = {"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 2}}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{url}/generate", json=body, timeout=3.0)  # held: the pause never ended

        newest = {k: v.detach().clone() for k, v in tiny_qwen3(53).named_parameters()}
        assert servers.catch_up(newest, 2) == {}
        assert _version(url) == "2" and _holds(url, newest)
        answer = httpx.post(f"{url}/generate", json=body, timeout=60.0).json()
        assert answer["meta_info"]["weight_version"] == "2"
    finally:
        servers.close()
