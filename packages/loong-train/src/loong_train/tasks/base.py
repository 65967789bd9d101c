"""The task seam: where a run's prompts, tools and rewards come from.

The controller draws training and held-out items from a :class:`Task`; every rollout worker builds
the same task to run its episodes (its tools and reward for white-box agents, its agent program
for black-box ones). Nothing above this seam imports a concrete task: :func:`loong_train.tasks.build_task`
picks one by name or import path.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec

from loong_agentflow import Agent, ChatML, ToolRegistry

__all__ = ["AgentCommand", "Item", "Task", "answer_demonstration"]

Item = dict[str, Any]
"""One task item: plain data that crosses processes inside an ``EpisodeSpec``. ``"messages"`` (the
chat prompt, a list of ``{"role", "content"}``) is required; ``"tags"`` (``{str: str}``) routes the
item (``domain``: its teacher in distillation, its curve in evaluation); any other key is the
task's own (a reference answer, metadata)."""


class AgentCommand(msgspec.Struct, frozen=True, kw_only=True):
    """A task's black-box agent: the program every episode runs (the contract of
    :mod:`loong_agentflow.blackbox`), the modules its episodes fork after importing once
    (``preload``, see :mod:`loong_agentflow.forkserver`) and the modules it needs installed
    (``requires``; ``install`` says how to get them)."""

    argv: list[str]
    preload: list[str] = []
    requires: list[str] = []
    install: str = ""


class Task:
    """Training and held-out items, tools, and the reward of an episode's final answer.

    Lifecycle: one instance per process that needs it (the controller for data, each rollout
    worker for episodes), built by :func:`loong_train.tasks.build_task` with no arguments beyond
    its config, so every process builds the same task. A task subclasses this class and defines
    the first three methods; the others have defaults. A task with no tools::

        class Echo(Task):
            def held_out(self, n):
                return [{"messages": [{"role": "user", "content": f"say {i}"}], "answer": str(i)}
                        for i in range(n)]

            def train_stream(self, seed, held_out):
                rng = random.Random(seed)
                while True:
                    i = rng.randint(1000, 9999)          # never one of held_out's answers
                    yield {"messages": [{"role": "user", "content": f"say {i}"}], "answer": str(i)}

            def reward(self, item, answer):
                return float(answer.strip() == item["answer"])
    """

    group_reward: Callable[..., Any] | None = None
    """A function that scores a whole GRPO group at once (then ``reward`` scores nothing), or None."""

    def held_out(self, n: int) -> list[Item]:
        """The first ``n`` held-out items, the same on every call and in every process."""
        raise NotImplementedError(f"{type(self).__name__}.held_out")

    def train_stream(self, seed: int, held_out: Sequence[Item]) -> Iterator[Item]:
        """Training items in a seeded order, never one of ``held_out``; endless (a finite data set
        cycles), so a run of any length has prompts."""
        raise NotImplementedError(f"{type(self).__name__}.train_stream")

    def reward(self, item: Item, answer: str) -> float:
        """The reward of an episode of ``item`` whose final answer is ``answer``."""
        raise NotImplementedError(f"{type(self).__name__}.reward")

    def tools(self) -> ToolRegistry:
        """The tools a white-box episode may call (default: none)."""
        return ToolRegistry([])

    def agent_command(self) -> AgentCommand | None:
        """The task's own black-box agent program (``agent.command`` unset), or None (default)."""
        return None

    def agent(self, chat: Any = ChatML) -> Agent | None:
        """The white-box agent that runs the task's episodes, laying them out with ``chat`` (an
        environment task's :class:`~loong_agentflow.EnvAgent`); None (default): a
        :class:`~loong_agentflow.ToolAgent` over ``tools()`` and ``reward``."""
        return None

    @property
    def runs_own_agent(self) -> bool:
        """Whether the task defines :meth:`agent` (and so runs its own tools)."""
        return type(self).agent is not Task.agent

    def demonstration(self, item: Item) -> list[tuple[str, bool]]:
        """An expert episode of ``item`` as ``(text, is_model)`` pieces, laid out exactly as its
        agent lays out the token buffer: what the tiny warm start (:mod:`loong_train.tiny.warmstart`)
        trains on. Tasks without demonstrations leave it undefined (:attr:`demonstrates`)."""
        raise NotImplementedError(f"task {type(self).__name__} has no demonstrations")

    @property
    def demonstrates(self) -> bool:
        """Whether the task defines :meth:`demonstration`."""
        return type(self).demonstration is not Task.demonstration

    def probe(self, n: int, seed: int, held_out: Sequence[Item]) -> list[Item]:
        """The items whose sampled success stops the tiny warm start (default: the first ``n`` of
        a training stream of ``seed``)."""
        return list(itertools.islice(self.train_stream(seed, held_out), n))


def answer_demonstration(item: Item, answer: str) -> list[tuple[str, bool]]:
    """A single-turn expert episode: the prompt as :class:`~loong_agentflow.ToolAgent` renders it,
    then ``answer`` and the end of turn, the model's tokens."""
    return [(ChatML.prompt(item["messages"]), False), (f"{answer}{ChatML.END}", True)]
