"""Tasks: the :class:`Task` seam and the factory that picks a recipe's ``task``.

A recipe's ``task`` is a shipped name or the import path of a factory, ``"pkg.module:factory"``,
called with no arguments and returning a :class:`Task`. The shipped names are the calculator tasks
of the tiny recipes (:mod:`loong_train.tiny.calc`, :mod:`loong_train.tiny.calc_domains`):

- ``calc``: ``compute A<op>B`` with ``op`` in ``+ - *``, untagged;
- ``calc-domains``: the same questions in two tagged domains, ``add`` and ``mul``, in equal shares;
- ``calc-add``, ``calc-mul``: one domain each (how the tiny OPD recipe trains its teachers);
- ``arithmetic``: ``What is A+B?`` for a pretrained chat model, scored by the answer's last
  integer (the real-model recipe's task): :mod:`loong_train.tasks.arithmetic`;
- ``data``: the user's rows (``[data]``) and reward function (``[reward]``): :mod:`loong_train.tasks.data`;
- ``env``: the user's multi-turn environment (``[environment]``) on the rows of ``[data]``:
  :mod:`loong_train.tasks.env`;
- ``reasoning_gym:<dataset>``, ``reasoning_gym`` (a weighted composite): reasoning-gym's procedural
  datasets, configured by ``[reasoning_gym]``: :mod:`loong_train.tasks.reasoning_gym`;
- ``verifiers``: a single-turn verifiers v1 taskset (``[verifiers]``), scored by its own rewards:
  :mod:`loong_train.tasks.verifiers`.

Tasks built from recipe tables get them as :class:`TaskTables` (the tables:
:mod:`loong_train.tasks.config`). A task made in code (the Python API,
:func:`loong_train.api.train`) is registered under ``"python:<label>"`` with :func:`register`:
the driver builds it from the registry, and the rollout workers get its factory itself.

Choosing a task imports nothing: the module is imported when the task is built.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import msgspec

from loong_train.tasks.base import AgentCommand, Item, Task
from loong_train.tasks.config import DataConfig, EnvConfig, ReasoningGymConfig, RewardConfig, VerifiersConfig
from loong_train.tasks.reasoning_gym import PREFIX

__all__ = [
    "SHIPPED",
    "AgentCommand",
    "Item",
    "Task",
    "TaskTables",
    "build_task",
    "register",
    "registered",
    "task_problem",
]

SHIPPED: dict[str, tuple[str, dict]] = {
    "calc": ("loong_train.tiny.calc:CalcTask", {}),
    "calc-domains": ("loong_train.tiny.calc_domains:CalcDomainsTask", {"domains": ("add", "mul")}),
    "calc-add": ("loong_train.tiny.calc_domains:CalcDomainsTask", {"domains": ("add",)}),
    "calc-mul": ("loong_train.tiny.calc_domains:CalcDomainsTask", {"domains": ("mul",)}),
    "arithmetic": ("loong_train.tasks.arithmetic:ArithmeticTask", {}),
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


_REGISTERED: dict[str, Callable[[], Task]] = {}


def register(label: str, factory: Callable[[], Task]) -> str:
    """Register a task made in code (``factory()`` builds it; it must pickle, as Ray sends it to
    the rollout workers); returns the name a recipe's ``task`` gives it, ``"python:<label>"``."""
    name = f"python:{label}"
    _REGISTERED[name] = factory
    return name


def registered(name: str) -> Callable[[], Task] | None:
    """The factory registered under ``name`` in this process, or None."""
    return _REGISTERED.get(name)


def task_problem(name: str) -> str:
    """Why ``name`` cannot name a task ("" when it can), checked without importing anything."""
    if name in SHIPPED or name == PREFIX or (name.count(":") == 1 and all(name.split(":"))):
        return ""
    return (
        f"unknown task {name!r} (expected a shipped task, one of {', '.join(map(repr, SHIPPED))}, "
        f"'{PREFIX}:<dataset>', '{PREFIX}', or the import path of a factory, 'pkg.module:factory')"
    )


def build_task(name: str | Callable[[], Task], tables: TaskTables | None = None) -> Task:
    """The task ``name`` names (see the module docstring), built from the recipe's ``tables``; a
    registered task's factory may be given itself (what a rollout worker receives)."""
    factory = name if callable(name) else registered(name)
    if factory is not None:
        return _checked(factory(), str(name))
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
    return _checked(factory(**kwargs), f"{name!r}: {path}()")


def _checked(task: object, what: str) -> Task:
    if not isinstance(task, Task):
        raise ValueError(
            f"task {what} returned {type(task).__name__}, which is not a Task: subclass loong_train.tasks.Task"
        )
    return task
