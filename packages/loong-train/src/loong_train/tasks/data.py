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

The table is :class:`~loong_train.tasks.config.DataConfig`; files and datasets are read by
:mod:`loong_train.tasks.readers`.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from loong_agentflow import ToolRegistry
from loong_core.config import ConfigError
from loong_train.tasks.base import AgentCommand, Item, Task, answer_demonstration
from loong_train.tasks.config import DataConfig, RewardConfig, get_dotted
from loong_train.tasks.readers import dataset_rows, iter_rows, read_rows
from loong_train.tasks.reward import RewardFn, load_reward

__all__ = ["DataConfig", "DataTask", "dataset_rows", "get_dotted", "read_rows"]


def hashed_out(rid: str, fraction: float, seed: int) -> bool:
    """Whether row ``rid`` is held out: a seeded hash of its id falls in the first ``fraction``."""
    digest = hashlib.blake2b(f"{seed}:{rid}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


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


class RowsTask(Task):
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
