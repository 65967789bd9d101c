"""What a Hugging Face checkpoint directory must hold for Loong to run it, checked before any work.

:func:`check_checkpoint` reads ``config.json``, the weight index and the tokenizer, never the
weights. The controller runs it before Ray starts, so a directory the workers could not load fails
in a second. The error names the file or the setting: a directory without ``config.json``, a
model neither Loong's decoder families nor ``transformers`` know, a model that needs its own
code without ``[model] trust_remote_code``, weights that are missing or a shard the index lists
but the directory lacks, and a tokenizer with more tokens than the model has embeddings. It logs
which implementation will run the model and why (:func:`loong_train.models.auto.choose`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from loong_core.config import ConfigError
from loong_train.models.auto import ModelChoice, choose
from loong_train.models.decoder import weight_files

__all__ = ["check_checkpoint"]

log = logging.getLogger("loong.models")


def check_checkpoint(path: str | Path, trust_remote_code: bool = False) -> ModelChoice:
    """Which implementation runs the checkpoint; raises ConfigError naming what would stop a worker."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"model.path {path}: no config.json (expected a Hugging Face checkpoint directory)")
    try:
        data = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{config_file}: not valid JSON ({e})") from e
    try:
        choice = choose(data, trust_remote_code)
        weight_files(path)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{config_file}: {e}") from e
    from loong_train.models.tokenizer import load_tokenizer

    try:
        tokens = len(load_tokenizer(path))
    except Exception as e:  # transformers' own message names the missing or broken file
        raise ConfigError(f"model.path {path}: the tokenizer does not load ({type(e).__name__}: {e})") from e
    vocab = data.get("vocab_size")
    if isinstance(vocab, int) and tokens > vocab:
        raise ConfigError(
            f"model.path {path}: the tokenizer has {tokens} tokens but config.json's vocab_size is "
            f"{vocab}: ids from {vocab} on would have no embedding"
        )
    log.info("model %s: the %s path (%s)", path, choice.path, choice.reason)
    return choice
