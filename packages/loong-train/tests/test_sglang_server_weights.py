"""The embedded SGLang-compatible server's weight updates in its process (from disk, from tensors)
and how they meet pauses and requests in flight, against float64 forward passes."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import torch
from train_testkit import PROMPT_IDS, forward_logprobs, serve_engine, tiny_qwen3

from loong_agentflow.sglang_client import SGLangClientConfig, SGLangEngine
from loong_core.protocols import SamplingParams
from loong_train.engines.embedded.engine import EmbeddedEngine
from loong_train.models.decoder import CausalLM
from loong_transfermesh.sglang import SGLangPusherConfig, SGLangWeightPusher


def _tensor_payload(named: dict[str, torch.Tensor]) -> str:
    buf = io.BytesIO()
    torch.save(list(named.items()), buf)
    return base64.b64encode(buf.getvalue()).decode()


def test_weight_updates_from_disk_and_tensor(model_dir, tmp_path):
    new = tiny_qwen3(11)
    new.save_pretrained(tmp_path / "v5")
    with serve_engine(EmbeddedEngine(CausalLM.from_pretrained(model_dir))) as (url, state):
        pusher = SGLangWeightPusher(SGLangPusherConfig(urls=[url]))
        pusher.push_from_disk(str(tmp_path / "v5"), version=5)
        served = dict(state.engine.model.named_parameters())
        assert all(torch.equal(served[k], v) for k, v in new.named_parameters())
        assert httpx.get(f"{url}/get_weight_version").json() == {"weight_version": "5"}
        # sglang test/srt/test_update_weights_from_disk.py: the served model_path follows the update
        assert httpx.get(f"{url}/get_model_info").json()["model_path"] == str(tmp_path / "v5")
        name = "model.layers.0.mlp.up_proj.weight"
        row = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": 2}).json()
        assert torch.equal(torch.tensor(row), new.state_dict()[name][:2])

        patch = {name: torch.randn(served[name].shape)}
        body = {"serialized_named_tensors": [_tensor_payload(patch)], "weight_version": "6"}
        assert httpx.post(f"{url}/update_weights_from_tensor", json=body).json()["success"]
        assert torch.equal(served[name], patch[name])
        out = httpx.post(
            f"{url}/generate", json={"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 2}}
        )
        assert out.json()["meta_info"]["weight_version"] == "6"
        pusher.shutdown()


def test_flush_cache_is_refused_while_an_in_place_pause_holds_running_requests(model_dir):
    """SGLang flushes only when idle and asserts (its scheduler dies) when a weight update with
    ``flush_cache`` true cannot flush; the server answers those cases 400 instead."""
    name = "model.layers.0.mlp.up_proj.weight"
    with serve_engine(EmbeddedEngine(CausalLM.from_pretrained(model_dir))) as (url, state):
        patch = {name: torch.randn(dict(state.engine.model.named_parameters())[name].shape)}
        before = dict(state.engine.model.named_parameters())[name].detach().clone()

        async def run():
            client = SGLangEngine(SGLangClientConfig(url=url, pause_mode="in_place"))
            http = httpx.AsyncClient(base_url=url, timeout=30)
            try:
                task = asyncio.create_task(client.generate(PROMPT_IDS, SamplingParams(max_new_tokens=500)))
                while state.engine.running == 0:
                    assert not task.done()
                    await asyncio.sleep(0.005)
                await asyncio.to_thread(client.pause)
                body = {"serialized_named_tensors": [_tensor_payload(patch)], "weight_version": "1"}
                refused = await http.post("/update_weights_from_tensor", json=body)
                unchanged = torch.equal(dict(state.engine.model.named_parameters())[name], before)
                busy_flush = await http.post("/flush_cache")
                taken = await http.post("/update_weights_from_tensor", json={**body, "flush_cache": False})
                await asyncio.to_thread(client.resume)
                span = await asyncio.wait_for(task, 60)
                return refused, unchanged, busy_flush, taken, span, await http.post("/flush_cache")
            finally:
                await http.aclose()
                await client.aclose()

        refused, unchanged, busy_flush, taken, span, idle_flush = asyncio.run(run())
        assert refused.status_code == 400 and refused.json()["param"] == "flush_cache" and unchanged
        assert busy_flush.status_code == 400 and "pending requests" in busy_flush.text
        assert taken.status_code == 200 and taken.json()["success"]
        assert idle_flush.status_code == 200
        assert span.weight_version == 1 and len(span.token_ids) > 0
        assert torch.equal(dict(state.engine.model.named_parameters())[name], patch[name])


async def _running(state, http: httpx.AsyncClient, max_new_tokens: int = 400) -> asyncio.Task:
    """A long /generate in flight, once it has sampled a few tokens."""
    body = {
        "input_ids": PROMPT_IDS,
        "sampling_params": {"max_new_tokens": max_new_tokens},
        "return_logprob": True,
    }
    task = asyncio.create_task(http.post("/generate", json=body))
    while not any(len(r.versions) >= 3 for r in state.engine._batch.rows):
        assert not task.done(), task.result().text
        await asyncio.sleep(0.005)
    return task


def test_retract_pause_lets_a_flushing_update_through_and_reprefills(model_dir):
    """Issue 20 point 8, mode ``retract`` (SGLang's ``Scheduler.pause_generation`` retracts the
    running batch; TestServerUpdateWeightsFromTensorNonBlocking updates with flush_cache true
    after it): the update succeeds, the held request continues after /continue_generation, and
    its last token's logprob is the new weights' (the KV cache was recomputed, checked against a
    float64 forward pass). The pause modes over HTTP alone: test_sglang_contract.py."""
    name = "model.layers.0.mlp.up_proj.weight"
    with serve_engine(EmbeddedEngine(CausalLM.from_pretrained(model_dir))) as (url, state):
        params = dict(state.engine.model.named_parameters())
        patch = {name: torch.randn(params[name].shape, generator=torch.Generator().manual_seed(5))}

        async def run():
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                task = await _running(state, http)
                await http.post("/pause_generation", json={"mode": "retract"})
                body = {"serialized_named_tensors": [_tensor_payload(patch)], "weight_version": "1"}
                updated = await http.post("/update_weights_from_tensor", json=body)
                flushed = await http.post("/flush_cache")
                await http.post("/continue_generation")
                return updated, flushed, await asyncio.wait_for(task, 60)

        updated, flushed, done = asyncio.run(run())
        new = state.engine.model
    assert updated.status_code == 200 and updated.json()["success"], updated.text
    assert flushed.status_code == 200
    answer = done.json()
    assert answer["meta_info"]["finish_reason"]["type"] == "length"
    assert answer["meta_info"]["weight_version"] == "1"
    ids = PROMPT_IDS + answer["output_ids"]
    want = forward_logprobs(new, ids)[-1]
    got = answer["meta_info"]["output_token_logprobs"][-1][0]
    assert abs(got - float(want)) < 1e-4


def test_client_continues_a_request_an_abort_pause_ended(model_dir):
    """Loong's SGLang client under ``pause_mode = "abort"``: the aborted answer is sent again
    with its tokens appended (a partial rollout), so the caller gets one whole span whose tokens
    carry the version that sampled each, the later ones the new weights' (float64 forward)."""
    name = "model.layers.0.mlp.up_proj.weight"
    with serve_engine(EmbeddedEngine(CausalLM.from_pretrained(model_dir))) as (url, state):
        params = dict(state.engine.model.named_parameters())
        patch = {name: torch.randn(params[name].shape, generator=torch.Generator().manual_seed(6))}

        async def run():
            client = SGLangEngine(SGLangClientConfig(url=url, pause_mode="abort"))
            try:
                task = asyncio.create_task(client.generate(PROMPT_IDS, SamplingParams(max_new_tokens=300)))
                while not any(len(r.versions) >= 3 for r in state.engine._batch.rows):
                    await asyncio.sleep(0.005)
                await asyncio.to_thread(client.pause)
                body = {"serialized_named_tensors": [_tensor_payload(patch)], "weight_version": "1"}
                async with httpx.AsyncClient(base_url=url) as http:
                    await http.post("/update_weights_from_tensor", json=body)
                await asyncio.to_thread(client.resume)
                return await asyncio.wait_for(task, 60)
            finally:
                await client.aclose()

        span = asyncio.run(run())
        new = state.engine.model
    versions = span.token_versions()
    assert len(span.token_ids) == 300 and versions[0] == 0 and versions[-1] == 1
    assert versions == sorted(versions)
    want = forward_logprobs(new, PROMPT_IDS + span.token_ids)[-1]
    assert abs(span.logprobs[-1] - float(want)) < 1e-4


