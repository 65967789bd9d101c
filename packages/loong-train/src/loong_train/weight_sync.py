"""How weight updates meet rollout calls: one strategy per run, chosen from ``[rollout.engine]``.

Ray runs one caller's calls to an actor in order, so a rollout queued after a weight update runs
on the new weights; the pipeline's ``queued_version`` is the version every call queued from now
on runs at, and is what admission checks. Each strategy keeps that bound its own way:

- :class:`InOrder` (the default): updates queue behind the rollout calls already on a worker;
  no generation sees two versions.
- :class:`Beside` (``partial`` rollouts, ``concurrent_calls`` > 1): updates run on the workers'
  ``weights`` thread, landing mid-call (:mod:`loong_train.engines.embedded.host`); a rollout call
  carries ``queued_version`` and its worker waits until it holds that version before starting.
  With concurrent calls, rollouts run on the ``rollout`` threads, and with ``partial = "off"``
  the worker's host lets running calls end first.
- :class:`Direct` (SGLang, ``weights = "direct"``): the trainer pushes into the servers itself;
  a call carries ``queued_version`` and waits until its server reports it, and a train step
  waits for the evaluations still running, so an evaluation runs at the version it names.

The first two push through a TransferMesh buffer that a later push may reuse
(``TransportConfig.must_have_applied``), so a publish waits for the applies of the version it
overwrites (``reuses_buffers``).
"""

from __future__ import annotations

from typing import Any

import ray

from loong_agentflow import EpisodeSpec
from loong_core.records import WeightManifest
from loong_train.engines.config import EngineConfig, SGLangEngineConfig

__all__ = ["Beside", "Direct", "InOrder", "WeightSync", "choose"]


class WeightSync:
    """The strategy's interface (see the module docstring); :class:`InOrder` is the base case."""

    reuses_buffers = True  # a publish waits for the applies of the buffer it overwrites
    # an update waits for the evaluations queued before it, started or not, so an evaluation may
    # queue behind rollout calls and still run at its version
    updates_wait_for_queued_evaluations = True

    def rollout(self, worker: Any, specs: list[EpisodeSpec], version: int, evaluation: bool) -> Any:
        """Queue a rollout call that runs at ``version`` or newer; returns its ref."""
        raise NotImplementedError

    def apply(self, worker: Any, manifest: WeightManifest, restart_floor: int) -> Any:
        """Queue ``manifest`` on ``worker``; episodes started below ``restart_floor`` run again
        where the strategy restarts them."""
        raise NotImplementedError

    def running_evaluations(self) -> list[Any]:
        """Evaluation calls a train step must wait for before it changes the weights."""
        return []


class InOrder(WeightSync):
    def rollout(self, worker: Any, specs: list[EpisodeSpec], version: int, evaluation: bool) -> Any:
        return worker.rollout.remote(specs, 0, evaluation)  # Ray's call order is the version

    def apply(self, worker: Any, manifest: WeightManifest, restart_floor: int) -> Any:
        return worker.apply_weights.remote(manifest)


class Beside(WeightSync):
    updates_wait_for_queued_evaluations = False  # an update lands beside a call not yet started

    def __init__(self, concurrent_calls: int, restart: bool) -> None:
        self.concurrent, self.restart = concurrent_calls > 1, restart

    def rollout(self, worker: Any, specs: list[EpisodeSpec], version: int, evaluation: bool) -> Any:
        call = worker.rollout.options(concurrency_group="rollout") if self.concurrent else worker.rollout
        return call.remote(specs, version, evaluation)

    def apply(self, worker: Any, manifest: WeightManifest, restart_floor: int) -> Any:
        floor = restart_floor if self.restart else -1
        return worker.apply_weights.options(concurrency_group="weights").remote(manifest, floor)


class Direct(WeightSync):
    reuses_buffers = False

    def __init__(self) -> None:
        self.evaluations: list[Any] = []

    def rollout(self, worker: Any, specs: list[EpisodeSpec], version: int, evaluation: bool) -> Any:
        ref = worker.rollout.remote(specs, version, evaluation)
        if evaluation:
            self.evaluations.append(ref)
        return ref

    def apply(self, worker: Any, manifest: WeightManifest, restart_floor: int) -> Any:
        return worker.apply_weights.remote(manifest)  # waits until the server reports the version

    def running_evaluations(self) -> list[Any]:
        refs = self.evaluations
        done = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
        self.evaluations = [r for r in refs if r not in done]
        return self.evaluations


def choose(engine: EngineConfig) -> WeightSync:
    """The strategy ``engine`` needs."""
    if isinstance(engine, SGLangEngineConfig) and engine.weights == "direct":
        return Direct()
    if engine.partial != "off" or engine.concurrent_calls > 1:
        return Beside(engine.concurrent_calls, restart=engine.partial == "restart")
    return InOrder()
