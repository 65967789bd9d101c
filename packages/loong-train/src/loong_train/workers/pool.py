"""The rollout worker actors and their health: which are down, which restarted.

Rollout workers are Ray actors with ``max_restarts``. A call of a worker whose process died
raises ``RayActorError`` (``ActorDiedError``, or ``ActorUnavailableError`` while Ray restarts
it); the pipeline then marks the worker down (:meth:`WorkerPool.mark_down`) and the pool probes
it (``pid()``, retried by Ray until the actor is back). Nothing else is queued on a worker while
it is down. A probe that finds a new pid counts a restart; one that finds the actor dead for
good (``ActorDiedError``: its restarts are spent) ends the run.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

__all__ = ["WorkerPool"]

log = logging.getLogger("loong.pipeline")


class WorkerPool:
    """``workers`` (rollout worker actor handles, in worker order) with each one's last seen pid,
    the probes of those that are down, and the restarts seen."""

    def __init__(self, workers: list[Any], max_restarts: int) -> None:
        self.workers, self.max_restarts = workers, max_restarts
        self.pids: list[int] = ray.get([w.pid.remote() for w in workers])
        self.probes: dict[Any, int] = {}  # pid() call -> worker, while it is down
        self.restarts = 0

    def __len__(self) -> int:
        return len(self.workers)

    @property
    def down(self) -> set[int]:
        """Workers whose process died, until a probe finds them back."""
        return set(self.probes.values())

    def live(self) -> list[int]:
        """The workers not down, in order."""
        down = self.down
        return [w for w in range(len(self.workers)) if w not in down]

    def live_worker(self) -> Any:
        """A worker to queue side work (evaluations) on: the first one not down."""
        live = self.live()
        return self.workers[live[0] if live else 0]

    def mark_down(self, w: int) -> None:
        """Queue nothing on worker ``w`` until a ``pid()`` probe answers (Ray retries the probe
        while the actor restarts)."""
        if w not in self.down:
            self.probes[self.workers[w].pid.options(max_task_retries=-1).remote()] = w

    def probed(self, ref: Any) -> int | None:
        """A probe finished: the worker it found back, or None while it is still restarting."""
        w = self.probes.pop(ref)
        try:
            pid = ray.get(ref)
        except ray.exceptions.ActorUnavailableError:  # still restarting
            self.mark_down(w)
            return None
        except ray.exceptions.ActorDiedError as e:
            raise RuntimeError(
                f"rollout worker {w} died and Ray will not restart it again "
                f"(rollout.max_restarts = {self.max_restarts})"
            ) from e
        self.seen(w, pid)
        return w

    def seen(self, w: int, pid: int) -> None:
        """Worker ``w`` answered from process ``pid``: a new pid is a restart."""
        if pid != self.pids[w]:
            self.restarts += 1
            log.warning("rollout worker %d restarted (pid %d -> %d)", w, self.pids[w], pid)
            self.pids[w] = pid

    def shutdown(self) -> None:
        """End the workers: each stops its proxy or server first (``close``)."""
        closing = [w.close.remote() for w in self.workers]
        ray.wait(closing, num_returns=len(closing), timeout=30)
        for actor in self.workers:
            ray.kill(actor)
