"""Launch cost of a black-box episode: a Python agent that imports the ``openai`` SDK, makes its
client and exits, started as a new interpreter per episode (``subprocess``) or forked from a warm
process that imported the SDK once (``forked``, :class:`~loong_agentflow.forkserver.ForkServer`).

Floor: ``forked_bare``: the same fork server running an empty program (fork, session, three
pipes, exit report): what starting any process costs this way. Each case runs ``EPISODES``
episodes, ``CONCURRENCY`` at a time, and records ``per_episode_ms`` (wall time / episodes) and
``cpu_ms_per_episode`` (CPU of this process and its children per episode) in ``extra_info``;
``speedup`` is subprocess / forked wall time. With benchmarks disabled (the default test run)
each case runs 4 episodes, as a smoke test.

Measured (2 cores, another agent's tests on the machine, one run): subprocess 347 ms and 688 ms
of CPU per episode, forked 42 ms and 73 ms (8.3x faster; the rest is mostly the SDK building its
HTTP client and TLS context), forked_bare 5.4 ms and 10 ms.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from loong_agentflow.forkserver import ForkServer

EPISODES, CONCURRENCY = 32, 4
AGENT = "import openai\nclient = openai.OpenAI(base_url='http://127.0.0.1:9/v1', api_key='k')\nprint('ok')\n"
ENV = {"PATH": os.environ.get("PATH", "")}


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


async def _episodes(launch, episodes: int) -> None:
    slots = asyncio.Semaphore(CONCURRENCY)

    async def one() -> None:
        async with slots:
            proc = await launch()
            out, _ = await proc.communicate(b"")
            assert proc.returncode == 0 and out == b"ok\n", (proc.returncode, out)

    await asyncio.gather(*(one() for _ in range(episodes)))


def _subprocess(script: Path):
    return lambda: asyncio.create_subprocess_exec(
        sys.executable, str(script), stdin=-1, stdout=-1, stderr=-1, env=ENV, start_new_session=True
    )


async def _forked(script: Path, preload: list[str], episodes: int) -> None:
    """Two rounds of ``episodes``: the warm process's start is paid once, as in a run."""
    server = ForkServer(sys.executable, preload)
    try:
        for _ in range(2):
            await _episodes(lambda: server.spawn([sys.executable, str(script)], ENV), episodes)
    finally:
        await server.close()


RESULTS: dict[str, float] = {}


@pytest.mark.parametrize("case", ["subprocess", "forked", "forked_bare"])
def test_episode_launch(benchmark, case, tmp_path, request):
    smoke = request.config.getoption("benchmark_disable") and not request.config.getoption("benchmark_enable")
    n = 4 if smoke else EPISODES
    script = tmp_path / "agent.py"
    script.write_text("print('ok')\n" if case == "forked_bare" else AGENT)

    def run() -> tuple[float, float]:
        wall, cpu = time.perf_counter(), _cpu_s()
        if case == "subprocess":
            asyncio.run(_episodes(_subprocess(script), n))
            episodes = n
        else:
            asyncio.run(_forked(script, [] if case == "forked_bare" else ["openai"], n))
            episodes = 2 * n
        return (time.perf_counter() - wall) / episodes, (_cpu_s() - cpu) / episodes

    per_episode, cpu = benchmark.pedantic(run, rounds=1, iterations=1)
    RESULTS[case] = per_episode
    benchmark.extra_info.update(case=case, per_episode_ms=per_episode * 1e3, cpu_ms_per_episode=cpu * 1e3)
    if case != "subprocess" and "subprocess" in RESULTS:
        benchmark.extra_info["speedup"] = RESULTS["subprocess"] / per_episode
    print(f"\n{case}: {per_episode * 1e3:.1f} ms/episode wall, {cpu * 1e3:.1f} ms CPU")
