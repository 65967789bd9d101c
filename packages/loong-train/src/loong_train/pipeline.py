"""Dispatch: the scheduler's commands placed on workers as Ray calls, their results as events.

What may run is the :class:`~loong_train.scheduler.Scheduler`'s decision; how updates meet
rollout calls is the run's :mod:`~loong_train.weight_sync` strategy; worker health is the
:class:`~loong_train.workers.pool.WorkerPool`'s; what happens to trajectories between a rollout
and a train step is :mod:`~loong_train.batching`. This module connects them.

Faults. A trainer that died (its process or its node), or one of whose ranks did, stops the run
with :class:`TrainerLost`, naming the node; ``--resume`` continues from the newest checkpoint.
For a rollout call whose worker died the pipeline aborts the call's groups in the window, so
they wait in ``window.reissue`` and ``admit`` issues them again: same group ids, same prompts
(``GroupSource.issued`` keeps them until trained), same sampling seeds. A failed weight apply
is dropped. Either way the worker is marked down and probed. The restarted worker took the
newest weights in its constructor (see ``RolloutWorker``); when the probe answers, the newest
update is queued on it too (skipped if it has it), so it serves at ``queued_version`` like the
others.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import msgspec
import ray

from loong_core.records import Trajectory, WeightManifest
from loong_core.window import StalenessWindow
from loong_train.backends.base import RankLost
from loong_train.batching import assemble, sort_groups
from loong_train.config import Recipe
from loong_train.messages import ApplyResult, DrawReport, FaultCounters, Published, RolloutDone
from loong_train.models.tokenizer import copy_model_files
from loong_train.scheduler import Scheduler
from loong_train.source import GroupSource
from loong_train.weight_sync import choose
from loong_train.workers.pool import WorkerPool

__all__ = ["Event", "Pipeline", "TrainerLost"]

log = logging.getLogger("loong.pipeline")

Event = RolloutDone | ApplyResult | Published
"""What :meth:`Pipeline.wait` yields: a rollout call finished, an engine applied an update, the
trainer published a step."""


class TrainerLost(RuntimeError):
    """The trainer (or one of its ranks) died: the run cannot go on; the message names the node
    and how to continue."""


class Pipeline:
    """In-flight work: rollout calls per worker, the one train step, pending weight applies.

    ``vocab_size`` (the model's, from ``model_path``'s config.json): token ids past it fail their
    row. ``dropped``: groups dynamic sampling dropped since the last step; ``generated``: model
    tokens of the groups that came back since then, in all and in groups with no signal.
    """

    def __init__(
        self,
        recipe: Recipe,
        workers: list[Any],
        trainer: Any,
        scheduler: Scheduler,
        source: GroupSource,
        model_path: str = "",
        run_path: Path | None = None,
    ) -> None:
        self.recipe, self.trainer, self.scheduler, self.source = recipe, trainer, scheduler, source
        self.model_path, self.run_path = model_path, run_path
        self.trainer_node: tuple[str, str] = ray.get(trainer.node.remote())  # (id, IP)
        self.pool = WorkerPool(workers, recipe.rollout.max_restarts)
        self.sync = choose(recipe.rollout.engine)
        self.rollouts: dict[Any, tuple[int, list[str]]] = {}  # call -> (worker, groups)
        self.train_ref: Any = None
        self.applies: dict[int, dict[int, Any]] = {}  # version -> worker -> apply
        self.latest: WeightManifest | None = None
        self.finished: dict[str, list[Trajectory]] = {}
        self.reissued = 0  # groups whose generation was lost and issued again
        self.restarted = 0  # episodes a weight update restarted (rollout.engine.partial = "restart")
        self.dropped: list[str] = []
        self.generated = [0, 0]  # model tokens: all, in groups with no signal
        self.stopped: str | None = None  # why the run ends before its last step
        config = Path(model_path) / "config.json"
        if model_path and config.is_file():
            self.vocab_size = int(json.loads(config.read_text()).get("vocab_size") or 0)
        else:
            self.vocab_size = 0

    @property
    def window(self) -> StalenessWindow:
        return self.scheduler.window

    @property
    def queued_version(self) -> int:
        return self.scheduler.queued_version

    @property
    def counters(self) -> FaultCounters:
        return FaultCounters(
            worker_restarts=self.pool.restarts,
            reissued_groups=self.reissued,
            restarted_episodes=self.restarted,
        )

    def admit(self) -> None:
        """Keep every worker's queue one call deeper than it runs at once (with one call at a
        time: one running, one waiting), round-robin."""
        per_call = -(-self.recipe.train.batch_groups // len(self.pool))
        live = self.pool.live()
        for depth in range(1, self.recipe.rollout.engine.concurrent_calls + 2):
            for w in live:
                if sum(1 for ww, _ in self.rollouts.values() if ww == w) >= depth:
                    continue
                groups = self.scheduler.admit(per_call, self.source.next_group)
                if not groups:
                    return
                specs = [s for g in groups for s in self.source.specs(g)]
                self.rollouts[self.queue_rollout(self.pool.workers[w], specs)] = (w, groups)

    def wait(self) -> list[Event]:
        """Block until some rollout or the train step finishes; returns the events, an
        :class:`ApplyResult` first for every weight update that finished meanwhile. Lost
        rollouts and worker probes are handled here and return no event."""
        train = [self.train_ref] if self.train_ref is not None else []
        refs = [*self.rollouts, *self.pool.probes, *train]
        if not refs:
            raise RuntimeError(
                f"pipeline stalled: nothing in flight and nothing admissible ({self.window.stats})"
            )
        ready, _ = ray.wait(refs, num_returns=1)
        events: list[Event] = []
        for ref in ready:
            if ref is self.train_ref:
                self.train_ref = None
                events.append(self.from_trainer(ref))
            elif ref in self.pool.probes:
                self._probed(ref)
            elif (done := self._rollout_done(ref)) is not None:
                events.append(done)
        return [*self.applied(), *events]  # a step's line sees them

    def from_trainer(self, ref: Any) -> Any:
        """``ray.get`` of a trainer call; :class:`TrainerLost` when the trainer or a rank died."""
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            node, ip = self.trainer_node
            raise self._lost_trainer(f"the trainer on node {ip} ({node[:12]}) died: {_first_line(e)}") from e
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, RankLost):
                raise self._lost_trainer(str(e.cause)) from e
            raise

    def _lost_trainer(self, what: str) -> TrainerLost:
        where = f" {self.run_path}" if self.run_path else ""
        return TrainerLost(
            f"{what}. The run stops at step {self.window.version}; `loong-train run RECIPE --resume"
            f"{where}` continues it from its newest checkpoint (train.checkpoint_every sets how often "
            "one is written)"
        )

    def _rollout_done(self, ref: Any) -> RolloutDone | None:
        """A rollout call's result with every row checked (a row that breaks a record invariant
        fails, not the run); None when the call was lost."""
        w, groups = self.rollouts.pop(ref)
        try:
            result = ray.get(ref)
        except ray.exceptions.RayActorError as e:
            self._lost(w, groups, e)
            return None
        self.pool.seen(w, result.pid)
        checked = [t.checked(self.vocab_size) for t in result.trajectories]
        return RolloutDone(groups, msgspec.structs.replace(result, trajectories=checked))

    def on_rollout(self, done: RolloutDone) -> None:
        """The call's groups enter the window (or are dropped, or issued again)."""
        outcomes = sort_groups(
            done.groups,
            done.result.trajectories,
            fallback_version=self.window.version,
            dynamic_sampling=self.recipe.loss.dynamic_sampling,
        )
        for g in outcomes:
            tokens = sum(t.num_model_tokens for t in g.trajectories)
            self.generated[0] += tokens
            self.generated[1] += tokens if g.no_signal else 0
            if self.scheduler.finish(g.group_id, g.oldest, g.drop):
                self.source.observe(g.group_id, g.trajectories)
                if g.drop:
                    self._dropped(g.group_id)
                else:
                    self.finished[g.group_id] = g.trajectories
            else:  # a restarted worker not yet caught up: the scheduler issues it again
                self.reissued += 1
                log.warning(
                    "group %s ran at version %d, below its admission: re-issuing it", g.group_id, g.oldest
                )

    def _dropped(self, group_id: str) -> None:
        """Dynamic sampling dropped the group: its prompt is released, and once
        ``dynamic_sampling_max_rounds`` batches' worth were dropped in a row the run is over
        (:attr:`stopped`): nothing left to draw carries signal, so it finishes instead of
        generating forever."""
        self.source.release([group_id])
        self.dropped.append(group_id)
        loss = self.recipe.loss
        if (
            self.stopped is None
            and len(self.dropped) >= loss.dynamic_sampling_max_rounds * self.window.batch_size
        ):
            self.stopped = (
                f"dynamic sampling dropped {len(self.dropped)} groups in a row without a train step "
                f"(loss.dynamic_sampling_max_rounds = {loss.dynamic_sampling_max_rounds}): every sample "
                "of every group scored the same, so the remaining prompts are solved (or all failed) "
                "by this policy"
            )

    def take_draw(self) -> DrawReport:
        """Where generation went since the last call: groups dropped, tokens with no signal."""
        curriculum = self.source.curriculum
        report = DrawReport(
            dropped=self.dropped,
            generated_tokens=self.generated[0],
            no_signal_tokens=self.generated[1],
            curriculum=curriculum.counts() if curriculum is not None else {},
        )
        self.dropped, self.generated = [], [0, 0]
        return report

    def _lost(self, w: int, groups: list[str], why: object) -> None:
        """A rollout call's generations are lost: its groups wait in ``window.reissue``."""
        self.scheduler.abort(groups)
        self.reissued += len(groups)
        reason = why if isinstance(why, str) else f"{type(why).__name__}: its process died"
        log.warning("rollout worker %d lost groups %s (%s); re-issuing them", w, ", ".join(groups), reason)
        if isinstance(why, ray.exceptions.RayActorError):
            self.pool.mark_down(w)

    def _probed(self, ref: Any) -> None:
        """A down worker's probe answered: queue the newest update on it (updates queued while it
        was down skipped it). A streaming transport pushed that version before the worker
        connected: the trainer sends it again to the receivers that missed it (after the call it
        is running, so never weights ahead of their version)."""
        if (w := self.pool.probed(ref)) is not None and self.latest is not None:
            self.trainer.catch_up_receivers.remote()
            self.applies.setdefault(self.latest.version, {})[w] = self._apply(w, self.latest)

    def start_train_step(self) -> list[Trajectory] | None:
        """Take a batch from the window and start the train step on it (non-blocking).

        The publish call depends on every worker's apply of the version whose buffer the push
        reuses, and the step on the evaluations the strategy says it must not cross (Ray
        dependencies: the controller never blocks on them; :mod:`loong_train.weight_sync`).
        """
        if (groups := self.scheduler.take()) is None:
            return None
        readers = []
        if self.sync.reuses_buffers:
            reused = self.recipe.transport.must_have_applied(self.window.version + 1)
            readers = list(self.applies.get(reused, {}).values())
        evaluations = self.sync.running_evaluations()
        trajs = [t for g in groups for t in self.finished.pop(g)]
        self.source.release(groups)
        batch = assemble(trajs, self.recipe.loss, self.window.version)
        step = self.trainer.train_step.remote(batch, evaluations)
        self.train_ref = self.trainer.publish.remote(step, readers)
        return trajs

    def sync_weights(self, manifest: WeightManifest) -> None:
        """The scheduler learns of the new version; the update is queued on every live worker, and
        calls queued after it run on the new version."""
        self.scheduler.published(manifest.version)
        self.applies[manifest.version] = {w: self._apply(w, manifest) for w in self.pool.live()}
        self.latest = manifest

    def queue_rollout(self, worker: Any, specs: list[Any], evaluation: bool = False) -> Any:
        """Queue a rollout call that runs at ``queued_version`` or newer; an evaluation runs
        entirely at one version (:mod:`loong_train.weight_sync`)."""
        return self.sync.rollout(worker, specs, self.queued_version, evaluation)

    def live_worker(self) -> Any:
        return self.pool.live_worker()

    def _apply(self, w: int, manifest: WeightManifest) -> Any:
        return self.sync.apply(self.pool.workers[w], manifest, self.scheduler.restart_floor())

    def applied(self) -> list[ApplyResult]:
        """Weight applies that finished since the last call (one per live worker and version);
        a worker whose apply died is probed."""
        done = []
        for version, by_worker in list(self.applies.items()):
            refs = list(by_worker.values())
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
            if len(ready) == len(refs):
                for w, ref in by_worker.items():
                    try:
                        result = ray.get(ref)
                    except ray.exceptions.RayActorError:
                        self.pool.mark_down(w)
                    else:
                        self.pool.seen(w, result.pid)
                        self.restarted += result.restarted
                        done.append(result)
                del self.applies[version]
        return done

    def save_checkpoint(self, path: Path) -> None:
        """The trainer's resumable state and the tokenizer into ``path`` (the trainer is idle)."""
        self.from_trainer(self.trainer.save_checkpoint.remote(str(path)))
        copy_model_files(self.model_path, path)  # the tokenizer, so the directory loads as a model

    def save_final(self, path: Path) -> None:
        """The trained policy as a Hugging Face directory (weights, config, tokenizer); the trainer
        stops after writing it."""
        self.from_trainer(self.trainer.save.remote(str(path)))
        self.from_trainer(self.trainer.close.remote())
        copy_model_files(self.model_path, path)

    def state_dict(self) -> dict[str, Any]:
        """The finished trajectories not yet trained and the fault counters (a checkpoint is
        written between steps: nothing else is in flight that a resumed run keeps)."""
        return {
            "finished": self.finished,
            "restarts": self.pool.restarts,
            "reissued": self.reissued,
            "restarted": self.restarted,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.finished = msgspec.convert(state["finished"], dict[str, list[Trajectory]])
        self.pool.restarts, self.reissued = state["restarts"], state["reissued"]
        self.restarted = state.get("restarted", 0)

    def shutdown(self) -> None:
        """End the run's actors, so a cluster that outlives the run (``--address``, tests) gets
        its CPUs back at once."""
        self.pool.shutdown()
        ray.kill(self.trainer)

    def drain(self) -> None:
        """Wait for every call still in flight (the run is over: lost ones are not re-issued)."""
        while refs := [
            *self.rollouts,
            *self.pool.probes,
            *(r for by in self.applies.values() for r in by.values()),
        ]:
            ray.wait(refs, num_returns=len(refs))
            self.rollouts.clear()
            for ref in list(self.pool.probes):
                self._probed(ref)  # a restarted worker gets the newest update: waited next round
            self.applied()


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
