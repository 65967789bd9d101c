"""Real SGLang on a GPU, driven the way ``[rollout] engine = "sglang"`` drives it.

The supervisor launches ``python -m sglang.launch_server`` on a tiny random Qwen3 checkpoint;
``loong_agentflow.SGLangEngine`` generates with logprobs and pauses/continues;
``loong_transfermesh.SGLangWeightPusher`` pushes new weights over a gloo group (the rollout
worker's default) and reads the version back; ``stop()`` leaves no process. Reference: the same
weights in Loong's torch model (float64 log-softmax); SGLang serves in bfloat16, so the logprob
gap is bounded loosely.

Skips without CUDA, or without an interpreter that has SGLang: ``SGLANG_PYTHON`` (SGLang's own
environment, as docs/gpu.md recommends), else this one if it imports ``sglang``.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch
from train_testkit import NEEDS_REAL_SGLANG, real_sglang_config

from loong_agentflow.sglang_client import SGLangClientConfig, SGLangEngine
from loong_core.net import free_port
from loong_core.protocols import SamplingParams
from loong_train.engines.sglang.supervisor import SGLangSupervisor
from loong_train.models.decoder import CausalLM, DecoderConfig
from loong_transfermesh import SGLangPusherConfig, SGLangWeightPusher

pytestmark = [*NEEDS_REAL_SGLANG, pytest.mark.integration]

CFG = DecoderConfig(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,  # a head size every SGLang attention kernel supports
)
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]


def _model(seed: int) -> CausalLM:
    model = CausalLM(CFG)
    model.init_weights(seed, std=0.3)
    return model.eval()


def _gap(model: CausalLM, ids: list[int], logprobs: list[float]) -> float:
    """Largest |server logprob - float64 reference| over the completion (temperature 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + ids])).double()[0, :-1]
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(PROMPT + ids)[1:, None]).squeeze(-1)
    return float((ref[len(PROMPT) - 1 :] - torch.tensor(logprobs, dtype=torch.float64)).abs().max())


def test_real_sglang_generates_pauses_and_takes_pushed_weights(tmp_path):
    first, second = _model(0), _model(1)
    first.save_pretrained(tmp_path / "model")
    log = tmp_path / "sglang.log"
    sup = SGLangSupervisor(real_sglang_config(tmp_path / "model", log))
    sup.start()
    pusher = SGLangWeightPusher(SGLangPusherConfig(urls=[sup.url], master_port=free_port(), timeout_s=120))
    try:

        async def generate():
            client = SGLangEngine(SGLangClientConfig(url=sup.url))
            try:
                client.pause()
                held = asyncio.create_task(client.generate(PROMPT, SamplingParams(max_new_tokens=8)))
                await asyncio.sleep(1.0)
                was_held = not held.done()
                client.resume()
                return was_held, await held
            finally:
                await client.aclose()

        held, span = asyncio.run(generate())
        assert held and len(span.token_ids) == 8 and span.weight_version == 0
        assert _gap(first, span.token_ids, span.logprobs) < 0.1

        pusher.connect()
        pusher.push(dict(second.named_parameters()), version=1)  # reads "1" back
        assert pusher.cache_flushed == [True]  # idle server: /flush_cache succeeded
        _, after = asyncio.run(generate())
        assert after.weight_version == 1
        assert _gap(second, after.token_ids, after.logprobs) < 0.1
        assert _gap(first, after.token_ids, after.logprobs) > _gap(second, after.token_ids, after.logprobs)
    finally:
        pusher.shutdown()
        pid = sup.pid
        sup.stop()
    assert pid is not None and sup.pid is None
    deadline = time.monotonic() + 10  # exited children may stay zombies until init reaps them
    while _group_exists(pid):
        assert time.monotonic() < deadline, "SGLang processes outlived stop()"
        time.sleep(0.1)


