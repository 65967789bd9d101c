"""How the proxy serves: :class:`ProxyConfig`, read by the server, its endpoints and its sampler."""

from __future__ import annotations

import msgspec

__all__ = ["ProxyConfig"]


class ProxyConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the proxy serves.

    ``temperature`` / ``top_p``, when set, override what agents ask for (RL samples at the
    training temperature whatever the agent's code says); otherwise temperature 0 (greedy) is a
    400, because the engine samples. ``max_session_model_tokens`` (0 = unlimited) caps the model
    tokens of one episode; a call past it is a 400 ``context_length_exceeded`` and the episode is
    marked truncated.

    Limits of the model (0: unknown, not checked): ``context_length``, its positions: a prompt
    that fills them, or a ``max_tokens`` that would run past them, is a 400
    ``context_length_exceeded`` naming the numbers; without ``max_tokens`` the default is clamped
    to what is left, as OpenAI does. ``vocab_size``: token-id prompts must lie in ``[0,
    vocab_size)``. ``max_tokens_limit`` bounds any ``max_tokens`` whatever the context.
    """

    host: str = "127.0.0.1"
    port: int = 0
    model: str = "loong-policy"
    max_body_bytes: int = 8 << 20
    default_max_tokens: int = 1024
    max_n: int = 8
    max_session_model_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    context_length: int = 0
    vocab_size: int = 0
    max_tokens_limit: int = 1 << 20
