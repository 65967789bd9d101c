"""``ProxyServer``: lifecycle, sessions, request plumbing, and the one call path that both
completion endpoints share (:meth:`ProxyServer._serve`; what differs per endpoint is in
:mod:`loong_agentflow.proxy.endpoints`).

One completion call, chat or text::

    session (401) -> body (413, 499) -> decode (400) -> unsupported (400)
    -> endpoint.prompt (400) -> sampler.params (400)              errors so far: a JSON error body
    -> n engine calls, live (500 when the engine fails)           -> session.record(endpoint.record)
    -> endpoint.body, or endpoint.chunks as a live event stream   (after the headers an error is
                                                                   the stream's last event)
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from loong_agentflow.proxy.asgi import Emit, Gone, LiveStream, unless_gone
from loong_agentflow.proxy.choices import Choice, LiveText, finish_choice
from loong_agentflow.proxy.config import ProxyConfig
from loong_agentflow.proxy.endpoints import ChatEndpoint, CompletionEndpoint, Endpoint
from loong_agentflow.proxy.render import ChatRenderer
from loong_agentflow.proxy.responses import ChatChunks, CompletionChunks
from loong_agentflow.proxy.sampling import Sampler
from loong_agentflow.proxy.session import CallRecord, ProxySession
from loong_agentflow.proxy.wire import ApiError, decode_request, error_body, error_event, now, unsupported
from loong_core.protocols import RequestRefused, RolloutEngine, SamplingParams
from loong_core.records import TokenSpan

if TYPE_CHECKING:
    from loong_agentflow.agent import EpisodeSpec

__all__ = ["ProxyServer"]

log = logging.getLogger("loong.proxy")

_JSON = "application/json"
_json = msgspec.json.Encoder()

Shown = Callable[[int, str, TokenSpan], Awaitable[None]]
"""``shown(i, text, tokens)``: choice ``i``'s text as it becomes showable, with the tokens it carries."""


class RewardRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    reward: float
    turn_rewards: list[float] = []
    done: bool = False


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


def _error(e: ApiError) -> Response:
    return Response(error_body(e), e.status, media_type=_JSON)


