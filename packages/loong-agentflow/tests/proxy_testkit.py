"""What the proxy tests share: a scripted tool-call exchange for the bigram policy, a client that
carries a session's key, OpenAI SSE parsing, and a 60 s bound on each test's event loop."""

from __future__ import annotations

import asyncio
import json

import httpx

from loong_agentflow.agent import EpisodeSpec
from loong_agentflow.proxy import ProxyServer

__all__ = ["CALL", "SCRIPT", "USER", "episode_spec", "run", "session_client", "sse_events"]


CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
SCRIPT = [f"Adding.{CALL}", "It is 5."]
USER = [{"role": "user", "content": "add 2 and 3"}]


def run(coro):
    """Runs ``coro`` to its end on a fresh event loop; fails after 60 s."""
    return asyncio.run(asyncio.wait_for(coro, 60))


async def session_client(proxy: ProxyServer, key: str) -> httpx.AsyncClient:
    """A client of the proxy's OpenAI API sending ``key`` (a session's) as its bearer token."""
    return httpx.AsyncClient(base_url=proxy.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def episode_spec(i: int = 0) -> EpisodeSpec:
    return EpisodeSpec(f"s{i}", "g0", {})


def sse_events(text: str) -> list[dict | str]:
    """The events of an SSE body: each ``data:`` payload decoded, the last one ``"[DONE]"``."""
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]
