"""GGUF files (llama.cpp, Ollama) as model sources: converted once into a Hugging Face checkpoint.

:func:`convert` reads a ``.gguf`` file with ``transformers``' GGUF loader (which dequantizes every
tensor to float32 and undoes llama.cpp's query/key row order) and writes a Hugging Face checkpoint
directory: ``model.safetensors`` (float32), ``config.json``, the tokenizer files with the chat
template from the file's metadata, and ``generation_config.json`` (its end-of-turn id). The
directory lives in the cache under the file's name and the first 16 hex digits of its sha256, so a
file is converted once whatever its path, and an edited file converts again. It is written to a
temporary directory and renamed, so an interrupted conversion leaves nothing half-written.

Before anything heavy the file is checked, each failure a ConfigError naming the file: it exists,
starts with GGUF's magic, parses whole (a truncated file does not), holds an architecture
``transformers`` can load and only quantization types ``gguf`` can dequantize.

Needs the ``loong-train[gguf]`` extra (``gguf`` and ``accelerate``), imported only here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

from loong_core.config import ConfigError

__all__ = ["convert", "digest"]

log = logging.getLogger("loong.models")

_MAGIC = b"GGUF"
_MARKER = "loong-gguf.json"  # written last: a directory holding it is a finished conversion


def digest(path: Path) -> str:
    """The sha256 of the file at ``path`` (hex)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def convert(path: str | Path, cache_dir: str | Path) -> Path:
    """The Hugging Face checkpoint converted from the GGUF file ``path`` (converted now, or found
    in ``cache_dir`` from an earlier run); raises ConfigError naming the file when it cannot be."""
    path = Path(path).expanduser()
    _check_file(path)
    sha = digest(path)
    out = Path(cache_dir) / "gguf" / f"{path.stem}-{sha[:16]}"
    if (out / _MARKER).is_file():
        log.info("GGUF %s: the converted checkpoint %s (from an earlier run)", path, out)
        return out
    arch, types = _inspect(path)
    log.info("GGUF %s: converting it (architecture %s, tensor types %s) into %s", path, arch, types, out)
    start = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the checkpoint is an ordinary cache entry
    try:
        _write_checkpoint(path, tmp)
        marker = {"source": str(path), "sha256": sha, "architecture": arch, "tensor_types": types}
        (tmp / _MARKER).write_text(json.dumps(marker, indent=1))
        if out.exists():  # a conversion that died before its marker
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("GGUF %s: converted in %.0f s into %s", path, time.monotonic() - start, out)
    return out


def _check_file(path: Path) -> None:
    if not path.is_file():
        raise ConfigError(
            f"GGUF file {path} does not exist" + (" (it is a directory)" if path.is_dir() else "")
        )
    with path.open("rb") as f:
        head = f.read(4)
    if head != _MAGIC:
        raise ConfigError(f"{path} is not a GGUF file: it starts with {head!r}, expected {_MAGIC!r}")


def _inspect(path: Path) -> tuple[str, list[str]]:
    """The file's architecture and tensor types, checked against what can convert them."""
    gguf = _require("gguf")
    from gguf.quants import _type_traits

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf reports a short file as a failed read or reshape
        raise ConfigError(
            f"{path} cannot be read as GGUF ({type(e).__name__}: {e}); is the file truncated or corrupt?"
        ) from e
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > path.stat().st_size:
        raise ConfigError(
            f"{path} is truncated: its tensors end at byte {end}, the file at {path.stat().st_size}"
        )
    field = reader.get_field("general.architecture")
    arch = field.contents() if field is not None else ""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    loadable = sorted(set(GGUF_CONFIG_MAPPING) - {"general", "tokenizer"})
    if arch not in loadable:
        raise ConfigError(
            f"{path}: architecture {arch!r} is not one transformers' GGUF loader supports ({', '.join(loadable)})"
        )
    plain = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
    types = sorted({t.tensor_type.name for t in reader.tensors})
    if bad := sorted(
        {t.tensor_type.name for t in reader.tensors if t.tensor_type not in (plain | set(_type_traits))}
    ):
        raise ConfigError(
            f"{path}: quantization type(s) {', '.join(bad)} cannot be dequantized by the gguf package "
            f"(it reads F32, F16, BF16 and {', '.join(sorted(t.name for t in _type_traits))})"
        )
    return arch, types


def _write_checkpoint(path: Path, out: Path) -> None:
    """Load ``path`` with ``transformers`` and save it as a float32 Hugging Face checkpoint."""
    _require("accelerate")  # gguf was required by _inspect, which runs first
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    where, name = str(path.parent), path.name
    config = AutoConfig.from_pretrained(where, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    # transformers marks a GGUF-loaded model as quantized and will not save it: copy its weights
    # into a plain model built from the same config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    generation = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=tokenizer.eos_token_id if tokenizer.eos_token_id is not None else config.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else config.pad_token_id,
    )
    generation.save_pretrained(out)


def _require(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            f"reading GGUF files needs the {module!r} package: install the loong-train[gguf] extra "
            "(in the repository: uv sync installs it)"
        ) from e
