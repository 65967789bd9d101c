"""A local, deterministic character-level tokenizer in Hugging Face format.

Tiny recipes cannot download a tokenizer, so Loong builds one: every printable ASCII
character and newline is a token, plus ChatML and Hermes tool-call special tokens, saved as
``tokenizer.json`` + ``tokenizer_config.json`` (with a Qwen-style chat template) that
``transformers.AutoTokenizer`` loads like any hub tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "TOOL_TOKENS", "build_tokenizer"]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# ChatML with Hermes-style tool calls, rendered compactly (no tool list in the system prompt).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>' + message.content + '</tool_response><|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for tc in message.tool_calls or [] %}"
    "{%- set f = tc.function if tc.function is defined else tc %}"
    '{{- \'<tool_call>{"name": "\' + f.name + \'", "arguments": \' }}'
    "{%- if f.arguments is string %}{{- f.arguments }}{%- else %}{{- f.arguments | tojson }}{%- endif %}"
    "{{- '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer(path: str | Path) -> Path:
    """Write a char-level tokenizer to ``path`` and return it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    chars = ["\n", *[chr(c) for c in range(32, 127)]]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + TOOL_TOKENS + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return path
