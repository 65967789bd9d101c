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

Resumed (``resume``, a :class:`RunDirState` from a checkpoint at step v): ``metrics.jsonl`` and
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
import math
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

from loong_core.config import dump_toml
from loong_core.records import EpisodeStatus, Trajectory
from loong_core.telemetry import MetricsWriter, TraceWriter
from loong_train import plugins
from loong_train.config import Recipe
from loong_train.engines.embedded.host import crossed_update
from loong_train.evaluator import EvalResult, Evaluator
from loong_train.pipeline import Pipeline
from loong_train.run.loggers import open_loggers
from loong_train.run.plots import plot_domains, plot_run

__all__ = ["RunDir", "RunDirState"]

log = logging.getLogger("loong.run_dir")


_TRAIN_KEYS = (
    "mismatch_kl",
    "onpolicy_mismatch_kl",
    "mismatch_abs_logp",
    "onpolicy_mismatch_abs_logp",
    "loss",
    "grad_norm",
    "lr",
    # loong_train.algo.losses.policy_loss
    "pg_loss",
    "clip_frac",
    "dual_clip_frac",
    "tis_frac",
    "mis_drop_frac",
    "is_weight_mean",
    "is_weight_min",
    "is_weight_max",
    "kl",
    "kl_loss",
)
_TRAIN_IF_PRESENT = (
    "distill_kl",
    "distill_jsd",
)  # loong_train.algo.losses.distill_loss (dense OPD objectives)
_TRAIN_PREFIXES = ("opd/", "teacher/")  # per-teacher OPD metrics (loong_train.algo.opd), named by teacher


class RunDirState(msgspec.Struct, kw_only=True):
    """The bookkeeping a checkpoint at ``step`` keeps, so a resumed run's metrics continue."""

    step: int
    elapsed_s: float
    trained_samples: int
    trainer_busy: float
    rollout_busy: float
    apply_s: float
    reported_evals: list[int]


