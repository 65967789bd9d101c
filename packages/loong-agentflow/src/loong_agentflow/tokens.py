"""The token buffer: an episode's transcript, kept as the exact tokens the policy saw.

Model tokens are appended as generated (with logprobs and weight version); observations are
tokenized on their own and appended with loss mask 0. Nothing is ever re-tokenized, so the
trainer sees exactly the sequence the policy conditioned on.

Control tokens cannot be forged: a rendered turn can be given as :data:`Piece` s, ``(text,
untrusted)``, where the message contents (user, tool and environment text) are untrusted. An
untrusted piece that holds the text of one of the codec's control tokens (``<|im_start|>``...)
is tokenized as literal text (:meth:`TextCodec.encode_literal`), so only the chat template itself
emits control tokens; every other piece is joined and tokenized as one string, exactly as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from loong_core.records import SpanSource, TokenSpan

__all__ = ["Piece", "TextCodec", "TokenBuffer", "encode_pieces", "joined"]

Piece = tuple[str, bool]
"""Rendered text and whether it is untrusted (a message's content, not the template's)."""


class TextCodec(Protocol):
    """Text <-> token ids without adding special tokens (e.g. a Hugging Face tokenizer adapter).

    ``special_tokens``: the texts of the control tokens; ``encode_literal``: ``text`` tokenized
    with those texts as plain characters (Hugging Face: ``split_special_tokens=True``). A codec
    without them tokenizes untrusted text like any other (no guard); Loong's codecs have both."""

    special_tokens: Sequence[str]

    def encode(self, text: str) -> list[int]: ...

    def encode_literal(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def joined(text: str | Sequence[Piece]) -> str:
    return text if isinstance(text, str) else "".join(t for t, _ in text)


def encode_pieces(codec: TextCodec, text: str | Sequence[Piece]) -> list[int]:
    """``text`` tokenized (see the module docstring): untrusted pieces holding a control token's
    text are tokenized literally, runs of other pieces as one string."""
    if isinstance(text, str):
        return codec.encode(text)
    specials = tuple(getattr(codec, "special_tokens", ()))  # a codec without them: no guard
    ids: list[int] = []
    run: list[str] = []
    for piece, untrusted in text:
        if untrusted and any(s in piece for s in specials):
            if run:
                ids += codec.encode("".join(run))
                run = []
            ids += codec.encode_literal(piece)
        else:
            run.append(piece)
    if run:
        ids += codec.encode("".join(run))
    return ids


class TokenBuffer:
    """Spans in order; ``ids`` is the concatenation of all spans' tokens."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.spans: list[TokenSpan] = []
        self.ids: list[int] = []

    def append_text(self, text: str | Sequence[Piece], source: SpanSource) -> TokenSpan:
        """Tokenize ``text`` (a string, or pieces: :func:`encode_pieces`) alone and append it as a
        non-model span."""
        return self.append(TokenSpan(token_ids=encode_pieces(self.codec, text), source=source))

    def append(self, span: TokenSpan) -> TokenSpan:
        self.spans.append(span)
        self.ids.extend(span.token_ids)
        return span

    @property
    def num_model_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.spans if s.is_model)

    def text(self) -> str:
        return self.codec.decode(self.ids)
