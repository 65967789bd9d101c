"""The mechanics under the driver: data, in-flight Ray calls, weight sync and telemetry.

Kept apart from ``controller.py`` so the driver reads as the loop of DESIGN.md section 5.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import ray

from loong_agentflow import EpisodeSpec
from loong_core.records import Trajectory, WeightManifest
from loong_core.window import StalenessWindow
from loong_train.algorithms import grpo_advantages, pack_batch
from loong_train.config import Recipe

__all__ = ["GroupSource", "Pipeline"]


class GroupSource:
    """Training prompts as GRPO groups; a group id names the window entry (the ledger key)."""

    def __init__(
        self, tasks: Iterator[dict[str, Any]], group_size: int, tags: dict[str, str] | None = None
    ) -> None:
        self.tasks, self.group_size, self.tags = tasks, group_size, tags or {}
        self.issued: dict[str, dict[str, Any]] = {}
        self.count = 0

    def next_group(self) -> str:
        group_id = f"g{self.count}"
        self.count += 1
        self.issued[group_id] = next(self.tasks)
        return group_id

    def release(self, group_ids: list[str]) -> None:
        """Forget groups that were trained (a long run would otherwise keep every prompt)."""
        for group_id in group_ids:
            del self.issued[group_id]

    def specs(self, group_id: str) -> list[EpisodeSpec]:
        task = self.issued[group_id]
        tags = {**self.tags, **task.get("tags", {})}  # a task's own tags (its domain) route it
        return [EpisodeSpec(f"{group_id}-{j}", group_id, task, dict(tags)) for j in range(self.group_size)]


@dataclass
class Pipeline:
    """In-flight work: rollout calls per worker, the one train step, pending weight applies.

    Ray runs one caller's calls to an actor in order, so a rollout queued after a weight update
    runs on the new weights: ``queued_version`` is the version every call queued from now on
    will run at, and is what admission checks.
    """

    recipe: Recipe
    workers: list[Any]
    trainer: Any
    window: StalenessWindow
    source: GroupSource
    queued_version: int = 0
    rollouts: dict[Any, tuple[int, list[str]]] = field(default_factory=dict)
    train_ref: Any = None
    applies: dict[int, list[Any]] = field(default_factory=dict)
    finished: dict[str, list[Trajectory]] = field(default_factory=dict)

    @property
    def groups_needed(self) -> int:
        """Groups still to admit so that exactly ``train.steps`` batches get trained."""
        w = self.window
        live = len(w.trained) + len(w.taken) + len(w.buffered) + len(w.in_flight)
        return self.recipe.train.steps * self.recipe.train.batch_groups - live

    def admit(self) -> None:
        """Keep every worker's queue two calls deep (one running, one waiting), round-robin."""
        per_call = -(-self.recipe.train.batch_groups // len(self.workers))
        for depth in (1, 2):
            for w, worker in enumerate(self.workers):
                if sum(1 for ww, _ in self.rollouts.values() if ww == w) >= depth:
                    continue
                groups = []
                while (
                    len(groups) < per_call
                    and self.groups_needed > 0
                    and self.window.can_admit(self.queued_version)
                ):
                    reissue = self.window.reissue
                    group_id = reissue[0] if reissue else self.source.next_group()
                    self.window.admit(group_id, self.queued_version)
                    groups.append(group_id)
                if not groups:
                    return
                specs = [s for g in groups for s in self.source.specs(g)]
                self.rollouts[worker.rollout.remote(specs)] = (w, groups)

    def wait(self) -> list[tuple[str, Any]]:
        """Block until some rollout or the train step finishes; returns (kind, result) events."""
        refs = list(self.rollouts) + ([self.train_ref] if self.train_ref is not None else [])
        if not refs:
            raise RuntimeError(
                f"pipeline stalled: nothing in flight and nothing admissible ({self.window.stats})"
            )
        ready, _ = ray.wait(refs, num_returns=1)
        events = []
        for ref in ready:
            if ref is self.train_ref:
                self.train_ref = None
                events.append(("train", ray.get(ref)))
            else:
                _, groups = self.rollouts.pop(ref)
                events.append(("rollout", (groups, ray.get(ref))))
        return events

    def on_rollout(self, groups: list[str], result: dict[str, Any]) -> None:
        trajectories: list[Trajectory] = result["trajectories"]
        by_group: dict[str, list[Trajectory]] = {g: [] for g in groups}
        for t in trajectories:
            t.validate()
            by_group[t.group_id].append(t)
        for group_id, trajs in by_group.items():
            versions = [t.oldest_version for t in trajs if t.oldest_version >= 0]
            self.window.finish(group_id, min(versions) if versions else self.window.version)
            self.finished[group_id] = trajs

    def start_train_step(self) -> list[Trajectory] | None:
        """Take a batch from the window and start the train step on it (non-blocking).

        The trainer publishes version v + 1 into the shm slot that version v - 1 used, so the
        publish call depends on every worker having applied v - 1 (a Ray dependency: the
        controller never blocks on it); with ``zero_copy`` receivers the engines read v - 1's slot
        until they apply v, so it depends on v's applies instead.
        """
        if self.train_ref is not None or self.window.version >= self.recipe.train.steps:
            return None
        if (groups := self.window.take_batch()) is None:
            return None
        lag = 0 if self.recipe.transport.mode == "zero_copy" else 1
        slot_users = self.applies.get(self.window.version - lag, [])
        trajs = [t for g in groups for t in self.finished.pop(g)]
        self.source.release(groups)
        adv = grpo_advantages(trajs, self.recipe.loss.scale_adv_by_std)
        batch = pack_batch(trajs, adv, self.window.version)
        self.train_ref = self.trainer.publish.remote(self.trainer.train_step.remote(batch), *slot_users)
        return trajs

    def sync_weights(self, manifest: WeightManifest) -> None:
        """Queue the update on every worker; calls queued after it run on the new version."""
        self.applies[manifest.version] = [w.apply_weights.remote(manifest) for w in self.workers]
        self.queued_version = manifest.version

    def applied(self) -> list[dict[str, float]]:
        """Results of weight applies that finished since the last call (one per worker and version)."""
        done = []
        for version, refs in list(self.applies.items()):
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            if len(ready) == len(refs):
                done += ray.get(refs)
                del self.applies[version]
        return done

    def drain(self) -> None:
        ray.get(list(self.rollouts) + [r for refs in self.applies.values() for r in refs])
        self.rollouts.clear()
