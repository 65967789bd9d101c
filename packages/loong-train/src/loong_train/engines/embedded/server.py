"""SGLang's native HTTP API, served by the embedded engine, so SGLang clients run on CPU.

The subset Loong uses, with SGLang's field names and shapes (``entrypoints/http_server.py`` and
``managers/io_struct.py`` in sgl-project/sglang), as the Structs of ``loong_core.sglang_api``
(bodies are decoded with msgspec); requests carry token ids, responses carry ``output_ids`` and
``meta_info`` as SGLang does when started with ``--skip-tokenizer-init``:

- ``POST /generate {input_ids, sampling_params, return_logprob, logprob_start_len,
  top_logprobs_num, rid}``:
  ``input_ids`` is one prompt or a batch (list of prompts). ``meta_info``: ``id``,
  ``finish_reason`` (``{"type": "length", "length": n}`` or ``{"type": "stop", "matched": id}``),
  ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``weight_version``,
  ``e2e_latency``, and with ``return_logprob``: ``output_token_logprobs`` and
  ``input_token_logprobs`` as ``[logprob, token_id, None]`` triples. Input entries cover
  ``input_ids[start:]`` (``start = logprob_start_len``, ``-1`` means the last prompt token);
  entry 0 is always ``None`` and entry ``i`` is ``log p(x[start+i] | x[:start+i])`` at T = 1.
  With ``top_logprobs_num = k`` too, ``input_top_logprobs`` holds, per input entry (``None``
  first), the ``k`` most likely ``[logprob, token_id, None]`` at that position, most likely first
  (prefill requests only: there are no ``output_top_logprobs``, so a ``top_logprobs_num`` with
  ``max_new_tokens > 0`` is a 400). ``max_new_tokens = 0`` is prefill only (how teachers score). Output logprobs are
  ``log_softmax(logits / T)`` of the sampled tokens; a matched stop token is in ``output_ids``.
  ``stream: true`` answers server-sent events, each the answer so far (``finish_reason`` on
  the last), then ``data: [DONE]``; a client that hangs up cancels the request.
- ``/pause_generation {mode}``, ``/continue_generation``, ``/get_weight_version``,
  ``/get_model_info``, ``/get_weights_by_name {name, truncate_size}``, ``/health``,
  ``/health_generate``, ``/flush_cache`` (no prefix cache here, but it answers as SGLang does:
  400 while requests are queued or running, 200 otherwise).
- Weight updates, each applied between decode steps (the engine is paused, the step in flight
  finishes, parameters are copied, the engine resumes unless a client paused it; running
  requests continue under the new weights, and ``meta_info.weight_version`` names the newest):
  ``/update_weights_from_disk {model_path, weight_version}`` (Hugging Face safetensors dir);
  ``/init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name,
  backend}``, ``/update_weights_from_distributed {names, dtypes, shapes, group_name,
  weight_version, load_format}`` (``load_format`` ``"flattened_bucket"``: one broadcast per call,
  else one per tensor), ``/destroy_weights_update_group {group_name}``; the group is the one
  ``loong_transfermesh.sglang`` joins (gloo on CPU, nccl on GPU).
- ``/update_weights_from_tensor {serialized_named_tensors, weight_version}``: SGLang sends
  ``MultiprocessingSerializer`` pickles whose tensors are CUDA IPC handles, meaningful only to a
  colocated GPU process, and unpickling them runs arbitrary code. This server instead takes, in
  the same field, base64 of ``torch.save([(name, tensor), ...])`` (tensors by value), loaded with
  ``torch.load(weights_only=True)``; SGLang's own payloads (bare pickles) are refused with a 400,
  never unpickled.

Differences from SGLang: no ``text`` input, ``stream`` for one prompt at a time (cumulative
events, as SGLang streams by default), greedy (``temperature = 0``) and the
sampling options other than ``max_new_tokens``, ``temperature``, ``top_p``, ``stop_token_ids`` are
refused (400) unless left at SGLang's defaults.

Pause modes, as SGLang's tokenizer manager and scheduler do them: every mode holds requests that
arrive while paused until ``/continue_generation`` and stops decoding between steps. ``abort``
(the default) ends every queued and running request before answering: each answers 200 with
``finish_reason: {"type": "abort"}`` and the tokens sampled so far. ``retract`` takes running
requests out of the batch and drops their KV cache (re-prefilled, under the weights current
then, on continue). ``in_place`` keeps them as they are. ``/flush_cache`` answers 400 while
requests are queued, or running in an ``in_place`` pause (retracted requests do not count while
paused, as in current SGLang). A weight update with ``flush_cache`` (default true, as in SGLang)
in such a state answers 400 before applying anything: SGLang's scheduler asserts on that failed
flush and dies, so a client must send ``flush_cache: false`` there (and flush later). A weight
update's ``abort_all_requests`` ends every queued and running request first, as ``abort`` does.
``weight_version`` is a string as in SGLang; when it reads as an integer it also becomes the
engine's version stamp.

Errors: a bad field answers 400 with SGLang's error body (``object``, ``message``, ``type``,
``code``) plus ``param`` naming the field and ``success: false``. With an API key, every path but
``/health*`` needs ``Authorization: Bearer <key>`` (401 otherwise). Binds 127.0.0.1 by default.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import datetime
import hmac
import io
import pickle
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from loong_core.protocols import SamplingParams
from loong_core.sglang_api import (
    DestroyWeightsUpdateGroupRequest,
    FinishReason,
    GenerateRequest,
    GenerateResponse,
    GetWeightsByNameRequest,
    InitWeightsUpdateGroupRequest,
    MetaInfo,
    ModelInfoResponse,
    PauseGenerationRequest,
    StatusResponse,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightsResponse,
    WeightVersionResponse,
)
from loong_train.engines.embedded.engine import EmbeddedEngine, RequestAborted
from loong_train.engines.embedded.wire import (
    BadRequest,
    bad_request,
    decode_body,
    dtype_named,
    json_response,
    sampling_params,
    token_ids,
)
from loong_transfermesh.sglang import bucket_dtype, join_weight_update_group, unflatten_bucket

__all__ = ["BadRequest", "SGLangServer", "build_app", "main", "serve"]


def _refuse_unknown(raw: bytes, kind: type) -> None:
    """A 400 naming the first field of SGLang's that this server does not implement and the
    request set (``token_ids_logprob``, ``return_text_in_logprobs``, ``custom_logit_processor``,
    ``lora_path``, ...): never ignored in silence. Left at an empty value, such a field is fine."""
    try:
        fields = msgspec.json.decode(raw or b"{}")
    except msgspec.DecodeError:
        return  # decode_body already answered that
    if not isinstance(fields, dict):
        return
    for key, value in fields.items():
        if key not in kind.__struct_fields__ and value not in (None, False, [], {}, ""):
            raise BadRequest(key, "is not supported by the embedded server (SGLang's default only)")


class SGLangServer:
    """State behind the routes: the engine, version labels, weight-update groups."""

    def __init__(self, engine: EmbeddedEngine, model_path: str = "", group_timeout_s: float = 600.0):
        self.engine, self.model_path, self.group_timeout_s = engine, model_path, group_timeout_s
        self.label = str(engine.weight_version)
        self.labels = {engine.weight_version: self.label}
        self.paused = False
        self.pause_mode = "abort"
        self._resumed = asyncio.Event()  # cleared while paused: new requests wait, as SGLang's do
        self._resumed.set()
        self.groups: dict[str, dist.ProcessGroup] = {}
        self._update_lock = asyncio.Lock()

    @property
    def vocab(self) -> int:
        return self.engine.model.config.vocab_size

    @property
    def device(self) -> torch.device:
        return self.engine.model.lm_head.weight.device

    # ---- generation ----
    async def generate(self, request: Request) -> Response:
        body = await decode_body(request, GenerateRequest)
        _refuse_unknown(await request.body(), GenerateRequest)
        if body.text is not None:
            raise BadRequest("text", "this server takes input_ids only (it has no tokenizer)")
        ids = body.input_ids
        batch = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        raw = body.sampling_params
        raws = raw if isinstance(raw, list) else [raw] * len(prompts)
        if len(raws) != len(prompts):
            raise BadRequest("sampling_params", "a list must have one entry per prompt")
        if not batch and isinstance(body.rid, list):
            raise BadRequest("rid", "must be a string for a single prompt")
        if isinstance(body.rid, list) and len(body.rid) != len(prompts):  # SGLang's _normalize_rid
            raise BadRequest(
                "rid", f"a list needs one id per prompt: {len(prompts)} prompts, {len(body.rid)} ids"
            )
        if isinstance(body.rid, list):
            rids = list(body.rid)
        elif batch:  # a batch under one id: <rid>_<i>, as SGLang names them
            rids = [f"{body.rid}_{i}" if body.rid else uuid.uuid4().hex for i in range(len(prompts))]
        else:
            rids = [body.rid or uuid.uuid4().hex]
        logprob, start = bool(body.return_logprob), body.logprob_start_len
        top_k = body.top_logprobs_num or 0
        jobs = []
        for i, (prompt, sp) in enumerate(zip(prompts, raws, strict=True)):
            suffix = f"[{i}]" if batch else ""
            prompt = token_ids(prompt, "input_ids" + suffix, self.vocab)
            sampling, max_new = sampling_params(
                sp, "sampling_params" + (suffix if isinstance(raw, list) else "")
            )
            positions = self.engine.model.config.max_position_embeddings
            if positions and len(prompt) + max_new > positions:  # SGLang's check, SGLang's 400
                raise BadRequest(
                    "input_ids" + suffix,
                    f"the prompt has {len(prompt)} tokens and max_new_tokens is {max_new}: together more "
                    f"than the model's context length of {positions}",
                )
            if top_k and max_new > 0:
                raise BadRequest(
                    "top_logprobs_num",
                    "gives input_top_logprobs only here (prefill, max_new_tokens = 0): output_top_logprobs "
                    "are not implemented",
                )
            first = len(prompt) - 1 if start in (None, -1) else start
            if not 0 <= first < len(prompt):
                raise BadRequest("logprob_start_len", f"must be -1 or in [0, {len(prompt)})")
            jobs.append((prompt, sampling, max_new, logprob, first, rids[i], top_k))
        await self._resumed.wait()
        if body.stream:
            if batch:
                raise BadRequest("stream", "streams one prompt at a time here (send a batch unstreamed)")
            return StreamingResponse(self._stream(*jobs[0]), media_type="text/event-stream")
        results = await asyncio.gather(*(self._one(*job) for job in jobs))
        return json_response(results if batch else results[0])

    async def _prompt_logprobs(self, prompt, logprob: bool, start: int, top_k: int) -> tuple[dict, int]:
        """The ``input_*`` logprob fields asked for, and the weight version that scored them."""
        logprobs: dict = {}
        version = self.engine.weight_version
        if logprob:
            scores: list[float] = []
            if start < len(prompt) - 1 and top_k:
                scores, top, version = await self.engine.score_top(prompt, top_k)
                logprobs["input_top_logprobs"] = [None] + [
                    [(lp, t, None) for lp, t in top[j - 1]] for j in range(start + 1, len(prompt))
                ]
            elif start < len(prompt) - 1:
                scores, version = await self.engine.score(prompt)
            if top_k and "input_top_logprobs" not in logprobs:  # only the first entry: SGLang's [None]
                logprobs["input_top_logprobs"] = [None]
            logprobs["input_token_logprobs"] = [(None, prompt[start], None)] + [
                (scores[j - 1], prompt[j], None) for j in range(start + 1, len(prompt))
            ]
        return logprobs, version

    def _answer(self, prompt, rid, out, lps, version, logprobs, finish, t0) -> GenerateResponse:
        if "input_token_logprobs" in logprobs:
            logprobs = logprobs | {
                "output_token_logprobs": [(lp, t, None) for lp, t in zip(lps, out, strict=True)]
            }
        meta = MetaInfo(
            id=rid, finish_reason=finish, prompt_tokens=len(prompt), completion_tokens=len(out),
            cached_tokens=0, weight_version=self.labels.get(version, self.label),
            e2e_latency=time.perf_counter() - t0, **logprobs,
        )  # fmt: skip
        return GenerateResponse(output_ids=list(out), meta_info=meta)

    @staticmethod
    def _finish(out: list[int], sampling: SamplingParams, max_new: int, aborted: bool) -> FinishReason:
        if aborted:
            return FinishReason(type="abort", message="Aborted by pause_generation (mode abort).")
        if out and out[-1] in sampling.stop_token_ids:
            return FinishReason(type="stop", matched=out[-1])
        return FinishReason(type="length", length=max_new)

    async def _one(
        self, prompt, sampling: SamplingParams, max_new: int, logprob: bool, start: int, rid, top_k: int
    ) -> GenerateResponse:
        t0 = time.perf_counter()
        logprobs, version = await self._prompt_logprobs(prompt, logprob, start, top_k)
        out: list[int] = []
        lps: list[float] = []
        aborted = False
        if max_new > 0:
            try:
                span = await self.engine.generate(prompt, sampling)
            except RequestAborted as e:
                span, aborted = e.span, True
            out, lps, version = span.token_ids, span.logprobs, span.weight_version
        finish = self._finish(out, sampling, max_new, aborted)
        return self._answer(prompt, rid, out, lps, version, logprobs, finish, t0)

    async def _stream(
        self, prompt, sampling: SamplingParams, max_new: int, logprob: bool, start: int, rid, top_k: int
    ) -> AsyncIterator[bytes]:
        """SGLang's streamed ``/generate``: one event per batch of new tokens, each carrying the
        whole answer so far (``output_ids`` and logprobs cumulative, SGLang's default without
        ``--incremental-streaming-output``), ``finish_reason`` only on the last; then ``[DONE]``.
        A client that hangs up cancels the request."""
        t0 = time.perf_counter()
        logprobs, version = await self._prompt_logprobs(prompt, logprob, start, top_k)
        out: list[int] = []
        lps: list[float] = []
        aborted = False
        if max_new > 0:
            try:
                async with contextlib.aclosing(self.engine.stream(prompt, sampling)) as deltas:
                    async for delta in deltas:
                        out, lps, version = out + delta.token_ids, lps + delta.logprobs, delta.weight_version
                        answer = self._answer(prompt, rid, out, lps, version, logprobs, None, t0)
                        yield b"data: " + msgspec.json.encode(answer) + b"\n\n"
            except RequestAborted as e:
                out, lps, version, aborted = e.span.token_ids, e.span.logprobs, e.span.weight_version, True
        finish = self._finish(out, sampling, max_new, aborted)
        answer = self._answer(prompt, rid, out, lps, version, logprobs, finish, t0)
        yield b"data: " + msgspec.json.encode(answer) + b"\n\n"
        yield b"data: [DONE]\n\n"

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

    # ---- weight updates ----
    def busy(self) -> bool:
        """Requests SGLang's scheduler counts against a cache flush: queued ones, and running ones
        unless a ``retract`` pause took them out of the batch (SGLang ignores retracted requests
        while paused; an ``abort`` pause has ended them all)."""
        retracted = self.paused and self.pause_mode == "retract"
        return bool(self.engine.queued or (self.engine.running and not retracted))

    async def swap(self, named: dict[str, torch.Tensor], update) -> None:
        """Check every tensor, then copy all of them between decode steps and relabel the version
        (``update``: the request, for ``weight_version``, ``flush_cache``, ``abort_all_requests``).

        ``abort_all_requests`` ends every queued and running request first, as SGLang does.
        ``flush_cache`` while a pause holds requests that block a flush (``busy``) is refused:
        SGLang applies the weights, fails the flush and its scheduler dies on an assert."""
        if update.abort_all_requests:
            self.engine.abort_all()
        if update.flush_cache and self.paused and self.busy():
            raise BadRequest(
                "flush_cache",
                f"{self.engine.running + self.engine.queued} requests are held by the "
                f"{self.pause_mode!r} pause, so the cache cannot be flushed (SGLang's scheduler "
                "asserts and dies here); send flush_cache: false and flush later",
            )
        params = dict(self.engine.model.named_parameters())
        if self.engine.model.config.tie_word_embeddings:
            named.pop("lm_head.weight", None)  # tied to embed_tokens, as SGLang skips it
        for name, t in named.items():
            if name not in params:
                raise BadRequest("names", f"tensor {name!r} is not a parameter of the served model")
            if t.shape != params[name].shape:
                raise BadRequest(
                    "shapes",
                    f"tensor {name!r} has shape {list(t.shape)}, model has {list(params[name].shape)}",
                )
        async with self._update_lock:
            label = self.label if update.weight_version is None else update.weight_version
            version = int(label) if label.lstrip("-").isdigit() else self.engine.weight_version + 1
            self.engine.pause()
            try:
                await self.engine.wait_idle()
                # No await between the idle check and the copy: no batch can start in between.
                self.engine.load_weights(named, version)
                self.labels[version], self.label = label, label
            finally:
                if not self.paused:
                    self.engine.resume()

    async def from_disk(self, request: Request) -> Response:
        body = await decode_body(request, UpdateWeightsFromDiskRequest)
        path = Path(body.model_path)
        if body.load_format not in (None, "auto", "safetensors"):
            raise BadRequest("load_format", "only safetensors checkpoints are supported")
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise BadRequest("model_path", f"no *.safetensors files in {str(path)!r}")
        from safetensors.torch import load_file

        named: dict[str, torch.Tensor] = {}
        for f in files:
            named.update(await asyncio.to_thread(load_file, str(f)))
        await self.swap(named, body)
        self.model_path = body.model_path  # /get_model_info names the weights served, as SGLang's does
        message = "Succeeded to update model weights."
        return json_response(UpdateWeightsResponse(success=True, message=message, num_paused_requests=0))

    async def init_group(self, request: Request) -> Response:
        body = await decode_body(request, InitWeightsUpdateGroupRequest)
        address, port, offset = body.master_address, body.master_port, body.rank_offset
        world, name, backend = body.world_size, body.group_name, body.backend
        if name in self.groups:
            raise BadRequest("group_name", f"group {name!r} already exists")
        if not 0 < offset < world:
            raise BadRequest("rank_offset", f"must be in [1, world_size) = [1, {world})")
        if backend not in ("gloo", "nccl"):
            raise BadRequest("backend", "must be gloo or nccl")
        timeout = datetime.timedelta(seconds=self.group_timeout_s)
        try:
            group = await asyncio.to_thread(
                join_weight_update_group, address, port, offset, world, name, backend, timeout
            )
        except Exception as e:  # rendezvous failures are the caller's to fix; keep serving
            return bad_request("master_address", f"could not join group {name!r}: {e}")
        self.groups[name] = group
        return json_response(
            UpdateWeightsResponse(success=True, message="Succeeded to initialize custom process group.")
        )

    async def from_distributed(self, request: Request) -> Response:
        body = await decode_body(request, UpdateWeightsFromDistributedRequest)
        names, shapes, name = body.names, body.shapes, body.group_name
        group = self.groups.get(name)
        if group is None:
            raise BadRequest(
                "group_name", f"no weight update group named {name!r}; call /init_weights_update_group"
            )
        if not (len(names) == len(body.dtypes) == len(shapes)) or not names:
            raise BadRequest("names", "names, dtypes and shapes must be non-empty lists of one length")
        dtypes = [dtype_named(d) for d in body.dtypes]
        if body.load_format not in (None, "direct", "flattened_bucket"):
            raise BadRequest("load_format", "must be null or 'flattened_bucket'")
        receive = _receive_flat if body.load_format == "flattened_bucket" else _receive_each
        named = await asyncio.to_thread(receive, group, names, dtypes, shapes, self.device)
        await self.swap(named, body)
        return json_response(
            UpdateWeightsResponse(success=True, message="Succeeded to update parameter online.")
        )

    async def destroy_group(self, request: Request) -> Response:
        name = (await decode_body(request, DestroyWeightsUpdateGroupRequest)).group_name
        group = self.groups.pop(name, None)
        if group is None:
            raise BadRequest("group_name", f"no weight update group named {name!r}")
        dist.destroy_process_group(group)
        return json_response(
            UpdateWeightsResponse(success=True, message="Succeeded to destroy custom process group.")
        )

    async def from_tensor(self, request: Request) -> Response:
        body = await decode_body(request, UpdateWeightsFromTensorRequest)
        payloads = body.serialized_named_tensors
        expected = "entry 0 must be base64 of torch.save([(name, tensor), ...])"
        try:
            raw = base64.b64decode(payloads[0], validate=True)
            if not raw.startswith(_ZIP_MAGIC):  # torch.save writes a zip archive; a pickle is not one
                raise BadRequest(
                    "serialized_named_tensors",
                    f"{expected}; it is a bare pickle, as SGLang's MultiprocessingSerializer sends "
                    "(tensors as CUDA IPC or shared-memory handles, meaningful only to a colocated "
                    "process), which the embedded server does not unpickle",
                )
            loaded = torch.load(io.BytesIO(raw), weights_only=True, map_location=self.device)
            named = dict(loaded)
        except (
            IndexError, TypeError, ValueError, binascii.Error, RuntimeError, pickle.UnpicklingError
        ) as e:  # fmt: skip
            raise BadRequest("serialized_named_tensors", f"{expected}: {e}") from None
        await self.swap(named, body)
        return json_response(UpdateWeightsResponse(success=True, message="Success"))


_ZIP_MAGIC = b"PK\x03\x04"


def _receive_flat(group, names, dtypes, shapes, device) -> dict[str, torch.Tensor]:
    total = sum(torch.Size(s).numel() for s in shapes)
    flat = torch.empty(total, dtype=bucket_dtype(dtypes), device=device)
    dist.broadcast(flat, src=0, group=group)
    return unflatten_bucket(flat, names, dtypes, shapes)


def _receive_each(group, names, dtypes, shapes, device) -> dict[str, torch.Tensor]:
    named = {n: torch.empty(s, dtype=d, device=device) for n, d, s in zip(names, dtypes, shapes, strict=True)}
    for handle in [dist.broadcast(t, src=0, group=group, async_op=True) for t in named.values()]:
        handle.wait()
    return named


class _ApiKey:
    """ASGI middleware: ``Authorization: Bearer <key>`` on every path but ``/health*``."""

    def __init__(self, app, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and not scope["path"].startswith("/health"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(
    engine: EmbeddedEngine,
    *,
    model_path: str = "",
    api_key: str | None = None,
    group_timeout_s: float = 600.0,
):
    """The ASGI app serving ``engine`` (wrapped in API-key checking when ``api_key`` is set)."""
    s = SGLangServer(engine, model_path, group_timeout_s)

    async def ok(request: Request) -> Response:
        return Response(status_code=200)

    async def flush(request: Request) -> Response:
        if s.busy():
            message = (
                "Cache not flushed because there are pending requests. "
                f"#queue-req: {s.engine.queued}, #running-req: {s.engine.running}\n"
            )
            return Response(message, status_code=400)
        return Response("Cache flushed.\n", status_code=200)

    async def on_bad_request(request: Request, exc: BadRequest) -> Response:
        return bad_request(exc.param, str(exc).removeprefix(f"{exc.param}: "))

    routes = [
        Route("/generate", s.generate, methods=["POST", "PUT"]),
        Route("/pause_generation", s.pause, methods=["POST"]),
        Route("/continue_generation", s.resume, methods=["POST"]),
        Route("/get_weight_version", s.weight_version, methods=["GET"]),
        Route("/get_model_info", s.model_info, methods=["GET"]),
        Route("/health", ok, methods=["GET"]),
        Route("/health_generate", ok, methods=["GET"]),
        Route("/flush_cache", flush, methods=["GET", "POST"]),
        Route("/get_weights_by_name", s.weights_by_name, methods=["GET", "POST"]),
        Route("/update_weights_from_disk", s.from_disk, methods=["POST"]),
        Route("/init_weights_update_group", s.init_group, methods=["POST"]),
        Route("/update_weights_from_distributed", s.from_distributed, methods=["POST"]),
        Route("/destroy_weights_update_group", s.destroy_group, methods=["POST"]),
        Route("/update_weights_from_tensor", s.from_tensor, methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={BadRequest: on_bad_request})
    app.state.sglang = s
    return _ApiKey(app, api_key) if api_key else app


def serve(
    engine: EmbeddedEngine,
    host: str = "127.0.0.1",
    port: int = 30000,
    api_key: str | None = None,
    model_path: str = "",
) -> None:
    """Serve ``engine`` until interrupted."""
    import uvicorn

    uvicorn.run(
        build_app(engine, model_path=model_path, api_key=api_key), host=host, port=port, log_level="warning"
    )


def main(argv: list[str] | None = None) -> int:
    """``loong-train serve-sglang MODEL_DIR [--host] [--port] [--api-key] [--seed]``.

    ``--model-path MODEL_DIR`` works too (SGLang's spelling), so a supervisor launches this server
    and ``python -m sglang.launch_server`` with the same standard flags."""
    parser = argparse.ArgumentParser(prog="loong-train serve-sglang", description=__doc__.splitlines()[0])
    parser.add_argument(
        "model_dir", type=Path, nargs="?", help="Hugging Face directory (config.json + *.safetensors)"
    )
    parser.add_argument("--model-path", type=Path, help="the same, as SGLang's launcher spells it")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--api-key", default=None, help="require Authorization: Bearer <key>")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="run a checkpoint's own modeling code (auto_map)"
    )
    args = parser.parse_args(argv)
    if (args.model_dir is None) == (args.model_path is None):
        parser.error("give the model directory once: MODEL_DIR or --model-path MODEL_DIR")
    args.model_dir = args.model_dir or args.model_path
    from loong_train.models.auto import load_causal_lm

    torch.set_num_threads(args.threads)
    engine = EmbeddedEngine(load_causal_lm(args.model_dir, args.trust_remote_code), seed=args.seed)
    print(f"serve-sglang: {args.model_dir} on http://{args.host}:{args.port}", flush=True)
    serve(engine, args.host, args.port, args.api_key, str(args.model_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
