"""The ``[agent]`` table, picked by ``type``, and the host that runs black-box agents.

- ``type = "whitebox"`` (:class:`WhiteboxAgentConfig`): :class:`~loong_agentflow.ToolAgent`
  episodes in the rollout worker's process (the framework drives the token loop and the tools).
- ``type = "blackbox"`` (:class:`BlackboxAgentConfig`): each worker hosts an AgentFlow proxy
  (OpenAI API on 127.0.0.1) over its engine and runs every episode as a subprocess
  (:class:`BlackBoxHost`; the contract of :mod:`loong_agentflow.blackbox`).

Importing this module loads no torch: recipes validate against these Structs.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any

import msgspec

from loong_agentflow import (
    AgentProgram,
    BlackBoxRunner,
    EpisodeLimits,
    EpisodeSpec,
    HFChatRenderer,
    ProxyConfig,
    ProxyServer,
    SandboxLimits,
)
from loong_core.config import ConfigError
from loong_core.protocols import SamplingParams
from loong_core.records import SpanSource, TokenSpan, Trajectory
from loong_train.tasks import AgentCommand, Task

if TYPE_CHECKING:
    from loong_train.engines.base import WorkerEngine

__all__ = ["AgentConfig", "BlackBoxHost", "BlackboxAgentConfig", "WhiteboxAgentConfig", "agent_program"]


class _Agent(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type"):
    @property
    def type(self) -> str:
        """The table's ``type`` (the Struct's tag)."""
        return str(type(self).__struct_config__.tag)


class WhiteboxAgentConfig(_Agent, tag="whitebox"):
    """``[agent] type = "whitebox"``: the task's tools and reward driven by
    :class:`~loong_agentflow.ToolAgent` in process (token buffer, no re-tokenization)."""


class BlackboxAgentConfig(_Agent, tag="blackbox"):
    """``[agent] type = "blackbox"``: every episode is a subprocess of ``command`` talking to the
    worker's proxy (``LOONG_MAX_TURNS`` holds ``rollout.max_turns``), at most ``max_concurrency``
    at a time per worker.

    - ``command``: empty: the task's own agent program (``Task.agent_command``; the calc tasks':
      :mod:`loong_train.tiny.calc_agent`, an ``openai``-SDK program run by this interpreter).
    - ``preload``: modules a Python ``command`` imports; episodes are then forked from a warm
      process that imported them once (:mod:`loong_agentflow.forkserver`), instead of paying an
      interpreter start and the imports (about a second for ``openai``) per episode. Unset: the
      task's agent preloads what it declares (the calc agent: ``openai``), another ``command`` runs
      as plain subprocesses; ``[]`` turns forking off.
    - ``sandbox``: ``true`` (the default limits) or an ``[agent.sandbox]`` table of
      :class:`~loong_agentflow.SandboxLimits`: every episode runs in the sandbox (no network but
      the worker's proxy, writes only in a fresh private directory, none of the worker's
      environment, CPU, memory, process and output limits); its wall clock is
      ``rollout.episode_timeout_s``. Episodes start a fresh process (no preload), and ``command``
      items that name files are made absolute first.
    """

    command: list[str] = []
    max_concurrency: int = 16
    preload: list[str] | None = None
    sandbox: bool | SandboxLimits = False

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.sandbox is not False and self.preload:
            raise ValueError(
                f"agent.preload = {self.preload}: a sandboxed episode starts a fresh process, so "
                "nothing is preloaded; drop agent.preload or agent.sandbox"
            )

    @property
    def sandbox_limits(self) -> SandboxLimits | None:
        """The sandbox's limits, or None when episodes run as plain subprocesses."""
        if self.sandbox is True:
            return SandboxLimits()
        return self.sandbox or None


AgentConfig = WhiteboxAgentConfig | BlackboxAgentConfig


class BlackBoxHost:
    """A worker's proxy and black-box runner, served from an event loop the worker owns.

    The :class:`~loong_agentflow.ProxyServer` listens on 127.0.0.1 (a free port of its own) for the
    worker's lifetime, renders with the tokenizer's chat template (:class:`HFChatRenderer`), forces
    the recipe's temperature and top_p whatever an agent asks for, and caps each session at the
    episode's model-token budget. Between ``run`` calls the loop is idle, so a weight update (the
    worker's next call) never overlaps a generation.

    Each episode's rows come back flat: row 0 keeps the spec's ``sample_id``, row i > 0 is
    ``"<sample_id>#<i>"``, all with the spec's ``group_id`` and ``info["episode"]`` (GRPO counts
    an episode once, see :func:`loong_train.algo.losses.grpo_advantages`). An episode that never
    got an answer (failed or timed out before its first call) is one row with an empty prompt span.
    """

    def __init__(
        self,
        engine: WorkerEngine,
        tokenizer: Any,
        agent: BlackboxAgentConfig,
        sampling: SamplingParams,
        limits: EpisodeLimits,
        task: Task,
    ) -> None:
        model = getattr(engine, "model", None)  # the served model's limits, when this process holds it
        config = ProxyConfig(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            default_max_tokens=sampling.max_new_tokens,
            max_session_model_tokens=limits.max_model_tokens,
            context_length=getattr(model.config, "max_position_embeddings", 0) if model else 0,
            vocab_size=getattr(model.config, "vocab_size", 0) if model else 0,
        )
        self.proxy = ProxyServer(engine, HFChatRenderer(tokenizer), config)
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.proxy.start())
        program = agent_program(agent, task, limits)
        self.runner = BlackBoxRunner(self.proxy, program, task.reward, agent.max_concurrency)

    def run(self, specs: list[EpisodeSpec]) -> list[Trajectory]:
        episodes = self.loop.run_until_complete(self.runner.run_many(specs))
        rows = [t for episode in episodes for t in episode]
        for t in rows:
            if not t.spans:
                t.spans = [TokenSpan(token_ids=[], source=SpanSource.PROMPT)]
        return rows

    def close(self) -> None:
        self.loop.run_until_complete(self.runner.close())
        self.loop.run_until_complete(self.proxy.stop())
        self.loop.close()


def agent_program(agent: BlackboxAgentConfig, task: Task, limits: EpisodeLimits) -> AgentProgram:
    """The program black-box episodes run: ``agent.command``, or the task's own agent (whose
    required modules must be installed). ``agent.preload`` unset: the task agent's preloads, none
    for a ``command``."""
    command = AgentCommand(argv=agent.command) if agent.command else task.agent_command()
    if command is None:
        raise ConfigError("agent.type = 'blackbox': this task ships no agent program; set agent.command")
    if missing := [m for m in command.requires if importlib.util.find_spec(m) is None]:
        raise ConfigError(
            f"the task's agent program {' '.join(command.argv)} needs {', '.join(missing)}, not installed "
            f"for {sys.executable}: {command.install or 'install it'}, or set agent.command to your own program"
        )
    sandbox = agent.sandbox_limits
    if sandbox is None:
        argv, preload = command.argv, command.preload if agent.preload is None else agent.preload
    else:  # a fresh private directory: relative paths would name nothing there
        argv, preload = [os.path.abspath(a) if os.path.isfile(a) else a for a in command.argv], []
    return AgentProgram(
        argv,
        env={"LOONG_MAX_TURNS": str(limits.max_turns)},
        timeout_s=limits.timeout_s,
        preload=preload,
        sandbox=sandbox,
    )
