"""White-box agents: the framework drives the token loop, the agent decides what happens.

Lifecycle of an episode: the runner creates an :class:`Episode` (task, engine, codec, limits);
the agent appends the prompt, then alternates ``await episode.generate()`` (model tokens, with
logprobs and weight versions) and ``episode.observe(text)`` (tool or environment tokens, loss
mask 0), and returns the reward. The runner turns the episode into a :class:`Trajectory`.

Example::

    agent = ToolAgent(ToolRegistry([Tool("calc", calc)]), reward_fn=lambda task, answer: ...)
    trajectories = await run_episodes(agent, specs, engine, codec, sampling)
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from loong_agentflow.tokens import Piece, TextCodec, TokenBuffer, joined
from loong_agentflow.tools import ToolRegistry, ToolResult, parse_tool_calls
from loong_core.protocols import RolloutEngine, SamplingParams
from loong_core.records import EpisodeStatus, SpanSource, Trajectory

__all__ = [
    "Agent",
    "ChatML",
    "Episode",
    "EpisodeLimits",
    "EpisodeSpec",
    "Reward",
    "ScriptedEpisode",
    "ToolAgent",
    "run_episodes",
]


@dataclass(frozen=True)
class EpisodeLimits:
    """Caps on one episode: agent turns, model tokens in total, wall time."""

    max_turns: int = 4
    max_model_tokens: int = 256
    timeout_s: float = 120.0


@dataclass
class EpisodeSpec:
    """What to run: the ledger id, the GRPO group, the task payload and routing tags.

    ``seed``: the episode's sampling seed. Turn ``t`` (0-based) asks the engine for
    ``(seed + t) mod 2**64``, so an episode's tokens depend only on its seed and the weights, not
    on which worker runs it or what ran before (resumed runs sample what an uninterrupted run
    would). It reaches engines whose ``generate`` takes ``seed=`` (the embedded engine); ``None``
    or another engine: the engine's own random stream.
    """

    sample_id: str
    group_id: str
    task: dict[str, Any]
    tags: dict[str, str] = field(default_factory=dict)
    seed: int | None = None


class Episode:
    """One running episode: its transcript buffer plus the policy it samples from."""

    def __init__(
        self,
        spec: EpisodeSpec,
        engine: RolloutEngine,
        codec: TextCodec,
        sampling: SamplingParams,
        limits: EpisodeLimits,
    ) -> None:
        self.spec, self.engine, self.sampling, self.limits = spec, engine, sampling, limits
        self.buffer = TokenBuffer(codec)
        self.truncated = False
        self.turns = 0
        self.metrics: dict[str, float] = {}  # the episode's numbers for the run's metrics
        self.seed = spec.seed if _takes_seed(engine) else None

    @property
    def task(self) -> dict[str, Any]:
        return self.spec.task

    def prompt(self, text: str | Sequence[Piece]) -> None:
        """Append the prompt: a string, or pieces whose untrusted text cannot forge control tokens."""
        self.buffer.append_text(text, SpanSource.PROMPT)

    def observe(self, text: str | Sequence[Piece], source: SpanSource = SpanSource.TOOL) -> None:
        self.buffer.append_text(text, source)

    async def generate(self) -> str:
        """Sample the next model turn; returns its text (the stop token included, if hit)."""
        budget = self.limits.max_model_tokens - self.buffer.num_model_tokens
        if budget <= 0 or self.turns >= self.limits.max_turns:
            self.truncated = True
            return ""
        sampling = msgspec.structs.replace(
            self.sampling, max_new_tokens=min(budget, self.sampling.max_new_tokens)
        )
        seed = {"seed": (self.seed + self.turns) % 2**64} if self.seed is not None else {}
        span = await self.engine.generate(list(self.buffer.ids), sampling, **seed)
        self.buffer.append(span)
        self.turns += 1
        hit_stop = bool(span.token_ids) and span.token_ids[-1] in sampling.stop_token_ids
        self.truncated = not hit_stop
        return self.buffer.codec.decode(span.token_ids)

    def trajectory(
        self, reward: float, status: EpisodeStatus, info: dict[str, str] | None = None
    ) -> Trajectory:
        if status is EpisodeStatus.OK and self.truncated:
            status = EpisodeStatus.TRUNCATED
        return Trajectory(
            sample_id=self.spec.sample_id,
            group_id=self.spec.group_id,
            spans=list(self.buffer.spans),
            reward=reward,
            status=status,
            tags=dict(self.spec.tags),
            info=info or {},
            metrics=dict(self.metrics),
        ).checked()


class ScriptedEpisode:
    """An :class:`Episode` stand-in whose model turns are given: an agent run on it plays an
    expert's turns against its tools or environment and records the transcript as
    ``(text, is_model)`` pieces in exactly the layout the agent gives a real episode's tokens (what a
    supervised warm start trains on). ``exhausted``: the agent asked for more turns than given."""

    def __init__(self, task: dict[str, Any], turns: Sequence[str]) -> None:
        self.task, self.turns = task, list(turns)
        self.pieces: list[tuple[str, bool]] = []
        self.truncated = self.exhausted = False

    def prompt(self, text: str | Sequence[Piece]) -> None:
        self.pieces.append((joined(text), False))

    def observe(self, text: str | Sequence[Piece], source: SpanSource = SpanSource.TOOL) -> None:
        self.pieces.append((joined(text), False))

    async def generate(self) -> str:
        if not self.turns:
            self.truncated = self.exhausted = True
            return ""
        text = self.turns.pop(0) + ChatML.END
        self.pieces.append((text, True))
        return text


def _takes_seed(engine: RolloutEngine) -> bool:
    try:
        return "seed" in inspect.signature(engine.generate).parameters
    except (TypeError, ValueError):  # no introspectable signature
        return False


class Agent(Protocol):
    """A white-box agent: runs one episode and returns its reward."""

    async def run(self, episode: Episode) -> float: ...


class Reward(float):
    """A reward with other numbers beside it, which the episode's trajectory carries into the run's
    metrics (``Reward(0.5, {"format": 1.0})``); anywhere a reward is a float, so is this."""

    metrics: dict[str, float]

    def __new__(cls, value: float, metrics: dict[str, float] | None = None) -> Reward:
        out = super().__new__(cls, value)
        out.metrics = dict(metrics or {})
        return out


class ChatML:
    """ChatML text pieces matching Loong's chat template (and Qwen's), so the token buffer
    decodes to exactly what ``tokenizer.apply_chat_template`` renders for the same messages."""

    END = "<|im_end|>"

    @staticmethod
    def prompt_pieces(messages: Sequence[dict[str, str]], tools: Any = None) -> list[Piece]:
        """The prompt as :data:`~loong_agentflow.tokens.Piece` s: the contents are untrusted.
        ``tools`` are not listed (tiny policies learn the layout, not schemas)."""
        pieces: list[Piece] = []
        for m in messages:
            pieces += [(f"<|im_start|>{m['role']}\n", False), (m["content"], True), ("<|im_end|>\n", False)]
        return [*pieces, ("<|im_start|>assistant\n", False)]

    @staticmethod
    def prompt(messages: Sequence[dict[str, str]]) -> str:
        return joined(ChatML.prompt_pieces(messages))

    @staticmethod
    def tool_turn_pieces(results: Sequence[ToolResult]) -> list[Piece]:
        """What follows an assistant turn that ended with ``<|im_end|>``: the tool responses
        (untrusted) and the next assistant header."""
        pieces: list[Piece] = [("\n", False)]
        for r in results:
            pieces += [("<|im_start|>user\n<tool_response>", False), (r.content, True)]
            pieces.append(("</tool_response><|im_end|>\n", False))
        return [*pieces, ("<|im_start|>assistant\n", False)]

    @staticmethod
    def tool_turn(results: Sequence[ToolResult]) -> str:
        return joined(ChatML.tool_turn_pieces(results))

    @staticmethod
    def turn_pieces(messages: Sequence[dict[str, str]], tools: Any = None) -> list[Piece]:
        """What follows an assistant turn that ended with ``<|im_end|>``: ``messages`` (contents
        untrusted; ``tool`` ones as Hermes ``<tool_response>`` user turns) and the next header."""
        pieces: list[Piece] = [("\n", False)]
        for m in messages:
            if m["role"] == "tool":
                head, tail = "<|im_start|>user\n<tool_response>", "</tool_response><|im_end|>\n"
            else:
                head, tail = f"<|im_start|>{m['role']}\n", "<|im_end|>\n"
            pieces += [(head, False), (m["content"], True), (tail, False)]
        return [*pieces, ("<|im_start|>assistant\n", False)]

    @classmethod
    def strip_end(cls, text: str) -> str:
        return text.removesuffix(cls.END)


class ToolAgent:
    """A Hermes-format tool-using agent: call tools until the model answers without a call.

    ``reward_fn(task, final_answer)`` scores the last assistant turn's text (a float, or a
    :class:`Reward` whose other numbers go into the trajectory's ``metrics``). ``chat`` lays the
    episode out (:class:`ChatML`, or a model's own template:
    :func:`~loong_agentflow.chat_template.chat_format`), the tool list in the prompt when it lists one.
    """

    def __init__(
        self, tools: ToolRegistry, reward_fn: Callable[[dict[str, Any], str], float], chat: Any = ChatML
    ) -> None:
        self.tools, self.reward_fn, self.chat = tools, reward_fn, chat

    async def run(self, episode: Episode) -> float:
        chat = self.chat
        episode.prompt(chat.prompt_pieces(episode.task["messages"], self.tools.schemas()))
        while True:
            text = await episode.generate()
            if episode.truncated:
                return 0.0
            calls = parse_tool_calls(text)
            if not calls:
                score = self.reward_fn(episode.task, chat.strip_end(text))
                episode.metrics.update(getattr(score, "metrics", {}))  # a Reward's other numbers
                return float(score)
            episode.observe(chat.tool_turn_pieces(await self.tools.run(calls)))


async def run_episode(agent: Agent, episode: Episode) -> Trajectory:
    """Run one episode; a crash or time-out is recorded in the trajectory, never raised."""
    start = time.monotonic()
    try:
        reward = await asyncio.wait_for(agent.run(episode), episode.limits.timeout_s)
        status = EpisodeStatus.OK
        info: dict[str, str] = {}
    except TimeoutError:
        reward, status = 0.0, EpisodeStatus.TIMEOUT
        info = {"error": f"episode exceeded {episode.limits.timeout_s}s"}
    except Exception as e:  # an agent's bug fails its episode, not the run
        reward, status = 0.0, EpisodeStatus.FAILED
        info = {"error": f"{type(e).__name__}: {e}"}
    if status is not EpisodeStatus.OK and "id" in episode.task:  # which row, for the run's log
        info["task_id"] = str(episode.task["id"])
    info["wall_s"] = f"{time.monotonic() - start:.3f}"
    return episode.trajectory(reward, status, info)


async def run_episodes(
    agent: Agent,
    specs: Sequence[EpisodeSpec],
    engine: RolloutEngine,
    codec: TextCodec,
    sampling: SamplingParams,
    limits: EpisodeLimits = EpisodeLimits(),
) -> list[Trajectory]:
    """Run all episodes concurrently; returns trajectories in ``specs`` order."""
    episodes = [Episode(s, engine, codec, sampling, limits) for s in specs]
    return list(await asyncio.gather(*(run_episode(agent, e) for e in episodes)))
