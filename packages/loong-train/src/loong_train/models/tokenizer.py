"""Hugging Face tokenizers as the rest of Loong uses them: loading, a text codec, end-of-turn ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

__all__ = ["HFCodec", "copy_model_files", "end_of_turn_ids", "load_tokenizer", "pad_token_id"]

_MODEL_FILES = (
    "tokenizer",
    "special_tokens",
    "vocab",
    "merges",
    "added_tokens",
    "chat_template",
    "generation_config",
)


def copy_model_files(src: str | Path, dst: str | Path) -> None:
    """Copy what a checkpoint needs besides weights and ``config.json`` from the model directory
    ``src``: tokenizer files, chat template and ``generation_config.json`` (end-of-turn ids,
    preferred sampling), so ``dst`` loads and generates as the model it was trained from."""
    for f in Path(src).iterdir():
        if f.is_file() and f.name.startswith(_MODEL_FILES):
            shutil.copy(f, Path(dst) / f.name)


def load_tokenizer(path: str | Path) -> Any:
    """Load a tokenizer directory with ``transformers`` (any HF tokenizer works): the class
    ``AutoTokenizer`` picks, taken directly where that is the tokenizers library's backend
    (:func:`_declared_backend`)."""
    if _declared_backend(Path(path)):
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _declared_backend(path: Path) -> bool:
    """Whether ``AutoTokenizer`` would load ``path`` as ``TokenizersBackend`` because its
    ``tokenizer_config.json`` declares that class (or its alias ``PreTrainedTokenizerFast``) with
    no code of its own, and its model type is not one ``transformers`` lists as declaring the
    wrong class. ``AutoTokenizer`` learns the model type by importing the model's config class,
    which imports much of ``transformers`` (2.5 s of a 2.8 s load of SmolLM2's tokenizer, against
    0.3 s for the class itself); here it is read from ``config.json``."""
    try:
        declared = json.loads((path / "tokenizer_config.json").read_text())
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
        from transformers.models.auto.tokenization_auto import (
            MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
            TOKENIZER_MAPPING_NAMES,
        )
    except (OSError, ValueError, ImportError):  # missing or unreadable: AutoTokenizer says what is wrong
        return False
    return (
        declared.get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast")
        and "auto_map" not in declared
        and isinstance(model_type, str)
        and model_type not in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
        and TOKENIZER_MAPPING_NAMES.get(model_type) != "MistralCommonBackend"
    )


class HFCodec:
    """A Hugging Face tokenizer as an AgentFlow ``TextCodec`` (no special tokens added)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.special_tokens = special_token_texts(tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_literal(self, text: str) -> list[int]:
        """``text`` with control-token texts tokenized as plain characters."""
        return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def special_token_texts(tokenizer: Any) -> tuple[str, ...]:
    """The texts of a Hugging Face tokenizer's control tokens: its added tokens marked special
    (``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>`` for Qwen) and its named special tokens."""
    added = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    return tuple(dict.fromkeys([*added, *tokenizer.all_special_tokens]))


def end_of_turn_ids(tokenizer: Any, model_path: str | Path) -> list[int]:
    """The token ids that end a model turn: ``eos_token_id`` of the model's
    ``generation_config.json`` (an id or a list) when it has one, else the tokenizer's eos token."""
    config = Path(model_path) / "generation_config.json"
    if config.exists():
        eos = json.loads(config.read_text()).get("eos_token_id")
        if eos is not None:
            return list(eos) if isinstance(eos, list) else [int(eos)]
    if tokenizer.eos_token_id is None:
        raise ValueError(f"{model_path}: neither generation_config.json nor the tokenizer names an eos token")
    return [tokenizer.eos_token_id]


def pad_token_id(tokenizer: Any) -> int:
    """The id that pads batched prompts: the tokenizer's pad token, else its eos token (GPT-2 and
    Llama tokenizers have no pad token), else 0. Padding is masked, so any valid id serves."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0
