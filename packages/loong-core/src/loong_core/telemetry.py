"""Run-directory writers: ``metrics.jsonl`` (one JSON object per train step) and ``trace.json``.

``MetricsWriter`` appends a line per step and flushes it at once, so a crashed or killed run keeps every
step it finished and ``--resume`` can keep appending to the same file. ``read_metrics`` is its inverse.

``TraceWriter`` collects Chrome trace events (the JSON format that Perfetto and ``chrome://tracing`` open):
one complete event (``"ph": "X"``) per span, and ``"ph": "M"`` metadata events that name each process and
thread. Spans come from many processes (rollout workers, the trainer, weight sync), so callers pass
*absolute* wall-clock seconds from ``time.time()``; the writer stores ``ts``/``dur`` in microseconds
relative to its own creation time ``t0``. Processes and threads are named by strings (``"rollout-0"``,
``"engine"``) and get stable small integer ids in order of first use. Writers are thread-safe.

Lifecycle: create once per run, call ``span``/``timed``/``counter`` from any thread, call ``save()``
whenever a consistent file is wanted (it rewrites ``trace.json`` atomically with all events so far).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import threading
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Any, Self

__all__ = ["MetricsWriter", "TraceWriter", "read_metrics"]


class MetricsWriter:
    """Append one JSON object per line to ``path`` (``metrics.jsonl``), flushing every write.

    Values must be JSON-serialisable; scalars with an ``.item()`` method (numpy, torch) are converted.
    Non-finite floats are written as ``NaN``/``Infinity``, which :func:`read_metrics` reads back.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, step_metrics: dict[str, Any]) -> None:
        line = json.dumps(step_metrics, default=_scalar) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _scalar(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"metric value of type {type(value).__name__} is not JSON serialisable")


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl`` file, in order.

    A last line without its newline is the trace of a process killed mid-write and is dropped if it
    does not parse; any other bad line raises ``json.JSONDecodeError``.
    """
    text = pathlib.Path(path).read_text(encoding="utf-8")
    lines = text.split("\n")
    records = [json.loads(line) for line in lines[:-1] if line.strip()]
    if lines[-1].strip():
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(lines[-1]))
    return records


class TraceWriter:
    """Collect Chrome/Perfetto trace events and save them as ``{"traceEvents": [...]}``.

    Times given to :meth:`span` and :meth:`counter` are absolute ``time.time()`` seconds; they are stored
    as microseconds since ``self.t0`` (the writer's creation time).

    Example::

        trace = TraceWriter(run_dir / "trace.json")
        with trace.timed("train_step", "train", "trainer", "rank0") as args:
            args["tokens"] = n_tokens
        trace.span("generate", "rollout", "rollout-0", "engine", t_start, t_end, {"version": 3})
        trace.save()
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = pathlib.Path(path)
        self.t0 = time.time()
        self._events: list[dict[str, Any]] = []
        self._pids: dict[str, int] = {}
        self._tids: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def span(
        self,
        name: str,
        cat: str,
        pid_name: str,
        tid_name: str,
        start_s: float,
        end_s: float,
        args: dict[str, Any] | None = None,
    ) -> None:
        """Record a complete event from ``start_s`` to ``end_s`` (absolute ``time.time()`` seconds)."""
        event: dict[str, Any] = {"name": name, "cat": cat, "ph": "X", "ts": self._us(start_s)}
        event["dur"] = round((end_s - start_s) * 1e6, 3)
        if args:
            event["args"] = dict(args)
        with self._lock:
            event["pid"], event["tid"] = self._ids(pid_name, tid_name)
            self._events.append(event)

    @contextlib.contextmanager
    def timed(self, name: str, cat: str, pid_name: str, tid_name: str) -> Iterator[dict[str, Any]]:
        """Record the ``with`` block as a span; the yielded dict becomes the span's ``args``.

        The span is recorded even if the block raises, so failed steps still show up in the trace.
        """
        args: dict[str, Any] = {}
        start = time.time()
        try:
            yield args
        finally:
            self.span(name, cat, pid_name, tid_name, start, time.time(), args)

    def counter(self, name: str, pid_name: str, t_s: float, values: dict[str, float]) -> None:
        """Record a counter sample (``"ph": "C"``), drawn as a track: e.g. in-flight samples, staleness."""
        event = {"name": name, "ph": "C", "ts": self._us(t_s), "args": values}
        with self._lock:
            event["pid"] = self._pid(pid_name)
            self._events.append(event)

    def save(self) -> None:
        """Atomically write all events recorded so far to ``self.path``."""
        with self._lock:
            payload = {"traceEvents": list(self._events), "displayTimeUnit": "ms"}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(payload), encoding="utf-8")
        os.replace(tmp, self.path)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.save()

    def _us(self, t_s: float) -> float:
        return round((t_s - self.t0) * 1e6, 3)

    def _ids(self, pid_name: str, tid_name: str) -> tuple[int, int]:
        """(pid, tid) for the names, emitting metadata events the first time. Caller holds the lock."""
        pid = self._pid(pid_name)
        tid = self._tids.get((pid_name, tid_name))
        if tid is None:
            tid = self._tids[(pid_name, tid_name)] = len(self._tids) + 1
            self._events.append(_metadata("thread_name", pid, tid, {"name": tid_name}))
            self._events.append(_metadata("thread_sort_index", pid, tid, {"sort_index": tid}))
        return pid, tid

    def _pid(self, pid_name: str) -> int:
        pid = self._pids.get(pid_name)
        if pid is None:
            pid = self._pids[pid_name] = len(self._pids) + 1
            self._events.append(_metadata("process_name", pid, 0, {"name": pid_name}))
            self._events.append(_metadata("process_sort_index", pid, 0, {"sort_index": pid}))
        return pid


def _metadata(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}
