"""Which implementation runs a checkpoint: Loong's fast decoder family, or ``transformers`` itself.

:func:`choose` reads ``config.json`` and answers with the path and the reason, which the
controller logs at start:

- ``fast``: ``model_type`` is one of the families :mod:`loong_train.models.decoder` implements
  (Qwen3, Qwen2/2.5, Llama, Mistral) and its config holds nothing that family's implementation
  leaves out;
- ``generic``: any other causal LM ``transformers`` ships, or a fast family with a feature the fast
  implementation does not have (sliding-window attention, another rope scaling):
  :class:`~loong_train.models.generic.HFCausalLM`, slower, never refused for speed;
- a model whose attention does not span the whole context (sliding-window or linear-attention
  layers) is refused by both;
- a checkpoint that needs its own code (``auto_map``) runs only with ``[model] trust_remote_code
  = true``; without it the error names that setting.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from loong_train.models.decoder import ARCHITECTURES, CausalLM, DecoderConfig

__all__ = ["ModelChoice", "choose", "load_causal_lm", "skeleton"]

log = logging.getLogger("loong.models")


@dataclass(frozen=True)
class ModelChoice:
    path: Literal["fast", "generic"]
    reason: str


def choose(config: dict, trust_remote_code: bool = False) -> ModelChoice:
    """The implementation for a checkpoint whose ``config.json`` is ``config``; raises ValueError
    for a model nothing here can run."""
    kind = config.get("model_type")
    if local := _local_attention(config):
        raise ValueError(
            f"model_type {kind!r} has {local}: neither Loong's decoder nor its generic path implements "
            "attention that is not over the whole context (a full-length cache would change what the "
            "model attends to)"
        )
    if kind in ARCHITECTURES:
        try:
            DecoderConfig.from_hf(config)
        except ValueError as e:
            return ModelChoice(
                "generic",
                f"model_type {kind!r} with a feature Loong's decoder lacks ({e}): transformers' implementation",
            )
        return ModelChoice("fast", f"model_type {kind!r}: Loong's decoder family")
    if "auto_map" in config:
        if not trust_remote_code:
            raise ValueError(
                f"model_type {kind!r} needs the checkpoint's own code (auto_map {sorted(config['auto_map'])}); "
                "set [model] trust_remote_code = true to run it (it executes Python files from the checkpoint)"
            )
        return ModelChoice("generic", f"model_type {kind!r}: the checkpoint's own code (trust_remote_code)")
    from transformers import CONFIG_MAPPING

    if kind not in CONFIG_MAPPING:
        raise ValueError(
            f"model_type {kind!r} is neither one of Loong's decoder families ({', '.join(ARCHITECTURES)}) "
            "nor a model transformers knows"
        )
    return ModelChoice(
        "generic", f"model_type {kind!r} is not one of Loong's decoder families: transformers' implementation"
    )


def _local_attention(config: dict) -> str:
    """What in ``config`` limits attention to less than the whole context ('' if nothing)."""
    if other := sorted({t for t in config.get("layer_types") or [] if t != "full_attention"}):
        return f"layer_types {other}"
    window = config.get("sliding_window")
    used = config.get("use_sliding_window", True)
    if window is not None and used and window < config.get("max_position_embeddings", window + 1):
        return f"sliding_window = {window} < max_position_embeddings"
    return ""


def load_causal_lm(path: str | Path, trust_remote_code: bool = False) -> CausalLM:
    """The checkpoint at ``path`` as the implementation :func:`choose` picks (the generic one has
    the same interface)."""
    import json

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    choice = choose(json.loads((path / "config.json").read_text()), trust_remote_code)
    log.info("%s: %s path, %s", path, choice.path, choice.reason)
    if choice.path == "fast":
        return CausalLM.from_pretrained(path)
    from loong_train.models.generic import HFCausalLM

    return HFCausalLM.from_pretrained(path, trust_remote_code)  # type: ignore[return-value]


def skeleton(path: str | Path, trust_remote_code: bool = False) -> torch.nn.Module:
    """The checkpoint's model without weights (on the ``meta`` device): its modules, their names
    and shapes, in no time and no memory. The implementation is the one :func:`choose` picks."""
    import json

    config = json.loads((Path(path) / "config.json").read_text())
    with torch.device("meta"):
        if choose(config, trust_remote_code).path == "fast":
            return CausalLM(DecoderConfig.from_hf(config))
        from transformers import AutoConfig, AutoModelForCausalLM

        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        return AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
