"""LoRA on the torch backend, by ``peft``: low-rank adapters trained instead of the whole model.

``peft.inject_adapter_in_model`` replaces each target linear layer (``[train.lora]
target_modules``) of the model by a LoRA layer computing ``W x + alpha / r * B A x`` (``A``
random, ``B`` zero: training starts from the base model exactly); only ``A`` and ``B`` train, so
the optimizer holds state for the adapters alone. Parameter names keep the model's own, with
``base_layer`` inserted in the adapted modules (``model.layers.0.self_attn.q_proj.base_layer.weight``).

What leaves the backend:

- weight updates: the adapters alone (:func:`adapter_weights`, ``[train.lora] sync =
  "adapter"``, the default), which an engine merges into its copy of the base weights
  (:class:`loong_transfermesh.LoraMerge`, over the modules
  :func:`~loong_train.models.adapters.adapted_modules` finds in its own model) or an SGLang server
  serves as an adapter; or every weight under its Hugging Face name with the adapter merged in
  (:func:`merged_weights`, ``W + alpha / r * B A``; ``sync = "merged"``);
- checkpoints: the adapter as ``peft`` saves one (:func:`save_adapter`: ``adapter_config.json`` and
  ``adapter_model.safetensors``, keys ``base_model.model.<module>.lora_A.weight``), which
  ``peft.PeftModel.from_pretrained(base, dir)`` loads onto the base checkpoint; and the merged
  model (:func:`merged`), a plain checkpoint;
- the KL penalty's reference policy is the base model: the same model with the adapters switched
  off (:func:`disabled`), so no second copy is kept.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loong_train.backends.config import LoraConfig
from loong_train.models.adapters import ADAPTER_FILE, PEFT_PREFIX, checkpoint_root, read_adapter, target_names

__all__ = [
    "ADAPTER",
    "adapter_weights",
    "add_adapters",
    "disabled",
    "load_adapter",
    "merged",
    "merged_weights",
    "save_adapter",
]

ADAPTER = "default"  # peft's adapter name inside the model (never in the files it saves)


def add_adapters(model: nn.Module, cfg: LoraConfig) -> Any:
    """Inject LoRA into ``model``'s target linear layers, in place; freeze everything else.
    Returns the ``peft.LoraConfig`` used (its ``save_pretrained`` writes ``adapter_config.json``)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    root = checkpoint_root(model)
    peft_config = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.scale * cfg.rank,
        lora_dropout=cfg.dropout,
        target_modules=target_names(root, cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    inject_adapter_in_model(peft_config, root, adapter_name=ADAPTER)
    for name, p in root.named_parameters():
        p.requires_grad_(".lora_" in name)
    return peft_config


def _layers(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    from peft.tuners.lora import LoraLayer

    return ((name, m) for name, m in root.named_modules() if isinstance(m, LoraLayer))


def adapter_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters, ``<module>.lora_A.weight`` and ``<module>.lora_B.weight`` by Hugging Face
    module name (:func:`loong_transfermesh.adapter_names`): what an adapter-only update sends."""
    return {
        name.replace(f".{ADAPTER}.", "."): p.detach()
        for name, p in checkpoint_root(model).named_parameters()
        if ".lora_" in name
    }


@torch.no_grad()
def merged_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight under its Hugging Face name, the adapters merged in (``W + scale * B A``)."""
    root = checkpoint_root(model)
    deltas = {f"{name}.weight": m.get_delta_weight(ADAPTER) for name, m in _layers(root)}
    out = {}
    for name, p in root.named_parameters():
        if ".lora_" in name:
            continue
        key = name.replace(".base_layer.", ".")
        out[key] = p.detach() + deltas[key] if key in deltas else p.detach()
    return out


@contextlib.contextmanager
def merged(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` as a plain model with the adapters merged in: each LoRA layer swapped for its
    base layer holding ``W + scale * B A``; restored (weights and layers) on exit."""
    root = checkpoint_root(model)
    layers = list(_layers(root))
    saved = []
    with torch.no_grad():
        for name, m in layers:
            parent, _, child = name.rpartition(".")
            base = m.get_base_layer()
            saved.append((root.get_submodule(parent) if parent else root, child, m, base.weight.clone()))
            base.weight += m.get_delta_weight(ADAPTER)
            setattr(saved[-1][0], child, base)
    try:
        yield model
    finally:
        with torch.no_grad():
            for parent, child, m, weight in saved:
                m.get_base_layer().weight.copy_(weight)
                setattr(parent, child, m)


@contextlib.contextmanager
def disabled(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` computing as its base model (the adapters switched off) inside the block."""
    layers = [m for _, m in _layers(checkpoint_root(model))]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield model
    finally:
        for m in layers:
            m.enable_adapters(True)
            for p in m.lora_A.parameters():  # enable_adapters(False) froze them
                p.requires_grad_(True)
            for p in m.lora_B.parameters():
                p.requires_grad_(True)


def save_adapter(model: nn.Module, peft_config: Any, path: str | Path, base: str = "") -> None:
    """The adapter as ``peft`` saves one into ``path`` (``base``: the base checkpoint's path,
    recorded as ``base_model_name_or_path``)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {PEFT_PREFIX + name: p.contiguous() for name, p in adapter_weights(model).items()}
    save_file(tensors, str(path / ADAPTER_FILE), metadata={"format": "pt"})
    peft_config.save_pretrained(str(path))
    if base:  # peft writes None for an injected adapter
        config = json.loads((path / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = str(base)
        (path / "adapter_config.json").write_text(json.dumps(config, indent=2))


@torch.no_grad()
def load_adapter(model: nn.Module, path: str | Path) -> None:
    """Copy the adapter :func:`save_adapter` wrote into ``path`` into ``model``'s adapters."""
    params = adapter_weights(model)
    saved = read_adapter(path)
    if missing := sorted(set(params) - set(saved)):
        raise ValueError(f"{path} holds no adapter weights for {missing[:3]} ({len(missing)} in all)")
    if unknown := sorted(set(saved) - set(params)):
        raise ValueError(f"{path} holds adapter weights {unknown[:3]} this model has no adapter for")
    for name, p in params.items():
        p.copy_(saved[name])
