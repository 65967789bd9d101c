"""The run directory (docs/architecture.md, "The run directory") and the per-step measurements
that fill it.

``runs/<name>/``: ``config.toml`` (resolved recipe), ``metrics.jsonl`` (one object per train
step), ``ledger.jsonl`` (per train step: its groups and sample ids, so anyone can check that no
sample was lost or trained twice), ``scheduler.jsonl`` (every call into the
:class:`~loong_train.scheduler.Scheduler`, with its decision, in order: the run's scheduling,
replayable with :func:`loong_train.scheduler.replay`), ``trace.json`` (Perfetto: rollout, eval, train and sync spans
per actor), ``plots/*.png``, ``checkpoints/final`` (Hugging Face format) and ``checkpoints/step_<v>``
(resumable, :mod:`loong_train.run.checkpoint`), ``summary.json``; with ``[log] loggers``, the same
rows in ``tensorboard/`` and ``wandb/`` (:mod:`loong_train.run.loggers`). Task sets with domains add
held-out success per domain (``eval_reward/<domain>``, ``plots/eval_by_domain.png``).

Resumed (``load_state_dict`` of a :class:`RunDirState` from a checkpoint at step v): ``metrics.jsonl`` and
``ledger.jsonl`` keep their lines up to step v (lines of steps after it, written by a run that
died later, are dropped) and go on from there; the previous ``trace.json`` and
``scheduler.jsonl`` are kept as ``trace.1.json`` and ``scheduler.1.jsonl`` (``.2``, ... on later
resumes); counters and clocks continue. Which versions are evaluated, and what happens to an
evaluation that was lost or unfinished at a checkpoint: :mod:`loong_train.evaluator`.

Busy fractions are cumulative: busy seconds of the trainer (or the mean rollout worker) over
the wall time since the run started, so they read as the run's utilization so far.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import msgspec

from loong_core.config import dump_toml
from loong_core.records import EpisodeStatus, Trajectory
from loong_core.telemetry import MetricsWriter, TraceWriter
from loong_train import plugins
from loong_train.config import Recipe
from loong_train.messages import (
    ApplyResult,
    DrawReport,
    EngineCounts,
    EvalResult,
    FaultCounters,
    Published,
    RolloutResult,
)
from loong_train.run.loggers import open_loggers
from loong_train.run.plots import plot_domains, plot_run
from loong_train.run.rows import batch_row, engine_row, train_row

__all__ = ["RunDir", "RunDirState"]

log = logging.getLogger("loong.run_dir")


class RunDirState(msgspec.Struct, kw_only=True):
    """The bookkeeping a checkpoint at ``step`` keeps, so a resumed run's metrics continue; the
    evaluations' results so far (``evals``: mean reward by version; ``evals_by_domain``)."""

    step: int
    elapsed_s: float
    trained_samples: int
    trainer_busy: float
    rollout_busy: float
    apply_s: float
    reported_evals: list[int]
    evals: dict[int, float]
    evals_by_domain: dict[int, dict[str, float]]


