"""Multi-turn environments: the episode's other side is a stateful object, one per episode.

An :class:`Environment` starts from a task row and answers every assistant turn::

    class GuessNumber:
        async def reset(self, task):               # -> the prompt messages
            self.secret = task["secret"]
            return [{"role": "user", "content": "Guess my number, 1 to 9."}]

        async def step(self, action):              # the assistant's turn, end token stripped
            if action.strip() == str(self.secret):
                return StepResult(reward=1.0, done=True)
            hint = "higher" if int(action) < self.secret else "lower"
            return StepResult(observations=[{"role": "user", "content": hint}])

        async def close(self): ...

Methods may also be plain (sync) functions. :class:`EnvAgent` runs one environment per episode
(``factory()`` makes it, so stateful sandboxes work), and the framework keeps the tokens: the
prompt and every observation are laid out by the agent's ``chat`` format (loss mask 0) between
model turns (loss mask 1): :class:`~loong_agentflow.agent.ChatML`, or the model's own chat
template (:func:`~loong_agentflow.chat_template.chat_format`), so the trajectory decodes to
exactly the template's rendering of the transcript and its logprobs are the engine's.
Observations are messages: ``user`` and ``system`` turns as they are, ``tool`` turns as the
format shows tool results (ChatML: Hermes ``<tool_response>`` blocks).

Tools: an environment may define ``tools() -> [functions]``, typed Python functions or its own
bound methods (so they see the episode's state, as TRL's ``environment_factory`` exposes methods).
Their JSON schemas go to the chat template, which lists them in the prompt (ChatML lists none:
tiny policies learn the layout). The framework parses the model's Hermes ``<tool_call>`` blocks,
runs them and shows the results; ``step`` sees only the turns without calls.

The episode's reward is the sum of the steps' rewards. It ends when a step says ``done``, or
without a final step when the model runs out of turns or tokens (the rewards so far count; the
row is marked truncated). An environment that raises fails the episode (``status = "failed"``,
the error in the trajectory's info), never the run; ``close`` runs in every case.

:class:`GymTextEnv` adapts a gymnasium-style text environment (``reset(seed=, options=) ->
(observation, info)``, ``step(action) -> (observation, reward, terminated, truncated, info)``),
:class:`SkyRLTextEnv` a SkyRL-gym one (``skyrl_gym.envs.base_text_env.BaseTextEnv``: built per
row, ``init(prompt) -> (messages, metadata)``, ``step(action) -> {"observations", "reward",
"done", "metadata"}``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from loong_agentflow.agent import ChatML, Episode, ScriptedEpisode
from loong_agentflow.tools import Tool, ToolRegistry, function_tool, parse_tool_calls

__all__ = ["EnvAgent", "Environment", "GymTextEnv", "SkyRLTextEnv", "StepResult", "env_tools"]


@dataclass
class StepResult:
    """What an environment answers to one assistant turn: messages to show next, the reward of
    this step, whether the episode is over, and anything to keep in the trajectory's info."""

    observations: list[dict[str, str]] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: dict[str, str] = field(default_factory=dict)


class Environment(Protocol):
    async def reset(self, task: dict[str, Any]) -> list[dict[str, str]]: ...

    async def step(self, action: str) -> StepResult: ...

    async def close(self) -> None: ...


async def _call(method: Callable[..., Any], *args: Any) -> Any:
    out = method(*args)
    return await out if inspect.isawaitable(out) else out


def env_tools(env: Any, timeout_s: float = 10.0) -> ToolRegistry | None:
    """The registry of ``env.tools()`` (typed functions or bound methods, made tools by
    :func:`~loong_agentflow.tools.function_tool`, or :class:`~loong_agentflow.tools.Tool`), or
    None when the environment has no tools."""
    listed = getattr(env, "tools", None)
    if listed is None:
        return None
    tools = [t if isinstance(t, Tool) else function_tool(t) for t in listed()]
    return ToolRegistry(tools, timeout_s) if tools else None


