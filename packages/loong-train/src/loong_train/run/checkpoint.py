"""Resumable checkpoints: ``loong-train run RECIPE --resume DIR`` continues where one stopped.

``DIR/checkpoints/step_<v>/`` is written every ``train.checkpoint_every`` steps and after the last
one, right after step v's weights were published:

- ``config.json``, ``model.safetensors`` and the tokenizer files: the policy at version v in
  Hugging Face format; a resumed run's rollout workers load it as their model, at version v;
- the train backend's state (``TrainBackend.save_state``: ``optimizer.pt`` for torch, one
  ``optimizer.tp<r>.pp<s>.pt`` per model-parallel rank for Megatron) and ``trainer_state.pt``
  (torch RNG, the sender's version; :meth:`TrainerWorker.save_checkpoint`);
- ``controller_state.msgpack`` (:class:`ControllerState`): the recipe, the window
  (``StalenessWindow.state_dict``), the data position (tasks drawn; the prompts of groups issued
  but not trained), the finished trajectories not yet trained, the fault counters and the run
  directory's bookkeeping (:class:`~loong_train.run.writer.RunDirState`) and the evaluations'
  (:class:`~loong_train.evaluator.EvaluatorState`: results, lost and pending ones).

It is written into ``.step_<v>.tmp`` and renamed when complete, so a crash while writing leaves
the previous checkpoint whole. The newest ``train.keep_checkpoints`` are kept, and so is the one
the running process resumed from (a restarted rollout worker reloads it).

Resuming takes the newest checkpoint. Groups in flight at the checkpoint are issued again (same
ids, prompts and seeds), buffered ones keep their trajectories; the version, the trainer's next
push and the window continue, so the staleness bound holds across the resume. The recipe given
with ``--resume`` (overrides included) is the one the run continues with, and may differ from the
checkpoint's only in :data:`RESUMABLE` keys (``--set train.steps=N`` extends a run).

Exactness. White-box episodes sample with seeds derived from the run seed and the sample id
(:func:`loong_train.pipeline.episode_seed`), never from an engine's request counter, so a resumed
run samples what an uninterrupted one would from the same weights. With ``max_staleness = 0``
nothing is in flight at a checkpoint and, with the same worker count, the engines batch the
same calls: the metrics after the resume equal the uninterrupted run's. With
``max_staleness >= 1`` the groups in flight are regenerated at version v instead of the version
they started at, so later steps differ (still within the bound). Black-box agents sample from
the engines' request counters, which start again at 0: same distribution, other tokens.
"""

from __future__ import annotations

import itertools
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import ray

from loong_core.config import ConfigError
from loong_core.records import Trajectory
from loong_train.config import Recipe
from loong_train.evaluator import Evaluator, EvaluatorState
from loong_train.models.tokenizer import copy_model_files
from loong_train.pipeline import Pipeline
from loong_train.run.writer import RunDir, RunDirState
from loong_train.scheduler import Scheduler

__all__ = ["RESUMABLE", "Checkpoint", "ControllerState", "latest", "maybe_save", "restore"]

log = logging.getLogger("loong.checkpoint")

STATE = "controller_state.msgpack"

RESUMABLE = (
    "train.steps",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "eval.every",
    "threads",
    "ray_address",
    "rollout.workers",
    "rollout.max_restarts",
    "rollout.episode_timeout_s",
    "agent.max_concurrency",
    "transport.",
)
"""Recipe keys (or prefixes) a resumed run may change; any other difference is refused. Exact
continuation also needs the same ``rollout.workers`` and ``threads``."""


class ControllerState(msgspec.Struct, kw_only=True):
    """``controller_state.msgpack``: everything of a checkpoint that the controller owns."""

    version: int
    recipe: dict[str, Any]  # msgspec.to_builtins of the Recipe
    window: dict[str, Any]
    tasks_drawn: int
    issued: dict[str, dict[str, Any]]
    finished: dict[str, list[Trajectory]]
    restarts: int
    reissued: int
    run_dir: RunDirState
    evaluator: EvaluatorState


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    state: ControllerState

    @property
    def version(self) -> int:
        return self.state.version


def maybe_save(pipe: Pipeline, run_dir: RunDir, evaluator: Evaluator) -> Path | None:
    """Checkpoint after a train step when ``train.checkpoint_every`` divides the version, and
    after the last step."""
    t, v = pipe.recipe.train, pipe.window.version
    if not (v == t.steps or (t.checkpoint_every and v % t.checkpoint_every == 0)):
        return None
    return save(pipe, run_dir, evaluator)


