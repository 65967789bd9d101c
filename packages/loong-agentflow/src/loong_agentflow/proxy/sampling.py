"""A request's sampling parameters, checked against the proxy's config, the model's limits and the
episode's token budget.

The checks run in this order, and the first that fails is the request's 400: temperature 0
(the engine samples), ``max_tokens`` above ``max_tokens_limit``, a prompt that fills the context or
a ``max_tokens`` that runs past it, the episode's budget used up, a ``stop`` string the tokenizer
cannot take. ``max_new_tokens`` is ``max_tokens`` (else ``default_max_tokens``), clamped to what
is left of the context and of the budget. A ``stop`` string that is one token also becomes an
engine stop token, so the engine call ends on it.
"""

from __future__ import annotations

from loong_agentflow.proxy.config import ProxyConfig
from loong_agentflow.proxy.render import ChatRenderer, tokenized
from loong_agentflow.proxy.session import ProxySession
from loong_agentflow.proxy.wire import ApiError, ChatRequest, CompletionRequest
from loong_core.protocols import SamplingParams

__all__ = ["Sampler"]

_STOP_CACHE_SIZE = 4096
"""Stop strings remembered with their token ids; past that, new ones are not made engine stop tokens."""


class Sampler:
    """Request -> :class:`~loong_core.protocols.SamplingParams` for one proxy."""

    def __init__(self, config: ProxyConfig, renderer: ChatRenderer) -> None:
        self.config, self.renderer = config, renderer
        self._stop_cache: dict[str, list[int]] = {}

    def params(
        self,
        req: ChatRequest | CompletionRequest,
        session: ProxySession,
        max_tokens: int | None,
        prompt_len: int,
        param: str,
    ) -> SamplingParams:
        """``param`` is what a context-length error names (``messages`` or ``prompt``)."""
        cfg = self.config
        temperature = cfg.temperature or (1.0 if req.temperature is None else req.temperature)
        if temperature == 0:
            raise ApiError(
                400,
                "Unsupported value for parameter 'temperature': 0 (greedy); the engine samples.",
                param="temperature",
            )
        max_new = session.capped(self._max_new(max_tokens, prompt_len, param))
        return SamplingParams(
            temperature=temperature,
            top_p=cfg.top_p or req.top_p or 1.0,
            max_new_tokens=max_new,
            stop_token_ids=self._stop_ids(req.stop_strings()),
        )

    def _max_new(self, max_tokens: int | None, prompt_len: int, param: str) -> int:
        cfg = self.config
        if max_tokens is not None and max_tokens > cfg.max_tokens_limit:
            raise ApiError(
                400,
                f"max_tokens is {max_tokens}; this server allows at most {cfg.max_tokens_limit}.",
                param="max_tokens",
            )
        max_new = max_tokens or cfg.default_max_tokens
        if not (context := cfg.context_length):
            return max_new
        if prompt_len >= context or (max_tokens is not None and prompt_len + max_tokens > context):
            raise ApiError(
                400,
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{prompt_len + (max_tokens or 0)} tokens ({prompt_len} in the prompt, "
                f"{max_tokens or 0} in the completion).",
                param=param,
                code="context_length_exceeded",
            )
        return min(max_new, context - prompt_len)  # the default, clamped to what is left

    def _stop_ids(self, stops: list[str]) -> list[int]:
        """The renderer's stop tokens, and each ``stop`` string that is a single token."""
        stop_ids = list(self.renderer.stop_token_ids)
        for s in stops:
            ids = self._stop_cache.get(s)
            if ids is None:
                ids = (
                    self._stop_cache.setdefault(s, tokenized(self.renderer.encode, s, param="stop"))
                    if len(self._stop_cache) < _STOP_CACHE_SIZE
                    else []
                )
            if len(ids) == 1:
                stop_ids.append(ids[0])
        return stop_ids
