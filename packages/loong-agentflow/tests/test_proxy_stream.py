"""The proxy's streamed answers (OpenAI SSE), token ids on request and stop strings, over real
HTTP against the scripted bigram engine; an engine that cannot stream gives the same answers."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from agentflow_testkit import CODEC, BigramEngine, ScriptedBigramPolicy, WholeBigramEngine
from proxy_testkit import SCRIPT, USER, episode_spec, run, session_client, sse_events

from loong_agentflow.proxy import ProxyServer
from loong_agentflow.proxy.render import ChatMLRenderer
from loong_core.records import EpisodeStatus

pytestmark = pytest.mark.integration


def test_stream_is_openai_sse_and_matches_the_json_answer():
    async def main():
        engine = BigramEngine(ScriptedBigramPolicy(SCRIPT))
        async with ProxyServer(engine, ChatMLRenderer(CODEC)) as proxy:
            session = proxy.open_session(episode_spec())
            req = {
                "messages": USER,
                "top_p": 0.5,
                "stream": True,
                "logprobs": True,
                "stream_options": {"include_usage": True},
            }
            async with await session_client(proxy, session.api_key) as c:
                r = await c.post("/chat/completions", json=req)
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
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
            session = proxy.open_session(episode_spec())
            async with await session_client(proxy, session.api_key) as c:
                plain = (await c.post("/chat/completions", json={"messages": USER, "top_p": 0.5})).json()
                req = {"messages": USER, "top_p": 0.5, "return_token_ids": True}
                body = (await c.post("/chat/completions", json=req)).json()
                streamed = sse_events((await c.post("/chat/completions", json={**req, "stream": True})).text)
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
            session = proxy.open_session(episode_spec())
            async with await session_client(proxy, session.api_key) as c:
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
            session = proxy.open_session(episode_spec())
            req = {"messages": USER, "top_p": 0.5, "stop": ["two"], "stream": stream, "max_tokens": 200}
            async with await session_client(proxy, session.api_key) as c:
                r = await c.post("/chat/completions", json=req)
            proxy.close_session(session)
        if stream:
            events = sse_events(r.text)
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
    return "".join(
        e["choices"][0]["delta"].get("content") or "" for e in sse_events(text)[1:-1] if e["choices"]
    )


def test_an_engine_that_cannot_stream_gets_the_same_answers():
    """Without ``engine.stream`` the proxy takes whole completions and cuts them the same way."""

    async def main():
        out = []
        for engine in (
            BigramEngine(ScriptedBigramPolicy(SCRIPT)),
            WholeBigramEngine(ScriptedBigramPolicy(SCRIPT)),
        ):
            async with ProxyServer(engine, ChatMLRenderer(CODEC)) as proxy:
                session = proxy.open_session(episode_spec())
                async with await session_client(proxy, session.api_key) as c:
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
            session = proxy.open_session(episode_spec())
            req = {"messages": USER, "top_p": 0.5, "stream": True}
            async with (
                await session_client(proxy, session.api_key) as c,
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
