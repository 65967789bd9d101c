"""What a teacher scores and what it returns: the ``Teacher`` seam shared by every backend.

A sample is any object with ``token_ids`` (``[seq]``), ``loss_mask`` (``[seq]``, 1 on tokens the
student sampled) and ``tags`` (``dict[str, str]``): a ``loong_core.records.Trajectory`` as it is, or a
:class:`ScoreRequest` from another framework. The teacher scores every position ``t`` with
``loss_mask[t] == 1``:

    logprob_t = log p_teacher(x_t | x_<t)                         (t >= 1; position 0 has no context)

and, when asked for the top k, the k most likely teacher tokens at that position with their
log-probabilities and the log of the mass left outside them (the tail bucket of top-k distillation).

Backends (one module each, chosen by the config's ``type``): ``local`` (a Hugging Face checkpoint
run in this process, :mod:`loong_teacher.local`) and ``sglang`` (an SGLang server scored with
prefill-only requests, :mod:`loong_teacher.remote`). The :class:`~loong_teacher.manager.TeacherManager`
routes samples to teachers and assembles :class:`~loong_teacher.manager.TeacherScores`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import msgspec
import torch

__all__ = ["RowScores", "Scorable", "ScoreRequest", "Teacher"]


class ScoreRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One sequence to score. Invariant: ``len(loss_mask) == len(token_ids)``; ``loss_mask[0] == 0``."""

    token_ids: list[int]
    loss_mask: list[int]
    tags: dict[str, str] = {}


@runtime_checkable
class Scorable(Protocol):
    """Anything with token ids, a loss mask of the same length and routing tags."""

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def loss_mask(self) -> Sequence[int]: ...

    @property
    def tags(self) -> Mapping[str, str]: ...


@dataclass(frozen=True)
class RowScores:
    """One sequence's scores at its scored positions (``n`` of them, in order).

    ``logprobs [n]`` float32; with top-k: ``topk_ids [n, k]`` int64 (in the ids the teacher was sent),
    ``topk_logprobs [n, k]`` and ``tail_logprobs [n]`` (log of the mass outside the k ids).
    """

    logprobs: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    tail_logprobs: torch.Tensor | None = None


@runtime_checkable
class Teacher(Protocol):
    """Scores token sequences at given positions.

    ``score(rows, top_k)``: each row is ``(token_ids, positions)`` with ``1 <= positions[i] < len(token_ids)``
    increasing; returns one :class:`RowScores` per row, ``positions`` long. Local teachers are made
    resident by the manager before ``score`` and released after; remote ones hold no local memory.
    """

    name: str

    def score(
        self, rows: Sequence[tuple[Sequence[int], Sequence[int]]], top_k: int = 0
    ) -> list[RowScores]: ...

    def close(self) -> None: ...
