"""A ``RolloutEngine`` over an SGLang server's native ``/generate`` endpoint (token ids in and out).

Works against any SGLang server (and Loong's embedded server, which serves the same endpoints on
CPU). Bodies are the Structs of ``loong_core.sglang_api``. Requests send ``input_ids``,
``sampling_params {max_new_tokens, temperature, top_p, stop_token_ids}`` (all four always, so a
server's preferred sampling defaults never apply) and ``return_logprob``; the span is built from
``output_ids`` and ``meta_info.output_token_logprobs`` (``[logprob, token_id, text]`` triples), so
nothing is re-tokenized. ``stream`` reads the same answer as SGLang streams it (``stream: true``,
cumulative events), for the proxy's live streaming. SGLang's output logprobs are ``log(softmax(logits / T))`` of the sampled
tokens before top-p filtering, which is the convention of ``loong_core.protocols.SamplingParams``.

Versions: SGLang's ``weight_version`` is a string (``"default"`` until the first update);
Loong pushes integers (``loong_transfermesh.sglang`` sends ``str(version)``). ``"default"`` reads
as ``initial_version``; any other non-integer label is an error naming it. A policy served as a
LoRA adapter over fixed base weights (:meth:`SGLangEngine.use_adapter`): requests name the
adapter (``lora_path``) and their tokens carry the adapter's version, whatever the server's label.

Failures: connection errors and 502/503/504 answers are retried with exponential backoff (a
request that never reached the server is safe to resend); other HTTP errors raise
``SGLangError`` with the server's message, as does an answer that does not decode as SGLang's.
A request the server aborted (finish reason ``abort``, as an ``abort`` pause for a weight update
ends it) is continued from its tokens so far, by ``generate`` and ``stream`` alike; one aborted
``MAX_IDLE_ABORTS`` times in a row without a new token raises ``SGLangError``.

Lifecycle::

    engine = SGLangEngine(SGLangClientConfig(url="http://127.0.0.1:30000"))
    span = await engine.generate(prompt_ids, SamplingParams(max_new_tokens=64))
    engine.pause(); ...; engine.resume()      # around a weight update, as RolloutEngine asks
    await engine.aclose()
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import TypeVar

import httpx
import msgspec

from loong_core.protocols import RequestRefused, SamplingParams
from loong_core.records import SpanSource, TokenSpan
from loong_core.sglang_api import (
    ContinueGenerationRequest,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    PauseGenerationRequest,
    SGLangSamplingParams,
    WeightVersionResponse,
)

__all__ = ["SGLangClientConfig", "SGLangEngine", "SGLangError"]

_RETRY_STATUS = {502, 503, 504}
_JSON = {"content-type": "application/json"}
_T = TypeVar("_T")


class SGLangError(RuntimeError):
    """The server answered with an error, aborted the request, or stayed unreachable."""


class SGLangClientConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``url``: server base URL. ``timeout_s``: one request (generation can be long).
    ``retries``: extra attempts after a connection failure, ``backoff_s`` doubling from there.
    ``pause_mode``: SGLang's ``/pause_generation`` mode; ``in_place`` keeps requests alive across a
    weight update, as Loong's partial rollouts expect. ``max_connections``: HTTP pool size.
    """

    url: str = "http://127.0.0.1:30000"
    api_key: str | None = None
    timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    retries: int = 5
    backoff_s: float = 0.2
    pause_mode: str = "in_place"
    initial_version: int = 0
    max_connections: int = 512

    def __post_init__(self) -> None:
        if self.pause_mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause_mode must be abort, retract or in_place, got {self.pause_mode!r}")
        if self.retries < 0 or self.timeout_s <= 0:
            raise ValueError("retries must be >= 0 and timeout_s > 0")


