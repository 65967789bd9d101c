"""The scheduling policy of the asynchronous loop, as pure code: events in, commands out.

:class:`Scheduler` owns the :class:`~loong_core.window.StalenessWindow` and the version rollouts
are queued at, and decides everything the window decides: which groups a rollout call may carry
(admission: a lost group first, then a new one, while the run still needs groups and the window
admits at the queued version), whether a finished group may enter the window (it must not have
run below the version it was admitted at), and which batch the trainer takes. It imports no Ray
and no torch: :mod:`loong_train.pipeline` executes its commands with Ray actors, and
``tools/simulate.py`` drives the same class with simulated time.

Lifecycle::

    s = Scheduler(StalenessWindow(max_staleness=1, batch_size=16), steps=100)
    groups = s.admit(room=16, new_group=source.next_group)  # command: run these groups
    s.finish("g3", oldest=0)          # event: a group's episodes came back -> True (accepted)
    s.finish("g5", oldest=0, drop=True)  # ...with nothing to learn: dropped, another takes its place
    s.abort(["g4"])                   # event: a call was lost -> its groups are admitted again
    batch = s.take()                  # command: train these groups (None: not yet)
    s.published(1)                    # event: the trainer published version 1

Every call is appended to ``journal`` as ``{"call": name, ...arguments, "out": result}``, so a
run's scheduling can be replayed exactly (:func:`replay`), by the simulator as by a test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from loong_core.window import StalenessWindow

__all__ = ["Scheduler", "replay"]


class Scheduler:
    """The staleness window plus the run's admission and take rules (module docstring)."""

    def __init__(self, window: StalenessWindow, *, steps: int) -> None:
        self.window, self.steps = window, steps
        self.queued_version = window.version
        self.training = False
        self.journal: list[dict[str, Any]] = []

    @property
    def groups_needed(self) -> int:
        """Groups still to admit so that exactly ``steps`` batches get trained."""
        s = self.window.stats
        return self.steps * self.window.batch_size - (s.trained + s.taken + s.buffered + s.in_flight)

    def admit(self, room: int, new_group: Callable[[], str]) -> list[str]:
        """Up to ``room`` groups for one rollout call, admitted at ``queued_version``: groups to
        issue again first, then new ones from ``new_group()``; [] when none may be admitted."""
        w, groups = self.window, []
        while len(groups) < room and self.groups_needed > 0 and w.can_admit(self.queued_version):
            group_id = w.reissue[0] if w.reissue else new_group()
            w.admit(group_id, self.queued_version)
            groups.append(group_id)
        self._log("admit", room=room, out=groups)
        return groups

    def finish(self, group_id: str, oldest: int, drop: bool = False) -> bool:
        """A group's episodes came back, their oldest model token at version ``oldest``. False
        (and the group is issued again) when it ran below the version it was admitted at (a
        restarted worker not caught up yet). An accepted group with ``drop`` (dynamic sampling:
        nothing to learn) leaves the window for good, so ``admit`` fills its place."""
        accepted = oldest >= self.window.in_flight[group_id]
        if not accepted:
            self.window.abort(group_id)
        elif drop:
            self.window.drop(group_id)
        else:
            self.window.finish(group_id, oldest)
        self._log("finish", group=group_id, oldest=oldest, **({"drop": True} if drop else {}), out=accepted)
        return accepted

    def abort(self, group_ids: Iterable[str]) -> None:
        """The generations of these in-flight groups were lost: admit them again."""
        group_ids = list(group_ids)
        for group_id in group_ids:
            self.window.abort(group_id)
        self._log("abort", groups=group_ids, out=None)

    def take(self) -> list[str] | None:
        """The batch to train next, when no step is training and the run needs more steps."""
        batch = None
        if not self.training and self.window.version < self.steps:
            batch = self.window.take_batch()
            self.training = batch is not None
        self._log("take", out=batch)
        return batch

    def published(self, version: int) -> None:
        """The trainer published ``version``: the window advances and every call queued from now
        on runs at it."""
        self.window.advance()
        self.queued_version, self.training = version, False
        self._log("published", version=version, out=None)

    def restart_floor(self) -> int:
        """The lowest oldest-token version the window can still train: ``take_batch`` trains at
        its version t only entries with ``t - oldest <= max_staleness``, and the next take is at
        ``version`` (``version + 1`` while a batch is taken), so an older episode could only be
        evicted. Every in-flight entry was admitted at a version >= this floor (the window's
        invariant F: live deadlines ``admit + max_staleness`` >= the next take), so restarts are
        a guard that fires only for work admitted outside that rule."""
        w = self.window
        return w.version + bool(w.taken) - w.max_staleness

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window.state_dict(), "queued_version": self.queued_version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue ``state_dict()`` (with no step training: checkpoints are written between
        steps); the journal goes on from here."""
        self.window = StalenessWindow.from_state(state["window"])
        self.queued_version, self.training = state["queued_version"], False

    @classmethod
    def from_state(cls, state: dict[str, Any], *, steps: int) -> Scheduler:
        """A scheduler continuing ``state_dict()`` (with no step training: checkpoints are
        written between steps)."""
        scheduler = cls(StalenessWindow.from_state(state["window"]), steps=steps)
        scheduler.load_state_dict(state)
        return scheduler

    def take_journal(self) -> list[dict[str, Any]]:
        """The journal's entries since the last call (the run directory appends them)."""
        entries, self.journal = self.journal, []
        return entries

    def _log(self, call: str, **fields: Any) -> None:
        self.journal.append({"call": call, **fields})


def replay(journal: Iterable[dict[str, Any]], window: StalenessWindow, *, steps: int) -> list[dict[str, Any]]:
    """Feed a recorded run's calls into a fresh scheduler; returns its journal, which equals the
    recorded one when the scheduler's decisions depend on nothing but those calls. New group ids
    are taken from the recorded admissions, in order."""
    scheduler = Scheduler(window, steps=steps)
    for entry in journal:
        call = entry["call"]
        if call == "admit":
            recorded = iter(entry["out"])
            scheduler.admit(entry["room"], lambda recorded=recorded: next(recorded, "<not recorded>"))
        elif call == "finish":
            scheduler.finish(entry["group"], entry["oldest"], entry.get("drop", False))
        elif call == "abort":
            scheduler.abort(entry["groups"])
        elif call == "take":
            scheduler.take()
        else:
            scheduler.published(entry["version"])
    return scheduler.journal
