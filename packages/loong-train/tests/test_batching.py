"""Batch assembly (:mod:`loong_train.batching`) without Ray: rows sorted into their groups, each
group's oldest version, dynamic sampling's drop mark, and the packed batch of a taken set of groups,
checked against hand-worked values."""

from __future__ import annotations

import math

import pytest

from loong_core.records import EpisodeStatus, SpanSource, TokenSpan, Trajectory
from loong_train.batching import assemble, sort_groups
from loong_train.config import load_recipe


def _row(sample: str, group: str, reward: float, versions: list[int], status: str = "ok") -> Trajectory:
    """A prompt of two tokens, then one model span per version in ``versions`` (one token each)."""
    spans = [TokenSpan(token_ids=[1, 2], source=SpanSource.PROMPT)]
    spans += [
        TokenSpan(token_ids=[3 + i], source=SpanSource.MODEL, logprobs=[-0.25 * (i + 1)], weight_version=v)
        for i, v in enumerate(versions)
    ]
    return Trajectory(
        sample_id=sample, group_id=group, spans=spans, reward=reward, status=EpisodeStatus(status)
    )


def test_rows_are_sorted_into_the_calls_groups_in_their_order_with_each_oldest_version():
    rows = [
        _row("g1-0", "g1", 1.0, [3, 4]),
        _row("g0-0", "g0", 0.0, [2]),
        _row("g1-1", "g1", 0.0, [4]),
        _row("g0-1", "g0", 1.0, [5, 2, 6]),
    ]
    out = sort_groups(["g0", "g1", "g2"], rows, fallback_version=7, dynamic_sampling=False)
    assert [g.group_id for g in out] == ["g0", "g1", "g2"]
    assert [[t.sample_id for t in g.trajectories] for g in out] == [["g0-0", "g0-1"], ["g1-0", "g1-1"], []]
    # g2 came back empty and a group whose rows have no model token has no oldest: the fallback
    assert [g.oldest for g in out] == [2, 3, 7]
    assert not any(g.drop for g in out)


def test_a_group_without_model_tokens_counts_at_the_fallback_version():
    out = sort_groups(["g0"], [_row("g0-0", "g0", 0.0, [])], fallback_version=4, dynamic_sampling=True)
    assert out[0].oldest == 4


@pytest.mark.parametrize("dynamic_sampling", [True, False])
def test_only_dynamic_sampling_marks_groups_whose_samples_all_scored_the_same(dynamic_sampling):
    rows = [
        _row("a-0", "a", 1.0, [0]),
        _row("a-1", "a", 1.0, [0]),
        _row("b-0", "b", 1.0, [0]),
        _row("b-1", "b", 0.0, [0]),
        _row("c-0", "c", 0.0, [0]),
        _row("c-1", "c", 1.0, [0], status="failed"),  # a failed row is not in the statistics
    ]
    out = sort_groups(["a", "b", "c"], rows, fallback_version=0, dynamic_sampling=dynamic_sampling)
    assert [g.no_signal for g in out] == [True, False, True]  # counted either way
    assert [g.drop for g in out] == ([True, False, True] if dynamic_sampling else [False] * 3)


@pytest.mark.parametrize(("std", "spread"), [("population", 0.5), ("unbiased", math.sqrt(0.5))])
def test_a_taken_batch_packs_trainable_rows_with_their_groups_advantages(std, spread):
    loss = load_recipe("tiny-calc-agent", ["loss.estimator='grpo'", f"loss.std='{std}'"]).loss
    assert loss.scale_adv_by_std
    rows = [
        _row("a-0", "a", 1.0, [2, 3]),
        _row("a-1", "a", 0.0, [2]),
        _row("a-2", "a", 0.0, [3], status="failed"),  # not packed, and not in a's statistics
        _row("b-0", "b", 0.5, [3]),
        _row("b-1", "b", 0.5, [3]),
    ]
    batch = assemble(rows, loss, version=3)
    assert batch.policy_version == 3
    assert batch.sample_ids == ["a-0", "a-1", "b-0", "b-1"]
    assert batch.row_lens == [4, 3, 3, 3]
    assert batch.versions == [-1, -1, 2, 3] + [-1, -1, 2] + [-1, -1, 3] * 2
    assert batch.loss_mask == [0, 0, 1, 1] + [0, 0, 1] + [0, 0, 1] * 2
    # group a's trainable rewards are 1 and 0: mean 0.5, spread 0.5 (/ G) or sqrt(0.5) (/ (G - 1))
    a = 0.5 / (spread + 1e-6)
    expected = [0, 0, a, a] + [0, 0, -a] + [0, 0, 0] * 2  # b's equal rewards: no signal
    assert batch.advantages == pytest.approx(expected, rel=1e-12)
