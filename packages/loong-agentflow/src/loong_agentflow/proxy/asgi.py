"""ASGI plumbing of the proxy: a live server-sent-event response, and answers that stop when
the client hangs up (the engine calls they await are cancelled)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request

from loong_agentflow.proxy.wire import ApiError, error_body

__all__ = ["Emit", "Gone", "LiveStream", "unless_gone"]

log = logging.getLogger("loong.proxy")

T = TypeVar("T")

Emit = Callable[[bytes], Awaitable[None]]


class LiveStream:
    """An ASGI response streaming the server-sent events ``produce(emit)`` emits as it emits them.

    The headers go out with the first event, so an :class:`ApiError` that ``produce`` raises
    before it emits anything (the engine refused the request) is answered as a plain error
    response with its own status. A client that hangs up cancels ``produce`` (and with it the
    engine calls it awaits)."""

    def __init__(self, produce: Callable[[Emit], Awaitable[None]]) -> None:
        self.produce = produce

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        lock, started = asyncio.Lock(), False

        async def emit(event: bytes) -> None:
            nonlocal started
            async with lock:  # choices stream concurrently; one body message at a time
                if not started:
                    started = True
                    await send({"type": "http.response.start", "status": 200, "headers": headers})
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
        try:
            work.result()
        except ApiError as e:
            if started:
                raise
            json = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": e.status, "headers": json})
            await send({"type": "http.response.body", "body": error_body(e), "more_body": False})
            return
        if not started:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class Gone:
    """The response to a client that already disconnected: nothing to send."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        return None


async def _disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: Request, call: Awaitable[T]) -> T | None:
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
