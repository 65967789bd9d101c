"""The proxy over real HTTP on loopback, against the scripted bigram engine (a real sampler).

Checks the OpenAI wire format (JSON and SSE), prompt chaining by exact ids, trajectory rows,
and every bad-input path: malformed JSON, unknown/finished keys, unsupported parameters,
oversize bodies, client disconnects, engine failures, exhausted budgets.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re

import httpx
import pytest
from agentflow_testkit import CODEC, BigramEngine, ScriptedBigramPolicy, WholeBigramEngine

from loong_agentflow.agent import EpisodeSpec
from loong_agentflow.proxy import ProxyConfig, ProxyServer
from loong_agentflow.proxy.render import ChatMLRenderer
from loong_core.protocols import SamplingParams
from loong_core.records import EpisodeStatus, SpanSource, TokenSpan

pytestmark = pytest.mark.integration

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
SCRIPT = [f"Adding.{CALL}", "It is 5."]
USER = [{"role": "user", "content": "add 2 and 3"}]


class CountingRenderer(ChatMLRenderer):
    def __init__(self) -> None:
        super().__init__(CODEC)
        self.full_renders = 0

    def render(self, messages, tools):
        self.full_renders += 1
        return super().render(messages, tools)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def _client(proxy: ProxyServer, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=proxy.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def _spec(i: int = 0) -> EpisodeSpec:
    return EpisodeSpec(f"s{i}", "g0", {})


def _sse(text: str) -> list[dict | str]:
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


def test_multi_turn_chat_chains_exact_ids_into_one_row():
    async def main():
        engine, renderer = BigramEngine(ScriptedBigramPolicy(SCRIPT)), CountingRenderer()
        async with ProxyServer(engine, renderer) as proxy:
            session = proxy.open_session(_spec())
            async with await _client(proxy, session.api_key) as c:
                r = await c.post("/chat/completions", json={"messages": USER, "top_p": 0.5, "logprobs": True})
                body = r.json()
                assert r.status_code == 200 and body["object"] == "chat.completion"
                choice = body["choices"][0]
                assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Adding."
                call = choice["message"]["tool_calls"][0]
                assert call["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
                assert [e["logprob"] for e in choice["logprobs"]["content"]] == engine.log[0][1].logprobs
                tool = {"role": "tool", "tool_call_id": call["id"], "content": "5"}
                messages = [*USER, choice["message"], tool]
                r = await c.post("/chat/completions", json={"messages": messages, "top_p": 0.5})
                assert r.json()["choices"][0]["message"]["content"] == "It is 5."
            proxy.close_session(session)
        assert renderer.full_renders == 1  # the second prompt reused ids + tokenized only the tool turn
        (p1, s1), (p2, s2) = engine.log
        assert p2 == p1 + s1.token_ids + CODEC.encode(
            "\n<|im_start|>user\n<tool_response>5</tool_response><|im_end|>\n<|im_start|>assistant\n"
        )
        (row,) = session.trajectories(1.0, EpisodeStatus.OK)
        assert [s.source for s in row.spans] == [
            SpanSource.PROMPT,
            SpanSource.MODEL,
            SpanSource.TOOL,
            SpanSource.MODEL,
        ]
        assert row.token_ids == p2 + s2.token_ids
        assert row.spans[1] == s1 and row.spans[3] == s2
        assert row.loss_mask == [0] * len(p1) + [1] * len(s1.token_ids) + [0] * (
            len(p2) - len(p1) - len(s1.token_ids)
        ) + [1] * len(s2.token_ids)
        assert row.info["rows"] == "1" and row.info["calls"] == "2"

    run(main())


def test_edited_history_starts_a_new_row_and_n_choices_fork():
    async def main():
        engine = BigramEngine(ScriptedBigramPolicy(["ok"]))
        async with ProxyServer(engine, ChatMLRenderer(CODEC)) as proxy:
            session = proxy.open_session(_spec())
            async with await _client(proxy, session.api_key) as c:
                r = await c.post("/chat/completions", json={"messages": USER, "n": 2, "top_p": 0.5})
                assert [ch["message"]["content"] for ch in r.json()["choices"]] == ["ok", "ok"]
                edited = [{"role": "user", "content": "something else"}]
                assert (
                    await c.post("/chat/completions", json={"messages": edited, "top_p": 0.5})
                ).status_code == 200
            proxy.close_session(session)
        rows = session.trajectories(0.5, EpisodeStatus.OK)
        assert [t.sample_id for t in rows] == ["s0", "s0#1", "s0#2"]
        assert all(t.reward == 0.5 and t.info["rows"] == "3" for t in rows)
        assert [[s.source for s in t.spans] for t in rows] == [[SpanSource.PROMPT, SpanSource.MODEL]] * 3

    run(main())


def test_stream_is_openai_sse_and_matches_the_json_answer():
    async def main():
        engine = BigramEngine(ScriptedBigramPolicy(SCRIPT))
        async with ProxyServer(engine, ChatMLRenderer(CODEC)) as proxy:
            session = proxy.open_session(_spec())
            req = {
                "messages": USER,
                "top_p": 0.5,
                "stream": True,
                "logprobs": True,
                "stream_options": {"include_usage": True},
            }
            async with await _client(proxy, session.api_key) as c:
                r = await c.post("/chat/completions", json=req)
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _sse(r.text)
        assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"]["role"] == "assistant"
        chunks = events[1:-2]
        content = "".join(e["choices"][0]["delta"].get("content") or "" for e in chunks)
        calls = [tc for e in chunks for tc in e["choices"][0]["delta"].get("tool_calls") or ()]
        assert content == "Adding."
        assert calls[0]["function"] == {"name": "add", "arguments": ""} and calls[0]["id"].startswith("call")
        assert calls[1]["function"] == {"arguments": '{"a": 2, "b": 3}'}
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        lps = [
            x["logprob"]
            for e in chunks
            if e["choices"][0]["logprobs"]
            for x in e["choices"][0]["logprobs"]["content"]
        ]
        assert lps == engine.log[0][1].logprobs
        usage = events[-2]["usage"]
        assert events[-2]["choices"] == [] and usage["completion_tokens"] == len(engine.log[0][1].token_ids)

    run(main())


def test_token_ids_on_request_are_the_ids_the_trajectory_records():
    """vLLM's ``return_token_ids``: the prompt's ids and each choice's sampled ids, in JSON, in
    the stream (chunks concatenate to them) and for text completions, equal to the engine's."""

    async def main():
        engine = BigramEngine(ScriptedBigramPolicy(SCRIPT))
        async with ProxyServer(engine, ChatMLRenderer(CODEC)) as proxy:
            session = proxy.open_session(_spec())
            async with await _client(proxy, session.api_key) as c:
                plain = (await c.post("/chat/completions", json={"messages": USER, "top_p": 0.5})).json()
                req = {"messages": USER, "top_p": 0.5, "return_token_ids": True}
                body = (await c.post("/chat/completions", json=req)).json()
                streamed = _sse((await c.post("/chat/completions", json={**req, "stream": True})).text)
                text = {"prompt": "2+3=", "max_tokens": 4, "top_p": 0.5, "return_token_ids": True}
                completion = (await c.post("/completions", json=text)).json()
        assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
        _, (p2, s2), (p3, s3), (p4, s4) = engine.log
        assert body["prompt_token_ids"] == p2 and body["choices"][0]["token_ids"] == s2.token_ids
        assert streamed[0]["prompt_token_ids"] == p3 and streamed[0]["choices"] == []
        ids = [t for e in streamed[1:-1] for t in e["choices"][0]["token_ids"]]
        assert ids == s3.token_ids
        choice = completion["choices"][0]
        assert (
            choice["prompt_token_ids"] == p4 == CODEC.encode("2+3=") and choice["token_ids"] == s4.token_ids
        )

    run(main())


