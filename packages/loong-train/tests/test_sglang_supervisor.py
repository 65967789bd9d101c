"""The SGLang supervisor on real processes: ``loong-train serve-sglang`` (the embedded engine
behind SGLang's HTTP API) and small scripted servers that crash, hang or turn unhealthy.

References: the served model's own forward pass (float64 log-softmax) for generated logprobs; the
operating system (``/proc``: no running process left in the server's process group).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from train_testkit import tiny_config

from loong_agentflow.sglang_client import SGLangClientConfig, SGLangEngine
from loong_core.net import free_port
from loong_core.protocols import SamplingParams
from loong_train.engines.sglang.supervisor import SGLangServerConfig, SGLangServerError, SGLangSupervisor
from loong_train.models.decoder import CausalLM

CFG = tiny_config()
PROMPT = [3, 14, 15, 9, 26, 5]
SERVE = [sys.executable, "-m", "loong_train.cli", "serve-sglang"]
FAST = {"health_interval_s": 0.2, "health_timeout_s": 2.0, "restart_backoff_s": 0.05, "stop_grace_s": 5.0}


def _group_alive(pgid: int) -> bool:
    """Does any process of group ``pgid`` still run? Zombies (exited, not yet reaped by init)
    do not count; ``os.killpg(pgid, 0)`` would still find them for a moment."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def _generate(url: str) -> tuple[list[int], list[float]]:
    async def run():
        client = SGLangEngine(SGLangClientConfig(url=url, retries=2))
        try:
            span = await client.generate(PROMPT, SamplingParams(max_new_tokens=6, temperature=0.7))
            return span.token_ids, span.logprobs
        finally:
            await client.aclose()

    return asyncio.run(run())


def _reference_logprobs(model_dir: Path, ids: list[int], temperature: float) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) at ``temperature`` for the completion, by one float64 forward pass."""
    model = CausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).double()[0, :-1] / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    return lp[len(PROMPT) - 1 :]


@pytest.mark.integration
def test_serves_restarts_after_sigkill_and_stops_the_whole_group(model_dir, tmp_path):
    log = tmp_path / "logs" / "sglang-0.log"
    # A shell in front of the server leaves a second process (sleep) in the server's group, as
    # SGLang's scheduler processes would be: stop() must end both.
    wrapper = ["sh", "-c", 'sleep 300 & exec "$@"', "sh", *SERVE]
    config = SGLangServerConfig(
        model_path=str(model_dir),
        command=wrapper,
        port=free_port(),
        log_path=str(log),
        max_restarts=2,
        **FAST,
    )
    restarted = []
    sup = SGLangSupervisor(config, on_restart=lambda: restarted.append(sup.pid))
    sup.start()
    try:
        first_pid = sup.pid
        ids, lps = _generate(sup.url)
        want = _reference_logprobs(model_dir, PROMPT + ids, 0.7)
        torch.testing.assert_close(torch.tensor(lps, dtype=torch.float64), want, rtol=0, atol=1e-5)

        os.kill(first_pid, signal.SIGKILL)
        _wait(lambda: restarted, 20, "the supervisor to relaunch the killed server")
        assert sup.restarts == 1 and sup.pid != first_pid and restarted == [sup.pid]
        assert not _group_alive(first_pid)  # the killed server's sleep went with it
        again, _ = _generate(sup.url)
        assert len(again) == 6
        sup.check()
    finally:
        last_pid = sup.pid
        sup.stop()
    assert last_pid is not None and not _group_alive(last_pid) and sup.pid is None
    text = log.read_text()
    assert text.count("=== loong: launch") == 2
    assert text.count(f"serve-sglang: {model_dir} on http://127.0.0.1:{config.port}") == 2
    assert "server process exited with code -9" in text


def test_a_launcher_that_exits_at_once_fails_after_the_restart_limit_naming_the_log(tmp_path):
    log = tmp_path / "sglang.log"
    crash = [sys.executable, "-c", "import sys; print('CUDA error: no device found'); sys.exit(3)"]
    config = SGLangServerConfig(
        model_path="/models/none", command=crash, port=free_port(), log_path=str(log),
        api_key="s3cret", max_restarts=2, **FAST,
    )  # fmt: skip
    sup = SGLangSupervisor(config)
    start = time.monotonic()
    with pytest.raises(SGLangServerError) as failure:
        sup.start()
    assert time.monotonic() - start < 10
    message = str(failure.value)
    assert str(log) in message and "CUDA error: no device found" in message
    assert "failed 3 times" in message and "max_restarts = 2" in message
    text = log.read_text()
    assert text.count("=== loong: launch") == 3 and text.count("exited with code 3 during startup") == 3
    assert "s3cret" not in text + message and "--api-key <api-key>" in text
    with pytest.raises(SGLangServerError):
        sup.check()
    sup.stop()


def test_a_server_that_never_gets_healthy_is_killed_after_the_startup_timeout(tmp_path):
    log, pidfile = tmp_path / "sglang.log", tmp_path / "pid"
    hang = [sys.executable, "-c", "import os, time; print('loading weights', flush=True);"
            "open(os.environ['PIDFILE'], 'w').write(str(os.getpid())); time.sleep(600)"]  # fmt: skip
    config = SGLangServerConfig(
        model_path="/models/none", command=hang, port=free_port(), log_path=str(log),
        env={"PIDFILE": str(pidfile)}, startup_timeout_s=1.0, max_restarts=0, **FAST,
    )  # fmt: skip
    with pytest.raises(SGLangServerError, match=r"did not become healthy within 1\.0 s") as failure:
        SGLangSupervisor(config).start()
    assert str(log) in str(failure.value) and "loading weights" in str(failure.value)
    assert not _group_alive(int(pidfile.read_text()))


HEALTH_SERVER = """
import http.server, os, sys
flag = os.environ["UNHEALTHY_FLAG"]
if os.path.exists(flag):
    os.remove(flag)  # a fresh server starts healthy