class SGLangEngine:
    """``loong_core.protocols.RolloutEngine`` backed by an SGLang server."""

    def __init__(self, config: SGLangClientConfig) -> None:
        self.config = config
        self._base = config.url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._timeout = httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s)
        limits = httpx.Limits(max_connections=config.max_connections)
        self._client = httpx.AsyncClient(headers=self._headers, timeout=self._timeout, limits=limits)
        self._version = config.initial_version
        self._adapter: tuple[str, int] | None = None  # (lora_path, version) requests sample with

    @property
    def weight_version(self) -> int:
        """The version of the latest response (or of the last ``refresh_version``)."""
        return self._version

    def use_adapter(self, name: str | None, version: int = 0) -> None:
        """Requests from now on sample with LoRA adapter ``name`` (loaded on the server; None: the
        base model, as the server's weights version it) and their tokens carry ``version``.
        Requests already sent keep the adapter they named."""
        self._adapter = None if name is None else (name, version)
        if name is not None:
            self._version = max(self._version, version)

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> TokenSpan:
        """One completion. An answer the server aborted (an ``abort`` pause for a weight update)
        is continued, as a partial rollout: the request goes again with the tokens so far
        appended to the prompt (the server holds it until generation continues), and the span
        joins the parts (per-token ``versions`` when they differ)."""
        parts: list[TokenSpan] = []
        done, idle = 0, 0
        while True:
            adapter = self._adapter
            body = _generate_body(
                [*input_ids, *(t for p in parts for t in p.token_ids)],
                msgspec.structs.replace(sampling, max_new_tokens=sampling.max_new_tokens - done),
                adapter=adapter,
            )
            out = await self._request("POST", "/generate", GenerateResponse, body)
            aborted = out.meta_info.finish_reason is not None and out.meta_info.finish_reason.type == "abort"
            parts.append(self._span(out, 0, aborted_ok=aborted, adapter=adapter))
            done += len(parts[-1].token_ids)
            if not aborted or done >= sampling.max_new_tokens:
                return _joined(parts)
            idle = 0 if parts[-1].token_ids else idle + 1
            _check_aborts(idle, out)

    async def stream(self, input_ids: list[int], sampling: SamplingParams) -> AsyncIterator[TokenSpan]:
        """``generate`` as SGLang streams it (``stream: true``): each event is the answer so far,
        and this yields the tokens new in it. An answer the server aborted (an ``abort`` pause for
        a weight update) is continued as ``generate`` continues it, so the tokens after the cut
        carry the new version. Closing early closes the connection, which SGLang takes as an
        abort of the request. Not retried on failure: tokens may already have been used."""
        sent: list[int] = []
        idle = 0  # aborted answers in a row that brought no token
        while True:
            rest = msgspec.structs.replace(sampling, max_new_tokens=sampling.max_new_tokens - len(sent))
            cut: list[GenerateResponse] = []
            before = len(sent)
            async for span in self._stream_once([*input_ids, *sent], rest, cut):
                sent += span.token_ids
                yield span
            if not cut or len(sent) >= sampling.max_new_tokens:
                return
            idle = 0 if len(sent) > before else idle + 1
            _check_aborts(idle, cut[0])

    async def _stream_once(
        self, input_ids: list[int], sampling: SamplingParams, cut: list[bool]
    ) -> AsyncIterator[TokenSpan]:
        """One streamed request; appends the answer to ``cut`` when the server aborted it."""
        adapter = self._adapter
        body = msgspec.json.encode(_generate_body(input_ids, sampling, stream=True, adapter=adapter))
        where, got = f"{self._base}/generate", 0
        try:
            async with self._client.stream("POST", where, content=body, headers=_JSON) as response:
                if response.status_code != 200:
                    await response.aread()
                    _checked(response, where)
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        return
                    try:
                        out = msgspec.json.decode(line[6:], type=GenerateResponse)
                    except msgspec.DecodeError as e:
                        raise SGLangError(f"{where}: the stream says {line[6:300]!r} ({e})") from None
                    done = out.meta_info.completion_tokens
                    if len(out.output_ids) < got or (done and done != len(out.output_ids)):
                        raise SGLangError(
                            f"{where}: a streamed event holds {len(out.output_ids)} tokens of an answer "
                            f"{done} long, after {got} (is the server started with "
                            "--incremental-streaming-output? Loong reads SGLang's default, cumulative events)"
                        )
                    finish = out.meta_info.finish_reason
                    if finish is not None and finish.type == "abort":
                        cut.append(out)
                    span = self._span(out, got, aborted_ok=bool(cut), adapter=adapter)
                    got = len(out.output_ids)
                    if span.token_ids:
                        yield span
            raise SGLangError(f"{where}: the stream ended without data: [DONE] after {got} tokens")
        except httpx.TransportError as e:
            raise SGLangError(f"{where}: the stream broke after {got} tokens: {e}") from e

    def _span(
        self,
        out: GenerateResponse,
        start: int,
        aborted_ok: bool = False,
        adapter: tuple[str, int] | None = None,
    ) -> TokenSpan:
        """Tokens ``start:`` of an answer, checked (not aborted unless ``aborted_ok``; logprobs
        match the ids), stamped with the version of the ``adapter`` the request named, or else
        the server's."""
        meta, ids = out.meta_info, out.output_ids
        if not aborted_ok and meta.finish_reason is not None and meta.finish_reason.type == "abort":
            reason = msgspec.to_builtins(meta.finish_reason)
            raise SGLangError(f"request aborted by the server: {reason}")
        triples = meta.output_token_logprobs or []
        if len(triples) != len(ids) or [t[1] for t in triples[start:]] != ids[start:]:  # the new part
            raise SGLangError("output_token_logprobs do not match output_ids")
        version = adapter[1] if adapter else self._parse_version(meta.weight_version)
        self._version = max(self._version, version)
        return TokenSpan(
            token_ids=ids[start:],
            logprobs=[float(t[0]) for t in triples[start:]],
            source=SpanSource.MODEL,
            weight_version=version,
        )

    async def prompt_logprobs(self, input_ids: list[int], start: int = 0) -> list[float]:
        """Prefill only: ``log p(x_i | x_<i)`` for ``i`` in ``start+1 .. n-1`` at T = 1 ([n - start - 1])."""
        body = GenerateRequest(
            input_ids=list(input_ids),
            sampling_params=SGLangSamplingParams(max_new_tokens=0),
            return_logprob=True,
            logprob_start_len=start,
            lora_path=self._adapter[0] if self._adapter else None,
        )
        out = await self._request("POST", "/generate", GenerateResponse, body)
        return [float(t[0]) for t in (out.meta_info.input_token_logprobs or [])[1:]]

    def pause(self) -> None:
        """Ask the server to hold generation (``/pause_generation``); blocks until it answered."""
        self._sync("/pause_generation", PauseGenerationRequest(mode=self.config.pause_mode))

    def resume(self) -> None:
        self._sync("/continue_generation", ContinueGenerationRequest())

    async def refresh_version(self) -> int:
        """Read ``/get_weight_version`` and return it as an integer."""
        out = await self._request("GET", "/get_weight_version", WeightVersionResponse)
        self._version = self._parse_version(out.weight_version)
        return self._version

    async def health(self) -> bool:
        try:
            response = await self._client.get(f"{self._base}/health")
        except httpx.TransportError:
            return False
        return response.status_code == 200

    async def aclose(self) -> None:
        await self._client.aclose()

    def _parse_version(self, label: str | None) -> int:
        if label in (None, "default"):
            return self.config.initial_version
        try:
            return int(label)
        except ValueError:
            raise SGLangError(f"weight_version {label!r} is not an integer") from None

    async def _request(
        self, method: str, path: str, kind: type[_T], body: msgspec.Struct | None = None
    ) -> _T:
        """Send ``body``, retrying transient failures, and decode a 200 answer as ``kind``."""
        where, content = f"{self._base}{path}", None if body is None else msgspec.json.encode(body)
        delay = self.config.backoff_s
        for attempt in range(self.config.retries + 1):
            last = attempt == self.config.retries
            try:
                response = await self._client.request(method, where, content=content, headers=_JSON)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as e:
                if last:
                    raise SGLangError(f"{where}: unreachable after {attempt + 1} tries: {e}") from e
            else:
                if response.status_code not in _RETRY_STATUS or last:
                    return _decode(_checked(response, where), kind, where)
            await asyncio.sleep(delay * (1 + random.random() * 0.1))
            delay *= 2
        raise AssertionError("unreachable")

    def _sync(self, path: str, body: msgspec.Struct) -> None:
        """POST ``body`` and wait for a 200; the answer's body is not needed."""
        where = f"{self._base}{path}"
        with httpx.Client(headers=self._headers, timeout=self._timeout) as client:
            _checked(client.post(where, content=msgspec.json.encode(body), headers=_JSON), where)


