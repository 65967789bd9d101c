"""Local, deterministic tokenizers in Hugging Face format, for tiny models built from a config.

Tiny recipes cannot download a tokenizer, so Loong builds one (``[model] tokenizer``):

- ``"char"``: every printable ASCII character and newline is a token;
- ``"bpe"``: a byte-level BPE (GPT-2 / Qwen style: any UTF-8 text encodes, a multi-byte character
  may span tokens) trained with ``tokenizers`` on the task's own text to ``bpe_vocab_size``
  tokens, with Qwen2's pre-tokenizer pattern (digits one by one, words with their leading space);
  ``"bpe-bare"``: the same, but a space before a word is a token of its own, so a word is the
  same token wherever it stands. With Qwen2's pattern ``go`` at the start of a line and `` go``
  after a space are unrelated tokens: a task that moves words around (reverse a list of words)
  then asks a tiny model to learn that pairing word by word, rather than to copy.

Both carry the ChatML and Hermes tool-call tokens (``<|im_start|>`` ... as special tokens, the
``<tool_call>`` tags as added tokens that never merge with their neighbours) and a Qwen-style chat
template, saved as ``tokenizer.json`` + ``tokenizer_config.json`` that ``transformers.AutoTokenizer``
loads like any hub tokenizer. Ids 0-2 are the special tokens in both.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "QWEN2_PATTERN", "SPECIAL_TOKENS", "TOOL_TOKENS", "build_tokenizer"]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# Qwen2's pre-tokenizer split: contractions, words with one leading non-letter, single digits,
# punctuation runs, newlines, spaces.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# Qwen2's pattern with bare words: no leading character joins a run of letters.
BARE_WORDS_PATTERN = QWEN2_PATTERN.replace(r"[^\r\n\p{L}\p{N}]?\p{L}+", r"\p{L}+")

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


def build_tokenizer(
    path: str | Path, kind: str = "char", corpus: Iterable[str] = (), vocab_size: int = 512
) -> Path:
    """Write a ``kind`` ("char" or "bpe") tokenizer to ``path`` and return it; "bpe" is trained on
    ``corpus`` (texts) to ``vocab_size`` tokens, tool tags included."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    if kind == "char":
        chars = ["\n", *[chr(c) for c in range(32, 127)]]
        vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + TOOL_TOKENS + chars)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>"))
        tok.decoder = decoders.Fuse()
    elif kind in ("bpe", "bpe-bare"):
        pattern = BARE_WORDS_PATTERN if kind == "bpe-bare" else QWEN2_PATTERN
        tok = _train_bpe(corpus, vocab_size - len(TOOL_TOKENS), pattern)
    else:
        raise ValueError(f"tokenizer {kind!r}: expected 'char', 'bpe' or 'bpe-bare'")
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
        "unk_token": None if kind != "char" else "<|endoftext|>",  # byte-level encodes every text
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return path


def _train_bpe(corpus: Iterable[str], vocab_size: int, pattern: str = QWEN2_PATTERN):
    """A byte-level BPE trained on ``corpus`` with the special tokens as ids 0-2; the 256 byte
    symbols are always in the vocabulary, so ``vocab_size`` must exceed 259."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size <= 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"bpe_vocab_size {vocab_size + len(TOOL_TOKENS)} is too small: a byte-level BPE holds 256 byte "
            f"symbols, {len(SPECIAL_TOKENS)} special and {len(TOOL_TOKENS)} tool tokens before any merge"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_without_tags(corpus), trainer)
    return tok


def _without_tags(corpus: Iterable[str]):
    """The corpus with the special and tool tags taken out: they are tokens of their own, so
    no merge may learn their characters."""
    for text in corpus:
        for tag in SPECIAL_TOKENS + TOOL_TOKENS:
            text = text.replace(tag, "\n")
        yield text
