"""Adapter-only updates: versions of a LoRA-trained model travel as their adapters.

A LoRA update changes a weight only through ``W + s * B @ A`` (``A``: ``[rank, in]``, ``B``:
``[out, rank]``, ``s`` the adapter's scale), so a version can be sent as its adapter tensors,
megabytes where the model is gigabytes, and merged where it lands. :class:`LoraMerge` is the
receiving side: it keeps a pristine copy of every adapted weight (the base) and the adapter buffers
a receiver applies into, and :meth:`LoraMerge.merge` writes ``base + s * B @ A`` into the model's
weights from the base each time, so versions never accumulate rounding and the result equals
merging the same adapter on the sending side.

Names follow the model's: the adapters of ``<module>.weight`` are ``<module>.lora_A.weight`` and
``<module>.lora_B.weight`` (:func:`adapter_names`), as PEFT names them without its adapter name.
Any receiver works (:func:`~loong_transfermesh.transport.open_receiver`): the buffers are plain
named tensors.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from loong_transfermesh.transport import WeightReceiver

__all__ = ["LoraMerge", "adapter_names", "adapter_shapes", "copy_adapter"]


def adapter_names(module: str) -> tuple[str, str]:
    """The names of module ``module``'s ``A`` and ``B``."""
    return f"{module}.lora_A.weight", f"{module}.lora_B.weight"


def adapter_shapes(
    weights: Mapping[str, torch.Tensor], modules: Iterable[str], rank: int, transposed: Collection[str] = ()
) -> dict[str, tuple[int, int]]:
    """The shape of every adapter tensor of ``modules`` by name: ``A`` is ``[rank, in]``, ``B``
    ``[out, rank]``, for ``<module>.weight`` in ``weights`` (``[out, in]``; ``[in, out]`` for the
    ``transposed`` ones)."""
    shapes = {}
    for module in modules:
        weight = weights.get(f"{module}.weight")
        if weight is None or weight.dim() != 2:
            raise ValueError(f"{module!r} has no 2-D weight {module}.weight to adapt")
        out_features, in_features = weight.shape[::-1] if module in transposed else weight.shape
        a_name, b_name = adapter_names(module)
        shapes[a_name], shapes[b_name] = (rank, in_features), (out_features, rank)
    return shapes


@torch.no_grad()
def copy_adapter(buffers: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor]) -> None:
    """Copy ``adapter`` into ``buffers`` (same names, e.g. a PEFT adapter file's keys without their
    ``base_model.model.`` prefix): every buffer given, with its shape, and nothing else."""
    missing, unknown = sorted(set(buffers) - set(adapter)), sorted(set(adapter) - set(buffers))
    wrong = [n for n, t in buffers.items() if n in adapter and adapter[n].shape != t.shape]
    if missing or unknown or wrong:
        raise ValueError(
            f"the adapter lacks {missing[:3]} ({len(missing)} missing), has no place for {unknown[:3]} "
            f"({len(unknown)}), shapes differ for {wrong[:3]} ({len(wrong)})"
        )
    for name, t in buffers.items():
        t.copy_(adapter[name])


class LoraMerge:
    """Merges adapter-only versions into ``weights`` (a model's named parameters).

    ``modules``: the adapted modules (each has ``<module>.weight`` in ``weights``); ``transposed``:
    those storing their weight as ``[in, out]`` (GPT-2's ``Conv1D``). ``buffers`` is what a
    receiver applies into; zeros until the first version, so merging them gives the base back.
    ``dtype``: the buffers' (the adapter's as the sender sends it; default: each weight's). A
    weight in a narrower dtype (a bfloat16 engine) is merged in the buffers' dtype over its own
    (rounded) base and rounded back. Costs one copy of the adapted weights (the base).
    """

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor],
        modules: Iterable[str],
        rank: int,
        scale: float,
        transposed: Collection[str] = (),
        dtype: torch.dtype | None = None,
    ) -> None:
        self.scale = scale
        self._layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool]] = []
        self.buffers: dict[str, torch.Tensor] = {}
        modules = list(modules)
        try:
            shapes = adapter_shapes(weights, modules, rank, transposed)
        except ValueError as e:
            raise ValueError(f"LoraMerge: {e}") from None
        for module in modules:
            weight = weights[f"{module}.weight"]
            a_name, b_name = adapter_names(module)
            a = weight.new_zeros(shapes[a_name], dtype=dtype)
            b = weight.new_zeros(shapes[b_name], dtype=dtype)
            self.buffers[a_name], self.buffers[b_name] = a, b
            self._layers.append((weight, weight.detach().to(a.dtype, copy=True), a, b, module in transposed))

    @torch.no_grad()
    def merge(self) -> None:
        """Each adapted weight becomes ``base + scale * B @ A`` (the buffers' adapter)."""
        for weight, base, a, b, flip in self._layers:  # one fused product-and-add a layer
            x, y = (a.T, b.T) if flip else (b, a)
            if weight.dtype == base.dtype:
                torch.addmm(base, x, y, alpha=self.scale, out=weight)
            else:
                weight.copy_(torch.addmm(base, x, y, alpha=self.scale))

    def apply(self, receiver: WeightReceiver, version: int | None = None) -> int:
        """Take ``version`` (the newest: None) from ``receiver`` into the buffers, then merge."""
        held = receiver.apply(self.buffers, version)
        self.merge()
        return held

    def load(self, adapter: Mapping[str, torch.Tensor]) -> None:
        """Merge ``adapter`` (names as in :attr:`buffers`; checked by :func:`copy_adapter`)."""
        copy_adapter(self.buffers, adapter)
        self.merge()
