"""tools/simulate.py, the discrete-event model of the async loop that drives the real window:
hand-computed timelines, and the window's guarantees checked from the run's own records."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import simulate as sim

LONG_TAIL = sim.SimConfig(engines=8, steps=30, dist="lognormal", sigma=1.0, record=True)


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_window_0_is_on_policy_and_never_overlaps_training() -> None:
    r = sim.simulate(replace(LONG_TAIL, window=0))
    assert r.staleness_hist == {"0": 30 * 8}
    steps = [(start, end + LONG_TAIL.sync_time) for start, end in r.trainer_intervals]  # train + sync
    assert len(steps) == 30
    busy = [iv for intervals in r.engine_intervals for iv in intervals]
    assert len(busy) >= 30 * 8 / LONG_TAIL.engines  # every group ran on some engine
    assert not any(_overlap(s, g) for s in steps for g in busy)


@pytest.mark.parametrize("window", [0, 1, 2])
@pytest.mark.parametrize("slots", [1, 3])
def test_staleness_bound_and_ledger(window: int, slots: int) -> None:
    cfg = replace(LONG_TAIL, window=window, slots=slots, batch_per_engine=2)
    r = sim.simulate(cfg)
    assert r.staleness_max <= window
    assert sum(r.staleness_hist.values()) == cfg.steps * cfg.batch
    assert max(Counter(r.trained).values()) == 1  # no group trained twice
    assert len(set(r.admitted)) == len(r.admitted)
    assert set(r.trained).isdisjoint(r.pending)
    assert set(r.trained) | set(r.pending) == set(r.admitted)
    assert len(r.trained) == cfg.steps * cfg.batch


def _hand(window: int, sync_time: float, n: int = 20, **kw) -> sim.SimResult:
    cfg = sim.SimConfig(
        engines=2, window=window, steps=n, dist="constant", step_ratio=1.0, sync_time=sync_time, **kw
    )
    return sim.simulate(cfg)


@pytest.mark.parametrize("sync_time", [0.0, 0.5])
def test_hand_checked_timelines(sync_time: float) -> None:
    """2 engines, B = 2, every generation 1, every train step 1, then a sync of s.

    Window 0: generate [0, 1], train [1, 2], sync [2, 2 + s]; each step takes 2 + s.
    Window 1: the second pair is admitted at t = 1 (version 0, deadline 1) while the first
    trains, so generation hides behind training: step k ends at 1 + k (1 + s); staleness 1.
    Window 2: same times (the trainer is the limit), but with s > 0 the idle engines admit one
    more pair at version 0 during the first sync; the buffer then stays one batch deep, so every
    batch from the third on has staleness 2: the extra window buys nothing here.
    """
    n, s = 20, sync_time
    sync = _hand(0, s)
    assert sync.sim_time == n * (2 + s)
    assert sync.staleness_hist == {"0": 2 * n}
    # Rates leave out the first n // 10 = 2 steps: engines and trainer each work 1 of 2 + s.
    assert sync.throughput == pytest.approx(2 / (2 + s))
    assert sync.trainer_busy == pytest.approx(1 / (2 + s))
    assert sync.engine_busy == pytest.approx(1 / (2 + s))
    one_off = {"0": 2, "1": 2 * (n - 1)}
    expected = {1: one_off, 2: one_off if s == 0 else {"0": 2, "1": 2, "2": 2 * (n - 2)}}
    for window, hist in expected.items():
        r = _hand(window, s)
        assert r.sim_time == 1 + n * (1 + s)
        assert r.staleness_hist == hist
        assert r.throughput == pytest.approx(2 / (1 + s))
        assert r.trainer_busy == pytest.approx(1 / (1 + s))


@pytest.mark.parametrize(("slot_cost", "step"), [(0.0, 2.0), (1.0, 3.0)])
def test_processor_sharing_on_one_engine(slot_cost: float, step: float) -> None:
    """One engine, two slots, B = 2: both groups run at once, each at 1 / (1 + slot_cost) speed."""
    r = sim.simulate(
        sim.SimConfig(
            engines=1, batch_per_engine=2, slots=2, slot_cost=slot_cost, window=0, steps=10,
            dist="constant", step_ratio=0.5, sync_time=0.0,
        )
    )  # fmt: skip
    assert r.sim_time == 10 * step  # generation 1 + slot_cost, then training 0.5 * 2
    assert r.engine_load == pytest.approx(2 * (1 + slot_cost) / step)


def test_async_beats_sync_on_a_long_tail() -> None:
    cfg = sim.SimConfig(engines=16, steps=40, dist="lognormal", sigma=1.0)
    results = sim.sweep(cfg, engines=[16], windows=[0, 1, 2])
    by_window = {r.window: r for r in results}
    assert by_window[0].speedup == 1.0
    assert by_window[1].throughput >= by_window[0].throughput
    assert by_window[2].throughput >= by_window[0].throughput
    assert by_window[1].trainer_busy >= by_window[0].trainer_busy


def test_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim.json"
    sim.main(["--engines", "4,8", "--windows", "0,2", "--steps", "12", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [(r["engines"], r["window"]) for r in rows] == [(4, 0), (4, 2), (8, 0), (8, 2)]
    keys = {"speedup", "trainer_busy", "engine_busy", "throughput", "staleness_max", "staleness_mean"}
    assert keys | {"staleness_hist"} <= rows[0].keys()
    assert "speedup" in capsys.readouterr().out


def test_hand_checked_tool_waits_hold_no_engine_slot() -> None:
    """2 engines, B = 2, generation 1 in two halves with a tool wait of exactly 1 between them
    (sigma 0), train step 1, no sync. Window 0: generate [0, 0.5], wait [0.5, 1.5], generate
    [1.5, 2], train [2, 3]; a step takes 3 and an engine runs a group 1 of those 3."""
    r = _hand(0, 0.0, turns=2, tool_latency=1.0, tool_sigma=0.0)
    assert r.sim_time == 20 * 3
    assert r.throughput == pytest.approx(2 / 3)
    assert r.engine_busy == pytest.approx(1 / 3)
    assert r.staleness_hist == {"0": 40}


def test_a_group_waits_for_its_slowest_episode() -> None:
    """The wait is the largest of ``episodes`` lognormal draws: more episodes, longer steps."""
    times = {
        n: sim.simulate(sim.SimConfig(engines=2, window=0, steps=20, dist="constant", turns=2,
                                      tool_latency=1.0, tool_sigma=0.5, episodes=n)).sim_time
        for n in (1, 8)
    }  # fmt: skip
    assert times[8] > times[1] > 20 * (2 + 0.05)  # a draw of one episode is sometimes below 1


def test_tool_waits_widen_what_asynchrony_gains() -> None:
    """Synchronous steps wait on tools while the trainer idles; a window of 2 trains meanwhile."""

    def speedup(latency: float) -> float:
        cfg = sim.SimConfig(engines=8, steps=40, dist="lognormal", sigma=0.5, cap=3.0, turns=3,
                            tool_latency=latency)  # fmt: skip
        runs = {r.window: r for r in sim.sweep(cfg, engines=[8], windows=[0, 2])}
        return runs[2].speedup

    assert speedup(1.0) > speedup(0.0) + 0.2


@pytest.mark.parametrize("window", [0, 1, 2])
def test_call_mode_admits_and_reports_a_call_as_a_whole(window: int) -> None:
    """``call_groups`` = 4, 2 calls at once per engine: each admission asks for a call's 4 groups,
    the scheduler hears of a call's groups together, once its slowest one ends; the window's
    guarantees hold as in group mode."""
    cfg = replace(LONG_TAIL, window=window, batch_per_engine=4, slots=2, call_groups=4, turns=2,
                  tool_latency=0.5)  # fmt: skip
    run = sim._Sim(cfg)
    r = run.run()
    assert r.staleness_max <= window and max(Counter(r.trained).values()) == 1
    assert len(r.trained) == cfg.steps * cfg.batch and set(r.trained) | set(r.pending) == set(r.admitted)
    journal = run.scheduler.journal
    calls = [e["out"] for e in journal if e["call"] == "admit" and e["out"]]
    assert {e["room"] for e in journal if e["call"] == "admit"} == {4}
    finished = [e["group"] for e in journal if e["call"] == "finish"]
    reported = [finished[i : i + 4] for i in range(0, len(finished), 4)]
    assert all(sorted(block) in [sorted(c) for c in calls] for block in reported)


def test_in_call_mode_a_call_waits_for_its_slowest_group() -> None:
    """One engine, B = 2, calls of 2 groups: generation lengths 1 and 3 (the first draws of the
    stream) keep both groups until 3; in group mode the short one is reported at 1."""
    base = sim.SimConfig(engines=1, batch_per_engine=2, window=0, steps=1, dist="constant",
                         slot_cost=0.0, step_ratio=0.5, sync_time=0.0)  # fmt: skip
    assert _finish_times(replace(base, slots=2), [1.0, 3.0]) == [1.0, 3.0]
    assert _finish_times(replace(base, slots=1, call_groups=2), [1.0, 3.0]) == [3.0, 3.0]


def _finish_times(cfg, works: list[float]) -> list[float]:
    """When the scheduler hears of each group, with generation lengths ``works`` in draw order."""
    run = sim._Sim(cfg)
    draws = iter(works)
    run.draw = lambda: next(draws)
    seen: list[float] = []
    finish = run.scheduler.finish
    run.scheduler.finish = lambda g, v, *a: seen.append(run.now) or finish(g, v, *a)
    run.run()
    return seen


def test_phases_that_never_overlap_never_slow_each_other() -> None:
    """Window 0 alternates generation and training, so shared-core slowdowns change nothing."""
    plain = _hand(0, 0.5)
    shared = _hand(0, 0.5, train_slowdown=2.0, engine_slowdown=1.5)
    assert (shared.sim_time, shared.throughput, shared.trainer_busy) == (
        plain.sim_time,
        plain.throughput,
        plain.trainer_busy,
    )


def test_hand_checked_shared_cores() -> None:
    """2 engines, B = 2, generation 1, train step 1, window 1, no sync; a step runs 2x slower
    while both engines generate, engines 1.5x slower while a step trains.

    After the first pair [0, 1], each step overlaps the next pair's generation: both slowed,
    generation ends 1.5 later, by then the step has done 0.75 of its 1 and ends 0.25 later
    alone: a period of 1.75. The last step has nothing to overlap and takes 1. Trainer busy:
    1.75 of every 1.75 in steady state; engines 1.5 of it."""
    n = 20
    r = _hand(1, 0.0, train_slowdown=2.0, engine_slowdown=1.5)
    assert r.sim_time == pytest.approx(1 + (n - 1) * 1.75 + 1)
    span = r.sim_time - (1 + 2 * 1.75)  # rates leave out the first n // 10 = 2 steps
    assert r.trainer_busy == pytest.approx(((n - 3) * 1.75 + 1) / span)
    assert r.engine_busy == pytest.approx((n - 3) * 1.5 / span)
    assert r.staleness_max == 1


@pytest.mark.parametrize(("share", "hop"), [(0.5, 0.25), (1.0, 0.125)])
def test_remote_engines_pay_the_extra_hop_in_the_sync(share: float, hop: float) -> None:
    """Engines on other nodes than the trainer's get their own copy of each update over the
    trainer's link: with a sync of 0.25 and 0.25 more for remote copies, the timelines are the
    hand-checked ones of a sync of 0.5 (above), at every window."""
    for window in (0, 1, 2):
        hopped = _hand(window, 0.25, remote_share=share, hop_time=hop)
        local = _hand(window, 0.5)
        assert hopped.sim_time == pytest.approx(local.sim_time)
        assert hopped.staleness_hist == local.staleness_hist
    assert sim.SimConfig(engines=8, remote_share=0.5, hop_time=0.1).sync_cost == pytest.approx(0.05 + 4 * 0.1)
