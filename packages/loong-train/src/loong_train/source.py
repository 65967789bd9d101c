"""Training prompts as GRPO groups, and the sampling seed of every episode; with a
:class:`~loong_train.curriculum.Curriculum`, the draw passes over resting prompts."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from typing import Any

from loong_agentflow import EpisodeSpec
from loong_core.records import Trajectory
from loong_train.algo.losses import episode_id
from loong_train.curriculum import Curriculum, Outcome, prompt_key

__all__ = ["GroupSource", "episode_seed"]


def episode_seed(run_seed: int, sample_id: str) -> int:
    """The sampling seed of episode ``sample_id`` in a run seeded ``run_seed`` (64 bits of a hash):
    the same sample samples the same tokens from the same weights however the run was split."""
    digest = hashlib.blake2b(f"{run_seed}/{sample_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class GroupSource:
    """Training prompts as GRPO groups; a group id names the window entry (the ledger key).

    ``count`` groups have been drawn, taking ``pulled`` items from ``tasks`` (more than
    ``count`` when the ``curriculum`` passed over some): the data position a checkpoint saves;
    ``issued`` keeps the prompt of every group not yet trained, so a lost group is issued again
    with the same prompt. With ``seed``, each episode carries ``episode_seed(seed, sample_id)``.
    """

    def __init__(
        self,
        tasks: Iterator[dict[str, Any]],
        group_size: int,
        tags: dict[str, str] | None = None,
        seed: int | None = None,
        curriculum: Curriculum | None = None,
    ) -> None:
        self.tasks, self.group_size, self.tags, self.seed = tasks, group_size, tags or {}, seed
        self.curriculum = curriculum
        self.issued: dict[str, dict[str, Any]] = {}
        self.count = self.pulled = 0

    def next_group(self) -> str:
        group_id = f"g{self.count}"
        self.issued[group_id] = self._draw()
        self.count += 1
        return group_id

    def _draw(self) -> dict[str, Any]:
        """The next item of the stream the curriculum admits."""
        c, passed = self.curriculum, 0
        any_item = c is not None and c.takes_any()
        while True:
            item = next(self.tasks)
            self.pulled += 1
            if c is None or c.admits(prompt_key(item), self.count, passed, any_item):
                return item
            passed += 1

    def observe(self, group_id: str, trajectories: list[Trajectory]) -> Outcome | None:
        """A finished group's outcome for its prompt's statistics (issued, not yet released)."""
        if self.curriculum is None:
            return None
        rewards = {episode_id(t): t.reward for t in trajectories if t.status.trainable}
        key = prompt_key(self.issued[group_id])
        return self.curriculum.observe(key, list(rewards.values()), self.count)

    def release(self, group_ids: list[str]) -> None:
        """Forget groups that were trained (a long run would otherwise keep every prompt)."""
        for group_id in group_ids:
            del self.issued[group_id]

    def specs(self, group_id: str) -> list[EpisodeSpec]:
        task = self.issued[group_id]
        tags = {**self.tags, **task.get("tags", {})}  # a task's own tags (its domain) route it
        ids = [f"{group_id}-{j}" for j in range(self.group_size)]
        return [EpisodeSpec(i, group_id, task, dict(tags), self._seed(i)) for i in ids]

    def _seed(self, sample_id: str) -> int | None:
        return None if self.seed is None else episode_seed(self.seed, sample_id)

    def state_dict(self) -> dict[str, Any]:
        """The data position (items taken from the stream, groups drawn), the prompts of groups
        issued but not trained, and the curriculum's statistics."""
        state = {"tasks_drawn": self.pulled, "groups": self.count, "issued": dict(self.issued)}
        if self.curriculum is not None:
            state["curriculum"] = self.curriculum.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a fresh source from ``state_dict()``: its task stream advances past the items
        taken (the stream is seeded: it yields the same items again)."""
        pulled = state["tasks_drawn"]
        next(itertools.islice(self.tasks, pulled - self.pulled, pulled - self.pulled), None)  # skip them
        self.pulled, self.count, self.issued = pulled, state.get("groups", pulled), dict(state["issued"])
        if self.curriculum is not None:
            if "curriculum" not in state:
                raise ValueError(
                    "the checkpoint was written without [curriculum] enabled: its prompt statistics "
                    "are missing (resume with curriculum.enabled = false)"
                )
            self.curriculum.load_state_dict(state["curriculum"])