def test_stop_string_cuts_the_answer_and_the_row_keeps_the_model_tokens():
    async def main():
        engine = BigramEngine(ScriptedBigramPolicy(["one. two. three."]))
        async with ProxyServer(engine, ChatMLRenderer(CODEC)) as proxy:
            session = proxy.open_session(_spec())
            async with await _client(proxy, session.api_key) as c:
                r = await c.post("/chat/completions", json={"messages": USER, "top_p": 0.5, "stop": ["two"]})
                choice = r.json()["choices"][0]
                assert choice["message"]["content"] == "one. " and choice["finish_reason"] == "stop"
                follow = [
                    *USER,
                    {"role": "assistant", "content": "one. "},
                    {"role": "user", "content": "go on"},
                ]
                assert (
                    await c.post("/chat/completions", json={"messages": follow, "top_p": 0.5})
                ).status_code == 200
            proxy.close_session(session)
        (row,) = session.trajectories(1.0, EpisodeStatus.OK)
        assert CODEC.decode(row.spans[1].token_ids) == "one. two"  # kept up to the stop string's last token
        assert CODEC.decode(row.spans[2].token_ids).startswith("<|im_end|>\n<|im_start|>user\ngo on")

    run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_generation_there(stream):
    """The engine call ends at the token that completes the stop string: the engine sampled
    exactly what the row keeps, not the rest of the scripted reply."""

    async def main():
        engine = BigramEngine(ScriptedBigramPolicy(["one. two. three."]))
        async with ProxyServer(engine, ChatMLRenderer(CODEC)) as proxy:
            session = proxy.open_session(_spec())
            req = {"messages": USER, "top_p": 0.5, "stop": ["two"], "stream": stream, "max_tokens": 200}
            async with await _client(proxy, session.api_key) as c:
                r = await c.post("/chat/completions", json=req)
            proxy.close_session(session)
        if stream:
            events = _sse(r.text)
            content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[1:-1])
            finish = events[-2]["choices"][0]["finish_reason"]
        else:
            content, finish = (
                r.json()["choices"][0]["message"]["content"],
                r.json()["choices"][0]["finish_reason"],
            )
        assert (content, finish) == ("one. ", "stop")
        ((_, sampled),) = engine.log
        assert CODEC.decode(sampled.token_ids) == "one. two"
        (row,) = session.trajectories(1.0, EpisodeStatus.OK)
        assert row.spans[1] == sampled

    run(main())


