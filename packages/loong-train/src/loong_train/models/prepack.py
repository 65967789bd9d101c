"""Linear layers that run inference from a weight oneDNN has laid out once (x86 CPUs).

A CPU product ``x @ W^T`` from a plain row-major ``W`` lays ``W`` out afresh for the kernel on
every call. :class:`Linear` (every linear layer of Loong's decoder) keeps oneDNN's blocked copy of
its weight once :func:`prepack` switched it on, and every forward that needs no gradient runs from
that copy (a weight of at least ``MIN_ELEMENTS`` entries: below that the plain call is as
fast). Measured on SmolLM2-135M-Instruct, two threads of an AVX512 EPYC: bfloat16 products of
a 128-row decode step 5-10% faster, float32 10-20% (the 49,152-row LM head 1.6x), the embedded
engine 8% (bfloat16) and 21% (float32) more tokens/s; float32 products of 2,232 rows 10-15%.

The copy is made at the first forward that uses it and again after the weight changed: its
storage moved (``.data`` swapped) or its version counter did (an in-place write through the
parameter: an optimizer step, a weight update copied in, an adapter merged). A writer that
bypasses both (``p.data.copy_(...)``, a shared-memory buffer the weight is a view of, rewritten)
calls :func:`release`. The copy costs the weight's own memory again while it is kept, and pins
the storage it was made from (so a new weight can never reuse that address unnoticed).
Forwards under CPU autocast, and bfloat16 ones on a CPU whose oneDNN has no bfloat16 support,
run the plain product.

Layers that read one input (attention's query, key and value projections) run as one product
by :func:`stacked`: their weights stacked into one blocked copy, kept on the first layer (made
again when any of them changes; it holds all their weights again and pins their storages).

Results agree with the plain product to the dtype's rounding (oneDNN's blocked kernel sums in
its own order); the layout is chosen for a fixed row count, so the same inputs give the same
result whatever ran before.
"""

from __future__ import annotations

import contextlib
import functools
import platform
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MIN_ELEMENTS", "Linear", "available", "dtypes", "prepack", "prepacked", "release", "stacked"]

_ROWS_HINT = 128  # rows oneDNN chooses the blocked layout for (fixed: the layout sets the summation order)
# Smaller weights run the plain product: the prepacked call costs about 15 us more per call, which
# a float32 weight of 64K elements does not win back even at 128 rows (576 x 576 does: 390 vs 452 us).
MIN_ELEMENTS = 1 << 17


