"""``task = "verifiers"``: a single-turn taskset of `verifiers <https://github.com/PrimeIntellect-ai/verifiers>`_
(its v1 API, ``verifiers>=0.4``), scored by the taskset's own rewards.

Needs the ``loong-train[verifiers]`` extra. The ``[verifiers]`` table:

- ``taskset``: ``"pkg.module:Class"`` or ``"path/to/file.py:Class"`` (a ``vf.Taskset`` subclass),
  or a module name whose ``__all__`` exports exactly one (verifiers' own convention);
- ``config``: keyword arguments of its ``vf.TasksetConfig`` (``system_prompt``, ``task``, ...);
- ``eval_fraction``, ``split_seed``: the held-out rows, a seeded fraction (as for ``task = "data"``).

Every task of the taskset becomes an item: its ``prompt`` (text or messages) after its
``system_prompt``, ids from the task's ``id`` (or its index). An episode's reward is what
verifiers computes for the final assistant turn: the weighted sum of the task's ``@vf.reward``
methods (and the rewards its ``TaskConfig`` adds), on a trace of the prompt and that reply.
Each of the task's rewards and metrics is logged too (``reward/<name>``, the step's mean).
Scoring runs off the episode's event loop with a time limit (``timeout_s``); a reward that
raises or gives no score fails the episode, never the run. Rewards that need a sandbox runtime
are skipped by verifiers (a single-turn taskset here runs no sandbox), and LLM judges need their
own endpoint. Multi-turn verifiers environments run as black-box agents (``[agent] type = "blackbox"``).
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

from loong_agentflow import Reward
from loong_core.config import ConfigError
from loong_train.tasks.base import Item
from loong_train.tasks.config import VerifiersConfig
from loong_train.tasks.data import RowsTask, split_held_out
from loong_train.tasks.objects import load_object
from loong_train.tasks.reward import RewardFn

__all__ = ["VerifiersConfig", "VerifiersTask"]


def _import_verifiers() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ConfigError(
            f"task 'verifiers' needs verifiers>=0.4: pip install 'loong-train[verifiers]' ({e})"
        ) from e
    return vf


def _taskset_class(spec: str, vf: Any) -> type:
    if ":" in spec:
        cls = load_object(spec, Path.cwd(), "verifiers.taskset")
    else:
        try:
            module = importlib.import_module(spec)
        except ImportError as e:
            raise ConfigError(f"verifiers.taskset {spec!r}: cannot import it ({e})") from e
        found = [getattr(module, n) for n in getattr(module, "__all__", [])]
        found = [c for c in found if inspect.isclass(c) and issubclass(c, vf.Taskset)]
        if len(found) != 1:
            raise ConfigError(
                f"verifiers.taskset {spec!r}: its __all__ must export exactly one vf.Taskset, found "
                f"{[c.__name__ for c in found]} (or name one: 'module:Class')"
            )
        cls = found[0]
    if not (inspect.isclass(cls) and issubclass(cls, vf.Taskset)):
        raise ConfigError(f"verifiers.taskset {spec!r} is {cls!r}, not a verifiers.v1.Taskset subclass")
    return cls


class VerifiersTask(RowsTask):
    """A :class:`~loong_train.tasks.Task` over a verifiers v1 taskset (no tools); every process
    that builds it loads the taskset, and items name their task by index."""

    def __init__(self, config: VerifiersConfig) -> None:
        if not config.taskset:
            raise ConfigError(
                "task = 'verifiers' needs verifiers.taskset ('pkg.module:Class' or a module name)"
            )
        self.vf = vf = _import_verifiers()
        cls = _taskset_class(config.taskset, vf)
        try:
            taskset = cls(vf.TasksetConfig(**config.config))
            self.tasks = list(taskset)
        except Exception as e:  # a bad config or a loader that fails: before training starts
            raise ConfigError(f"verifiers.taskset {config.taskset!r}: {type(e).__name__}: {e}") from e
        if not self.tasks:
            raise ConfigError(f"verifiers.taskset {config.taskset!r} yielded no tasks")
        items = [self._item(i, t) for i, t in enumerate(self.tasks)]
        what = f"verifiers.taskset {config.taskset!r}"
        self.eval, self.train = split_held_out(items, config.eval_fraction, config.split_seed, what)
        # off the event loop under timeout_s, a finite number or the episode fails (as [reward] fn)
        self.scorer = RewardFn(self._score, ("row", "completion"), config.timeout_s, f"verifiers {what}")

    def _item(self, index: int, task: Any) -> Item:
        data = task.data
        prompt = data.prompt
        rid = f"{data.id or index}"
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list) and prompt:
            messages = [m.model_dump() if hasattr(m, "model_dump") else dict(m) for m in prompt]
            messages = [{"role": m.get("role"), "content": m.get("content")} for m in messages]
        else:
            raise ConfigError(f"verifiers task {rid}: prompt must be text or messages, got {prompt!r}")
        if bad := [m for m in messages if not isinstance(m["content"], str)]:
            raise ConfigError(f"verifiers task {rid}: only text messages are supported, got {bad[0]!r}")
        if data.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": data.system_prompt}, *messages]
        return {"id": rid, "messages": messages, "source": index}

    def reward(self, item: Item, answer: str) -> float:
        return self.scorer.score(item, answer)

    async def _score(self, row: Item, completion: str) -> Reward | None:
        vf, task = self.vf, self.tasks[row["source"]]
        kinds = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}
        messages = [kinds[m["role"]](content=m["content"]) for m in row["messages"]]
        nodes = [vf.MessageNode(message=m, parent=i - 1 if i else None) for i, m in enumerate(messages)]
        reply = vf.MessageNode(
            message=vf.AssistantMessage(content=completion), parent=len(nodes) - 1, sampled=True
        )
        trace = vf.Trace(
            task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            agent=vf.AgentInfo(config=vf.AgentConfig(), name="loong", trainable=True),
            nodes=[*nodes, reply],
        )
        try:
            await task.score(trace)
        except Exception as e:  # the episode fails, with the task named in the run's log
            raise RuntimeError(f"verifiers scoring of task {row['id']}: {e}") from e
        if trace.errors:
            raise RuntimeError(f"verifiers scoring of task {row['id']}: {trace.errors[0]}")
        if trace.reward is None:
            return None
        scores = {name: r.score for name, r in trace.rewards.items() if r is not None and r.score is not None}
        numbers = {**scores, **{k: v for k, v in trace.metrics.items() if v is not None}}
        return Reward(trace.reward, numbers)  # each reward and metric: reward/<name> in the run's metrics
