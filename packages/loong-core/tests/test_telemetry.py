"""Tests for loong_core.telemetry: metrics.jsonl and Chrome trace-event files."""

from __future__ import annotations

import json
import math
import pathlib
import threading
import time

import pytest

from loong_core.telemetry import MetricsWriter, TraceWriter, read_metrics

# ------------------------------------------------------------------------------------------ metrics


def test_metrics_round_trip_and_flush_per_write(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "run" / "metrics.jsonl"
    rows = [{"step": i, "reward_mean": i / 3, "staleness_max": 2, "tag": "x"} for i in range(5)]
    with MetricsWriter(path) as writer:
        for i, row in enumerate(rows):
            writer.write(row)
            assert read_metrics(path) == rows[: i + 1]  # visible before close
    assert path.read_text().count("\n") == len(rows)
    assert all(isinstance(json.loads(line), dict) for line in path.read_text().splitlines())


def test_metrics_append_on_resume_and_non_finite(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as writer:
        writer.write({"step": 0, "loss": math.nan})
    with MetricsWriter(path) as writer:
        writer.write({"step": 1, "loss": math.inf})
    rows = read_metrics(path)
    assert [r["step"] for r in rows] == [0, 1]
    assert math.isnan(rows[0]["loss"]) and rows[1]["loss"] == math.inf


def test_metrics_scalar_objects_with_item(tmp_path: pathlib.Path) -> None:
    class Scalar:  # stands in for numpy / torch 0-d values
        def item(self) -> float:
            return 0.25

    with MetricsWriter(tmp_path / "m.jsonl") as writer:
        writer.write({"kl": Scalar()})
        with pytest.raises(TypeError, match="not JSON serialisable"):
            writer.write({"bad": object()})
    assert read_metrics(tmp_path / "m.jsonl") == [{"kl": 0.25}]


def test_read_metrics_drops_torn_last_line_only(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n\n{"step": 1}\n{"step": 2, "rew')
    assert read_metrics(path) == [{"step": 0}, {"step": 1}]
    path.write_text('{"step": 0}\n{"st\n{"step": 2}\n')
    with pytest.raises(json.JSONDecodeError):
        read_metrics(path)


# -------------------------------------------------------------------------------------------- trace


def load_trace(path: pathlib.Path) -> list[dict]:
    data = json.loads(path.read_text())
    assert data["displayTimeUnit"] == "ms"
    return data["traceEvents"]


def test_span_times_ids_and_metadata(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "trace.json"
    trace = TraceWriter(path)
    t0 = trace.t0
    trace.span("generate", "rollout", "rollout-0", "engine", t0 + 1.5, t0 + 1.5 + 0.123456, {"version": 3})
    trace.span("train_step", "train", "trainer", "rank0", t0 + 2.0, t0 + 2.75)
    trace.span("generate", "rollout", "rollout-0", "engine", t0 + 3.0, t0 + 3.000001)
    trace.span("tool", "rollout", "rollout-0", "agent", t0 + 3.0, t0 + 4.0)
    trace.save()
    events = load_trace(path)

    spans = [e for e in events if e["ph"] == "X"]
    assert [s["name"] for s in spans] == ["generate", "train_step", "generate", "tool"]
    expected = [(1.5, 0.123456), (2.0, 0.75), (3.0, 0.000001), (3.0, 1.0)]
    for span, (start, dur) in zip(spans, expected, strict=True):
        assert abs(span["ts"] - start * 1e6) <= 1.0
        assert abs(span["dur"] - dur * 1e6) <= 1.0
    assert spans[0]["args"] == {"version": 3} and "args" not in spans[1]
    assert spans[0]["cat"] == "rollout"

    # Stable ids: same names -> same pid/tid; a new thread in a known process keeps its pid.
    assert (spans[0]["pid"], spans[0]["tid"]) == (spans[2]["pid"], spans[2]["tid"])
    assert spans[1]["pid"] != spans[0]["pid"]
    assert spans[3]["pid"] == spans[0]["pid"] and spans[3]["tid"] != spans[0]["tid"]

    meta = [e for e in events if e["ph"] == "M"]
    process_names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    thread_names = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert process_names == {spans[0]["pid"]: "rollout-0", spans[1]["pid"]: "trainer"}
    assert thread_names == {
        (spans[0]["pid"], spans[0]["tid"]): "engine",
        (spans[1]["pid"], spans[1]["tid"]): "rank0",
        (spans[3]["pid"], spans[3]["tid"]): "agent",
    }


def test_timed_measures_block_and_records_on_error(tmp_path: pathlib.Path) -> None:
    trace = TraceWriter(tmp_path / "trace.json")
    before = time.time()
    with trace.timed("sync", "weights", "trainer", "sync") as args:
        time.sleep(0.02)
        args["bytes"] = 1024
    after = time.time()
    with pytest.raises(RuntimeError), trace.timed("boom", "train", "trainer", "rank0"):
        raise RuntimeError("x")
    trace.save()
    spans = [e for e in load_trace(tmp_path / "trace.json") if e["ph"] == "X"]
    sync, boom = spans
    assert sync["args"] == {"bytes": 1024}
    assert 0.02e6 <= sync["dur"] <= (after - before) * 1e6 + 1
    assert (before - trace.t0) * 1e6 - 1 <= sync["ts"]
    assert boom["name"] == "boom"


def test_counter_events(tmp_path: pathlib.Path) -> None:
    trace = TraceWriter(tmp_path / "trace.json")
    trace.counter("in_flight", "controller", trace.t0 + 0.5, {"samples": 12})
    trace.save()
    events = load_trace(tmp_path / "trace.json")
    (counter,) = [e for e in events if e["ph"] == "C"]
    assert counter["args"] == {"samples": 12} and abs(counter["ts"] - 0.5e6) <= 1.0
    assert any(e["ph"] == "M" and e["args"] == {"name": "controller"} for e in events)


def test_save_is_atomic_and_repeatable(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "sub" / "trace.json"
    with TraceWriter(path) as trace:
        trace.span("a", "c", "p", "t", trace.t0, trace.t0 + 1)
        trace.save()
        assert len([e for e in load_trace(path) if e["ph"] == "X"]) == 1
        trace.span("b", "c", "p", "t", trace.t0 + 1, trace.t0 + 2)
    assert [e["name"] for e in load_trace(path) if e["ph"] == "X"] == ["a", "b"]  # saved on exit
    assert sorted(p.name for p in path.parent.iterdir()) == ["trace.json"]  # no temp files left


def test_thread_safety(tmp_path: pathlib.Path) -> None:
    trace = TraceWriter(tmp_path / "trace.json")

    def work(worker: int) -> None:
        for i in range(200):
            trace.span("s", "c", f"proc-{worker % 3}", f"thread-{worker}", trace.t0 + i, trace.t0 + i + 0.5)
            if i % 50 == 0:
                trace.save()

    threads = [threading.Thread(target=work, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    trace.save()
    events = load_trace(tmp_path / "trace.json")
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 8 * 200
    meta = [e for e in events if e["ph"] == "M"]
    assert sum(e["name"] == "process_name" for e in meta) == 3
    assert sum(e["name"] == "thread_name" for e in meta) == 8
    assert len({(s["pid"], s["tid"]) for s in spans}) == 8