@functools.cache
def available() -> bool:
    """Whether this torch can prepack linear weights here: oneDNN on an x86-64 CPU."""
    return (
        torch.backends.mkldnn.is_available()
        and platform.machine().lower() in ("x86_64", "amd64")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


@functools.cache
def dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes that prepack here: float32, and bfloat16 where oneDNN supports it (its
    bfloat16 reorder refuses CPUs without AVX512 or AVX-NE-CONVERT); none where not
    :func:`available`."""
    if not available():
        return ()
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)


class _Blocked:
    """A layer's blocked weight (or a stack's), published whole as ``entry``: ``(key, sources,
    blocked)`` with ``key`` the (address, version, dtype) of each weight it was made from and
    ``sources`` those weights (pinning their storage). Threads that forward at once (an engine's
    decode steps and scoring) read ``entry`` once; one at a time makes a new copy. Never copied
    or pickled with the module (a blocked tensor has no storage to copy): a copy starts empty."""

    __slots__ = ("entry", "lock")

    def __init__(self) -> None:
        self.entry: tuple[tuple, list[torch.Tensor], torch.Tensor] | None = None
        self.lock = threading.Lock()

    def __reduce__(self):
        return (_Blocked, ())


class Linear(nn.Linear):
    """``nn.Linear`` that, once :func:`prepack` switched it on, runs every forward needing no
    gradient on a CPU from oneDNN's blocked copy of its weight (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prepack_on = False
        self._blocked = _Blocked()
        self._stacked = _Blocked()  # this layer's weight stacked with the others of a `stacked` call

    def runs_prepacked(self, x: torch.Tensor) -> bool:
        """Whether ``forward(x)`` runs from the blocked weight."""
        return _runs_prepacked((self,), x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.runs_prepacked(x):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(
            x, _blocked(self._blocked, (self,)), self.bias, "none", [], ""
        )

    def release(self) -> None:
        """Drop this layer's blocked copy and the stack it heads (the next forward that uses one
        makes it again; :func:`release` of the model drops every stack a layer is part of)."""
        self._blocked.entry = self._stacked.entry = None


def stacked(layers: tuple[nn.Module, ...], x: torch.Tensor) -> list[torch.Tensor]:
    """``[layer(x) for layer in layers]`` for layers that read the same input (attention's query,
    key and value projections), run as one product from their weights stacked and blocked once
    where every one is a :class:`Linear`, the first is prepacked and the stack is large enough
    (``MIN_ELEMENTS`` counts the stack). Each output has the bits of its own layer's prepacked
    product (oneDNN computes an output column from its weight row alone) at one call's fixed
    cost: SmolLM2's three projections of a 128-row bfloat16 decode step take 550 us against 720
    (the key and value weights, 576 x 192, are too small to prepack alone)."""
    if not _runs_prepacked(layers, x):
        return [layer(x) for layer in layers]
    bias = None
    if any(layer.bias is not None for layer in layers):
        bias = torch.cat([x.new_zeros(m.out_features) if m.bias is None else m.bias for m in layers])
    out = torch.ops.mkldnn._linear_pointwise(x, _blocked(layers[0]._stacked, layers), bias, "none", [], "")
    return list(out.split([layer.out_features for layer in layers], -1))


def _runs_prepacked(layers: tuple[nn.Module, ...], x: torch.Tensor) -> bool:
    """Whether the product of ``x`` with ``layers``' weights (stacked) runs from a blocked copy:
    never for a layer that is not a :class:`Linear` (a LoRA layer ``peft`` put in its place)."""
    if not all(isinstance(layer, Linear) for layer in layers):
        return False
    weights = [layer.weight for layer in layers]
    params = weights + [layer.bias for layer in layers if layer.bias is not None]
    dtype = weights[0].dtype
    return (
        layers[0].prepack_on
        and sum(w.numel() for w in weights) >= MIN_ELEMENTS
        and x.device.type == "cpu"
        and x.dtype == dtype
        and all(w.dtype == dtype for w in weights)
        and dtype in dtypes()
        and not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)))
        and not torch.is_autocast_enabled("cpu")
    )


def _blocked(blocked: _Blocked, layers: tuple[Linear, ...]) -> torch.Tensor:
    """``layers``' weights (stacked, for more than one) as oneDNN's blocked copy, kept in
    ``blocked`` and made again once any of them changed."""
    weights = [layer.weight.detach() for layer in layers]
    key = tuple((w.data_ptr(), w._version, w.dtype) for w in weights)
    entry = blocked.entry
    if entry is not None and entry[0] == key:
        return entry[2]
    with blocked.lock:
        entry = blocked.entry
        if entry is None or entry[0] != key:
            blocked.entry = None  # the stale copy goes before the new one is made
            whole = torch.cat(weights) if len(weights) > 1 else weights[0].contiguous()
            packed = torch.ops.mkldnn._reorder_linear_weight(whole, _ROWS_HINT)
            entry = blocked.entry = (key, weights, packed)
    return entry[2]


def _layers(model: nn.Module) -> Iterator[Linear]:
    return (m for m in model.modules() if isinstance(m, Linear))


def prepack(model: nn.Module, on: bool = True) -> nn.Module:
    """Switch prepacked inference on (or off, dropping the copies) for every :class:`Linear` of
    ``model``; a no-op where :func:`available` is False. Returns ``model``."""
    on = on and available()
    for layer in _layers(model):
        layer.prepack_on = on
        if not on:
            layer.release()
    return model


def release(model: nn.Module) -> None:
    """Drop every blocked copy in ``model`` (after writing its weights in a way that moves neither
    their storage nor their version counter); they are made again when next used."""
    for layer in _layers(model):
        layer.release()


@contextlib.contextmanager
def prepacked(model: nn.Module) -> Iterator[nn.Module]:
    """:func:`prepack` for the ``with`` block. A model that was not prepacked before is switched
    off again on leaving it, its copies dropped; one that was stays as it was."""
    was_on = any(layer.prepack_on for layer in _layers(model))
    prepack(model)
    try:
        yield model
    finally:
        if not was_on:
            prepack(model, False)
