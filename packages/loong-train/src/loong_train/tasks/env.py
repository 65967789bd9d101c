"""``task = "env"``: episodes against the user's multi-turn environment, one instance per episode.

The ``[environment]`` table names the class and how to build it; the ``[data]`` table gives the
rows each episode starts from (any JSON objects: no prompt key is needed, the environment's
``reset`` makes the prompt), split into training and held-out rows as for ``task = "data"``:

- ``cls``: ``"pkg.module:Class"`` or ``"path/to/file.py:Class"`` (relative to the directory the
  run starts in); ``kwargs``: its constructor's keyword arguments;
- ``api``: ``"loong"`` (:class:`loong_agentflow.Environment`: ``reset(row) -> messages``,
  ``step(action) -> StepResult``, ``close()``, sync or async) or ``"gym"`` (a gymnasium-style
  text env, ``reset(seed=row.get("seed"), options=row) -> (observation, info)`` and
  ``step(action) -> (observation, reward, terminated, truncated, info)``, through
  :class:`loong_agentflow.GymTextEnv`; ``system`` is its system message) or ``"skyrl"`` (a
  SkyRL-gym ``BaseTextEnv``, built per row as ``cls(env_config=kwargs, extras=row)`` the way
  SkyRL builds it, with ``kwargs`` as an omegaconf ``DictConfig``; ``init`` gets the row's
  ``[data] prompt_key`` messages; through :class:`loong_agentflow.SkyRLTextEnv`), so SkyRL's own
  dataset rows (``prompt``, ``env_class``, ``reward_spec``, ``extra_info``) are used as they are;
- ``demonstration_key``: the row key holding an expert's assistant turns (a list of strings), what
  the tiny warm start trains on: they are played against the environment (and its tools) and the
  transcript is laid out exactly as a real episode's tokens (:class:`loong_agentflow.ScriptedEpisode`).

An environment's ``tools()`` (typed functions or its bound methods) are run by the framework
when the model calls them (:class:`loong_agentflow.EnvAgent`).

The episode's reward is the sum of its steps' rewards, so ``[reward] fn`` must stay unset (one
source of reward, no silent precedence). Episodes are white-box: the framework renders the
environment's messages into the token buffer and the trajectory decodes to the transcript.
A class that does not import, or keyword arguments its constructor does not take, are errors
before the run starts; an environment that raises fails its episode, not the run.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from loong_agentflow import ChatML, EnvAgent, GymTextEnv, ScriptedEpisode, SkyRLTextEnv
from loong_core.config import ConfigError
from loong_train.tasks.base import Item
from loong_train.tasks.config import DataConfig, EnvConfig, RewardConfig
from loong_train.tasks.data import DataTask
from loong_train.tasks.objects import load_object

__all__ = ["EnvConfig", "EnvTask"]


class EnvTask(DataTask):
    """A :class:`~loong_train.tasks.Task` whose episodes run the user's environment on the rows of
    ``[data]``; :meth:`agent` is the rollout worker's agent (an :class:`~loong_agentflow.EnvAgent`)."""

    def __init__(
        self,
        env: EnvConfig,
        data: DataConfig,
        reward: RewardConfig,
        *,
        cls: type | None = None,
        rows: Sequence[Any] | None = None,
        eval_rows: Sequence[Any] | None = None,
    ) -> None:
        """``cls``, ``rows`` and ``eval_rows`` stand for ``environment.cls`` and the data files when
        the task is made in code (:mod:`loong_train.api`)."""
        if cls is not None:
            env = msgspec.structs.replace(env, cls=f"<code>:{cls.__qualname__}")
        if not env.cls:
            raise ConfigError("task = 'env' needs environment.cls ('pkg.module:Class' or 'file.py:Class')")
        if reward.fn or reward.url:
            key, value = ("fn", reward.fn) if reward.fn else ("url", reward.url)
            raise ConfigError(
                f"task = 'env' takes each episode's reward from its environment's steps: drop reward.{key} "
                f"({value!r}), or score in the environment's step"
            )
        self.env_config = env
        self.cls = cls if cls is not None else load_object(env.cls, Path.cwd(), "environment.cls")
        try:
            if env.api == "skyrl":  # SkyRL's constructor: (env_config, extras)
                inspect.signature(self.cls).bind(env_config=env.kwargs, extras={})
            else:
                inspect.signature(self.cls).bind(**env.kwargs)
        except TypeError as e:
            if env.api == "skyrl":
                raise ConfigError(
                    f"environment.api = 'skyrl' builds {env.cls} as cls(env_config=..., extras=row), "
                    f"as SkyRL does, and its constructor does not take that: {e}"
                ) from e
            raise ConfigError(f"environment.kwargs {env.kwargs!r} do not fit {env.cls}: {e}") from e
        except ValueError:  # no introspectable signature: its constructor will say
            pass
        super().__init__(data, RewardConfig(), rows=rows, eval_rows=eval_rows)

    def _item(self, rid: str, row: Any) -> Item:
        if not isinstance(row, dict):
            raise ConfigError(f"{rid}: a row must be a JSON object, got {type(row).__name__}")
        tags = row.get(self.config.tags_key) or {}
        item: Item = {"id": rid, "messages": [], "row": row}
        if tags:
            item["tags"] = tags
        return item

    def make(self) -> _RowEnvironment:
        c = self.env_config
        if c.api == "skyrl":
            config = _skyrl_config(c.kwargs)
            env: Any = SkyRLTextEnv(
                lambda row: self.cls(env_config=config, extras=row), self.config.prompt_key
            )
        else:
            env = self.cls(**c.kwargs)
            if c.api == "gym":
                env = GymTextEnv(env, system=c.system)
        return _RowEnvironment(env)

    def agent(self, chat: Any = ChatML) -> EnvAgent:
        return EnvAgent(self.make, chat=chat)

    def reward(self, item: Item, answer: str) -> float:
        raise RuntimeError("an environment task's rewards come from its environment's steps")

    def demonstration(self, item: Item) -> list[tuple[str, bool]]:
        """The row's expert turns played against a fresh environment, as ``(text, is_model)`` pieces."""
        key = self.env_config.demonstration_key
        turns = item["row"].get(key)
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ConfigError(
                f"{item['id']}: the warm start needs the row's expert turns at {key!r} "
                f"(environment.demonstration_key), a list of strings; got {turns!r}"
            )
        scripted = ScriptedEpisode(item, turns)
        asyncio.run(self.agent().run(scripted))
        if scripted.exhausted:
            raise ConfigError(
                f"{item['id']}: the environment was not done after the {len(turns)} turns at {key!r}"
            )
        return scripted.pieces


def _skyrl_config(kwargs: dict[str, Any]) -> Any:
    """SkyRL envs read ``env_config`` by attribute (``env_config.db_file_path``): a DictConfig."""
    try:
        from omegaconf import OmegaConf
    except ImportError:  # skyrl-gym depends on omegaconf; a plain env class may not need it
        return dict(kwargs)
    return OmegaConf.create(kwargs)


class _RowEnvironment:
    """The user's environment, reset with the data row rather than Loong's item around it. Its
    methods' results (values or awaitables) go to :class:`~loong_agentflow.EnvAgent` as they are."""

    def __init__(self, env: Any) -> None:
        self.env = env

    def reset(self, task: Item) -> Any:
        return self.env.reset(task["row"])

    def step(self, action: str) -> Any:
        return self.env.step(action)

    def tools(self) -> list[Any]:
        tools = getattr(self.env, "tools", None)
        return list(tools()) if tools is not None else []

    def close(self) -> Any:
        close = getattr(self.env, "close", None)
        return close() if close is not None else None
