"""Tasks: the :class:`Task` seam and the factory that picks a recipe's ``task``.

A recipe's ``task`` is a shipped name or the import path of a factory, ``"pkg.module:factory"``,
called with no arguments and returning a :class:`Task`. The shipped names are the calculator tasks
of the tiny recipes (:mod:`loong_train.tiny.calc`, :mod:`loong_train.tiny.calc_domains`):

- ``calc``: ``compute A<op>B`` with ``op`` in ``+ - *``, untagged;
- ``calc-domains``: the same questions in two tagged domains, ``add`` and ``mul``, in equal shares;
- ``calc-add``, ``calc-mul``: one domain each (how the tiny OPD recipe trains its teachers);
- ``data``: the user's rows (``[data]``) and reward function (``[reward]``): :mod:`loong_train.tasks.data`;
- ``env``: the user's multi-turn environment (``[environment]``) on the rows of ``[data]``:
  :mod:`loong_train.tasks.env`;
- ``reasoning_gym:<dataset>``, ``reasoning_gym`` (a weighted composite): reasoning-gym's procedural
  datasets, configured by ``[reasoning_gym]``: :mod:`loong_train.tasks.reasoning_gym`;
- ``verifiers``: a single-turn verifiers v1 taskset (``[verifiers]``), scored by its own rewards:
  :mod:`loong_train.tasks.verifiers`.

Tasks built from recipe tables get them as :class:`TaskTables`.

Choosing a task imports nothing: the module is imported when the task is built.
"""

from __future__ import annotations

import importlib

import msgspec

from loong_train.tasks.base import AgentCommand, Item, Task
from loong_train.tasks.data import DataConfig
from loong_train.tasks.env import EnvConfig
from loong_train.tasks.reasoning_gym import PREFIX, ReasoningGymConfig
from loong_train.tasks.reward import RewardConfig
from loong_train.tasks.verifiers import VerifiersConfig

__all__ = ["SHIPPED", "AgentCommand", "Item", "Task", "TaskTables", "build_task", "task_problem"]

SHIPPED: dict[str, tuple[str, dict]] = {
    "calc": ("loong_train.tiny.calc:CalcTask", {}),
    "calc-domains": ("loong_train.tiny.calc_domains:CalcDomainsTask", {"domains": ("add", "mul")}),
    "calc-add": ("loong_train.tiny.calc_domains:CalcDomainsTask", {"domains": ("add",)}),
    "calc-mul": ("loong_train.tiny.calc_domains:CalcDomainsTask", {"domains": ("mul",)}),
    "data": ("loong_train.tasks.data:DataTask", {}),
    "env": ("loong_train.tasks.env:EnvTask", {}),
    "verifiers": ("loong_train.tasks.verifiers:VerifiersTask", {}),
}


class TaskTables(msgspec.Struct, frozen=True, kw_only=True):
    """The recipe tables a task is built from: ``[data]`` and ``[reward]`` (``task = "data"``),
    ``[environment]`` (``task = "env"``, with ``[data]``), ``[reasoning_gym]``, ``[verifiers]``.
    Other tasks ignore them."""

    data: DataConfig = DataConfig()
    environment: EnvConfig = EnvConfig()
    reward: RewardConfig = RewardConfig()
    reasoning_gym: ReasoningGymConfig = ReasoningGymConfig()
    verifiers: VerifiersConfig = VerifiersConfig()


def task_problem(name: str) -> str:
    """Why ``name`` cannot name a task ("" when it can), checked without importing anything."""
    if name in SHIPPED or name == PREFIX or (name.count(":") == 1 and all(name.split(":"))):
        return ""
    return (
        f"unknown task {name!r} (expected a shipped task, one of {', '.join(map(repr, SHIPPED))}, "
        f"'{PREFIX}:<dataset>', '{PREFIX}', or the import path of a factory, 'pkg.module:factory')"
    )


def build_task(name: str, tables: TaskTables | None = None) -> Task:
    """The task ``name`` names (see the module docstring), built from the recipe's ``tables``."""
    if problem := task_problem(name):
        raise ValueError(problem)
    tables = tables or TaskTables()
    if name == PREFIX or name.startswith(f"{PREFIX}:"):
        from loong_train.tasks.reasoning_gym import ReasoningGymTask

        return ReasoningGymTask(tables.reasoning_gym, name.partition(":")[2])
    path, kwargs = SHIPPED.get(name, (name, {}))
    if name == "data":
        kwargs = {"data": tables.data, "reward": tables.reward}
    elif name == "env":
        kwargs = {"env": tables.environment, "data": tables.data, "reward": tables.reward}
    elif name == "verifiers":
        kwargs = {"config": tables.verifiers}
    module, attr = path.split(":")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"task {name!r}: cannot import {path} ({type(e).__name__}: {e})") from e
    task = factory(**kwargs)
    if not isinstance(task, Task):
        raise ValueError(f"task {name!r}: {path}() returned {type(task).__name__}, which is not a Task")
    return task
