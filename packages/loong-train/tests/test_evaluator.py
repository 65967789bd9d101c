"""Held-out evaluations say when episodes failed or timed out, instead of reading as wrong answers."""

from __future__ import annotations

import logging

from loong_core.records import EpisodeStatus, SpanSource, TokenSpan, Trajectory
from loong_train.evaluator import _warn_unfinished


def _episode(i: int, status: EpisodeStatus, reward: float = 0.0) -> Trajectory:
    spans = [TokenSpan([1, 2], SpanSource.PROMPT), TokenSpan([3], SpanSource.MODEL, [-0.1], 4)]
    return Trajectory(
        sample_id=f"eval-v4-{i}", group_id=f"eval-v4-{i}", spans=spans, reward=reward, status=status
    )


def test_timed_out_and_failed_held_out_episodes_are_counted_in_a_warning(caplog):
    statuses = [EpisodeStatus.TIMEOUT] * 3 + [EpisodeStatus.FAILED] + [EpisodeStatus.OK] * 4
    with caplog.at_level(logging.WARNING, logger="loong.evaluator"):
        _warn_unfinished(4, [_episode(i, s) for i, s in enumerate(statuses)])
    (record,) = caplog.records
    assert "evaluation of version 4: 1 failed, 3 timeout of 8 episodes, each scored 0" in record.getMessage()
    assert "rollout.episode_timeout_s" in record.getMessage()


def test_finished_and_truncated_episodes_need_no_warning(caplog):
    statuses = [EpisodeStatus.OK, EpisodeStatus.TRUNCATED]
    with caplog.at_level(logging.WARNING, logger="loong.evaluator"):
        _warn_unfinished(0, [_episode(i, s, 1.0) for i, s in enumerate(statuses)])
    assert not caplog.records
