"""Held-out evaluation: which versions are evaluated, the rollout calls that do it, their results.

Version 0 is evaluated before training, then every ``eval.every`` versions and the last one. An
evaluation is a rollout call of every held-out item (one episode each, seeded by the run seed and
the item's sample id, so a version's evaluation samples the same tokens in every run), queued on a
live worker behind the weight update to that version, and never crossed by a later update
(:meth:`Pipeline.queue_rollout` with ``evaluation=True``).

An evaluation whose worker died is recorded as lost (logged, ``lost_evals`` in the summary), not
re-run: a later run would evaluate other weights than the version it names. Resumed from a
checkpoint at version v, an evaluation of v that had not finished is queued again (the engines
start at v); older unfinished ones are lost.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import msgspec
import ray

from loong_agentflow import EpisodeSpec
from loong_core.records import Trajectory
from loong_train.pipeline import Pipeline, episode_seed
from loong_train.tasks import Item

__all__ = ["EvalResult", "Evaluator", "EvaluatorState"]

log = logging.getLogger("loong.evaluator")


class EvaluatorState(msgspec.Struct, kw_only=True):
    """What a checkpoint keeps of the evaluations (see :mod:`loong_train.run.checkpoint`)."""

    results: dict[int, float]
    by_domain: dict[int, dict[str, float]]
    lost: list[int]
    pending: list[int]  # queued, not finished at the checkpoint


class EvalResult(msgspec.Struct, frozen=True, kw_only=True):
    """One finished evaluation: mean reward over the held-out items, per ``domain`` tag (empty
    when no item carries one), and the rollout call's worker and wall-clock span."""

    version: int
    reward: float
    by_domain: dict[str, float]
    worker: int
    start: float
    end: float


class Evaluator:
    """Queues evaluations on the pipeline and collects them as they finish.

    Lifecycle: ``begin(pipe)`` once (version 0, or the resumed checkpoint's pending one);
    ``after_step(pipe, v)`` after every published version; ``collect(wait)`` whenever results may
    have finished (``wait``: block until all queued ones did); ``state()`` for a checkpoint.
    """

    def __init__(
        self,
        held_out: list[Item],
        *,
        seed: int,
        every: int,
        last: int,
        resume: EvaluatorState | None = None,
        resumed_at: int = 0,
    ) -> None:
        self.held_out, self.seed, self.every, self.last = held_out, seed, every, last
        self.calls: dict[int, Any] = {}
        self.results: dict[int, float] = dict(resume.results) if resume else {}
        self.by_domain: dict[int, dict[str, float]] = dict(resume.by_domain) if resume else {}
        self.lost: set[int] = set(resume.lost) if resume else set()
        self._resume, self._resumed_at = resume, resumed_at

    def begin(self, pipe: Pipeline) -> None:
        if self._resume is None:
            self.queue(pipe, 0)
            return
        for v in self._resume.pending:
            if v == self._resumed_at:
                self.queue(pipe, v)
            else:
                self.lost.add(v)
                log.warning(
                    "evaluation of version %d lost: unfinished at the checkpoint of step %d",
                    v,
                    self._resumed_at,
                )

    def after_step(self, pipe: Pipeline, version: int) -> None:
        """Queue the evaluation of ``version`` when it is due."""
        if version % self.every == 0 or version == self.last:
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
        pending = {v: ref for v, ref in self.calls.items() if v not in self.results and v not in self.lost}
        refs = list(pending.values())
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=None if wait else 0)[0]) if refs else set()
        out = []
        for v, ref in sorted(pending.items()):
            if ref not in ready:
                continue
            try:
                result = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                self.lost.add(v)
                log.warning("evaluation of version %d lost: its worker died (%s)", v, type(e).__name__)
                continue
            trajs = result["trajectories"]
            _warn_unfinished(v, trajs)
            self.results[v] = sum(t.reward for t in trajs) / len(trajs)
            self.by_domain[v] = _by_domain(trajs)
            out.append(
                EvalResult(
                    version=v,
                    reward=self.results[v],
                    by_domain=self.by_domain[v],
                    worker=result["worker"],
                    start=result["start"],
                    end=result["end"],
                )
            )
        return out

    def state(self) -> EvaluatorState:
        done = self.results.keys() | self.lost
        return EvaluatorState(
            results=dict(self.results),
            by_domain=dict(self.by_domain),
            lost=sorted(self.lost),
            pending=sorted(v for v in self.calls if v not in done),
        )


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
