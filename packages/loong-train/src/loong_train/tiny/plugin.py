"""The tiny world as a plugin (:mod:`loong_train.plugins`): it builds the tiny model a recipe
without ``[model] path`` trains, and the tiny OPD recipe's teachers. Registered through
loong-train's own entry point (``loong_train.plugins``: ``tiny``)."""

from __future__ import annotations

from pathlib import Path

from loong_train import plugins
from loong_train.config import Recipe
from loong_train.tiny.teachers import prepare_teachers, teacher_success
from loong_train.tiny.warmstart import build_tiny, prepare_model, warm_start

__all__ = ["TinyModels", "TinyTeachers", "register"]


class TinyModels:
    """A random-init tiny model with a tokenizer built locally, warm-started, cached by recipe."""

    def prepare(self, recipe: Recipe, cache_dir: Path) -> Path:
        return prepare_model(recipe, cache_dir)

    def build(self, recipe: Recipe, out: Path) -> str:
        build_tiny(out, recipe)
        return str(warm_start(out, recipe)) if recipe.warmstart.steps else "built (no warm start)"


class TinyTeachers:
    """Each ``[[opd.build]]`` teacher: the student's warm start trained on one domain."""

    def prepare(self, recipe: Recipe, cache_dir: Path, student: Path) -> Recipe:
        return prepare_teachers(recipe, cache_dir, student)

    def held_out_success(self, recipe: Recipe) -> dict[str, dict[str, float]]:
        return teacher_success(recipe)


def register() -> None:
    plugins.register_models(TinyModels())
    plugins.register_teachers(TinyTeachers())
