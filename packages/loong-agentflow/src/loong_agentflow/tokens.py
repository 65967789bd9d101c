"""The token buffer: an episode's transcript, kept as the exact tokens the policy saw.

Model tokens are appended as generated (with logprobs and weight version); observations are
tokenized on their own and appended with loss mask 0. Nothing is ever re-tokenized, so the
trainer sees exactly the sequence the policy conditioned on.
"""

from __future__ import annotations

from typing import Protocol

from loong_core.records import SpanSource, TokenSpan

__all__ = ["TextCodec", "TokenBuffer"]


class TextCodec(Protocol):
    """Text <-> token ids without adding special tokens (e.g. a Hugging Face tokenizer adapter)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class TokenBuffer:
    """Spans in order; ``ids`` is the concatenation of all spans' tokens."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.spans: list[TokenSpan] = []
        self.ids: list[int] = []

    def append_text(self, text: str, source: SpanSource) -> TokenSpan:
        """Tokenize ``text`` alone and append it as a non-model span."""
        return self.append(TokenSpan(token_ids=self.codec.encode(text), source=source))

    def append(self, span: TokenSpan) -> TokenSpan:
        self.spans.append(span)
        self.ids.extend(span.token_ids)
        return span

    @property
    def num_model_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.spans if s.is_model)

    def text(self) -> str:
        return self.codec.decode(self.ids)
