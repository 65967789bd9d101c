"""Held-out evaluation: which versions are evaluated, the rollout calls that do it, their results.

Version 0 (the weights before training) is evaluated first, then every ``eval.every`` versions
and the last one. An evaluation is a rollout call of every held-out item (one episode each, seeded
by the run seed and the item's sample id, so a version's evaluation samples the same tokens in
every run), queued on a live worker behind the weight update to that version; once it runs, no
later update crosses it (:meth:`Pipeline.queue_rollout` with ``evaluation=True``). Where updates wait
for the evaluations queued before them (:mod:`loong_train.weight_sync`), version 0's queues behind
the first rollout calls, so the trainer starts on their batch while it runs.

An evaluation whose worker died, or that ran at another version than it names (an update
overtook it while it waited behind other calls), is recorded as lost (logged, ``lost_evals`` in
the summary), not re-run: a later run would evaluate other weights than the version it names.
Resumed from a checkpoint at version v, an evaluation of v that had not finished is queued again
(the engines start at v); older unfinished ones are lost.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import ray

from loong_agentflow import EpisodeSpec
from loong_core.records import Trajectory
from loong_train.messages import EvalResult, RolloutResult
from loong_train.pipeline import Pipeline
from loong_train.source import episode_seed
from loong_train.tasks import Item

__all__ = ["Evaluator"]

log = logging.getLogger("loong.evaluator")


class Evaluator:
    """Queues evaluations on the pipeline and collects them as they finish.

    Lifecycle: ``load_state_dict`` when resumed; ``begin(pipe)`` once (version 0, or the resumed
    checkpoint's pending one); ``after_step(pipe, v)`` after every published version;
    ``collect(wait)`` whenever results may have finished (``wait``: block until all queued ones
    did); ``state_dict()`` for a checkpoint. Results go to whoever collects them (the run
    directory keeps them); ``lost`` names the versions whose evaluation was lost.
    """

    def __init__(self, held_out: list[Item], *, seed: int, every: int, last: int) -> None:
        self.held_out, self.seed, self.every, self.last = held_out, seed, every, last
        self.calls: dict[int, Any] = {}  # version -> rollout call, until collected
        self.lost: set[int] = set()
        self.version = 0  # the newest version published
        self._resumed: list[int] | None = None  # pending at the checkpoint resumed from

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (see :mod:`loong_train.run.checkpoint`): the versions lost, and
        those queued and not finished."""
        return {"version": self.version, "lost": sorted(self.lost), "pending": sorted(self.calls)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version, self.lost, self._resumed = state["version"], set(state["lost"]), state["pending"]

    def begin(self, pipe: Pipeline) -> None:
        if self._resumed is None:
            self.queue(pipe, 0)
            return
        for v in self._resumed:
            if v == self.version:
                self.queue(pipe, v)
            else:
                self.lost.add(v)
                log.warning(
                    "evaluation of version %d lost: unfinished at the checkpoint of step %d", v, self.version
                )

    def after_step(self, pipe: Pipeline, version: int) -> None:
        """Queue the evaluation of ``version`` when it is due."""
        self.version = version
        if version % self.every == 0 or version == self.last:
            self.queue(pipe, version)

    def stop_at(self, pipe: Pipeline, version: int) -> None:
        """The run ends at ``version``, before its last step: evaluate it unless it was due anyway."""
        if version % self.every and version != self.last:
            self.queue(pipe, version)

    def queue(self, pipe: Pipeline, version: int) -> None:
        """A held-out evaluation on a live worker, behind the weight update to ``version``."""
        ids = [f"eval-v{version}-{i}" for i in range(len(self.held_out))]
        specs = [
            EpisodeSpec(i, i, item, dict(item.get("tags", {})), episode_seed(self.seed, i))
            for i, item in zip(ids, self.held_out, strict=True)
        ]
        self.calls[version] = pipe.queue_rollout(pipe.live_worker(), specs, evaluation=True)

    def collect(self, wait: bool = False) -> list[EvalResult]:
        """Evaluations that finished since the last call, oldest version first."""
        refs = list(self.calls.values())
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=None if wait else 0)[0]) if refs else set()
        out = []
        for v, ref in sorted(self.calls.items()):
            if ref not in ready:
                continue
            del self.calls[v]
            try:
                result: RolloutResult = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                self.lost.add(v)
                log.warning("evaluation of version %d lost: its worker died (%s)", v, type(e).__name__)
                continue
            if result.version != v:  # an update that did not wait for it (it ran behind other calls)
                self.lost.add(v)
                log.warning("evaluation of version %d lost: it ran at version %d", v, result.version)
                continue
            trajs = result.trajectories
            _warn_unfinished(v, trajs)
            reward = sum(t.reward for t in trajs) / len(trajs)
            out.append(
                EvalResult(
                    version=v,
                    reward=reward,
                    by_domain=_by_domain(trajs),
                    worker=result.worker,
                    start=result.start,
                    end=result.end,
                )
            )
        return out


def _warn_unfinished(version: int, trajs: list[Trajectory]) -> None:
    """Say so when held-out episodes failed or timed out: they score 0, and a mean that counts them
    would otherwise read as a policy that answers wrong."""
    counts = Counter(t.status for t in trajs if not t.status.trainable)
    if counts:
        log.warning(
            "evaluation of version %d: %s of %d episodes, each scored 0 (a timeout is "
            "rollout.episode_timeout_s, counted from when the evaluation's episodes start together)",
            version,
            ", ".join(f"{n} {status}" for status, n in sorted(counts.items())),
            len(trajs),
        )


def _by_domain(trajs: list[Trajectory]) -> dict[str, float]:
    """Mean reward per ``domain`` tag; empty when no trajectory carries one."""
    rewards: dict[str, list[float]] = {}
    for t in trajs:
        if "domain" in t.tags:
            rewards.setdefault(t.tags["domain"], []).append(t.reward)
    return {d: sum(r) / len(r) for d, r in sorted(rewards.items())}
