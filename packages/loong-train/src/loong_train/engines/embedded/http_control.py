"""The state behind the SGLang-compatible HTTP routes, and SGLang's control endpoints.

``/pause_generation {mode}``, ``/continue_generation``, ``/get_weight_version``,
``/get_model_info``, ``/get_weights_by_name {name, truncate_size}``, ``/flush_cache`` (no prefix
cache here, but it answers as SGLang does: 400 while requests are queued or running, 200
otherwise). ``/health`` and ``/health_generate`` answer 200 (:mod:`.http_app`).

Pause modes, as SGLang's tokenizer manager and scheduler do them: every mode holds requests that
arrive while paused until ``/continue_generation`` and stops decoding between steps. ``abort``
(the default) ends every queued and running request before answering: each answers 200 with
``finish_reason: {"type": "abort"}`` and the tokens sampled so far. ``retract`` takes running
requests out of the batch and drops their KV cache (re-prefilled, under the weights current
then, on continue). ``in_place`` keeps them as they are. ``/flush_cache`` answers 400 while
requests are queued, or running in an ``in_place`` pause (retracted requests do not count while
paused, as in current SGLang); a weight update that flushes the cache in such a state is refused
too (:mod:`.http_weights`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from loong_core.sglang_api import (
    GetWeightsByNameRequest,
    ModelInfoResponse,
    PauseGenerationRequest,
    StatusResponse,
    WeightVersionResponse,
)
from loong_train.engines.embedded.engine import EmbeddedEngine
from loong_train.engines.embedded.wire import BadRequest, decode_body, json_response

if TYPE_CHECKING:
    from loong_train.engines.embedded.http_lora import LoraRoutes

__all__ = ["SGLangServer"]


class SGLangServer:
    """What every route shares: the engine, the served weights' labels and path, the client's pause.

    ``label`` is the newest ``weight_version`` string; ``label_of`` names the version an answer
    was sampled under. ``paused`` and ``pause_mode`` are the client's pause, which a weight
    update leaves in place. Generation (:mod:`.http_generate`) waits in ``wait_resumed``;
    weight updates (:mod:`.http_weights`) relabel through ``relabel`` and ``serve_path``.
    ``incremental_streaming``: streamed answers send each token once (see :mod:`.http_app`)."""

    def __init__(self, engine: EmbeddedEngine, model_path: str = "", incremental_streaming: bool = False):
        self.engine, self.model_path = engine, model_path
        self.incremental_streaming = incremental_streaming
        self.label = str(engine.weight_version)
        self._labels = {engine.weight_version: self.label}
        self.paused = False
        self.pause_mode = "abort"
        self._resumed = asyncio.Event()  # cleared while paused: new requests wait, as SGLang's do
        self._resumed.set()
        self.lora: LoraRoutes | None = None  # LoRA adapters (--enable-lora): :mod:`.http_lora`

    def label_of(self, version: int) -> str:
        """The ``weight_version`` string of engine version ``version`` (the newest if unknown)."""
        return self._labels.get(version, self.label)

    def relabel(self, version: int, label: str) -> None:
        """Weights of engine version ``version``, labelled ``label``, are now served."""
        self._labels[version], self.label = label, label

    def serve_path(self, model_path: str) -> None:
        """The weights served came from ``model_path`` (``/get_model_info`` names it, as SGLang's does)."""
        self.model_path = model_path

    async def wait_resumed(self) -> None:
        """Return once no client pause holds new requests."""
        await self._resumed.wait()

    def busy(self) -> bool:
        """Requests SGLang's scheduler counts against a cache flush: queued ones, and running ones
        unless a ``retract`` pause took them out of the batch (SGLang ignores retracted requests
        while paused; an ``abort`` pause has ended them all)."""
        retracted = self.paused and self.pause_mode == "retract"
        return bool(self.engine.queued or (self.engine.running and not retracted))

    # ---- routes ----
    async def pause(self, request: Request) -> Response:
        """SGLang's three modes. All hold new requests until ``/continue_generation`` and stop
        decoding between steps; ``abort`` (the default) also ends every queued and running
        request now (``finish_reason: abort``, with the tokens sampled so far), ``retract`` takes
        the running ones out of the batch and drops their KV cache (re-prefilled on continue),
        ``in_place`` keeps them, cache and all."""
        mode = (await decode_body(request, PauseGenerationRequest)).mode
        self.paused, self.pause_mode = True, mode
        self._resumed.clear()
        self.engine.pause()
        if mode == "abort":
            self.engine.abort_all()
        elif mode == "retract":
            self.engine.retract()
        return json_response(StatusResponse(message="Generation paused successfully."))

    async def resume(self, request: Request) -> Response:
        self.paused = False
        self._resumed.set()
        self.engine.resume()
        return json_response(StatusResponse(message="Generation continued successfully."))

    async def weight_version(self, request: Request) -> Response:
        return json_response(WeightVersionResponse(weight_version=self.label))

    async def model_info(self, request: Request) -> Response:
        path = self.model_path
        return json_response(
            ModelInfoResponse(model_path=path, tokenizer_path=path, weight_version=self.label)
        )

    async def weights_by_name(self, request: Request) -> Response:
        """SGLang's ``/get_weights_by_name {name, truncate_size}``: the first rows of a parameter."""
        body = await decode_body(request, GetWeightsByNameRequest)
        param = dict(self.engine.model.named_parameters()).get(body.name)
        if param is None:
            raise BadRequest("name", f"no parameter named {body.name!r}")
        return JSONResponse(param.detach()[: body.truncate_size].float().cpu().tolist())

    async def flush_cache(self, request: Request) -> Response:
        """SGLang's ``/flush_cache``, in plain text: 400 while ``busy``, else 200."""
        if self.busy():
            message = (
                "Cache not flushed because there are pending requests. "
                f"#queue-req: {self.engine.queued}, #running-req: {self.engine.running}\n"
            )
            return Response(message, status_code=400)
        return Response("Cache flushed.\n", status_code=200)
