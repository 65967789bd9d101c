"""The ``local`` teacher backend: a Hugging Face causal LM checkpoint run in this process, resident
only while the :class:`~loong_teacher.manager.TeacherManager` lets it be.

A checkpoint is a directory with ``config.json`` and ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``). The model is built once from its config with every parameter on
the ``meta`` device (no memory); buffers the model computes itself (rotary frequencies) stay real.
``build(config_dict) -> nn.Module`` makes the module; the default uses transformers
(``AutoModelForCausalLM.from_config``, the optional ``[hf]`` extra, imported only here and only then).
An injected ``build`` may return any module whose ``forward(input_ids=, attention_mask=)`` gives logits
(a tensor or an object with ``.logits``) and whose parameter names are the checkpoint's.

Residency, three ways, chosen at construction:

- Mapped (CPU, every tensor stored in ``dtype`` at an offset aligned to its element size: the usual
  case): paging in maps the safetensors files read-only with ``MAP_POPULATE`` and points every
  parameter at its bytes in the mapping. Nothing is copied: the kernel maps the page cache's pages
  (reading from disk only what is not cached), and paging out drops the mapping, so the process
  stops holding the pages while the page cache keeps recently used files fast to map again.
  ``nbytes`` is the files' size, what a mapped teacher holds.
- Copied (CPU, other dtypes): all parameters are views into one flat byte buffer ``[nbytes]`` (each
  tensor 64-byte aligned, cast to ``dtype``), filled from the memory-mapped files in 32 MiB chunks
  whose mapped pages are dropped at once (``MADV_DONTNEED``); paging out hands the buffer back (the
  manager reuses it for the next teacher, as a caching allocator would).
- GPU (``device = "cuda..."``; written for, not exercised by, the CPU test suite): the flat buffer on
  the device, from a pinned host copy made at construction with one asynchronous host-to-device copy.

Scoring runs micro-batches of rows sorted by length, right-padded, at most ``max_batch_tokens`` padded
tokens each, and keeps logits only at the positions that are scored (``logits_to_keep`` where the
model takes it); log-probabilities are ``log_softmax`` in float32 of the model's logits, taken 256
positions at a time.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import mmap
import struct
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loong_teacher.config import LocalTeacherConfig
from loong_teacher.teacher import RowScores

__all__ = ["LocalTeacher", "hf_causal_lm", "score_rows"]

_ALIGN = 64
_CHUNK = 32 << 20
_ROWS = 256  # positions log-softmaxed at a time
_PAGE = mmap.PAGESIZE
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
Build = Callable[[dict[str, Any]], nn.Module]


def hf_causal_lm(config: dict[str, Any]) -> nn.Module:
    """The default ``build``: a transformers causal LM from a ``config.json`` dict."""
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))


@dataclass(frozen=True)
class _Slot:
    """One parameter (with all its tied names) and where its bytes live, on disk and in the buffer."""

    names: tuple[str, ...]
    file: Path
    file_dtype: torch.dtype
    file_offset: int  # absolute byte offset in ``file``
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # byte offset in the flat buffer

    @property
    def numel(self) -> int:
        return _numel(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class LocalTeacher:
    """A checkpoint's model, offloaded until :meth:`page_in`; see the module docstring."""

    def __init__(self, config: LocalTeacherConfig, build: Build | None = None) -> None:
        self.config, self.name = config, config.name
        self.device = torch.device(config.device)
        root = Path(config.path)
        with _params_on_meta():
            self.model = (build or hf_causal_lm)(json.loads((root / "config.json").read_text())).eval()
        self._slots = _layout(self.model, _checkpoint(root), getattr(torch, config.dtype))
        self._files = sorted({s.file for s in self._slots})
        self.mapped = self.device.type == "cpu" and all(_mappable(s) for s in self._slots)
        if self.mapped:  # what a resident teacher holds: its files, mapped
            self.nbytes = sum(f.stat().st_size for f in self._files)
        else:
            self.nbytes = max((s.offset + s.nbytes for s in self._slots), default=0)
        for module in self.model.modules():
            for key, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[key] = buf.to(self.device)
        self._pinned: torch.Tensor | None = None
        if self.device.type == "cuda":  # GPU path: offloaded bytes live in pinned host memory
            self._pinned = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
            _copy_from_files(self._slots, self._pinned)
        self.storage: torch.Tensor | None = None  # the flat buffer (copied and GPU residency)
        self._maps: dict[Path, torch.Tensor] | None = None  # file -> its mapping (mapped residency)
        self._bind(lambda slot: None)

    @property
    def resident(self) -> bool:
        return self.storage is not None or self._maps is not None

    def page_in(self, storage: torch.Tensor | None = None) -> int:
        """Make the weights resident: mapped (``storage`` must be None), or in ``storage`` (a
        reused uint8 buffer of at least ``nbytes`` on this device) or a new buffer; returns the
        bytes made resident."""
        if self.mapped:
            assert storage is None, f"teacher {self.name!r} is mapped: it takes no buffer"
            self._maps = {file: _map(file) for file in self._files}
            self._bind(lambda slot: _view(self._maps[slot.file], slot.file_offset, slot))
            return self.nbytes
        flat = (
            storage
            if storage is not None
            else torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        )
        if self._pinned is not None:
            flat[: self.nbytes].copy_(self._pinned, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
        else:
            _copy_from_files(self._slots, flat)
        self.storage = flat
        self._bind(lambda slot: _view(flat, slot.offset, slot))
        return self.nbytes

    def page_out(self) -> torch.Tensor | None:
        """Drop the weights (parameters back on ``meta``); returns the buffer that held them, or
        None for a mapped teacher (its mappings go once nothing points into them)."""
        assert self.resident, f"teacher {self.name!r} is not resident"
        storage, self.storage, self._maps = self.storage, None, None
        self._bind(lambda slot: None)
        return storage

    def close(self) -> None:
        if self.resident:
            self.page_out()
        self._pinned = None

    def score(self, rows: Sequence[tuple[Sequence[int], Sequence[int]]], top_k: int = 0) -> list[RowScores]:
        """See :class:`loong_teacher.teacher.Teacher`; the teacher must be resident."""
        assert self.resident, f"teacher {self.name!r} scored while offloaded"
        return score_rows(self.model, rows, top_k, self.config.max_batch_tokens, self.device)

    def _bind(self, view: Callable[[_Slot], torch.Tensor | None]) -> None:
        """Point every parameter (tied names share one) at ``view(slot)``, or at ``meta`` where
        that is None."""
        for slot in self._slots:
            data = view(slot)
            if data is None:
                data = torch.empty(slot.shape, dtype=slot.dtype, device="meta")
            param = nn.Parameter(data, requires_grad=False)
            for name in slot.names:
                owner, _, leaf = name.rpartition(".")
                self.model.get_submodule(owner)._parameters[leaf] = param


@torch.inference_mode()
def score_rows(
    model: nn.Module,
    rows: Sequence[tuple[Sequence[int], Sequence[int]]],
    top_k: int,
    max_batch_tokens: int,
    device: torch.device,
) -> list[RowScores]:
    """Score ``rows`` with any causal LM ``model`` on ``device`` (the ``Teacher.score`` contract)."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
    out: list[RowScores | None] = [None] * len(rows)
    for chunk in _micro_batches(order, [len(r[0]) for r in rows], max_batch_tokens):
        for i, scores in zip(
            chunk, _score_batch(model, [rows[i] for i in chunk], top_k, device), strict=True
        ):
            out[i] = scores
    return out  # type: ignore[return-value]


def _score_batch(model: nn.Module, rows, top_k: int, device: torch.device) -> list[RowScores]:
    width = max(len(ids) for ids, _ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.long)
    for b, (row, _) in enumerate(rows):
        ids[b, : len(row)] = torch.as_tensor(row)
        attn[b, : len(row)] = 1
    b_idx = torch.cat([torch.full((len(p),), b) for b, (_, p) in enumerate(rows)])
    t_idx = torch.cat([torch.as_tensor(p, dtype=torch.long) for _, p in rows])
    logits = _logits_at(model, ids.to(device), attn.to(device), b_idx, t_idx - 1)
    target = ids[b_idx, t_idx]
    chunks = [
        _from_logits(logits[i : i + _ROWS], target[i : i + _ROWS], top_k)
        for i in range(0, max(len(target), 1), _ROWS)  # one (empty) chunk when nothing is scored
    ]
    scored = RowScores(
        *(None if f[0] is None else torch.cat(f) for f in zip(*map(_fields, chunks), strict=True))
    )
    sizes = [len(p) for _, p in rows]
    parts = [t.split(sizes) if t is not None else [None] * len(rows) for t in _fields(scored)]
    return [RowScores(*fields) for fields in zip(*parts, strict=True)]


def _from_logits(logits: torch.Tensor, target: torch.Tensor, top_k: int) -> RowScores:
    """Scores of ``target`` (and the top ``top_k``) under ``logits`` ``[n, vocab]``: float32
    log-softmax of at most ``_ROWS`` positions at a time, so the float32 copy of a large
    vocabulary's logits never exists for a whole batch."""
    logp = torch.log_softmax(logits.float(), dim=-1).cpu()
    scored = RowScores(logp.gather(-1, target[:, None]).squeeze(-1))
    if not top_k:
        return scored
    top_lp, top_ids = logp.topk(top_k, dim=-1)
    tail = logp.scatter(-1, top_ids, -torch.inf).logsumexp(-1)
    return RowScores(scored.logprobs, top_ids, top_lp, tail)


def _logits_at(model: nn.Module, ids, attn, b_idx, t_idx) -> torch.Tensor:
    """Logits predicting position ``t + 1`` from ``(b, t)`` for each pair: ``[n, vocab]``."""
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        out = model(input_ids=ids, attention_mask=attn)
        return getattr(out, "logits", out)[b_idx, t_idx]
    keep = torch.unique(t_idx)  # sorted
    where = torch.full((ids.shape[1],), -1, dtype=torch.long)
    where[keep] = torch.arange(len(keep))
    out = model(input_ids=ids, attention_mask=attn, logits_to_keep=keep.to(ids.device))
    return out.logits[b_idx, where[t_idx]]


def _fields(scores: RowScores) -> list[torch.Tensor | None]:
    return [scores.logprobs, scores.topk_ids, scores.topk_logprobs, scores.tail_logprobs]


def _micro_batches(order: list[int], lengths: list[int], max_tokens: int) -> Iterator[list[int]]:
    """Consecutive runs of ``order`` (by increasing length) with ``rows * longest <= max_tokens``."""
    chunk: list[int] = []
    for i in order:
        if chunk and (len(chunk) + 1) * lengths[i] > max_tokens:
            yield chunk
            chunk = []
        chunk.append(i)
    if chunk:
        yield chunk


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """While building, every registered parameter moves to ``meta`` (its initialisation then costs
    nothing); buffers stay where the module made them."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:  # a tied parameter arrives already on meta
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _checkpoint(root: Path) -> dict[str, tuple[Path, str, tuple[int, ...], int]]:
    """name -> (file, safetensors dtype, shape, absolute byte offset), from the files' headers."""
    index = root / "model.safetensors.index.json"
    if index.exists():
        files = sorted({root / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = [root / "model.safetensors"]
    found = {}
    for file in files:
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        for name, info in header.items():
            found[name] = (file, info["dtype"], tuple(info["shape"]), 8 + size + info["data_offsets"][0])
    return found


def _layout(model: nn.Module, ckpt: dict, dtype: torch.dtype) -> list[_Slot]:
    """One slot per distinct parameter, found in the checkpoint under any of its (tied) names."""
    groups: dict[int, list[str]] = {}
    params = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
        params[id(p)] = p
    slots, offset, missing = [], 0, []
    for key, names in groups.items():
        stored = next((n for n in names if n in ckpt), None)
        if stored is None:
            missing.append(names[0])
            continue
        file, st_dtype, shape, at = ckpt[stored]
        if shape != tuple(params[key].shape):
            raise ValueError(
                f"{stored}: checkpoint shape {list(shape)} but the model's is {list(params[key].shape)}"
            )
        file_dtype = _DTYPES[st_dtype]
        slot_dtype = dtype if file_dtype.is_floating_point else file_dtype
        slots.append(_Slot(tuple(names), file, file_dtype, at, shape, slot_dtype, offset))
        offset = -(-(offset + slots[-1].nbytes) // _ALIGN) * _ALIGN
    unknown = sorted(set(ckpt) - {n for names in groups.values() for n in names})
    if missing or unknown:
        raise ValueError(
            f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unknown[:5]}"
        )
    return slots


def _mappable(slot: _Slot) -> bool:
    """Whether ``slot`` can be used in place in its file: stored in its dtype, aligned."""
    return slot.file_dtype == slot.dtype and slot.file_offset % slot.dtype.itemsize == 0


def _map(file: Path) -> torch.Tensor:
    """``file`` as a read-only uint8 tensor over a private mapping whose pages are mapped at once
    (``MAP_POPULATE``, Linux; elsewhere they fault in on first use). Read-only matters: a
    writable private mapping is populated by write faults, which copy every page into anonymous
    memory. Nothing writes to a teacher's weights (a write would fault)."""
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)
    with file.open("rb") as f:
        mm = mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ)
    with warnings.catch_warnings():  # torch warns that the buffer is not writable: it is meant not to be
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mm, dtype=torch.uint8)  # keeps ``mm`` alive while any view is


