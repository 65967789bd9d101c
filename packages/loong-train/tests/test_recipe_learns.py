"""The shipped recipe really learns: a shortened tiny-calc-agent run (the session's model cache
starts empty, so the first slow run of the recipe warm-starts it).

Builds and warm-starts the tiny model, then runs 40 asynchronous GRPO steps (window 1). The full
recipe (160 steps) is what docs/results.md reports; 40 steps already show the held-out gain.
"""

import json

import pytest

from loong_core.telemetry import read_metrics
from loong_train.config import load_recipe
from loong_train.controller import run


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.xdist_group("tiny-calc-warm-start")  # with the regression test: one warm start for both
def test_tiny_calc_agent_improves_held_out_success(tmp_path, tiny_cache):
    recipe = load_recipe("tiny-calc-agent", ["train.steps=40"])
    out = run(recipe, tmp_path / "run", tiny_cache)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_eval"] - summary["first_eval"] >= 0.3, summary
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 40
    assert max(r["staleness_max"] for r in rows) <= recipe.train.max_staleness
    assert rows[0]["mismatch_kl"] < 1e-9
