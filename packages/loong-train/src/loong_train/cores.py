"""Idle cores lent to the trainer: a rollout worker's threads train while it has nothing to run.

On a CPU node each rollout worker reserves ``threads`` cores and the trainer ``train.threads``.
An engine rests between its bursts (the staleness bound holds it until the next version; its
episodes wait on tools), while the trainer's step is the critical path; training on a resting
worker's core shortens the step (SmolLM2-135M-Instruct: a GRPO step on 1 thread 9.8-10.1 s, on
2 threads 5.6-5.8 s). Running both at once on one core costs far more than either alone (each
parallel region waits for its slowest thread), so a core is lent only while its worker rests and
is taken back when the worker works again.

A :class:`CoreBoard` is one small shared file per run and node: the threads the trainer borrows
now, then one byte a worker, the threads it lends now. A worker's :class:`Lender` writes its
byte (0 while its engine decodes or scores, or new weights go in; an unwritten byte lends
nothing). The trainer's :class:`Borrower` sets its torch threads to its own plus the lent ones
before every linear layer's forward and backward, and writes how many it borrows; a worker taking
its threads back waits, at most ``Lender.wait_s``, until the trainer has given them back at its
next linear layer (a KL reference's included), LM head chunk (:func:`adjust_threads`) or
optimizer step. Thread counts then follow timing, as a step's products round differently
on one thread and on two: a run with lending on may diverge from another with the same seed
(``[train] borrow_idle_threads``, off by default).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["Borrower", "CoreBoard", "Lender", "adjust_threads", "board_path", "remove_board"]

log = logging.getLogger("loong.cores")

_WORKERS = 255  # slots on a board, so every process maps the same size


_borrowing: Borrower | None = None  # the Borrower whose hooks are on in this process


def adjust_threads() -> None:
    """Where a :class:`Borrower`'s hooks are on, take the threads lent now (work that runs no
    linear layer of its own calls this: the LM head's chunks); elsewhere nothing."""
    if _borrowing is not None:
        _borrowing.adjust()


def board_path(name: str) -> Path:
    """Where run ``name``'s board is on this node."""
    shm = Path("/dev/shm")  # memory, where Linux has it
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / f"loong-{name}.cores"


def remove_board(name: str) -> None:
    """Remove run ``name``'s board on this node (the trainer and the rollout workers remove it at
    their end; this also when they died first)."""
    board_path(name).unlink(missing_ok=True)


