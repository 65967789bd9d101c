"""LoRA adapters as files and as module names: which modules of a plain model an adapter adapts,
and reading an adapter ``peft`` saved.

``peft`` adapts every linear layer whose name (the last part of its path) is a target, never the
LM head; its saved adapter (``adapter_model.safetensors``) names tensors
``base_model.model.<module>.lora_A.weight``. The trainer (:mod:`loong_train.backends.lora`) and the
engines that merge or serve adapters (:mod:`loong_train.workers.rollout`,
:mod:`loong_train.engines.embedded.http_lora`, :mod:`loong_train.engines.sglang.rollout`) agree on
the modules through :func:`adapted_modules`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

__all__ = [
    "ADAPTER_FILE",
    "PEFT_PREFIX",
    "adapted_modules",
    "checkpoint_root",
    "linear_layers",
    "read_adapter",
    "target_names",
]

ADAPTER_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # a PeftModel's path to the wrapped model, in saved adapter keys


def checkpoint_root(model: nn.Module) -> nn.Module:
    """The module whose parameter names are the checkpoint's (the generic path wraps one)."""
    return getattr(model, "inner", model)


def linear_layers(root: nn.Module) -> dict[str, nn.Module]:
    """Every linear layer of ``root`` but the LM head, by name."""
    head = root.get_output_embeddings() if hasattr(root, "get_output_embeddings") else None
    head = head if head is not None else getattr(root, "lm_head", None)
    kinds = _linear_kinds()
    return {name: m for name, m in root.named_modules() if isinstance(m, kinds) and m is not head}


def _linear_kinds() -> tuple[type, ...]:
    """``nn.Linear``, and transformers' ``Conv1D`` (GPT-2's linear layers; peft adapts those too)
    once ``transformers.pytorch_utils`` is imported: a model can only hold one then, and importing
    transformers for the check would cost a trainer process 2-3 s of its start."""
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    return (nn.Linear, pytorch_utils.Conv1D) if pytorch_utils is not None else (nn.Linear,)


def target_names(
    root: nn.Module, spec: list[str] | str, setting: str = "train.lora.target_modules"
) -> list[str]:
    """Module names (the last part of a path) to adapt: ``spec``'s, each checked to name linear
    layers (the error names ``setting`` as their source), or every linear layer's but the LM
    head's for ``"all-linear"``."""
    linear = sorted({name.rsplit(".", 1)[-1] for name in linear_layers(root)})
    if spec == "all-linear":
        return linear
    if unknown := [t for t in spec if t not in linear]:
        raise ValueError(
            f"{setting} names {unknown}, which no linear layer of the model is called "
            f"(its linear layers: {linear}; the LM head is never adapted)"
        )
    return list(spec)


def adapted_modules(
    model: nn.Module, target_modules: list[str] | str, setting: str = "train.lora.target_modules"
) -> tuple[list[str], list[str]]:
    """The modules ``peft`` adapts for ``target_modules`` in a plain ``model`` (an engine's), by
    Hugging Face name, and those of them storing ``[in, out]`` weights (``Conv1D``)."""
    root = checkpoint_root(model)
    targets = set(target_names(root, target_modules, setting))
    modules = {name: m for name, m in linear_layers(root).items() if name.rsplit(".", 1)[-1] in targets}
    return list(modules), [name for name, m in modules.items() if not isinstance(m, nn.Linear)]


def read_adapter(path: str | Path) -> dict[str, torch.Tensor]:
    """The adapter ``peft`` saved into directory ``path``, named ``<module>.lora_A.weight`` (its
    ``base_model.model.`` prefix dropped)."""
    from safetensors.torch import load_file

    return {k.removeprefix(PEFT_PREFIX): t for k, t in load_file(str(Path(path) / ADAPTER_FILE)).items()}
