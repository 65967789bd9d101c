"""SGLang's LoRA endpoints, served by the embedded engine (``serve-sglang --enable-lora``).

- ``POST /load_lora_adapter_from_tensors {lora_name, config_dict, serialized_named_tensors}``:
  serve an adapter under ``lora_name``. ``config_dict`` is its PEFT ``adapter_config.json``
  (``r``, ``lora_alpha``; options this server does not compute, ``use_dora``, ``use_rslora``, a
  ``bias`` other than ``"none"``, ``modules_to_save``, are refused). Entry 0 of
  ``serialized_named_tensors`` is base64 of ``torch.save({name: tensor})`` with PEFT's names
  (``base_model.model.<module>.lora_A.weight``), as ``/update_weights_from_tensor`` takes tensors
  here (:func:`.http_weights.load_payload`). Every adapted module must be a linear layer of the
  served model, every module of that name must be adapted (PEFT adapts them all), each ``A`` is
  ``[r, in]`` and each ``B`` ``[out, r]``; with ``--max-lora-rank`` the rank is bounded, with
  ``--lora-target-modules`` the modules are (SGLang's flags). A refusal names what is wrong and
  loads nothing.
- ``POST /unload_lora_adapter {lora_name}``: new requests can no longer name it; requests that
  arrived before still run under it (each holds its adapter from its arrival, as SGLang's do).
- ``/generate``'s ``lora_path`` names the adapter a request samples with (None: the base model).

The engine holds one set of weights, so this server serves one adapter at a time, merged into
the base weights by :class:`loong_transfermesh.LoraMerge` (``base + alpha / r * B @ A`` from a
pristine copy of the base, as a rollout worker merges adapter-only updates). A request naming
another adapter than the merged one waits until the running requests have ended, then the
adapter is merged and it starts; requests are admitted in arrival order, so one waiting for
another adapter holds back later requests for the merged one and neither starves. SGLang
batches requests for several adapters together (its LoRA kernels); each request's tokens are
the same either way, its adapter's. Base weights are fixed while LoRA is on: full weight
updates are refused (:mod:`.http_weights`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator
from typing import NamedTuple

import torch
from starlette.requests import Request
from starlette.responses import Response

from loong_core.sglang_api import (
    LoadLoRAAdapterFromTensorsRequest,
    LoRAUpdateResponse,
    UnloadLoRAAdapterRequest,
)
from loong_train.engines.embedded.http_control import SGLangServer
from loong_train.engines.embedded.http_weights import load_payload
from loong_train.engines.embedded.wire import BadRequest, decode_body, json_response
from loong_train.models.adapters import PEFT_PREFIX, adapted_modules
from loong_transfermesh import LoraMerge, adapter_shapes

__all__ = ["LoraRoutes", "ServedAdapter"]

# PEFT options that change what an adapter computes, and the value this server computes with
_PLAIN = {"use_dora": False, "use_rslora": False, "bias": "none", "modules_to_save": None}
_UNKNOWN = object()  # ``merged`` while a switch runs, and after one failed: the next request switches


class ServedAdapter(NamedTuple):
    """A loaded adapter: its modules (the merge's layout), those stored ``[in, out]``, rank,
    scale, and tensors by :func:`loong_transfermesh.adapter_names`."""

    modules: tuple[str, ...]
    transposed: tuple[str, ...]
    rank: int
    scale: float
    tensors: dict[str, torch.Tensor]


class LoraRoutes:
    """The adapter endpoints over ``server``'s engine, and the gate ``/generate`` passes through.

    ``max_rank`` (0: any) and ``target_modules`` (empty: any; ``"all"`` too) are SGLang's
    ``--max-lora-rank`` and ``--lora-target-modules``."""

    def __init__(self, server: SGLangServer, max_rank: int = 0, target_modules: tuple[str, ...] = ()) -> None:
        self._server, self.engine = server, server.engine
        self.max_rank = max_rank
        self.target_modules = frozenset(target_modules) - {"all", "all-linear"}
        self.adapters: dict[str, ServedAdapter] = {}
        # the adapter the engine's weights hold now (None: the base; _UNKNOWN: a switch failed)
        self.merged: ServedAdapter | object | None = None
        self._merge: LoraMerge | None = None
        self._layout: tuple | None = None  # the merge's modules, transposed modules and rank
        self._users = 0  # admitted requests, all under ``merged``
        self._switching = False
        self._queue: collections.deque[object] = collections.deque()
        self._wake = asyncio.Event()  # set (and replaced) whenever the gate's state changed

    # ---- the gate /generate passes through ----
    def adapter(self, name: str | None, field: str = "lora_path") -> ServedAdapter | None:
        """The loaded adapter ``name`` names (None: the base model); a request holds it from its
        arrival, so an unload after that does not touch it."""
        if name is None:
            return None
        if name not in self.adapters:
            raise BadRequest(
                field, f"no LoRA adapter named {name!r} is loaded (loaded: {sorted(self.adapters)})"
            )
        return self.adapters[name]

    @contextlib.asynccontextmanager
    async def serving(self, adapter: ServedAdapter | None) -> AsyncIterator[None]:
        """Run the block with ``adapter`` (None: the base model) merged into the weights, once
        every request that arrived before it under another adapter has ended."""
        ticket = object()
        self._queue.append(ticket)
        try:
            while not self._admits(ticket, adapter):
                await self._wake.wait()
        finally:  # admitted, or cancelled while waiting
            self._queue.remove(ticket)
            self._changed()
        if self.merged is not adapter:
            self._switching = True
            try:
                await self._switch(adapter)
            finally:
                self._switching = False
                self._changed()
        self._users += 1
        try:
            yield
        finally:  # no await here: a cancelled request must not skip it
            self._users -= 1
            self._changed()

    def _admits(self, ticket: object, adapter: ServedAdapter | None) -> bool:
        """Its turn (first in line, no switch running), and nothing runs under another adapter."""
        first = self._queue[0] is ticket and not self._switching
        return first and (not self._users or self.merged is adapter)

    def _changed(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    async def _switch(self, adapter: ServedAdapter | None) -> None:
        """Merge ``adapter`` (None: restore the base) while no request runs."""
        engine = self.engine
        layout = None if adapter is None else (adapter.modules, adapter.transposed, adapter.rank)
        engine.pause()
        try:
            await engine.wait_idle()
            self.merged = _UNKNOWN  # until the merge below completes
            if self._merge is not None and (adapter is None or layout != self._layout):
                self._fill(None)  # the base back in place (before another layout copies it)
            if adapter is not None:
                if self._merge is None or layout != self._layout:
                    params = dict(engine.model.named_parameters())
                    dtype = torch.promote_types(params[f"{adapter.modules[0]}.weight"].dtype, torch.float32)
                    self._merge = LoraMerge(
                        params, adapter.modules, adapter.rank, adapter.scale, adapter.transposed, dtype
                    )
                    self._layout = layout
                self._fill(adapter)
            self.merged = adapter
        finally:
            if not self._server.paused:
                engine.resume()

    @torch.no_grad()
    def _fill(self, adapter: ServedAdapter | None) -> None:
        """Merge ``adapter``'s tensors (None: zeros, which gives the base back exactly)."""
        for key, buffer in self._merge.buffers.items():
            if adapter is None:
                buffer.zero_()
            else:
                buffer.copy_(adapter.tensors[key])
        self._merge.scale = 0.0 if adapter is None else adapter.scale
        self._merge.merge()

    # ---- routes ----
    async def load(self, request: Request) -> Response:
        body = await decode_body(request, LoadLoRAAdapterFromTensorsRequest)
        if body.lora_name in self.adapters:
            raise BadRequest("lora_name", f"an adapter named {body.lora_name!r} is already loaded")
        if body.load_format not in (None, "auto"):
            raise BadRequest("load_format", "only the default format (a {name: tensor} dict) is supported")
        loaded = load_payload(body.serialized_named_tensors, "{name: tensor}", torch.device("cpu"))
        if not isinstance(loaded, dict) or not all(isinstance(t, torch.Tensor) for t in loaded.values()):
            raise BadRequest("serialized_named_tensors", "expected a {name: tensor} dict")
        self.adapters[body.lora_name] = self._checked(body.config_dict, loaded)
        return self._answer()

    async def unload(self, request: Request) -> Response:
        name = (await decode_body(request, UnloadLoRAAdapterRequest)).lora_name
        self.adapter(name, "lora_name")
        del self.adapters[name]  # new requests are refused; those that arrived still run under it
        return self._answer()

    def _answer(self) -> Response:
        loaded = {n: {"lora_name": n, "lora_path": "__tensor__"} for n in self.adapters}
        return json_response(LoRAUpdateResponse(success=True, loaded_adapters=loaded))

    def _checked(self, config: dict, loaded: dict[str, torch.Tensor]) -> ServedAdapter:
        """The adapter ``config`` and ``loaded`` describe, checked against the served model."""
        for key, plain in _PLAIN.items():
            if config.get(key, plain) not in (plain, [], {}):
                raise BadRequest("config_dict", f"{key} = {config[key]!r} is not supported (only {plain!r})")
        rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise BadRequest("config_dict", f"r must be a positive integer, got {rank!r}")
        if not isinstance(alpha, int | float) or alpha <= 0:
            raise BadRequest("config_dict", f"lora_alpha must be a positive number, got {alpha!r}")
        if self.max_rank and rank > self.max_rank:
            raise BadRequest(
                "config_dict", f"r = {rank} exceeds the server's --max-lora-rank {self.max_rank}"
            )
        tensors = {name.removeprefix(PEFT_PREFIX): t for name, t in loaded.items()}
        leaves = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in tensors})
        if self.target_modules and (outside := sorted(set(leaves) - self.target_modules)):
            raise BadRequest(
                "serialized_named_tensors",
                f"adapts {outside}, outside the server's --lora-target-modules {sorted(self.target_modules)}",
            )
        try:
            modules, transposed = adapted_modules(self.engine.model, leaves, "the adapter")
        except ValueError as e:
            raise BadRequest("serialized_named_tensors", str(e)) from None
        want = adapter_shapes(dict(self.engine.model.named_parameters()), modules, rank, transposed)
        missing, unknown = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
        wrong = [
            f"{n} {list(t.shape)} (expected {list(want[n])})"
            for n, t in tensors.items()
            if n in want and tuple(t.shape) != want[n]
        ]
        if missing or unknown or wrong:
            raise BadRequest(
                "serialized_named_tensors",
                f"missing {missing[:3]} ({len(missing)} in all), unknown {unknown[:3]} ({len(unknown)}), "
                f"wrong shapes {wrong[:3]} ({len(wrong)})",
            )
        return ServedAdapter(
            tuple(modules), tuple(transposed), rank, alpha / rank, {n: tensors[n] for n in want}
        )