def test_sglang_serializer_payload_is_a_clear_400(model_dir):
    """Issue 20 point 9: /update_weights_from_tensor with a payload as SGLang's
    MultiprocessingSerializer writes it (base64 of a ForkingPickler pickle) is a 400 naming
    the field, not a 500; nothing is unpickled or applied and the server keeps serving."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # registers torch's tensor reductions with ForkingPickler, as SGLang's does

    name = "model.norm.weight"
    with serve_engine(EmbeddedEngine(CausalLM.from_pretrained(model_dir))) as (url, state):
        before = dict(state.engine.model.named_parameters())[name].detach().clone()
        payload = base64.b64encode(bytes(ForkingPickler.dumps([(name, torch.zeros_like(before))]))).decode()
        body = {"serialized_named_tensors": [payload], "weight_version": "1"}
        refused = httpx.post(f"{url}/update_weights_from_tensor", json=body)
        after = dict(state.engine.model.named_parameters())[name]
        version = httpx.get(f"{url}/get_weight_version").json()["weight_version"]
        ok = httpx.post(
            f"{url}/generate", json={"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 1}}
        )
    assert refused.status_code == 400, refused.text
    assert refused.json()["param"] == "serialized_named_tensors" and "pickle" in refused.json()["message"]
    assert torch.equal(after, before) and version == "0" and ok.status_code == 200
