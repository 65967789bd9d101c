"""What crosses a Ray hop, as typed records (docs/architecture.md, "Records").

Each record's docstring names its hop (sender -> receiver). The pipeline turns finished calls
into events (:class:`RolloutDone`, :class:`ApplyResult`, :class:`Published`) and the controller
matches on their type; :class:`EvalResult` and :class:`FaultCounters` are what the run directory
is handed instead of the objects that hold them.
"""

from __future__ import annotations

import msgspec

from loong_core.records import Trajectory, WeightManifest

__all__ = [
    "ApplyResult",
    "EngineCounts",
    "EvalResult",
    "FaultCounters",
    "Published",
    "RolloutDone",
    "RolloutResult",
    "StepResult",
]


class EngineCounts(msgspec.Struct, frozen=True):
    """An embedded engine's work since its worker started: decode steps, rows over those steps,
    seconds with a forward running."""

    steps: int
    rows: int
    busy_s: float


class RolloutResult(msgspec.Struct, kw_only=True):
    """Rollout worker -> controller: the episodes of one ``RolloutWorker.rollout`` call (black-box:
    every row of each episode), the call's wall-clock span and the version the engine ended at.
    Since the worker's process started: ``busy_s`` (seconds with at least one call running) and
    the engine's counters (``None`` for a server)."""

    trajectories: list[Trajectory]
    start: float
    end: float
    version: int
    worker: int
    pid: int
    busy_s: float
    engine: EngineCounts | None = None


class ApplyResult(msgspec.Struct, frozen=True, kw_only=True):
    """Rollout worker -> controller: a weight update the worker applied (or skipped, holding that
    version already); ``restarted``: episodes the update restarted (``partial = "restart"``)."""

    version: int
    worker: int
    pid: int
    start: float
    end: float
    restarted: int = 0

    @property
    def apply_s(self) -> float:
        return self.end - self.start


class StepResult(msgspec.Struct, frozen=True, kw_only=True):
    """Trainer -> trainer (``train_step``'s result, handed to ``publish`` as a Ray dependency):
    the backend's and the teachers' metrics of one optimizer step, and its span. ``teacher_end``:
    when on-policy distillation finished scoring the batch."""

    metrics: dict[str, float]
    start: float
    end: float
    teacher_end: float | None = None


class Published(msgspec.Struct, frozen=True, kw_only=True):
    """Trainer -> controller: a step's weights pushed as ``manifest.version``."""

    step: StepResult
    manifest: WeightManifest
    push_start: float
    push_end: float

    @property
    def push_s(self) -> float:
        return self.push_end - self.push_start


class RolloutDone(msgspec.Struct, frozen=True):
    """Pipeline -> controller: a rollout call of these groups finished."""

    groups: list[str]
    result: RolloutResult


class EvalResult(msgspec.Struct, frozen=True, kw_only=True):
    """Evaluator -> run directory: one finished evaluation: mean reward over the held-out items,
    per ``domain`` tag (empty when no item carries one), and the rollout call's worker and span."""

    version: int
    reward: float
    by_domain: dict[str, float]
    worker: int
    start: float
    end: float


class DrawReport(msgspec.Struct, frozen=True, kw_only=True):
    """Pipeline -> run directory, with each batch: where generation went since the previous one.
    ``dropped``: the groups dynamic sampling dropped; ``generated_tokens``: model tokens of every
    group that came back; ``no_signal_tokens``: those of the groups whose samples all scored the
    same (nothing to learn, trained or not); ``curriculum``: the prompt curriculum's counts
    (:meth:`loong_train.curriculum.Curriculum.counts`; empty without one)."""

    dropped: list[str] = []
    generated_tokens: int = 0
    no_signal_tokens: int = 0
    curriculum: dict[str, int] = {}


class FaultCounters(msgspec.Struct, frozen=True, kw_only=True):
    """Pipeline -> run directory: what faults cost so far. ``worker_restarts``: worker processes
    Ray restarted; ``reissued_groups``: groups whose generation was lost and issued again;
    ``restarted_episodes``: episodes a weight update restarted."""

    worker_restarts: int = 0
    reissued_groups: int = 0
    restarted_episodes: int = 0
