"""Request parsing for the SGLang-compatible server: SGLang's field names, errors that name the field.

Every check raises ``BadRequest(param, message)``; the server turns it into a 400 with SGLang's
error body plus ``param``. Fields are read by name with their JSON type checked (``bool`` is not
an ``int`` here, though it is in Python).
"""

from __future__ import annotations

from typing import Any

import torch
from starlette.requests import Request
from starlette.responses import JSONResponse

from loong_core.protocols import SamplingParams

__all__ = [
    "BadRequest",
    "bad_request",
    "dtype_named",
    "field",
    "is_int",
    "json_body",
    "sampling_params",
    "token_ids",
]

_MISSING = object()
# SGLang sampling options this server cannot honour, with SGLang's defaults (accepted when default).
_DEFAULTS: dict[str, Any] = {
    "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1, "ignore_eos": False, "stop": None,
    "logit_bias": None, "regex": None, "json_schema": None, "ebnf": None, "structural_tag": None,
    "custom_params": None, "sampling_seed": None,
}  # fmt: skip
# Options that only shape detokenized text, which this server never returns.
_TEXT_ONLY = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"}


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_KINDS = {
    int: is_int,
    float: lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    bool: lambda v: isinstance(v, bool),
    str: lambda v: isinstance(v, str),
    list: lambda v: isinstance(v, list),
    dict: lambda v: isinstance(v, dict),
}


class BadRequest(Exception):
    """A request field is missing or wrong; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def field(body: dict, key: str, kind: type, default: Any = _MISSING, where: str = "") -> Any:
    value = body.get(key)
    if value is None:
        if default is _MISSING:
            raise BadRequest(where + key, "is required")
        return default
    if not _KINDS[kind](value):
        raise BadRequest(where + key, f"must be {kind.__name__}, got {type(value).__name__}")
    return value


def token_ids(value: Any, param: str, vocab: int) -> list[int]:
    if not isinstance(value, list) or not value:
        raise BadRequest(param, "must be a non-empty list of token ids")
    if not all(is_int(t) and 0 <= t < vocab for t in value):
        raise BadRequest(param, f"must hold integer token ids in [0, {vocab})")
    return value


def sampling_params(raw: Any, param: str) -> tuple[SamplingParams, int]:
    """SGLang ``sampling_params`` -> (Loong SamplingParams, max_new_tokens which may be 0)."""
    if not isinstance(raw, dict):
        raise BadRequest(param, "must be an object")
    where = param + "."
    for key, value in raw.items():
        if key in _DEFAULTS and value not in (_DEFAULTS[key], None) and value != []:
            raise BadRequest(where + key, "is not supported by the embedded server (SGLang default only)")
        if key not in _DEFAULTS and key not in _TEXT_ONLY and key not in (
            "max_new_tokens", "temperature", "top_p", "stop_token_ids",
        ):  # fmt: skip
            raise BadRequest(where + key, "is not a sampling parameter")
    max_new = field(raw, "max_new_tokens", int, 128, where)
    temperature = field(raw, "temperature", float, 1.0, where)
    top_p = field(raw, "top_p", float, 1.0, where)
    stops = field(raw, "stop_token_ids", list, [], where)
    if max_new < 0:
        raise BadRequest(where + "max_new_tokens", "must be >= 0")
    if temperature <= 0:
        raise BadRequest(where + "temperature", "must be > 0 (greedy decoding is not supported here)")
    if not 0 < top_p <= 1:
        raise BadRequest(where + "top_p", "must be in (0, 1]")
    if not all(is_int(t) for t in stops):
        raise BadRequest(where + "stop_token_ids", "must be a list of integers")
    sampling = SamplingParams(
        temperature=temperature, top_p=top_p, max_new_tokens=max(max_new, 1), stop_token_ids=stops
    )
    return sampling, max_new


def bad_request(param: str, message: str, status: int = 400) -> JSONResponse:
    text = f"{param}: {message}"
    body = {"success": False, "object": "error", "message": text, "type": "BadRequestError"}
    return JSONResponse({**body, "param": param, "code": status}, status_code=status)


async def json_body(request: Request) -> dict:
    try:
        body = await request.json() if await request.body() else {}
    except ValueError as e:
        raise BadRequest("body", f"is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    return body


def dtype_named(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise BadRequest("dtypes", f"{name!r} is not a torch dtype name")
    return dtype
