"""Staleness window: admission control, batch selection and the sample ledger of the async loop.

An *entry* is one admission unit (for GRPO one group: a prompt with its n samples), named by a
string ``entry_id``. Let K = ``max_staleness``, B = ``batch_size`` and t the trainer version.
Each entry moves through the ledger::

    admit -> in flight --finish--> buffered --take_batch--> taken --advance--> trained
                 |  abort, restore                 | evict (never in normal flow)
                 v                                 v
              awaiting re-issue (admitted again later under the same id)
                 |
                 +--drop--> dropped (finished with nothing to learn: DAPO's dynamic sampling)

Staleness of an entry trained at version t is ``t - oldest``, where ``oldest`` is the oldest
weight version among its model tokens. Its *bound* b is the engine version at admit while in
flight and ``oldest`` once finished (``oldest >= start``, so b only grows); its *deadline* is
``b + K``, the last trainer version allowed to train it.

Algorithm. A set of deadlines *fits from s* when, sorted, the i-th (0-based) is
``>= s + i // B``: training B entries per step at versions s, s+1, ..., earliest deadline first,
meets every deadline. Equivalently, for every D, at most ``(D - s + 1) * B`` deadlines are <= D.

- ``admit`` needs: occupancy (in flight + buffered + taken) < capacity = ``(K + 1) * B``, and
  the live deadlines plus ``engine_version + K`` fit from the next take version
  (t, or t + 1 while a batch is taken). This implies ``engine_version >= t - K``.
- ``take_batch`` evicts buffered entries past their deadline to the re-issue queue, then takes
  the B buffered entries with the oldest ``oldest`` (ties in finish order), i.e. earliest
  deadline first. It returns None when fewer than B are buffered, or when the entries left
  behind would not fit from t + 1 although all live entries fit from t: an in-flight straggler
  must be in this batch, so the trainer waits for it (or for the controller to abort it).

Guarantees and why they hold.

1. Bound: every taken entry has staleness <= K, in any state, restored or edited, because
   ``take_batch`` only takes entries with ``t - oldest <= K``.
2. Capacity: occupancy <= ``(K + 1) * B`` always; ``admit`` checks it (the fit check alone
   implies it whenever ``engine_version <= t``, as engines never run ahead of the trainer).
3. No eviction and no lost work: invariant F = "the live, untaken entries fit from the next take
   version". ``admit`` checks F; ``finish`` only raises a deadline; ``abort`` removes; a take
   commits only if the rest fits from t + 1, and ``advance`` makes t + 1 the next take version.
   ``drop`` removes a deadline, as ``abort`` does. A restore drops in-flight entries and
   returns the taken B (deadlines >= t) ahead of a set fitting from t + 1, so F holds from t. Under F every deadline is >= t, so nothing is evicted.
   Waiting is never in vain: if the rest fails to fit at some D while F holds, the batch holds
   an entry with deadline > D, so every buffered entry with deadline <= D is in it and the excess
   is in flight; once those entries finish or are aborted, that D is satisfied. An entry admitted
   at engine version t never causes a wait (its deadline t + K is met by capacity), and with
   nothing in flight and >= B buffered, F makes the take succeed.
4. When engines sync right after each ``advance`` (engine_version == t), the new deadline
   ``t + K`` is the latest possible and the fit check reduces to the capacity check. With K = 0
   the capacity is B and a taken batch fills it: generation and training alternate, on-policy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

import msgspec

__all__ = ["StalenessWindow", "WindowStats"]


class WindowStats(msgspec.Struct, frozen=True):
    """Ledger sizes at one moment, plus the total number of evictions (0 in normal flow)."""

    version: int
    in_flight: int
    buffered: int
    taken: int
    trained: int
    awaiting_reissue: int
    evicted: int
    dropped: int = 0


def _fits(deadlines: Iterable[int], first_version: int, batch_size: int) -> bool:
    """True iff B entries per step from ``first_version`` on, earliest deadline first, meet all."""
    return all(d >= first_version + i // batch_size for i, d in enumerate(sorted(deadlines)))


class StalenessWindow:
    """Admission control and batch selection with staleness <= ``max_staleness`` (see module doc).

    Lifecycle, driven by one controller (ids in ``w.reissue`` are admitted before new ones)::

        w = StalenessWindow(max_staleness=1, batch_size=8)
        while w.can_admit(engine_version):
            w.admit(next_entry_id(), engine_version)
        w.finish(entry_id, oldest_version)          # or w.abort(entry_id): generation lost
        if (batch := w.take_batch()) is not None:   # None: wait for more finishes
            train(batch, version=w.version)
            push_weights(w.advance())
    """

    def __init__(self, max_staleness: int, batch_size: int) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness: expected an int >= 0, got {max_staleness!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self.capacity = (max_staleness + 1) * batch_size
        self._version = 0
        self._in_flight: dict[str, int] = {}  # entry_id -> engine version at admit
        self._buffered: dict[str, int] = {}  # entry_id -> oldest version, in finish order
        self._taken: dict[str, int] = {}  # the batch being trained: entry_id -> oldest version
        self._trained: set[str] = set()
        self._reissue: dict[str, None] = {}  # FIFO of ids to generate again
        self._dropped: set[str] = set()
        self._evicted = 0
        self._last_staleness: list[int] = []

    def can_admit(self, engine_version: int) -> bool:
        """Whether an entry generated from weights ``engine_version`` may start now."""
        occupancy = len(self._in_flight) + len(self._buffered) + len(self._taken)
        if occupancy >= self.capacity:  # O(1); the deadline check is O(live entries)
            return False
        deadlines = [*self._live_deadlines(), engine_version + self.max_staleness]
        return _fits(deadlines, self._version + bool(self._taken), self.batch_size)

    def admit(self, entry_id: str, engine_version: int) -> None:
        """Record ``entry_id`` as in flight; an id awaiting re-issue leaves that queue."""
        if entry_id in self._in_flight or entry_id in self._buffered or entry_id in self._taken:
            raise ValueError(f"entry {entry_id!r} is already admitted and not yet trained")
        if entry_id in self._trained:
            raise ValueError(f"entry {entry_id!r} was already trained")
        if entry_id in self._dropped:
            raise ValueError(f"entry {entry_id!r} was dropped")
        if not self.can_admit(engine_version):
            raise RuntimeError(f"cannot admit {entry_id!r} at engine version {engine_version} now")
        self._reissue.pop(entry_id, None)
        self._in_flight[entry_id] = engine_version

    def finish(self, entry_id: str, oldest_version: int) -> None:
        """The rollout finished; ``oldest_version`` (oldest weight version of its model tokens)
        must be >= the engine version it was admitted with."""
        start = self._in_flight[self._require_in_flight(entry_id)]
        if oldest_version < start:
            raise ValueError(f"entry {entry_id!r}: oldest_version {oldest_version} < admit version {start}")
        del self._in_flight[entry_id]
        self._buffered[entry_id] = oldest_version

    def drop(self, entry_id: str) -> None:
        """The rollout finished but will not be trained (all its samples scored the same, so
        they carry no advantage): it leaves the window for good, and its place is free for
        another entry. ``dropped`` records it, so the ledger still accounts for every id."""
        del self._in_flight[self._require_in_flight(entry_id)]
        self._dropped.add(entry_id)

    def abort(self, entry_id: str) -> None:
        """The generation was lost; the id waits in ``reissue`` to be admitted again."""
        del self._in_flight[self._require_in_flight(entry_id)]
        self._reissue[entry_id] = None

    def take_batch(self) -> list[str] | None:
        """B buffered entries, oldest first, for training at ``version``; None means wait."""
        if self._taken:
            raise RuntimeError("take_batch() called again before advance()")
        t, k, b = self._version, self.max_staleness, self.batch_size
        for entry_id, oldest in list(self._buffered.items()):
            if t - oldest > k:
                del self._buffered[entry_id]
                self._reissue[entry_id] = None
                self._evicted += 1
        if len(self._buffered) < b:
            return None
        order = sorted(self._buffered, key=self._buffered.__getitem__)  # stable: ties by finish
        rest = [self._buffered[i] + k for i in order[b:]] + [s + k for s in self._in_flight.values()]
        if not _fits(rest, t + 1, b) and _fits(self._live_deadlines(), t, b):
            return None  # a straggler in flight must join this batch to meet its deadline
        self._taken = {i: self._buffered.pop(i) for i in order[:b]}
        self._last_staleness = [t - oldest for oldest in self._taken.values()]
        return order[:b]

    def advance(self) -> int:
        """The train step on the taken batch finished: mark it trained; return the new version."""
        if not self._taken:
            raise RuntimeError("advance() called without a taken batch")
        self._trained.update(self._taken)
        self._taken = {}
        self._version += 1
        return self._version

    @property
    def version(self) -> int:
        return self._version

    @property
    def last_batch_staleness(self) -> list[int]:
        """``version - oldest`` per entry of the last taken batch, in batch order."""
        return list(self._last_staleness)

    @property
    def in_flight(self) -> Mapping[str, int]:
        """Read-only view: entry_id -> engine version at admit."""
        return MappingProxyType(self._in_flight)

    @property
    def buffered(self) -> Mapping[str, int]:
        """Read-only view: entry_id -> oldest version, in finish order."""
        return MappingProxyType(self._buffered)

    @property
    def taken(self) -> tuple[str, ...]:
        return tuple(self._taken)

    @property
    def trained(self) -> frozenset[str]:
        return frozenset(self._trained)

    @property
    def dropped(self) -> frozenset[str]:
        return frozenset(self._dropped)

    @property
    def reissue(self) -> tuple[str, ...]:
        """Ids to generate again, oldest request first; each leaves when admitted again."""
        return tuple(self._reissue)

    @property
    def stats(self) -> WindowStats:
        sizes = map(len, (self._in_flight, self._buffered, self._taken, self._trained, self._reissue))
        return WindowStats(self._version, *sizes, self._evicted, len(self._dropped))

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable checkpoint (plain dicts, lists, ints, strs)."""
        return {
            "max_staleness": self.max_staleness,
            "batch_size": self.batch_size,
            "version": self._version,
            "in_flight": dict(self._in_flight),
            "buffered": dict(self._buffered),
            "taken": dict(self._taken),
            "trained": sorted(self._trained),
            "reissue": list(self._reissue),
            "evicted": self._evicted,
            "dropped": sorted(self._dropped),
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> StalenessWindow:
        """Resume: in-flight entries died with their actors and wait for re-issue; a taken batch
        whose step did not finish goes back to the front of the buffer; the version continues."""
        window = cls(state["max_staleness"], state["batch_size"])
        window._version = state["version"]
        window._buffered = {**state["taken"], **state["buffered"]}
        window._trained = set(state["trained"])
        window._reissue = dict.fromkeys([*state["reissue"], *state["in_flight"]])
        window._evicted = state["evicted"]
        window._dropped = set(state.get("dropped", ()))  # absent from checkpoints before dropping
        return window

    def _live_deadlines(self) -> list[int]:
        k = self.max_staleness
        return [v + k for v in (*self._in_flight.values(), *self._buffered.values())]

    def _require_in_flight(self, entry_id: str) -> str:
        if entry_id not in self._in_flight:
            raise ValueError(f"entry {entry_id!r} is not in flight")
        return entry_id
