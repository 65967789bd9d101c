"""The pure scheduler: admission, finishes, takes and state by hand-worked cases, and a real
pipeline run whose recorded scheduling a fresh scheduler replays call for call."""

from __future__ import annotations

import json

import pytest
import simulate

from loong_core.window import StalenessWindow
from loong_train import scheduler as scheduler_module
from loong_train.config import load_recipe
from loong_train.controller import run
from loong_train.scheduler import Scheduler, replay


def _ids():
    n = iter(range(10**6))
    return lambda: f"g{next(n)}"


def test_admission_stops_at_the_window_and_at_the_groups_the_run_needs():
    s = Scheduler(StalenessWindow(max_staleness=1, batch_size=2), steps=2)  # needs 4 groups
    new = _ids()
    assert s.admit(3, new) == ["g0", "g1", "g2"]
    assert s.admit(3, new) == ["g3"]  # window capacity (1 + 1) * 2 = 4 = the run's 2 * 2 groups
    for g in ("g0", "g1", "g2", "g3"):
        assert s.finish(g, 0)
    assert s.admit(3, new) == []


def test_lost_groups_are_admitted_again_before_new_ones():
    s = Scheduler(StalenessWindow(max_staleness=0, batch_size=2), steps=5)
    new = _ids()
    assert s.admit(2, new) == ["g0", "g1"]
    s.abort(["g1"])
    assert s.admit(2, new) == ["g1"]  # window 0: capacity 2, g0 still in flight


def test_a_group_that_ran_below_its_admission_version_goes_back():
    s = Scheduler(StalenessWindow(max_staleness=1, batch_size=1), steps=5)
    new = _ids()
    assert s.admit(1, new) == ["g0"]
    assert s.finish("g0", 0) and s.take() == ["g0"]
    assert s.take() is None  # a step is training
    s.published(1)
    assert s.admit(1, new) == ["g1"]  # admitted at version 1
    assert not s.finish("g1", 0)  # its episodes ran at version 0: issued again
    assert s.window.reissue == ("g1",)
    assert s.admit(1, new) == ["g1"]


def test_no_take_past_the_last_step_and_state_round_trip():
    s = Scheduler(StalenessWindow(max_staleness=0, batch_size=1), steps=1)
    new = _ids()
    assert s.admit(1, new) == ["g0"] and s.finish("g0", 0) and s.take() == ["g0"]
    s.published(1)
    assert s.admit(1, new) == [] and s.take() is None
    again = Scheduler.from_state(json.loads(json.dumps(s.state_dict())), steps=3)
    assert (again.queued_version, again.window.version, again.window.trained) == (1, 1, {"g0"})
    assert again.admit(5, new) == ["g1"]


def test_the_simulator_drives_this_scheduler():
    assert simulate.Scheduler is scheduler_module.Scheduler


@pytest.mark.integration
def test_a_pipeline_run_replays_call_for_call(tmp_path):
    """The scheduling of a real run (window 1: admissions overlap training) depends on nothing but
    the events the pipeline fed the scheduler: replayed into a fresh one, every decision repeats."""
    small = [
        "warmstart.steps=0",
        "train.steps=4",
        "train.batch_groups=2",
        "train.max_staleness=1",
        "rollout.group_size=2",
        "rollout.max_new_tokens=12",
        "rollout.max_model_tokens=24",
        "eval.every=4",
        "eval.num_tasks=4",
    ]
    recipe = load_recipe("tiny-calc-agent", small)
    out = run(recipe, tmp_path / "run", tmp_path / "cache")
    journal = [json.loads(line) for line in (out / "scheduler.jsonl").read_text().splitlines()]
    calls = [e["call"] for e in journal]
    assert calls.count("published") == 4 and calls.count("finish") == 4 * 2
    assert [e["out"] for e in journal if e["call"] == "take" and e["out"]] == [
        json.loads(line)["groups"] for line in (out / "ledger.jsonl").read_text().splitlines()
    ]
    assert replay(journal, StalenessWindow(1, 2), steps=4) == journal
    assert simulate.replay_run(out)  # the simulator fed the same events decides the same
    next(e for e in journal if e["call"] == "take" and e["out"])["out"] = ["g999"]
    (out / "scheduler.jsonl").write_text("".join(json.dumps(e) + "\n" for e in journal))
    assert not simulate.replay_run(out)  # and a decision the scheduler would not make is caught
