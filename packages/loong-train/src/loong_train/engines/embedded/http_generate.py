"""SGLang's ``POST /generate``, served by the embedded engine.

``POST /generate {input_ids, sampling_params, return_logprob, logprob_start_len,
top_logprobs_num, rid}``: ``input_ids`` is one prompt or a batch (list of prompts). ``meta_info``:
``id``, ``finish_reason`` (``{"type": "length", "length": n}`` or ``{"type": "stop", "matched":
id}``), ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``weight_version``,
``e2e_latency``, and with ``return_logprob``: ``output_token_logprobs`` and
``input_token_logprobs`` as ``[logprob, token_id, None]`` triples. Input entries cover
``input_ids[start:]`` (``start = logprob_start_len``, ``-1`` means the last prompt token); entry
0 is always ``None`` and entry ``i`` is ``log p(x[start+i] | x[:start+i])`` at T = 1. With
``top_logprobs_num = k`` too, ``input_top_logprobs`` holds, per input entry (``None`` first), the
``k`` most likely ``[logprob, token_id, None]`` at that position (at T = 1), most likely first,
and ``output_top_logprobs`` the same per output token, from the distribution it was sampled from
(``log_softmax(logits / T)``, so the sampled token's entry equals its output logprob).
``max_new_tokens = 0`` is prefill only (how teachers score).
Output logprobs are ``log_softmax(logits / T)`` of the sampled tokens; a matched stop token is in
``output_ids``. ``stream: true`` answers server-sent events, each the answer so far
(``finish_reason`` on the last), then ``data: [DONE]``; a client that hangs up cancels the request.
A server started with ``--incremental-streaming-output`` (SGLang's flag; ``--stream-output`` its
older name) sends each event only its new ``output_ids`` and output logprob entries instead, so
the events' ids joined are the answer (the counts in ``meta_info`` stay cumulative).

``lora_path`` names a loaded LoRA adapter to sample with (one per prompt for a batch), on a
server started with ``--enable-lora`` (:mod:`.http_lora`).

Differences from SGLang: no ``text`` input, ``stream`` for one prompt at a time (cumulative
events, as SGLang streams by default), greedy (``temperature = 0``) and the sampling options
other than ``max_new_tokens``, ``temperature``, ``top_p``, ``stop_token_ids`` are refused (400)
unless left at SGLang's defaults, and so is any other SGLang field this server does not implement.
Requests that arrive during a client's pause wait for ``/continue_generation``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import NamedTuple

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from loong_core.protocols import SamplingParams
from loong_core.sglang_api import FinishReason, GenerateRequest, GenerateResponse, MetaInfo
from loong_train.engines.embedded.engine import RequestAborted
from loong_train.engines.embedded.http_control import SGLangServer
from loong_train.engines.embedded.http_lora import ServedAdapter
from loong_train.engines.embedded.wire import (
    BadRequest,
    decode_body,
    json_response,
    sampling_params,
    token_ids,
)

__all__ = ["GenerateRoutes"]


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


def _request_ids(rid: str | list[str] | None, batch: bool, n: int) -> list[str]:
    """One id per prompt, as SGLang's ``_normalize_rid``: a list as given (one per prompt), a
    batch under one id as ``<rid>_<i>``, a fresh uuid where none is given."""
    if not batch and isinstance(rid, list):
        raise BadRequest("rid", "must be a string for a single prompt")
    if isinstance(rid, list) and len(rid) != n:
        raise BadRequest("rid", f"a list needs one id per prompt: {n} prompts, {len(rid)} ids")
    if isinstance(rid, list):
        return list(rid)
    if batch:
        return [f"{rid}_{i}" if rid else uuid.uuid4().hex for i in range(n)]
    return [rid or uuid.uuid4().hex]


class _Job(NamedTuple):
    """One prompt of a ``/generate`` request, checked: ``start`` is the first position of
    ``input_token_logprobs`` (``logprob_start_len`` resolved), ``top_k`` is ``top_logprobs_num``."""

    prompt: list[int]
    sampling: SamplingParams
    max_new: int
    logprob: bool
    start: int
    rid: str
    top_k: int
    adapter: ServedAdapter | None


class GenerateRoutes:
    """``/generate`` over the engine of ``server``."""

    def __init__(self, server: SGLangServer) -> None:
        self._server, self.engine = server, server.engine

    @property
    def vocab(self) -> int:
        return self.engine.model.config.vocab_size

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
        rids = _request_ids(body.rid, batch, len(prompts))
        adapters = self._adapters(body.lora_path, len(prompts))
        jobs = []
        for i, (prompt, sp) in enumerate(zip(prompts, raws, strict=True)):
            suffix = f"[{i}]" if batch else ""
            sp_field = "sampling_params" + (suffix if isinstance(raw, list) else "")
            jobs.append(self._job(body, prompt, "input_ids" + suffix, sp, sp_field, rids[i], adapters[i]))
        await self._server.wait_resumed()
        if body.stream:
            if batch:
                raise BadRequest("stream", "streams one prompt at a time here (send a batch unstreamed)")
            return StreamingResponse(self._stream(jobs[0]), media_type="text/event-stream")
        results = await asyncio.gather(*(self._one(job) for job in jobs))
        return json_response(results if batch else results[0])

    def _adapters(self, lora_path: str | list[str | None] | None, n: int) -> list[ServedAdapter | None]:
        """The adapter each prompt samples with (``lora_path``; None: the base model), each loaded
        now: the request holds it from here on, an unload notwithstanding."""
        names = lora_path if isinstance(lora_path, list) else [lora_path] * n
        if len(names) != n:
            raise BadRequest(
                "lora_path", f"a list needs one entry per prompt: {n} prompts, {len(names)} entries"
            )
        lora = self._server.lora
        if any(names) and lora is None:
            raise BadRequest("lora_path", "LoRA is not enabled: start the server with --enable-lora")
        return [lora.adapter(name) if name else None for name in names]

    def _serving(self, adapter: ServedAdapter | None) -> contextlib.AbstractAsyncContextManager:
        """The block runs with ``adapter`` merged in (a server without LoRA: as it is)."""
        lora = self._server.lora
        return contextlib.nullcontext() if lora is None else lora.serving(adapter)

    def _job(
        self,
        body: GenerateRequest,
        prompt,
        field: str,
        sp,
        sp_field: str,
        rid: str,
        adapter: ServedAdapter | None,
    ) -> _Job:
        """Check one prompt (``field`` names it) and its sampling parameters (``sp_field``)."""
        prompt = token_ids(prompt, field, self.vocab)
        sampling, max_new = sampling_params(sp, sp_field)
        positions = self.engine.model.config.max_position_embeddings
        if positions and len(prompt) + max_new > positions:  # SGLang's check, SGLang's 400
            raise BadRequest(
                field,
                f"the prompt has {len(prompt)} tokens and max_new_tokens is {max_new}: together more "
                f"than the model's context length of {positions}",
            )
        top_k = body.top_logprobs_num or 0
        start = body.logprob_start_len
        first = len(prompt) - 1 if start in (None, -1) else start
        if not 0 <= first < len(prompt):
            raise BadRequest("logprob_start_len", f"must be -1 or in [0, {len(prompt)})")
        return _Job(prompt, sampling, max_new, bool(body.return_logprob), first, rid, top_k, adapter)

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

    def _answer(self, prompt, rid, out, lps, top, version, logprobs, finish, t0) -> GenerateResponse:
        if "input_token_logprobs" in logprobs:
            logprobs = logprobs | {
                "output_token_logprobs": [(lp, t, None) for lp, t in zip(lps, out, strict=True)]
            }
        if "input_top_logprobs" in logprobs:
            logprobs["output_top_logprobs"] = [[(lp, t, None) for lp, t in step] for step in top]
        meta = MetaInfo(
            id=rid, finish_reason=finish, prompt_tokens=len(prompt), completion_tokens=len(out),
            cached_tokens=0, weight_version=self._server.label_of(version),
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

    async def _one(self, job: _Job) -> GenerateResponse:
        prompt, sampling, max_new, logprob, start, rid, top_k, adapter = job
        t0 = time.perf_counter()
        async with self._serving(adapter):
            logprobs, version = await self._prompt_logprobs(prompt, logprob, start, top_k)
            out: list[int] = []
            lps: list[float] = []
            top: list[list[tuple[float, int]]] = []
            aborted = False
            if max_new > 0:
                k = top_k if logprob else 0
                try:
                    span, top = await self.engine.generate_top(prompt, sampling, k)
                except RequestAborted as e:
                    span, top, aborted = e.span, e.top, True
                out, lps, version = span.token_ids, span.logprobs, span.weight_version
        finish = self._finish(out, sampling, max_new, aborted)
        return self._answer(prompt, rid, out, lps, top, version, logprobs, finish, t0)

    async def _stream(self, job: _Job) -> AsyncIterator[bytes]:
        """SGLang's streamed ``/generate``: one event per batch of new tokens, each carrying the
        whole answer so far (``output_ids`` and logprobs cumulative, SGLang's default without
        ``--incremental-streaming-output``), ``finish_reason`` only on the last; then ``[DONE]``.
        A client that hangs up cancels the request."""
        events = self._events(job)
        async with self._serving(job.adapter), contextlib.aclosing(events):  # a hang-up ends both
            async for event in events:
                yield event

    async def _events(self, job: _Job) -> AsyncIterator[bytes]:
        prompt, sampling, max_new, logprob, start, rid, top_k, _ = job
        t0 = time.perf_counter()
        logprobs, version = await self._prompt_logprobs(prompt, logprob, start, top_k)
        out: list[int] = []
        lps: list[float] = []
        top: list[list[tuple[float, int]]] = []
        aborted = False
        sent = 0  # tokens already sent, when each event carries only its new ones
        if max_new > 0:
            stream = self.engine.stream_top(prompt, sampling, top_k if logprob else 0)
            try:
                async with contextlib.aclosing(stream) as deltas:
                    async for delta, tops in deltas:
                        out, lps, version = out + delta.token_ids, lps + delta.logprobs, delta.weight_version
                        top = top + tops
                        answer = self._answer(prompt, rid, out, lps, top, version, logprobs, None, t0)
                        yield self._event(answer, sent)
                        sent = len(out) if self._server.incremental_streaming else 0
            except RequestAborted as e:
                span, top, aborted = e.span, e.top, True
                out, lps, version = span.token_ids, span.logprobs, span.weight_version
        finish = self._finish(out, sampling, max_new, aborted)
        answer = self._answer(prompt, rid, out, lps, top, version, logprobs, finish, t0)
        yield self._event(answer, sent)
        yield b"data: [DONE]\n\n"

    @staticmethod
    def _event(answer: GenerateResponse, sent: int) -> bytes:
        """One server-sent event: the answer without its first ``sent`` output tokens."""
        if sent:
            meta = answer.meta_info
            cut = {
                name: getattr(meta, name)[sent:]
                for name in ("output_token_logprobs", "output_top_logprobs")
                if getattr(meta, name) is not msgspec.UNSET
            }
            answer = GenerateResponse(
                output_ids=answer.output_ids[sent:], meta_info=msgspec.structs.replace(meta, **cut)
            )
        return b"data: " + msgspec.json.encode(answer) + b"\n\n"
