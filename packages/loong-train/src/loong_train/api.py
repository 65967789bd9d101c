"""Train from Python: your rows, reward function and environment class as objects, no files.

::

    from loong_train.api import train

    def score(completion: str, answer: str) -> float:
        return float(completion.strip() == answer)

    rows = [{"prompt": "2+2?", "answer": "4"}, ...]
    train("recipe.toml", rows=rows, reward=score)            # task = "data" on these rows
    train("recipe.toml", rows=rows, environment=MyEnv)       # task = "env": MyEnv per episode
    train("recipe.toml", task=make_my_task)                  # any factory returning a Task

Everything else comes from the recipe (a TOML path, a shipped recipe's name, or a
:class:`~loong_train.config.Recipe`) and ``sets`` (``key=value`` overrides, as ``--set``): its
``[data]`` keys (``prompt_key``, ``answer_key``, ``eval_fraction``, ...) read the rows, its
``[reward] style`` and ``timeout_s`` call the function, ``[environment] kwargs`` and ``api`` build
the class. ``rows`` is any iterable of row objects (it is read once, into memory); ``eval_rows``
are held out instead of a seeded fraction of ``rows``.

The functions and classes travel to the rollout workers by value (Ray pickles them with
cloudpickle), so they may be defined in the calling script. A tiny warm start (no
``model.path``) is cached by the rows' content and the code's source, like a recipe's files.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec

from loong_core.config import ConfigError
from loong_train.config import Recipe, load_recipe
from loong_train.ray_env import prepare_local_ray
from loong_train.tasks import Task, register

__all__ = ["code_task", "train"]

log = logging.getLogger("loong.api")


def train(
    recipe: Recipe | str | Path,
    *,
    rows: Iterable[Any] | None = None,
    eval_rows: Iterable[Any] | None = None,
    reward: Callable[..., Any] | None = None,
    environment: type | None = None,
    task: Callable[[], Task] | None = None,
    sets: Iterable[str] = (),
    out: Path | None = None,
    cache: Path = Path(".cache/loong"),
    resume: bool = False,
) -> Path:
    """Train ``recipe`` on a task made in code (see the module docstring); returns the run
    directory (``out``, default ``runs/<recipe name>``)."""
    if not isinstance(recipe, Recipe):  # its tables are checked against the task made here
        kind = "env" if environment is not None else "data" if rows is not None else None
        recipe = load_recipe(str(recipe), list(sets), task=kind or ("python" if task else None))
    elif sets:
        raise ConfigError(
            "sets apply to a recipe file or name; change a Recipe object with msgspec.structs.replace"
        )
    recipe = code_task(
        recipe, rows=rows, eval_rows=eval_rows, reward=reward, environment=environment, task=task
    )
    from loong_train.controller import run

    if not recipe.ray_address:
        prepare_local_ray()
    return run(recipe, out or Path("runs") / recipe.name, cache, resume)


def code_task(
    recipe: Recipe,
    *,
    rows: Iterable[Any] | None = None,
    eval_rows: Iterable[Any] | None = None,
    reward: Callable[..., Any] | None = None,
    environment: type | None = None,
    task: Callable[[], Task] | None = None,
) -> Recipe:
    """``recipe`` with its ``task`` set to the task these objects make, registered in this process
    (:func:`loong_train.tasks.register`) under a name keyed by their content."""
    if task is not None:
        if rows is not None or eval_rows is not None or reward is not None or environment is not None:
            raise ConfigError("task= is a whole task: give it alone, or rows with reward= or environment=")
        return _registered(recipe, task, ["task", _source(task)])
    if rows is None:
        raise ConfigError("give rows= (with reward= or environment=), or task=")
    rows = list(rows)
    held = list(eval_rows) if eval_rows is not None else None
    t = recipe.task_tables
    if environment is not None:
        if reward is not None:
            raise ConfigError(
                "an environment's steps give the reward: drop reward=, or score in its step (one source of reward)"
            )
        from loong_train.tasks.env import EnvTask

        factory = functools.partial(
            EnvTask, t.environment, t.data, t.reward, cls=environment, rows=rows, eval_rows=held
        )
        kind, code = "env", _source(environment)
    else:
        from loong_train.tasks.data import DataTask

        factory = functools.partial(DataTask, t.data, t.reward, rows=rows, eval_rows=held, reward_fn=reward)
        kind, code = "data", _source(reward) if reward is not None else "exact match"
    return _registered(recipe, factory, [kind, code, rows, held])


def _registered(recipe: Recipe, factory: Callable[[], Task], content: list[Any]) -> Recipe:
    tables = msgspec.to_builtins(recipe.task_tables)
    digest = hashlib.sha256(json.dumps([content, tables], default=str, sort_keys=True).encode()).hexdigest()
    name = register(f"{content[0]}-{digest[:12]}", factory)
    log.info("task made in code: %s", name)
    return msgspec.structs.replace(recipe, task=name)


def _source(obj: Any) -> str:
    """What identifies code for the warm-start cache: its source, else its qualified name."""
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', repr(obj))}"
