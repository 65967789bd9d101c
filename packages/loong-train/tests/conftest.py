"""Shared fixtures: one tiny model + tokenizer directory per session, a shared warm-start cache,
a tiny Qwen3 checkpoint per module (the server tests'), the rows of the data-task tests.

The test kits (``train_testkit``, ...) import by name through the root ``pyproject.toml``'s
``pythonpath``. Ray workers do not get it (Ray adds only the driver's working directory to their
path), so nothing a test sends them may need a test kit."""

from __future__ import annotations

import os
from pathlib import Path

from loong_train.ray_env import prepare_local_ray

prepare_local_ray()  # as loong-train run does, before anything imports Ray
# every ray.init without an address starts a cluster of its own, here and in the runs' subprocesses,
# never joining one another test started (test_many_nodes' Cluster is found by its address file)
os.environ.setdefault("RAY_ADDRESS", "local")

import pytest  # noqa: E402
import torch  # noqa: E402
from train_testkit import DATA_ROWS, tiny_qwen3, write_jsonl  # noqa: E402

from loong_train.config import load_recipe  # noqa: E402
from loong_train.tiny.warmstart import build_tiny  # noqa: E402


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


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory):
    """The same tiny model with ``[model] tokenizer = "bpe"``: a byte-level BPE trained on the calc
    task's text."""
    return build_tiny(
        tmp_path_factory.mktemp("tiny-bpe"), load_recipe("tiny-calc-agent", ['model.tokenizer="bpe"'])
    )


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    """A model cache shared by the slow runs of the shipped recipe: the first warm-starts into it.
    ``LOONG_TEST_CACHE=DIR`` keeps it across sessions (to rerun slow tests while developing)."""
    if path := os.environ.get("LOONG_TEST_CACHE"):
        return Path(path)
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """``train_testkit.tiny_qwen3(0)`` in Hugging Face layout (no tokenizer: token ids in and out)."""
    path = tmp_path_factory.mktemp("tiny-qwen3")
    tiny_qwen3(0).save_pretrained(path)
    return path


@pytest.fixture
def data(tmp_path):
    """``data.jsonl`` holding ``train_testkit.DATA_ROWS``, for a ``task = "data"`` test."""
    return write_jsonl(tmp_path / "data.jsonl", DATA_ROWS)
