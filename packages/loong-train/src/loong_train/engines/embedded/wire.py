"""Request decoding for the SGLang-compatible server: bodies are ``loong_core.sglang_api`` Structs,
decoded by msgspec, and every refusal names the field.

msgspec checks the JSON types (``bool`` is not an ``int``, as in JSON) and SGLang's ranges; this
module adds what only this server refuses. Every check raises ``BadRequest(param, message)``; the
server turns it into a 400 with SGLang's error body plus ``param``. For a msgspec error, ``param``
is the path of the offending field without the leading ``$.`` (``sampling_params.temperature``,
``input_ids[1]`` for a batch's second prompt; a position inside a list of scalars is left to the
message, so ``[1, "x"]`` names ``input_ids``); the message keeps msgspec's full path.
"""

from __future__ import annotations

import math
import re
from typing import Any, TypeVar

import msgspec
import torch
from starlette.requests import Request
from starlette.responses import Response

from loong_core.protocols import MIN_TEMPERATURE, SamplingParams
from loong_core.sglang_api import ErrorResponse, SGLangSamplingParams

__all__ = [
    "BadRequest",
    "bad_request",
    "decode_body",
    "dtype_named",
    "json_response",
    "sampling_params",
    "token_ids",
    "validation_param",
]

_T = TypeVar("_T")

# The sampling options this server honours; the others are refused unless left at SGLang's default.
_SUPPORTED = {"max_new_tokens", "temperature", "top_p", "stop_token_ids"}
# Options that only shape detokenized text, which this server never returns.
_TEXT_ONLY = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"}
_AT = re.compile(r" - at `\$\.?([^`]*)`$")
_NAMED = re.compile(r"(?:unknown|missing required) field `([^`]+)`")


class BadRequest(Exception):
    """A request field is missing or wrong; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def validation_param(error: msgspec.ValidationError) -> str:
    """The field a msgspec error is about (see the module docstring); ``body`` for the whole body."""
    text = str(error)
    at, named = _AT.search(text), _NAMED.search(text)
    path = at.group(1) if at else ""
    if named:
        path = f"{path}.{named.group(1)}" if path else named.group(1)
    return re.sub(r"\[\d+\]$", "", path) or "body"


async def decode_body(request: Request, kind: type[_T]) -> _T:
    """The request body as ``kind``; an empty body reads as ``{}``."""
    try:
        return msgspec.json.decode(await request.body() or b"{}", type=kind)
    except msgspec.ValidationError as e:
        raise BadRequest(validation_param(e), str(e)) from None
    except msgspec.DecodeError as e:
        raise BadRequest("body", f"is not valid JSON ({e})") from None


def json_response(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


def bad_request(param: str, message: str, status: int = 400) -> Response:
    return json_response(ErrorResponse(message=f"{param}: {message}", param=param, code=status), status)


def token_ids(value: Any, param: str, vocab: int) -> list[int]:
    """One prompt: a non-empty list of token ids in ``[0, vocab)`` (a nested list is refused)."""
    if not isinstance(value, list) or not value:
        raise BadRequest(param, "must be a non-empty list of token ids")
    if not all(isinstance(t, int) and 0 <= t < vocab for t in value):
        raise BadRequest(param, f"must hold integer token ids in [0, {vocab})")
    return value


def sampling_params(sp: SGLangSamplingParams | None, param: str) -> tuple[SamplingParams, int]:
    """SGLang ``sampling_params`` -> (Loong SamplingParams, max_new_tokens which may be 0)."""
    sp = sp or SGLangSamplingParams()
    for key, value in sp.non_default().items():
        if key not in _SUPPORTED and key not in _TEXT_ONLY and value != []:
            raise BadRequest(
                f"{param}.{key}", "is not supported by the embedded server (SGLang default only)"
            )
    max_new, temperature = sp.value("max_new_tokens"), sp.value("temperature")
    if temperature == 0:
        raise BadRequest(f"{param}.temperature", "must be > 0 (greedy decoding is not supported here)")
    if not (math.isfinite(temperature) and temperature >= MIN_TEMPERATURE):
        raise BadRequest(
            f"{param}.temperature",
            f"must be >= {MIN_TEMPERATURE} (below it logprobs stop being finite numbers)",
        )
    sampling = SamplingParams(
        temperature=temperature,
        top_p=sp.value("top_p"),
        max_new_tokens=max(max_new, 1),
        stop_token_ids=sp.value("stop_token_ids") or [],
    )
    return sampling, max_new


def dtype_named(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise BadRequest("dtypes", f"{name!r} is not a torch dtype name")
    return dtype
