"""Shared fixtures: one tiny model + tokenizer directory built once per session."""

from __future__ import annotations

import pytest
import torch

from loong_train.config import load_recipe
from loong_train.warmstart import build_tiny


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def recipe():
    return load_recipe("tiny-calc-agent")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, recipe):
    """A random-init tiny Qwen3 checkpoint and char tokenizer (Hugging Face layout)."""
    return build_tiny(tmp_path_factory.mktemp("tiny"), recipe)
