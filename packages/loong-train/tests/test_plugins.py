"""Plugins (loong_train.plugins): the tiny world is found through its entry point, and a builder
registered from user code takes over."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loong_train import plugins


def test_the_tiny_world_is_an_installed_plugin_that_nothing_imports():
    code = (
        "import sys\n"
        "import loong_train.controller, loong_train.cli, loong_train.api, loong_train.run.writer\n"
        "assert not any(m.startswith('loong_train.tiny') for m in sys.modules), 'imported early'\n"
        "from loong_train import plugins\n"
        "print(type(plugins.model_builder()).__name__, type(plugins.teacher_builder()).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["TinyModels", "TinyTeachers"]


def test_a_model_builder_registered_in_code_is_the_one_used(monkeypatch, tmp_path):
    class Fixed:
        def prepare(self, recipe, cache_dir: Path) -> Path:
            return cache_dir / f"built-for-{recipe.name}"

        def build(self, recipe, out: Path) -> str:
            return f"built {recipe.name} into {out}"

    monkeypatch.setattr(plugins, "_models", list(plugins._models))  # the registry is restored after
    monkeypatch.setattr(plugins, "_loaded", plugins._loaded)
    plugins.register_models(Fixed())
    from loong_train.config import load_recipe
    from loong_train.controller import _prepare_model

    recipe = load_recipe("tiny-calc-agent")
    assert _prepare_model(recipe, tmp_path) == tmp_path / "built-for-tiny-calc-agent"


def test_without_a_builder_the_error_says_what_to_set(monkeypatch):
    monkeypatch.setattr(plugins, "_models", [])
    monkeypatch.setattr(plugins, "_loaded", True)
    with pytest.raises(LookupError, match=r"no model builder is installed .*: set \[model\] path"):
        plugins.model_builder()
