"""Shared test helpers for loong-train: tiny random-init Qwen3 models built from a config.

``tiny_config()`` is the shape most engine and server tests use (2 layers, 4 query heads over 2
KV heads of width 8, hidden 32); keyword arguments change any field. ``tiny_qwen3(seed, std)``
builds and initialises one (``std`` larger than a trained model's, so logprobs are far from
uniform and a wrong computation shows)."""

from __future__ import annotations

from typing import Any

from loong_train.models.qwen3 import Qwen3Config, Qwen3ForCausalLM

__all__ = ["tiny_config", "tiny_qwen3"]

_SHAPE = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}


def tiny_config(**fields: Any) -> Qwen3Config:
    return Qwen3Config(**{**_SHAPE, **fields})


def tiny_qwen3(seed: int = 0, std: float = 0.3, **fields: Any) -> Qwen3ForCausalLM:
    model = Qwen3ForCausalLM(tiny_config(**fields))
    model.init_weights(seed, std=std)
    return model
