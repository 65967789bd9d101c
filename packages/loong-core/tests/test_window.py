"""StalenessWindow: hand-worked cases, error cases, and a stateful property test against an
independent model of the ledger that computes staleness from its own records."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import loong_core.window as window_module
from loong_core.window import StalenessWindow, WindowStats


def _roundtrip(window: StalenessWindow) -> StalenessWindow:
    return StalenessWindow.from_state(json.loads(json.dumps(window.state_dict())))


def test_exports() -> None:
    assert window_module.__all__ == ["StalenessWindow", "WindowStats"]


def test_window_1_batch_2_hand_worked() -> None:
    w = StalenessWindow(max_staleness=1, batch_size=2)
    assert w.capacity == 4
    for entry_id in "abcd":
        w.admit(entry_id, engine_version=0)
    assert not w.can_admit(0)  # 4 in flight = capacity
    w.finish("a", 0)
    assert w.take_batch() is None  # one buffered, two needed
    w.finish("b", 0)
    assert w.take_batch() == ["a", "b"]
    assert w.last_batch_staleness == [0, 0]
    assert not w.can_admit(0)  # the taken batch still counts against capacity
    assert w.advance() == 1
    # c and d (admitted at 0) must be trained at version 1; a third such entry could not be.
    assert not w.can_admit(0)
    assert w.can_admit(1)
    w.admit("e", 1)
    w.admit("f", 1)
    w.finish("e", 1)
    w.finish("c", 0)
    # Taking [c, e] now would leave d to be trained at version 2 (staleness 2): wait for d.
    assert w.take_batch() is None
    w.finish("d", 0)
    assert w.take_batch() == ["c", "d"]
    assert w.last_batch_staleness == [1, 1]
    assert w.advance() == 2
    w.finish("f", 2)
    assert w.take_batch() == ["e", "f"]
    assert w.last_batch_staleness == [1, 0]
    w.advance()
    assert w.trained == frozenset("abcdef")
    assert w.stats == WindowStats(3, 0, 0, 0, 6, 0, 0)


def test_window_0_is_synchronous() -> None:
    w = StalenessWindow(max_staleness=0, batch_size=2)
    w.admit("a", 0)
    w.admit("b", 0)
    assert not w.can_admit(0)
    w.finish("b", 0)
    w.finish("a", 0)
    assert w.take_batch() == ["b", "a"]  # ties in finish order
    assert not w.can_admit(0)  # no generation while the trainer trains
    w.advance()
    assert not w.can_admit(0)  # old weights are refused until the engine syncs
    assert w.can_admit(1)


def test_oldest_first_and_abort_reissues() -> None:
    w = StalenessWindow(max_staleness=2, batch_size=1)
    w.admit("a", 0)
    w.admit("b", 0)
    w.abort("a")
    assert w.reissue == ("a",)
    w.finish("b", 0)
    assert w.take_batch() == ["b"]
    w.advance()
    w.admit("c", 1)
    w.admit("a", 1)  # re-issued under the same id
    assert w.reissue == ()
    w.finish("a", 2)
    w.finish("c", 1)
    assert w.take_batch() == ["c"]


@pytest.mark.parametrize(("k", "b", "name"), [(-1, 1, "max_staleness"), (0, 0, "batch_size")])
def test_constructor_rejects_bad_args(k: int, b: int, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        StalenessWindow(k, b)


def test_duplicates_are_rejected_in_every_state() -> None:
    w = StalenessWindow(max_staleness=1, batch_size=1)
    w.admit("a", 0)
    with pytest.raises(ValueError, match="already"):
        w.admit("a", 0)  # in flight
    w.finish("a", 0)
    with pytest.raises(ValueError, match="already"):
        w.admit("a", 0)  # buffered
    w.take_batch()
    with pytest.raises(ValueError, match="already"):
        w.admit("a", 0)  # taken
    w.advance()
    with pytest.raises(ValueError, match="already"):
        w.admit("a", 1)  # trained


def test_finish_and_abort_errors() -> None:
    w = StalenessWindow(max_staleness=1, batch_size=1)
    with pytest.raises(ValueError, match="not in flight"):
        w.finish("x", 0)
    with pytest.raises(ValueError, match="not in flight"):
        w.abort("x")
    w.admit("a", 0)
    w.finish("a", 0)
    with pytest.raises(ValueError, match="not in flight"):
        w.finish("a", 0)
    w.take_batch()
    w.advance()
    w.admit("b", 1)
    with pytest.raises(ValueError, match="oldest_version"):
        w.finish("b", 0)
    assert dict(w.in_flight) == {"b": 1}


def test_protocol_order_errors() -> None:
    w = StalenessWindow(max_staleness=0, batch_size=1)
    with pytest.raises(RuntimeError, match="advance"):
        w.advance()
    w.admit("a", 0)
    with pytest.raises(RuntimeError, match="cannot admit"):
        w.admit("b", 0)
    w.finish("a", 0)
    assert w.take_batch() == ["a"]
    with pytest.raises(RuntimeError, match="take_batch"):
        w.take_batch()


def test_restore_reissues_in_flight_and_returns_taken_batch() -> None:
    w = StalenessWindow(max_staleness=1, batch_size=2)
    for entry_id in "abcd":
        w.admit(entry_id, 0)
    w.abort("d")
    w.finish("a", 0)
    w.finish("b", 0)
    w.take_batch()  # [a, b] taken; the checkpoint happens mid-step
    r = _roundtrip(w)
    assert r.version == 0
    assert r.reissue == ("d", "c")
    assert dict(r.buffered) == {"a": 0, "b": 0}
    assert r.take_batch() == ["a", "b"]
    assert r.advance() == 1


def test_restore_with_smaller_window_evicts_over_stale() -> None:
    w = StalenessWindow(max_staleness=2, batch_size=1)
    for entry_id in "abc":
        w.admit(entry_id, 0)
    for entry_id in "abc":
        w.finish(entry_id, 0)
    w.take_batch()
    w.advance()
    w.take_batch()
    w.advance()  # version 2, c buffered with oldest 0 (staleness 2 <= 2)
    r = StalenessWindow.from_state({**w.state_dict(), "max_staleness": 1})
    assert r.take_batch() is None  # c would have staleness 2 > 1
    assert r.reissue == ("c",)
    assert r.stats.evicted == 1


def _schedulable(deadlines: list[int], first_version: int, batch_size: int) -> bool:
    """Counting form of the window's fit test: B per step from ``first_version`` meets them all."""
    return all(sum(d <= dl for d in deadlines) <= (dl - first_version + 1) * batch_size for dl in deadlines)