def _unstamped(body: str) -> str:
    """A JSON answer without its per-call id and timestamp."""
    return re.sub(r'"(id|created)": ?("[^"]*"|\d+)', "", body)


def _streamed_content(text: str) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in _sse(text)[1:-1] if e["choices"])


def test_an_engine_that_cannot_stream_gets_the_same_answers():
    """Without ``engine.stream`` the proxy takes whole completions and cuts them the same way."""

    async def main():
        out = []
        for engine in (
            BigramEngine(ScriptedBigramPolicy(SCRIPT)),
            WholeBigramEngine(ScriptedBigramPolicy(SCRIPT)),
        ):
            async with ProxyServer(engine, ChatMLRenderer(CODEC)) as proxy:
                session = proxy.open_session(_spec())
                async with await _client(proxy, session.api_key) as c:
                    for stream in (False, True):
                        req = {"messages": USER, "top_p": 0.5, "stream": stream, "stop": ["}}"]}
                        out.append((await c.post("/chat/completions", json=req)).text)
                proxy.close_session(session)
            out.append([t.token_ids for t in session.trajectories(1.0, EpisodeStatus.OK)])
        live, whole = out[:3], out[3:]
        assert _unstamped(live[0]) == _unstamped(whole[0]) and live[2] == whole[2]
        answer = json.loads(live[0])["choices"][0]["message"]["content"]
        assert _streamed_content(live[1]) == _streamed_content(whole[1]) == answer

    run(main())


def test_stream_chunks_leave_while_the_engine_still_samples():
    """True streaming: the first content arrives while the engine is held mid-completion."""

    async def main():
        engine = BigramEngine(ScriptedBigramPolicy(["It is 5."]))
        engine.gate = asyncio.Event()
        async with ProxyServer(engine, ChatMLRenderer(CODEC)) as proxy:
            session = proxy.open_session(_spec())
            req = {"messages": USER, "top_p": 0.5, "stream": True}
            async with (
                await _client(proxy, session.api_key) as c,
                c.stream("POST", "/chat/completions", json=req) as r,
            ):
                lines = r.aiter_lines()
                seen = ""
                while not seen:
                    line = await anext(lines)
                    if line.startswith("data: {"):
                        seen = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                assert seen == "I" and engine.log == []  # the engine has not finished: one token out
                engine.gate.set()
                rest = [line async for line in lines if line.startswith("data: ")]
            proxy.close_session(session)
        assert rest[-1] == "data: [DONE]" and len(engine.log) == 1
        content = seen + "".join(
            json.loads(x[6:])["choices"][0]["delta"].get("content") or "" for x in rest[:-1]
        )
        assert content == "It is 5."

    run(main())


def test_text_completions_chain_by_text_and_models_lists_the_policy():
    async def main():
        engine = BigramEngine(ScriptedBigramPolicy(None), seed=3)
        async with ProxyServer(engine, ChatMLRenderer(CODEC), ProxyConfig(model="tiny")) as proxy:
            session = proxy.open_session(_spec())
            async with await _client(proxy, session.api_key) as c:
                models = (await c.get("/models")).json()
                assert models["data"][0]["id"] == "tiny"
                r = (
                    await c.post("/completions", json={"prompt": "abc", "max_tokens": 5, "logprobs": 1})
                ).json()
                text = r["choices"][0]["text"]
                assert r["choices"][0]["logprobs"]["token_logprobs"] == engine.log[0][1].logprobs
                assert r["choices"][0]["finish_reason"] in ("length", "stop")
                r = await c.post(
                    "/completions", json={"prompt": "abc" + text + "xyz", "max_tokens": 3, "stream": True}
                )
                events = _sse(r.text)
                assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"]
            proxy.close_session(session)
        (p1, s1), (p2, _) = engine.log
        assert p2 == p1 + s1.token_ids + CODEC.encode("xyz")
        assert len(session.trajectories(1.0, EpisodeStatus.OK)) == 1

    run(main())


