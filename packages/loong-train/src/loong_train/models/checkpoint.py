"""What a Hugging Face checkpoint directory must hold for Loong to run it, checked before any work.

:func:`check_checkpoint` reads ``config.json``, the weight index and the tokenizer, never the
weights. The controller runs it before Ray starts, so a directory the workers could not load fails
in a second. The error names the file or the setting: a directory without ``config.json``, a
family Loong does not implement (and a model that needs its own remote code, which Loong never
runs), weights that are missing or a shard the index lists but the directory lacks, and a
tokenizer with more tokens than the model has embeddings.
"""

from __future__ import annotations

import json
from pathlib import Path

from loong_core.config import ConfigError
from loong_train.models.decoder import ARCHITECTURES, DecoderConfig, weight_files

__all__ = ["check_checkpoint"]


def check_checkpoint(path: str | Path) -> DecoderConfig:
    """The checkpoint's decoder config; raises ConfigError naming what would stop a worker."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"model.path {path}: no config.json (expected a Hugging Face checkpoint directory)")
    try:
        data = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{config_file}: not valid JSON ({e})") from e
    kind = data.get("model_type")
    if kind not in ARCHITECTURES and "auto_map" in data:
        raise ConfigError(
            f"{config_file}: model_type {kind!r} needs the checkpoint's own code (auto_map "
            f"{sorted(data['auto_map'])}); Loong runs the decoder families it implements "
            f"({', '.join(ARCHITECTURES)}) and never runs a checkpoint's remote code"
        )
    try:
        config = DecoderConfig.from_hf(data)
        weight_files(path)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{config_file}: {e}") from e
    from loong_train.models.tokenizer import load_tokenizer

    try:
        tokens = len(load_tokenizer(path))
    except Exception as e:  # transformers' own message names the missing or broken file
        raise ConfigError(f"model.path {path}: the tokenizer does not load ({type(e).__name__}: {e})") from e
    if tokens > config.vocab_size:
        raise ConfigError(
            f"model.path {path}: the tokenizer has {tokens} tokens but config.json's vocab_size is "
            f"{config.vocab_size}: ids from {config.vocab_size} on would have no embedding"
        )
    return config
