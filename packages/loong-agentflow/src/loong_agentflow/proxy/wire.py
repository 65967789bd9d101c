"""The OpenAI wire format the proxy speaks: request Structs, error bodies, response and SSE builders.

Requests are decoded straight into msgspec Structs that forbid unknown top-level fields, so an
unsupported parameter is a 400 naming it. Parameters that are accepted but would silently change
the meaning of a rollout (penalties, seeds, logit bias, forced tool choice, top-k logprobs) are
rejected by :func:`unsupported` with the parameter's name, never ignored.
"""

from __future__ import annotations

import itertools
import os
import re
import time
from typing import Any

import msgspec

from loong_core.protocols import MIN_TEMPERATURE

__all__ = [
    "ApiError",
    "ChatRequest",
    "CompletionRequest",
    "Message",
    "decode_request",
    "error_body",
    "error_event",
    "next_id",
    "sse",
    "unsupported",
]

_json = msgspec.json.Encoder()
_PREFIX = os.urandom(4).hex()
_COUNTER = itertools.count()


def next_id(kind: str) -> str:
    """A process-unique id such as ``chatcmpl-1a2b3c4d-17`` (cheaper than a uuid per call)."""
    return f"{kind}-{_PREFIX}-{next(_COUNTER)}"


class ApiError(Exception):
    """An error answered with an OpenAI-style body: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type


def _error_json(e: ApiError) -> dict[str, Any]:
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


def error_body(e: ApiError) -> bytes:
    return _json.encode(_error_json(e))


def error_event(e: ApiError) -> bytes:
    """``e`` as the last event of a stream whose headers already went out."""
    return sse(_error_json(e))


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str


class ToolCallIn(msgspec.Struct, kw_only=True):
    function: FunctionCall
    id: str | None = None
    type: str = "function"


class Message(msgspec.Struct, kw_only=True):
    """One chat message; extra fields the SDKs echo back (``refusal``, ``annotations``...) are ignored."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    return_token_ids: bool = False  # vLLM's extension: prompt_token_ids and choices[].token_ids

    def stop_strings(self) -> list[str]:
        """``stop`` as a list (one string, several, or none)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())

    def streams_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk (``stream_options.include_usage``)."""
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Common, kw_only=True, forbid_unknown_fields=True):
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None


class CompletionRequest(_Common, kw_only=True, forbid_unknown_fields=True):
    prompt: str | list[int]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


_UNKNOWN = re.compile(r"unknown field `([^`]+)`")
_AT = re.compile(r"at `\$\.?([^`\[]*)")


MAX_JSON_DEPTH = 64
"""How deeply the free-form fields (``tools``, ``tool_choice``, ``response_format``) may nest."""


def _depth(value: Any, limit: int) -> int:
    """The nesting depth of ``value`` (lists and dicts), counted no further than ``limit + 1``."""
    if limit < 0 or not isinstance(value, dict | list):
        return 0
    children = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(c, limit - 1) for c in children), default=0)


def decode_request(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """Decode a request body; raises :class:`ApiError` 400 for bad JSON, unknown or mistyped
    fields, and JSON nested deeper than :data:`MAX_JSON_DEPTH` in the free-form fields."""
    try:
        req = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        msg = str(e)
        if m := _UNKNOWN.search(msg):
            param = m.group(1)
            where = _AT.search(msg)
            if where and where.group(1):
                param = f"{where.group(1)}.{param}"
            raise ApiError(400, f"Unsupported parameter: '{param}'.", param=param) from None
        where = _AT.search(msg)
        raise ApiError(400, f"Invalid request: {msg}", param=where.group(1) if where else None) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"The request body is not valid JSON ({e}).", code="invalid_json") from None
    except RecursionError:
        raise ApiError(
            400, f"The request body nests deeper than {MAX_JSON_DEPTH} levels.", code="invalid_json"
        ) from None
    for name in ("tools", "tool_choice", "response_format"):
        if _depth(getattr(req, name, None), MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
            raise ApiError(400, f"Invalid '{name}': nested deeper than {MAX_JSON_DEPTH} levels.", param=name)
    return req


def unsupported(req: ChatRequest | CompletionRequest, max_n: int) -> None:
    """Reject parameter values Loong cannot honour exactly; raises :class:`ApiError` 400 naming them."""
    checks: list[tuple[str, bool, str]] = [
        ("n", not 1 <= req.n <= max_n, f"must be in [1, {max_n}]"),
        ("presence_penalty", bool(req.presence_penalty), "penalties would change the sampled policy"),
        ("frequency_penalty", bool(req.frequency_penalty), "penalties would change the sampled policy"),
        ("logit_bias", bool(req.logit_bias), "logit bias would change the sampled policy"),
        ("seed", req.seed is not None, "the engine does not take per-request seeds"),
        ("max_tokens", req.max_tokens is not None and req.max_tokens < 1, "must be >= 1"),
        ("top_p", req.top_p is not None and not 0 < req.top_p <= 1, "must be in (0, 1]"),
        (
            "temperature",
            req.temperature is not None
            and req.temperature != 0
            and not MIN_TEMPERATURE <= req.temperature <= 2,
            f"must be 0 or in [{MIN_TEMPERATURE}, 2] (below {MIN_TEMPERATURE} logprobs stop being finite numbers)",
        ),
    ]
    if isinstance(req.stop, list):
        checks.append(("stop", len(req.stop) > 4, "at most 4 stop sequences"))
    if isinstance(req, ChatRequest):
        checks += [
            ("top_logprobs", bool(req.top_logprobs), "the engine returns sampled-token logprobs only"),
            ("tool_choice", req.tool_choice not in (None, "auto", "none"), "only 'auto' and 'none'"),
            (
                "response_format",
                req.response_format is not None and req.response_format.get("type") != "text",
                "only {'type': 'text'}",
            ),
            (
                "max_completion_tokens",
                req.max_completion_tokens is not None and req.max_completion_tokens < 1,
                "must be >= 1",
            ),
        ]
    else:
        checks += [
            ("echo", bool(req.echo), "not supported"),
            ("suffix", req.suffix is not None, "not supported"),
            ("best_of", req.best_of not in (None, 1), "not supported"),
            ("logprobs", req.logprobs is not None and req.logprobs > 1, "at most 1 (sampled token)"),
        ]
    for param, bad, why in checks:
        if bad:
            raise ApiError(400, f"Unsupported value for parameter '{param}': {why}.", param=param)


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + _json.encode(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"


def now() -> int:
    return int(time.time())