def _joined(parts: list[TokenSpan]) -> TokenSpan:
    """Consecutive model spans as one (``versions`` per token when they differ)."""
    if len(parts) == 1:
        return parts[0]
    versions = [v for p in parts for v in p.token_versions()]
    return TokenSpan(
        token_ids=[t for p in parts for t in p.token_ids],
        logprobs=[lp for p in parts for lp in p.logprobs],
        source=SpanSource.MODEL,
        weight_version=max(p.weight_version for p in parts),
        versions=versions if len(set(versions)) > 1 else [],
    )


def _generate_body(
    input_ids: list[int],
    sampling: SamplingParams,
    stream: bool = False,
    adapter: tuple[str, int] | None = None,
) -> GenerateRequest:
    options = SGLangSamplingParams(
        max_new_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        stop_token_ids=list(sampling.stop_token_ids),
    )
    return GenerateRequest(
        input_ids=list(input_ids),
        sampling_params=options,
        return_logprob=True,
        stream=stream or None,
        lora_path=adapter[0] if adapter else None,
    )


def _checked(response: httpx.Response, where: str) -> httpx.Response:
    """``response`` if it is a 200; else the server's message: ``RequestRefused`` for a 400 (the
    server refused this request: a prompt past its context, ...), ``SGLangError`` otherwise."""
    if response.status_code == 200:
        return response
    try:
        message = msgspec.json.decode(response.content, type=ErrorResponse).message
    except msgspec.DecodeError:  # not SGLang's error body (SGLang's /generate nests it)
        message = response.text
    if response.status_code == 400:
        raise RequestRefused(f"{where}: HTTP 400: {message}")
    raise SGLangError(f"{where}: HTTP {response.status_code}: {message}")


def _decode(response: httpx.Response, kind: type[_T], where: str) -> _T:
    try:
        return msgspec.json.decode(response.content, type=kind)
    except msgspec.DecodeError as e:
        raise SGLangError(f"{where}: not an SGLang answer: {e}") from None


MAX_IDLE_ABORTS = 8
"""Aborted answers in a row without a new token before a request fails: a weight update's pause
aborts a request once (the resent one waits for the pause to end); a server that keeps aborting
it (an error, a deadline) would otherwise be asked forever."""


def _check_aborts(idle: int, out: GenerateResponse) -> None:
    if idle >= MAX_IDLE_ABORTS:
        reason = msgspec.to_builtins(out.meta_info.finish_reason)
        raise SGLangError(f"request aborted {idle} times in a row without a new token: {reason}")
