"""Black-box agents: run any program as an episode against the AgentFlow proxy.

The runner opens a proxy session per episode and starts the agent program as a subprocess (in its
own process group) with this contract:

- environment: ``OPENAI_BASE_URL`` (the proxy's ``/v1``) and ``OPENAI_API_KEY`` (the session
  key), so the official SDK needs no configuration; ``LOONG_SAMPLE_ID``, ``LOONG_GROUP_ID`` and
  ``LOONG_TASK`` (the task as JSON, when under 64 KiB). Other ``OPENAI_*`` variables of the
  parent are removed, so an agent cannot reach a real API by accident.
- stdin: the task as JSON, then end of file.
- stdout: the agent's final answer, given to ``reward_fn(task, stdout)``; alternatively the agent
  (or its environment) posts ``{"reward": r}`` to ``/v1/sessions/reward``, which takes precedence.
  Each scored row's ``metrics["from_agent"]`` says which won (1: the posted reward, 0: ``reward_fn``),
  logged by the trainer as ``reward/from_agent``, the share of episodes the agent scored itself.

With ``sandbox`` limits the program runs in :class:`~loong_agentflow.sandbox.Sandbox` instead: a
fresh private working directory, none of the parent's environment but the variables above and
``env``, no network but the proxy (its loopback address, carried into the sandbox's network
namespace), CPU, memory, file, process and output limits, and ``timeout_s`` as the wall clock.

Outcome of an episode (never a silent 0): ``timeout`` when it runs past ``timeout_s`` (the whole
process group is killed); ``failed`` when it exits non-zero, never calls the model, or leaves no
reward; otherwise ``ok``, or ``truncated`` when the session ran out of tokens or its last call
was cut by ``max_tokens``. The proxy keeps serving every other session throughout.

Example::

    async with ProxyServer(engine, ChatMLRenderer(codec)) as proxy:
        runner = BlackBoxRunner(proxy, AgentProgram([sys.executable, "my_agent.py"], timeout_s=60),
                                reward_fn=lambda task, answer: float(answer == task["answer"]))
        episodes = await runner.run_many(specs)     # one list of trajectory rows per spec
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import msgspec

from loong_agentflow.agent import EpisodeSpec
from loong_agentflow.forkserver import ForkedProcess, ForkServer
from loong_agentflow.proxy import ProxyServer
from loong_agentflow.proxy.session import ProxySession
from loong_agentflow.sandbox import Sandbox, SandboxLimits
from loong_core.records import EpisodeStatus, Trajectory

__all__ = ["AgentProgram", "BlackBoxRunner"]

_MAX_ENV_TASK = 64 << 10


@dataclass(frozen=True)
class AgentProgram:
    """The command that runs one episode, its extra environment, working directory and wall-time limit.

    ``preload``: modules a Python program imports (e.g. ``("openai",)``). When set, episodes are
    forked from a warm process that imported them once (:class:`~loong_agentflow.forkserver.ForkServer`)
    instead of starting a new interpreter each; ``argv`` must then be ``[python, "-m", MODULE, ...]``
    or ``[python, SCRIPT, ...]``. The contract for the program is unchanged.

    ``sandbox``: run each episode under these limits (its ``wall_s`` is ``timeout_s``), see the
    module docstring; a sandboxed episode starts a fresh process in a fresh directory, so it
    takes neither ``preload`` nor ``cwd``.
    """

    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    timeout_s: float = 120.0
    preload: Sequence[str] = ()
    sandbox: SandboxLimits | None = None

    def __post_init__(self) -> None:
        if self.sandbox is not None and (self.preload or self.cwd):
            raise ValueError(
                "a sandboxed agent program starts a fresh process in a private directory: "
                f"drop preload ({list(self.preload)}) and cwd ({self.cwd!r})"
            )


@dataclass
class _Exit:
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float


class BlackBoxRunner:
    """Runs episodes of one agent program through one proxy, at most ``max_concurrency`` at a time."""

    def __init__(
        self,
        proxy: ProxyServer,
        program: AgentProgram,
        reward_fn: Callable[[dict[str, Any], str], float] | None = None,
        max_concurrency: int = 64,
    ) -> None:
        self.proxy, self.program, self.reward_fn = proxy, program, reward_fn
        self._slots = asyncio.Semaphore(max_concurrency)
        self._forks = ForkServer(program.argv[0], program.preload) if program.preload else None
        self._box = self._pool = None
        if program.sandbox is not None:  # refuses here what this machine cannot enforce
            self._box = Sandbox(msgspec.structs.replace(program.sandbox, wall_s=program.timeout_s))
            self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="loong-sandbox")

    async def close(self) -> None:
        """Stop the fork server, if the program has one (it also ends with the runner's process)."""
        if self._forks is not None:
            await self._forks.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    async def run_many(self, specs: Sequence[EpisodeSpec]) -> list[list[Trajectory]]:
        """All episodes concurrently; one list of rows per spec, in ``specs`` order."""
        return list(await asyncio.gather(*(self.run(s) for s in specs)))

    async def run(self, spec: EpisodeSpec) -> list[Trajectory]:
        """One episode: its trajectory rows (see :class:`~loong_agentflow.proxy.session.ProxySession`)."""
        async with self._slots:
            session = self.proxy.open_session(spec)
            try:
                done = await self._execute(session, spec)
            finally:
                self.proxy.close_session(session)
            return self._trajectories(session, spec, done)

    def _env(self, session: ProxySession, spec: EpisodeSpec, task: str) -> dict[str, str]:
        env = {} if self._box else {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
        env.update(self.program.env)
        env.update(
            OPENAI_BASE_URL=self.proxy.base_url,
            OPENAI_API_KEY=session.api_key,
            LOONG_SAMPLE_ID=spec.sample_id,
            LOONG_GROUP_ID=spec.group_id,
        )
        if len(task) < _MAX_ENV_TASK:
            env["LOONG_TASK"] = task
        return env

    async def _execute(self, session: ProxySession, spec: EpisodeSpec) -> _Exit:
        task = json.dumps(spec.task)
        if self._box is not None:
            return await self._execute_sandboxed(self._env(session, spec, task), task)
        start = time.monotonic()
        try:
            proc = await self._launch(self._env(session, spec, task))
        except (OSError, RuntimeError) as e:  # no such program, a dead fork server: this episode fails
            return _Exit(None, "", f"could not start {list(self.program.argv)!r}: {e}", False, 0.0)
        try:
            out, err = await asyncio.wait_for(proc.communicate(task.encode()), self.program.timeout_s)
            timed_out = False
        except TimeoutError:
            out, err, timed_out = b"", b"", True
        finally:
            if proc.returncode is None:  # timed out or cancelled: the whole process group goes
                _kill_group(proc.pid)
                await proc.wait()
        text = out.decode(errors="replace")
        return _Exit(proc.returncode, text, err.decode(errors="replace"), timed_out, time.monotonic() - start)

    async def _execute_sandboxed(self, env: dict[str, str], task: str) -> _Exit:
        proxy = urlsplit(self.proxy.base_url)
        run = functools.partial(
            self._box.run,
            list(self.program.argv),
            task.encode(),
            env=env,
            reach=[(proxy.hostname, proxy.port)],
        )
        try:
            result = await asyncio.get_running_loop().run_in_executor(self._pool, run)
        except (OSError, RuntimeError, ValueError) as e:  # no temp dir, cgroup or thread: this episode fails
            return _Exit(
                None, "", f"could not start {list(self.program.argv)!r} in the sandbox: {e}", False, 0.0
            )
        if result.stdout_cut:  # the answer is stdout: a cut one would be scored as if whole
            error = (
                f"agent printed {self._box.limits.output_bytes + result.stdout_cut} bytes, past the "
                f"sandbox's output_bytes = {self._box.limits.output_bytes}: raise agent.sandbox.output_bytes"
            )
            return _Exit(None, "", error, False, result.wall_s)
        return _Exit(result.returncode, result.stdout, result.stderr, result.timed_out, result.wall_s)

    async def _launch(self, env: dict[str, str]) -> asyncio.subprocess.Process | ForkedProcess:
        """The episode's process, in a session of its own: forked when the program preloads."""
        p = self.program
        if self._forks is not None:
            return await self._forks.spawn(p.argv, env, p.cwd)
        return await asyncio.create_subprocess_exec(
            *p.argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            cwd=p.cwd,
            start_new_session=True,
        )

    def _trajectories(self, session: ProxySession, spec: EpisodeSpec, done: _Exit) -> list[Trajectory]:
        info = {"wall_s": f"{done.wall_s:.3f}", "returncode": str(done.returncode)}
        status, reward, error = self._outcome(session, spec, done)
        if error:
            info["error"] = error
        rows = session.trajectories(reward, status, info)
        if status is not EpisodeStatus.FAILED and status is not EpisodeStatus.TIMEOUT:
            posted = float(session.reward is not None)  # which reward won: the agent's, or reward_fn's
            for t in rows:
                t.metrics = {**t.metrics, "from_agent": posted}
        return rows

    def _outcome(
        self, session: ProxySession, spec: EpisodeSpec, done: _Exit
    ) -> tuple[EpisodeStatus, float, str]:
        if done.timed_out:
            return EpisodeStatus.TIMEOUT, 0.0, f"agent ran past {self.program.timeout_s}s and was killed"
        if done.returncode is None:
            return EpisodeStatus.FAILED, 0.0, done.stderr
        if done.returncode != 0:
            return (
                EpisodeStatus.FAILED,
                0.0,
                f"agent exited with code {done.returncode}: {done.stderr[-800:]}",
            )
        if not session.calls:
            return EpisodeStatus.FAILED, 0.0, "agent never called the model"
        if session.reward is not None:
            reward = session.reward
        elif self.reward_fn is None:
            return (
                EpisodeStatus.FAILED,
                0.0,
                "no reward: nothing posted to /v1/sessions/reward and no reward_fn",
            )
        else:
            try:
                reward = float(self.reward_fn(spec.task, done.stdout.strip()))
            except Exception as e:  # a broken reward function fails the episode, not the run
                return EpisodeStatus.FAILED, 0.0, f"reward_fn raised {type(e).__name__}: {e}"
        status = EpisodeStatus.TRUNCATED if session.truncated else EpisodeStatus.OK
        return status, reward, ""


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
