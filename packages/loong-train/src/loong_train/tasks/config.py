"""The recipe tables of the shipped tasks: ``[data]``, ``[reward]``, ``[environment]``,
``[reasoning_gym]`` and ``[verifiers]``, as msgspec Structs validated when a recipe loads.

Each table's keys are documented with its task (:mod:`loong_train.tasks.data`,
:mod:`~loong_train.tasks.reward`, :mod:`~loong_train.tasks.env`,
:mod:`~loong_train.tasks.reasoning_gym`, :mod:`~loong_train.tasks.verifiers`). Pure msgspec:
importing this module reads no data file and imports no torch, so a recipe validates without
loading a task.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = [
    "DATA_SUFFIXES",
    "DataConfig",
    "EnvConfig",
    "ReasoningGymConfig",
    "RewardConfig",
    "VerifiersConfig",
    "get_dotted",
]

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


class DataConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The ``[data]`` table (:mod:`loong_train.tasks.data`)."""

    train_files: list[str] = []
    eval_files: list[str] = []
    eval_fraction: float = 0.1
    split_seed: int = 0
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    metadata_key: str = "metadata"
    tags_key: str = "tags"
    system_prompt: str = ""
    dataset: str = ""
    dataset_config: str = ""
    train_split: str = "train"
    eval_split: str = ""
    shuffle_buffer: int = 0

    def __post_init__(self) -> None:
        if self.shuffle_buffer < 0:
            raise ValueError(
                f"shuffle_buffer must be >= 0 (0: read every row into memory), got {self.shuffle_buffer}"
            )
        if self.shuffle_buffer and (self.dataset or any(f.endswith(".json") for f in self.train_files)):
            what = "data.dataset" if self.dataset else "a .json file (one JSON list, read whole)"
            raise ValueError(f"shuffle_buffer streams .jsonl and .parquet train_files, not {what}")
        if self.dataset and (self.train_files or self.eval_files):
            raise ValueError(
                f"data.dataset ({self.dataset!r}) and data.train_files / eval_files are two sources of "
                "rows: set one (a dataset's held-out rows come from eval_split)"
            )
        if self.eval_split and not self.dataset:
            raise ValueError(
                f"data.eval_split = {self.eval_split!r} names a split of data.dataset, which is unset"
            )
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        for name in ("train_files", "eval_files"):
            if bad := [f for f in getattr(self, name) if not f.endswith(DATA_SUFFIXES)]:
                raise ValueError(f"{name}: {bad} are not {', '.join(DATA_SUFFIXES)} files")


def get_dotted(row: dict[str, Any], dotted: str) -> Any:
    """``row[a][b]`` for ``"a.b"``; None when any part is missing."""
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


class RewardConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``fn``: ``"pkg.module:name"`` or ``"file.py:name"`` (empty: exact match on the answer);
    ``style``: how it is called (``loong``, ``verl``, ``trl``); ``timeout_s``: how long one call may run.
    ``url``, ``api_key_env``, ``retries``: a reward service instead (:mod:`loong_train.tasks.reward`)."""

    fn: str = ""
    style: Literal["loong", "verl", "trl"] = "loong"
    timeout_s: float = 30.0
    url: str = ""
    api_key_env: str = ""
    retries: int = 2
    group: bool = False
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.fn and (self.fn.count(":") < 1 or not all(self.fn.rsplit(":", 1))):
            raise ValueError(f"fn must be 'pkg.module:name' or 'path/to/file.py:name', got {self.fn!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.url and self.fn:
            raise ValueError(f"set fn ({self.fn!r}) or url ({self.url!r}), not both: one source of reward")
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        if self.url and self.style != "loong":
            raise ValueError(f"style {self.style!r} is for functions; a url gets every parameter as JSON")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if self.overlong_buffer < 0 or self.overlong_penalty < 0:
            raise ValueError(
                f"overlong_buffer ({self.overlong_buffer}) and overlong_penalty ({self.overlong_penalty}) "
                "must be >= 0 (0 tokens: no overlong shaping)"
            )
        if self.group and (self.url or self.style == "verl"):
            what = "a url" if self.url else "style 'verl' (one sample per call)"
            raise ValueError(
                f"group = true calls a function once per group with lists; {what} cannot take that"
            )
        if self.group and not self.fn:
            raise ValueError(
                "group = true calls a function once per group: set fn (exact match scores one episode)"
            )


class EnvConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The ``[environment]`` table (:mod:`loong_train.tasks.env`)."""

    cls: str = ""
    kwargs: dict[str, Any] = {}
    api: Literal["loong", "gym", "skyrl"] = "loong"
    system: str = ""
    demonstration_key: str = "demonstration"


class ReasoningGymConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The ``[reasoning_gym]`` table (:mod:`loong_train.tasks.reasoning_gym`)."""

    datasets: dict[str, float] = {}
    config: dict[str, dict[str, Any]] = {}
    seed: int = 0
    eval_size: int = 128
    train_size: int = 10_000
    answer_format: Literal["tags", "plain"] = "tags"
    scoring: Literal["strict", "dataset"] = "strict"
    system_prompt: str = ""

    def __post_init__(self) -> None:
        if self.eval_size < 1 or self.train_size < 1:
            raise ValueError("eval_size and train_size must be >= 1")
        if bad := {k: w for k, w in self.datasets.items() if not w > 0}:
            raise ValueError(f"dataset weights must be > 0, got {bad}")


class VerifiersConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The ``[verifiers]`` table (:mod:`loong_train.tasks.verifiers`)."""

    taskset: str = ""
    config: dict[str, Any] = {}
    eval_fraction: float = 0.1
    split_seed: int = 0
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
