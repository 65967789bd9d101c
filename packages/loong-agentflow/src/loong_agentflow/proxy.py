"""The AgentFlow proxy: an OpenAI-compatible server that records token-exact black-box episodes.

Any program that speaks the OpenAI API (the ``openai`` SDK, LangChain, a shell script with curl)
can be an agent: point ``OPENAI_BASE_URL`` at the proxy and use the session's API key. The proxy
renders the chat template itself, asks a :class:`~loong_core.protocols.RolloutEngine` for token
ids with logprobs and weight versions, and records every call of the session.

Endpoints (all need ``Authorization: Bearer <session key>``; unknown or finished keys get 401):

- ``POST /v1/chat/completions``: ``messages``, ``tools`` (Hermes ``<tool_call>`` format),
  ``stream`` (+ ``stream_options.include_usage``), ``n``, ``temperature``, ``top_p``,
  ``max_tokens`` / ``max_completion_tokens``, ``stop``, ``logprobs``, and vLLM's
  ``return_token_ids`` (the answer carries ``prompt_token_ids`` and ``choices[].token_ids``: the
  ids the trajectory records; streamed, each chunk carries the ids of what it shows).
- ``POST /v1/completions``: ``prompt`` (text or token ids), same sampling fields, ``logprobs`` <= 1,
  ``return_token_ids`` (on each choice, as vLLM answers; not in streamed completions).
- ``GET /v1/models``: the one served model.
- ``POST /v1/sessions/reward``: ``{"reward": float, "turn_rewards": [float], "done": bool}`` sets
  the episode's reward from inside the agent (or from its environment); ``done: true`` also ends
  the session, after which its key answers 401.

Streaming is live: chunks leave as the engine samples (an engine with ``stream``, see
:class:`~loong_core.protocols.RolloutEngine`; one without answers each completion whole), and a
``stop`` string ends the engine call at the token that completes it, streamed or not.

Token exactness: when a chat call's messages extend an earlier call of the session (that call's
messages, then the assistant reply it returned, then new messages, with the same tools), the
prompt is that call's prompt ids + its completion ids + the renderer's continuation for the new
messages only; the model's tokens are never re-tokenized. Text completions chain the same way by
text prefix. Errors are OpenAI-style bodies: malformed JSON or unsupported parameters 400 (naming
the parameter), oversize bodies 413, engine failures 500. A client that disconnects while its
completion is generated cancels the engine call.

Lifecycle::

    proxy = ProxyServer(engine, ChatMLRenderer(codec))
    await proxy.start()                      # binds 127.0.0.1 on a free port by default
    session = proxy.open_session(spec)       # session.api_key, proxy.base_url
    ...                                      # the agent calls the proxy
    proxy.close_session(session)
    rows = session.trajectories(reward, status)
    await proxy.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from loong_agentflow.proxy_chat import (
    ChatChunks,
    Choice,
    CompletionChunks,
    LiveText,
    chat_body,
    completion_body,
    finish_choice,
)
from loong_agentflow.proxy_render import ChatRenderer
from loong_agentflow.proxy_session import CallRecord, ProxySession, normalize_messages
from loong_agentflow.proxy_wire import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    decode_request,
    error_body,
    error_event,
    now,
    unsupported,
)
from loong_core.protocols import RolloutEngine, SamplingParams
from loong_core.records import SpanSource, TokenSpan

if TYPE_CHECKING:
    from loong_agentflow.agent import EpisodeSpec

__all__ = ["ProxyConfig", "ProxyServer"]

log = logging.getLogger("loong.proxy")

T = TypeVar("T")

_JSON = "application/json"
_json = msgspec.json.Encoder()


class ProxyConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the proxy serves.

    ``temperature`` / ``top_p``, when set, override what agents ask for (RL samples at the
    training temperature whatever the agent's code says); otherwise temperature 0 (greedy) is a
    400, because the engine samples. ``max_session_model_tokens`` (0 = unlimited) caps the model
    tokens of one episode; a call past it is a 400 ``context_length_exceeded`` and the episode is
    marked truncated.

    Limits of the model (0: unknown, not checked): ``context_length``, its positions: a prompt
    that fills them, or a ``max_tokens`` that would run past them, is a 400
    ``context_length_exceeded`` naming the numbers; without ``max_tokens`` the default is clamped
    to what is left, as OpenAI does. ``vocab_size``: token-id prompts must lie in ``[0,
    vocab_size)``. ``max_tokens_limit`` bounds any ``max_tokens`` whatever the context.
    """

    host: str = "127.0.0.1"
    port: int = 0
    model: str = "loong-policy"
    max_body_bytes: int = 8 << 20
    default_max_tokens: int = 1024
    max_n: int = 8
    max_session_model_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    context_length: int = 0
    vocab_size: int = 0
    max_tokens_limit: int = 1 << 20


class RewardRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    reward: float
    turn_rewards: list[float] = []
    done: bool = False


Emit = Callable[[bytes], Awaitable[None]]


class _LiveStream:
    """An ASGI response streaming the server-sent events ``produce(emit)`` emits as it emits them.

    A client that hangs up cancels ``produce`` (and with it the engine calls it awaits)."""

    def __init__(self, produce: Callable[[Emit], Awaitable[None]]) -> None:
        self.produce = produce

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        lock = asyncio.Lock()

        async def emit(event: bytes) -> None:
            async with lock:  # choices stream concurrently; one body message at a time
                await send({"type": "http.response.body", "body": event, "more_body": True})

        work = asyncio.ensure_future(self.produce(emit))
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            done, _ = await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if work not in done:
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            log.debug("a client disconnected while its completion streamed: the engine call was cancelled")
            return
        work.result()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _tokens(
    engine: RolloutEngine, prompt: list[int], sampling: SamplingParams, live: bool
) -> AsyncIterator[TokenSpan]:
    """The engine's tokens as they are sampled (``engine.stream``, when ``live``), or its whole
    completion at once (not live, or an engine that cannot stream)."""
    stream = getattr(engine, "stream", None) if live else None
    if stream is None:
        yield await engine.generate(prompt, sampling)
        return
    async with contextlib.aclosing(stream(prompt, sampling)) as deltas:
        async for delta in deltas:
            yield delta


class _Gone:
    """The response to a client that already disconnected: nothing to send."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        return None


async def _disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _tokenized(render: Any, *args: Any, param: str = "messages") -> list[int]:
    """``render(*args)``; text the tokenizer or chat template cannot take is the request's 400."""
    try:
        return render(*args)
    except (KeyError, ValueError, TypeError, UnicodeError) as e:
        raise ApiError(
            400, f"Invalid '{param}': it cannot be tokenized ({type(e).__name__}: {e}).", param=param
        ) from None


def _error(e: ApiError) -> Response:
    return Response(error_body(e), e.status, media_type=_JSON)


@dataclass(slots=True)
class _Call:
    """One completions call, ready to run: what to generate, and how to record and answer it."""

    prompt: list[int]
    sampling: SamplingParams
    stops: list[str]
    n: int
    chat: bool
    record: Callable[[list[Choice]], CallRecord]
    body: Callable[[list[Choice]], dict[str, Any]]


def _usage(req: ChatRequest | CompletionRequest) -> bool:
    """Whether a streamed answer ends with a usage chunk (``stream_options.include_usage``)."""
    return bool(req.stream_options and req.stream_options.include_usage)


async def _unless_gone(request: Request, call: Awaitable[T]) -> T | None:
    """``await call``, or None when the client disconnected first (the call is cancelled)."""
    work = asyncio.ensure_future(call)
    watch = asyncio.ensure_future(_disconnected(request.receive))
    try:
        done, _ = await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        work.cancel()  # no-op once done
        watch.cancel()
    if work not in done:
        await asyncio.gather(work, return_exceptions=True)
        return None
    return work.result()


