"""The weight-sync strategy a run gets from ``[rollout.engine]`` (:mod:`loong_train.weight_sync`);
the strategies themselves run in every pipeline test (``test_run_e2e``, ``test_partial_rollout``,
``test_sglang_rollout``)."""

from __future__ import annotations

import pytest

from loong_train.config import load_recipe
from loong_train.weight_sync import Beside, Direct, InOrder, choose


@pytest.mark.parametrize(
    ("sets", "kind", "concurrent", "restart"),
    [
        ([], InOrder, None, None),
        (['rollout.engine.partial="continue"'], Beside, False, False),
        (['rollout.engine.partial="restart"'], Beside, False, True),
        (['rollout.engine.partial="continue"', "rollout.engine.concurrent_calls=2"], Beside, True, False),
        (['rollout.engine={type="sglang", launcher="loong"}'], InOrder, None, None),
        (['rollout.engine={type="sglang", launcher="loong", weights="direct"}'], Direct, None, None),
    ],
)
def test_the_strategy_follows_the_engine_table(sets, kind, concurrent, restart):
    sync = choose(load_recipe("tiny-calc-agent", sets).rollout.engine)
    assert type(sync) is kind
    assert sync.reuses_buffers is (kind is not Direct)  # the trainer's push into servers reuses none
    if kind is Beside:
        assert (sync.concurrent, sync.restart) == (concurrent, restart)
