"""Resumable checkpoints: ``loong-train run RECIPE --resume DIR`` continues where one stopped.

``DIR/checkpoints/step_<v>/`` is written every ``train.checkpoint_every`` steps and after the last
one, right after step v's weights were published:

- ``config.json``, ``model.safetensors`` and the tokenizer files: the policy at version v in
  Hugging Face format; a resumed run's rollout workers load it as their model, at version v;
- the train backend's state (``TrainBackend.save_state``: ``optimizer.pt`` for torch, one
  ``optimizer.tp<r>.pp<s>.pt`` per model-parallel rank for Megatron) and ``trainer_state.pt``
  (torch RNG, the sender's version; :meth:`TrainerWorker.save_checkpoint`);
- ``controller_state.msgpack`` (:class:`ControllerState`): the recipe and the ``state_dict()``
  of every component the controller owns, by name (the controller's ``_components``): the data
  source (tasks drawn; the prompts of groups issued but not trained), the scheduler (the window),
  the pipeline (finished trajectories not yet trained, fault counters), the evaluator (lost and
  pending evaluations) and the run directory (its bookkeeping and the evaluations' results,
  :class:`~loong_train.run.writer.RunDirState`). This module only gathers and restores them.

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

import logging
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec

from loong_core.config import ConfigError
from loong_train.config import Recipe, TrainConfig

__all__ = ["RESUMABLE", "Checkpoint", "ControllerState", "Stateful", "due", "latest", "restore", "save"]

log = logging.getLogger("loong.checkpoint")

STATE = "controller_state.msgpack"

RESUMABLE = (
    "train.steps",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "eval.every",
    "threads",
    "train.borrow_idle_threads",
    "ray_address",
    "rollout.workers",
    "rollout.max_restarts",
    "rollout.episode_timeout_s",
    "agent.max_concurrency",
    "transport.",
)
"""Recipe keys (or prefixes) a resumed run may change; any other difference is refused. Exact
continuation also needs the same ``rollout.workers`` and ``threads``."""


class Stateful(Protocol):
    """A component whose state a checkpoint keeps: ``state_dict()`` returns what msgpack encodes
    (builtins and msgspec records); ``load_state_dict`` takes it back decoded as builtins."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class ControllerState(msgspec.Struct, kw_only=True):
    """``controller_state.msgpack``: everything of a checkpoint that the controller owns."""

    version: int
    recipe: dict[str, Any]  # msgspec.to_builtins of the Recipe
    states: dict[str, Any]  # each component's state_dict(), by name


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    state: ControllerState

    @property
    def version(self) -> int:
        return self.state.version


def due(train: TrainConfig, version: int) -> bool:
    """A checkpoint is written when ``train.checkpoint_every`` divides the version, and after the
    last step."""
    return version == train.steps or bool(train.checkpoint_every and version % train.checkpoint_every == 0)


def save(
    run_path: Path,
    version: int,
    recipe: Recipe,
    components: Mapping[str, Stateful],
    write_trainer: Callable[[Path], None],
    protect: int | None = None,
) -> Path:
    """Write ``checkpoints/step_<version>`` atomically: the trainer's files (``write_trainer``, the
    trainer being idle between steps) and the components' states; keep the newest
    ``train.keep_checkpoints`` and ``protect`` (the one the run resumed from)."""
    root = run_path / "checkpoints"
    tmp, final = root / f".step_{version}.tmp", root / f"step_{version}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_trainer(tmp)
    state = ControllerState(
        version=version,
        recipe=msgspec.to_builtins(recipe),
        states={name: c.state_dict() for name, c in components.items()},
    )
    (tmp / STATE).write_bytes(msgspec.msgpack.encode(state))
    shutil.rmtree(final, ignore_errors=True)  # from a run that died after writing it
    tmp.rename(final)
    for old_v, old in _checkpoints(run_path)[: -recipe.train.keep_checkpoints]:
        if old_v != protect:
            shutil.rmtree(old)
    log.info("checkpoint of step %d written to %s", version, final)
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


def restore(components: Mapping[str, Stateful], ckpt: Checkpoint) -> None:
    """Put each component's state from ``ckpt`` back (freshly made components; the trainer and
    the engines load theirs when created, see the controller)."""
    states = ckpt.state.states
    if missing := sorted(components.keys() - states.keys()):
        raise ConfigError(f"--resume: {ckpt.path / STATE} holds no state of {', '.join(missing)}")
    for name, c in components.items():
        c.load_state_dict(states[name])


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
