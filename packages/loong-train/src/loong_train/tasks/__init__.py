"""Synthetic agentic tasks with verifiable rewards, addressed by a recipe's ``task`` name.

Every task set shares the calculator tool, reward and demonstration layout of :mod:`calc`; they
differ in which questions they draw and in the routing tags the questions carry:

- ``calc``: ``compute A<op>B`` with ``op`` in ``+ - *``, untagged.
- ``calc-domains``: the same questions in two tagged domains, ``add`` and ``mul``, in equal shares.
- ``calc-add``, ``calc-mul``: one domain each (how the tiny OPD recipe trains its teachers).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from loong_train.tasks import calc, calc_domains

__all__ = ["EVAL_SEED", "TASKS", "eval_tasks", "train_tasks"]

EVAL_SEED = 1_000_003
_DOMAINS = {"calc-domains": tuple(calc_domains.DOMAINS), "calc-add": ("add",), "calc-mul": ("mul",)}
TASKS = ("calc", *_DOMAINS)


def eval_tasks(task: str, n: int, seed: int = EVAL_SEED) -> list[dict[str, Any]]:
    """Held-out (or, with another seed, probe) questions of ``task``."""
    if task == "calc":
        return calc.eval_tasks(n, seed)
    return calc_domains.eval_tasks(n, seed, _DOMAINS[task])


def train_tasks(task: str, seed: int, held_out: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """An endless stream of training questions of ``task``, none of them in ``held_out``."""
    if task == "calc":
        return calc.train_tasks(seed, held_out)
    return calc_domains.train_tasks(seed, held_out, _DOMAINS[task])
