"""Lazy package exports (PEP 562): a package's ``__init__`` names what it exports and where each
name lives, and a module is imported on first access to one of its names.

This keeps ``import loong_transfermesh.config`` (a msgspec Struct) from importing torch, which the
package's transports need: validating a recipe must not load torch. Usage in ``__init__.py``::

    __getattr__, __dir__ = lazy_exports(__name__, {"pkg.config": ["Config"], "pkg.heavy": ["Engine"]})
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, modules: dict[str, list[str]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``, whose public ``name`` is defined in the
    module that ``modules`` lists it under. An attribute that is no export raises AttributeError."""
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(where[name]), name)

    def __dir__() -> list[str]:
        return sorted(where)

    return __getattr__, __dir__
