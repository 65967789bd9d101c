"""Partial rollouts: a weight update that lands while a rollout call runs (docs/architecture.md,
"The asynchronous loop", step 4).

``[rollout] partial`` picks the policy:

- ``"off"``: an update waits for the worker's running rollout calls (with one call at a time,
  Ray runs it between calls; with ``concurrent_calls`` > 1 the host holds new calls back and
  waits for the running ones), so no generation sees two weight versions.
- ``"continue"``: the update runs on the worker's ``weights`` thread (a Ray concurrency group)
  while a call runs. The engine pauses between decode steps, the new weights are copied in with
  no forward running, the version is set and the engine resumes: running requests are
  re-prefilled under the new weights and go on, each token stamped with the version that
  sampled it (``TokenSpan.versions`` when a span crosses the update).
- ``"restart"``: as ``"continue"``, and every episode of the running call (finished or not) that
  started under a version below the update's ``restart_below`` runs again from its prompt under
  the new weights (same spec, same seed), so its oldest token is never older than that.

An evaluation call (held-out reward of one version) is never crossed: an update that arrives
while it runs waits for it to end.

The restart happens inside the worker, not as ``window.abort`` plus a re-issue: the group stays
in its call and its window entry (admitted at a version <= the restarted tokens' versions) stays
valid, with no round trip through the controller and no second admission. The pipeline sets
``restart_below`` to the lowest version the window can still train, see
:meth:`loong_train.scheduler.Scheduler.restart_floor`.

An episode's start version (the engine's version when its task was created) is a lower bound
on its oldest token's version, so a restart decision never keeps an episode that is too old.

TransferMesh slots: an apply returns only after the swap, once no forward can read the previous
weights (``zero_copy``: the parameters are views of the new slot from then on), and the trainer
publishes into a slot only after the applies that last used it returned
(:meth:`loong_train.pipeline.Pipeline.start_train_step`). Applies that no longer wait for rollout
calls only shorten that wait; no slot is overwritten while an engine reads it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from loong_agentflow import Agent, Episode, EpisodeLimits, EpisodeSpec, TextCodec
from loong_agentflow.agent import run_episode
from loong_core.protocols import SamplingParams
from loong_core.records import Trajectory
from loong_train.engines.embedded.engine import EmbeddedEngine

__all__ = ["EngineHost"]

T = TypeVar("T")


@dataclass
class _Running:
    """One episode of a running call: its spec, task and the engine version it started under."""

    spec: EpisodeSpec
    task: asyncio.Task
    started: int


@dataclass
class _Call:
    """A running rollout call: its episodes by sample id, how to start one again, whether it is
    an evaluation."""

    episodes: dict[str, _Running]
    start: Callable[[EpisodeSpec], _Running]
    evaluation: bool


class EngineHost:
    """An embedded engine on an event loop of its own (a daemon thread), so a weight update that
    arrives on another thread can pause it between decode steps.

    Lifecycle: ``rollout(...)`` from the worker's rollout threads (``[rollout.engine]
    concurrent_calls`` of them: the calls' episodes share the engine's running batch, so while
    one call's episodes wait on their tools the others' keep it busy), ``swap(copy, version,
    restart_below, between_calls)`` from its weights thread at any moment, ``close()``. Every
    touch of the engine runs on the loop.

    While a swap is pending no call starts (a stream of calls cannot starve an update). A swap
    waits for running evaluations; with ``between_calls`` (``partial = "off"``) it waits for
    every running call, so no generation sees two versions.
    """

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="loong-engine", daemon=True)
        self._thread.start()
        self._changed = asyncio.Condition()  # the version, the running calls or a pending swap changed
        self._calls: list[_Call] = []
        self._swapping = False

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def rollout(
        self,
        agent: Agent,
        specs: Sequence[EpisodeSpec],
        codec: TextCodec,
        sampling: SamplingParams,
        limits: EpisodeLimits,
        min_version: int = 0,
        evaluation: bool = False,
    ) -> list[Trajectory]:
        """Run ``specs`` once the engine holds ``min_version`` or newer; trajectories in order.
        An ``evaluation`` runs at one version: updates wait for it to end (its reward is that
        version's) and nothing in it restarts."""
        return self._call(self._rollout(agent, specs, codec, sampling, limits, min_version, evaluation))

    async def _rollout(
        self, agent, specs, codec, sampling, limits, min_version, evaluation
    ) -> list[Trajectory]:
        def start(spec: EpisodeSpec) -> _Running:
            episode = Episode(spec, self.engine, codec, sampling, limits)
            task = asyncio.create_task(run_episode(agent, episode))
            return _Running(spec, task, self.engine.weight_version)

        async with self._changed:
            await self._changed.wait_for(
                lambda: self.engine.weight_version >= min_version and not self._swapping
            )
            call = _Call({s.sample_id: start(s) for s in specs}, start, evaluation)
            self._calls.append(call)
        try:
            while not all(r.task.done() for r in call.episodes.values()):
                await asyncio.wait([r.task for r in call.episodes.values()])  # a restart adds tasks
            return [call.episodes[s.sample_id].task.result() for s in specs]
        finally:
            async with self._changed:
                self._calls.remove(call)
                self._changed.notify_all()

    def swap(
        self, copy: Callable[[], None], version: int, restart_below: int = -1, between_calls: bool = False
    ) -> int:
        """Pause the engine, run ``copy`` (the weight copy) with no forward running, stamp
        ``version`` and resume; episodes that started below ``restart_below`` run again. With
        ``between_calls``, first wait until no rollout call runs. Returns how many episodes
        restarted."""
        return self._call(self._swap(copy, version, restart_below, between_calls))

    async def _swap(
        self, copy: Callable[[], None], version: int, restart_below: int, between_calls: bool
    ) -> int:
        async with self._changed:
            self._swapping = True
            await self._changed.wait_for(lambda: not any(c.evaluation or between_calls for c in self._calls))
        self.engine.pause()
        try:
            await self.engine.wait_idle()
            await asyncio.to_thread(copy)
            self.engine.set_version(version)
            stale = [
                (call, r) for call in self._calls for r in call.episodes.values() if r.started < restart_below
            ]
            for call, r in stale:  # cancelled while paused: their rows leave before the next step
                r.task.cancel()
                call.episodes[r.spec.sample_id] = call.start(r.spec)
        finally:
            self.engine.resume()
            async with self._changed:
                self._swapping = False
                self._changed.notify_all()
        return len(stale)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