@dataclass(slots=True)
class _Call:
    """One completion call, ready to run: the request, its endpoint, the record's request part
    (``head``: prompt ids and what chains later calls to it) and the sampling parameters."""

    req: Any
    endpoint: Endpoint[Any]
    head: CallRecord
    sampling: SamplingParams
    created: int

    @property
    def prompt(self) -> list[int]:
        return self.head.prompt_ids


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
        self._sampler = Sampler(self.config, renderer)
        self._chat_endpoint = ChatEndpoint(renderer, self.config)
        self._completion_endpoint = CompletionEndpoint(renderer, self.config)
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

    # -- the completion call path, shared by both endpoints ----------------------------------

    async def _serve(self, request: Request, endpoint: Endpoint[Any]) -> Any:
        """Check the request and answer it: one JSON body, or with ``stream`` a live event stream.
        An :class:`ApiError` before generation is answered as a JSON error body."""
        try:
            session = self._session(request)
            req = decode_request(await self._body(request), endpoint.request)
            unsupported(req, self.config.max_n)
            head = endpoint.prompt(req, session)
            max_tokens = endpoint.max_tokens(req)
            sampling = self._sampler.params(req, session, max_tokens, len(head.prompt_ids), endpoint.param)
        except ApiError as e:
            return _error(e)
        call = _Call(req, endpoint, head, sampling, now())
        if not req.stream:
            return await self._respond(request, session, call)
        chunks = endpoint.chunks(req, call.created)
        return LiveStream(functools.partial(self._stream, session, call, chunks))

    async def _respond(self, request: Request, session: ProxySession, call: _Call) -> Any:
        """``call``'s answer as one JSON body; a client that hangs up first cancels the call."""
        try:
            out = await unless_gone(request, self._run(session, call))
        except ApiError as e:
            return _error(e)
        if out is None:
            return Gone()
        body = call.endpoint.body(call.req, call.prompt, out[0], call.created)
        return Response(_json.encode(body), media_type=_JSON)

    async def _stream(
        self, session: ProxySession, call: _Call, chunks: ChatChunks | CompletionChunks, emit: Emit
    ) -> None:
        """``call``'s answer as server-sent events, emitted as the engine samples. The stream opens
        with the first text to show (or the answer): an error before it is the response itself
        (a 400 when the engine refuses the request), an error after it the stream's last event."""
        opened, opening = False, asyncio.Lock()  # choices show text concurrently

        async def open_stream() -> None:
            nonlocal opened
            async with opening:
                if not opened:
                    for event in chunks.start(call.prompt, call.req.n):
                        await emit(event)
                    opened = True

        async def shown(i: int, text: str, tokens: TokenSpan) -> None:
            await open_stream()
            await emit(chunks.content(i, text, tokens))

        try:
            choices, lives = await self._run(session, call, shown)
        except ApiError as e:
            if not opened:
                raise
            await emit(error_event(e))
            return
        await open_stream()
        for i, (choice, live) in enumerate(zip(choices, lives, strict=True)):
            for event in chunks.finish(i, choice, live):
                await emit(event)
        for event in chunks.end(len(call.prompt), choices):
            await emit(event)

    async def _run(
        self, session: ProxySession, call: _Call, shown: Shown | None = None
    ) -> tuple[list[Choice], list[LiveText]]:
        """Generate ``call``'s choices and record them (before the answer's last event)."""
        choices, lives = await self._live(session, call, shown)
        if session.closed:
            raise ApiError(401, "The session finished while this call was generated.", code="invalid_api_key")
        session.record(call.endpoint.record(call.head, choices))
        return choices, lives

    async def _live(
        self, session: ProxySession, call: _Call, shown: Shown | None
    ) -> tuple[list[Choice], list[LiveText]]:
        """``n`` completions of the prompt, each stopped at its first stop string (the engine call
        ends there), finished as choices; ``shown`` receives their text as it becomes showable.
        The engine refusing the request (:class:`RequestRefused`) is the call's 400, any other
        engine failure its 500 (the other choices are cancelled)."""
        stop_ids = frozenset(call.sampling.stop_token_ids)
        stops, chat = call.req.stop_strings(), call.endpoint.chat
        follow = shown is not None or bool(stops)  # a whole completion needs no token-by-token watch

        async def one(i: int) -> LiveText:
            live = LiveText(self.renderer, stop_ids, stops, chat)
            tokens = _tokens(self.engine, call.prompt, call.sampling, follow)
            async with contextlib.aclosing(tokens) as deltas:
                async for delta in deltas:
                    text = live.push(delta)
                    if text and shown is not None:
                        await shown(i, text, live.take())
                    if live.stopped:
                        break
            return live

        tasks = [asyncio.ensure_future(one(i)) for i in range(call.req.n)]
        self.inflight += 1
        try:
            lives = await asyncio.gather(*tasks)
            choices = [finish_choice(x.span(), self.renderer, stop_ids, stops, chat) for x in lives]
        except RequestRefused as e:  # the client's mistake, as the engine found it
            raise ApiError(
                400, f"The model cannot take this request: {e}", param=call.endpoint.param
            ) from None
        except Exception as e:  # the engine's failure is this call's 500, not the server's end
            session.errors.append(f"{type(e).__name__}: {e}")
            raise ApiError(500, f"The engine failed: {type(e).__name__}: {e}", type="server_error") from None
        finally:
            for t in tasks:
                t.cancel()  # no-op once done
            self.inflight -= 1
        return choices, lives

    # -- endpoints ---------------------------------------------------------------------------

    async def _chat(self, request: Request) -> Any:
        return await self._serve(request, self._chat_endpoint)

    async def _completions(self, request: Request) -> Any:
        return await self._serve(request, self._completion_endpoint)

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
