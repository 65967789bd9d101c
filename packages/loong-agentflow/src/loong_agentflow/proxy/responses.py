"""OpenAI answers built from finished choices: JSON bodies and the SSE chunks of live streams.

A chat stream is a role chunk, content chunks as text becomes showable, tool-call chunks (header,
then arguments) once the choice finished, a finish chunk, an optional usage chunk, then
``data: [DONE]`` (:class:`ChatChunks`; text completions: :class:`CompletionChunks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loong_agentflow.proxy.choices import Choice, LiveText
from loong_agentflow.proxy.render import ChatRenderer
from loong_agentflow.proxy.wire import DONE, next_id, sse
from loong_core.records import TokenSpan

__all__ = ["ChatChunks", "CompletionChunks", "chat_body", "completion_body"]


def _logprob_entries(renderer: ChatRenderer, span: TokenSpan) -> list[dict[str, Any]]:
    out = []
    for t, lp in zip(span.token_ids, span.logprobs, strict=True):
        tok = renderer.decode([t])
        out.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []})
    return out


def _usage(prompt_len: int, choices: Sequence[Choice]) -> dict[str, int]:
    completion = sum(len(c.span.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt_len,
        "completion_tokens": completion,
        "total_tokens": prompt_len + completion,
    }


def chat_body(
    model: str,
    prompt: list[int],
    choices: Sequence[Choice],
    renderer: ChatRenderer,
    logprobs: bool,
    created: int,
    token_ids: bool = False,
) -> dict[str, Any]:
    """A chat completion; ``token_ids`` (vLLM's ``return_token_ids``) adds the prompt's token ids
    and each choice's sampled ones, end token included: exactly what the trajectory records."""
    out = []
    for i, c in enumerate(choices):
        message: dict[str, Any] = {"role": "assistant", "content": c.content, "refusal": None}
        if c.tool_calls:
            message["tool_calls"] = c.tool_calls
        lp = {"content": _logprob_entries(renderer, c.span), "refusal": None} if logprobs else None
        out.append({"index": i, "message": message, "logprobs": lp, "finish_reason": c.finish})
        if token_ids:
            out[-1]["token_ids"] = list(c.span.token_ids)
    body = {
        "id": next_id("chatcmpl"),
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": out,
        "usage": _usage(len(prompt), choices),
        "system_fingerprint": None,
    }
    if token_ids:
        body["prompt_token_ids"] = list(prompt)
    return body


def _text_logprobs(renderer: ChatRenderer, span: TokenSpan) -> dict[str, Any]:
    tokens = [renderer.decode([t]) for t in span.token_ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": list(span.logprobs),
        "top_logprobs": None,
        "text_offset": offsets,
    }


def completion_body(
    model: str,
    prompt: list[int],
    choices: Sequence[Choice],
    renderer: ChatRenderer,
    logprobs: bool,
    created: int,
    token_ids: bool = False,
) -> dict[str, Any]:
    """A text completion; ``token_ids`` as in :func:`chat_body` (vLLM puts ``prompt_token_ids``
    on each choice of a completion)."""
    out = []
    for i, c in enumerate(choices):
        choice = {
            "index": i,
            "text": c.text,
            "logprobs": _text_logprobs(renderer, c.span) if logprobs else None,
            "finish_reason": c.finish,
        }
        if token_ids:
            choice |= {"prompt_token_ids": list(prompt), "token_ids": list(c.span.token_ids)}
        out.append(choice)
    return {
        "id": next_id("cmpl"),
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": out,
        "usage": _usage(len(prompt), choices),
    }


class ChatChunks:
    """The SSE events of a streamed chat completion (``token_ids``: vLLM's ``return_token_ids``:
    a first event carries ``prompt_token_ids``, and each choice's chunks the ids of the tokens
    they show, concatenated the choice's sampled ids)."""

    def __init__(
        self,
        model: str,
        created: int,
        renderer: ChatRenderer,
        logprobs: bool,
        include_usage: bool,
        token_ids: bool,
    ) -> None:
        self.renderer, self.logprobs, self.token_ids = renderer, logprobs, token_ids
        self.base: dict[str, Any] = {"id": next_id("chatcmpl"), "object": "chat.completion.chunk"}
        self.base |= {"created": created, "model": model, "system_fingerprint": None}
        if include_usage:
            self.base["usage"] = None

    def _chunk(
        self, i: int, delta: dict[str, Any], span: TokenSpan | None = None, finish: str | None = None
    ) -> bytes:
        lp = _logprob_entries(self.renderer, span) if self.logprobs and span else None
        choice = {
            "index": i,
            "delta": delta,
            "logprobs": {"content": lp, "refusal": None} if lp else None,
            "finish_reason": finish,
        }
        if self.token_ids:
            choice["token_ids"] = list(span.token_ids) if span else []
        return sse({**self.base, "choices": [choice]})

    def start(self, prompt: list[int], n: int) -> list[bytes]:
        events = (
            [sse({**self.base, "choices": [], "prompt_token_ids": list(prompt)})] if self.token_ids else []
        )
        return events + [
            self._chunk(i, {"role": "assistant", "content": "", "refusal": None}) for i in range(n)
        ]

    def content(self, i: int, text: str, span: TokenSpan) -> bytes:
        return self._chunk(i, {"content": text}, span)

    def finish(self, i: int, choice: Choice, live: LiveText) -> list[bytes]:
        """The rest of a finished choice: content not shown yet, its tool calls, the finish chunk."""
        text, span = live.rest(choice)
        events = [self.content(i, text, span)] if text else []
        for j, call in enumerate(choice.tool_calls or ()):
            head = {"index": j, "id": call["id"], "type": "function"}
            head["function"] = {"name": call["function"]["name"], "arguments": ""}
            events.append(self._chunk(i, {"tool_calls": [head]}))
            args = {"index": j, "function": {"arguments": call["function"]["arguments"]}}
            events.append(self._chunk(i, {"tool_calls": [args]}))
        events.append(self._chunk(i, {}, None if text else span, choice.finish))
        return events

    def end(self, prompt_len: int, choices: Sequence[Choice]) -> list[bytes]:
        usage = [sse({**self.base, "choices": [], "usage": _usage(prompt_len, choices)})]
        return [*(usage if "usage" in self.base else ()), DONE]


class CompletionChunks:
    """The SSE events of a streamed text completion."""

    def __init__(self, model: str, created: int, include_usage: bool) -> None:
        self.base = {"id": next_id("cmpl"), "object": "text_completion", "created": created, "model": model}
        self.include_usage = include_usage

    def _chunk(self, i: int, text: str, finish: str | None = None) -> bytes:
        return sse(
            {**self.base, "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": finish}]}
        )

    def start(self, prompt: list[int], n: int) -> list[bytes]:
        return []

    def content(self, i: int, text: str, span: TokenSpan) -> bytes:
        return self._chunk(i, text)

    def finish(self, i: int, choice: Choice, live: LiveText) -> list[bytes]:
        text, _ = live.rest(choice)
        return [*([self._chunk(i, text)] if text else ()), self._chunk(i, "", choice.finish)]

    def end(self, prompt_len: int, choices: Sequence[Choice]) -> list[bytes]:
        usage = sse({**self.base, "choices": [], "usage": _usage(prompt_len, choices)})
        return [*((usage,) if self.include_usage else ()), DONE]
