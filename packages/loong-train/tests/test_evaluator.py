"""Held-out evaluations say when episodes failed or timed out, instead of reading as wrong answers,
and record a version only for an evaluation that ran at it."""

from __future__ import annotations

import logging

import pytest
import ray

from loong_core.records import EpisodeStatus, SpanSource, TokenSpan, Trajectory
from loong_train.evaluator import Evaluator, _warn_unfinished
from loong_train.messages import RolloutResult


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


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=1, include_dashboard=False, logging_level=logging.WARNING)
    yield
    ray.shutdown()


def _result(version: int) -> RolloutResult:
    trajs = [_episode(i, EpisodeStatus.OK, reward=float(i % 2)) for i in range(4)]
    return RolloutResult(trajectories=trajs, start=0.0, end=1.0, version=version, worker=0, pid=0, busy_s=1.0)


def test_an_evaluation_that_ran_at_another_version_is_lost_not_recorded(local_ray, caplog):
    evaluator = Evaluator([], seed=0, every=2, last=4)
    evaluator.calls = {0: ray.put(_result(1)), 2: ray.put(_result(2))}  # version 0's was overtaken
    with caplog.at_level(logging.WARNING, logger="loong.evaluator"):
        (result,) = evaluator.collect(wait=True)
    assert (result.version, result.reward) == (2, 0.5)
    assert evaluator.lost == {0} and not evaluator.calls
    assert "evaluation of version 0 lost: it ran at version 1" in caplog.text
