"""Which local teachers are resident, within a byte budget, least recently used evicted first.

Accounting: ``reserved`` is every byte this pool holds: the files of resident mapped teachers, and
every byte buffer of the others, whether a resident teacher's weights are in it or it waits, freed
by an eviction, to be reused (a caching allocator: teachers of equal size swap through the same
buffers, so paging in is a copy into memory already touched; a mapped teacher takes no buffer and
leaves none). Invariant, checked after every step: ``reserved <= budget``. Since the teacher being
scored is resident, the teachers' weights never take more than the budget; scoring adds only its
activations.

:meth:`Residency.acquire` makes a teacher resident:

1. already resident: mark it most recently used;
2. else (unless it is mapped) reuse the smallest free buffer of at least its size on its device;
3. else, while ``reserved + size > budget``: release a free buffer, or evict the least recently
   used resident teacher (its buffer becomes free and is reused at once if large enough);
4. count its bytes as reserved when no buffer was reused.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from loong_teacher.local import LocalTeacher

__all__ = ["Residency", "TeacherBudgetError"]


class TeacherBudgetError(ValueError):
    """The memory budget cannot hold the largest local teacher."""


class Residency:
    """LRU set of resident :class:`LocalTeacher` s within ``budget`` bytes."""

    def __init__(self, budget: int, teachers: list[LocalTeacher]) -> None:
        largest = max(teachers, key=lambda t: t.nbytes, default=None)
        if largest is not None and largest.nbytes > budget:
            raise TeacherBudgetError(
                f"budget_bytes = {budget} is smaller than local teacher {largest.name!r} "
                f"({largest.nbytes} bytes); the teacher being scored must fit, so raise budget_bytes "
                f"to at least {largest.nbytes}"
            )
        self.budget = budget
        self.lru: OrderedDict[str, LocalTeacher] = OrderedDict()
        self.free: list[torch.Tensor] = []
        self.reserved = 0
        self.peak = 0
        self.paged_in = 0  # bytes made resident, all time
        self.loads: dict[str, int] = {t.name: 0 for t in teachers}
        self.evictions = 0

    def acquire(self, teacher: LocalTeacher) -> None:
        if teacher.name in self.lru:
            self.lru.move_to_end(teacher.name)
            return
        storage = self._take_free(teacher)
        while storage is None and self.reserved + teacher.nbytes > self.budget:
            if self.free:
                self._release(max(self.free, key=_nbytes))
            else:
                self._evict()
            storage = self._take_free(teacher)
        if storage is None:
            self.reserved += teacher.nbytes
        self.peak = max(self.peak, self.reserved)
        assert self.reserved <= self.budget
        self.paged_in += teacher.page_in(storage)
        self.loads[teacher.name] += 1
        self.lru[teacher.name] = teacher

    def resident(self) -> list[str]:
        """Resident teachers, least recently used first."""
        return list(self.lru)

    def clear(self) -> None:
        while self.lru:
            self._evict()
        for buf in list(self.free):
            self._release(buf)

    def _take_free(self, teacher: LocalTeacher) -> torch.Tensor | None:
        if teacher.mapped:
            return None
        fits = [b for b in self.free if b.device == teacher.device and _nbytes(b) >= teacher.nbytes]
        if not fits:
            return None
        best = min(fits, key=_nbytes)
        self.free = [b for b in self.free if b is not best]
        return best

    def _evict(self) -> None:
        _, teacher = self.lru.popitem(last=False)
        if (buf := teacher.page_out()) is None:  # mapped: its pages are unmapped
            self.reserved -= teacher.nbytes
        else:
            self.free.append(buf)
        self.evictions += 1

    def _release(self, buf: torch.Tensor) -> None:
        self.free = [b for b in self.free if b is not buf]
        self.reserved -= _nbytes(buf)


def _nbytes(buf: torch.Tensor) -> int:
    return buf.numel()
