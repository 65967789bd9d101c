"""The proxy over real HTTP on loopback, against the scripted bigram engine (a real sampler): the
OpenAI JSON answers, prompt chaining by exact ids, trajectory rows, text completions, the
session's token budget and its reward."""

from __future__ import annotations

import pytest
from agentflow_testkit import CODEC, BigramEngine, ScriptedBigramPolicy
from proxy_testkit import SCRIPT, USER, episode_spec, run, session_client, sse_events

from loong_agentflow.proxy import ProxyConfig, ProxyServer
from loong_agentflow.proxy.render import ChatMLRenderer
from loong_core.records import EpisodeStatus, SpanSource

pytestmark = pytest.mark.integration


class CountingRenderer(ChatMLRenderer):
    def __init__(self) -> None:
        super().__init__(CODEC)
        self.full_renders = 0

    def render(self, messages, tools):
        self.full_renders += 1
        return super().render(messages, tools)


def test_multi_turn_chat_chains_exact_ids_into_one_row():
    async def main():
        engine, renderer = BigramEngine(ScriptedBigramPolicy(SCRIPT)), CountingRenderer()
        async with ProxyServer(engine, renderer) as proxy:
            session = proxy.open_session(episode_spec())
            async with await session_client(proxy, session.api_key) as c:
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
            session = proxy.open_session(episode_spec())
            async with await session_client(proxy, session.api_key) as c:
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


def test_text_completions_chain_by_text_and_models_lists_the_policy():
    async def main():
        engine = BigramEngine(ScriptedBigramPolicy(None), seed=3)
        async with ProxyServer(engine, ChatMLRenderer(CODEC), ProxyConfig(model="tiny")) as proxy:
            session = proxy.open_session(episode_spec())
            async with await session_client(proxy, session.api_key) as c:
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
                events = sse_events(r.text)
                assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"]
            proxy.close_session(session)
        (p1, s1), (p2, _) = engine.log
        assert p2 == p1 + s1.token_ids + CODEC.encode("xyz")
        assert len(session.trajectories(1.0, EpisodeStatus.OK)) == 1

    run(main())


def test_without_max_tokens_the_default_is_clamped_to_the_context_left():
    async def main():
        engine = BigramEngine(ScriptedBigramPolicy(["x" * 300]))
        prompt_len = len(ChatMLRenderer(CODEC).render(USER, None))
        config = ProxyConfig(context_length=prompt_len + 7, default_max_tokens=1024)
        async with ProxyServer(engine, ChatMLRenderer(CODEC), config) as proxy:
            session = proxy.open_session(episode_spec())
            async with await session_client(proxy, session.api_key) as c:
                r = await c.post("/chat/completions", json={"messages": USER})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 7
        assert r.json()["choices"][0]["finish_reason"] == "length"

    run(main())


def test_reward_endpoint_and_session_budget():
    async def main():
        engine = BigramEngine(ScriptedBigramPolicy(["a long answer"]))
        config = ProxyConfig(max_session_model_tokens=20)
        async with ProxyServer(engine, ChatMLRenderer(CODEC), config) as proxy:
            session = proxy.open_session(episode_spec())
            async with await session_client(proxy, session.api_key) as c:
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
