"""The ``sglang`` teacher backend: an SGLang server (or anything serving SGLang's native
``/generate``, such as Loong's embedded engine) scored with prefill-only requests.

One request (a ``loong_core.sglang_api.GenerateRequest``) carries up to ``batch_size`` rows::

    POST /generate {"input_ids": [[...], ...], "sampling_params": {"max_new_tokens": 0},
                    "return_logprob": true, "logprob_start_len": s, "top_logprobs_num": k}

``meta_info.input_token_logprobs`` of each row holds ``[logprob, token_id, text]`` triples for
``input_ids[s:]``: entry ``i >= 1`` is ``log p(x[s+i] | x[:s+i])`` (entry 0 has no logprob we use).
With ``k > 0``, ``meta_info.input_top_logprobs[i]`` lists the k best ``[logprob, token_id, text]`` at
the same position. ``s`` is one position before the batch's first scored token, so only the part
of each sequence that is scored comes back; each triple's token id is checked against the row.
The tail is ``log(1 - sum_i exp(top_i))`` (the server returns no more than its top k).

Failures: connection errors, timeouts and 502/503/504 are retried ``retries`` times with
exponential backoff (a prefill has no side effects, so resending is safe); any other error, or a
response that does not line up with the request, raises :class:`TeacherServerError`. Up to
``max_concurrency`` requests are in flight at once.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import torch

from loong_core.sglang_api import GenerateRequest, GenerateResponse, MetaInfo, SGLangSamplingParams
from loong_teacher.config import SGLangTeacherConfig
from loong_teacher.losses import _log1mexp
from loong_teacher.teacher import RowScores

__all__ = ["SGLangTeacher", "TeacherServerError"]

_RETRY_STATUS = {502, 503, 504}
_JSON = {"content-type": "application/json"}


class TeacherServerError(RuntimeError):
    """The teacher server answered with an error, stayed unreachable, or answered out of line."""


class SGLangTeacher:
    """A teacher behind an SGLang server; holds no model memory in this process."""

    def __init__(self, config: SGLangTeacherConfig) -> None:
        self.config, self.name = config, config.name
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._client = httpx.Client(
            base_url=config.url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(max_connections=config.max_concurrency),
        )
        self.requests = 0  # requests sent, retries included
        self.retried = 0

    def score(self, rows: Sequence[tuple[Sequence[int], Sequence[int]]], top_k: int = 0) -> list[RowScores]:
        """See :class:`loong_teacher.teacher.Teacher`."""
        n = self.config.batch_size
        batches = [rows[i : i + n] for i in range(0, len(rows), n)]
        if len(batches) == 1:
            return self._score_batch(batches[0], top_k)
        with ThreadPoolExecutor(self.config.max_concurrency) as pool:
            done = pool.map(lambda b: self._score_batch(b, top_k), batches)
            return [scores for batch in done for scores in batch]

    def close(self) -> None:
        self._client.close()

    def _score_batch(self, rows, top_k: int) -> list[RowScores]:
        start = min(p[0] for _, p in rows) - 1
        body = GenerateRequest(
            input_ids=[list(ids) for ids, _ in rows],
            sampling_params=SGLangSamplingParams(max_new_tokens=0),
            return_logprob=True,
            logprob_start_len=start,
            top_logprobs_num=top_k or None,
        )
        try:
            answers = msgspec.json.decode(self._post(msgspec.json.encode(body)), type=list[GenerateResponse])
        except msgspec.DecodeError as e:
            raise TeacherServerError(f"{self.name}: not an SGLang /generate answer: {e}") from None
        if len(answers) != len(rows):
            raise TeacherServerError(f"{self.name}: expected {len(rows)} answers, got {len(answers)}")
        return [
            _row_scores(self.name, a.meta_info, ids, p, start, top_k)
            for a, (ids, p) in zip(answers, rows, strict=True)
        ]

    def _post(self, body: bytes) -> bytes:
        """POST ``body`` to ``/generate`` with the retries of the module docstring; the 200 answer."""
        delay = self.config.backoff_s
        for attempt in range(self.config.retries + 1):
            self.requests += 1
            last = attempt == self.config.retries
            try:
                response = self._client.post("/generate", content=body, headers=_JSON)
            except httpx.TransportError as exc:  # connection errors and timeouts
                if last:
                    raise TeacherServerError(
                        f"{self.name}: {self.config.url} failed after {attempt + 1} tries: {type(exc).__name__}: {exc}"
                    ) from exc
            else:
                if response.status_code == 200:
                    return response.content
                if response.status_code not in _RETRY_STATUS or last:
                    raise TeacherServerError(
                        f"{self.name}: {self.config.url}/generate: HTTP {response.status_code}: {response.text[:500]}"
                    )
            self.retried += 1
            time.sleep(delay * (1 + 0.1 * random.random()))
            delay *= 2
        raise AssertionError("unreachable")


def _row_scores(name: str, meta: MetaInfo, ids, positions, start: int, top_k: int) -> RowScores:
    """Pick the scored positions out of one row's ``meta_info`` (entries cover ``ids[start:]``)."""
    triples = meta.input_token_logprobs or []
    if len(triples) < len(ids) - start:
        raise TeacherServerError(f"{name}: {len(triples)} input logprobs for {len(ids) - start} positions")
    at = [p - start for p in positions]
    if any(triples[i][1] != ids[p] for i, p in zip(at, positions, strict=True)):
        raise TeacherServerError(f"{name}: input_token_logprobs token ids do not match the request")
    logprobs = torch.tensor([float(triples[i][0]) for i in at], dtype=torch.float32)
    if not top_k:
        return RowScores(logprobs)
    tops = meta.input_top_logprobs or []
    if len(tops) < len(triples):
        raise TeacherServerError(
            f"{name}: the server returned no input_top_logprobs for top_logprobs_num={top_k}"
        )
    rows = [(tops[i] or [])[:top_k] for i in at]
    if any(len(r) < top_k for r in rows):
        raise TeacherServerError(f"{name}: fewer than {top_k} top logprobs at a scored position")
    top_lp = torch.tensor([[float(t[0]) for t in r] for r in rows], dtype=torch.float32)
    top_ids = torch.tensor([[int(t[1]) for t in r] for r in rows], dtype=torch.long)
    tail = _log1mexp(top_lp.logsumexp(-1).clamp(max=0.0))
    return RowScores(logprobs, top_ids, top_lp, tail)
