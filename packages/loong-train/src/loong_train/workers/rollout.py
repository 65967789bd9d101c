"""A rollout worker: an engine plus an AgentFlow runner, usable in-process or as a Ray actor.

The runner is white-box (:class:`~loong_agentflow.ToolAgent` in process) or black-box
(:class:`BlackBoxHost`: agent programs as subprocesses against a proxy over the same engine),
chosen by the recipe's ``[agent] type`` (:mod:`loong_train.workers.agent`); either way ``rollout`` returns trajectories.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
import torch

from loong_agentflow import (
    ChatML,
    EpisodeLimits,
    EpisodeSpec,
    Latency,
    ToolAgent,
    chat_format,
    run_episodes,
)
from loong_core.protocols import SamplingParams
from loong_core.records import Trajectory, WeightManifest
from loong_train.backends.config import LoraConfig
from loong_train.cores import Lender
from loong_train.engines.base import build_engine, build_host
from loong_train.engines.config import EmbeddedEngineConfig, EngineConfig
from loong_train.engines.embedded.engine import EmbeddedEngine
from loong_train.memory import keep_freed_memory
from loong_train.messages import ApplyResult, EngineCounts, RolloutResult
from loong_train.models.adapters import adapted_modules, read_adapter
from loong_train.models.tokenizer import HFCodec, end_of_turn_ids, load_tokenizer, pad_token_id
from loong_train.tasks import Task, TaskTables, build_task
from loong_train.tasks.reward import final_turn, score_groups
from loong_train.tasks.shaping import shape_overlong
from loong_train.workers.agent import AgentConfig, BlackboxAgentConfig, BlackBoxHost
from loong_transfermesh import LoraMerge, TransportConfig, catch_up, open_receiver

__all__ = ["RolloutWorker"]


log = logging.getLogger("loong.rollout")


def _tool_agent(task: Task, chat, latency: Latency | None, seed: int) -> ToolAgent:
    """The agent of a task that runs no agent of its own: its tools (delayed by ``latency``, as a
    sandbox or web API would) and its reward."""
    tools = task.tools().with_latency(latency, seed) if latency else task.tools()
    return ToolAgent(tools, task.reward, chat)


class RolloutWorker:
    """Runs the task's episodes (white-box, or black-box through a :class:`BlackBoxHost`) on the
    engine ``build_engine`` makes; receives weights by manifest.

    Restarts: the controller creates workers as Ray actors with ``max_restarts``; when a worker's
    process dies, Ray runs this constructor again, which reloads ``model_path`` and then catches
    up to the newest weights the trainer published (:meth:`_catch_up`). Weight updates never move
    a worker backwards (an update older than what it holds is skipped), so every call queued
    after an update runs at that version or a newer one.

    ``cores``: the name of the run's :class:`~loong_train.cores.CoreBoard`, where an embedded
    engine lends the worker's ``threads`` to the trainer while it rests ("": it lends nothing).
    """

    def __init__(
        self,
        model_path: str,
        *,
        seed: int,
        sampling: dict[str, Any],
        limits: dict[str, Any],
        transport: TransportConfig | None = None,
        threads: int = 1,
        worker_id: int = 0,
        agent: AgentConfig | None = None,
        engine: EngineConfig | None = None,
        log_dir: str = "",
        version: int = 0,
        task: str | Callable[[], Task] = "calc",
        tables: TaskTables | None = None,
        trust_remote_code: bool = False,
        tool_latency: Latency | None = None,
        lora: LoraConfig | None = None,
        adapter: str = "",
        cores: str = "",
    ) -> None:
        torch.set_num_threads(threads)
        keep_freed_memory()
        self.worker_id, self._model_path = worker_id, model_path
        tokenizer = load_tokenizer(model_path)
        self.codec = HFCodec(tokenizer)
        self.engine = build_engine(  # a server logs into ``log_dir``
            engine or EmbeddedEngineConfig(),
            model_path,
            seed=seed,
            pad_id=pad_token_id(tokenizer),
            worker_id=worker_id,
            log_dir=log_dir,
            trust_remote_code=trust_remote_code,
            version=version,
            lora=lora,
            adapter=adapter,
        )
        stop = end_of_turn_ids(tokenizer, model_path)
        self.sampling = SamplingParams(**sampling, stop_token_ids=stop)
        self.limits = EpisodeLimits(**limits)
        reward = (tables or TaskTables()).reward
        self.overlong = reward.overlong_buffer, reward.overlong_penalty
        self.budget = min(self.limits.max_model_tokens, self.limits.max_turns * self.sampling.max_new_tokens)
        self.task = build_task(task, tables)
        self.chat = chat = chat_format(tokenizer)  # the model's own layout, unless it renders as ChatML does
        if chat is not ChatML:
            log.info("white-box episodes use %s's own chat template (it differs from ChatML)", model_path)
        self.agent = self.task.agent(chat) or _tool_agent(self.task, chat, tool_latency, seed)
        self.blackbox, self.host = self._episode_runner(agent, tokenizer)
        self.between_calls = (engine or EmbeddedEngineConfig()).partial == "off"
        self._calls_lock, self._calls, self._calls_since, self.busy_s = threading.Lock(), 0, 0.0, 0.0
        self._open_weights(transport or TransportConfig(), version, lora, adapter)
        self.lender = self._lend_cores(cores, threads) if cores else None

    def _lend_cores(self, name: str, threads: int) -> Lender:
        """Lend ``threads`` on board ``name`` whenever the engine has nothing to run and no
        weights go in."""
        if not isinstance(self.engine, EmbeddedEngine):
            raise ValueError(f"only the embedded engine lends its cores, not {type(self.engine).__name__}")
        lender = Lender(name, self.worker_id, threads)
        self.engine.lend_idle_cores(lender)
        return lender

    def _episode_runner(self, agent: AgentConfig | None, tokenizer) -> tuple[BlackBoxHost | None, Any]:
        """Black-box episodes run through a :class:`BlackBoxHost`; white-box ones through the
        engine's host, where updates may land mid-call (partial rollouts)."""
        if isinstance(agent, BlackboxAgentConfig):
            return BlackBoxHost(self.engine, tokenizer, agent, self.sampling, self.limits, self.task), None
        return None, build_host(self.engine)

    def _open_weights(
        self, transport: TransportConfig, version: int, lora: LoraConfig | None, adapter: str
    ) -> None:
        """Start at ``version`` (resumed: the engine loaded that checkpoint) and take the trainer's
        updates from ``transport``; an engine without a host copy is updated by the trainer itself
        (``weights = "direct"``) and has no receiver. ``lora``: updates are adapters alone, merged
        into the engine's base weights (resumed: ``adapter``, the checkpoint's, merged first), or
        received into the adapter of an engine that serves adapters itself (SGLang's LoRA API;
        its ``set_version`` loads them).

        Updates arrive in the trainer's float32. An engine in another dtype (``[rollout.engine]
        dtype``) receives them into a float32 copy of its weights and rounds them in; adapters
        stay float32 and are merged in float32."""
        if version:
            self.engine.set_version(version)
        self.receiver, self.lora, self._staged = None, None, {}
        if self.engine.adapter is not None:
            self.receiver = open_receiver(transport, background=True)
            self._catch_up(transport)
        elif self.engine.model is not None:
            params = dict(self.engine.model.named_parameters())
            if lora is not None:
                modules, transposed = adapted_modules(self.engine.model, lora.target_modules)
                self.lora = LoraMerge(params, modules, lora.rank, lora.scale, transposed, dtype=torch.float32)
                if adapter:
                    self.lora.load(read_adapter(adapter))
            elif any(p.dtype != torch.float32 for p in params.values()):
                self._staged = {name: p.detach().float() for name, p in params.items()}
            self.receiver = open_receiver(transport, background=True)  # pushes never wait for our apply
            self._catch_up(transport)

    def _targets(self) -> dict[str, torch.Tensor]:
        """What updates are applied into: the adapter buffers (LoRA: the worker's merge, or the
        engine's own), the float32 copy of a lower-precision engine's weights, or the engine's
        weights themselves."""
        if self.lora:
            return self.lora.buffers
        if self.engine.adapter is not None:
            return self.engine.adapter
        return self._staged or dict(self.engine.model.named_parameters())

    @torch.no_grad()
    def _install(self) -> None:
        """Bring a received version into the engine: merge the adapter, or round the float32 copy."""
        if self.lora:
            self.lora.merge()
        elif self._staged:
            for name, p in self.engine.model.named_parameters():
                p.copy_(self._staged[name])

    def _receive(self, version: int) -> None:
        with self.lender.working() if self.lender else contextlib.nullcontext():
            self.receiver.apply(self._targets(), version=version)
            self._install()

    def _catch_up(self, transport: TransportConfig) -> None:
        """Take the newest version the transport still holds, if newer than ours (a restarted
        worker; a fresh run has none): :func:`loong_transfermesh.catch_up`."""
        held = self.engine.weight_version
        if (version := catch_up(transport, self._targets(), held)) != held:
            self._install()
            self.engine.set_version(version)

    def rollout(
        self, specs: list[EpisodeSpec], min_version: int = 0, evaluation: bool = False
    ) -> RolloutResult:
        """Run episodes (:class:`~loong_train.messages.RolloutResult`). With partial
        rollouts or concurrent calls (:mod:`loong_train.engines.embedded.host`) the episodes
        start once the engine holds ``min_version`` (its update may still be on the way), and an
        ``evaluation`` runs entirely at one version."""
        start = self._call_began()
        try:
            if self.receiver is None and min_version > self.engine.weight_version:
                self.engine.set_version(min_version)  # direct weights: wait until the server has it
            if self.blackbox is not None:
                out = self.blackbox.run(specs)
            elif self.host is not None:
                out = self.host.rollout(
                    self.agent, specs, self.codec, self.sampling, self.limits, min_version, evaluation
                )
            else:
                out = asyncio.run(
                    run_episodes(self.agent, specs, self.engine, self.codec, self.sampling, self.limits)
                )
        finally:
            self._call_ended()
        self.engine.check()  # a server given up on fails the call, not just its episodes
        if (group := self.task.group_reward) is not None:
            score_groups(group, out, {s.sample_id: s.task for s in specs}, self._final_turn)
        if self.overlong[0] and not evaluation:
            shape_overlong(out, self.budget, *self.overlong)
        end = time.time()
        stats = getattr(self.engine, "stats", None)  # the embedded engine counts its work
        return RolloutResult(
            trajectories=out,
            start=start,
            end=end,
            version=self.engine.weight_version,
            worker=self.worker_id,
            pid=os.getpid(),
            busy_s=self.busy_s,
            engine=None if stats is None else EngineCounts(stats.steps, stats.tokens, stats.busy_s),
        )

    def _call_began(self) -> float:
        with self._calls_lock:
            now = time.time()
            if not self._calls:
                self._calls_since = now
            self._calls += 1
            return now

    def _call_ended(self) -> None:
        """``busy_s`` counts the time at least one call (rollout or evaluation) ran."""
        with self._calls_lock:
            self._calls -= 1
            if not self._calls:
                self.busy_s += time.time() - self._calls_since

    def _final_turn(self, t: Trajectory) -> str:
        """The text of an episode's last model turn, as the white-box agent gives it to a reward."""
        return final_turn(t, self.codec.decode, self.chat.strip_end)

    def apply_weights(self, manifest: WeightManifest, restart_below: int = -1) -> ApplyResult:
        """Receive an update through TransferMesh. Called like a rollout, Ray runs it between
        rollout calls: no generation sees mixed weights. Called in the ``weights`` concurrency
        group, it lands mid-call (partial rollouts), or, with ``partial = "off"`` and concurrent
        calls, once the running calls ended (the host holds new ones back):
        :meth:`~loong_train.engines.embedded.host.EngineHost.swap` pauses the engine for the
        copy, and episodes that started below ``restart_below`` run again. A worker that already
        holds this version or a newer one (a restarted worker that caught up) skips it."""
        start, restarted = time.time(), 0
        if self.receiver is None:  # direct weights: the trainer pushed; wait until the server has it
            self.engine.set_version(max(manifest.version, self.engine.weight_version))
        elif manifest.version > self.engine.weight_version:
            copy = functools.partial(self._receive, manifest.version)
            if self.host is not None:
                restarted = self.host.swap(copy, manifest.version, restart_below, self.between_calls)
            else:
                copy()
                self.engine.set_version(manifest.version)
        return ApplyResult(
            version=manifest.version,
            worker=self.worker_id,
            pid=os.getpid(),
            start=start,
            end=time.time(),
            restarted=restarted,
        )

    def close(self) -> None:
        """Stop the black-box proxy and the SGLang server (a Ray actor's process just ends, and its
        server with it; in process, call this)."""
        if self.blackbox is not None:
            self.blackbox.close()
        if self.host is not None:
            self.host.close()
        if self.receiver is not None:
            self.receiver.close()
        if self.lender is not None:
            self.lender.close()
        self.engine.close()

    def model_path(self) -> str:
        return self._model_path

    def server_url(self) -> str:
        """Where other nodes reach this worker's server (direct weights): its bind address, or
        this node's IP as Ray knows it when the server binds every interface (loopback stays
        loopback: a trainer on another node cannot reach it)."""
        config = self.engine.supervisor.config
        if config.host in ("0.0.0.0", "::"):
            return f"http://{ray.util.get_node_ip_address()}:{config.port}"
        return config.url

    def node(self) -> tuple[str, str]:
        """The Ray node this worker runs on: its id and IP address."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def pid(self) -> int:
        """The worker's process id (a restarted worker has a new one)."""
        return os.getpid()

    def weight_version(self) -> int:
        return self.engine.weight_version
