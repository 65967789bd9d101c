"""What the two completion endpoints do their own way; everything else is one shared call path.

``POST /v1/chat/completions`` and ``POST /v1/completions`` are served by
``ProxyServer._serve``: session lookup, request decoding and checks, sampling, the engine call,
recording and answering (a JSON body or a live stream), with one error handling. An
:class:`Endpoint` supplies only what differs:

- the request Struct, and the parameter a context-length error names (``messages``, ``prompt``);
- the prompt: chat renders messages through the chat template, chained to an earlier call of the
  session by message; completions tokenize text, chained by text prefix, or take token ids;
- ``max_tokens``: chat reads ``max_completion_tokens`` or ``max_tokens`` (else the proxy's
  default), completions ``max_tokens`` or 16 (OpenAI's default);
- what the record keeps of each choice: chat its reply (to chain by message), completions its
  text (to chain by text); a chat choice is also split into content and tool calls (``chat``);
- the answer: :func:`chat_body` and :class:`ChatChunks`, or :func:`completion_body` and
  :class:`CompletionChunks`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Generic, TypeVar

import msgspec

from loong_agentflow.proxy.choices import Choice
from loong_agentflow.proxy.config import ProxyConfig
from loong_agentflow.proxy.render import ChatRenderer, tokenized
from loong_agentflow.proxy.responses import ChatChunks, CompletionChunks, chat_body, completion_body
from loong_agentflow.proxy.session import CallRecord, ProxySession, normalize_messages
from loong_agentflow.proxy.wire import ApiError, ChatRequest, CompletionRequest
from loong_core.records import SpanSource

__all__ = ["ChatEndpoint", "CompletionEndpoint", "Endpoint"]

R = TypeVar("R", ChatRequest, CompletionRequest)

_json = msgspec.json.Encoder()


class Endpoint(Generic[R]):
    """One completion endpoint's own parts (see the module docstring); the base records the
    choices' spans, which both endpoints keep."""

    request: ClassVar[type[Any]]
    chat: ClassVar[bool]
    param: ClassVar[str]

    def __init__(self, renderer: ChatRenderer, config: ProxyConfig) -> None:
        self.renderer, self.config = renderer, config

    def prompt(self, req: R, session: ProxySession) -> CallRecord:
        """The call's record before it has choices: the prompt ids and what chains later calls to it."""
        raise NotImplementedError

    def max_tokens(self, req: R) -> int | None:
        raise NotImplementedError

    def record(self, head: CallRecord, choices: list[Choice]) -> CallRecord:
        """``head`` (from :meth:`prompt`) with the answered choices, as the session records it."""
        return dataclasses.replace(
            head,
            spans=[c.span for c in choices],
            closed=[c.closed for c in choices],
            finish=[c.finish for c in choices],
        )

    def body(self, req: R, prompt: list[int], choices: list[Choice], created: int) -> dict[str, Any]:
        raise NotImplementedError

    def chunks(self, req: R, created: int) -> ChatChunks | CompletionChunks:
        raise NotImplementedError


class ChatEndpoint(Endpoint[ChatRequest]):
    """``POST /v1/chat/completions``: a call whose messages extend an earlier call's messages and
    reply (same tools) continues that call's prompt and completion ids, never re-tokenized."""

    request = ChatRequest
    chat = True
    param = "messages"

    def prompt(self, req: ChatRequest, session: ProxySession) -> CallRecord:
        messages, keys = normalize_messages(req.messages)
        tools_key = _json.encode(req.tools) if req.tools else b""
        parent = session.chat_parent(keys, tools_key)
        if parent is None:
            ids, observation = tokenized(self.renderer.render, messages, req.tools), SpanSource.ENV
        else:
            prev, k = parent
            new = messages[len(prev.messages or ()) + 1 :]
            ids = prev.prompt_ids + prev.spans[k].token_ids
            if not prev.closed[k]:
                ids = ids + self.renderer.turn_end_ids
            ids = ids + tokenized(self.renderer.continuation, new, req.tools)
            tool_only = all(m["role"] == "tool" for m in new)
            observation = SpanSource.TOOL if tool_only else SpanSource.ENV
        return CallRecord(
            prompt_ids=ids,
            spans=[],
            closed=[],
            finish=[],
            observation=observation,
            messages=keys,
            tools_key=tools_key,
        )

    def max_tokens(self, req: ChatRequest) -> int | None:
        return req.max_completion_tokens or req.max_tokens

    def record(self, head: CallRecord, choices: list[Choice]) -> CallRecord:
        call = super().record(head, choices)
        call.replies = [c.reply for c in choices if c.reply is not None]
        return call

    def body(
        self, req: ChatRequest, prompt: list[int], choices: list[Choice], created: int
    ) -> dict[str, Any]:
        logprobs, ids = bool(req.logprobs), req.return_token_ids
        return chat_body(self.config.model, prompt, choices, self.renderer, logprobs, created, ids)

    def chunks(self, req: ChatRequest, created: int) -> ChatChunks:
        logprobs, usage, ids = bool(req.logprobs), req.streams_usage(), req.return_token_ids
        return ChatChunks(self.config.model, created, self.renderer, logprobs, usage, ids)


class CompletionEndpoint(Endpoint[CompletionRequest]):
    """``POST /v1/completions``: a text prompt that extends an earlier call's prompt and returned
    text (or all its decoded ids) reuses that call's ids; a token-id prompt is taken as is."""

    request = CompletionRequest
    chat = False
    param = "prompt"

    def prompt(self, req: CompletionRequest, session: ProxySession) -> CallRecord:
        text = req.prompt if isinstance(req.prompt, str) else None
        ids = self._text_ids(text, session) if text is not None else self._checked(req.prompt)
        if not ids:
            raise ApiError(400, "Invalid 'prompt': it is empty.", param="prompt")
        return CallRecord(prompt_ids=ids, spans=[], closed=[], finish=[], prompt_text=text)

    def _text_ids(self, text: str, session: ProxySession) -> list[int]:
        parent = session.text_parent(text)
        if parent is None:
            return tokenized(self.renderer.encode, text, param="prompt")
        reused, rest = parent
        return reused + (tokenized(self.renderer.encode, rest, param="prompt") if rest else [])

    def _checked(self, ids: list[int]) -> list[int]:
        vocab = self.config.vocab_size
        if bad := [t for t in ids if t < 0 or (vocab and t >= vocab)][:3]:
            raise ApiError(
                400,
                f"Invalid 'prompt': token ids {bad} are outside the vocabulary [0, {vocab or 'inf'}).",
                param="prompt",
            )
        return ids

    def max_tokens(self, req: CompletionRequest) -> int | None:
        return req.max_tokens or 16

    def record(self, head: CallRecord, choices: list[Choice]) -> CallRecord:
        call = super().record(head, choices)
        call.texts = [(c.text, self.renderer.decode(c.span.token_ids)) for c in choices]
        return call

    def body(
        self, req: CompletionRequest, prompt: list[int], choices: list[Choice], created: int
    ) -> dict[str, Any]:
        logprobs, ids = bool(req.logprobs), req.return_token_ids
        return completion_body(self.config.model, prompt, choices, self.renderer, logprobs, created, ids)

    def chunks(self, req: CompletionRequest, created: int) -> CompletionChunks:
        return CompletionChunks(self.config.model, created, req.streams_usage())
