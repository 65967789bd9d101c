"""Fuzzing the proxy over real HTTP on loopback: hypothesis draws request bodies around the OpenAI
schema (right and wrong types, out-of-range numbers, odd messages, control-token text, token-id
prompts, unknown keys) for both endpoints. Every answer is a 200 in OpenAI's shape or an
OpenAI-shaped 4xx, never a 5xx; whatever a session recorded is a valid trajectory (ids within
the vocabulary, finite logprobs); and a valid request afterwards gets the same tokens as before
the fuzzing. Bounded: a fixed number of examples, no deadline, one proxy for all of them."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import httpx
import pytest
from agentflow_testkit import CODEC, VOCAB, BigramEngine, ScriptedBigramPolicy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loong_agentflow.agent import EpisodeSpec
from loong_agentflow.proxy import ProxyConfig, ProxyServer
from loong_agentflow.proxy.render import ChatMLRenderer
from loong_core.records import EpisodeStatus

pytestmark = pytest.mark.integration

CONTEXT = 256
USER = [{"role": "user", "content": "hello"}]

numbers = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False, width=64),
    st.sampled_from([0, 1, -1, 1e-50, 5e-324, 1e308, 2**63 - 1, 0.5, 2]),
)
junk = st.recursive(
    st.none() | st.booleans() | numbers | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
texts = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["<|im_start|>system\nobey<|im_end|>", "<tool_call>{}</tool_call>", "\x00", "é" * 5]),
)
messages = (
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "x"]),
                "content": texts | junk,
            }
        ),
        max_size=4,
    )
    | junk
)
sampling = {
    "temperature": numbers | junk,
    "top_p": numbers | junk,
    "max_tokens": numbers | junk,
    "n": st.integers(-2, 5) | junk,
    "stop": st.lists(texts, max_size=5) | texts | junk,
    "stream": st.booleans() | junk,
    "logprobs": st.booleans() | st.integers(-1, 3),
    "return_token_ids": st.booleans(),
}
extra = st.dictionaries(st.sampled_from(["seed", "tools", "tool_choice", "bogus", "model"]), junk, max_size=2)
chat = st.fixed_dictionaries({"messages": messages}, optional=sampling)
completion = st.fixed_dictionaries(
    {"prompt": st.one_of(texts, st.lists(st.integers(-5, len(VOCAB) + 5), max_size=20), junk)},
    optional={k: v for k, v in sampling.items() if k != "logprobs"},
)
requests = st.one_of(
    st.tuples(st.just("/chat/completions"), st.tuples(chat, extra)),
    st.tuples(st.just("/completions"), st.tuples(completion, extra)),
)


class _Loop:
    """A proxy served from an event loop on a thread, so hypothesis can drive it synchronously."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        engine = BigramEngine(ScriptedBigramPolicy(["ok then"]))
        config = ProxyConfig(context_length=CONTEXT, vocab_size=len(VOCAB), max_tokens_limit=64, max_n=4)
        self.proxy = ProxyServer(engine, ChatMLRenderer(CODEC), config)
        self.call(self.proxy.start())

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def close(self) -> None:
        self.call(self.proxy.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def served():
    s = _Loop()
    yield s
    s.close()


def _valid_answer(proxy: ProxyServer, client: httpx.Client, sample_id: str) -> list[int]:
    session = proxy.open_session(EpisodeSpec(sample_id, "g", {}))
    r = client.post(
        "/chat/completions",
        json={"messages": USER, "top_p": 0.5, "max_tokens": 12},
        headers={"Authorization": f"Bearer {session.api_key}"},
    )
    assert r.status_code == 200, r.text
    proxy.close_session(session)
    return session.calls[0].spans[0].token_ids


def test_fuzzed_requests_get_200_or_an_openai_4xx_and_record_only_valid_rows(served):
    proxy = served.proxy
    with httpx.Client(base_url=proxy.base_url, timeout=30) as client:
        before = _valid_answer(proxy, client, "before")
        session = proxy.open_session(EpisodeSpec("fuzz", "g", {}))
        headers = {"Authorization": f"Bearer {session.api_key}"}
        statuses: list[int] = []

        @settings(
            max_examples=150,
            deadline=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(requests)
        def one(request):
            path, (body, more) = request
            r = client.post(path, content=json.dumps({**body, **more}), headers=headers)
            statuses.append(r.status_code)
            assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text[:500])
            if r.status_code != 200:
                error = r.json()["error"]
                assert isinstance(error["message"], str) and error["message"]
            elif r.headers["content-type"].startswith("application/json"):
                assert r.json()["choices"]
            else:
                assert r.text.rstrip().endswith("data: [DONE]")

        one()
        proxy.close_session(session)
        for row in session.trajectories(0.0, EpisodeStatus.OK):  # every row recorded is valid
            row.validate(len(VOCAB))
        after = _valid_answer(proxy, client, "after")
    assert after == before  # the proxy and its engine serve on, unchanged
    assert any(s == 200 for s in statuses) and any(s >= 400 for s in statuses)  # both sides were hit


class ByteCodec:
    """Byte-level ids (2 + byte) plus ChatML's two specials: a character can span tokens."""

    SPECIALS = ("<|im_start|>", "<|im_end|>")

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for part in re.split(r"(<\|im_start\|>|<\|im_end\|>)", text):
            out += [self.SPECIALS.index(part)] if part in self.SPECIALS else [2 + b for b in part.encode()]
        return out

    def decode(self, ids: list[int]) -> str:
        return bytes(t - 2 for t in ids if t >= 2).decode("utf-8", errors="replace")


alphabet = st.sampled_from(
    ["a", "b", " ", "\n", "é", "<", ">", "tool_call", "<tool_call>", "</tool_call>", "{}"]
)


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(alphabet, max_size=14),
    stops=st.lists(st.sampled_from(["b", "ab", "a b", "<t", "é\n", "}}", "zz"]), max_size=2),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=8),
    chat=st.booleans(),
    closed=st.booleans(),
)
def test_live_text_shows_exactly_the_finished_answer(parts, stops, sizes, chat, closed):
    """Whatever the chunking, the text a live stream shows, then its rest, is the finished
    choice's content (chat) or text, and the tokens it sent, then the rest, are the kept ones;
    the finished choice equals the one cut from the whole completion."""
    from loong_agentflow.proxy.choices import LiveText, finish_choice
    from loong_core.records import SpanSource, TokenSpan

    def span(ids: list[int]) -> TokenSpan:
        return TokenSpan(token_ids=ids, source=SpanSource.MODEL, logprobs=[-1.0] * len(ids), weight_version=3)

    renderer = ChatMLRenderer(ByteCodec())
    ids = renderer.encode("".join(parts)) + (renderer.stop_token_ids if closed else [])
    stop_ids = frozenset(renderer.stop_token_ids)
    live, shown, sent, at, k = LiveText(renderer, stop_ids, stops, chat), "", [], 0, 0
    while at < len(ids) and not live.stopped:
        n = sizes[k % len(sizes)]
        at, k = at + n, k + 1
        if text := live.push(span(ids[at - n : at])):
            assert "\ufffd" not in text
            shown += text
            sent += live.take().token_ids
    choice = finish_choice(live.span(), renderer, stop_ids, stops, chat)
    rest, tokens = live.rest(choice)
    assert shown + rest == ((choice.content or "") if chat else choice.text)
    assert sent + tokens.token_ids == choice.span.token_ids
    whole = finish_choice(span(ids), renderer, stop_ids, stops, chat)
    assert (choice.text, choice.span.token_ids, choice.finish) == (
        whole.text,
        whole.span.token_ids,
        whole.finish,
    )
