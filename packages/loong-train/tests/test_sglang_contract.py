"""SGLang's HTTP behaviour, as SGLang's own endpoint tests expect it, checked over HTTP only.

Each case speaks to a server through its URL and nothing else, so the same case runs against two
servers: the embedded SGLang-compatible server (every CI run) and, marked ``gpu``, a real SGLang
server launched by Loong's supervisor (``tools/gpu_check.sh``; skipped without CUDA or without an
interpreter that has SGLang, as in ``test_sglang_gpu.py``). The upstream test a case follows is
named in its docstring (sgl-project/sglang ``test/srt``), adapted to token-id prompts
(``--skip-tokenizer-init``) and temperature 1. Behaviour that differs on purpose (fields the
embedded server refuses, its tensor payload format) is tested in ``test_sglang_server.py``.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import msgspec
import pytest
from train_testkit import NEEDS_REAL_SGLANG, real_sglang_config, serve_in_thread, tiny_qwen3

from loong_train.engines.embedded.engine import EmbeddedEngine
from loong_train.engines.embedded.http_app import build_app
from loong_train.models.decoder import CausalLM

PROMPT = [3, 14, 15, 9, 26, 5]


def _embedded(model_dir):
    app = build_app(EmbeddedEngine(CausalLM.from_pretrained(model_dir)), model_path=str(model_dir))
    return serve_in_thread(app)


@contextlib.contextmanager
def _real_sglang(model_dir, log_path):
    from loong_train.engines.sglang.supervisor import SGLangSupervisor

    sup = SGLangSupervisor(real_sglang_config(model_dir, log_path))
    sup.start()
    try:
        yield sup.url
    finally:
        sup.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("contract-tiny")
    tiny_qwen3(0, head_dim=64).eval().save_pretrained(path)  # 64-wide heads: every SGLang kernel takes them
    return path


@pytest.fixture(params=["embedded", pytest.param("sglang", marks=NEEDS_REAL_SGLANG)])
def url(request, model_dir, tmp_path):
    """The base URL of a fresh server of each kind on the same tiny checkpoint."""
    if request.param == "embedded":
        with _embedded(model_dir) as base:
            yield base
    else:
        with _real_sglang(model_dir, tmp_path / "sglang.log") as base:
            yield base


def _events(raw: str) -> list[str]:
    return [e.removeprefix("data: ") for e in raw.split("\n\n") if e.strip()]


async def _streaming(http: httpx.AsyncClient, max_new_tokens: int = 400) -> tuple[asyncio.Task, list[dict]]:
    """A streamed /generate as a task collecting its events; returns once the first arrived."""
    events: list[dict] = []
    first = asyncio.Event()

    async def consume() -> None:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": max_new_tokens}, "stream": True}
        async with http.stream("POST", "/generate", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(msgspec.json.decode(line[6:]))
                    first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 60)
    return task, events


def _generate(max_new_tokens: int, **fields) -> dict:
    return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": max_new_tokens}, **fields}


def test_stream_sends_cumulative_events_then_done(url):
    """Point 1 (test_skip_tokenizer_init.py's streaming case; SGLang's default, not
    --incremental-streaming-output): each event holds the answer so far, the finish reason comes
    on the last, then ``data: [DONE]``."""
    raw = httpx.post(f"{url}/generate", json=_generate(5, stream=True, return_logprob=True), timeout=60).text
    events = _events(raw)
    assert events[-1] == "[DONE]"
    answers = [msgspec.json.decode(e) for e in events[:-1]]
    ids = answers[-1]["output_ids"]
    assert len(ids) == 5 and all(a["output_ids"] == ids[: len(a["output_ids"])] for a in answers)
    assert answers[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert all(a["meta_info"]["finish_reason"] is None for a in answers[:-1])
    assert [t[1] for t in answers[-1]["meta_info"]["output_token_logprobs"]] == ids


def test_batch_rids_are_normalized_per_prompt(url):
    """Point 2 (test_io_struct.py, ``GenerateReqInput._normalize_rid``): one rid for a batch
    becomes ``<rid>_<i>``, a list gives each prompt its own, a list of the wrong length is a 400,
    and unnamed prompts get distinct uuid4 hex ids."""
    body = {"input_ids": [PROMPT, [1, 2]], "sampling_params": {"max_new_tokens": 1}}
    one = httpx.post(f"{url}/generate", json={**body, "rid": "job"}, timeout=60).json()
    listed = httpx.post(f"{url}/generate", json={**body, "rid": ["a", "b"]}, timeout=60).json()
    short = httpx.post(f"{url}/generate", json={**body, "rid": ["a"]}, timeout=60)
    unnamed = httpx.post(f"{url}/generate", json=body, timeout=60).json()
    assert [r["meta_info"]["id"] for r in one] == ["job_0", "job_1"]
    assert [r["meta_info"]["id"] for r in listed] == ["a", "b"]
    assert short.status_code == 400
    ids = [r["meta_info"]["id"] for r in unnamed]
    assert len(set(ids)) == 2 and all(len(i) == 32 for i in ids)


def test_input_top_logprobs_at_the_default_start_are_none(url):
    """Point 3 (test_srt_endpoint.py's top-logprob cases): with ``logprob_start_len`` left at -1
    the input side holds SGLang's single ``None``."""
    body = _generate(0, return_logprob=True, top_logprobs_num=3)
    meta = httpx.post(f"{url}/generate", json=body, timeout=60).json()["meta_info"]
    assert meta["input_top_logprobs"] == [None]
    assert meta["input_token_logprobs"] == [[None, PROMPT[-1], None]]


def test_requests_past_the_context_length_are_refused(url):
    """Point 4 (TestRequestLengthValidation): prompt + max_new_tokens beyond the model's context
    is a 400 that speaks of the context length."""
    too_long = {"input_ids": [1] * 500, "sampling_params": {"max_new_tokens": 100}}
    response = httpx.post(f"{url}/generate", json=too_long, timeout=60)
    assert response.status_code == 400 and "context length" in response.text
    assert httpx.post(f"{url}/generate", json=_generate(2), timeout=60).status_code == 200


def test_model_path_follows_a_disk_update(url, tmp_path):
    """Point 7 (TestServerUpdateWeightsFromDisk): /get_model_info names the weights served."""
    tiny_qwen3(3, head_dim=64).save_pretrained(tmp_path / "v1")
    body = {"model_path": str(tmp_path / "v1"), "weight_version": "1"}
    updated = httpx.post(f"{url}/update_weights_from_disk", json=body, timeout=120).json()
    info = httpx.get(f"{url}/get_model_info", timeout=60).json()
    assert updated["success"] and info["model_path"] == str(tmp_path / "v1")
    assert httpx.get(f"{url}/get_weight_version", timeout=60).json()["weight_version"] == "1"


def test_abort_pause_ends_running_requests_and_holds_new_ones(url):
    """Point 8, mode ``abort`` (SGLang's default; TestAbortAll's finish reason): a request in
    flight ends before the pause answers, with ``finish_reason`` abort and the tokens sampled so
    far; a request sent while paused waits for /continue_generation; nothing blocks a flush."""

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            task, events = await _streaming(http)
            paused = await http.post("/pause_generation", json={})
            await asyncio.wait_for(task, 30)
            held = asyncio.create_task(http.post("/generate", json=_generate(3)))
            await asyncio.sleep(1.0)
            was_held = not held.done()
            flushed = await http.post("/flush_cache")
            await http.post("/continue_generation")
            return paused, events[-1], was_held, flushed, await asyncio.wait_for(held, 60)

    paused, last, was_held, flushed, later = asyncio.run(run())
    assert paused.status_code == 200
    assert last["meta_info"]["finish_reason"]["type"] == "abort" and 1 <= len(last["output_ids"]) < 400
    assert was_held and flushed.status_code == 200
    assert later.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


@pytest.mark.parametrize(("mode", "flushable"), [("retract", True), ("in_place", False)])
def test_retract_and_in_place_pauses_keep_requests_for_continue(url, mode, flushable):
    """Point 8, modes ``retract`` and ``in_place`` (``Scheduler.pause_generation``): the request
    in flight survives the pause and finishes after /continue_generation with all its tokens.
    ``retract`` takes it out of the running batch, so the cache can be flushed while paused
    (TestServerUpdateWeightsFromTensorNonBlocking flushes there); ``in_place`` keeps it running,
    so a flush is refused (SGLang's "Cache not flushed because there are pending requests")."""

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            task, events = await _streaming(http, max_new_tokens=200)
            await http.post("/pause_generation", json={"mode": mode})
            flushed = await http.post("/flush_cache")
            await asyncio.sleep(0.5)
            during = len(events)
            await http.post("/continue_generation")
            await asyncio.wait_for(task, 120)
            return flushed, during, events

    flushed, during, events = asyncio.run(run())
    assert (flushed.status_code == 200) is flushable, flushed.text
    assert len(events) > during  # the answer went on after continue
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 200}
    assert len(events[-1]["output_ids"]) == 200
