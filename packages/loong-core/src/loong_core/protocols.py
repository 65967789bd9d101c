"""The seams between Loong's packages: one small Protocol each.

Backends live in the packages above loong-core and are chosen by a ``type`` field in config.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import msgspec

from loong_core.records import TokenSpan

__all__ = ["MIN_TEMPERATURE", "RequestRefused", "RolloutEngine", "SamplingParams"]

MIN_TEMPERATURE = 1e-3
"""The lowest sampling temperature: below it ``logits / T`` can overflow to inf for a model's
larger logits (then logprobs are NaN), and sampling is greedy in all but name."""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to sample one completion.

    ``logprobs`` returned with a completion are log-probabilities of the sampled tokens under the
    distribution actually sampled from: ``log_softmax(logits / temperature)`` (top-p does not
    renormalise them), which is what the trainer recomputes.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_token_ids: list[int] = []

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= MIN_TEMPERATURE):
            raise ValueError(f"temperature must be a number >= {MIN_TEMPERATURE}, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


class RequestRefused(ValueError):
    """An engine refuses one request: its prompt or sampling cannot run on this model (token ids
    outside the vocabulary, a prompt past the context). The request fails alone and nothing else
    is affected; a server in front of the engine answers it as the client's mistake (HTTP 400)."""


@runtime_checkable
class RolloutEngine(Protocol):
    """Token-level generation with per-token logprobs and weight versions.

    Lifecycle: create, then ``generate`` concurrently from many episodes; around a weight update
    the owner calls ``pause()`` (in-flight requests hold between decode steps), applies weights,
    then ``resume()``. Every returned model span carries the version that produced its tokens.

    ``generate`` raises :class:`RequestRefused` for a request the model cannot take; any other
    exception is the engine's own failure.

    Optional: ``stream(input_ids, sampling) -> AsyncIterator[TokenSpan]``, the same completion
    yielded while it is sampled (model spans of the tokens new since the previous one); closing
    the iterator early cancels the request. The AgentFlow proxy streams through it and ends a
    call at a stop string there.
    """

    @property
    def weight_version(self) -> int: ...

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> TokenSpan:
        """Complete ``input_ids``; returns a model span (stop token included when hit)."""
        ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...