class EnvAgent:
    """A white-box agent whose episodes are driven by a fresh ``factory()`` environment each.

    An environment with ``tools()`` gets tool calls answered by the framework: an assistant turn
    holding ``<tool_call>`` blocks runs them (each under ``tool_timeout_s``, a failure becomes the
    observation) and shows their results as a tool turn; a turn without calls goes to ``step``.
    """

    def __init__(self, factory: Callable[[], Any], tool_timeout_s: float = 10.0, chat: Any = ChatML) -> None:
        self.factory, self.tool_timeout_s, self.chat = factory, tool_timeout_s, chat

    async def run(self, episode: Episode | ScriptedEpisode) -> float:
        env = self.factory()
        total = 0.0
        try:
            tools, chat = env_tools(env, self.tool_timeout_s), self.chat
            schemas = tools.schemas() if tools is not None else None
            episode.prompt(chat.prompt_pieces(await _call(env.reset, episode.task), schemas))
            while True:
                text = await episode.generate()
                if episode.truncated:
                    return total
                if tools is not None and (calls := parse_tool_calls(text)):
                    episode.observe(chat.tool_turn_pieces(await tools.run(calls)))
                    continue
                result: StepResult = await _call(env.step, chat.strip_end(text))
                total += float(result.reward)
                if result.done:
                    return total
                if not result.observations:
                    raise ValueError("a step that is not done must return observations for the next turn")
                episode.observe(chat.turn_pieces(result.observations))
        finally:
            close = getattr(env, "close", None)
            if close is not None:
                await _call(close)


class GymTextEnv:
    """An :class:`Environment` over a gymnasium-style text env: ``reset(seed=task.get("seed"),
    options=task)`` gives the first user message, each ``step`` the next (``terminated`` or
    ``truncated`` ends the episode). ``system``: a system message before the first."""

    def __init__(self, env: Any, system: str = "") -> None:
        self.env, self.system = env, system

    def reset(self, task: dict[str, Any]) -> list[dict[str, str]]:
        observation, _info = self.env.reset(seed=task.get("seed"), options=task)
        first = [{"role": "user", "content": str(observation)}]
        return [{"role": "system", "content": self.system}, *first] if self.system else first

    def step(self, action: str) -> StepResult:
        observation, reward, terminated, truncated, _info = self.env.step(action)
        done = bool(terminated or truncated)
        shown = [] if done else [{"role": "user", "content": str(observation)}]
        return StepResult(observations=shown, reward=float(reward), done=done)

    def close(self) -> None:
        self.env.close()


class SkyRLTextEnv:
    """An :class:`Environment` over a SkyRL-gym text env. SkyRL builds one env per dataset row
    (the row is its constructor's ``extras``), so ``build(row)`` makes it at ``reset``, which
    hands ``init`` the row's ``prompt_key`` messages (a string is one user message).

    Its steps' rewards are summed like any environment's (SkyRL's per-turn rewards); a step's
    ``metadata`` becomes its :class:`StepResult`'s info. A ``postprocessed_action`` is ignored: the trajectory
    keeps the tokens the model sampled, which is what it is trained on."""

    def __init__(self, build: Callable[[dict[str, Any]], Any], prompt_key: str = "prompt") -> None:
        self.build, self.prompt_key, self.env = build, prompt_key, None

    def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:
        self.env = self.build(row)
        prompt = row.get(self.prompt_key)
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if not isinstance(prompt, list):
            raise ValueError(
                f"a SkyRL row's {self.prompt_key!r} must be chat messages or a string, got {prompt!r:.80}"
            )
        messages, _metadata = self.env.init([dict(m) for m in prompt])
        return [{"role": m["role"], "content": m["content"]} for m in messages]

    def step(self, action: str) -> StepResult:
        out = self.env.step(action)
        done = bool(out["done"])
        shown = [] if done else [{"role": m["role"], "content": m["content"]} for m in out["observations"]]
        info = {str(k): str(v) for k, v in (out.get("metadata") or {}).items()}
        return StepResult(observations=shown, reward=float(out["reward"]), done=done, info=info)

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
