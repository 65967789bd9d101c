"""Turning engine spans into OpenAI answers: finish a choice, build JSON bodies and SSE event lists.

A choice is cut at the first ``stop`` string: its kept token ids run up to and including the token
that completes the stop string, the text shown to the agent ends before it (as OpenAI does).
A turn that ended in one of the renderer's stop tokens is *closed*; the stop token stays in the
recorded ids and is left out of the text. Streaming replays a finished completion as OpenAI does:
a role chunk, one content chunk per token, tool-call chunks (header, then arguments), a finish
chunk, an optional usage chunk, then ``data: [DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from loong_agentflow.proxy_render import ChatRenderer, split_completion
from loong_agentflow.proxy_session import MessageKey, args_key
from loong_agentflow.proxy_wire import DONE, next_id, sse
from loong_core.records import SpanSource, TokenSpan

__all__ = ["Choice", "chat_body", "chat_events", "completion_body", "completion_events", "finish_choice"]


@dataclass(slots=True)
class Choice:
    span: TokenSpan
    text: str
    closed: bool
    finish: str
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reply: MessageKey | None = None


def finish_choice(
    span: TokenSpan, renderer: ChatRenderer, stop_ids: Collection[int], stops: Sequence[str], chat: bool
) -> Choice:
    ids = span.token_ids
    closed = bool(ids) and ids[-1] in stop_ids
    text = renderer.decode(ids[:-1] if closed else ids)
    finish = "stop" if closed else "length"
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if cut >= 0:
        stop = next(s for s in stops if text.find(s) == cut)
        keep = _tokens_covering(renderer.decode, ids, cut + len(stop))
        span = _prefix(span, keep)
        text, closed, finish = text[:cut], False, "stop"
    choice = Choice(span, text, closed, finish)
    if chat:
        content, calls = split_completion(text)
        choice.content = content
        choice.tool_calls = [
            {
                "id": next_id("call"),
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
            }
            for c in calls
        ] or None
        if calls and finish == "stop":
            choice.finish = "tool_calls"
        choice.reply = (
            "assistant",
            content or "",
            None,
            tuple((c.name, args_key(c.arguments)) for c in calls),
        )
    return choice


def _tokens_covering(decode: Callable[[list[int]], str], ids: list[int], n_chars: int) -> int:
    """The fewest leading tokens whose text reaches ``n_chars`` characters (binary search)."""
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(ids[:mid])) >= n_chars:
            hi = mid
        else:
            lo = mid + 1
    return hi


def _prefix(span: TokenSpan, k: int) -> TokenSpan:
    return TokenSpan(
        token_ids=span.token_ids[:k],
        source=SpanSource.MODEL,
        logprobs=span.logprobs[:k],
        weight_version=span.weight_version,
        versions=span.versions[:k],
    )


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


def _pieces(decode: Callable[[list[int]], str], ids: list[int], text: str) -> list[str]:
    """Per-token text pieces that concatenate to ``text`` (incremental detokenization: a token that
    ends inside a multi-byte character contributes ``""`` and the next one carries the character)."""
    pieces: list[str] = []
    prefix = read = 0
    for k in range(len(ids)):
        before = decode(ids[prefix:read])
        now = decode(ids[prefix : k + 1])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            pieces.append(now[len(before) :])
            prefix, read = read, k + 1
        else:
            pieces.append("")
    return pieces if "".join(pieces) == text else [text] + [""] * (len(ids) - 1)


def chat_events(
    model: str,
    prompt: list[int],
    choices: Sequence[Choice],
    renderer: ChatRenderer,
    logprobs: bool,
    include_usage: bool,
    created: int,
    token_ids: bool = False,
) -> list[bytes]:
    """:func:`chat_body` as chunks; with ``token_ids`` a first chunk (no choices) carries
    ``prompt_token_ids`` and each choice's chunks the ids of the tokens they show (concatenated:
    the choice's sampled ids)."""
    base: dict[str, Any] = {"id": next_id("chatcmpl"), "object": "chat.completion.chunk", "created": created}
    base |= {"model": model, "system_fingerprint": None}
    if include_usage:
        base["usage"] = None

    def chunk(
        i: int,
        delta: dict[str, Any],
        lp: list[dict[str, Any]] | None = None,
        finish: str | None = None,
        ids: list[int] | None = None,
    ):
        lps = {"content": lp, "refusal": None} if logprobs and lp else None
        choice = {"index": i, "delta": delta, "logprobs": lps, "finish_reason": finish}
        if token_ids:
            choice["token_ids"] = ids or []
        return sse({**base, "choices": [choice]})

    events: list[bytes] = []
    if token_ids:
        events.append(sse({**base, "choices": [], "prompt_token_ids": list(prompt)}))
    for i, c in enumerate(choices):
        events.append(chunk(i, {"role": "assistant", "content": "", "refusal": None}))
        entries = _logprob_entries(renderer, c.span) if logprobs else []
        sampled = list(c.span.token_ids)
        used = 0
        if c.content:
            ids = c.span.token_ids[:-1] if c.closed else c.span.token_ids
            emitted = 0
            for k, piece in enumerate(_pieces(renderer.decode, ids, c.text)):
                if emitted >= len(c.content):
                    break
                piece = piece[: len(c.content) - emitted]
                emitted += len(piece)
                events.append(chunk(i, {"content": piece}, entries[k : k + 1], ids=sampled[k : k + 1]))
                used = k + 1
        for j, call in enumerate(c.tool_calls or ()):
            head = {"index": j, "id": call["id"], "type": "function"}
            head["function"] = {"name": call["function"]["name"], "arguments": ""}
            events.append(chunk(i, {"tool_calls": [head]}))
            args = {"index": j, "function": {"arguments": call["function"]["arguments"]}}
            events.append(chunk(i, {"tool_calls": [args]}))
        events.append(chunk(i, {}, entries[used:], c.finish, ids=sampled[used:]))
    if include_usage:
        events.append(sse({**base, "choices": [], "usage": _usage(len(prompt), choices)}))
    events.append(DONE)
    return events


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


def completion_events(
    model: str,
    prompt: list[int],
    choices: Sequence[Choice],
    renderer: ChatRenderer,
    include_usage: bool,
    created: int,
) -> list[bytes]:
    base = {"id": next_id("cmpl"), "object": "text_completion", "created": created, "model": model}
    events = []
    for i, c in enumerate(choices):
        ids = c.span.token_ids[:-1] if c.closed else c.span.token_ids
        emitted = 0
        for piece in _pieces(renderer.decode, ids, c.text):
            piece = piece[: len(c.text) - emitted]
            if piece:
                emitted += len(piece)
                events.append(
                    sse(
                        {
                            **base,
                            "choices": [{"index": i, "text": piece, "logprobs": None, "finish_reason": None}],
                        }
                    )
                )
        events.append(
            sse({**base, "choices": [{"index": i, "text": "", "logprobs": None, "finish_reason": c.finish}]})
        )
    if include_usage:
        events.append(sse({**base, "choices": [], "usage": _usage(len(prompt), choices)}))
    events.append(DONE)
    return events