def _view(flat: torch.Tensor, offset: int, slot: _Slot) -> torch.Tensor:
    """``slot``'s tensor at byte ``offset`` of the uint8 tensor ``flat``."""
    return flat[offset : offset + slot.nbytes].view(slot.dtype).view(slot.shape)


def _copy_from_files(slots: list[_Slot], flat: torch.Tensor) -> None:
    """Copy every slot from its memory-mapped file into ``flat`` in chunks, dropping each chunk's
    mapped pages once copied (the page cache keeps them; this process does not)."""
    by_file: dict[Path, list[_Slot]] = {}
    for slot in slots:
        by_file.setdefault(slot.file, []).append(slot)
    for file, group in by_file.items():
        with file.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
            for slot in group:
                dst = flat[slot.offset : slot.offset + slot.nbytes].view(slot.dtype)
                size = slot.file_dtype.itemsize
                step = max(1, _CHUNK // size)
                for i in range(0, slot.numel, step):
                    n = min(step, slot.numel - i)
                    start = slot.file_offset + i * size
                    src = torch.frombuffer(mm, dtype=slot.file_dtype, count=n, offset=start)
                    dst[i : i + n].copy_(src)
                    del src
                    page = start - start % _PAGE
                    mm.madvise(mmap.MADV_DONTNEED, page, start + n * size - page)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
