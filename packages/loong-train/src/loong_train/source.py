"""Training prompts as GRPO groups, and the sampling seed of every episode."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from typing import Any

from loong_agentflow import EpisodeSpec

__all__ = ["GroupSource", "episode_seed"]


def episode_seed(run_seed: int, sample_id: str) -> int:
    """The sampling seed of episode ``sample_id`` in a run seeded ``run_seed`` (64 bits of a hash):
    the same sample samples the same tokens from the same weights however the run was split."""
    digest = hashlib.blake2b(f"{run_seed}/{sample_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class GroupSource:
    """Training prompts as GRPO groups; a group id names the window entry (the ledger key).

    ``count`` tasks have been drawn from ``tasks`` (one per group), which is the data position a
    checkpoint saves; ``issued`` keeps the prompt of every group not yet trained, so a lost group
    is issued again with the same prompt. With ``seed``, each episode carries
    ``episode_seed(seed, sample_id)``.
    """

    def __init__(
        self,
        tasks: Iterator[dict[str, Any]],
        group_size: int,
        tags: dict[str, str] | None = None,
        seed: int | None = None,
    ) -> None:
        self.tasks, self.group_size, self.tags, self.seed = tasks, group_size, tags or {}, seed
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
        ids = [f"{group_id}-{j}" for j in range(self.group_size)]
        return [EpisodeSpec(i, group_id, task, dict(tags), self._seed(i)) for i in ids]

    def _seed(self, sample_id: str) -> int | None:
        return None if self.seed is None else episode_seed(self.seed, sample_id)

    def state_dict(self) -> dict[str, Any]:
        """The data position: tasks drawn, and the prompts of groups issued but not trained."""
        return {"tasks_drawn": self.count, "issued": dict(self.issued)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a fresh source from ``state_dict()``: its task stream advances past the tasks
        drawn (the stream is seeded: it draws the same tasks again)."""
        drawn = state["tasks_drawn"]
        next(itertools.islice(self.tasks, drawn - self.count, drawn - self.count), None)  # skip them
        self.count, self.issued = drawn, dict(state["issued"])
