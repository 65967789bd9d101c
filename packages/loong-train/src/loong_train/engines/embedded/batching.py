"""Continuous batching for the embedded engine: rows join and leave the running batch between
decode steps (iteration-level scheduling, as Orca introduced it), against one KV cache.

Cache layout (per layer ``[rows, kv_heads, width, head_dim]``): every row writes its next token at
the same column ``end``, so one forward call decodes all rows, yet each row's math equals its own
unpadded computation:

- Row ``i``'s context fills columns ``[first[i], end)``; every other column of the row is masked
  out. Its next token sits at position ``end - first[i]`` (the length of its context) and attends
  to columns ``[first[i], end]``.
- Join: the joining rows are left-padded to their longest context ``P`` and prefilled into their
  own rows at columns ``[end - P, end)`` (the cache shifts right first when ``end < P``). A pad
  attends only to itself (no attention row is empty, so no NaN), real tokens never see pads, and
  position ids count real tokens only. Rows joining with the same context (a GRPO group's samples
  of one prompt) are prefilled once and copy that row's cache columns; only the last position's
  logits are computed. A prefix all joining contexts share (at least ``SHARED_PREFIX_MIN``
  tokens: a chat template's system turn, an evaluation's instructions) is computed once, as one
  row: its keys and values are copied into the first columns of every joining row, the rest of
  each context is prefilled after them, and the prefix is then written again where each row's
  context starts (right after its padding), so a context is one run of columns again.
- Leave: a finished (or abandoned) row's slot is filled by moving the live columns of a row from
  the end into it, so rows ``[0, n)`` are exactly the running ones and a step costs ``n`` rows,
  not the batch's peak.
- Columns left of ``min(first)`` are skipped by viewing the cache from there; when ``end`` hits
  the width, the cache is shifted left by ``min(first)`` and grown when that frees too little.

Sampling: each request owns a ``torch.Generator``; a token is drawn by inverse CDF from one
uniform ``u`` of that generator: the first token whose cumulative probability exceeds
``u * total``. A row's tokens therefore depend only on its own logits and generator, never on
which other rows share its steps. Its logprob is ``log_softmax(logits / T)`` of the sampled token
(top-p zeroes the tail before the draw but does not renormalise the reported logprob); a request
with ``top_k`` also keeps the ``top_k`` largest entries of that distribution at every step.

Weight versions: a step samples with the version it is given and stamps it on each token. When
the weights changed since the previous step (a new ``epoch``), every running row is first
re-prefilled, prompt plus tokens so far, under the new weights: a token stamped ``v`` is then
sampled from exactly the distribution of weights ``v`` given its prefix, never from a KV cache
written by older weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from loong_core.protocols import SamplingParams
from loong_core.records import SpanSource, TokenSpan
from loong_train.models.decoder import CausalLM, KVCache

__all__ = ["SHARED_PREFIX_MIN", "BatchStats", "Request", "RunningBatch"]

SHARED_PREFIX_MIN = 8  # tokens: a shorter prefix shared by the joining contexts is prefilled with each
CDF_BLOCK = 1024  # tokens per block of the two-level draw over a wide vocabulary (_inverse_cdf)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of ``weights`` [n, vocab] (non-negative, each row with a positive sum), the first
    token whose cumulative weight exceeds ``u * total`` (``u`` [n] in [0, 1)): never a token of
    zero weight.

    A vocabulary wider than two blocks of ``CDF_BLOCK`` tokens is scanned in two levels: the
    cumulative sums of the blocks' totals pick the block, the cumulative sum inside it the token
    (the same token up to float32 rounding at a boundary; for 128 x 49,152 weights 10x faster
    than one scan across the vocabulary)."""
    n, vocab = weights.shape
    if vocab <= 2 * CDF_BLOCK:
        cdf = weights.cumsum(-1)
        return _first_above(cdf, u * cdf[:, -1])[0]
    full = vocab - vocab % CDF_BLOCK
    totals = weights[:, :full].view(n, full // CDF_BLOCK, CDF_BLOCK).sum(-1)
    if full < vocab:
        totals = torch.cat([totals, weights[:, full:].sum(-1, keepdim=True)], -1)
    cdf = totals.cumsum(-1)
    block, target = _first_above(cdf, u * cdf[:, -1])
    before = cdf.gather(-1, (block - 1).clamp(min=0)[:, None]).squeeze(-1).masked_fill(block == 0, 0.0)
    index = block[:, None] * CDF_BLOCK + torch.arange(CDF_BLOCK, device=weights.device)
    inside = weights.gather(-1, index.clamp(max=vocab - 1)).masked_fill_(index >= vocab, 0.0).cumsum(-1)
    return block * CDF_BLOCK + _first_above(inside, target - before)[0]


def _first_above(cdf: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``cdf`` [n, m] (non-decreasing, non-negative, a positive last entry), the first
    index whose value exceeds ``target`` [n], and the target used: kept below the last entry, so
    rounding never carries a draw past the last positive increase (a row of NaN or zero weights,
    which breaks the precondition, still gets an index in range)."""
    last = cdf[:, -1]
    target = torch.minimum(target, last.nextafter(torch.zeros_like(last)))
    index = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)
    return index.clamp_(max=cdf.shape[-1] - 1), target


def _shared_prefix(contexts: list[list[int]]) -> int:
    """The length of the prefix all ``contexts`` share, short of the shortest one's last token
    (every row computes at least its last position, whose logits it samples from)."""
    shortest = min(contexts, key=len)
    n = 0
    while n < len(shortest) - 1 and all(c[n] == shortest[n] for c in contexts):
        n += 1
    return n


@dataclass
class BatchStats:
    """Counters over sampling steps: ``tokens`` / ``steps`` is the mean occupancy (rows per step);
    ``busy_s``: seconds with a decode step or scoring pass running (the engine counts it);
    ``prefill_tokens``: context positions computed when rows join (a shared prefix once)."""

    steps: int = 0
    tokens: int = 0
    busy_s: float = 0.0
    prefill_tokens: int = 0

    @property
    def mean_occupancy(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0


@dataclass(eq=False)
class Request:
    """One completion in flight: its prompt, sampler and what it produced so far ([n] lists)."""

    prompt: list[int]
    sampling: SamplingParams
    generator: torch.Generator
    future: asyncio.Future | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    on_token: Callable[[], None] | None = None  # called (in the stepping thread) after each sampled token
    top_k: int = 0  # also keep the top_k most likely tokens of each step's distribution
    top: list[list[tuple[float, int]]] = field(default_factory=list)  # per token, most likely first

    @property
    def finished(self) -> bool:
        ids, sampling = self.token_ids, self.sampling
        return len(ids) >= sampling.max_new_tokens or (bool(ids) and ids[-1] in sampling.stop_token_ids)

    def span(self) -> TokenSpan:
        """The completion as a model span. ``weight_version`` is the last token's version;
        ``versions`` lists every token's version when the span crossed a weight update."""
        mixed = len(set(self.versions)) > 1
        return TokenSpan(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            source=SpanSource.MODEL,
            weight_version=self.versions[-1],
            versions=list(self.versions) if mixed else [],
        )


class RunningBatch:
    """The rows decoding together, their KV cache and next-token logits (not thread-safe: one
    caller at a time)."""

    def __init__(self, model: CausalLM, pad_id: int, stats: BatchStats) -> None:
        self.model, self.pad_id, self.stats = model, pad_id, stats
        self.rows: list[Request] = []
        self.epoch: int | None = None
        self._release()

    def _release(self) -> None:
        self.cache: KVCache | None = None
        self.first: list[int] = []  # [n] first context column of each row
        self.end = 0  # the column every row writes its next token to
        self.logits: torch.Tensor | None = None  # [n, vocab] next-token logits

    def reset(self) -> list[Request]:
        """Drop every row (after a failed step); returns them."""
        rows, self.rows = self.rows, []
        self._release()
        return rows

    @torch.no_grad()
    def step(
        self, joining: Sequence[Request], leaving: Sequence[Request], version: int, epoch: int
    ) -> list[Request]:
        """Drop ``leaving``, admit ``joining``, sample one token per row stamped ``version``, then
        decode the unfinished rows. Returns the rows that finished, in row order."""
        if leaving:
            gone = {id(r) for r in leaving}
            self._keep([i for i, r in enumerate(self.rows) if id(r) not in gone])
        if epoch != self.epoch and self.rows:
            joining = [*self.reset(), *joining]
        self.epoch = epoch
        if joining:
            self._join(list(joining))
        if not self.rows:
            return []
        tokens = self._sample(version)
        done = [r for r in self.rows if r.finished]
        order = self._keep([i for i, r in enumerate(self.rows) if not r.finished])
        if order:
            self._decode(tokens[order])
        return done

    @property
    def _device(self) -> torch.device:
        return self.model.lm_head.weight.device

    def _join(self, joining: list[Request]) -> None:
        """Prefill the joining rows. Rows with the same context (a group's samples of one
        prompt) are prefilled once: the first computes, the others copy its cache columns. A
        prefix all joining contexts share (a chat template's system turn) is computed once too."""
        index: dict[tuple[int, ...], int] = {}  # context -> its row among the prefilled ones
        firsts: list[Request] = []
        repeats: list[Request] = []
        copied: list[int] = []  # the prefilled row each repeat copies
        for r in joining:
            context = (*r.prompt, *r.token_ids)
            if context in index:
                repeats.append(r)
                copied.append(index[context])
            else:
                index[context] = len(firsts)
                firsts.append(r)
        joining = firsts + repeats
        contexts = [r.prompt + r.token_ids for r in firsts]
        source = [*range(len(firsts)), *copied]
        k, u, p, n = len(joining), len(contexts), max(len(c) for c in contexts), len(self.rows)
        headroom = max(r.sampling.max_new_tokens - len(r.token_ids) for r in joining)
        self._reserve(n + k, p, headroom)
        view = self.cache.view(slice(n, n + u), self.end - p)
        shared = _shared_prefix(contexts) if u > 1 else 0
        if shared < SHARED_PREFIX_MIN:
            shared = 0
        prefix = self._prefill_prefix(contexts[0][:shared], view) if shared else None
        logits = self._prefill(contexts, shared, view)
        if prefix is not None:
            self._place_prefix(prefix, [p - len(c) for c in contexts], view)
        self.stats.prefill_tokens += shared + sum(len(c) - shared for c in contexts)
        if k > u:  # the repeats copy their first's cache rows and logits
            src = torch.tensor(source[u:], device=self._device)
            dst = torch.arange(n + u, n + k, device=self._device)
            self.cache.move_rows(n + src, dst, slice(self.end - p, self.end))
            logits = torch.cat([logits, logits[src]])
        self.logits = logits if self.logits is None else torch.cat([self.logits, logits])
        self.first += [self.end - len(contexts[i]) for i in source]
        self.rows += joining

    def _prefill_prefix(self, prefix: list[int], view: KVCache) -> KVCache:
        """The shared prefix's keys and values, computed once ([1, kv_heads, len, head_dim] a
        layer) and copied into columns ``[0, len)`` of every row of ``view``, where the rows'
        own tokens attend to them."""
        s, cfg, dtype = len(prefix), self.model.config, self.model.lm_head.weight.dtype
        cache = KVCache(cfg, 1, s, dtype, self._device)
        ids = torch.tensor([prefix], dtype=torch.long, device=self._device)
        causal = torch.tril(torch.ones(s, s, dtype=torch.bool, device=self._device))
        self.model(ids, None, causal[None, None], cache, 0, last_only=True)
        for mine, theirs in zip((*cache.k, *cache.v), (*view.k, *view.v), strict=True):
            theirs[:, :, :s] = mine
        return cache

    def _prefill(self, contexts: list[list[int]], shared: int, view: KVCache) -> torch.Tensor:
        """Prefill each context after its first ``shared`` tokens (whose keys and values sit in
        columns ``[0, shared)`` of ``view``), left-padded into columns ``[shared, p)``; returns
        each row's next-token logits [rows, vocab]. A pad attends only to itself (no attention
        row is empty), real tokens never see pads, and position ids count real tokens only."""
        u, p = len(contexts), max(len(c) for c in contexts)
        t = p - shared
        ids = torch.full((u, t), self.pad_id, dtype=torch.long)
        valid = torch.zeros(u, t, dtype=torch.bool)
        for i, context in enumerate(contexts):
            rest = context[shared:]
            ids[i, t - len(rest) :] = torch.tensor(rest, dtype=torch.long)
            valid[i, t - len(rest) :] = True
        ids, valid = ids.to(self._device), valid.to(self._device)
        positions = shared + (valid.long().cumsum(-1) - 1).clamp(min=0)
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=self._device))
        own = (causal & valid[:, None, :]) | torch.eye(t, dtype=torch.bool, device=self._device)
        mask = torch.cat([valid[:, :, None].expand(u, t, shared), own], -1)  # the prefix: real tokens only
        return self.model(ids, positions, mask[:, None], view, shared, last_only=True)[:, -1]

    def _place_prefix(self, prefix: KVCache, pads: list[int], view: KVCache) -> None:
        """Write the shared prefix again where each row's context starts (column ``pads[i]`` of
        ``view``, right after its padding), so a row's context is one run of columns again."""
        s = prefix.max_len
        rows = torch.arange(len(pads), device=self._device)[:, None]
        cols = torch.tensor(pads, device=self._device)[:, None] + torch.arange(s, device=self._device)
        for mine, theirs in zip((*prefix.k, *prefix.v), (*view.k, *view.v), strict=True):
            theirs[rows, :, cols] = mine[0].transpose(0, 1)  # [rows, s, kv_heads, head_dim] <- [s, ...]

    def _decode(self, tokens: torch.Tensor) -> None:
        n = len(self.rows)
        self._reserve(n, 0)
        c0 = min(self.first)
        first = torch.tensor(self.first, device=self._device)
        mask = torch.arange(c0, self.end + 1, device=self._device)[None, :] >= first[:, None]
        positions = (self.end - first)[:, None]
        view = self.cache.view(slice(0, n), c0)
        self.logits = self.model(tokens[:, None], positions, mask[:, None, None], view, self.end - c0)[:, -1]
        self.end += 1

    def _reserve(self, rows: int, left: int, headroom: int = 1) -> None:
        """Make room for ``rows`` rows, ``left`` columns before ``end`` and one free column at
        ``end`` (a new cache gets ``headroom`` free columns)."""
        if self.cache is None:
            cfg, dtype = self.model.config, self.model.lm_head.weight.dtype
            self.cache = KVCache(cfg, rows, left + max(headroom, 1), dtype, self._device)
            self.end = left
            return
        width, batch = self.cache.max_len, self.cache.batch
        if self.end < left:
            shift = left - self.end
        elif self.end >= width:
            shift = -min(min(self.first), self.end - left)  # drop columns no row reads
        else:
            shift = 0
        used = self.end + shift + 1
        if shift == 0 and rows <= batch and used <= width:
            return
        if used > width or (self.end >= width and 2 * used > width):
            width = 2 * used  # amortised: a shift that frees under half the width also grows it
        batch = batch if rows <= batch else max(rows, 2 * batch)
        self.cache = self.cache.resized(batch, width, shift)
        self.end += shift
        self.first = [f + shift for f in self.first]

    def _keep(self, keep: list[int]) -> list[int]:
        """Keep rows ``keep`` as rows ``[0, len(keep))``: each slot left by a row that goes is
        filled by a kept row from beyond that range, so few rows move. Returns the new order
        (old row index of each new row)."""
        n = len(keep)
        if n == len(self.rows):
            return keep
        if not n:
            self.reset()
            return []
        kept = set(keep)
        holes = [i for i in range(n) if i not in kept]
        order = list(range(n))
        if holes:
            movers = [i for i in keep if i >= n]
            for hole, mover in zip(holes, movers, strict=True):
                order[hole] = mover
            cols = slice(min(self.first[i] for i in movers), self.end)
            src, dst = (torch.tensor(x, device=self._device) for x in (movers, holes))
            self.cache.move_rows(src, dst, cols)
        self.rows = [self.rows[i] for i in order]
        self.first = [self.first[i] for i in order]
        self.logits = self.logits[torch.tensor(order, device=self._device)]
        return order

    def _keep_top(self, z: torch.Tensor, total: torch.Tensor) -> None:
        """The ``top_k`` most likely tokens of this step's ``log_softmax(logits / T)`` for the rows
        that asked (before top-p, as the reported logprobs), appended to their ``top``."""
        asking = [i for i, r in enumerate(self.rows) if r.top_k]
        if not asking:
            return
        k = min(max(self.rows[i].top_k for i in asking), z.shape[-1])
        sel = torch.tensor(asking, device=z.device)
        values, ids = (z[sel] - total[sel, None].log()).topk(k, dim=-1)
        for i, vals, toks in zip(asking, values.tolist(), ids.tolist(), strict=True):
            r = self.rows[i]
            r.top.append(list(zip(vals[: r.top_k], toks[: r.top_k], strict=True)))

    def _sample(self, version: int) -> torch.Tensor:
        rows, device = self.rows, self._device
        # A row-major copy (the head's logits are a transposed view) that the next lines change in place.
        z = torch.empty(self.logits.shape, dtype=torch.float32, device=device).copy_(self.logits)
        temps = [r.sampling.temperature for r in rows]
        if any(t != 1 for t in temps):  # dividing by 1 changes nothing: skipped
            z.div_(torch.tensor(temps, device=device)[:, None])
        z.sub_(z.amax(-1, keepdim=True))
        weights = z.exp()  # unnormalised probabilities
        total = weights.sum(-1)
        top_ps = [r.sampling.top_p for r in rows]
        if min(top_ps) < 1:
            sorted_w, order = weights.sort(dim=-1, descending=True)
            limit = torch.tensor(top_ps, device=device)[:, None] * total[:, None]
            drop = sorted_w.cumsum(-1) - sorted_w > limit
            weights = weights.scatter(-1, order, sorted_w.masked_fill(drop, 0.0))
        u = torch.cat([torch.rand(1, generator=r.generator) for r in rows]).to(device)
        tokens = _inverse_cdf(weights, u)
        picked = z.gather(-1, tokens[:, None]).squeeze(-1) - total.log()  # log_softmax of the token
        self._keep_top(z, total)
        for r, token, lp in zip(rows, tokens.tolist(), picked.tolist(), strict=True):
            r.token_ids.append(token)
            r.logprobs.append(lp)
            r.versions.append(version)
            if r.on_token is not None:
                r.on_token()
        self.stats.steps += 1
        self.stats.tokens += len(rows)
        return tokens
