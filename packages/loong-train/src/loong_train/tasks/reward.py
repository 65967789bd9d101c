"""The ``[reward]`` table: a user's reward function, found by path, called with what it names.

``fn = "pkg.module:name"`` (an importable module) or ``fn = "path/to/file.py:name"`` (a file,
relative to the recipe's directory or absolute). The function may be sync or ``async`` and takes
any of these parameters, by name (anything else is a start-up error naming the parameter):

- ``completion``: the final assistant text of the episode (stripped of the end-of-turn token);
- ``prompt``: the last user message's text; ``messages``: the prompt messages followed by the
  final assistant turn (single-turn data tasks: the whole transcript);
- ``answer``: the row's reference answer (``data.answer_key``; ``None`` when the row has none);
- ``metadata``: the row's ``data.metadata_key`` value (``{}`` when absent); ``row``: the whole row.

It returns a number or a dict with a numeric ``"score"``; the dict's other numeric keys are logged
as metrics (``reward/<key>``: their mean over each step's trained episodes). A
function that raises, runs longer than ``timeout_s`` or returns NaN or a non-number fails that
episode (``status = "failed"``, the error in the trajectory's info), never the run. Unset ``fn``:
exact match, ``float(completion.strip() == str(answer).strip())``.

Functions written for other frameworks run unchanged with ``style``:

- ``"verl"``: ``compute_score(data_source, solution_str, ground_truth, extra_info)``, called as
  verl calls it: the row's ``data_source``, the completion, the answer, the row's ``extra_info``;
- ``"trl"``: a list-style TRL reward function, ``fn(prompts=[...], completions=[...], **columns)``
  with one element per list: the row's prompt (text, or messages for a chat row), the completion
  (text, or ``[{"role": "assistant", ...}]`` for a chat row) and every other column of the row;
  it returns a list of one float (``None`` fails the episode).

``"loong"`` (the default) binds by name as above: a function names only what it uses. Whether a
row's call binds is checked on the first training row when the task is built.

A reward service over HTTP instead of a function: ``url = "http://host:port/score"`` (never
together with ``fn``). Each episode is one ``POST`` of a JSON object holding all six parameters
above; the answer is a JSON number or ``{"score": x, ...}``, read like a function's. ``api_key_env``
names the environment variable holding a key, sent as ``Authorization: Bearer <key>`` (the key
itself never goes in a recipe). Each request has ``timeout_s``; a refused connection, a timeout or
a 5xx answer is retried ``retries`` times, 0.5 s, 1 s, ... apart; a 4xx answer, or an answer that
is not a score, fails the episode at once, with the service's message.

Group mode (``group = true``, as slime's group reward model): the function is called once per
GRPO group, after the group's episodes finished; each parameter it names is a list with one
entry per episode (truncated, failed and timed-out episodes are left out), and it returns a list
of as many scores. A failing call fails the group's episodes; an entry that is not a score fails
its own. With ``style = "trl"`` the lists are TRL's, for the whole group. White-box agents only.

Overlong shaping (DAPO's soft overlong punishment): ``overlong_buffer = L`` costs an episode
that uses the last ``L`` tokens of its budget, linearly up to ``overlong_penalty`` at the budget
(the budget: ``min(rollout.max_model_tokens, rollout.max_turns * rollout.max_new_tokens)``, the
most model tokens an episode can hold); added to training rewards, never to evaluations, and
logged as ``reward/overlong_penalty``. 0 (the default): off.

Which reward wins: a black-box agent that posts its own reward (``/v1/sessions/reward``, see
:mod:`loong_agentflow.blackbox`) overrides ``fn`` for that episode, and the metric
``reward/from_agent`` is the share of a step's black-box episodes scored that way (0: ``fn``
scored them all); ``task = "env"`` takes rewards from its environment only and refuses an ``fn``.

The table is :class:`~loong_train.tasks.config.RewardConfig`; the service client is
:mod:`loong_train.tasks.reward_service`, the overlong shaping :mod:`loong_train.tasks.shaping`.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import msgspec

from loong_agentflow import Reward
from loong_core.config import ConfigError
from loong_core.records import EpisodeStatus, Trajectory
from loong_train.tasks.config import RewardConfig
from loong_train.tasks.objects import load_object
from loong_train.tasks.reward_service import RewardService

__all__ = [
    "PARAMETERS",
    "RewardConfig",
    "RewardFn",
    "RewardService",
    "final_turn",
    "load_reward",
    "score_groups",
]

PARAMETERS = ("completion", "prompt", "messages", "answer", "metadata", "row")


def exact_match(completion: str, answer: Any) -> float:
    return float(answer is not None and completion.strip() == str(answer).strip())


def load_reward(config: RewardConfig, base: Path, fn: Callable[..., Any] | None = None) -> RewardFn:
    """The function ``config.fn`` names (files relative to ``base``), checked against
    :data:`PARAMETERS`, or the service at ``config.url``, or ``fn`` itself (a task made in code);
    raises ConfigError naming what does not import or bind."""
    if fn is not None:
        if config.fn or config.url:
            raise ConfigError("a reward function given in code replaces reward.fn and reward.url: unset them")
        label = getattr(fn, "__qualname__", repr(fn))
        config = msgspec.structs.replace(config, fn=f"<code>:{label}")
    if config.url:
        service = RewardService(config)
        waits = 0.5 * (2**config.retries - 1)  # the pauses between attempts
        return RewardFn(service, PARAMETERS, config.timeout_s * (config.retries + 1) + waits + 1, config.url)
    if fn is None:
        fn = load_object(config.fn, base, "reward.fn") if config.fn else exact_match
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"reward.fn {config.fn!r}: not a function with a signature ({e})") from e
    if config.style != "loong":
        return RewardFn(fn, (), config.timeout_s, config.fn, config.style)  # checked per row: check()
    params = signature.parameters.values()
    names = []
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name not in PARAMETERS and p.default is p.empty:
            raise ConfigError(
                f"reward.fn {config.fn!r}: parameter {p.name!r} is none of {', '.join(PARAMETERS)} "
                "(rename it, or give it a default)"
            )
        if p.name in PARAMETERS:
            names.append(p.name)
    return RewardFn(fn, tuple(names), config.timeout_s, config.fn or "exact match")


_CALLS = {
    "verl": "(data_source, solution_str, ground_truth, extra_info)",
    "trl": "(prompts, completions, **columns)",
}


class RewardFn:
    """A bound reward function: ``score(item, completion)`` calls it with the parameters it names,
    on a thread of its own with a time limit, and returns a finite float or raises."""

    def __init__(
        self,
        fn: Callable[..., Any],
        names: tuple[str, ...],
        timeout_s: float,
        label: str,
        style: str = "loong",
    ) -> None:
        self.fn, self.names, self.timeout_s, self.label, self.style = fn, names, timeout_s, label, style
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="reward")

    def arguments(self, item: dict[str, Any], completion: str) -> dict[str, Any]:
        messages = item["messages"]
        prompt = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        values = {
            "completion": completion,
            "prompt": prompt,
            "messages": [*messages, {"role": "assistant", "content": completion}],
            "answer": item.get("answer"),
            "metadata": item.get("metadata", {}),
            "row": item.get("row", item),
        }
        return {name: values[name] for name in self.names}

    def call_args(self, item: dict[str, Any], completion: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The positional and keyword arguments of one call in this function's style."""
        row = item.get("row", item)
        if self.style == "verl":
            return (row.get("data_source", ""), completion, item.get("answer"), row.get("extra_info", {})), {}
        if self.style == "trl":
            return (), _trl_columns([item], [completion])
        return (), self.arguments(item, completion)

    def group_args(self, items: list[dict[str, Any]], completions: list[str]) -> dict[str, Any]:
        """The keyword arguments of one group call: each parameter a list, one entry per episode."""
        if self.style == "trl":
            return _trl_columns(items, completions)
        each = [self.arguments(i, c) for i, c in zip(items, completions, strict=True)]
        return {name: [a[name] for a in each] for name in self.names}

    def check(self, item: dict[str, Any]) -> None:
        """Raise ConfigError when a call for ``item`` (a first row) would not bind to the function."""
        args, kwargs = self.call_args(item, "")
        try:
            inspect.signature(self.fn).bind(*args, **kwargs)
        except TypeError as e:
            how = f"style {self.style!r} calls it as {_CALLS[self.style]}" if self.style in _CALLS else "it"
            raise ConfigError(f"reward.fn {self.label!r}: {how}, for row {item.get('id')}: {e}") from e

    def score(self, item: dict[str, Any], completion: str) -> float:
        out = self._timed(*self.call_args(item, completion))
        if self.style == "trl":
            out = out[0] if isinstance(out, list | tuple) and len(out) == 1 else out
        return self._value(out)

    def score_group(self, items: list[dict[str, Any]], completions: list[str]) -> list[float | Exception]:
        """One call for a whole group (``group = true``); per episode its score, or the error that
        fails that episode alone (a NaN, a non-number). A call that raises or times out raises."""
        out = self._timed((), self.group_args(items, completions))
        if not isinstance(out, list | tuple) or len(out) != len(items):
            raise ValueError(
                f"reward {self.label} (group = true) returned {out!r:.120}, expected a list of "
                f"{len(items)} scores, one per episode of the group"
            )
        scores: list[float | Exception] = []
        for x in out:
            try:
                scores.append(self._value(x))
            except ValueError as e:
                scores.append(e)
        return scores

    def _timed(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        call = self._pool.submit(self._call, args, kwargs)
        try:
            return call.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise TimeoutError(f"reward {self.label} ran past {self.timeout_s}s") from None

    def _value(self, out: Any) -> float:
        """One score: a finite number, a ``{"score": x, ...}`` dict (a Reward with its other
        numbers) or a Reward; ValueError otherwise."""
        value = out.get("score") if isinstance(out, dict) else out
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(
                f"reward {self.label} returned {out!r}, expected a finite number or {{'score': x}}"
            )
        if isinstance(out, Reward):  # a task's own scorer (verifiers) hands its numbers over as they are
            return out
        if not isinstance(out, dict):
            return float(value)
        numbers = {  # the dict's other numeric keys: logged as reward/<key>
            k: float(v)
            for k, v in out.items()
            if k != "score" and isinstance(v, int | float) and not isinstance(v, bool)
        }
        return Reward(value, numbers)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = self.fn(*args, **kwargs)
        return asyncio.run(out) if inspect.iscoroutine(out) else out


def final_turn(t: Trajectory, decode: Callable[[list[int]], str], strip_end: Callable[[str], str]) -> str:
    """The text of a white-box episode's last model turn, as its agent gives it to a reward."""
    span = next(s for s in reversed(t.spans) if s.is_model)
    return strip_end(decode(span.token_ids))


def score_groups(
    reward: RewardFn,
    trajs: list[Trajectory],
    items: dict[str, dict[str, Any]],
    completion: Callable[[Trajectory], str],
) -> None:
    """``group = true``: score a rollout call's finished episodes with one call per group (in
    place). ``items``: each episode's row by sample id; ``completion(t)``: its final turn's text.
    Truncated, failed and timed-out episodes keep their reward and are left out of the call. A
    call that fails fails its group's episodes, an entry that is not a score fails its episode."""
    groups: dict[str, list[Trajectory]] = {}
    for t in trajs:
        if t.status is EpisodeStatus.OK:
            groups.setdefault(t.group_id, []).append(t)
    for members in groups.values():
        try:
            scores: list[float | Exception] = reward.score_group(
                [items[t.sample_id] for t in members], [completion(t) for t in members]
            )
        except Exception as e:  # the function's failure fails this group's episodes, not the run
            scores = [e] * len(members)
        for t, score in zip(members, scores, strict=True):
            if isinstance(score, Exception):
                t.reward, t.status = 0.0, EpisodeStatus.FAILED
                t.info = {
                    **t.info,
                    "error": f"{type(score).__name__}: {score}",
                    "task_id": str(items[t.sample_id].get("id")),
                }
            else:
                t.reward = float(score)
                t.metrics = {**t.metrics, **getattr(score, "metrics", {})}


def _trl_columns(items: list[dict[str, Any]], completions: list[str]) -> dict[str, Any]:
    """TRL's list-style arguments: ``prompts``, ``completions`` and every other column of the
    rows, one entry per episode (chat rows: messages in, ``[{"role": "assistant", ...}]`` out)."""
    prompts, done, columns = [], [], {}
    for item, completion in zip(items, completions, strict=True):
        row = item.get("row", item)
        chat = not isinstance(row.get("prompt", ""), str)
        prompts.append(item["messages"] if chat else item["messages"][-1]["content"])
        done.append([{"role": "assistant", "content": completion}] if chat else completion)
        for k, v in row.items():
            if k not in ("prompt", "prompts", "completions"):
                columns.setdefault(k, []).append(v)
    return {"prompts": prompts, "completions": done, **columns}
