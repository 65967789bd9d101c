"""A model's own chat layout, read from its Hugging Face tokenizer's ``apply_chat_template``.

White-box agents lay out an episode as text pieces (:data:`~loong_agentflow.tokens.Piece`): the
prompt, then after each model turn the observations and the next generation prompt. The pieces
of :class:`TemplateChat` are the template's own rendering, so a white-box episode on a Llama,
Mistral or Qwen checkpoint reads as that model was trained to read, tool list included (the
template renders ``tools``, OpenAI-style function schemas). :func:`chat_format` picks it for a
tokenizer whose template differs from ChatML, and :class:`~loong_agentflow.agent.ChatML`
otherwise (the same text, and the same tokens).

How the pieces are found:

- the prompt: the template's rendering of the messages with the generation prompt;
- what follows a model turn closed by the stop token (``turn_pieces``): a probe conversation
  whose last assistant turn is a unique marker is rendered with the new messages after it, and
  cut after the marker and the stop token's text. A template that does not put the stop token
  right after an assistant turn's content is refused at construction (``ValueError``).

Control tokens cannot be forged from content: every special token's text inside a message is
replaced by a per-call random marker before rendering, and comes back as an untrusted piece,
tokenized as literal text. The template's own control tokens are the only ones in the pieces.
The tokenizer is duck-typed (``apply_chat_template``, ``eos_token``, ``added_tokens_decoder``):
transformers is never imported here.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from typing import Any

from loong_agentflow.tokens import Piece

__all__ = ["TemplateChat", "chat_format"]

log = logging.getLogger("loong.agentflow")

Messages = Sequence[dict[str, Any]]
Tools = Sequence[dict[str, Any]] | None

_MARK = "\x00loong-turn-marker\x00"


class TemplateChat:
    """The chat layout of ``tokenizer``'s template; ``END`` is the text that closes a model turn
    (``stop_token``, by default the tokenizer's ``eos_token``)."""

    def __init__(self, tokenizer: Any, stop_token: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.END: str = stop_token or tokenizer.eos_token
        specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
        specials.sort(key=len, reverse=True)
        self._specials = re.compile("|".join(map(re.escape, specials)) or "(?!)")
        self.turn_pieces([{"role": "user", "content": "probe"}])  # refuses a template we cannot continue

    def text(self, messages: Messages, tools: Tools = None, generation_prompt: bool = True) -> str:
        """The template's text for ``messages`` (and ``tools``), as ``apply_chat_template`` gives it."""
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=generation_prompt,
            tokenize=False,
        )

    def prompt_pieces(self, messages: Messages, tools: Tools = None) -> list[Piece]:
        """The conversation followed by the generation prompt."""
        guarded, unguard = self._guard(messages)
        return unguard(self.text(guarded, tools))

    def turn_pieces(self, messages: Messages, tools: Tools = None) -> list[Piece]:
        """``messages`` as they follow a model turn closed by ``END``, plus the generation prompt."""
        guarded, unguard = self._guard(messages)
        probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]
        text = self.text([*probe, *guarded], tools)
        cut = text.find(_MARK + self.END)
        if cut < 0:
            raise ValueError(
                f"the chat template does not end an assistant turn with {self.END!r} right after its content"
            )
        return unguard(text[cut + len(_MARK) + len(self.END) :])

    def tool_turn_pieces(self, results: Sequence[Any]) -> list[Piece]:
        """Tool results (``.content``) as the template shows ``tool`` messages after a model turn."""
        return self.turn_pieces([{"role": "tool", "content": r.content} for r in results])

    def strip_end(self, text: str) -> str:
        return text.removesuffix(self.END)

    def _guard(self, messages: Messages) -> tuple[list[dict[str, Any]], Any]:
        """``messages`` with each control token's text in a content replaced by a fresh marker,
        and the function that splits a rendering at the markers into pieces."""
        literals: list[str] = []
        marker = f"\x00loong-{os.urandom(8).hex()}-"  # new per call: no content can forge one

        def mark(match: re.Match[str]) -> str:
            literals.append(match.group(0))
            return f"{marker}{len(literals) - 1}\x00"

        guarded = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, str) and self._specials.search(content):
                m = {**m, "content": self._specials.sub(mark, content)}
            guarded.append(m)

        def unguard(text: str) -> list[Piece]:
            if not literals:
                return [(text, False)]
            parts = re.split(f"{re.escape(marker)}(\\d+)\x00", text)
            return [(p, False) if k % 2 == 0 else (literals[int(p)], True) for k, p in enumerate(parts) if p]

        return guarded, unguard


_PROBE = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {"role": "assistant", "content": "A"},
    {"role": "tool", "content": "T"},
]


def chat_format(tokenizer: Any) -> Any:
    """The white-box layout for ``tokenizer``: :class:`~loong_agentflow.agent.ChatML` when its
    template renders a probe conversation (system, user, assistant, tool) exactly as ChatML does,
    has no template, or refuses the probe (a warning says why), else :class:`TemplateChat`."""
    from loong_agentflow.agent import ChatML
    from loong_agentflow.tools import ToolResult

    if not getattr(tokenizer, "chat_template", None):
        return ChatML
    first, reply = _PROBE[:2], _PROBE[2]["content"]
    try:
        template = TemplateChat(tokenizer, ChatML.END if "<|im_end|>" in tokenizer.get_vocab() else None)
        same = template.text(first) == ChatML.prompt(first) and (
            ChatML.prompt(first) + reply + ChatML.END + ChatML.tool_turn([ToolResult(None, "T", ok=True)])
            == template.text(_PROBE)
        )
    except Exception as e:  # a template that refuses the probe (roles must alternate, tool call ids...)
        log.warning("white-box episodes keep ChatML's layout: the chat template cannot lay them out (%s)", e)
        return ChatML
    return ChatML if same else template