@settings(max_examples=200, deadline=None)
@given(k=st.integers(0, 3), b=st.integers(1, 3), data=st.data())
def test_controller_loop_with_stragglers(k: int, b: int, data: st.DataObject) -> None:
    """The real controller's loop with adversarial engines: keep the window full, finish the
    newest entries first so the oldest straggle (dropping some, as dynamic sampling does), train
    whenever a batch is ready, sync weights after a random delay. Nothing is evicted, trained
    twice or both trained and dropped, and staleness stays <= k."""
    w = StalenessWindow(k, b)
    start: dict[str, int] = {}
    oldest: dict[str, int] = {}
    trained: list[str] = []
    engine = 0
    for step in range(30):
        while w.can_admit(engine):
            entry_id = w.reissue[0] if w.reissue else f"e{len(start)}"
            w.admit(entry_id, engine)
            start[entry_id] = engine
        newest_first = sorted(w.in_flight, key=lambda i: -start[i])
        for entry_id in newest_first[: data.draw(st.integers(0, len(newest_first)))]:
            if data.draw(st.integers(0, 3)) == 0:
                w.drop(entry_id)
                continue
            oldest[entry_id] = data.draw(st.integers(start[entry_id], engine))
            w.finish(entry_id, oldest[entry_id])
        if step % 7 == 6 and w.in_flight:
            w.abort(next(iter(w.in_flight)))
        batch = w.take_batch()
        if batch is not None:
            assert [w.version - oldest[i] for i in batch] == w.last_batch_staleness
            assert max(w.last_batch_staleness) <= k
            assert all(oldest[i] >= max(oldest[j] for j in batch) for i in w.buffered), "oldest first"
            trained += batch
            w.advance()
        if data.draw(st.booleans()):
            engine = w.version
        assert w.stats.evicted == 0
    assert len(trained) == len(set(trained)) == len(w.trained)
    assert not w.trained & w.dropped and w.stats.dropped == len(w.dropped)


_STATES = ("in_flight", "buffered", "taken", "trained", "reissue", "dropped")


