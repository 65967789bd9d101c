"""The rows of ``task = "data"`` (:mod:`loong_train.tasks.data`), each with its id.

From files: a ``.jsonl`` file (a JSON object per line), a ``.json`` file (a top-level list) or a
``.parquet`` file (read with ``pyarrow``, the ``loong-train[parquet]`` extra), read whole
(:func:`read_rows`) or one row at a time (:func:`iter_rows`, for ``shuffle_buffer``); from a
Hugging Face dataset (:func:`dataset_rows`, the ``loong-train[datasets]`` extra). A missing or
empty source, or a line that is not JSON, is a ConfigError naming the file and line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loong_core.config import ConfigError
from loong_train.tasks.config import DataConfig

__all__ = ["dataset_rows", "iter_rows", "read_rows"]


def read_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """The rows of a ``.jsonl``, ``.json`` or ``.parquet`` file, each with its id
    ``"<file name>:<line or index>"`` (lines count from 1, list and table rows from 0)."""
    if not path.is_file():
        raise ConfigError(f"data file {path} does not exist")
    if path.suffix == ".parquet":
        out = [(f"{path.name}:{i}", row) for i, row in enumerate(_parquet_rows(path))]
        if not out:
            raise ConfigError(f"data file {path} has no rows")
        return out
    text = path.read_text()
    if path.suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(rows, list):
            raise ConfigError(f"{path}: expected a top-level list of rows, got {type(rows).__name__}")
        out = [(f"{path.name}:{i}", row) for i, row in enumerate(rows)]
    else:
        out = []
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                out.append((f"{path.name}:{n}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}, line {n}: not valid JSON ({e})") from e
    if not out:
        raise ConfigError(f"data file {path} has no rows")
    return out


def iter_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """The rows of a ``.jsonl`` or ``.parquet`` file one at a time, with the ids :func:`read_rows` gives."""
    if not path.is_file():
        raise ConfigError(f"data file {path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        i = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                yield f"{path.name}:{i}", row
                i += 1
        return
    with path.open() as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path.name}:{n}", json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}, line {n}: not valid JSON ({e})") from e


def dataset_rows(config: DataConfig, split: str) -> list[tuple[str, dict[str, Any]]]:
    """The rows of split ``split`` of ``config.dataset``, each with its id ``"<split>:<index>"``."""
    try:
        import datasets
    except ImportError as e:
        raise ConfigError(
            "data.dataset needs the datasets package: pip install 'loong-train[datasets]'"
        ) from e
    name, where = config.dataset, Path(config.dataset)
    saved = where.is_dir() and any((where / f).is_file() for f in ("dataset_dict.json", "dataset_info.json"))
    try:
        if saved:
            ds = datasets.load_from_disk(str(where))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ConfigError(f"data.dataset {name}: no split {split!r} (it has {', '.join(ds)})")
                ds = ds[split]
        else:
            ds = datasets.load_dataset(name, config.dataset_config or None, split=split)
    except ConfigError:
        raise
    except Exception as e:  # datasets raises many kinds: not found, offline, bad split, bad config
        raise ConfigError(
            f"data.dataset {name!r} (split {split!r}) does not load: {type(e).__name__}: {e} "
            "(offline, a hub dataset must already be in the local Hugging Face cache)"
        ) from e
    rows = [(f"{split}:{i}", dict(row)) for i, row in enumerate(ds)]
    if not rows:
        raise ConfigError(f"data.dataset {name!r}: split {split!r} has no rows")
    return rows


def _parquet_rows(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ConfigError(
            f"{path}: reading .parquet needs pyarrow: pip install 'loong-train[parquet]'"
        ) from e
    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow's errors for a file that is not parquet, or a damaged one
        raise ConfigError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from e
