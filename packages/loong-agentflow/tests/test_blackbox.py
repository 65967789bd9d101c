"""Black-box episodes end to end: an ``openai``-SDK agent program as a subprocess, the real proxy on
loopback, the scripted bigram engine (a real sampler with exact logprobs).

Exactness: the recorded ids decode to the transcript the agent saw (its own message list, rendered
by the template) and to a hand-written expected text; model spans are exactly what the engine
returned; the recorded logprobs match a fresh scoring pass of the policy over the recorded ids.
Failures: crash -> failed, hang -> timeout (process group killed), never calls -> failed; healthy
episodes running at the same time are unaffected.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from pathlib import Path

import pytest
from agentflow_testkit import CODEC, BigramEngine, ScriptedBigramPolicy, reference_logprobs

from loong_agentflow.agent import EpisodeSpec
from loong_agentflow.blackbox import AgentProgram, BlackBoxRunner
from loong_agentflow.proxy import ProxyServer
from loong_agentflow.proxy.render import ChatMLRenderer
from loong_core.records import EpisodeStatus, SpanSource

pytestmark = pytest.mark.integration

AGENT = [sys.executable, str(Path(__file__).parent / "agents" / "openai_agent.py")]


def add(a: int, b: int) -> str:
    return f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'


SCRIPT = [f"Let me add.{add(2, 3)}", f"{add(5, 6)}{add(1, 1)}", "The answer is 11."]
MESSAGES = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 2+3+6?"}]
EXPECTED = (
    "<|im_start|>system\nYou add numbers.<|im_end|>\n<|im_start|>user\nWhat is 2+3+6?<|im_end|>\n"
    f"<|im_start|>assistant\n{SCRIPT[0]}<|im_end|>\n"
    "<|im_start|>user\n<tool_response>5</tool_response><|im_end|>\n"
    f"<|im_start|>assistant\n{SCRIPT[1]}<|im_end|>\n"
    "<|im_start|>user\n<tool_response>11</tool_response><|im_end|>\n"
    "<|im_start|>user\n<tool_response>2</tool_response><|im_end|>\n"
    f"<|im_start|>assistant\n{SCRIPT[2]}<|im_end|>"
)


def _template_messages(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": json.loads(c["function"]["arguments"]),
                    }
                }
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


FORKED = ("openai",)  # AgentProgram.preload: episodes forked from a warm process (loong_agentflow.forkserver)


@pytest.mark.parametrize(("stream", "preload"), [(False, ()), (True, ()), (False, FORKED), (True, FORKED)])
def test_openai_sdk_agent_multi_turn_tools_is_token_exact(stream, preload, tmp_path):
    policy = ScriptedBigramPolicy(SCRIPT)
    engine = BigramEngine(policy, seed=1, bump_every=1)  # a weight update after every call
    transcript = tmp_path / "transcript.json"
    task = {"messages": MESSAGES, "stream": stream, "transcript": str(transcript), "answer": "11"}

    async def main():
        async with ProxyServer(engine, ChatMLRenderer(CODEC)) as proxy:
            runner = BlackBoxRunner(
                proxy,
                AgentProgram(AGENT, timeout_s=60, preload=preload),
                reward_fn=lambda task, out: float(out == f"The answer is {task['answer']}."),
            )
            try:
                return await runner.run(EpisodeSpec("ep0", "g0", task, tags={"domain": "math"}))
            finally:
                await runner.close()

    (row,) = asyncio.run(main())
    assert row.status is EpisodeStatus.OK and row.reward == 1.0, row.info
    assert row.sample_id == "ep0" and row.tags == {"domain": "math"}
    row.validate()
    text = CODEC.decode(row.token_ids)
    assert text == EXPECTED
    seen = json.loads(transcript.read_text())
    assert (
        ChatMLRenderer(CODEC).text(_template_messages(seen["messages"]), generation_prompt=False)
        == text + "\n"
    )
    sources = [s.source for s in row.spans]
    M, P, T = SpanSource.MODEL, SpanSource.PROMPT, SpanSource.TOOL
    assert sources == [P, M, T, M, T, M]
    model_spans = [s for s in row.spans if s.is_model]
    assert model_spans == [
        span for _, span in engine.log
    ]  # ids, logprobs and versions as the engine returned
    assert [s.weight_version for s in model_spans] == [0, 1, 2]
    assert seen["logprobs"] == [s.logprobs for s in model_spans]  # what the agent was sent
    fresh = reference_logprobs(policy, row.token_ids, row.loss_mask, temperature=1.0)
    assert all(abs(a - b) < 1e-9 for a, b in zip(fresh, row.logprobs, strict=True))
    assert sum(row.loss_mask) == sum(len(s.token_ids) for s in model_spans)


@pytest.mark.parametrize("preload", [(), FORKED])
def test_failing_agents_are_marked_and_do_not_disturb_healthy_ones(preload, tmp_path):
    engine = BigramEngine(ScriptedBigramPolicy(["ok"]))
    pidfile = tmp_path / "hang.pid"

    def spec(i: int, mode: str) -> EpisodeSpec:
        task = {"messages": MESSAGES, "mode": mode, "pidfile": str(pidfile), "stream": False}
        task["transcript"] = str(tmp_path / f"t{i}.json")
        return EpisodeSpec(f"e{i}", "g0", task)

    specs = [spec(0, "crash"), spec(1, "hang"), spec(2, "silent"), spec(3, "post_reward"), spec(4, "tools")]

    async def main():
        async with ProxyServer(engine, ChatMLRenderer(CODEC)) as proxy:
            # a cold start pays Python's and openai's imports: on 2 busy cores (the CI runs two
            # test workers and Ray beside this) that alone has taken most of 10 s; a forked
            # episode skips them, but on those cores has still needed more than 5 s
            program = AgentProgram(AGENT, timeout_s=15 if preload else 25, preload=preload)
            runner = BlackBoxRunner(proxy, program, reward_fn=lambda task, out: 1.0)
            episodes = await runner.run_many(specs)
            await runner.close()
            assert proxy.sessions == {}
            return episodes

    crash, hang, silent, posted, healthy = (rows[0] for rows in asyncio.run(main()))
    assert crash.status is EpisodeStatus.FAILED and "agent bug" in crash.info["error"]
    assert crash.num_model_tokens > 0  # its call is kept, but the status excludes it from training
    assert hang.status is EpisodeStatus.TIMEOUT and "killed" in hang.info["error"]
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert silent.status is EpisodeStatus.FAILED and silent.spans == []
    assert silent.info["error"] == "agent never called the model"
    assert (
        posted.status is EpisodeStatus.TRUNCATED and posted.reward == 0.75
    )  # max_tokens=2 cut its only call
    assert healthy.status is EpisodeStatus.OK and healthy.reward == 1.0
    assert all(not t.status.trainable for t in (crash, hang, silent))
    # which reward won: the posted 0.75 over reward_fn's 1.0, and reward_fn where nothing was posted
    assert posted.metrics["from_agent"] == 1.0 and healthy.metrics["from_agent"] == 0.0
    assert all("from_agent" not in t.metrics for t in (crash, hang, silent))


def test_missing_reward_fails_the_episode(tmp_path):
    engine = BigramEngine(ScriptedBigramPolicy(["ok"]))
    task = {"messages": MESSAGES, "stream": False, "transcript": str(tmp_path / "t.json")}

    async def main():
        async with ProxyServer(engine, ChatMLRenderer(CODEC)) as proxy:
            return await BlackBoxRunner(proxy, AgentProgram(AGENT, timeout_s=30)).run(
                EpisodeSpec("e", "g", task)
            )

    (row,) = asyncio.run(main())
    assert row.status is EpisodeStatus.FAILED and row.info["error"].startswith("no reward")


def test_a_program_that_cannot_start_fails_its_episode_only(tmp_path):
    engine = BigramEngine(ScriptedBigramPolicy(["ok"]))
    task = {"messages": MESSAGES, "stream": False, "transcript": str(tmp_path / "t.json")}
    missing = str(tmp_path / "no-such-agent")

    async def main():
        async with ProxyServer(engine, ChatMLRenderer(CODEC)) as proxy:
            runner = BlackBoxRunner(proxy, AgentProgram([missing], timeout_s=30), reward_fn=lambda t, o: 1.0)
            broken = await runner.run(EpisodeSpec("e0", "g", task))
            healthy = await BlackBoxRunner(proxy, AgentProgram(AGENT), reward_fn=lambda t, o: 1.0).run(
                EpisodeSpec("e1", "g", task)
            )
            return broken, healthy

    (broken,), (healthy,) = asyncio.run(main())
    assert broken.status is EpisodeStatus.FAILED and missing in broken.info["error"]
    assert healthy.status is EpisodeStatus.OK


def test_a_sandboxed_agent_reaches_the_proxy_and_nothing_else(tmp_path, monkeypatch):
    """``AgentProgram.sandbox``: the episode's model calls pass (the proxy's loopback address is
    carried into the sandbox's network namespace) and are recorded token-exact; another loopback
    server, a write outside its directory and the parent's environment are out of reach; a
    memory hog, and an answer longer than the output kept, fail their own episodes alone."""
    from loong_agentflow.sandbox import SandboxLimits

    monkeypatch.setenv("LOONG_TEST_PARENT_SECRET", "visible")
    engine = BigramEngine(ScriptedBigramPolicy(["The answer is 11."]))
    other = socket.create_server(("127.0.0.1", 0))
    other.settimeout(0.2)
    escape = tmp_path / "escaped.txt"
    agent = [sys.executable, str(Path(__file__).parent / "agents" / "confined_agent.py")]
    task = {"messages": MESSAGES, "other": other.getsockname()[1], "escape": str(escape)}
    seen = {}

    def score(task, out):
        seen.update(json.loads(out))
        return float(seen["answer"] == "The answer is 11.")

    async def main():
        async with ProxyServer(engine, ChatMLRenderer(CODEC)) as proxy:
            program = AgentProgram(agent, timeout_s=30, sandbox=SandboxLimits(memory_mb=1024))
            runner = BlackBoxRunner(proxy, program, reward_fn=score)
            episodes = await runner.run_many(
                [
                    EpisodeSpec("ok", "g", task),
                    EpisodeSpec("hog", "g", {**task, "hog": True}),
                    EpisodeSpec("flood", "g", {**task, "flood": True}),
                ]
            )
            await runner.close()
            return episodes

    (row,), (hog,), (flood,) = asyncio.run(main())
    assert row.status is EpisodeStatus.OK and row.reward == 1.0, row.info
    with pytest.raises(TimeoutError):
        other.accept()  # no connection ever arrived
    other.close()
    assert not escape.exists()
    model = [s for s in row.spans if s.is_model]  # the engine's record (the flood's call is there too)
    assert len(model) == 1 and model[0] in [span for _, span in engine.log]
    assert CODEC.decode(row.token_ids).endswith("The answer is 11.<|im_end|>")
    assert seen["other"] == "ConnectionRefusedError" and seen["escape"] == "PermissionError"
    assert seen["scratch"] == 2 and seen["cwd"] != os.getcwd() and seen["parent_env"] is None
    assert hog.status is EpisodeStatus.FAILED and "MemoryError" in hog.info["error"]
    # an answer past output_bytes would be scored cut: the episode fails, naming the setting
    assert flood.status is EpisodeStatus.FAILED and "agent.sandbox.output_bytes" in flood.info["error"]
