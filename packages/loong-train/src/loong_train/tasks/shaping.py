"""DAPO's soft overlong punishment (``[reward] overlong_buffer``, ``overlong_penalty``), added to
training rewards by the rollout worker (see :mod:`loong_train.tasks.reward`)."""

from __future__ import annotations

from loong_core.records import EpisodeStatus, Trajectory

__all__ = ["overlong_penalty", "shape_overlong"]


def overlong_penalty(tokens: int, budget: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment (Yu et al., 2025) of an episode with ``tokens`` model
    tokens, ``budget`` the most it may have and ``buffer`` the last tokens of it that cost:

        0                                            tokens <= budget - buffer
        -factor * (tokens - (budget - buffer)) / buffer   up to -factor at the budget
    """
    start = budget - buffer
    if buffer <= 0 or tokens <= start:
        return 0.0
    return -factor * min(1.0, (tokens - start) / buffer)


def shape_overlong(trajs: list[Trajectory], budget: int, buffer: int, factor: float) -> None:
    """Add :func:`overlong_penalty` to the reward of every finished or truncated episode (in place;
    a black-box episode's rows count together), and log it as ``reward/overlong_penalty``."""
    tokens: dict[str, int] = {}
    for t in trajs:
        key = t.info.get("episode", t.sample_id)
        tokens[key] = tokens.get(key, 0) + t.num_model_tokens
    for t in trajs:
        if t.status in (EpisodeStatus.OK, EpisodeStatus.TRUNCATED):
            penalty = overlong_penalty(tokens[t.info.get("episode", t.sample_id)], budget, buffer, factor)
            t.reward += penalty
            t.metrics = {**t.metrics, "overlong_penalty": penalty}