class RunDir:
    """Writes config, metrics, ledger, scheduling, trace, summary and plots of one run of
    ``workers`` rollout workers, from the events and counters the controller hands it.

    Lifecycle: ``load_state_dict`` when resumed, ``begin()`` (the files are prepared and the
    clocks start), the ``on_*`` events, ``finish``; ``close()`` also when the run failed.
    """

    def __init__(self, path: Path, recipe: Recipe, workers: int) -> None:
        self.path, self.recipe, self.workers = path, recipe, workers
        self.resumed: RunDirState | None = None
        (path / "plots").mkdir(parents=True, exist_ok=True)
        (path / "checkpoints").mkdir(exist_ok=True)
        (path / "config.toml").write_text(dump_toml(recipe))
        self.name = f"{recipe.name}-{os.getpid()}-{int(time.time())}"
        self.reported_evals: set[int] = set()
        self.evals: dict[int, float] = {}  # mean held-out reward by version
        self.evals_by_domain: dict[int, dict[str, float]] = {}
        self.eval_ends: dict[int, float] = {}  # version -> when its evaluation finished (time.time())
        self.start = self.last_step_end = time.time()
        self.rollout_busy = self.trainer_busy = 0.0  # rollout: of the run before a resume
        self.worker_busy: dict[tuple[int, int], float] = {}  # (worker, pid) -> busy_s, cumulative
        self.engine_counts: dict[tuple[int, int], EngineCounts] = {}  # -> engine counters
        self.trained_samples = 0
        self.apply_s = 0.0
        self.step = 0
        self.batch: dict[str, Any] = {}
        self.batch_ids: dict[str, list[str]] = {}
        self.last: dict[str, Any] = {}
        self._open = False

    def state_dict(self) -> RunDirState:
        """What a checkpoint at the last step keeps (see :mod:`loong_train.run.checkpoint`)."""
        return RunDirState(
            step=self.step,
            elapsed_s=time.time() - self.start,
            trained_samples=self.trained_samples,
            trainer_busy=self.trainer_busy,
            rollout_busy=self._rollout_busy(),
            apply_s=self.apply_s,
            reported_evals=sorted(self.reported_evals),
            evals=dict(self.evals),
            evals_by_domain=dict(self.evals_by_domain),
        )

    def load_state_dict(self, state: Any) -> None:
        """Continue from ``state_dict()`` (before ``begin``)."""
        resume = self.resumed = msgspec.convert(state, RunDirState)
        self.step, self.trained_samples, self.apply_s = resume.step, resume.trained_samples, resume.apply_s
        self.trainer_busy, self.rollout_busy = resume.trainer_busy, resume.rollout_busy
        self.reported_evals = set(resume.reported_evals)
        self.evals, self.evals_by_domain = dict(resume.evals), dict(resume.evals_by_domain)

    def begin(self) -> None:
        """Prepare the files (resumed: keep what the checkpoint's step wrote, see the module
        docstring) and start the clocks (resumed: continue them)."""
        path, resume = self.path, self.resumed
        for name in ("metrics.jsonl", "ledger.jsonl"):
            if resume is None:
                (path / name).unlink(missing_ok=True)  # a new run starts new logs
            else:
                _keep_until(path / name, resume.step)
        if resume is None:
            (path / "scheduler.jsonl").unlink(missing_ok=True)
        for stem, suffix in (("trace", ".json"), ("scheduler", ".jsonl")):
            if resume is not None and (path / f"{stem}{suffix}").exists():
                parts = 1 + sum(1 for _ in path.glob(f"{stem}.*{suffix}"))
                (path / f"{stem}{suffix}").rename(path / f"{stem}.{parts}{suffix}")
        self.metrics = MetricsWriter(path / "metrics.jsonl")
        self.scheduling = MetricsWriter(path / "scheduler.jsonl")
        self.ledger = MetricsWriter(path / "ledger.jsonl")
        self.trace = TraceWriter(path / "trace.json")
        self.loggers = open_loggers(self.recipe.log, path, msgspec.to_builtins(self.recipe))
        self._open = True
        self.start = self.last_step_end = time.time()
        if resume is not None:
            self.start -= resume.elapsed_s

    def on_rollout(self, result: RolloutResult) -> None:
        key = (result.worker, result.pid)  # a worker's counters start again in a new process
        self.worker_busy[key] = max(self.worker_busy.get(key, 0.0), result.busy_s)
        if (engine := result.engine) is not None:
            old = self.engine_counts.get(key)
            self.engine_counts[key] = max(old or engine, engine, key=lambda c: c.steps)
        for t in result.trajectories:  # counted per step in metrics ("failed", "timeouts")
            if t.status in (EpisodeStatus.FAILED, EpisodeStatus.TIMEOUT):
                row = t.info.get("task_id", "?")
                log.warning("episode %s (row %s) %s: %s", t.sample_id, row, t.status, t.info.get("error"))
        self.trace.span(
            "rollout",
            "rollout",
            f"rollout-worker-{result.worker}",
            "engine",
            result.start,
            result.end,
            {"episodes": len(result.trajectories), "version": result.version},
        )

    def on_batch(self, trajs: list[Trajectory], staleness: list[int], draw: DrawReport) -> None:
        """A batch was taken: its trajectories, each one's staleness, and where generation went
        since the previous batch (``no_signal_share``: the share of generated tokens in groups
        with nothing to learn; the groups dynamic sampling dropped; the curriculum's counts)."""
        self.batch = batch_row(trajs, staleness)
        self.batch_ids = {
            "groups": list(dict.fromkeys(t.group_id for t in trajs)),
            "sample_ids": [t.sample_id for t in trajs],
        }
        self.batch["no_signal_share"] = draw.no_signal_tokens / max(draw.generated_tokens, 1)
        if self.recipe.loss.dynamic_sampling:  # the groups dropped since the previous line
            self.batch_ids["dropped"] = draw.dropped
            self.batch["dropped_groups"] = len(draw.dropped)
        self.batch |= draw.curriculum

    def on_train_step(self, version: int, p: Published, counters: FaultCounters) -> None:
        """Step ``version`` was published: its metrics line, ledger line and trace spans."""
        m, step = p.step.metrics, p.step
        now = time.time()
        interval = max(now - self.last_step_end, 1e-9)
        wall = max(now - self.start, 1e-9)
        self.trainer_busy += step.end - step.start + p.push_s
        self.trained_samples += self.batch["samples"]
        self.step = version
        self._trace_sync(p, version)
        line = {
            "step": version,
            "policy_version": version,
            **self.batch,
            **train_row(m),
            "trainer_busy_frac": min(1.0, self.trainer_busy / wall),
            "rollout_busy_frac": min(1.0, self._rollout_busy() / (wall * self.workers)),
            **engine_row(list(self.engine_counts.values()), wall, self.workers),
            "samples_per_s": self.batch["samples"] / interval,
            "trained_samples_per_s": self.trained_samples / wall,
            "push_s": p.push_s,
            "apply_s": self.apply_s,
            "weight_sync_s": p.push_s + self.apply_s,
            "elapsed_s": now - self.start,
            **msgspec.structs.asdict(counters),
        }
        self.last_step_end = now
        line |= self._unreported_eval()
        self.ledger.write({"step": version, **self.batch_ids})
        self.metrics.write(line)
        for logger in self.loggers:
            logger.log(line)
        self.last = line

    def on_scheduling(self, journal: list[dict[str, Any]]) -> None:
        """Append scheduler journal entries to ``scheduler.jsonl``."""
        for entry in journal:
            self.scheduling.write(entry)

    def _trace_sync(self, p: Published, version: int) -> None:
        """Train and push spans of this step (and the teachers' scoring, with OPD)."""
        step = p.step
        self.trace.span("train_step", "train", "trainer", "train", step.start, step.end, {"version": version})
        self.trace.span(
            "push_weights", "sync", "trainer", "sync", p.push_start, p.push_end, {"version": version}
        )
        if step.teacher_end is not None:
            self.trace.span("teacher_score", "teacher", "trainer", "train", step.start, step.teacher_end, {})

    def on_applied(self, a: ApplyResult) -> None:
        """An engine finished applying a weight update."""
        self.apply_s = a.apply_s
        self.trace.span(
            "apply_weights",
            "sync",
            f"rollout-worker-{a.worker}",
            "engine",
            a.start,
            a.end,
            {"version": a.version},
        )

    def _rollout_busy(self) -> float:
        """Worker-seconds with at least one rollout or evaluation call running."""
        return self.rollout_busy + sum(self.worker_busy.values())

    def on_eval(self, r: EvalResult) -> None:
        """An evaluation finished: its result is kept for the metrics and the summary (its worker
        counts its time)."""
        self.evals[r.version], self.evals_by_domain[r.version] = r.reward, r.by_domain
        self.eval_ends[r.version] = r.end
        span = {"version": r.version, "reward": r.reward}
        self.trace.span("eval", "eval", f"rollout-worker-{r.worker}", "engine", r.start, r.end, span)

    def _unreported_eval(self) -> dict[str, Any]:
        """The newest finished evaluation not yet written to metrics (earlier ones go to summary)."""
        fresh = [v for v in self.evals if v not in self.reported_evals]
        if not fresh:
            return {}
        self.reported_evals.update(fresh)
        v = max(fresh)
        by_domain = {f"eval_reward/{d}": x for d, x in self.evals_by_domain[v].items()}
        row = {"eval_reward_mean": self.evals[v], "eval_policy_version": v, **by_domain}
        if v in self.eval_ends:  # not for one finished before the checkpoint this run resumed from
            row["eval_elapsed_s"] = self.eval_ends[v] - self.start
        return row

    def postfix(self) -> dict[str, str]:
        out = {
            "reward": f"{self.last.get('reward_mean', 0):.2f}",
            "stale": str(self.last.get("staleness_max", 0)),
        }
        if self.evals:
            out["eval"] = f"{self.evals[max(self.evals)]:.2f}"
        return out

    def finish(
        self, steps: int, counters: FaultCounters, lost_evals: set[int], stopped: str | None = None
    ) -> None:
        """The run is over (drained, evaluations collected) after ``steps`` (``stopped``: why it
        ended before its last step): the summary, the plots, the files closed."""
        evals = dict(sorted(self.evals.items()))
        summary = {
            "eval_reward_by_version": evals,
            "first_eval": evals[min(evals)] if evals else None,
            "final_eval": evals[max(evals)] if evals else None,
            "steps": steps,
            "wall_s": time.time() - self.start,
            "started_at": self.start,
            "worker_restarts": counters.worker_restarts,
            "reissued_groups": counters.reissued_groups,
        }
        if lost_evals:
            summary["lost_evals"] = sorted(lost_evals)
        if stopped:
            summary["stopped"] = stopped
        if any(self.evals_by_domain.values()):
            summary |= self._domain_summary()
        (self.path / "summary.json").write_text(json.dumps(summary, indent=2))
        self.close()
        plot_run(self.path, evals)
        if "eval_reward_by_domain" in summary:
            baseline = Path(self.recipe.opd.baseline_run) if self.recipe.opd.enabled else None
            plot_domains(self.path, summary, baseline)

    def _domain_summary(self) -> dict[str, Any]:
        """Per-domain eval success by version, the run's label, and (OPD recipes) each domain's
        teacher with its held-out success on that domain."""
        by_version = self.evals_by_domain
        domains = sorted({d for by in by_version.values() for d in by})
        o = self.recipe.opd
        routes = {tag: t.name for t in (o.teachers.teachers if o.teachers else []) for tag in t.tags}
        levels = plugins.teacher_builder().held_out_success(self.recipe) if o.build else {}
        return {
            "label": "on-policy distillation" if o.enabled else "RL only (task reward)",
            "eval_reward_by_domain": {
                d: {v: by[d] for v, by in sorted(by_version.items()) if d in by} for d in domains
            },
            "teacher_by_domain": {
                d: {"teacher": routes[d], "held_out_success": levels[routes[d]][d]}
                for d in domains
                if d in routes and d in levels.get(routes[d], {})
            },
        }

    def close(self) -> None:
        """Flush the metrics and trace files (idempotent; also runs when a run fails)."""
        if not self._open:
            return
        self.metrics.close()
        self.ledger.close()
        self.scheduling.close()
        self.trace.save()
        for logger in self.loggers:
            logger.close()
        self.loggers = []


def _keep_until(path: Path, step: int) -> None:
    """Drop the lines of ``path`` (JSON lines with a ``step``) after ``step``, and a torn last line."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line + "\n")
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(keep))
    tmp.replace(path)
