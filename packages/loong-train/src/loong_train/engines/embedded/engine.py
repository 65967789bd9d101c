"""The embedded rollout engine: continuous batching with a KV cache on a local torch model.

Requests arrive one by one from concurrent episodes (``await engine.generate(...)``) and join the
running batch between decode steps; finished ones leave it at once, so a long-tailed batch does
not hold the engine at low occupancy (``engines/embedded/batching.py`` has the cache layout and the exact
math: each row's logprobs equal its own unpadded computation). Each sampled token's logprob is
``log_softmax(logits / T)`` of the exact distribution sampled from.

Randomness: request number ``n`` (counted from 0 in arrival order) samples from its own
``torch.Generator`` seeded ``request_seed(n)`` unless ``generate(..., seed=s)`` names one, so a
request's tokens do not depend on what else runs beside it: the same seed gives the same tokens
alone, in a batch, or joining mid-way (logprobs agree to float32 rounding: matmul kernels round a
row differently for different row counts).

Scheduling: decode steps run in a worker thread, which hands back to the event loop as soon as a
row finishes, a queued request could join, ``pause()`` was called or a caller gave up on a
request; the loop then yields a few ticks before admitting, so every episode whose request just
finished enqueues its next one first (request numbers, hence seeds, follow a deterministic order
when episodes react within those ticks).

Prefill-only scoring (``score``) runs one full forward and returns ``log_softmax(logits)`` of each
prompt token given its prefix (temperature 1), the way a teacher or SGLang's
``max_new_tokens=0, return_logprob`` request scores a sequence.

Pause and weight updates: ``pause()`` holds everything between decode steps (the step in flight
finishes; running rows keep their place, queued requests wait); ``await wait_idle()`` then returns
with no forward running, so weights can be swapped (``load_weights`` or a copy plus
``set_version``). After ``resume()`` the running rows are re-prefilled under the new weights and
continue; each token is stamped with the version that produced it, and a span that crossed the
update lists per-token ``versions`` (``TokenSpan``) with ``weight_version`` the newest.
``abort_all()`` ends every queued and running request at once: its caller gets
``RequestAborted`` carrying the tokens sampled so far (SGLang's ``abort`` pause); ``retract()``
drops the running rows' KV cache, so they are re-prefilled when generation continues (SGLang's
``retract`` pause).

Products: the engine's linear layers run from weights oneDNN has laid out once
(:mod:`loong_train.models.prepack`), laid out again after each ``set_version``.

``continuous=False`` admits requests only into an empty batch (static batching: a batch runs
until its longest row finishes); it exists as the benchmark's baseline.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator, Sequence

import msgspec
import torch

from loong_core.protocols import RequestRefused, SamplingParams
from loong_core.records import SpanSource, TokenSpan
from loong_train.cores import Lender
from loong_train.engines.embedded.batching import BatchStats, Request, RunningBatch
from loong_train.models.decoder import CausalLM
from loong_train.models.prepack import prepack, release

__all__ = ["EmbeddedEngine", "RequestAborted"]


class RequestAborted(Exception):
    """``abort_all`` ended the request; ``span``: the tokens it had sampled (possibly none);
    ``top``: their top logprobs, when the request asked for them."""

    def __init__(self, span: TokenSpan, top: list[list[tuple[float, int]]] | None = None) -> None:
        super().__init__(f"request aborted after {len(span.token_ids)} tokens")
        self.span, self.top = span, top or []


class EmbeddedEngine:
    """In-process engine implementing ``loong_core.protocols.RolloutEngine``.

    ``stats`` counts sampling steps, tokens (``stats.mean_occupancy``: rows per step) and busy
    seconds.
    Weight updates may land between decode steps of a running call (``mid_call_updates``).
    With :meth:`lend_idle_cores`, its worker's threads are lent to the trainer while it has no
    request to decode and no prompt to score (:mod:`loong_train.cores`).
    """

    mid_call_updates = True
    adapter = None  # adapter-only updates are merged into ``model`` by the rollout worker

    def __init__(
        self,
        model: CausalLM,
        *,
        seed: int = 0,
        max_batch: int = 256,
        pad_id: int = 0,
        continuous: bool = True,
    ) -> None:
        self.model = prepack(model.eval())
        self.seed, self.max_batch, self.pad_id, self.continuous = seed, max_batch, pad_id, continuous
        self.stats = BatchStats()
        self._version = 0
        self._epoch = 0  # bumped whenever the weights may have changed
        self._requests = 0
        self._queue: list[Request] = []
        self._batch = RunningBatch(self.model, pad_id, self.stats)
        self._driver: asyncio.Task | None = None
        self._running = asyncio.Event()
        self._running.set()
        self._busy, self._busy_since = 0, 0.0
        self._lender: Lender | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def running(self) -> int:
        """Live requests in the running batch (an aborted or abandoned row leaves at the next step)."""
        return sum(not r.future.done() for r in self._batch.rows)

    @property
    def queued(self) -> int:
        """Live requests waiting to join the running batch."""
        return sum(not r.future.done() for r in self._queue)

    def request_seed(self, n: int) -> int:
        """The generator seed of request number ``n``: a 32-bit hash of (engine seed, n), since
        torch's CPU generator keeps only the low 32 bits of a seed (engines seeded apart must not
        share streams)."""
        digest = hashlib.blake2b(f"{self.seed}:{n}".encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little")

    def pause(self) -> None:
        """Hold between decode steps (the step in flight finishes) until ``resume``."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def abort_all(self) -> int:
        """End every queued and running request now; each caller gets ``RequestAborted`` with
        the tokens sampled so far (a token sampled by the step in flight is dropped). Returns how
        many were aborted."""
        live = [r for r in [*self._batch.rows, *self._queue] if not r.future.done()]
        for r in live:
            n = len(r.versions)  # appended last of a token's lists
            partial = (
                _delta(r, 0, n)
                if n
                else TokenSpan(token_ids=[], source=SpanSource.MODEL, weight_version=self._version)
            )
            r.future.set_exception(RequestAborted(partial, r.top[:n]))
        return len(live)

    def retract(self) -> None:
        """Drop the running rows' KV cache: before their next token they are re-prefilled, prompt
        plus tokens so far, under the weights current then."""
        self._epoch += 1

    async def wait_idle(self) -> None:
        """Return once no decode step or scoring pass is running (after ``pause()``: stays so).

        Idleness is checked right before returning, so a caller that does not await between
        this and its weight copy cannot overlap a step (even if someone resumed meanwhile).
        """
        while self._busy:
            await self._idle.wait()

    async def _start_work(self) -> None:
        await self._work_opens()
        try:
            while not self._running.is_set():
                await self._running.wait()
        except BaseException:  # cancelled: no _end_work follows
            self._work_closes()
            raise
        # No await between the running check and the busy count: a pause() seen by the
        # caller of wait_idle() can never be followed by a step starting.
        if not self._busy:
            self._busy_since = time.perf_counter()
        self._busy += 1
        self._idle.clear()

    def _end_work(self) -> None:
        self._busy -= 1
        if not self._busy:
            self.stats.busy_s += time.perf_counter() - self._busy_since
            self._idle.set()
        self._work_closes()

    def lend_idle_cores(self, lender: Lender) -> None:
        """Lend through ``lender`` whenever no request is queued or running and nothing is scored:
        a spell of work (from its first request to its last row's end, decode steps or not) takes
        the threads back, waiting off the event loop until the trainer gave them back."""
        self._lender = lender

    async def _work_opens(self) -> None:
        if self._lender is not None and self._lender.begin():
            try:
                await asyncio.to_thread(self._lender.wait_returned)
            except BaseException:  # cancelled: the caller closes nothing
                self._lender.end()
                raise

    def _work_closes(self) -> None:
        if self._lender is not None:
            self._lender.end()

    async def score(self, input_ids: list[int]) -> tuple[list[float], int]:
        """Prefill only: ``log p(x_i | x_<i)`` for i = 1..n-1 ([n - 1]) and the weight version used."""
        await self._start_work()
        try:
            return (await asyncio.to_thread(self.score_batch, [input_ids]))[0], self._version
        finally:
            self._end_work()

    async def score_top(
        self, input_ids: list[int], k: int
    ) -> tuple[list[float], list[list[tuple[float, int]]], int]:
        """Like ``score``, plus the ``k`` most likely tokens ``(logprob, id)`` at each of those
        positions, most likely first."""
        await self._start_work()
        try:
            picked, top = await asyncio.to_thread(self._score_top, input_ids, k)
            return picked, top, self._version
        finally:
            self._end_work()

    @torch.no_grad()
    def _score_top(self, input_ids: list[int], k: int) -> tuple[list[float], list[list[tuple[float, int]]]]:
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.model.lm_head.weight.device)
        logp = torch.log_softmax(self.model(ids).float(), dim=-1)[0, :-1]
        picked = logp.gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()
        values, indices = logp.topk(min(k, logp.shape[-1]), dim=-1)
        top = [list(zip(v, i, strict=True)) for v, i in zip(values.tolist(), indices.tolist(), strict=True)]
        return picked, top

    @torch.no_grad()
    def score_batch(self, prompts: Sequence[list[int]]) -> list[list[float]]:
        """Log-probabilities of every prompt token after the first, one full forward for all.

        Right padding needs no mask: causal attention never lets a real token see a later pad.
        """
        device = self.model.lm_head.weight.device
        ids = torch.full((len(prompts), max(len(x) for x in prompts)), self.pad_id, dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        ids = ids.to(device)
        logp = torch.log_softmax(self.model(ids).float(), dim=-1)[:, :-1]
        picked = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
        return [picked[i, : len(p) - 1].tolist() for i, p in enumerate(prompts)]

    def check(self) -> None:
        """Nothing to check: the engine runs in this process."""

    def close(self) -> None:
        """Nothing to stop."""

    def set_version(self, version: int) -> None:
        """Stamp everything generated from now on with ``version`` (after weights were copied in)."""
        self._version = version
        self._epoch += 1
        release(self.model)  # new weights may sit where the old ones did (a rewritten shared buffer)

    @torch.no_grad()
    def load_weights(self, named: dict[str, torch.Tensor], version: int) -> None:
        """Copy new weights in place and stamp everything generated from now on with ``version``."""
        params = dict(self.model.named_parameters())
        for name, tensor in named.items():
            params[name].copy_(tensor)
        self.set_version(version)

    def _request(
        self, input_ids: list[int], sampling: SamplingParams, seed: int | None, top_k: int = 0
    ) -> Request:
        """A request, after refusing a prompt the model cannot take (:class:`RequestRefused`: it
        fails alone, before it joins a batch) and capping ``max_new_tokens`` at the model's positions."""
        vocab, positions = self.model.config.vocab_size, self.model.config.max_position_embeddings
        if not input_ids:
            raise RequestRefused("the prompt is empty: it needs at least one token id")
        if bad := [t for t in input_ids if not 0 <= t < vocab][:3]:
            raise RequestRefused(f"prompt token ids outside the vocabulary [0, {vocab}): {bad}")
        if positions and len(input_ids) >= positions:
            raise RequestRefused(
                f"the prompt has {len(input_ids)} tokens; the model has {positions} positions"
            )
        if positions and len(input_ids) + sampling.max_new_tokens > positions:  # never past the last position
            sampling = msgspec.structs.replace(sampling, max_new_tokens=positions - len(input_ids))
        seed = self.request_seed(self._requests) if seed is None else seed
        self._requests += 1
        return Request(list(input_ids), sampling, torch.Generator().manual_seed(seed), top_k=top_k)

    def _admit(self, queue: list[Request], running: int) -> tuple[list[Request], list[Request]]:
        """Split ``queue`` into the requests that join now and those that wait."""
        room = 0 if running and not self.continuous else self.max_batch - running
        return queue[:room], queue[room:]

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, seed: int | None = None
    ) -> TokenSpan:
        span, _ = await self.generate_top(input_ids, sampling, 0, seed=seed)
        return span

    async def generate_top(
        self, input_ids: list[int], sampling: SamplingParams, top_k: int, *, seed: int | None = None
    ) -> tuple[TokenSpan, list[list[tuple[float, int]]]]:
        """``generate``, and for each sampled token the ``top_k`` most likely ``(logprob, id)`` of
        the distribution it was drawn from, most likely first (SGLang's ``output_top_logprobs``)."""
        request = self._request(input_ids, sampling, seed, top_k)
        request.future = asyncio.get_running_loop().create_future()
        self._queue.append(request)
        if self._driver is None or self._driver.done():
            self._driver = asyncio.create_task(self._drive())
        return await request.future, request.top

    async def stream(
        self, input_ids: list[int], sampling: SamplingParams, *, seed: int | None = None
    ) -> AsyncIterator[TokenSpan]:
        """``generate``, yielding the completion while it is sampled: model spans of the tokens
        new since the previous one (together: the span ``generate`` returns; same seed, same
        tokens). Closing the iterator early cancels the request: its row leaves the batch
        after the decode step in flight."""
        async with contextlib.aclosing(self.stream_top(input_ids, sampling, 0, seed=seed)) as deltas:
            async for delta, _ in deltas:
                yield delta

    async def stream_top(
        self, input_ids: list[int], sampling: SamplingParams, top_k: int, *, seed: int | None = None
    ) -> AsyncIterator[tuple[TokenSpan, list[list[tuple[float, int]]]]]:
        """``stream``, each delta with its tokens' ``top_k`` most likely (as ``generate_top``)."""
        request = self._request(input_ids, sampling, seed, top_k)
        loop = asyncio.get_running_loop()
        request.future = loop.create_future()
        ready = asyncio.Event()
        request.on_token = lambda: loop.call_soon_threadsafe(ready.set)
        self._queue.append(request)
        if self._driver is None or self._driver.done():
            self._driver = asyncio.create_task(self._drive())
        sent = 0
        try:
            while True:
                finished = request.future.done()
                if finished:
                    request.future.result()  # the engine's failure is the stream's
                n = len(request.versions)  # appended last of a token's lists
                if n > sent:
                    yield _delta(request, sent, n), request.top[sent:n]
                    sent = n
                if finished:
                    return
                waiter = asyncio.ensure_future(ready.wait())
                try:
                    await asyncio.wait((waiter, request.future), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
                ready.clear()
        finally:
            if not request.future.done():
                request.future.cancel()  # seen by the stepping thread: the row leaves

    async def _drive(self) -> None:
        await self._work_opens()  # from the first request to the last row's end, steps or not
        try:
            await self._decode()
        finally:
            self._work_closes()

    async def _decode(self) -> None:
        batch = self._batch
        while self._queue or batch.rows:
            for _ in range(4):  # let every runnable episode enqueue its request first
                await asyncio.sleep(0)
            await self._start_work()
            leaving = [r for r in batch.rows if r.future.done()]  # episodes that timed out
            waiting = [r for r in self._queue if not r.future.done()]
            joining, self._queue = self._admit(waiting, len(batch.rows) - len(leaving))
            try:
                done = await asyncio.to_thread(self._steps, joining, leaving, self._version, self._epoch)
            except Exception as e:
                for r in [*batch.reset(), *joining]:
                    if not r.future.done():
                        r.future.set_exception(e)
                continue
            finally:
                self._end_work()
            for r in done:
                if not r.future.done():
                    r.future.set_result(r.span())

    def _steps(
        self, joining: list[Request], leaving: list[Request], version: int, epoch: int
    ) -> list[Request]:
        """Decode steps, in a worker thread, until a row finishes or the event loop has work for
        the batch: a request that could join, a pause, an abandoned row. (Reading those flags from
        this thread is safe: a stale read only delays the return by one step.)"""
        batch = self._batch
        done = batch.step(joining, leaving, version, epoch)
        while not done and batch.rows and not self._loop_has_work():
            done = batch.step([], [], version, epoch)
        return done

    def _loop_has_work(self) -> bool:
        running = len(self._batch.rows)
        return (
            not self._running.is_set()
            or bool(self._queue and self._admit(self._queue, running)[0])
            or any(r.future.done() for r in self._batch.rows)
        )

    def generate_batch(
        self,
        prompts: Sequence[list[int]],
        samplings: Sequence[SamplingParams],
        seeds: Sequence[int | None] | None = None,
    ) -> list[TokenSpan]:
        """Generate one completion per prompt synchronously, batched as ``generate`` batches
        requests that all arrive at once (not while the async driver is running)."""
        seeds = seeds or [None] * len(prompts)
        requests = [self._request(p, s, x) for p, s, x in zip(prompts, samplings, seeds, strict=True)]
        batch, queue = RunningBatch(self.model, self.pad_id, self.stats), requests
        while queue or batch.rows:
            joining, queue = self._admit(queue, len(batch.rows))
            batch.step(joining, [], self._version, self._epoch)
        return [r.span() for r in requests]


def _delta(request: Request, start: int, end: int) -> TokenSpan:
    """Tokens ``[start, end)`` of ``request`` as a model span (``versions`` when they are mixed)."""
    versions = request.versions[start:end]
    return TokenSpan(
        token_ids=request.token_ids[start:end],
        logprobs=request.logprobs[start:end],
        source=SpanSource.MODEL,
        weight_version=versions[-1],
        versions=versions if len(set(versions)) > 1 else [],
    )
