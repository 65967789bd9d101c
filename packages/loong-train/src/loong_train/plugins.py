"""What a plugin adds beyond the seams' import paths: the model a recipe without ``[model] path``
starts from, and the teachers its ``[[opd.build]]`` tables describe.

The tiny CPU world (:mod:`loong_train.tiny`) is such a plugin: it builds and warm-starts a tiny
model and trains the tiny OPD recipe's teachers. Nothing in loong-train imports it; it is found
like any other plugin, through the entry-point group ``loong_train.plugins`` (a package names a
function there, called once with no arguments, that calls :func:`register_models` and
:func:`register_teachers`), or by calling those functions from the user's own code.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from loong_train.config import Recipe

__all__ = [
    "ModelBuilder",
    "TeacherBuilder",
    "model_builder",
    "register_models",
    "register_teachers",
    "teacher_builder",
]

GROUP = "loong_train.plugins"


class ModelBuilder(Protocol):
    """Makes the policy of a recipe whose ``[model] path`` is empty."""

    def prepare(self, recipe: Recipe, cache_dir: Path) -> Path:
        """The checkpoint to train, built into ``cache_dir`` once and found there afterwards."""
        ...

    def build(self, recipe: Recipe, out: Path) -> str:
        """Build it into ``out`` (``loong-train build-tiny``); returns what was done, for the user."""
        ...


class TeacherBuilder(Protocol):
    """Makes the teachers of a recipe's ``[[opd.build]]`` tables."""

    def prepare(self, recipe: Recipe, cache_dir: Path, student: Path) -> Recipe:
        """The recipe with every built teacher's path set (built once into ``cache_dir``)."""
        ...

    def held_out_success(self, recipe: Recipe) -> dict[str, dict[str, float]]:
        """Each built teacher's held-out success per domain, by teacher name (for the summary)."""
        ...


_models: list[ModelBuilder] = []
_teachers: list[TeacherBuilder] = []
_loaded = False


def register_models(builder: ModelBuilder) -> None:
    """Use ``builder`` for recipes without ``[model] path`` (after the installed plugins: it wins)."""
    _load()
    _models.append(builder)


def register_teachers(builder: TeacherBuilder) -> None:
    """Use ``builder`` for ``[[opd.build]]`` teachers (after the installed plugins: it wins)."""
    _load()
    _teachers.append(builder)


def model_builder() -> ModelBuilder:
    """The registered model builder (the last one registered wins)."""
    _load()
    if not _models:
        raise LookupError(f"no model builder is installed (entry-point group {GROUP!r}): set [model] path")
    return _models[-1]


def teacher_builder() -> TeacherBuilder:
    """The registered teacher builder (the last one registered wins)."""
    _load()
    if not _teachers:
        raise LookupError(
            f"no teacher builder is installed (entry-point group {GROUP!r}): give each teacher a path"
        )
    return _teachers[-1]


def _load() -> None:
    """Call every installed plugin's registration function, once per process."""
    global _loaded
    if not _loaded:
        _loaded = True
        for entry in entry_points(group=GROUP):
            entry.load()()