class WindowMachine(RuleBasedStateMachine):
    """Random interleavings of admit, finish (out of order), drop (dynamic sampling), abort, take,
    train, weight sync and checkpoint/restore. The engine's version only changes by a sync to the trainer's version,
    immediately after each train step (``immediate``) or whenever the ``sync`` rule fires."""

    @initialize(k=st.integers(0, 3), b=st.integers(1, 3), immediate=st.booleans(), restores=st.booleans())
    def setup(self, k: int, b: int, immediate: bool, restores: bool) -> None:
        self.w = StalenessWindow(k, b)
        self.k, self.b, self.immediate, self.restores = k, b, immediate, restores
        self.version = 0
        self.engine = 0
        self.state: dict[str, str] = {}  # every id ever issued -> its state in this model
        self.start: dict[str, int] = {}
        self.oldest: dict[str, int] = {}
        self.batch: list[str] = []
        self.new_ids = 0

    def _ids(self, name: str) -> list[str]:
        return sorted(i for i, s in self.state.items() if s == name)

    def _occupancy(self) -> int:
        return sum(s in ("in_flight", "buffered", "taken") for s in self.state.values())

    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        """The controller admits up to a few entries, as many as the window allows."""
        for _ in range(data.draw(st.integers(1, 4))):
            if not self._admit_one(data):
                return

    def _admit_one(self, data: st.DataObject) -> bool:
        ok = self.w.can_admit(self.engine)
        if self._occupancy() >= self.w.capacity or self.engine < self.version - self.k:
            assert not ok
        if self.immediate:  # admission control is exactly the capacity check
            assert ok == (self._occupancy() < self.w.capacity)
        if not ok:
            with pytest.raises(RuntimeError):
                self.w.admit("never-admitted", self.engine)
            return False
        assert not (self.k == 0 and self.batch), "window 0 must not generate while training"
        entry_id = data.draw(st.sampled_from([*self._ids("reissue"), f"e{self.new_ids}"]))
        self.new_ids += entry_id == f"e{self.new_ids}"
        self.w.admit(entry_id, self.engine)
        self.state[entry_id], self.start[entry_id] = "in_flight", self.engine
        return True

    @precondition(lambda self: self._ids("in_flight"))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        # Newest first: Hypothesis favours early choices, and finishing the newest entry first
        # leaves stragglers behind, the case admission control must survive.
        newest_first = sorted(self._ids("in_flight"), key=lambda i: -self.start[i])
        entry_id = data.draw(st.sampled_from(newest_first))
        oldest = data.draw(st.integers(self.start[entry_id], self.engine))
        self.w.finish(entry_id, oldest)
        self.state[entry_id], self.oldest[entry_id] = "buffered", oldest

    @precondition(lambda self: self._ids("in_flight"))
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        """A finished entry with nothing to learn leaves for good; its id is never admitted again."""
        entry_id = data.draw(st.sampled_from(self._ids("in_flight")))
        self.w.drop(entry_id)
        self.state[entry_id] = "dropped"
        with pytest.raises(ValueError, match="dropped"):
            self.w.admit(entry_id, self.engine)

    @precondition(lambda self: self._ids("in_flight"))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        entry_id = data.draw(st.sampled_from(self._ids("in_flight")))
        self.w.abort(entry_id)
        self.state[entry_id] = "reissue"

    @precondition(lambda self: not self.batch)
    @rule()
    def take(self) -> None:
        batch = self.w.take_batch()
        buffered = self._ids("buffered")
        edf = sorted(buffered, key=lambda i: self.oldest[i])[: self.b]
        rest = [self.oldest[i] + self.k for i in buffered if i not in edf]
        rest += [self.start[i] + self.k for i in self._ids("in_flight")]
        if batch is None:  # waiting is allowed only if taking now would doom a straggler
            assert len(buffered) < self.b or not _schedulable(rest, self.version + 1, self.b)
            return
        assert len(batch) == len(set(batch)) == self.b and set(batch) <= set(buffered)
        staleness = [self.version - self.oldest[i] for i in batch]
        assert max(staleness) <= self.k
        assert self.w.last_batch_staleness == staleness
        left = [self.oldest[i] for i in buffered if i not in batch]
        assert all(o >= max(self.oldest[i] for i in batch) for o in left), "oldest first"
        if self.k == 0:
            assert all(self.start[i] == self.oldest[i] == self.version for i in batch)
        self.batch = batch
        for entry_id in batch:
            self.state[entry_id] = "taken"

    @precondition(lambda self: self.batch)
    @rule()
    def train_step(self) -> None:
        assert self.w.advance() == self.version + 1
        self.version += 1
        for entry_id in self.batch:
            self.state[entry_id] = "trained"
        self.batch = []
        if self.immediate:
            self.engine = self.version

    @rule()
    def sync(self) -> None:
        self.engine = self.version

    @precondition(lambda self: self.restores)
    @rule()
    def checkpoint_restore(self) -> None:
        self.w = _roundtrip(self.w)
        for entry_id, s in self.state.items():
            self.state[entry_id] = {"in_flight": "reissue", "taken": "buffered"}.get(s, s)
        self.batch = []
        self.engine = self.version  # fresh actors load the checkpoint's weights

    @invariant()
    def ledger_matches_model(self) -> None:
        w = self.w
        views = {
            "in_flight": set(w.in_flight),
            "buffered": set(w.buffered),
            "taken": set(w.taken),
            "trained": w.trained,
            "reissue": set(w.reissue),
            "dropped": w.dropped,
        }
        for name in _STATES:
            assert views[name] == set(self._ids(name)), name
        assert sum(len(v) for v in views.values()) == len(self.state)  # disjoint, nothing lost
        assert dict(w.in_flight) == {i: self.start[i] for i in self._ids("in_flight")}
        assert dict(w.buffered) == {i: self.oldest[i] for i in self._ids("buffered")}
        assert self._occupancy() <= w.capacity
        assert w.version == self.version
        assert w.stats.evicted == 0, "admission control must make eviction unnecessary"


TestWindowMachine = WindowMachine.TestCase
TestWindowMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
