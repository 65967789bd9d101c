"""Proxy overhead per call: proxy round trip minus a direct engine call, with an instantaneous engine.

The proxy runs in this process (as in a rollout worker); the agents run in a load-generator
subprocess (``proxy_loadgen.py``: one keep-alive connection per session, chained multi-turn chat
calls). Per session count (1, 64, 256, 2048) two scenarios run in the same pass:

- ``back_to_back``: every session calls again as soon as it has its answer: the proxy is
  saturated, so latency = service time x queue length; reported as ``p50/p99_overhead_ms``.
- ``paced``: every session waits ``THINK_S`` x U(0.5, 1.5) before each call (standing in for the
  engine's decode time and the agent's tools, which a real episode always has):
  ``paced_p50/p99_overhead_ms``.

Baseline: the direct ``engine.generate`` call (same prompt) timed in-process, subtracted from
every round trip. Floor: ``floor_*``: the same load generator against a bare asyncio server that
returns a canned response without parsing (the cost of loopback HTTP with this client and event
loop). ``server_cpu_ms_per_call`` is this process's CPU time per call. ``lost_trajectories``
counts sessions whose recorded calls differ from the calls the agent made or that did not merge
into one row.
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import sys
import time
from pathlib import Path

import pytest

from loong_agentflow.agent import EpisodeSpec
from loong_agentflow.proxy import ProxyServer
from loong_agentflow.proxy.render import ChatMLRenderer
from loong_core.protocols import SamplingParams
from loong_core.records import EpisodeStatus, SpanSource, TokenSpan

LOADGEN = Path(__file__).parent / "proxy_loadgen.py"
THINK_S = 0.2
CALLS = {1: (300, 10), 64: (12, 5), 256: (5, 3), 2048: (2, 2)}  # sessions: (back-to-back, paced) calls each
_SPLIT = re.compile(r"(<\|im_start\|>|<\|im_end\|>)")
_SPECIAL = {"<|im_start|>": 0, "<|im_end|>": 1}


class Codec:
    def encode(self, text: str) -> list[int]:
        return [t for p in _SPLIT.split(text) if p for t in ([_SPECIAL[p]] if p in _SPECIAL else map(ord, p))]

    def decode(self, ids: list[int]) -> str:
        return "".join("<|im_start|>" if i == 0 else "<|im_end|>" if i == 1 else chr(i) for i in ids)


class InstantEngine:
    """Answers ``ok<|im_end|>`` at once."""

    weight_version = 0

    def __init__(self) -> None:
        self.ids = Codec().encode("ok<|im_end|>")

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> TokenSpan:
        return TokenSpan(
            token_ids=list(self.ids), source=SpanSource.MODEL, logprobs=[-0.5] * 3, weight_version=0
        )


async def _engine_ms(engine: InstantEngine) -> float:
    prompt, sampling = list(range(2, 200)), SamplingParams(max_new_tokens=8)
    times = []
    for _ in range(2000):
        t0 = time.perf_counter()
        await engine.generate(prompt, sampling)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


async def _loadgen(port: int, keys: list[str], calls: int, think_s: float) -> dict:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(LOADGEN), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    cfg = {"port": port, "keys": keys, "calls": calls, "think_s": think_s}
    out, _ = await proc.communicate(json.dumps(cfg).encode())
    assert proc.returncode == 0
    return json.loads(out)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _proxy_run(proxy: ProxyServer, sessions: int, calls: int, think_s: float, engine_ms: float):
    live = [proxy.open_session(EpisodeSpec(f"s{i}", "g", {})) for i in range(sessions)]
    cpu0 = time.process_time()
    report = await _loadgen(proxy.port, [s.api_key for s in live], calls, think_s)
    cpu = time.process_time() - cpu0
    lost = 0
    for s in live:
        proxy.close_session(s)
        rows = s.trajectories(1.0, EpisodeStatus.OK)
        lost += len(s.calls) != report["calls"].get(s.api_key, 0) or len(rows) != 1
    overhead = [x - engine_ms for x in report["latencies_ms"]]
    return overhead, lost, cpu * 1e3 / max(1, len(overhead))


async def _floor(sessions: int, calls: int) -> list[float]:
    canned = b'{"choices":[{"message":{"content":"ok"}}]}'
    response = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(canned), canned)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                writer.write(response)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=4096)
    port = server.sockets[0].getsockname()[1]
    report = await _loadgen(port, [f"k{i}" for i in range(sessions)], calls, 0.0)
    server.close()
    return report["latencies_ms"]


async def _scenario(sessions: int) -> dict:
    engine = InstantEngine()
    back_calls, paced_calls = CALLS[sessions]
    async with ProxyServer(engine, ChatMLRenderer(Codec())) as proxy:
        engine_ms = await _engine_ms(engine)
        hot, lost_a, cpu_ms = await _proxy_run(proxy, sessions, back_calls, 0.0, engine_ms)
        paced, lost_b, _ = await _proxy_run(proxy, sessions, paced_calls, THINK_S, engine_ms)
    floor = await _floor(sessions, back_calls)
    return {
        "sessions": sessions,
        "calls": len(hot) + len(paced),
        "engine_ms": round(engine_ms, 5),
        "p50_overhead_ms": round(_pct(hot, 0.5), 3),
        "p99_overhead_ms": round(_pct(hot, 0.99), 3),
        "paced_p50_overhead_ms": round(_pct(paced, 0.5), 3),
        "paced_p99_overhead_ms": round(_pct(paced, 0.99), 3),
        "floor_p50_ms": round(_pct(floor, 0.5), 3),
        "floor_p99_ms": round(_pct(floor, 0.99), 3),
        "server_cpu_ms_per_call": round(cpu_ms, 3),
        "calls_per_s_back_to_back": round(sessions * 1e3 / max(1e-9, statistics.mean(hot)), 1),
        "lost_trajectories": lost_a + lost_b,
    }


@pytest.mark.parametrize("sessions", [1, 64, 256, 2048])
def test_proxy_overhead(benchmark, sessions):
    result: dict = {}

    def once() -> None:
        result.update(asyncio.run(_scenario(sessions)))

    benchmark.pedantic(once, rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    print(json.dumps(result))
    assert result["lost_trajectories"] == 0