class CoreBoard:
    """The threads the resting workers of run ``name`` lend on this node, and how many of them
    the trainer runs on now (``borrowed``)."""

    def __init__(self, name: str) -> None:
        self.name, self.path = name, board_path(name)
        size = 1 + _WORKERS  # byte 0: borrowed; then one a worker
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, size)  # the same size in every process: zeros lend nothing
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)

    @property
    def borrowed(self) -> int:
        return self._map[0]

    @borrowed.setter
    def borrowed(self, threads: int) -> None:
        self._map[0] = min(threads, 255)

    def lend(self, slot: int, threads: int) -> None:
        """Worker ``slot`` rests: its ``threads`` may train."""
        self._map[1 + slot] = min(threads, 255)

    def reclaim(self, slot: int) -> None:
        """Worker ``slot`` works again: it lends nothing."""
        self._map[1 + slot] = 0

    def returned(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` until the trainer borrows no more than is lent."""
        deadline = time.monotonic() + wait_s
        while self.borrowed > self.lent() and time.monotonic() < deadline:
            time.sleep(0.0005)

    def lent(self) -> int:
        """Threads lent now, by every worker on this node."""
        return sum(self._map[1:])

    def close(self, unlink: bool = False) -> None:
        """Unmap (``unlink``: and remove the file; another process's map stays valid until it
        closes)."""
        self._map.close()
        if unlink:
            self.path.unlink(missing_ok=True)


class Lender:
    """A rollout worker's side of run ``name``'s board (slot ``slot``): it lends ``threads`` while
    no work is open. :meth:`working` opens work (the engine's decode and scoring spells, a weight
    install; from any thread), taking the threads back and waiting, at most ``wait_s``, for the
    trainer to give them back."""

    def __init__(self, name: str, slot: int, threads: int, wait_s: float = 0.25) -> None:
        self.board, self.slot, self.threads, self.wait_s = CoreBoard(name), slot, threads, wait_s
        self._open, self._lock = 0, threading.Lock()
        self.board.lend(slot, threads)

    def begin(self) -> bool:
        """Work opens now. True when that took the threads back: then :meth:`wait_returned`
        before running (where waiting blocks nothing else)."""
        with self._lock:
            self._open += 1
            if self._open > 1:
                return False
            self.board.reclaim(self.slot)
            return True

    def wait_returned(self) -> None:
        self.board.returned(self.wait_s)

    def end(self) -> None:
        with self._lock:
            self._open -= 1
            if self._open == 0:
                self.board.lend(self.slot, self.threads)

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        if self.begin():
            self.wait_returned()
        try:
            yield
        finally:
            self.end()

    def close(self) -> None:
        """Lend nothing more and remove the board: the run is over (on a node without the
        trainer, nothing else would remove it; the trainer's map stays valid where it has one)."""
        self.board.reclaim(self.slot)
        self.board.close(unlink=True)


class Borrower:
    """Sets this process's torch threads to ``own`` plus what run ``name``'s board lends, before each linear
    layer of a model runs forward or backward, each optimizer step and each LM head chunk (hooks;
    :meth:`hooks`). ``threads_mean``: the thread count averaged over the time since the hooks went
    on, for the step's metrics."""

    def __init__(self, name: str, own: int) -> None:
        self.board, self.own = CoreBoard(name), own
        self.threads = own
        self.board.borrowed = 0  # a board left by an earlier trainer of this run (restarted)
        self._reset()

    def _reset(self) -> None:
        self._since = self._changed = time.perf_counter()
        self._thread_s = 0.0

    @property
    def threads_mean(self) -> float:
        now = time.perf_counter()
        total = self._thread_s + self.threads * (now - self._changed)
        return total / (now - self._since) if now > self._since else float(self.threads)

    def adjust(self) -> None:
        """Take the threads lent now (called on the thread that runs the model)."""
        self._set(self.own + self.board.lent())

    def release(self) -> None:
        """Back to ``own`` threads: the lent ones are the workers' again."""
        self._set(self.own)

    def _set(self, threads: int) -> None:
        if threads == self.threads:
            return
        now = time.perf_counter()
        self._thread_s += self.threads * (now - self._changed)
        self._changed, self.threads = now, threads
        torch.set_num_threads(threads)
        self.board.borrowed = threads - self.own

    @contextlib.contextmanager
    def hooks(self, model: torch.nn.Module, *others: torch.nn.Module) -> Iterator[None]:
        """Within: every ``nn.Linear`` of ``model`` (and of ``others``: a KL reference) adjusts
        before its forward, and before its backward (a hook on its output's gradient), every
        optimizer before its step and :func:`adjust_threads` when called; after: back to ``own``
        threads."""

        def before_forward(module, args) -> None:
            self.adjust()

        def after_forward(module, args, output) -> None:
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(before_backward)

        def before_backward(grad):
            self.adjust()

        handles = []
        for module in (m for each in (model, *others) for m in each.modules()):
            if isinstance(module, torch.nn.Linear):
                handles.append(module.register_forward_pre_hook(before_forward))
                handles.append(module.register_forward_hook(after_forward))
        if not handles:
            log.warning("%s has no nn.Linear layers: it runs on its own threads only", type(model).__name__)
        handles.append(register_optimizer_step_pre_hook(lambda *_: self.adjust()))
        global _borrowing
        outer, _borrowing = _borrowing, self
        try:
            self._reset()
            self.adjust()
            yield
        finally:
            _borrowing = outer
            for handle in handles:
                handle.remove()
            self.release()

    def close(self) -> None:
        """Give every thread back and remove the board (the run is over)."""
        self.release()
        self.board.close(unlink=True)
