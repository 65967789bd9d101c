"""``task = "data"``: prompts from the user's data files, scored by the user's reward function.

The ``[data]`` table names the files and which keys of a row hold what; the ``[reward]`` table
names the function (:mod:`loong_train.tasks.reward`). A row is a JSON object (a line of a
``.jsonl`` file, or an element of a ``.json`` file's top-level list) or a row of a ``.parquet``
file (verl's data format, read with ``pyarrow``: the ``loong-train[parquet]`` extra; nested
columns become lists and dicts, so verl's rows are taken as they are):

- ``prompt_key`` (default ``"prompt"``): a string (one user message) or a list of chat messages
  ``{"role", "content"}`` (verl's and TRL's conversational rows); ``system_prompt`` is prepended
  to rows that have no system message;
- ``answer_key`` (default ``"answer"``; dotted for nested keys, e.g. verl's
  ``"reward_model.ground_truth"``): the reference answer the reward function receives;
- ``metadata_key`` (default ``"metadata"``): anything else it receives; ``tags_key``: a
  ``{str: str}`` dict routing the row (``domain``: its curve in evaluation, its teacher in OPD).

A Hugging Face dataset instead of files: ``dataset`` names it (a hub name, found in the local
cache when offline, with ``dataset_config`` for its configuration; or a directory written by
``save_to_disk`` or holding data files), read with ``datasets`` (the ``loong-train[datasets]``
extra); ``train_split`` holds the training rows and ``eval_split``, when set, the held-out ones.

Files too large for memory stream with ``shuffle_buffer = N`` (``.jsonl`` and ``.parquet``):
training reads the files in order on each pass and draws rows at random from a buffer of ``N``
(seeded, so a resumed run, which skips the rows already drawn, continues where it stopped); rows
are checked as they are read (the first row of each file when the task is built). Held out are
the ``eval_files``, or else the rows a seeded hash of their id puts in ``eval_fraction``.

Held-out rows: the ``eval_files`` (or ``eval_split``), or else ``eval_fraction`` of ``train_files`` chosen with
``split_seed`` (disjoint from training by row, never by content). Training draws rows in a seeded
order, reshuffled each pass over the data. Every file is read and checked when the task is built
(in the controller's preflight, before any work): a missing or empty file, a row that is not an
object, lacks the prompt key or whose prompt is neither text nor messages is an error naming the
file and line. Relative paths are taken from the directory ``loong-train run`` starts in.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec

from loong_agentflow import ToolRegistry
from loong_core.config import ConfigError
from loong_train.tasks.base import AgentCommand, Item, answer_demonstration
from loong_train.tasks.reward import RewardConfig, RewardFn, load_reward

__all__ = ["DataConfig", "DataTask", "dataset_rows", "get_dotted", "read_rows"]


DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


class DataConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The ``[data]`` table (see the module docstring)."""

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