class ProxyServer:
    """OpenAI-compatible front of a RolloutEngine; one :class:`ProxySession` per episode."""

    def __init__(
        self, engine: RolloutEngine, renderer: ChatRenderer, config: ProxyConfig | None = None
    ) -> None:
        self.engine, self.renderer = engine, renderer
        self.config = config or ProxyConfig()
        self.sessions: dict[str, ProxySession] = {}
        self.inflight = 0
        self.port = self.config.port
        self._stop_cache: dict[str, list[int]] = {}
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None
        routes = [
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/v1/sessions/reward", self._reward, methods=["POST"]),
        ]
        self.app = Starlette(routes=routes, exception_handlers={HTTPException: self._http_error})

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.port}/v1"

    async def start(self) -> None:
        """Serve on ``config.host:config.port`` (port 0 picks a free one) in the running loop."""
        import uvicorn

        # proto=TCP explicitly: asyncio only sets TCP_NODELAY on sockets that say so (else Nagle + delayed ACK add 40 ms)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.config.host, self.config.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="off",
            backlog=4096,
            timeout_keep_alive=60,
            timeout_graceful_shutdown=5,
        )
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="loong-proxy-server")
        while not self._server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
            self._server = self._task = None

    async def __aenter__(self) -> ProxyServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def open_session(self, spec: EpisodeSpec) -> ProxySession:
        key = "sk-loong-" + secrets.token_urlsafe(24)
        session = ProxySession(key, spec, self.config.max_session_model_tokens)
        self.sessions[key] = session
        return session

    def close_session(self, session: ProxySession) -> None:
        """End a session: its key answers 401 from now on and nothing more is recorded."""
        session.closed = True
        self.sessions.pop(session.api_key, None)
        session.done.set()

    # -- request plumbing --------------------------------------------------------------------

    def _session(self, request: Request) -> ProxySession:
        auth = request.headers.get("authorization", "")
        session = self.sessions.get(auth[7:]) if auth[:7].lower() == "bearer " else None
        if session is None:
            raise ApiError(
                401,
                "Incorrect API key provided: the key is unknown or its session has finished.",
                code="invalid_api_key",
            )
        return session

    async def _body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise ApiError(413, f"Request body exceeds {limit} bytes.", code="request_too_large")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"Request body exceeds {limit} bytes.", code="request_too_large")
                chunks.append(chunk)
        except ClientDisconnect:  # it hung up before sending its body: nobody reads the answer
            log.debug(
                "%s %s: the client disconnected while sending the request", request.method, request.url.path
            )
            raise ApiError(499, "The client closed the request.", code="client_disconnected") from None
        return b"".join(chunks)

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        return _error(ApiError(status, f"{request.method} {request.url.path}: {exc}", code=str(status)))

    def _sampling(
        self,
        req: ChatRequest | CompletionRequest,
        session: ProxySession,
        max_tokens: int | None,
        prompt_len: int,
    ) -> SamplingParams:
        cfg = self.config
        temperature = cfg.temperature or (1.0 if req.temperature is None else req.temperature)
        if temperature == 0:
            raise ApiError(
                400,
                "Unsupported value for parameter 'temperature': 0 (greedy); the engine samples.",
                param="temperature",
            )
        if max_tokens is not None and max_tokens > cfg.max_tokens_limit:
            raise ApiError(
                400,
                f"max_tokens is {max_tokens}; this server allows at most {cfg.max_tokens_limit}.",
                param="max_tokens",
            )
        max_new = max_tokens or cfg.default_max_tokens
        if context := cfg.context_length:
            if prompt_len >= context or (max_tokens is not None and prompt_len + max_tokens > context):
                raise ApiError(
                    400,
                    f"This model's maximum context length is {context} tokens. However, you requested "
                    f"{prompt_len + (max_tokens or 0)} tokens ({prompt_len} in the prompt, "
                    f"{max_tokens or 0} in the completion).",
                    param="messages" if isinstance(req, ChatRequest) else "prompt",
                    code="context_length_exceeded",
                )
            max_new = min(max_new, context - prompt_len)  # the default, clamped to what is left
        if session.max_model_tokens:
            left = session.max_model_tokens - session.model_tokens
            if left <= 0:
                session.budget_exhausted = True
                raise ApiError(
                    400, "The episode's model-token budget is used up.", code="context_length_exceeded"
                )
            max_new = min(max_new, left)
        stop_ids = list(self.renderer.stop_token_ids)
        for s in self._stops(req):
            ids = self._stop_cache.get(s)
            if ids is None:
                ids = (
                    self._stop_cache.setdefault(s, _tokenized(self.renderer.encode, s, param="stop"))
                    if len(self._stop_cache) < 4096
                    else []
                )
            if len(ids) == 1:
                stop_ids.append(ids[0])
        return SamplingParams(
            temperature=temperature,
            top_p=cfg.top_p or req.top_p or 1.0,
            max_new_tokens=max_new,
            stop_token_ids=stop_ids,
        )

    def _token_prompt(self, ids: list[int]) -> list[int]:
        vocab = self.config.vocab_size
        if bad := [t for t in ids if t < 0 or (vocab and t >= vocab)][:3]:
            raise ApiError(
                400,
                f"Invalid 'prompt': token ids {bad} are outside the vocabulary [0, {vocab or 'inf'}).",
                param="prompt",
            )
        return ids

    @staticmethod
    def _stops(req: ChatRequest | CompletionRequest) -> list[str]:
        return [req.stop] if isinstance(req.stop, str) else list(req.stop or ())

    async def _live(
        self,
        session: ProxySession,
        prompt: list[int],
        sampling: SamplingParams,
        stops: Sequence[str],
        n: int,
        chat: bool,
        shown: Callable[[int, str, TokenSpan], Awaitable[None]] | None = None,
    ) -> tuple[list[Choice], list[LiveText]]:
        """``n`` completions of ``prompt``, each stopped at its first stop string (the engine
        call ends there), finished as choices. ``shown(i, text, tokens)`` receives choice ``i``'s
        text as it becomes showable, with the tokens it carries. An engine failure is the call's
        500 (the other choices are cancelled)."""
        stop_ids = frozenset(sampling.stop_token_ids)
        follow = shown is not None or bool(stops)  # a whole completion needs no token-by-token watch

        async def one(i: int) -> LiveText:
            live = LiveText(self.renderer, stop_ids, stops, chat)
            async with contextlib.aclosing(_tokens(self.engine, prompt, sampling, follow)) as deltas:
                async for delta in deltas:
                    text = live.push(delta)
                    if text and shown is not None:
                        await shown(i, text, live.take())
                    if live.stopped:
                        break
            return live

        tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
        self.inflight += 1
        try:
            lives = await asyncio.gather(*tasks)
            choices = [finish_choice(x.span(), self.renderer, stop_ids, stops, chat) for x in lives]
        except Exception as e:  # the engine's failure is this call's 500, not the server's end
            session.errors.append(f"{type(e).__name__}: {e}")
            raise ApiError(500, f"The engine failed: {type(e).__name__}: {e}", type="server_error") from None
        finally:
            for t in tasks:
                t.cancel()  # no-op once done
            self.inflight -= 1
        return choices, lives

    async def _answer(
        self,
        request: Request,
        session: ProxySession,
        call: _Call,
        chunks: ChatChunks | CompletionChunks | None,
    ) -> Any:
        """Run ``call`` and answer it: one JSON body, or with ``chunks`` a live event stream. The
        call is recorded before the answer's last event; a client that hangs up first cancels it."""

        async def run(shown: Callable[[int, str, TokenSpan], Awaitable[None]] | None = None):
            choices, lives = await self._live(
                session, call.prompt, call.sampling, call.stops, call.n, call.chat, shown
            )
            if session.closed:
                raise ApiError(
                    401, "The session finished while this call was generated.", code="invalid_api_key"
                )
            session.record(call.record(choices))
            return choices, lives

        if chunks is None:
            try:
                out = await _unless_gone(request, run())
            except ApiError as e:
                return _error(e)
            if out is None:
                return _Gone()
            return Response(_json.encode(call.body(out[0])), media_type=_JSON)

        async def produce(emit: Emit) -> None:
            for event in chunks.start(call.prompt, call.n):
                await emit(event)

            async def shown(i: int, text: str, tokens: TokenSpan) -> None:
                await emit(chunks.content(i, text, tokens))

            try:
                choices, lives = await run(shown)
            except ApiError as e:  # headers are out: the error is the stream's last event
                await emit(error_event(e))
                return
            for i, (choice, live) in enumerate(zip(choices, lives, strict=True)):
                for event in chunks.finish(i, choice, live):
                    await emit(event)
            for event in chunks.end(len(call.prompt), choices):
                await emit(event)

        return _LiveStream(produce)

    # -- endpoints ---------------------------------------------------------------------------

    async def _chat(self, request: Request) -> Any:
        try:
            session = self._session(request)
            req = decode_request(await self._body(request), ChatRequest)
            unsupported(req, self.config.max_n)
            messages, keys = normalize_messages(req.messages)
            tools_key = _json.encode(req.tools) if req.tools else b""
            parent = session.chat_parent(keys, tools_key)
            if parent is None:
                prompt, observation = _tokenized(self.renderer.render, messages, req.tools), SpanSource.ENV
            else:
                prev, k = parent
                new = messages[len(prev.messages or ()) + 1 :]
                prompt = prev.prompt_ids + prev.spans[k].token_ids
                if not prev.closed[k]:
                    prompt = prompt + self.renderer.turn_end_ids
                prompt = prompt + _tokenized(self.renderer.continuation, new, req.tools)
                tool_only = all(m["role"] == "tool" for m in new)
                observation = SpanSource.TOOL if tool_only else SpanSource.ENV
            sampling = self._sampling(req, session, req.max_completion_tokens or req.max_tokens, len(prompt))
        except ApiError as e:
            return _error(e)
        created, model, logprobs, ids = now(), self.config.model, bool(req.logprobs), req.return_token_ids

        def record(choices: list[Choice]) -> CallRecord:
            return CallRecord(
                prompt_ids=prompt,
                spans=[c.span for c in choices],
                closed=[c.closed for c in choices],
                finish=[c.finish for c in choices],
                observation=observation,
                messages=keys,
                tools_key=tools_key,
                replies=[c.reply for c in choices if c.reply is not None],
            )

        def body(choices: list[Choice]) -> dict[str, Any]:
            return chat_body(model, prompt, choices, self.renderer, logprobs, created, ids)

        call = _Call(prompt, sampling, self._stops(req), req.n, True, record, body)
        chunks = ChatChunks(model, created, self.renderer, logprobs, _usage(req), ids) if req.stream else None
        return await self._answer(request, session, call, chunks)

    async def _completions(self, request: Request) -> Any:
        try:
            session = self._session(request)
            req = decode_request(await self._body(request), CompletionRequest)
            unsupported(req, self.config.max_n)
            prompt_text: str | None = None
            if isinstance(req.prompt, str):
                prompt_text = req.prompt
                parent = session.text_parent(prompt_text)
                if parent is None:
                    prompt = _tokenized(self.renderer.encode, prompt_text, param="prompt")
                else:
                    prompt = parent[0] + (
                        _tokenized(self.renderer.encode, parent[1], param="prompt") if parent[1] else []
                    )
            else:
                prompt = self._token_prompt(req.prompt)
            if not prompt:
                raise ApiError(400, "Invalid 'prompt': it is empty.", param="prompt")
            sampling = self._sampling(req, session, req.max_tokens or 16, len(prompt))
        except ApiError as e:
            return _error(e)
        created, model, logprobs, ids = now(), self.config.model, bool(req.logprobs), req.return_token_ids

        def record(choices: list[Choice]) -> CallRecord:
            return CallRecord(
                prompt_ids=prompt,
                spans=[c.span for c in choices],
                closed=[c.closed for c in choices],
                finish=[c.finish for c in choices],
                prompt_text=prompt_text,
                texts=[(c.text, self.renderer.decode(c.span.token_ids)) for c in choices],
            )

        def body(choices: list[Choice]) -> dict[str, Any]:
            return completion_body(model, prompt, choices, self.renderer, logprobs, created, ids)

        call = _Call(prompt, sampling, self._stops(req), req.n, False, record, body)
        chunks = CompletionChunks(model, created, _usage(req)) if req.stream else None
        return await self._answer(request, session, call, chunks)

    async def _models(self, request: Request) -> Response:
        try:
            self._session(request)
        except ApiError as e:
            return _error(e)
        model = {"id": self.config.model, "object": "model", "created": 0, "owned_by": "loong"}
        return Response(_json.encode({"object": "list", "data": [model]}), media_type=_JSON)

    async def _reward(self, request: Request) -> Response:
        try:
            session = self._session(request)
            req = decode_request(await self._body(request), RewardRequest)
        except ApiError as e:
            return _error(e)
        session.reward, session.turn_rewards = req.reward, list(req.turn_rewards)
        if req.done:
            self.close_session(session)
        return Response(_json.encode({"ok": True, "reward": req.reward, "done": req.done}), media_type=_JSON)
