"""Chat rendering for the proxy: messages + tools -> prompt token ids, and completions -> messages.

A :class:`ChatRenderer` renders a whole conversation (``render``) and, separately, what follows
an assistant turn that the model closed with a stop token (``continuation``: the new tool/user
messages and the next generation prompt). The proxy calls ``continuation`` when a request
extends the previous call of its session, so the prompt of the next call is::

    previous prompt ids + previous completion ids (the model's own tokens) + continuation ids

and the model's tokens are never re-tokenized. Two renderers ship:

- :class:`ChatMLRenderer`: ChatML with compact Hermes tool calls, in pure Python over any
  :class:`~loong_agentflow.tokens.TextCodec`; it renders exactly like Loong's tiny tokenizer
  template and like :class:`~loong_agentflow.agent.ChatML` (the white-box layout).
- :class:`HFChatRenderer`: any Hugging Face tokenizer's own ``apply_chat_template``, duck-typed
  (transformers is never imported here), through :class:`~loong_agentflow.chat_template.TemplateChat`,
  the layout white-box agents use for the same model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from loong_agentflow.chat_template import TemplateChat
from loong_agentflow.proxy.wire import ApiError
from loong_agentflow.tokens import Piece, TextCodec, encode_pieces, joined
from loong_agentflow.tools import ToolCall, parse_tool_calls

__all__ = ["ChatMLRenderer", "ChatRenderer", "HFChatRenderer", "split_completion", "tokenized"]

Messages = Sequence[dict[str, Any]]

Tools = Sequence[dict[str, Any]] | None


class ChatRenderer(Protocol):
    """Messages (OpenAI shape; tool-call ``arguments`` already decoded to dicts) -> token ids."""

    stop_token_ids: list[int]
    """Tokens that end an assistant turn; the engine stops on them."""
    turn_end_ids: list[int]
    """What closes an assistant turn the model did not close itself (cut by length or a stop string)."""

    def render(self, messages: Messages, tools: Tools) -> list[int]:
        """The whole conversation followed by the generation prompt."""
        ...

    def continuation(self, messages: Messages, tools: Tools) -> list[int]:
        """``messages`` rendered after an assistant turn closed by a stop token, plus the generation prompt."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def split_completion(text: str) -> tuple[str | None, list[ToolCall]]:
    """A completion's text -> (content, tool calls) in the Hermes ``<tool_call>{json}</tool_call>`` format.

    Content is the text before the first tool call (``None`` when that is blank). A completion
    with any malformed tool-call block is returned whole as content, with no tool calls.
    """
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    parsed = parse_tool_calls(text)
    calls = [c for c in parsed if isinstance(c, ToolCall)]
    if not calls or len(calls) != len(parsed):
        return text, []
    content = text[:start]
    return (content if content.strip() else None), calls


def tokenized(render: Callable[..., list[int]], *args: Any, param: str = "messages") -> list[int]:
    """``render(*args)``; text the tokenizer or chat template cannot take is the request's 400."""
    try:
        return render(*args)
    except (KeyError, ValueError, TypeError, UnicodeError) as e:
        raise ApiError(
            400, f"Invalid '{param}': it cannot be tokenized ({type(e).__name__}: {e}).", param=param
        ) from None


def _tool_call_text(call: dict[str, Any]) -> str:
    fn = call.get("function", call)
    return f'<tool_call>{{"name": "{fn["name"]}", "arguments": {json.dumps(fn["arguments"], ensure_ascii=False)}}}</tool_call>'


class ChatMLRenderer:
    """ChatML with Hermes tool calls, matching Loong's tiny-tokenizer template character for character:

    ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message; an assistant turn is its content
    followed by ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` per call; each tool
    message is a ``user`` turn ``<tool_response>{content}</tool_response>``. The tool list is not
    rendered (tiny policies are trained on the layout, not on schemas).
    """

    END = "<|im_end|>"

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.stop_token_ids = codec.encode(self.END)
        if len(self.stop_token_ids) != 1:
            raise ValueError(f"{self.END!r} must be one token, got {self.stop_token_ids}")
        self.turn_end_ids = list(self.stop_token_ids)

    def text(self, messages: Messages, generation_prompt: bool = True) -> str:
        return joined(self.pieces(messages, generation_prompt))

    def pieces(self, messages: Messages, generation_prompt: bool = True) -> list[Piece]:
        """The rendering as :data:`~loong_agentflow.tokens.Piece` s: message contents and tool-call
        text are untrusted, so they cannot forge control tokens."""
        out: list[Piece] = []
        for m in messages:
            out += self._message(m)
        return out + ([("<|im_start|>assistant\n", False)] if generation_prompt else [])

    def _message(self, m: dict[str, Any]) -> list[Piece]:
        if m["role"] == "tool":
            head, body = "<|im_start|>user\n<tool_response>", m["content"]
            return [(head, False), (body, True), (f"</tool_response>{self.END}\n", False)]
        if m["role"] == "assistant":
            calls = "".join(_tool_call_text(c) for c in m.get("tool_calls") or ())
            body = f"{m.get('content') or ''}{calls}"
            return [("<|im_start|>assistant\n", False), (body, True), (f"{self.END}\n", False)]
        return [(f"<|im_start|>{m['role']}\n", False), (m["content"], True), (f"{self.END}\n", False)]

    def render(self, messages: Messages, tools: Tools) -> list[int]:
        return encode_pieces(self.codec, self.pieces(messages))

    def continuation(self, messages: Messages, tools: Tools) -> list[int]:
        return encode_pieces(self.codec, [("\n", False), *self.pieces(messages)])

    def encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.codec.decode(ids)


class HFChatRenderer:
    """A Hugging Face tokenizer's chat template (``apply_chat_template``), duck-typed.

    ``stop_token`` defaults to the tokenizer's ``eos_token`` and must be what the template puts
    right after an assistant message's content (``<|im_end|>`` for Qwen). The continuation is
    probed once at construction, so a template that does not close assistant turns that way fails
    early with a ``ValueError`` rather than producing wrong tokens.
    """

    def __init__(self, tokenizer: Any, stop_token: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat = TemplateChat(tokenizer, stop_token)  # probes the continuation: refuses a template early
        self.stop_text = self.chat.END
        self.stop_token_ids = tokenizer.encode(self.stop_text, add_special_tokens=False)
        if len(self.stop_token_ids) != 1:
            raise ValueError(f"stop token {self.stop_text!r} is not a single token")
        self.turn_end_ids = list(self.stop_token_ids)
        self.special_tokens = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]

    def render(self, messages: Messages, tools: Tools) -> list[int]:
        return encode_pieces(self, self.chat.prompt_pieces(messages, tools))

    def continuation(self, messages: Messages, tools: Tools) -> list[int]:
        return encode_pieces(self, self.chat.turn_pieces(messages, tools))

    def encode_literal(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
