"""Proxy sessions: per-episode call records, message-level chaining, and trajectory rows.

A session is one episode of a black-box agent, addressed by its own API key. Every answered call
is recorded as a :class:`CallRecord` (prompt ids, one model span per choice with logprobs and
weight versions). At the end the calls become trajectory rows by exact token prefix:

- a choice whose prompt ids start with the ids of an existing row extends that row (the longest
  such row): the prompt's new tokens are a non-model span (loss mask 0), the completion a model
  span (loss mask 1);
- otherwise it starts a new row of the same episode: ``[prompt span, model span]``.

Row 0 keeps the episode's ``sample_id``; row ``i > 0`` is ``f"{sample_id}#{i}"``, and every row
carries ``info["episode"]``, ``info["row"]`` and ``info["rows"]``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from loong_agentflow.proxy.wire import ApiError, Message
from loong_core.records import EpisodeStatus, SpanSource, TokenSpan, Trajectory

if TYPE_CHECKING:
    from loong_agentflow.agent import EpisodeSpec

__all__ = ["CallRecord", "ProxySession", "build_rows", "normalize_messages"]

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

MessageKey = tuple[str, str, str | None, tuple[tuple[str, bytes], ...]]


def args_key(args: dict[str, Any]) -> bytes:
    return msgspec.json.encode(args, order="sorted")


def normalize_messages(messages: list[Message]) -> tuple[list[dict[str, Any]], list[MessageKey]]:
    """Wire messages -> (template-ready dicts, comparison keys). Raises ApiError 400 on bad content."""
    dicts: list[dict[str, Any]] = []
    keys: list[MessageKey] = []
    for i, m in enumerate(messages):
        if m.role not in _ROLES:
            raise ApiError(400, f"Unknown message role {m.role!r}.", param=f"messages[{i}].role")
        content = m.content
        if isinstance(content, list):
            if any(p.type != "text" for p in content):
                raise ApiError(400, "Only text content parts are supported.", param=f"messages[{i}].content")
            content = "".join(p.text or "" for p in content)
        d: dict[str, Any] = {"role": m.role, "content": content if content is not None else ""}
        calls: tuple[tuple[str, bytes], ...] = ()
        if m.tool_calls:
            d["tool_calls"] = [_tool_call(i, c.function.name, c.function.arguments) for c in m.tool_calls]
            calls = tuple(
                (c["function"]["name"], args_key(c["function"]["arguments"])) for c in d["tool_calls"]
            )
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        dicts.append(d)
        keys.append((m.role, d["content"], m.name, calls))
    return dicts, keys


def _tool_call(i: int, name: str, arguments: str) -> dict[str, Any]:
    try:
        args = msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        args = None
    if not isinstance(args, dict):
        raise ApiError(
            400, "Tool call arguments must be a JSON object.", param=f"messages[{i}].tool_calls"
        ) from None
    return {"type": "function", "function": {"name": name, "arguments": args}}


@dataclass(slots=True)
class CallRecord:
    """One answered call. ``spans[k]`` is choice k's model span; ``closed[k]``: it ended in a stop token.

    Chat calls keep the request's message keys and each choice's reply key (for chaining the next
    call at message level); completion calls keep the prompt text and each choice's text.
    """

    prompt_ids: list[int]
    spans: list[TokenSpan]
    closed: list[bool]
    finish: list[str]
    observation: SpanSource = SpanSource.ENV
    messages: list[MessageKey] | None = None
    tools_key: bytes = b""
    replies: list[MessageKey] = field(default_factory=list)
    prompt_text: str | None = None
    texts: list[tuple[str, str]] = field(default_factory=list)


class ProxySession:
    """One episode's calls, reward and state. Created by ``ProxyServer.open_session``."""

    def __init__(self, api_key: str, spec: EpisodeSpec, max_model_tokens: int = 0) -> None:
        self.api_key, self.spec, self.max_model_tokens = api_key, spec, max_model_tokens
        self.calls: list[CallRecord] = []
        self.reward: float | None = None
        self.turn_rewards: list[float] = []
        self.errors: list[str] = []
        self.model_tokens = 0
        self.budget_exhausted = False
        self.closed = False
        self.done = asyncio.Event()

    def chat_parent(self, keys: list[MessageKey], tools_key: bytes) -> tuple[CallRecord, int] | None:
        """The latest (call, choice) whose messages plus reply are a strict prefix of ``keys``."""
        for call in reversed(self.calls):
            prev = call.messages
            if prev is None or call.tools_key != tools_key or len(keys) <= len(prev) + 1:
                continue
            reply = keys[len(prev)]
            if reply in call.replies and keys[: len(prev)] == prev:
                return call, call.replies.index(reply)
        return None

    def text_parent(self, prompt: str) -> tuple[list[int], str] | None:
        """For text completions: (ids to reuse, text left to tokenize) when ``prompt`` extends a call.

        ``texts[k]`` holds choice k's (returned text, decoded text of all its ids); a prompt may
        continue after either (the stop token is dropped from the reused ids in the first case).
        """
        for call in reversed(self.calls):
            if call.prompt_text is None or not prompt.startswith(call.prompt_text):
                continue
            rest = prompt[len(call.prompt_text) :]
            for span, closed, (shown, full) in zip(call.spans, call.closed, call.texts, strict=True):
                if rest.startswith(full):
                    return call.prompt_ids + span.token_ids, rest[len(full) :]
                if rest.startswith(shown):
                    ids = span.token_ids[:-1] if closed else span.token_ids
                    return call.prompt_ids + ids, rest[len(shown) :]
        return None

    def capped(self, max_new: int) -> int:
        """``max_new`` capped to what is left of the episode's model-token budget (0: unlimited).

        A call once the budget is used up is a 400 ``context_length_exceeded``, and the episode
        counts as truncated."""
        if not self.max_model_tokens:
            return max_new
        left = self.max_model_tokens - self.model_tokens
        if left <= 0:
            self.budget_exhausted = True
            raise ApiError(
                400, "The episode's model-token budget is used up.", code="context_length_exceeded"
            )
        return min(max_new, left)

    def record(self, call: CallRecord) -> None:
        self.calls.append(call)
        self.model_tokens += sum(len(s.token_ids) for s in call.spans)

    @property
    def truncated(self) -> bool:
        """The budget ran out, or the last call was cut by ``max_tokens``."""
        return self.budget_exhausted or bool(self.calls and "length" in self.calls[-1].finish)

    def trajectories(
        self, reward: float, status: EpisodeStatus, info: dict[str, str] | None = None
    ) -> list[Trajectory]:
        """The episode's rows (one empty row when the agent never got an answer)."""
        rows = build_rows(self.calls) or [[]]
        spec = self.spec
        base = {
            **(info or {}),
            "episode": spec.sample_id,
            "rows": str(len(rows)),
            "calls": str(len(self.calls)),
        }
        if self.errors:
            base["proxy_errors"] = "; ".join(self.errors[-3:])
        out = []
        for i, spans in enumerate(rows):
            row = Trajectory(
                sample_id=spec.sample_id if i == 0 else f"{spec.sample_id}#{i}",
                group_id=spec.group_id,
                spans=spans,
                reward=reward,
                status=status,
                turn_rewards=list(self.turn_rewards),
                tags=dict(spec.tags),
                info={**base, "row": str(i)},
            )
            out.append(row.checked() if spans else row)  # an empty row: the agent got no answer
        return out


def build_rows(calls: list[CallRecord]) -> list[list[TokenSpan]]:
    """Merge calls into rows by exact token prefix (see the module docstring)."""
    rows: list[tuple[list[int], list[TokenSpan]]] = []
    for call in calls:
        prompt = call.prompt_ids
        for span in call.spans:
            best: tuple[list[int], list[TokenSpan]] | None = None
            for row in rows:
                ids = row[0]
                n = len(ids)
                if n <= len(prompt) and (best is None or n > len(best[0])) and prompt[:n] == ids:
                    best = row
            if best is None:
                rows.append(
                    (
                        prompt + span.token_ids,
                        [TokenSpan(token_ids=list(prompt), source=SpanSource.PROMPT), span],
                    )
                )
                continue
            extra = prompt[len(best[0]) :]
            if extra:
                best[1].append(TokenSpan(token_ids=extra, source=call.observation))
            best[1].append(span)
            best[0].extend(extra)
            best[0].extend(span.token_ids)
    return [spans for _, spans in rows]
