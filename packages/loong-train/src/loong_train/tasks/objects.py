"""Objects a recipe names by path: ``"pkg.module:name"`` or ``"path/to/file.py:name"``."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loong_core.config import ConfigError

__all__ = ["load_object"]


def load_object(spec: str, base: Path, key: str) -> Callable[..., Any]:
    """The callable ``spec`` names: ``"pkg.module:name"`` (imported) or ``"path/file.py:name"``
    (loaded from the file, relative to ``base``); a ConfigError naming the recipe ``key`` when it
    does not import or is not there."""
    where, name = spec.rsplit(":", 1)
    try:
        if where.endswith(".py"):
            path = Path(where) if Path(where).is_absolute() else base / where
            if not path.is_file():
                raise ConfigError(f"{key} {spec!r}: file {path} does not exist")
            module_spec = importlib.util.spec_from_file_location(f"loong_user_{path.stem}", path)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_spec.name] = module
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as e:  # the user's module failed to import: say where and why
        raise ConfigError(f"{key} {spec!r}: importing {where} failed ({type(e).__name__}: {e})") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"{key} {spec!r}: {where} has no function or class {name!r}")
    return fn
