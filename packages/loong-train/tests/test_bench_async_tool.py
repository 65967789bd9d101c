"""``tools/bench_async.py``'s bookkeeping: workload specs, and the speedup taken against the faster
synchronous configuration of each workload (a hand-made set of run rows; no training here)."""

from __future__ import annotations

from pathlib import Path

import bench_async as bench
import pytest


def test_a_workload_spec_names_its_overrides():
    assert bench.parse_workload("compute") == ("compute", {})
    assert bench.parse_workload("tools=rollout.tool_latency_ms=200,rollout.tool_latency_sigma=1") == (
        "tools",
        {"rollout.tool_latency_ms": "200", "rollout.tool_latency_sigma": "1"},
    )
    with pytest.raises(SystemExit, match="expected NAME=KEY=VALUE"):
        bench.parse_workload("tools=rollout.tool_latency_ms")


def _row(workload, config, seed, sps, ev):
    return {"workload": workload, "config": config, "seed": seed, "samples_per_s": sps, "final_eval": ev}


def test_the_speedup_is_the_best_asynchronous_over_the_best_synchronous_configuration():
    rows = [
        _row("compute", "sync-t1", 0, 24.0, 0.8), _row("compute", "sync-t1", 1, 26.0, 0.9),
        _row("compute", "sync-t2", 0, 44.0, 0.8), _row("compute", "sync-t2", 1, 42.0, 0.7),
        _row("compute", "async-t1", 0, 45.0, 0.9), _row("compute", "async-t1", 1, 43.0, 0.8),
        _row("compute", "async-t1-cc", 0, 40.0, 0.9), _row("compute", "async-t1-cc", 1, 42.0, 0.8),
        _row("tools", "sync-t1", 0, 12.0, 0.8), _row("tools", "sync-t2", 0, 10.0, 0.8),
        _row("tools", "async-t1", 0, 18.0, 0.85), _row("tools", "async-t1-cc", 0, 30.0, 0.85),
    ]  # fmt: skip
    out = bench.summarize(rows)
    assert out["compute"]["best_sync"] == "sync-t2" and out["tools"]["best_sync"] == "sync-t1"
    assert out["compute"]["best_async"] == "async-t1" and out["tools"]["best_async"] == "async-t1-cc"
    assert out["compute"]["speedup"] == pytest.approx(44.0 / 43.0)
    assert out["tools"]["speedup"] == pytest.approx(2.5)
    assert out["compute"]["configs"]["sync-t1"] == {"samples_per_s": 25.0, "final_eval": pytest.approx(0.85)}
    lines = bench.table(out).splitlines()
    assert len(lines) == 2 + 8
    assert lines[-1].startswith("| tools | async-t1-cc (best) | 30.0 | 2.50x | - | 0.85 |")
    assert "predicted_speedup" not in out["tools"]


def test_the_simulator_is_compared_on_the_same_two_configurations():
    rows = [
        _row("tools", "sync-t1", 0, 12.0, 0.8) | {"predicted_samples_per_s": 10.0},
        _row("tools", "sync-t2", 0, 10.0, 0.8) | {"predicted_samples_per_s": 11.0},
        _row("tools", "async-t1-cc", 0, 30.0, 0.85) | {"predicted_samples_per_s": 27.0},
    ]
    out = bench.summarize(rows)["tools"]
    assert out["best_sync"] == "sync-t1"  # measured best, though the simulator prefers sync-t2
    assert out["predicted_speedup"] == pytest.approx(2.7)
    assert "| tools | async-t1-cc (best) | 30.0 | 2.50x | 2.70x | 0.85 |" in bench.table({"tools": out})


def test_a_summary_of_one_kind_of_run_has_no_speedup_and_still_tables():
    rows = [
        _row("tools", "async-t1", 0, 18.0, 0.85) | {"predicted_samples_per_s": 20.0},
        _row("tools", "async-t1-tr2", 0, 21.0, 0.8),  # no prediction: its trainer threads had no sync run
    ]
    out = bench.summarize(rows)["tools"]
    assert out["best_sync"] is None and out["best_async"] == "async-t1-tr2"
    assert "speedup" not in out and "predicted_speedup" not in out
    assert "| tools | async-t1 | 18.0 | - | - | 0.85 |" in bench.table({"tools": out})


def test_concurrent_calls_match_the_window():
    assert bench.config_sets("async-t1-cc", 2) == {
        "threads": 1,
        "train.max_staleness": 2,
        "rollout.engine.concurrent_calls": 3,
        "rollout.engine.partial": "continue",
    }
    assert bench.config_sets("sync-t2", 2) == {"train.max_staleness": 0, "threads": 2}


def test_engine_costs_are_measured_on_the_recipes_model(tmp_path):
    """A real worker on a random-init tiny model (no warm start), short episodes: every cost is
    measured (timing under a loaded test machine is too noisy to check the fit's values here)."""
    sets = {"warmstart.steps": 0, "rollout.max_new_tokens": 8, "rollout.group_size": 2}
    costs = bench.engine_costs("tiny-calc-agent", sets, tmp_path, threads=1, solo=3, sizes=(4, 12))
    assert costs["group_s"] > 0 and costs["turns"] >= 1 and costs["sigma"] >= 0
    assert {"step_s", "row_s", "slot_cost"} <= costs.keys()


