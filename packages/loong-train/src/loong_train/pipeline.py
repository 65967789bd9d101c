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

    def next_group(self) -> str:
        group_id = f"g{len(self.issued)}"
        self.issued[group_id] = next(self.tasks)
        return group_id

    def specs(self, group_id: str) -> list[EpisodeSpec]:
        task = self.issued[group_id]
        return [
            EpisodeSpec(f"{group_id}-{j}", group_id, task, dict(self.tags)) for j in range(self.group_size)
        ]


@dataclass
class Pipeline:
    """In-flight work: rollout calls per worker, the one train step, pending weight applies."""

    recipe: Recipe
    workers: list[Any]
    trainer: Any
    window: StalenessWindow
    source: GroupSource
    engine_version: list[int] = field(default_factory=list)
    rollouts: dict[Any, tuple[int, list[str]]] = field(default_factory=dict)
    train_ref: Any = None
    train_groups: dict[str, list[Trajectory]] = field(default_factory=dict)
    applies: dict[int, list[Any]] = field(default_factory=dict)
    finished: dict[str, list[Trajectory]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.engine_version = [0] * len(self.workers)

    def admit(self, per_call: int) -> None:
        """Fill every worker's queue (one call running, one waiting) with admitted groups."""
        for w, worker in enumerate(self.workers):
            while sum(1 for ww, _ in self.rollouts.values() if ww == w) < 2:
                groups = []
                while len(groups) < per_call and self.window.can_admit(self.engine_version[w]):
                    reissue = self.window.reissue
                    group_id = reissue[0] if reissue else self.source.next_group()
                    self.window.admit(group_id, self.engine_version[w])
                    groups.append(group_id)
                if not groups:
                    return
                specs = [s for g in groups for s in self.source.specs(g)]
                self.rollouts[worker.rollout.remote(specs)] = (w, groups)

    def wait(self) -> list[tuple[str, Any]]:
        """Block until some rollout or the train step finishes; returns (kind, result) events."""
        refs = list(self.rollouts) + ([self.train_ref] if self.train_ref is not None else [])
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
            by_group[t.group_id].append(t)
        for group_id, trajs in by_group.items():
            versions = [t.oldest_version for t in trajs if t.oldest_version >= 0]
            self.window.finish(group_id, min(versions) if versions else self.window.version)
            self.finished[group_id] = trajs

    def start_train_step(self) -> list[Trajectory] | None:
        """Take a batch from the window and start the train step on it (non-blocking)."""
        if self.train_ref is not None or (groups := self.window.take_batch()) is None:
            return None
        for stale_version in [v for v in self.applies if v <= self.window.version - 1]:
            ray.get(self.applies.pop(stale_version))  # its shm slot is about to be rewritten
        trajs = [t for g in groups for t in self.finished.pop(g)]
        t = self.recipe.train
        batch = pack_batch(trajs, grpo_advantages(trajs, t.scale_adv_by_std), self.window.version)
        self.train_ref = self.trainer.train_step.remote(batch)
        return trajs

    def sync_weights(self, manifest: WeightManifest) -> None:
        """Queue the update on every worker; calls queued after it run on the new version."""
        self.applies[manifest.version] = [w.apply_weights.remote(manifest) for w in self.workers]
        self.engine_version = [manifest.version] * len(self.workers)

    def last_apply_s(self) -> float:
        done = [v for v, refs in self.applies.items() if all(r in ray.wait(refs, timeout=0)[0] for r in refs)]
        if not done:
            return 0.0
        return max(r["apply_s"] for r in ray.get(self.applies[max(done)]))

    def drain(self) -> None:
        ray.get(list(self.rollouts) + [r for refs in self.applies.values() for r in refs])
        self.rollouts.clear()