def test_bad_requests_get_openai_error_bodies():
    async def main():
        engine = BigramEngine(ScriptedBigramPolicy(["ok"]))
        config = ProxyConfig(max_body_bytes=4096)
        async with ProxyServer(engine, ChatMLRenderer(CODEC), config) as proxy:
            session = proxy.open_session(_spec())
            async with await _client(proxy, session.api_key) as c:
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
            session = proxy.open_session(_spec())
            async with await _client(proxy, session.api_key) as c:
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


def test_without_max_tokens_the_default_is_clamped_to_the_context_left():
    async def main():
        engine = BigramEngine(ScriptedBigramPolicy(["x" * 300]))
        prompt_len = len(ChatMLRenderer(CODEC).render(USER, None))
        config = ProxyConfig(context_length=prompt_len + 7, default_max_tokens=1024)
        async with ProxyServer(engine, ChatMLRenderer(CODEC), config) as proxy:
            session = proxy.open_session(_spec())
            async with await _client(proxy, session.api_key) as c:
                r = await c.post("/chat/completions", json={"messages": USER})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 7
        assert r.json()["choices"][0]["finish_reason"] == "length"

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
            session = proxy.open_session(_spec())
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
            async with await _client(proxy, session.api_key) as c:
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
            session = proxy.open_session(_spec())
            async with await _client(proxy, session.api_key) as c:
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
            async with await _client(proxy, session.api_key) as c:
                assert (await c.post("/chat/completions", json={"messages": USER})).status_code == 200

    run(main())


def test_client_disconnect_mid_stream_leaves_no_task_and_proxy_serves_on():
    async def main():
        engine = BlockingEngine()
        engine.release.set()
        async with ProxyServer(engine, ChatMLRenderer(CODEC)) as proxy:
            session = proxy.open_session(_spec())
            async with (
                await _client(proxy, session.api_key) as c,
                c.stream("POST", "/chat/completions", json={"messages": USER, "stream": True}) as r,
            ):
                first = await anext(r.aiter_bytes())
                assert first.startswith(b"data: ")
                # leaving the block closes the connection with ~4000 events unsent
            await asyncio.sleep(0.1)
            assert proxy.inflight == 0 and not _our_tasks()
            async with await _client(proxy, session.api_key) as c:
                r = await c.post("/chat/completions", json={"messages": USER, "stream": True})
                assert _sse(r.text)[-1] == "[DONE]"

    run(main())


class FailingEngine(BlockingEngine):
    async def generate(self, input_ids, sampling):
        raise RuntimeError("device lost")


def test_engine_failure_is_a_500_and_other_sessions_keep_working():
    async def main():
        async with ProxyServer(FailingEngine(), ChatMLRenderer(CODEC)) as proxy:
            session = proxy.open_session(_spec())
            async with await _client(proxy, session.api_key) as c:
                r = await c.post("/chat/completions", json={"messages": USER})
                assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
                assert "device lost" in r.json()["error"]["message"]
            proxy.close_session(session)
        (row,) = session.trajectories(0.0, EpisodeStatus.FAILED)
        assert row.spans == [] and "device lost" in row.info["proxy_errors"]

    run(main())


def test_reward_endpoint_and_session_budget():
    async def main():
        engine = BigramEngine(ScriptedBigramPolicy(["a long answer"]))
        config = ProxyConfig(max_session_model_tokens=20)
        async with ProxyServer(engine, ChatMLRenderer(CODEC), config) as proxy:
            session = proxy.open_session(_spec())
            async with await _client(proxy, session.api_key) as c:
                r = await c.post("/chat/completions", json={"messages": USER, "top_p": 0.5, "max_tokens": 10})
                assert r.json()["choices"][0]["finish_reason"] == "length"
                r = await c.post("/chat/completions", json={"messages": USER, "top_p": 0.5, "max_tokens": 50})
                assert len(engine.log[1][1].token_ids) == 10  # clamped to the budget left
                r = await c.post("/chat/completions", json={"messages": USER})
                assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
                assert session.truncated
                r = await c.post(
                    "/sessions/reward", json={"reward": 0.25, "turn_rewards": [0.0, 0.25], "done": True}
                )
                assert r.status_code == 200
                assert (await c.post("/sessions/reward", json={"reward": 1.0})).status_code == 401
        assert session.closed and session.reward == 0.25 and session.turn_rewards == [0.0, 0.25]

    run(main())