def test_the_slot_cost_fit_recovers_a_hand_made_engine():
    """Calls on an engine with a = 2 ms per step and b = 0.3 ms per row: G = 8 rows cost
    8 * 0.3 / (2 + 8 * 0.3) = 0.545 of a solo group's step."""
    calls = [(100, 800), (120, 3000), (150, 9000)]  # (steps, rows)
    points = [[steps, rows, 0.002 * steps + 0.0003 * rows] for steps, rows in calls]
    fit = bench.fit_slot_cost(points, group_size=8)
    assert fit["step_s"] == pytest.approx(0.002) and fit["row_s"] == pytest.approx(0.0003)
    assert fit["slot_cost"] == pytest.approx(2.4 / 4.4)


def test_the_cpu_floor_is_every_core_busy_at_the_synchronous_cost_per_sample():
    """Hand-worked: one thread each, sync, 18 samples/s with the trainer busy 60% and the engine
    30% of the time: a sample costs 0.9 / 18 = 0.05 core-seconds, so 2 cores train at most 40/s."""
    rows = [
        _row("tools", "sync-t1", 0, 18.0, 0.5) | {"trainer_busy": 0.6, "engine_busy": 0.3},
        _row("tools", "sync-t2", 0, 20.0, 0.5) | {"trainer_busy": 0.5, "engine_busy": 0.3},
        _row("tools", "async-t1", 0, 30.0, 0.5) | {"trainer_busy": 0.9, "engine_busy": 0.5},
    ]
    out = bench.summarize(rows, cores=2)["tools"]
    assert out["cpu_floor_samples_per_s"] == pytest.approx(40.0)
    assert "| tools | CPU floor (every core busy) | 40.0 | 2.00x |" in bench.table({"tools": out})


def test_only_configurations_named_cc_run_concurrent_calls():
    assert "rollout.engine.concurrent_calls" not in bench.config_sets("async-t1-tr2", 2)
    assert bench.config_sets("async-t1-tr2", 2)["train.threads"] == 2


def _costed(config: str, sets: dict, shared: dict | None = None) -> dict:
    """A row with hand-made costs: a solo group takes 1 s, a train step 2 s (batch of 2)."""
    engine = {"group_s": 1.0, "sigma": 0.0, "slot_cost": 0.0, "turns": 1}
    row = {
        "config": config,
        "sets": sets,
        "engine_costs": engine,
        "trainer_costs": {"train_s": 2.0, "sync_s": 0.0},
    }
    return row | ({"shared_costs": shared} if shared else {})


def test_predictions_charge_the_shared_cores_to_overlapped_runs_only():
    """rollout.workers 1 and batch_groups 2, constant 1 s calls of 2 groups, 2 s steps: the
    synchronous run takes 1 + 2 s a step, the asynchronous one 2 s (generation hides behind
    training) unless each slows the other 1.5x: the call then takes 1.5 s, during which the
    trainer does 1 s of its 2 s of work, and the other 1 s runs alone: 2.5 s a step."""
    base = {"rollout.workers": 1, "train.batch_groups": 2, "rollout.group_size": 2, "threads": 1}
    sync = base | {"train.max_staleness": 0}
    asyn = base | {"train.max_staleness": 1}
    shared = {"train_slowdown": 1.5, "engine_slowdown": 1.5}
    rows = [_costed("sync-t1", sync, shared), _costed("async-t1", asyn), _costed("async-t1", asyn, shared)]
    bench.add_predictions("tiny-calc-agent", rows, steps=40)
    per_step = [row["predicted_samples_per_s"] / 4 for row in rows]  # 4 samples a step
    assert per_step == pytest.approx([1 / 3, 1 / 2, 1 / 2.5], rel=0.02)


def test_shared_core_costs_time_each_phase_alone_and_beside_the_other(tmp_path):
    """Real worker, real backend and real second processes on a random-init tiny model: every
    time is measured, each slowdown is its phase beside over alone (timing under a loaded test
    machine is too noisy to check the values), and the second processes are gone."""
    sets = {
        "warmstart.steps": 0,
        "rollout.max_new_tokens": 8,
        "rollout.group_size": 2,
        "train.batch_groups": 2,
    }
    costs = bench.shared_core_costs(
        "tiny-calc-agent", sets, tmp_path, engine_threads=1, train_threads=1, repeats=1
    )
    assert all(costs[k] > 0 for k in ("call_alone_s", "call_beside_s", "train_alone_s", "train_beside_s"))
    assert costs["train_slowdown"] == costs["train_beside_s"] / costs["train_alone_s"]
    assert costs["engine_slowdown"] == costs["call_beside_s"] / costs["call_alone_s"]
    hogs = [p for p in Path("/proc").glob("[0-9]*/cmdline") if _reads(p).count(str(tmp_path))]
    assert hogs == []  # each second process (its command line names the cache) has exited


def _reads(path: Path) -> str:
    try:
        return path.read_bytes().decode(errors="replace")
    except OSError:  # exited meanwhile
        return ""