port = int(sys.argv[sys.argv.index("--port") + 1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503 if os.path.exists(flag) else 200)
        self.end_headers()

    def log_message(self, *args):
        pass

print("health server up", flush=True)
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_a_live_server_failing_health_checks_is_restarted(tmp_path):
    flag, log = tmp_path / "unhealthy", tmp_path / "sglang.log"
    config = SGLangServerConfig(
        model_path="/models/none", command=[sys.executable, "-c", HEALTH_SERVER], port=free_port(),
        log_path=str(log), env={"UNHEALTHY_FLAG": str(flag)}, health_failures=3, **FAST,
    )  # fmt: skip
    hook_calls = []

    def on_restart():  # fails the first time: the supervisor must relaunch once more
        hook_calls.append(time.monotonic())
        if len(hook_calls) == 1:
            raise RuntimeError("could not push the weights")

    sup = SGLangSupervisor(config, on_restart=on_restart)
    sup.start()
    try:
        pid = sup.pid
        flag.touch()
        failing_since = time.monotonic()
        _wait(lambda: len(hook_calls) == 2, 10, "a restart after failed health checks, then another")
        # three failed polls, 0.2 s apart, came first
        assert hook_calls[0] - failing_since >= 0.4 and sup.pid != pid and sup.healthy()
        assert sup.restarts == 2
        text = log.read_text()
        assert "/health failed 3 times in a row" in text
        assert "on_restart hook failed after the relaunch: RuntimeError('could not push the weights')" in text
    finally:
        sup.stop()
    assert not _group_alive(pid)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3"])
def test_a_non_loopback_host_needs_an_api_key(host):
    with pytest.raises(ValueError, match="api_key"):
        SGLangServerConfig(model_path="m", host=host)
    assert SGLangServerConfig(model_path="m", host=host, api_key="k").url.startswith("http://")
    assert SGLangServerConfig(model_path="m", host="localhost").api_key is None
