"""The mechanics under the driver: data, in-flight Ray calls, weight sync and telemetry.

Kept apart from ``controller.py`` so the driver reads as the loop of docs/architecture.md.

Faults. Rollout workers are Ray actors with ``max_restarts``. A call of a worker whose process
died raises ``RayActorError`` (``ActorDiedError``, or ``ActorUnavailableError`` while Ray
restarts it). For a rollout call the pipeline aborts the call's groups in the window, so they
wait in ``window.reissue`` and ``admit`` issues them again: same group ids, same prompts
(``GroupSource.issued`` keeps them until trained), same sampling seeds. A failed weight apply
is dropped. Either way the worker is marked down and probed (``pid()``, retried by Ray until
the actor is back); nothing else is queued on it meanwhile (weight updates skip it, evaluations
go to a live worker). The restarted worker took the newest weights in its constructor (see
``RolloutWorker``); when the probe answers, the newest update is queued on it too (skipped if
it has it), so it serves at ``queued_version`` like the others. A probe that finds a new pid
counts a restart (``restarts``); one that finds the actor dead for good (``ActorDiedError``:
its restarts are spent) ends the run.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from loong_agentflow import EpisodeSpec
from loong_core.records import Trajectory, WeightManifest
from loong_core.window import StalenessWindow
from loong_train.algo.losses import advantages, no_signal, pack_batch
from loong_train.config import Recipe
from loong_train.models.tokenizer import copy_model_files
from loong_train.scheduler import Scheduler

__all__ = ["GroupSource", "Pipeline", "episode_seed"]

log = logging.getLogger("loong.pipeline")


def episode_seed(run_seed: int, sample_id: str) -> int:
    """The sampling seed of episode ``sample_id`` in a run seeded ``run_seed`` (64 bits of a hash):
    the same sample samples the same tokens from the same weights however the run was split."""
    digest = hashlib.blake2b(f"{run_seed}/{sample_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class GroupSource:
    """Training prompts as GRPO groups; a group id names the window entry (the ledger key).

    ``count`` tasks have been drawn from ``tasks`` (one per group), which is the data position a
    checkpoint saves; ``issued`` keeps the prompt of every group not yet trained, so a lost group
    is issued again with the same prompt. With ``seed``, each episode carries
    ``episode_seed(seed, sample_id)``.
    """

    def __init__(
        self,
        tasks: Iterator[dict[str, Any]],
        group_size: int,
        tags: dict[str, str] | None = None,
        seed: int | None = None,
    ) -> None:
        self.tasks, self.group_size, self.tags, self.seed = tasks, group_size, tags or {}, seed
        self.issued: dict[str, dict[str, Any]] = {}
        self.count = 0

    def next_group(self) -> str:
        group_id = f"g{self.count}"
        self.count += 1
        self.issued[group_id] = next(self.tasks)
        return group_id

    def release(self, group_ids: list[str]) -> None:
        """Forget groups that were trained (a long run would otherwise keep every prompt)."""
        for group_id in group_ids:
            del self.issued[group_id]

    def specs(self, group_id: str) -> list[EpisodeSpec]:
        task = self.issued[group_id]
        tags = {**self.tags, **task.get("tags", {})}  # a task's own tags (its domain) route it
        ids = [f"{group_id}-{j}" for j in range(self.group_size)]
        return [EpisodeSpec(i, group_id, task, dict(tags), self._seed(i)) for i in ids]

    def _seed(self, sample_id: str) -> int | None:
        return None if self.seed is None else episode_seed(self.seed, sample_id)


@dataclass
class Pipeline:
    """In-flight work: rollout calls per worker, the one train step, pending weight applies.

    What may run is the :class:`~loong_train.scheduler.Scheduler`'s decision (admission, taking
    a batch, the version calls are queued at); this class only places its commands on workers,
    executes them as Ray calls and reports their results back to it.

    Ray runs one caller's calls to an actor in order, so a rollout queued after a weight update
    runs on the new weights: ``queued_version`` is the version every call queued from now on
    will run at, and is what admission checks. With partial rollouts (``rollout.engine.partial``, see
    :mod:`loong_train.engines.embedded.host`) updates run on the workers' ``weights`` thread instead, so they
    land mid-call and never wait for rollouts; a rollout call then carries ``queued_version``
    and its worker waits until it holds that version before starting, so the bound holds alike.
    With concurrent calls (``rollout.engine.concurrent_calls`` > 1) rollouts run on the workers'
    ``rollout`` threads and updates on their ``weights`` thread, calls carry ``queued_version``
    the same way, and with ``partial = "off"`` the worker's host lets running calls end first.
    """

    recipe: Recipe
    workers: list[Any]
    trainer: Any
    scheduler: Scheduler
    source: GroupSource
    model_path: str = ""
    rollouts: dict[Any, tuple[int, list[str]]] = field(default_factory=dict)
    train_ref: Any = None
    applies: dict[int, dict[int, Any]] = field(default_factory=dict)  # version -> worker -> apply
    evaluations: list[Any] = field(default_factory=list)  # direct weights: evaluation calls a push waits for
    latest: WeightManifest | None = None
    finished: dict[str, list[Trajectory]] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)  # each worker's process, as last seen
    probes: dict[Any, int] = field(default_factory=dict)  # pid() call -> worker, while it is down
    restarts: int = 0
    reissued: int = 0  # groups whose generation was lost and issued again
    dropped: list[str] = field(default_factory=list)  # dynamic sampling: dropped since the last step
    restarted: int = 0  # episodes a weight update restarted (rollout.engine.partial = "restart")
    vocab_size: int = 0  # the model's, from config.json: token ids past it fail their row

    def __post_init__(self) -> None:
        if not self.pids:
            self.pids = ray.get([w.pid.remote() for w in self.workers])
        config = Path(self.model_path) / "config.json"
        if not self.vocab_size and self.model_path and config.is_file():
            self.vocab_size = int(json.loads(config.read_text()).get("vocab_size") or 0)

    @property
    def window(self) -> StalenessWindow:
        return self.scheduler.window

    @property
    def queued_version(self) -> int:
        return self.scheduler.queued_version

    @property
    def down(self) -> set[int]:
        """Workers whose process died, until a probe finds them back."""
        return set(self.probes.values())

    def live_worker(self) -> Any:
        """A worker to queue side work (evaluations) on: the first one not down."""
        return self.workers[min(set(range(len(self.workers))) - self.down, default=0)]

    @property
    def concurrent_calls(self) -> int:
        """Rollout calls a worker runs at once (``[rollout.engine] concurrent_calls``)."""
        return self.recipe.rollout.engine.concurrent_calls

    def admit(self) -> None:
        """Keep every worker's queue one call deeper than it runs at once (with one call at a
        time: one running, one waiting), round-robin."""
        per_call = -(-self.recipe.train.batch_groups // len(self.workers))
        down = self.down
        for depth in range(1, self.concurrent_calls + 2):
            for w, worker in enumerate(self.workers):
                if w in down or sum(1 for ww, _ in self.rollouts.values() if ww == w) >= depth:
                    continue
                groups = self.scheduler.admit(per_call, self.source.next_group)
                if not groups:
                    return
                specs = [s for g in groups for s in self.source.specs(g)]
                self.rollouts[self.queue_rollout(worker, specs)] = (w, groups)

    def wait(self) -> list[tuple[str, Any]]:
        """Block until some rollout or the train step finishes; returns (kind, result) events:
        ``rollout``, ``train``, and ``applied`` for every weight update that finished meanwhile.
        Lost rollouts and worker probes are handled here and return no event."""
        refs = [*self.rollouts, *self.probes] + ([self.train_ref] if self.train_ref is not None else [])
        if not refs:
            raise RuntimeError(
                f"pipeline stalled: nothing in flight and nothing admissible ({self.window.stats})"
            )
        ready, _ = ray.wait(refs, num_returns=1)
        events = []
        for ref in ready:
            if ref is self.train_ref:
                self.train_ref = None
                events.append(("train", ray.get(ref)))
            elif ref in self.probes:
                self._probed(ref)
            else:
                w, groups = self.rollouts.pop(ref)
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._lost(w, groups, e)
                    continue
                self._seen(w, result["pid"])
                events.append(("rollout", (groups, result)))
        return [("applied", a) for a in self.applied()] + events  # a step's line sees them

    def on_rollout(self, groups: list[str], result: dict[str, Any]) -> None:
        # a row that breaks a record invariant fails (the run directory logs and counts it), not the run
        trajectories = [t.checked(self.vocab_size) for t in result["trajectories"]]
        result["trajectories"] = trajectories
        by_group: dict[str, list[Trajectory]] = {g: [] for g in groups}
        for t in trajectories:
            by_group[t.group_id].append(t)
        for group_id, trajs in by_group.items():
            versions = [t.oldest_version for t in trajs if t.oldest_version >= 0]
            oldest = min(versions) if versions else self.window.version
            drop = self.recipe.loss.dynamic_sampling and no_signal(trajs)
            if self.scheduler.finish(group_id, oldest, drop):
                if drop:
                    self._dropped(group_id)
                else:
                    self.finished[group_id] = trajs
            else:  # a restarted worker not yet caught up: the scheduler issues it again
                self.reissued += 1
                log.warning(
                    "group %s ran at version %d, below its admission: re-issuing it", group_id, oldest
                )

    def _dropped(self, group_id: str) -> None:
        """Dynamic sampling dropped the group: its prompt is released, and a run whose groups all
        stopped carrying signal ends with an error instead of generating forever."""
        self.source.release([group_id])
        self.dropped.append(group_id)
        loss = self.recipe.loss
        if len(self.dropped) >= loss.dynamic_sampling_max_rounds * self.window.batch_size:
            raise RuntimeError(
                f"dynamic sampling dropped {len(self.dropped)} groups in a row without a train step: "
                "every sample of every group scored the same (the prompts are all solved, or all "
                "failed, by this policy). Raise loss.dynamic_sampling_max_rounds "
                f"(now {loss.dynamic_sampling_max_rounds}) or turn loss.dynamic_sampling off"
            )

    def take_dropped(self) -> list[str]:
        """The groups dropped since the last call (for the ledger)."""
        dropped, self.dropped = self.dropped, []
        return dropped

    def _lost(self, w: int, groups: list[str], why: object) -> None:
        """A rollout call's generations are lost: its groups wait in ``window.reissue``."""
        self.scheduler.abort(groups)
        self.reissued += len(groups)
        reason = why if isinstance(why, str) else f"{type(why).__name__}: its process died"
        log.warning("rollout worker %d lost groups %s (%s); re-issuing them", w, ", ".join(groups), reason)
        if isinstance(why, ray.exceptions.RayActorError):
            self._down(w)

    def _down(self, w: int) -> None:
        """Queue nothing on worker ``w`` until a ``pid()`` probe answers (Ray retries the probe
        while the actor restarts)."""
        if w not in self.down:
            self.probes[self.workers[w].pid.options(max_task_retries=-1).remote()] = w

    def _probed(self, ref: Any) -> None:
        w = self.probes.pop(ref)
        try:
            pid = ray.get(ref)
        except ray.exceptions.ActorUnavailableError:  # still restarting
            self._down(w)
            return
        except ray.exceptions.ActorDiedError as e:
            raise RuntimeError(
                f"rollout worker {w} died and Ray will not restart it again "
                f"(rollout.max_restarts = {self.recipe.rollout.max_restarts})"
            ) from e
        self._seen(w, pid)
        if self.latest is not None:  # updates queued while it was down were skipped
            ref = self._apply(w, self.latest)
            self.applies.setdefault(self.latest.version, {})[w] = ref

    def _seen(self, w: int, pid: int) -> None:
        """Worker ``w`` answered from process ``pid``: a new pid is a restart."""
        if pid != self.pids[w]:
            self.restarts += 1
            log.warning("rollout worker %d restarted (pid %d -> %d)", w, self.pids[w], pid)
            self.pids[w] = pid

    def start_train_step(self) -> list[Trajectory] | None:
        """Take a batch from the window and start the train step on it (non-blocking).

        The push of version v + 1 may reuse the buffer of an older version (the transport's rule,
        ``TransportConfig.must_have_applied``: shm's double buffer reuses v - 1's slot, or v's with
        ``zero_copy`` receivers), so the publish call depends on every worker's apply of that
        version (a Ray dependency: the controller never blocks on it). With direct weights the
        trainer's push lands in the servers at once, so the step waits instead for the evaluations
        still running (before it changes the weights, so the trainer can still catch a server up
        meanwhile): an evaluation runs entirely at the version it names.
        """
        if (groups := self.scheduler.take()) is None:
            return None
        readers, evaluations = [], []  # what the push waits for; what the step waits for
        if self.recipe.rollout.engine.weights == "direct":  # no buffer to reuse; evaluations see one version
            evaluations = self.evaluations = self._running(self.evaluations)
        else:
            reused = self.recipe.transport.must_have_applied(self.window.version + 1)
            readers = list(self.applies.get(reused, {}).values())
        trajs = [t for g in groups for t in self.finished.pop(g)]
        self.source.release(groups)
        adv = advantages(trajs, self.recipe.loss)
        batch = pack_batch(trajs, adv, self.window.version, self.recipe.loss.overlong_filter)
        step = self.trainer.train_step.remote(batch, evaluations)
        self.train_ref = self.trainer.publish.remote(step, readers)
        return trajs

    @staticmethod
    def _running(refs: list[Any]) -> list[Any]:
        """The calls of ``refs`` that have not finished."""
        done = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
        return [r for r in refs if r not in done]

    def sync_weights(self, manifest: WeightManifest) -> None:
        """The scheduler learns of the new version; the update is queued on every live worker, and
        calls queued after it run on the new version."""
        self.scheduler.published(manifest.version)
        down = self.down
        self.applies[manifest.version] = {
            w: self._apply(w, manifest) for w in range(len(self.workers)) if w not in down
        }
        self.latest = manifest

    def queue_rollout(self, worker: Any, specs: list[EpisodeSpec], evaluation: bool = False) -> Any:
        """Queue a rollout call that runs at ``queued_version`` or newer (with partial rollouts, or
        servers the trainer updates directly, the worker waits for that version itself; without,
        Ray's call order ensures it). An evaluation runs entirely at one version (updates wait
        for it; with direct weights the trainer's next step does, ``start_train_step``)."""
        if self.concurrent_calls > 1:  # beside the updates: the worker waits for the version
            call = worker.rollout.options(concurrency_group="rollout")
            return call.remote(specs, self.queued_version, evaluation)
        engine = self.recipe.rollout.engine
        direct = engine.weights == "direct"
        ref = worker.rollout.remote(
            specs, self.queued_version if direct or engine.partial != "off" else 0, evaluation
        )
        if direct and evaluation:
            self.evaluations.append(ref)
        return ref

    def _apply(self, w: int, manifest: WeightManifest) -> Any:
        """Queue ``manifest`` on worker ``w``: behind its rollout calls, or with partial rollouts
        or concurrent calls on its ``weights`` thread (``restart``: with the restart floor)."""
        worker, partial = self.workers[w], self.recipe.rollout.engine.partial
        if partial == "off" and self.concurrent_calls == 1:
            return worker.apply_weights.remote(manifest)
        floor = self.scheduler.restart_floor() if partial == "restart" else -1
        return worker.apply_weights.options(concurrency_group="weights").remote(manifest, floor)

    def applied(self) -> list[dict[str, float]]:
        """Results of weight applies that finished since the last call (one per live worker and
        version); a worker whose apply died is probed."""
        done = []
        for version, by_worker in list(self.applies.items()):
            refs = list(by_worker.values())
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
            if len(ready) == len(refs):
                for w, ref in by_worker.items():
                    try:
                        done.append(ray.get(ref))
                    except ray.exceptions.RayActorError:
                        self._down(w)
                    else:
                        self._seen(w, done[-1]["pid"])
                        self.restarted += done[-1]["restarted"]
                del self.applies[version]
        return done

    def save_final(self, path: Path) -> None:
        """The trained policy as a Hugging Face directory (weights, config, tokenizer); the trainer
        stops after writing it."""
        ray.get(self.trainer.save.remote(str(path)))
        ray.get(self.trainer.close.remote())
        copy_model_files(self.model_path, path)

    def shutdown(self) -> None:
        """End the run's actors, so a cluster that outlives the run (``--address``, tests) gets
        its CPUs back at once: workers stop their proxy or server first (``close``)."""
        closing = [w.close.remote() for w in self.workers]
        ray.wait(closing, num_returns=len(closing), timeout=30)
        for actor in [*self.workers, self.trainer]:
            ray.kill(actor)

    def drain(self) -> None:
        """Wait for every call still in flight (the run is over: lost ones are not re-issued)."""
        while refs := [
            *self.rollouts,
            *self.probes,
            *(r for by in self.applies.values() for r in by.values()),
        ]:
            ray.wait(refs, num_returns=len(refs))
            self.rollouts.clear()
            for ref in list(self.probes):
                self._probed(ref)  # a restarted worker gets the newest update: waited next round
            self.applied()
