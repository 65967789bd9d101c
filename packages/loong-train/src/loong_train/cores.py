"""Idle cores lent to the trainer: an engine's threads train while it has nothing to decode.

On a CPU node each rollout worker reserves ``threads`` cores and the trainer ``train.threads``.
An engine rests between its bursts (the staleness bound holds it until the next version; its
episodes wait on tools), while the trainer's step is the critical path; training on a resting
engine's core shortens the step (SmolLM2-135M-Instruct: a GRPO step on 1 thread 9.8-10.1 s, on
2 threads 5.6-5.8 s). Running both at once on one core costs far more than either alone (each
parallel region waits for its slowest thread), so a core is lent only while its engine rests and
is taken back the moment the engine works again.

A :class:`CoreBoard` is one small shared file per run and node, one byte a worker: the threads
it lends now (0 while its engine works). Engines write their byte (an unwritten one lends
nothing); the trainer reads the sum. A :class:`Borrower` sets the trainer's torch threads to its
own plus the lent ones before every linear layer's forward and backward, so it follows an
engine within one layer, and writes how many it borrows; an engine taking its threads back waits
(a bounded time) until the trainer has given them back. Thread counts then follow timing: a run
with lending on gives the same results only up to rounding (``[train] borrow_idle_threads``, off
by default).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["Borrower", "CoreBoard", "remove_board"]


def _path(name: str) -> Path:
    return Path(tempfile.gettempdir()) / f"loong-{name}.cores"


def remove_board(name: str) -> None:
    """Remove run ``name``'s board on this node (the trainer removes it at its end; this also
    when the trainer died first)."""
    _path(name).unlink(missing_ok=True)


class CoreBoard:
    """The threads the resting workers of run ``name`` lend on this node (``slots``: one per
    worker), and how many of them the trainer runs on now (``borrowed``)."""

    def __init__(self, name: str, slots: int) -> None:
        self.path = _path(name)
        self.slots = slots
        size = 1 + slots  # byte 0: borrowed; then one a worker
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:  # the first to open it sizes it; zeros lend nothing
                os.ftruncate(fd, size)
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

    def reclaim(self, slot: int, wait_s: float = 0.0) -> None:
        """Worker ``slot`` works again: it lends nothing. Waits up to ``wait_s`` for the trainer
        to give the threads back (it does before its next linear layer), so the two never share
        a core, which would slow both."""
        self._map[1 + slot] = 0
        deadline = time.monotonic() + wait_s
        while self.borrowed > self.lent() and time.monotonic() < deadline:
            time.sleep(0.0005)

    def lent(self) -> int:
        """Threads lent now, by every worker on this node."""
        return sum(self._map[1 : 1 + self.slots])

    def close(self, unlink: bool = False) -> None:
        """Unmap (``unlink``: and remove the file; a worker's map stays valid until it closes)."""
        self._map.close()
        if unlink:
            self.path.unlink(missing_ok=True)


class Borrower:
    """Sets this process's torch threads to ``own`` plus what ``board`` lends, before each linear
    layer of a model runs forward or backward (hooks; :meth:`hooks`). ``threads_mean``: the
    thread count averaged over the time since :meth:`reset`, for the step's metrics."""

    def __init__(self, board: CoreBoard, own: int) -> None:
        self.board, self.own = board, own
        self.threads = own
        self.reset()

    def reset(self) -> None:
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
        """Back to ``own`` threads: the lent ones are the engines' again."""
        self._set(self.own)

    def _set(self, threads: int) -> None:
        if threads != self.threads:
            now = time.perf_counter()
            self._thread_s += self.threads * (now - self._changed)
            self._changed, self.threads = now, threads
            torch.set_num_threads(threads)
            self.board.borrowed = threads - self.own

    @contextlib.contextmanager
    def hooks(self, model: torch.nn.Module) -> Iterator[None]:
        """Within: every ``nn.Linear`` of ``model`` adjusts before its forward, and before its
        backward (a hook on its output's gradient); after: back to ``own`` threads."""

        def before_forward(module, args) -> None:
            self.adjust()

        def after_forward(module, args, output) -> None:
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(before_backward)

        def before_backward(grad):
            self.adjust()

        handles = []
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                handles.append(module.register_forward_pre_hook(before_forward))
                handles.append(module.register_forward_hook(after_forward))
        try:
            self.reset()
            self.adjust()
            yield
        finally:
            for handle in handles:
                handle.remove()
            self.release()
