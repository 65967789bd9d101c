"""The embedded rollout engine: batched KV-cache generation on a local torch model.

Requests arrive one by one from concurrent episodes (``await engine.generate(...)``); a batcher
gathers everything queued in the same event-loop tick and runs it as one left-padded batch with
a preallocated KV cache. Each sampled token's logprob is ``log_softmax(logits / T)`` of the
exact distribution sampled from, and each span carries the weight version that produced it.

Prefill-only scoring (``score``) runs one full forward and returns ``log_softmax(logits)`` of each
prompt token given its prefix (temperature 1), the way a teacher or SGLang's
``max_new_tokens=0, return_logprob`` request scores a sequence.

Quiescence: ``pause()`` stops new batches from starting; ``await wait_idle()`` then returns once
the batch in flight (if any) has finished, so weights can be swapped with no forward running.

Padding: prompts are left-padded; pad positions attend only to themselves (so no row of the
attention is fully masked and no NaN can reach real tokens) and real tokens never attend to
pads; position ids count real tokens only, so a row's math equals its unpadded computation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from loong_core.protocols import SamplingParams
from loong_core.records import SpanSource, TokenSpan
from loong_train.models.qwen3 import KVCache, Qwen3ForCausalLM

__all__ = ["EmbeddedEngine"]


class EmbeddedEngine:
    """In-process engine implementing ``loong_core.protocols.RolloutEngine``."""

    def __init__(
        self, model: Qwen3ForCausalLM, *, seed: int = 0, max_batch: int = 256, pad_id: int = 0
    ) -> None:
        self.model = model.eval()
        self.generator = torch.Generator().manual_seed(seed)
        self.max_batch, self.pad_id = max_batch, pad_id
        self._version = 0
        self._queue: list[tuple[list[int], SamplingParams, asyncio.Future]] = []
        self._drainer: asyncio.Task | None = None
        self._running = asyncio.Event()
        self._running.set()
        self._busy = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def weight_version(self) -> int:
        return self._version

    def pause(self) -> None:
        """Hold new batches (the one in flight finishes) until ``resume``."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    async def wait_idle(self) -> None:
        """Return once no batch or scoring pass is running (after ``pause()``: stays so).

        Idleness is checked right before returning, so a caller that does not await between
        this and its weight copy cannot overlap a batch (even if someone resumed meanwhile).
        """
        while self._busy:
            await self._idle.wait()

    async def _start_work(self) -> None:
        # No await between the running check and the busy count: a pause() seen by the
        # caller of wait_idle() can never be followed by a batch starting.
        while not self._running.is_set():
            await self._running.wait()
        self._busy += 1
        self._idle.clear()

    def _end_work(self) -> None:
        self._busy -= 1
        if not self._busy:
            self._idle.set()

    async def score(self, input_ids: list[int]) -> tuple[list[float], int]:
        """Prefill only: ``log p(x_i | x_<i)`` for i = 1..n-1 ([n - 1]) and the weight version used."""
        await self._start_work()
        try:
            return (await asyncio.to_thread(self.score_batch, [input_ids]))[0], self._version
        finally:
            self._end_work()

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

    def set_version(self, version: int) -> None:
        """Stamp everything generated from now on with ``version`` (after weights were copied in)."""
        self._version = version

    @torch.no_grad()
    def load_weights(self, named: dict[str, torch.Tensor], version: int) -> None:
        """Copy new weights in place and stamp everything generated from now on with ``version``."""
        params = dict(self.model.named_parameters())
        for name, tensor in named.items():
            params[name].copy_(tensor)
        self._version = version

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> TokenSpan:
        future = asyncio.get_running_loop().create_future()
        self._queue.append((input_ids, sampling, future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._queue:
            for _ in range(4):  # let every runnable episode enqueue its request first
                await asyncio.sleep(0)
            await self._start_work()
            batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
            batch = [b for b in batch if not b[2].done()]  # drop requests whose episode timed out
            try:
                if not batch:
                    continue
                spans = await asyncio.to_thread(
                    self.generate_batch, [b[0] for b in batch], [b[1] for b in batch]
                )
            except Exception as e:
                for _, _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            finally:
                self._end_work()
            for (_, _, fut), span in zip(batch, spans, strict=True):
                if not fut.done():
                    fut.set_result(span)

    @torch.no_grad()
    def generate_batch(
        self, prompts: Sequence[list[int]], samplings: Sequence[SamplingParams]
    ) -> list[TokenSpan]:
        """Generate one completion per prompt, all in one batch."""
        device = self.model.lm_head.weight.device
        b, p = len(prompts), max(len(x) for x in prompts)
        max_new = [s.max_new_tokens for s in samplings]
        total = p + max(max_new)
        ids = torch.full((b, p), self.pad_id, dtype=torch.long, device=device)
        valid = torch.zeros(b, total, dtype=torch.bool, device=device)
        for i, prompt in enumerate(prompts):
            ids[i, p - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            valid[i, p - len(prompt) : p] = True
        positions = (valid[:, :p].long().cumsum(-1) - 1).clamp(min=0)
        eye = torch.eye(p, dtype=torch.bool, device=device)
        mask = (torch.tril(torch.ones(p, p, dtype=torch.bool, device=device)) & valid[:, None, :p]) | eye
        cache = KVCache(self.model.config, b, total, self.model.lm_head.weight.dtype, device)
        logits = self.model(ids, positions, mask[:, None], cache, 0)[:, -1]
        temps = torch.tensor([s.temperature for s in samplings], device=device)[:, None]
        top_ps = torch.tensor([s.top_p for s in samplings], device=device)[:, None]
        stops = [set(s.stop_token_ids) for s in samplings]
        out_ids: list[list[int]] = [[] for _ in range(b)]
        out_lps: list[list[float]] = [[] for _ in range(b)]
        done = [False] * b
        pos = positions[:, -1]
        for t in range(max(max_new)):
            tokens, logprobs = self._sample(logits, temps, top_ps)
            for i, (tok, lp) in enumerate(zip(tokens.tolist(), logprobs.tolist(), strict=True)):
                if not done[i]:
                    out_ids[i].append(tok)
                    out_lps[i].append(lp)
                    done[i] = tok in stops[i] or len(out_ids[i]) >= max_new[i]
            if all(done):
                break
            valid[:, p + t] = True
            pos = pos + 1
            logits = self.model(
                tokens[:, None], pos[:, None], valid[:, None, None, : p + t + 1], cache, p + t
            )[:, -1]
        return [
            TokenSpan(token_ids=i, logprobs=lp, source=SpanSource.MODEL, weight_version=self._version)
            for i, lp in zip(out_ids, out_lps, strict=True)
        ]

    def _sample(self, logits: torch.Tensor, temps: torch.Tensor, top_ps: torch.Tensor):
        logp = torch.log_softmax(logits.float() / temps, dim=-1)
        probs = logp.exp()
        if bool((top_ps < 1).any()):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > top_ps
            probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        tokens = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