def hashed_out(rid: str, fraction: float, seed: int) -> bool:
    """Whether row ``rid`` is held out: a seeded hash of its id falls in the first ``fraction``."""
    digest = hashlib.blake2b(f"{seed}:{rid}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


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


def get_dotted(row: dict[str, Any], dotted: str) -> Any:
    """``row[a][b]`` for ``"a.b"``; None when any part is missing."""
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def split_held_out(items: list[Item], fraction: float, seed: int, what: str) -> tuple[list[Item], list[Item]]:
    """``(held_out, train)``: a seeded ``fraction`` of ``items`` (at least one) and the rest, in order."""
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    cut = max(1, round(len(items) * fraction))
    if cut >= len(items):
        raise ConfigError(
            f"{what} hold {len(items)} rows: too few to hold out {fraction:.0%} and train on the rest "
            "(add rows or give held-out ones)"
        )
    return [items[i] for i in order[:cut]], [items[i] for i in sorted(order[cut:])]


def shuffled_cycle(items: list[Item], seed: int, held_out: Sequence[Item]) -> Iterator[Item]:
    """``items`` without any of ``held_out`` (by id), endlessly, each pass in a seeded order."""
    banned = {item["id"] for item in held_out}
    rows = [item for item in items if item["id"] not in banned]
    rng = random.Random(seed)
    while True:
        order = list(range(len(rows)))
        rng.shuffle(order)
        yield from (rows[i] for i in order)


class RowsTask:
    """What a task over a list of items shares: ``self.train`` and ``self.eval`` (held out), an
    endless seeded stream of the training items, no tools, no agent program of its own."""

    train: list[Item]
    eval: list[Item]

    def held_out(self, n: int) -> list[Item]:
        return self.eval[:n]

    def train_stream(self, seed: int, held_out: Sequence[Item]) -> Iterator[Item]:
        return shuffled_cycle(self.train, seed, held_out)

    def tools(self) -> ToolRegistry:
        return ToolRegistry([])

    def agent_command(self) -> AgentCommand | None:
        return None


class DataTask(RowsTask):
    """A :class:`~loong_train.tasks.Task` over the user's rows and reward function (no tools)."""

    def __init__(
        self,
        data: DataConfig,
        reward: RewardConfig,
        *,
        rows: Sequence[Any] | None = None,
        eval_rows: Sequence[Any] | None = None,
        reward_fn: Callable[..., Any] | None = None,
    ) -> None:
        """``rows`` / ``eval_rows`` (ids ``rows:<i>``, ``eval_rows:<i>``) stand for the files and
        ``reward_fn`` for ``reward.fn`` when the task is made in code (:mod:`loong_train.api`)."""
        if rows is None and not data.train_files and not data.dataset:
            raise ConfigError(
                "this task needs data.train_files (a list of .jsonl, .json or .parquet files) or "
                f"data.dataset (a Hugging Face dataset), got train_files = {data.train_files}"
            )
        self.config, self.group = data, reward.group
        self.reward_fn = load_reward(reward, Path.cwd(), fn=reward_fn)
        self.streamed = bool(data.shuffle_buffer) and rows is None
        if self.streamed:
            self._start_stream(eval_rows)
            return
        if rows is not None:
            train = [self._item(rid, row) for rid, row in _listed(rows, "rows")]
        elif data.dataset:
            train = [self._item(rid, row) for rid, row in dataset_rows(data, data.train_split)]
        else:
            train = [self._item(rid, row) for f in data.train_files for rid, row in read_rows(Path(f))]
        if eval_rows is not None:
            held = [self._item(rid, row) for rid, row in _listed(eval_rows, "eval_rows")]
        elif data.eval_files:
            held = [self._item(rid, row) for f in data.eval_files for rid, row in read_rows(Path(f))]
        elif data.eval_split:
            held = [self._item(rid, row) for rid, row in dataset_rows(data, data.eval_split)]
        else:
            held, train = split_held_out(train, data.eval_fraction, data.split_seed, "data.train_files")
        self.train, self.eval = train, held
        self.reward_fn.check(train[0])

    # -- streamed files (shuffle_buffer) ----------------------------------------------------

    def _start_stream(self, eval_rows: Sequence[Any] | None) -> None:
        """Check the first row of every file; held-out rows are read now only from eval files."""
        data = self.config
        for f in data.train_files:
            first = next(iter_rows(Path(f)), None)
            if first is None:
                raise ConfigError(f"data file {f} has no rows")
            self._item(*first)
        self.train = []  # never in memory: train_stream reads the files
        self._hashed = eval_rows is None and not data.eval_files
        if eval_rows is not None:
            self.eval = [self._item(rid, row) for rid, row in _listed(eval_rows, "eval_rows")]
        elif data.eval_files:
            self.eval = [self._item(rid, row) for f in data.eval_files for rid, row in read_rows(Path(f))]
        else:
            self.eval = []  # the hashed-out rows, read as far as held_out needs
        self.reward_fn.check(self._item(*next(iter_rows(Path(data.train_files[0])))))

    def _file_rows(self) -> Iterator[tuple[str, dict[str, Any]]]:
        return itertools.chain.from_iterable(iter_rows(Path(f)) for f in self.config.train_files)

    def _is_held(self, rid: str) -> bool:
        return self._hashed and hashed_out(rid, self.config.eval_fraction, self.config.split_seed)

    def held_out(self, n: int) -> list[Item]:
        if self.streamed and self._hashed and len(self.eval) < n:
            held = (self._item(rid, row) for rid, row in self._file_rows() if self._is_held(rid))
            self.eval = list(itertools.islice(held, n))
            if not self.eval:
                raise ConfigError(
                    f"data.train_files hold no row in the held-out fraction {self.config.eval_fraction}: "
                    "give data.eval_files or raise eval_fraction"
                )
        return self.eval[:n]

    def train_stream(self, seed: int, held_out: Sequence[Item]) -> Iterator[Item]:
        if not self.streamed:
            return super().train_stream(seed, held_out)
        return self._buffered(seed, {item["id"] for item in held_out})

    def _buffered(self, seed: int, banned: set[str]) -> Iterator[Item]:
        """Endless passes over the files; each row leaves through a seeded ``shuffle_buffer``."""
        rng, size = random.Random(seed), self.config.shuffle_buffer
        while True:
            buffer: list[Item] = []
            for rid, row in self._file_rows():
                if rid in banned or self._is_held(rid):
                    continue
                item = self._item(rid, row)
                if len(buffer) < size:
                    buffer.append(item)
                    continue
                k = rng.randrange(size)
                yield buffer[k]
                buffer[k] = item
            if not buffer:
                raise ConfigError("data.train_files hold no training rows (every row is held out)")
            rng.shuffle(buffer)
            yield from buffer

    def _item(self, rid: str, row: Any) -> Item:
        c = self.config
        if not isinstance(row, dict):
            raise ConfigError(f"{rid}: a row must be a JSON object, got {type(row).__name__}")
        if c.prompt_key not in row:
            raise ConfigError(f"{rid}: the row has no prompt key {c.prompt_key!r} (keys: {', '.join(row)})")
        messages = _messages(rid, row[c.prompt_key], c.prompt_key)
        if c.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": c.system_prompt}, *messages]
        tags = row.get(c.tags_key) or {}
        if not isinstance(tags, dict) or not all(isinstance(v, str) for v in tags.values()):
            raise ConfigError(f"{rid}: {c.tags_key!r} must be an object of strings, got {tags!r}")
        item: Item = {"id": rid, "messages": messages, "answer": get_dotted(row, c.answer_key), "row": row}
        item["metadata"] = row.get(c.metadata_key, {})
        if tags:
            item["tags"] = tags
        return item

    @property
    def group_reward(self) -> RewardFn | None:
        """The function that scores whole groups (``reward.group``), or None: ``reward`` scores."""
        return self.reward_fn if self.group else None

    def reward(self, item: Item, answer: str) -> float:
        if self.group:
            return 0.0  # scored with its group once the rollout call ends (tasks.reward.score_groups)
        return self.reward_fn.score(item, answer)

    def demonstration(self, item: Item) -> list[tuple[str, bool]]:
        """The row's reference answer as the final turn (rows without one cannot be demonstrated)."""
        if item["answer"] is None:
            raise ConfigError(
                f"{item['id']}: no answer at data.answer_key {self.config.answer_key!r} to warm-start on"
            )
        return answer_demonstration(item, str(item["answer"]))


def _listed(rows: Sequence[Any], what: str) -> list[tuple[str, Any]]:
    if not rows:
        raise ConfigError(f"{what} is empty: a task needs at least one row")
    return [(f"{what}:{i}", row) for i, row in enumerate(rows)]


def _messages(rid: str, prompt: Any, key: str) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    ok = (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt
        )
    )
    if not ok:
        raise ConfigError(
            f"{rid}: {key!r} must be a string or a list of {{'role', 'content'}} messages, got {prompt!r:.80}"
        )
    return [{"role": m["role"], "content": m["content"]} for m in prompt]
