"""The calculator task split into two routing domains: ``add`` (``+`` or ``-``) and ``mul`` (``*``).

Questions, tool, reward and demonstrations are :mod:`calc`'s; every task also carries
``tags = {"domain": d}``, which travels with its episodes into each ``Trajectory`` (and its
TrainBatch row) and routes the row to that domain's teacher in on-policy distillation.

Task sets (names in :data:`loong_train.tasks.SHIPPED`): ``calc-domains`` alternates the domains
(so every batch and the held-out set hold them in equal shares); ``calc-add`` and ``calc-mul`` are
one domain each. A one-domain held-out set is that domain's part of the two-domain held-out set
of the same size, so a teacher trained on ``calc-add`` never sees a question the student's run
evaluates on.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from typing import Any

from loong_train.tiny import calc
from loong_train.tiny.calc import EVAL_SEED, random_task

__all__ = ["DOMAINS", "CalcDomainsTask", "domain", "eval_tasks", "train_tasks"]

DOMAINS: dict[str, str] = {"add": "+-", "mul": "*"}


def domain(task: dict[str, Any]) -> str:
    return task["tags"]["domain"]


def _tagged(rng: random.Random, name: str) -> dict[str, Any]:
    return {**random_task(rng, DOMAINS[name]), "tags": {"domain": name}}


def eval_tasks(n: int, seed: int, domains: Sequence[str] = tuple(DOMAINS)) -> list[dict[str, Any]]:
    """The two-domain held-out set of ``n`` questions (domains alternate), kept to ``domains``."""
    rng, cycle = random.Random(seed), itertools.cycle(DOMAINS)
    every = [_tagged(rng, next(cycle)) for _ in range(n)]
    return [t for t in every if domain(t) in domains]


def train_tasks(
    seed: int, held_out: list[dict[str, Any]], domains: Sequence[str] = tuple(DOMAINS)
) -> Iterator[dict[str, Any]]:
    """An endless stream cycling through ``domains``, skipping any held-out expression."""
    rng, banned, cycle = random.Random(seed), {t["expr"] for t in held_out}, itertools.cycle(domains)
    while True:
        task = _tagged(rng, next(cycle))
        if task["expr"] not in banned:
            yield task


class CalcDomainsTask(calc.CalcTask):
    """A task set of ``domains`` (``calc-domains``, ``calc-add``, ``calc-mul``) as a
    :class:`~loong_train.tasks.Task`; tools, reward, demonstrations and agent are ``calc``'s."""

    def __init__(self, domains: Sequence[str]) -> None:
        self.domains = tuple(domains)

    def held_out(self, n: int) -> list[dict[str, Any]]:
        return eval_tasks(n, EVAL_SEED, self.domains)

    def probe(self, n: int, seed: int, held_out: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
        return eval_tasks(n, seed, self.domains)

    def train_stream(self, seed: int, held_out: Sequence[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        return train_tasks(seed, list(held_out), self.domains)
