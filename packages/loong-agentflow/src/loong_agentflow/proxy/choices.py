"""Finishing a choice: engine tokens -> the text, tool calls and kept ids of one OpenAI choice.

A choice is cut at the first ``stop`` string: its kept token ids run up to and including the token
that completes the stop string, the text shown to the agent ends before it (as OpenAI does).
A turn that ended in one of the renderer's stop tokens is *closed*; the stop token stays in the
recorded ids and is left out of the text.

Streaming is live: :class:`LiveText` follows a choice's tokens as the engine samples them and
says which text can be shown already (never taken back) and when a stop string was hit, so the
caller stops generation there; :func:`finish_choice` then makes the :class:`Choice`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from loong_agentflow.proxy.render import ChatRenderer, split_completion
from loong_agentflow.proxy.session import MessageKey, args_key
from loong_agentflow.proxy.wire import next_id
from loong_core.records import SpanSource, TokenSpan

__all__ = ["Choice", "LiveText", "finish_choice"]

TOOL_CALL = "<tool_call>"


@dataclass(slots=True)
class Choice:
    span: TokenSpan
    text: str
    closed: bool
    finish: str
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reply: MessageKey | None = None


def finish_choice(
    span: TokenSpan, renderer: ChatRenderer, stop_ids: Collection[int], stops: Sequence[str], chat: bool
) -> Choice:
    ids = span.token_ids
    closed = bool(ids) and ids[-1] in stop_ids
    text = renderer.decode(ids[:-1] if closed else ids)
    finish = "stop" if closed else "length"
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if cut >= 0:
        stop = next(s for s in stops if text.find(s) == cut)
        keep = _tokens_covering(renderer.decode, ids, cut + len(stop))
        span = _slice(span, 0, keep)
        text, closed, finish = text[:cut], False, "stop"
    choice = Choice(span, text, closed, finish)
    if chat:
        content, calls = split_completion(text)
        choice.content = content
        choice.tool_calls = [
            {
                "id": next_id("call"),
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
            }
            for c in calls
        ] or None
        if calls and finish == "stop":
            choice.finish = "tool_calls"
        choice.reply = (
            "assistant",
            content or "",
            None,
            tuple((c.name, args_key(c.arguments)) for c in calls),
        )
    return choice


def _tokens_covering(decode: Callable[[list[int]], str], ids: list[int], n_chars: int) -> int:
    """The fewest leading tokens whose text reaches ``n_chars`` characters (binary search)."""
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(ids[:mid])) >= n_chars:
            hi = mid
        else:
            lo = mid + 1
    return hi


class LiveText:
    """One choice while its tokens arrive: the tokens so far, the text safe to show, and whether
    a stop string was hit (then the caller stops generation and finishes the choice).

    Shown text is never taken back, so it stops short of a trailing partial character, of a
    suffix that could begin a stop string and, in chat, of the first ``<tool_call>`` (or a suffix
    that could begin one) and of a blank beginning (content before a tool call is ``None`` when
    blank). What remains is shown once the choice finished (:meth:`rest`).
    """

    def __init__(
        self, renderer: ChatRenderer, stop_ids: Collection[int], stops: Sequence[str], chat: bool
    ) -> None:
        self.decode, self.stop_ids, self.stops, self.chat = renderer.decode, stop_ids, list(stops), chat
        self.holds = [*self.stops, TOOL_CALL] if chat else self.stops
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.text = ""  # the decoded text of the tokens up to ``_read``
        self._prefix = self._read = 0  # incremental detokenization: decode only ids[_prefix:]
        self._reach = max(map(len, self.holds), default=0)
        self.shown = ""
        self.sent = 0  # leading tokens already sent with shown text
        self.stopped = False

    def push(self, delta: TokenSpan) -> str:
        """Add the engine's new tokens; returns the text that became showable ("" if none).

        Decoding is incremental (each push decodes the tokens since the last complete character,
        as vLLM's detokenizer does) and stop strings are looked for in the new text only, so a
        long completion costs linear time."""
        self.ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.versions += delta.token_versions()
        end = len(self.ids) - (1 if self.ids and self.ids[-1] in self.stop_ids else 0)
        before = len(self.text)
        if end > self._read:
            done = self.decode(self.ids[self._prefix : self._read])
            now = self.decode(self.ids[self._prefix : end])
            if len(now) > len(done) and not now.endswith("\ufffd"):  # a character's bytes all arrived
                self.text += now[len(done) :]
                self._prefix, self._read = self._read, end
        text = self.text
        if any(s in text[max(0, before - self._reach) :] for s in self.stops):
            self.stopped = True
            return ""
        call = text.find(TOOL_CALL, max(0, len(self.shown) - len(TOOL_CALL))) if self.chat else -1
        limit = call if call >= 0 else len(text) - _held(text, self.holds)
        if (self.chat and not text[:limit].strip()) or limit <= len(self.shown):
            return ""
        piece, self.shown = text[len(self.shown) : limit], text[:limit]
        return piece

    def take(self) -> TokenSpan:
        """The tokens not yet sent, as a model span; they count as sent from now on."""
        span = self._span(self.sent, len(self.ids))
        self.sent = len(self.ids)
        return span

    def span(self) -> TokenSpan:
        """Every token so far: the choice's span before :func:`finish_choice` cuts it."""
        return self._span(0, len(self.ids))

    def rest(self, choice: Choice) -> tuple[str, TokenSpan]:
        """What the finished ``choice`` still has to show: its text (content in chat) beyond the
        shown text, and its kept tokens not yet sent."""
        final = (choice.content or "") if self.chat else choice.text
        text = final[len(self.shown) :] if final.startswith(self.shown) else ""
        ids = choice.span.token_ids
        return text, _slice(choice.span, min(self.sent, len(ids)), len(ids))

    def _span(self, start: int, end: int) -> TokenSpan:
        versions = self.versions[start:end]
        return TokenSpan(
            token_ids=self.ids[start:end],
            source=SpanSource.MODEL,
            logprobs=self.logprobs[start:end],
            weight_version=versions[-1] if versions else 0,
            versions=versions if len(set(versions)) > 1 else [],
        )


def _held(text: str, holds: Sequence[str]) -> int:
    """The length of the longest suffix of ``text`` that begins one of ``holds`` (but is not all of it)."""
    for k in range(min(len(text), max(map(len, holds), default=1) - 1), 0, -1):
        if any(h.startswith(text[-k:]) for h in holds):
            return k
    return 0


def _slice(span: TokenSpan, start: int, end: int) -> TokenSpan:
    return TokenSpan(
        token_ids=span.token_ids[start:end],
        source=SpanSource.MODEL,
        logprobs=span.logprobs[start:end],
        weight_version=span.weight_version,
        versions=span.versions[start:end],
    )
