"""SGLangEngine's HTTP behaviour over real loopback HTTP against a scripted SGLang-shaped server.

What the server answers is scripted (its bodies have SGLang's ``/generate`` shape); the client, its
retries, error mapping and version parsing run for real. Generation against a real model is
tested in loong-train's tests/test_sglang_server.py (the embedded SGLang-compatible server).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loong_agentflow.sglang_client import SGLangClientConfig, SGLangEngine, SGLangError
from loong_core.net import free_port
from loong_core.protocols import RequestRefused, RolloutEngine, SamplingParams


def _reply(version="default", finish=None, ids=(7, 8)):
    return {
        "output_ids": list(ids),
        "meta_info": {
            "id": "x",
            "finish_reason": finish or {"type": "length", "length": len(ids)},
            "weight_version": version,
            "output_token_logprobs": [[-0.5 * (i + 1), t, None] for i, t in enumerate(ids)],
        },
    }


@contextlib.contextmanager
def _scripted(answers: list):
    """Serve ``answers`` in order (a dict is a 200 body, a str a 200 event stream, an int a bare
    status); log each request."""
    seen: list[tuple[str, dict]] = []

    async def handle(request: Request):
        seen.append((request.url.path, await request.json() if await request.body() else {}))
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, int):
            return JSONResponse({"message": f"scripted {answer}"}, status_code=answer)
        if isinstance(answer, str):
            return Response(answer, media_type="text/event-stream")
        return JSONResponse(answer)

    paths = ["/generate", "/pause_generation", "/continue_generation", "/get_weight_version"]
    app = Starlette(routes=[Route(p, handle, methods=["GET", "POST"]) for p in paths])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", seen
    finally:
        server.should_exit = True
        thread.join(10)


def _generate(url: str, **config):
    async def run():
        engine = SGLangEngine(SGLangClientConfig(url=url, backoff_s=0.01, **config))
        try:
            return await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2, stop_token_ids=[8]))
        finally:
            await engine.aclose()

    return asyncio.run(run())


def test_span_request_fields_and_default_version():
    with _scripted([_reply()]) as (url, seen):
        span = _generate(url, initial_version=4)
    assert span.token_ids == [7, 8] and span.logprobs == [-0.5, -1.0] and span.weight_version == 4
    path, body = seen[0]
    assert path == "/generate" and body["input_ids"] == [1, 2, 3] and body["return_logprob"] is True
    assert body["sampling_params"] == {
        "max_new_tokens": 2,
        "temperature": 1.0,
        "top_p": 1.0,
        "stop_token_ids": [8],
    }


def test_unavailable_answers_are_retried_then_succeed():
    with _scripted([503, 503, _reply(version="12")]) as (url, seen):
        span = _generate(url, retries=3)
    assert len(seen) == 3 and span.weight_version == 12


def test_client_errors_are_not_retried_and_carry_the_message():
    """A 400 is the server refusing this request (the caller's mistake: RequestRefused); another
    4xx is an SGLangError. Neither is retried."""
    with _scripted([400]) as (url, seen), pytest.raises(RequestRefused, match="400: scripted 400"):
        _generate(url, retries=3)
    assert len(seen) == 1
    with _scripted([404]) as (url, seen), pytest.raises(SGLangError, match="404: scripted 404"):
        _generate(url, retries=3)
    assert len(seen) == 1


def test_unreachable_server_fails_after_the_retries():
    port = free_port()  # nothing listens there
    with pytest.raises(SGLangError, match="unreachable after 3 tries"):
        _generate(f"http://127.0.0.1:{port}", retries=2)


def test_an_aborted_answer_is_continued_from_its_tokens():
    """An ``abort`` pause ends a request with the tokens so far; the client sends it again with
    them appended and the budget reduced, and joins the two answers."""
    aborted = _reply(version="3", finish={"type": "abort", "message": "paused"}, ids=(7,))
    with _scripted([aborted, _reply(version="4", ids=(9,))]) as (url, seen):
        span = _generate(url)
    assert span.token_ids == [7, 9] and span.logprobs == [-0.5, -0.5] and span.token_versions() == [3, 4]
    assert [body["input_ids"] for _, body in seen] == [[1, 2, 3], [1, 2, 3, 7]]
    assert [body["sampling_params"]["max_new_tokens"] for _, body in seen] == [2, 1]


async def _stream(url):
    engine = SGLangEngine(SGLangClientConfig(url=url))
    try:
        return [s async for s in engine.stream([1, 2, 3], SamplingParams(max_new_tokens=2))]
    finally:
        await engine.aclose()


def test_an_aborted_stream_is_continued_from_its_tokens():
    """As ``generate``: the stream goes on with a second request holding the tokens so far; each
    part keeps the version the server named."""
    aborted = _reply(version="3", finish={"type": "abort", "message": "paused"}, ids=(7,))
    first = f"data: {json.dumps(aborted)}\n\ndata: [DONE]\n\n"
    second = f"data: {json.dumps(_reply(version='4', ids=(9,)))}\n\ndata: [DONE]\n\n"
    with _scripted([first, second]) as (url, seen):
        spans = asyncio.run(_stream(url))
    assert [(s.token_ids, s.weight_version) for s in spans] == [([7], 3), ([9], 4)]
    assert [body["input_ids"] for _, body in seen] == [[1, 2, 3], [1, 2, 3, 7]]
    assert [body["sampling_params"]["max_new_tokens"] for _, body in seen] == [2, 1]


def test_a_request_aborted_again_and_again_without_tokens_raises():
    """A server that keeps aborting a request before its first token (not a weight update's one
    pause) fails it after ``MAX_IDLE_ABORTS`` tries, in ``generate`` and ``stream`` alike."""
    from loong_agentflow.sglang_client import MAX_IDLE_ABORTS

    empty = _reply(finish={"type": "abort", "message": "deadline"}, ids=())
    with _scripted([empty]) as (url, seen), pytest.raises(SGLangError, match="aborted 8 times in a row"):
        _generate(url)
    assert len(seen) == MAX_IDLE_ABORTS == 8
    events = f"data: {json.dumps(empty)}\n\ndata: [DONE]\n\n"
    with _scripted([events]) as (url, seen), pytest.raises(SGLangError, match="deadline"):
        asyncio.run(_stream(url))
    assert len(seen) == MAX_IDLE_ABORTS


def test_broken_streams_and_non_integer_versions_raise():
    cut = f"data: {json.dumps(_reply(ids=(7,)))}\n\n"  # no [DONE]: the stream broke off
    with _scripted([cut]) as (url, _), pytest.raises(SGLangError, match=r"ended without data: \[DONE\]"):
        asyncio.run(_stream(url))
    with _scripted([_reply(version="step-3")]) as (url, _), pytest.raises(SGLangError, match="step-3"):
        _generate(url)


def test_pause_resume_and_version_refresh_hit_sglang_endpoints():
    with _scripted([{"status": "ok"}, {"status": "ok"}, {"weight_version": "9"}]) as (url, seen):
        engine = SGLangEngine(SGLangClientConfig(url=url, pause_mode="retract"))
        assert isinstance(engine, RolloutEngine)
        engine.pause()
        engine.resume()

        async def refresh():
            try:
                return await engine.refresh_version()
            finally:
                await engine.aclose()

        assert asyncio.run(refresh()) == 9 == engine.weight_version
    assert seen == [
        ("/pause_generation", {"mode": "retract"}),
        ("/continue_generation", {}),
        ("/get_weight_version", {}),
    ]