class RunDir:
    """Writes config, metrics, ledger, scheduling, trace, summary and plots of one run, from the
    events the controller hands it; eval results are the ``evaluator``'s."""

    def __init__(
        self, path: Path, recipe: Recipe, evaluator: Evaluator, resume: RunDirState | None = None
    ) -> None:
        self.path, self.recipe, self.evaluator, self.resumed = path, recipe, evaluator, resume
        (path / "plots").mkdir(parents=True, exist_ok=True)
        (path / "checkpoints").mkdir(exist_ok=True)
        (path / "config.toml").write_text(dump_toml(recipe))
        self.name = f"{recipe.name}-{os.getpid()}-{int(time.time())}"
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
        self.loggers = open_loggers(recipe.log, path, msgspec.to_builtins(recipe))
        self.reported_evals: set[int] = set()
        self.start = self.last_step_end = time.time()
        self.rollout_busy = self.trainer_busy = 0.0  # rollout: of the run before a resume
        self.worker_busy: dict[tuple[int, int], float] = {}  # (worker, pid) -> busy_s, cumulative
        self.engine_counts: dict[tuple[int, int], dict[str, float]] = {}  # -> engine counters
        self.trained_samples = 0
        self.apply_s = 0.0
        self.batch: dict[str, Any] = {}
        self.batch_ids: dict[str, list[str]] = {}
        self.last: dict[str, Any] = {}
        if resume is not None:
            self.trained_samples, self.apply_s = resume.trained_samples, resume.apply_s
            self.trainer_busy, self.rollout_busy = resume.trainer_busy, resume.rollout_busy
            self.reported_evals = set(resume.reported_evals)

    def begin(self) -> None:
        """Start the clocks (resumed: continue them)."""
        self.start = self.last_step_end = time.time()
        if self.resumed is not None:
            self.start -= self.resumed.elapsed_s

    def state(self, step: int) -> RunDirState:
        """What a checkpoint at ``step`` keeps (see :mod:`loong_train.run.checkpoint`)."""
        return RunDirState(
            step=step,
            elapsed_s=time.time() - self.start,
            trained_samples=self.trained_samples,
            trainer_busy=self.trainer_busy,
            rollout_busy=self._rollout_busy(),
            apply_s=self.apply_s,
            reported_evals=sorted(self.reported_evals),
        )

    def on_rollout(self, result: dict[str, Any]) -> None:
        key = (result["worker"], result["pid"])  # a worker's counters start again in a new process
        self.worker_busy[key] = max(self.worker_busy.get(key, 0.0), result["busy_s"])
        if result["engine"]:
            old = self.engine_counts.get(key)
            self.engine_counts[key] = max(old or result["engine"], result["engine"], key=lambda c: c["steps"])
        for t in result["trajectories"]:  # counted per step in metrics ("failed", "timeouts")
            if t.status in (EpisodeStatus.FAILED, EpisodeStatus.TIMEOUT):
                row = t.info.get("task_id", "?")
                log.warning("episode %s (row %s) %s: %s", t.sample_id, row, t.status, t.info.get("error"))
        self.trace.span(
            "rollout",
            "rollout",
            f"rollout-worker-{result['worker']}",
            "engine",
            result["start"],
            result["end"],
            {"episodes": len(result["trajectories"]), "version": result["version"]},
        )

    def on_batch(self, pipe: Pipeline, trajs: list[Trajectory]) -> None:
        statuses = Counter(t.status for t in trajs)
        ok = [t for t in trajs if t.status.trainable]
        staleness = pipe.window.last_batch_staleness
        self.batch = {
            "reward_mean": sum(t.reward for t in ok) / max(1, len(ok)),
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": max(staleness),
            "staleness_hist": dict(Counter(str(s) for s in staleness)),
            "samples": len(trajs),
            "failed": statuses[EpisodeStatus.FAILED],
            "timeouts": statuses[EpisodeStatus.TIMEOUT],
            "truncated": statuses[EpisodeStatus.TRUNCATED],
            "response_tokens_mean": sum(t.num_model_tokens for t in ok) / max(1, len(ok)),
            "mixed_version_samples": sum(map(crossed_update, trajs)),  # partial rollouts
            **_episode_metrics(ok),
        }
        self.batch_ids = {
            "groups": list(dict.fromkeys(t.group_id for t in trajs)),
            "sample_ids": [t.sample_id for t in trajs],
        }
        if self.recipe.loss.dynamic_sampling:  # the groups dropped since the previous line
            self.batch_ids["dropped"] = pipe.take_dropped()
            self.batch["dropped_groups"] = len(self.batch_ids["dropped"])

    def on_train_step(self, pipe: Pipeline, m: dict[str, Any]) -> None:
        version = pipe.window.version
        now = time.time()
        interval = max(now - self.last_step_end, 1e-9)
        wall = max(now - self.start, 1e-9)
        self.trainer_busy += m["train_end"] - m["train_start"] + m["push_s"]
        self.trained_samples += self.batch["samples"]
        self._trace_sync(pipe, m, version)
        line = {
            "step": version,
            "policy_version": version,
            **self.batch,
            **{k: m.get(k) for k in _TRAIN_KEYS},
            **{k: m[k] for k in _TRAIN_IF_PRESENT if k in m},
            **{k: v for k, v in m.items() if k.startswith(_TRAIN_PREFIXES)},
            "trainer_busy_frac": min(1.0, self.trainer_busy / wall),
            "rollout_busy_frac": min(1.0, self._rollout_busy() / (wall * len(pipe.workers))),
            **self._engine_metrics(wall, len(pipe.workers)),
            "samples_per_s": self.batch["samples"] / interval,
            "trained_samples_per_s": self.trained_samples / wall,
            "push_s": m["push_s"],
            "apply_s": self.apply_s,
            "weight_sync_s": m["push_s"] + self.apply_s,
            "elapsed_s": now - self.start,
            "worker_restarts": pipe.restarts,
            "reissued_groups": pipe.reissued,
            "restarted_episodes": pipe.restarted,
        }
        self.last_step_end = now
        line |= self._unreported_eval()
        self.ledger.write({"step": version, **self.batch_ids})
        self.metrics.write(line)
        for logger in self.loggers:
            logger.log(line)
        self.write_scheduling(pipe)
        self.last = line

    def write_scheduling(self, pipe: Pipeline) -> None:
        """Append the scheduler's journal since the last call to ``scheduler.jsonl``."""
        for entry in pipe.scheduler.journal:
            self.scheduling.write(entry)
        pipe.scheduler.journal.clear()

    def _trace_sync(self, pipe: Pipeline, m: dict[str, Any], version: int) -> None:
        """Train and push spans of this step; apply spans of every engine update that finished."""
        self.trace.span(
            "train_step", "train", "trainer", "train", m["train_start"], m["train_end"], {"version": version}
        )
        self.trace.span(
            "push_weights", "sync", "trainer", "sync", m["push_start"], m["push_end"], {"version": version}
        )
        if "teacher_end" in m:
            self.trace.span(
                "teacher_score", "teacher", "trainer", "train", m["train_start"], m["teacher_end"], {}
            )

    def on_applied(self, a: dict[str, Any]) -> None:
        """An engine finished applying a weight update."""
        self.apply_s = a["apply_s"]
        self.trace.span(
            "apply_weights",
            "sync",
            f"rollout-worker-{a['worker']}",
            "engine",
            a["start"],
            a["end"],
            {"version": a["version"]},
        )

    def _rollout_busy(self) -> float:
        """Worker-seconds with at least one rollout or evaluation call running."""
        return self.rollout_busy + sum(self.worker_busy.values())

    def _engine_metrics(self, wall: float, workers: int) -> dict[str, float]:
        """Embedded engines, since their workers started: the fraction of time a forward runs
        (``engine_busy_frac``) and the mean rows per decode step (``engine_rows_per_step``)."""
        counts = list(self.engine_counts.values())
        if not counts:
            return {}
        steps = sum(c["steps"] for c in counts)
        return {
            "engine_busy_frac": min(1.0, sum(c["busy_s"] for c in counts) / (wall * workers)),
            "engine_rows_per_step": sum(c["rows"] for c in counts) / max(steps, 1),
        }

    def on_eval(self, r: EvalResult) -> None:
        """An evaluation finished (its result is the evaluator's; its worker counts its time)."""
        span = {"version": r.version, "reward": r.reward}
        self.trace.span("eval", "eval", f"rollout-worker-{r.worker}", "engine", r.start, r.end, span)

    def _unreported_eval(self) -> dict[str, Any]:
        """The newest finished evaluation not yet written to metrics (earlier ones go to summary)."""
        e = self.evaluator
        fresh = [v for v in e.results if v not in self.reported_evals]
        if not fresh:
            return {}
        self.reported_evals.update(fresh)
        v = max(fresh)
        by_domain = {f"eval_reward/{d}": x for d, x in e.by_domain[v].items()}
        return {"eval_reward_mean": e.results[v], "eval_policy_version": v, **by_domain}

    def postfix(self) -> dict[str, str]:
        out = {
            "reward": f"{self.last.get('reward_mean', 0):.2f}",
            "stale": str(self.last.get("staleness_max", 0)),
        }
        if results := self.evaluator.results:
            out["eval"] = f"{results[max(results)]:.2f}"
        return out

    def finish(self, pipe: Pipeline) -> None:
        """The run is over (drained, evaluations collected): the summary, the plots, the files closed."""
        self.write_scheduling(pipe)
        evals = dict(sorted(self.evaluator.results.items()))
        summary = {
            "eval_reward_by_version": evals,
            "first_eval": evals[min(evals)] if evals else None,
            "final_eval": evals[max(evals)] if evals else None,
            "steps": pipe.window.version,
            "wall_s": time.time() - self.start,
            "worker_restarts": pipe.restarts,
            "reissued_groups": pipe.reissued,
        }
        if self.evaluator.lost:
            summary["lost_evals"] = sorted(self.evaluator.lost)
        if any(self.evaluator.by_domain.values()):
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
        by_version = self.evaluator.by_domain
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


def _episode_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """``reward/<key>``: the mean of each finite number the episodes carry (a reward's other keys)
    over the episodes that carry it."""
    values: dict[str, list[float]] = {}
    for t in trajs:
        for k, v in t.metrics.items():
            if math.isfinite(v):
                values.setdefault(k, []).append(v)
    return {f"reward/{k}": sum(v) / len(v) for k, v in sorted(values.items())}