async def _generate_once(url: str):
    client = SGLangEngine(SGLangClientConfig(url=url))
    try:
        return await client.generate(PROMPT, SamplingParams(max_new_tokens=8))
    finally:
        await client.aclose()


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _direct_push_lands(tmp_path, backend: str, server_env: dict[str, str]) -> None:
    """The trainer's side of ``weights = "direct"``: ``SGLangServers`` pushes CUDA tensors into a
    real server launched on other weights (``server_env``: where it runs). The server then holds
    them (as bfloat16, its dtype) and generates from them at the new version."""
    import httpx
    import msgspec

    from loong_transfermesh import SGLangServers

    first, second = _model(0), _model(1)
    first.save_pretrained(tmp_path / "model")
    config = real_sglang_config(tmp_path / "model", tmp_path / "sglang.log")
    sup = SGLangSupervisor(msgspec.structs.replace(config, env={**config.env, **server_env}))
    sup.start()
    servers = SGLangServers(
        SGLangPusherConfig(urls=[sup.url], backend=backend, timeout_s=120, pause_mode="abort")
    )
    try:
        named = {k: v.detach().cuda() for k, v in second.named_parameters()}
        assert servers.push(named, 1) == {}
        for name in ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight", "lm_head.weight"):
            body = {"name": name, "truncate_size": 4}
            served = torch.tensor(httpx.post(f"{sup.url}/get_weights_by_name", json=body, timeout=60).json())
            assert torch.equal(served.float(), named[name][:4].to(torch.bfloat16).float().cpu()), name

        span = asyncio.run(_generate_once(sup.url))
        assert span.weight_version == 1 and _gap(second, span.token_ids, span.logprobs) < 0.1
    finally:
        servers.close()
        sup.stop()


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL pairs distinct GPUs: the trainer's and the server's"
)
def test_the_trainer_pushes_straight_into_real_sglang_over_nccl(tmp_path):
    """``update_backend = "nccl"``: a broadcast from GPU 0 into a server on GPU 1."""
    torch.cuda.set_device(0)
    _direct_push_lands(tmp_path, "nccl", {"CUDA_VISIBLE_DEVICES": "1"})


def test_the_trainer_hands_real_sglang_its_cuda_tensors_by_ipc(tmp_path):
    """``update_backend = "tensor"`` (colocated): CUDA IPC handles to ``/update_weights_from_tensor``;
    the server, on the same GPU, copies from the trainer's memory."""
    _direct_push_lands(tmp_path, "tensor", {})


def test_real_sglang_serves_an_adapter_loaded_from_cuda_tensors(tmp_path):
    """Adapter-only sync into real SGLang (``[train.lora] sync = "adapter"`` with an sglang engine):
    ``SGLangWeightPusher.load_adapter`` hands the adapter over as CUDA IPC handles
    (``/load_lora_adapter_from_tensors``), a request naming it samples the adapted policy (gap to
    the ``peft`` model in float64 below bfloat16's bound, and smaller than the base model's), and
    after ``unload_adapter`` a request naming it is refused."""
    import msgspec

    from loong_core.protocols import RequestRefused
    from loong_train.backends.config import LoraConfig
    from loong_train.backends.lora import adapter_weights, add_adapters

    base = _model(0)
    base.save_pretrained(tmp_path / "model")
    adapted = _model(0)
    peft_config = add_adapters(adapted, LoraConfig(rank=8, alpha=16, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if ".lora_" in name:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    lora_flags = ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj"]
    config = real_sglang_config(tmp_path / "model", tmp_path / "sglang.log")
    sup = SGLangSupervisor(msgspec.structs.replace(config, args=[*config.args, *lora_flags]))
    sup.start()
    pusher = SGLangWeightPusher(SGLangPusherConfig(urls=[sup.url], backend="tensor", timeout_s=120))
    try:
        tensors = {f"base_model.model.{n}": t.cuda() for n, t in adapter_weights(adapted).items()}
        config_dict = {**peft_config.to_dict(), "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"}
        pusher.load_adapter("v1", tensors, config_dict)

        async def generate(adapter: str | None):
            client = SGLangEngine(SGLangClientConfig(url=sup.url))
            client.use_adapter(adapter, 1)
            try:
                return await client.generate(PROMPT, SamplingParams(max_new_tokens=8))
            finally:
                await client.aclose()

        span = asyncio.run(generate("v1"))
        assert _gap(adapted, span.token_ids, span.logprobs) < 0.1
        assert _gap(adapted, span.token_ids, span.logprobs) < _gap(base, span.token_ids, span.logprobs)
        pusher.unload_adapter("v1")
        with pytest.raises(RequestRefused):  # SGLang's 400 for an adapter it does not hold
            asyncio.run(generate("v1"))
    finally:
        pusher.shutdown()
        sup.stop()