def save(pipe: Pipeline, run_dir: RunDir, evaluator: Evaluator) -> Path:
    """Write ``checkpoints/step_<v>`` atomically (the trainer is idle: no step was started yet)."""
    v, root = pipe.window.version, run_dir.path / "checkpoints"
    tmp, final = root / f".step_{v}.tmp", root / f"step_{v}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    ray.get(pipe.trainer.save_checkpoint.remote(str(tmp)))
    copy_model_files(pipe.model_path, tmp)  # the tokenizer, so the directory loads as a model
    state = ControllerState(
        version=v,
        recipe=msgspec.to_builtins(pipe.recipe),
        window=pipe.window.state_dict(),
        tasks_drawn=pipe.source.count,
        issued=dict(pipe.source.issued),
        finished=dict(pipe.finished),
        restarts=pipe.restarts,
        reissued=pipe.reissued,
        run_dir=run_dir.state(v),
        evaluator=evaluator.state(),
    )
    (tmp / STATE).write_bytes(msgspec.msgpack.encode(state))
    shutil.rmtree(final, ignore_errors=True)  # from a run that died after writing it
    tmp.rename(final)
    protect = {run_dir.resumed.step} if run_dir.resumed else set()
    for old_v, old in _checkpoints(run_dir.path)[: -pipe.recipe.train.keep_checkpoints]:
        if old_v not in protect:
            shutil.rmtree(old)
    log.info("checkpoint of step %d written to %s", v, final)
    return final


def latest(run_path: Path, recipe: Recipe) -> Checkpoint:
    """The newest checkpoint of run directory ``run_path``, checked against ``recipe``."""
    found = _checkpoints(run_path)
    if not found:
        raise ConfigError(
            f"--resume {run_path}: no checkpoint in {run_path / 'checkpoints'} (one is written every "
            "train.checkpoint_every steps and after the last step)"
        )
    path = found[-1][1]
    try:
        state = msgspec.msgpack.decode((path / STATE).read_bytes(), type=ControllerState)
    except msgspec.ValidationError as e:
        raise ConfigError(
            f"--resume {run_path}: {path / STATE} is not a checkpoint this version of Loong reads ({e}); "
            "start a new run"
        ) from e
    old, new = _flat(state.recipe), _flat(msgspec.to_builtins(recipe))
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    refused = [k for k in changed if not k.startswith(RESUMABLE)]
    if refused:
        raise ConfigError(
            f"--resume {run_path}: the recipe differs from the checkpoint's in {', '.join(refused)}; "
            f"a resumed run may change only {', '.join(RESUMABLE)}"
        )
    if recipe.train.steps <= state.version:
        raise ConfigError(
            f"--resume {run_path}: the checkpoint is at step {state.version} and train.steps = "
            f"{recipe.train.steps}: nothing to train (extend it with --set train.steps=N)"
        )
    return Checkpoint(path, state)


def restore(pipe: Pipeline, ckpt: Checkpoint) -> None:
    """Put the controller's side of ``ckpt`` into a freshly started pipeline: the window, the data
    position (the task stream advanced past the tasks drawn), the finished trajectories and the
    counters. (The trainer and the engines load theirs when created, see the controller.)"""
    s = ckpt.state
    state = {"window": s.window, "queued_version": s.version}
    pipe.scheduler = Scheduler.from_state(state, steps=pipe.recipe.train.steps)
    pipe.source.count, pipe.source.issued = s.tasks_drawn, dict(s.issued)
    next(itertools.islice(pipe.source.tasks, s.tasks_drawn, s.tasks_drawn), None)  # skip them
    pipe.finished = dict(s.finished)
    pipe.restarts, pipe.reissued = s.restarts, s.reissued
    log.info(
        "resumed from %s: step %d, %d groups to issue again", ckpt.path, s.version, len(pipe.window.reissue)
    )


def _checkpoints(run_path: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run directory, oldest first."""
    found = []
    for p in (run_path / "checkpoints").glob("step_*"):
        v = p.name.removeprefix("step_")
        if v.isdigit() and (p / STATE).exists():
            found.append((int(v), p))
    return sorted(found)


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out
