"""``task = "reasoning_gym:<dataset>"`` (or ``"reasoning_gym"`` with a weighted composite): the
procedural datasets of `reasoning-gym <https://github.com/open-thought/reasoning-gym>`_, offline.

Needs the ``loong-train[reasoning-gym]`` extra. The ``[reasoning_gym]`` table:

- ``datasets``: ``{name = weight}`` for a composite (``task = "reasoning_gym"``); with
  ``task = "reasoning_gym:<name>"`` that one dataset, weight 1. ``config``: per dataset, the
  generator's keyword arguments (``config.leg_counting = {min_animals = 2, max_animals = 3}``).
- ``seed``, ``eval_size``, ``train_size``: each dataset is generated once with ``seed`` and
  ``eval_size + train_size`` items; held-out items are its first ``eval_size`` indices, training
  items the rest, and a training item whose question equals a held-out one is skipped. Splitting
  by index range, never by seed, matters: reasoning-gym's item ``i`` of seed ``s + 1`` is item
  ``i + 1`` of seed ``s``, so neighbouring seeds share almost every item.
- ``answer_format``: ``"tags"`` (the answer is what the model writes inside ``<answer>...</answer>``,
  reasoning-gym's convention; ``system_prompt`` empty: its ``default`` system prompt) or
  ``"plain"`` (the whole final turn, stripped: what a tiny model can learn).
- ``scoring``: ``"strict"`` (1 when the extracted answer, stripped, equals the reference, else 0)
  or ``"dataset"`` (the dataset's own ``score_answer``, which gives partial credit, e.g. 0.6 for
  the right number with a leading space and 0.75 for it with a character in front: a small model
  learns to exploit that, so strict is the default). A scorer that raises on a malformed answer
  scores 0 and is counted (``scorer_errors``), and the run goes on.

Every item is tagged with its dataset (``tags.domain``), so evaluation reports held-out success
per dataset. Building the task logs each dataset's unique question count (small configs repeat).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterator, Sequence

from loong_agentflow import ToolRegistry
from loong_core.config import ConfigError
from loong_train.tasks.base import AgentCommand, Item, Task, answer_demonstration
from loong_train.tasks.config import ReasoningGymConfig

__all__ = ["PREFIX", "ReasoningGymConfig", "ReasoningGymTask"]

PREFIX = "reasoning_gym"
log = logging.getLogger("loong.reasoning_gym")


class ReasoningGymTask(Task):
    """A :class:`~loong_train.tasks.Task` over reasoning-gym datasets (no tools)."""

    def __init__(self, config: ReasoningGymConfig, dataset: str = "") -> None:
        try:
            import reasoning_gym
            from reasoning_gym.utils import SYSTEM_PROMPTS
        except ImportError as e:
            raise ConfigError(
                f"task {PREFIX!r} needs reasoning-gym: pip install 'loong-train[reasoning-gym]' ({e})"
            ) from e
        weights = {dataset: 1.0} if dataset else dict(config.datasets)
        if not weights:
            raise ConfigError(f"task = {PREFIX!r} needs reasoning_gym.datasets = {{name = weight, ...}}")
        self.config, self.weights, self.scorer_errors = config, weights, 0
        size = config.eval_size + config.train_size
        self.datasets = {}
        for name in weights:
            try:
                self.datasets[name] = reasoning_gym.create_dataset(
                    name, size=size, seed=config.seed, **config.config.get(name, {})
                )
            except Exception as e:  # an unknown name or a bad generator config
                raise ConfigError(f"reasoning_gym dataset {name!r}: {type(e).__name__}: {e}") from e
        system = config.system_prompt or (SYSTEM_PROMPTS["default"] if config.answer_format == "tags" else "")
        self.system = system
        self.eval = self._held_out_items()
        self.held_questions = {item["messages"][-1]["content"] for item in self.eval}
        for name, ds in self.datasets.items():
            unique = len({ds[i]["question"] for i in range(min(len(ds), 2000))})
            log.info(
                "reasoning_gym %s: %d items, %d unique questions in the first 2000", name, len(ds), unique
            )

    def _item(self, name: str, index: int) -> Item:
        entry = self.datasets[name][index]
        messages = [{"role": "user", "content": entry["question"]}]
        if self.system:
            messages = [{"role": "system", "content": self.system}, *messages]
        return {
            "id": f"{name}:{index}",
            "messages": messages,
            "answer": str(entry["answer"]),
            "tags": {"domain": name},
            "source": [name, index],
        }

    def _held_out_items(self) -> list[Item]:
        """``eval_size`` items in all, each dataset's share by weight, interleaved by a seeded draw."""
        total = sum(self.weights.values())
        shares = {n: max(1, math.floor(self.config.eval_size * w / total)) for n, w in self.weights.items()}
        order = [n for n, k in shares.items() for _ in range(k)]
        random.Random(self.config.seed).shuffle(order)
        taken = dict.fromkeys(shares, 0)
        items = []
        for name in order:
            items.append(self._item(name, taken[name]))
            taken[name] += 1
        return items

    def held_out(self, n: int) -> list[Item]:
        return self.eval[:n]

    def train_stream(self, seed: int, held_out: Sequence[Item]) -> Iterator[Item]:
        rng, names = random.Random(seed), list(self.weights)
        weights = [self.weights[n] for n in names]
        low = self.config.eval_size
        banned = self.held_questions | {i["messages"][-1]["content"] for i in held_out}
        while True:
            name = rng.choices(names, weights)[0]
            item = self._item(name, rng.randrange(low, len(self.datasets[name])))
            if item["messages"][-1]["content"] not in banned:
                yield item

    def tools(self) -> ToolRegistry:
        return ToolRegistry([])

    def extract(self, completion: str) -> str | None:
        if self.config.answer_format == "plain":
            return completion.strip()
        from reasoning_gym.utils import extract_answer

        return extract_answer(completion)

    def reward(self, item: Item, answer: str) -> float:
        extracted = self.extract(answer)
        if extracted is None:
            return 0.0
        if self.config.scoring == "strict":
            return float(extracted.strip() == item["answer"].strip())
        name, index = item["source"]
        try:
            return float(self.datasets[name].score_answer(extracted, self.datasets[name][index]))
        except Exception as e:  # some scorers raise on malformed answers: 0, counted, logged
            self.scorer_errors += 1
            log.warning(
                "reasoning_gym %s scorer raised on %r (item %s): %s", name, extracted[:80], item["id"], e
            )
            return 0.0

    def agent_command(self) -> AgentCommand | None:
        return None

    def demonstration(self, item: Item) -> list[tuple[str, bool]]:
        """The dataset's own answer, in ``<answer>`` tags or plain (``answer_format``)."""
        tagged = self.config.answer_format == "tags"
        return answer_demonstration(item, f"<answer>{item['answer']}</answer>" if tagged else item["answer"])
