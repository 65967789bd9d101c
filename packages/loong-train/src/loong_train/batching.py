"""Batch assembly as pure functions: what the pipeline does with trajectories between a rollout
call and a train step (no Ray; :mod:`loong_train.pipeline` calls these).

A rollout call's rows (checked when they arrived: a row that breaks a record invariant fails, not
the run) are sorted into their groups; each group's oldest model-token version decides whether the window
accepts it, and with dynamic sampling a group whose samples all scored the same carries no
signal and is dropped. A taken batch becomes one :class:`~loong_core.records.TrainBatch`:
advantages per group, rows packed.
"""

from __future__ import annotations

from dataclasses import dataclass

from loong_core.records import TrainBatch, Trajectory
from loong_train.algo.config import LossConfig
from loong_train.algo.losses import advantages, no_signal, pack_batch

__all__ = ["GroupOutcome", "assemble", "sort_groups"]


@dataclass(frozen=True, slots=True)
class GroupOutcome:
    """One group of a finished rollout call: its trajectories, the oldest weight version among
    their model tokens, whether it carries no signal and whether dynamic sampling drops it."""

    group_id: str
    trajectories: list[Trajectory]
    oldest: int
    no_signal: bool
    drop: bool


def sort_groups(
    groups: list[str],
    trajectories: list[Trajectory],
    *,
    fallback_version: int,
    dynamic_sampling: bool,
) -> list[GroupOutcome]:
    """Sort a call's rows into its ``groups`` (in the call's order). A group none of whose rows
    produced a model token counts as run at ``fallback_version``; a group whose samples all scored
    the same is marked ``no_signal``, and with ``dynamic_sampling`` ``drop``."""
    by_group: dict[str, list[Trajectory]] = {g: [] for g in groups}
    for t in trajectories:
        by_group[t.group_id].append(t)
    outcomes = []
    for group_id, trajs in by_group.items():
        versions = [t.oldest_version for t in trajs if t.oldest_version >= 0]
        oldest = min(versions) if versions else fallback_version
        flat = no_signal(trajs)
        outcomes.append(GroupOutcome(group_id, trajs, oldest, flat, dynamic_sampling and flat))
    return outcomes


def assemble(trajectories: list[Trajectory], loss: LossConfig, version: int) -> TrainBatch:
    """The train batch of ``trajectories`` (whole groups) taken at ``version``."""
    return pack_batch(trajectories, advantages(trajectories, loss), version, loss.overlong_filter)
