"""The proxy's bad-input paths over real HTTP: malformed JSON, unknown or finished keys, unsupported
parameters, oversize and hostile bodies, client disconnects and engine failures."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from agentflow_testkit import CODEC, BigramEngine, ScriptedBigramPolicy
from proxy_testkit import USER, episode_spec, run, session_client, sse_events

from loong_agentflow.proxy import ProxyConfig, ProxyServer
from loong_agentflow.proxy.render import ChatMLRenderer
from loong_core.protocols import RequestRefused, SamplingParams
from loong_core.records import EpisodeStatus, SpanSource, TokenSpan

pytestmark = pytest.mark.integration


def test_bad_requests_get_openai_error_bodies():
    async def main():
        engine = BigramEngine(ScriptedBigramPolicy(["ok"]))
        config = ProxyConfig(max_body_bytes=4096)
        async with ProxyServer(engine, ChatMLRenderer(CODEC), config) as proxy:
            session = proxy.open_session(episode_spec())
            async with await session_client(proxy, session.api_key) as c:
                cases = {
                    "malformed": await c.post(
                        "/chat/completions",
                        content=b'{"messages": [',
                        headers={"content-type": "application/json"},
                    ),
                    "unknown_param": await c.post(
                        "/chat/completions", json={"messages": USER, "frobnicate": 1}
                    ),
                    "seed": await c.post("/chat/completions", json={"messages": USER, "seed": 7}),
                    "greedy": await c.post("/chat/completions", json={"messages": USER, "temperature": 0}),
                    "wrong_type": await c.post("/chat/completions", json={"messages": USER, "n": "two"}),
                    "oversize": await c.post(
                        "/chat/completions", json={"messages": [{"role": "user", "content": "x" * 5000}]}
                    ),
                }
                bad_key = await c.post(
                    "/chat/completions", json={"messages": USER}, headers={"Authorization": "Bearer nope"}
                )
                no_key = await c.get("/models", headers={"Authorization": ""})
                ok = await c.post("/chat/completions", json={"messages": USER, "top_p": 0.5})
                proxy.close_session(session)
                finished = await c.post("/chat/completions", json={"messages": USER})
        assert ok.status_code == 200
        expected = {
            "malformed": (400, None),
            "unknown_param": (400, "frobnicate"),
            "seed": (400, "seed"),
            "greedy": (400, "temperature"),
            "wrong_type": (400, "n"),
            "oversize": (413, None),
        }
        for name, (status, param) in expected.items():
            r = cases[name]
            err = r.json()["error"]
            assert r.status_code == status, name
            assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
            assert err["param"] == param, name
            if param:
                assert param in err["message"]
        for r in (bad_key, no_key, finished):
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert len(session.calls) == 1

    run(main())


def _nested(depth: int) -> dict:
    return json.loads('{"a": ' * depth + "1" + "}" * depth)


HOSTILE = {  # name: (endpoint, body, expected param); each got a 500 or a 200 with bad data before
    "temperature_1e-50": ("/chat/completions", {"messages": USER, "temperature": 1e-50}, "temperature"),
    "temperature_5e-324": ("/chat/completions", {"messages": USER, "temperature": 5e-324}, "temperature"),
    "temperature_9": ("/chat/completions", {"messages": USER, "temperature": 9}, "temperature"),
    "tools_nested_3000": ("/chat/completions", {"messages": USER, "tools": "DEEP"}, None),
    "tools_nested_100": (
        "/chat/completions",
        {"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": _nested(100)}}]},
        "tools",
    ),
    "response_format_nested": ("/chat/completions", {"messages": USER, "response_format": _nested(80)}, "response_format"),
    "max_tokens_huge": ("/chat/completions", {"messages": USER, "max_tokens": 10**9}, "max_tokens"),
    "max_tokens_past_context": ("/chat/completions", {"messages": USER, "max_tokens": 490}, "messages"),
    "prompt_past_context": ("/chat/completions", {"messages": [{"role": "user", "content": "x" * 600}]}, "messages"),
    "ids_out_of_vocab": ("/completions", {"prompt": [1000]}, "prompt"),
    "ids_negative": ("/completions", {"prompt": [3, -1]}, "prompt"),
    "ids_int64_max": ("/completions", {"prompt": [2**63 - 1]}, "prompt"),
    "ids_empty": ("/completions", {"prompt": []}, "prompt"),
    "text_empty": ("/completions", {"prompt": ""}, "prompt"),
}  # fmt: skip


def test_hostile_requests_get_openai_4xx_bodies_and_record_nothing():
    """Requests that got a 500 (or a 200 with garbage) get a 400 naming what is wrong; none of
    them reaches the engine or the session's calls, and the proxy serves on."""

    async def main():
        engine = BigramEngine(ScriptedBigramPolicy(["ok"]))
        config = ProxyConfig(context_length=512, vocab_size=120, max_tokens_limit=4096)
        async with ProxyServer(engine, ChatMLRenderer(CODEC), config) as proxy:
            session = proxy.open_session(episode_spec())
            async with await session_client(proxy, session.api_key) as c:
                answers = {}
                for name, (path, body, _) in HOSTILE.items():
                    if body.get("tools") == "DEEP":  # deeper than any decoder recursion
                        deep = '{"a": ' * 3000 + "1" + "}" * 3000
                        raw = (
                            '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
                        )
                        raw += '"function": {"name": "f", "parameters": ' + deep + "}}]}"
                        answers[name] = await c.post(
                            path, content=raw, headers={"content-type": "application/json"}
                        )
                    else:
                        answers[name] = await c.post(path, json=body)
                ok = await c.post("/chat/completions", json={"messages": USER})
        for name, (_, _, param) in HOSTILE.items():
            r = answers[name]
            assert r.status_code == 400, (name, r.status_code, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, name
            assert err["param"] == param, (name, err)
        assert "512 tokens" in answers["max_tokens_past_context"].json()["error"]["message"]
        assert answers["prompt_past_context"].json()["error"]["code"] == "context_length_exceeded"
        assert "[1000]" in answers["ids_out_of_vocab"].json()["error"]["message"]
        assert ok.status_code == 200 and len(session.calls) == 1  # only the valid call was recorded

    run(main())


class BlockingEngine:
    """Blocks in generate until released; records cancellations."""

    weight_version = 0

    def __init__(self) -> None:
        self.started, self.release = asyncio.Event(), asyncio.Event()
        self.cancelled = 0

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> TokenSpan:
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return TokenSpan(
            token_ids=CODEC.encode("x" * 4000),
            source=SpanSource.MODEL,
            logprobs=[-1.0] * 4000,
            weight_version=0,
        )


def _our_tasks() -> list[asyncio.Task]:
    return [
        t
        for t in asyncio.all_tasks()
        if "generate" in repr(t.get_coro()) or "_disconnected" in repr(t.get_coro())
    ]


def test_a_client_that_hangs_up_mid_body_ends_quietly(caplog):
    """A request whose client closes the connection halfway through its body: no traceback in
    the log (one debug line), nothing recorded, and the proxy serves on."""

    async def main():
        engine = BigramEngine(ScriptedBigramPolicy(["ok"]))
        async with ProxyServer(engine, ChatMLRenderer(CODEC)) as proxy:
            session = proxy.open_session(episode_spec())
            for _ in range(3):
                _, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
                head = (
                    "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Authorization: Bearer {session.api_key}\r\nContent-Length: 5000\r\n\r\n"
                )
                writer.write(head.encode() + b'{"messages": [{"role": "user", "content": "')
                await writer.drain()
                await asyncio.sleep(0.05)
                writer.close()
                await writer.wait_closed()
            await asyncio.sleep(0.1)
            async with await session_client(proxy, session.api_key) as c:
                ok = await c.post("/chat/completions", json={"messages": USER})
        assert ok.status_code == 200 and len(session.calls) == 1

    with caplog.at_level(logging.DEBUG):
        run(main())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "Exception in ASGI application" not in caplog.text and "Traceback" not in caplog.text
    assert caplog.text.count("the client disconnected while sending the request") == 3


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_while_generating_cancels_the_engine_call(stream):
    async def main():
        engine = BlockingEngine()
        async with ProxyServer(engine, ChatMLRenderer(CODEC)) as proxy:
            session = proxy.open_session(episode_spec())
            async with await session_client(proxy, session.api_key) as c:
                req = asyncio.create_task(
                    c.post("/chat/completions", json={"messages": USER, "stream": stream})
                )
                await engine.started.wait()
                assert proxy.inflight == 1
                req.cancel()  # closes the connection
                for _ in range(200):
                    if engine.cancelled:
                        break
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            assert engine.cancelled == 1 and proxy.inflight == 0 and not _our_tasks()
            assert session.calls == []
            engine.release.set()  # the proxy still serves the session
            async with await session_client(proxy, session.api_key) as c:
                assert (await c.post("/chat/completions", json={"messages": USER})).status_code == 200

    run(main())


def test_client_disconnect_mid_stream_leaves_no_task_and_proxy_serves_on():
    async def main():
        engine = BlockingEngine()
        engine.release.set()
        async with ProxyServer(engine, ChatMLRenderer(CODEC)) as proxy:
            session = proxy.open_session(episode_spec())
            async with (
                await session_client(proxy, session.api_key) as c,
                c.stream("POST", "/chat/completions", json={"messages": USER, "stream": True}) as r,
            ):
                first = await anext(r.aiter_bytes())
                assert first.startswith(b"data: ")
                # leaving the block closes the connection with ~4000 events unsent
            await asyncio.sleep(0.1)
            assert proxy.inflight == 0 and not _our_tasks()
            async with await session_client(proxy, session.api_key) as c:
                r = await c.post("/chat/completions", json={"messages": USER, "stream": True})
                assert sse_events(r.text)[-1] == "[DONE]"

    run(main())


class FailingEngine(BlockingEngine):
    async def generate(self, input_ids, sampling):
        raise RuntimeError("device lost")


def test_engine_failure_is_a_500_and_other_sessions_keep_working():
    async def main():
        async with ProxyServer(FailingEngine(), ChatMLRenderer(CODEC)) as proxy:
            session = proxy.open_session(episode_spec())
            async with await session_client(proxy, session.api_key) as c:
                r = await c.post("/chat/completions", json={"messages": USER})
                assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
                assert "device lost" in r.json()["error"]["message"]
            proxy.close_session(session)
        (row,) = session.trajectories(0.0, EpisodeStatus.FAILED)
        assert row.spans == [] and "device lost" in row.info["proxy_errors"]

    run(main())


class RefusingEngine(BlockingEngine):
    async def generate(self, input_ids, sampling):
        raise RequestRefused(f"the prompt has {len(input_ids)} tokens; the model has 8 positions")


def test_a_request_the_engine_refuses_is_a_400_naming_why_and_no_engine_error():
    """The engine's :class:`RequestRefused` is the client's mistake (the model cannot take the
    prompt), answered as OpenAI answers one; the session records no engine error."""

    async def main():
        async with ProxyServer(RefusingEngine(), ChatMLRenderer(CODEC)) as proxy:
            session = proxy.open_session(episode_spec())
            async with await session_client(proxy, session.api_key) as c:
                r = await c.post("/chat/completions", json={"messages": USER})
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert (error["type"], error["param"]) == ("invalid_request_error", "messages")
                assert "the model has 8 positions" in error["message"]
                r = await c.post("/completions", json={"prompt": "2+2="})
                assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
                for path, body in (
                    ("/chat/completions", {"messages": USER}),
                    ("/completions", {"prompt": "2"}),
                ):
                    # streamed: the refusal comes before any event, so it is the response itself
                    r = await c.post(path, json={**body, "stream": True})
                    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
                    assert "the model has 8 positions" in r.json()["error"]["message"]
            proxy.close_session(session)
        assert session.errors == []

    run(main())
