"""``task = "arithmetic"``: sums of two small numbers asked in plain words, for a pretrained chat model.

A question is ``What is A+B?`` with ``A`` and ``B`` in 1..20, the user turn of a chat, no tools and
no instruction about the answer's form. The reward reads the answer as GSM8K-style graders do
(verl's flexible ``gsm8k`` score, TRL's examples): 1 when the last integer in the final turn equals
``A + B``, else 0. A pretrained instruct model answers in its own words ("7 + 8 = 15."), so what
RL has to change is what the model computes and how often its sampled answers wander off (at
temperature 1, SmolLM2-135M-Instruct's sampled success is about 0.1 and its greedy one about 0.35).

The 400 questions are split once, by a fixed shuffle: held-out items are its first ``n``,
training items the others, drawn in a seeded order that reshuffles after every pass.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence

from loong_agentflow import ToolRegistry
from loong_train.tasks.base import Item, Task, answer_demonstration

__all__ = ["ArithmeticTask", "last_integer"]

_LOW, _HIGH = 1, 20
_SPLIT_SEED = 20_261_204
_INTEGER = re.compile(r"-?\d+")


def last_integer(text: str) -> int | None:
    """The last integer written in ``text`` (a leading minus sign kept), or None."""
    found = _INTEGER.findall(text)
    return int(found[-1]) if found else None


def _questions() -> list[Item]:
    pairs = [(a, b) for a in range(_LOW, _HIGH + 1) for b in range(_LOW, _HIGH + 1)]
    random.Random(_SPLIT_SEED).shuffle(pairs)
    return [
        {
            "messages": [{"role": "user", "content": f"What is {a}+{b}?"}],
            "answer": str(a + b),
            "id": f"{a}+{b}",
        }
        for a, b in pairs
    ]


class ArithmeticTask(Task):
    """The ``arithmetic`` task (see the module docstring)."""

    def __init__(self) -> None:
        self._items = _questions()

    def held_out(self, n: int) -> list[Item]:
        if n >= len(self._items):
            raise ValueError(
                f"task 'arithmetic' has {len(self._items)} questions: eval.num_tasks = {n} leaves none to train on "
                f"(expected at most {len(self._items) - 1})"
            )
        return self._items[:n]

    def train_stream(self, seed: int, held_out: Sequence[Item]) -> Iterator[Item]:
        banned = {item["id"] for item in held_out}
        pool = [item for item in self._items if item["id"] not in banned]
        rng = random.Random(seed)
        while True:
            rng.shuffle(pool)
            yield from pool

    def tools(self) -> ToolRegistry:
        return ToolRegistry([])

    def reward(self, item: Item, answer: str) -> float:
        return float(last_integer(answer) == int(item["answer"]))

    def demonstration(self, item: Item) -> list[tuple[str, bool]]:
        return answer_demonstration(item, item["answer"])

    def agent_command(self) -> None:
        return None
