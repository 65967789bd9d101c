"""SGLang's weight-update endpoints, served by the embedded engine.

Each update is applied between decode steps (the engine is paused, the step in flight finishes,
parameters are copied, the engine resumes unless a client paused it; running requests continue
under the new weights, and ``meta_info.weight_version`` names the newest):

- ``/update_weights_from_disk {model_path, weight_version}`` (Hugging Face safetensors dir);
- ``/init_weights_update_group {master_address, master_port, rank_offset, world_size,
  group_name, backend}``, ``/update_weights_from_distributed {names, dtypes, shapes, group_name,
  weight_version, load_format}`` (``load_format`` ``"flattened_bucket"``: one broadcast per call,
  else one per tensor), ``/destroy_weights_update_group {group_name}``; the group is the one
  ``loong_transfermesh.sglang`` joins (gloo on CPU, nccl on GPU);
- ``/update_weights_from_tensor {serialized_named_tensors, weight_version}``: SGLang sends
  ``MultiprocessingSerializer`` pickles whose tensors are CUDA IPC handles, meaningful only to a
  colocated GPU process, and unpickling them runs arbitrary code. This server instead takes, in
  the same field, base64 of ``torch.save([(name, tensor), ...])`` (tensors by value), loaded with
  ``torch.load(weights_only=True)``; SGLang's own payloads (bare pickles) are refused with a 400,
  never unpickled.

An update with ``flush_cache`` (default true, as in SGLang) while a client's pause holds requests
that block a cache flush (:meth:`.http_control.SGLangServer.busy`) answers 400 before applying
anything: SGLang's scheduler asserts on that failed flush and dies, so a client must send
``flush_cache: false`` there (and flush later). An update's ``abort_all_requests`` ends every
queued and running request first, as a pause in ``abort`` mode does. ``weight_version`` is a
string as in SGLang; when it reads as an integer it also becomes the engine's version stamp.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import datetime
import io
import pickle
from pathlib import Path

import torch
import torch.distributed as dist
from starlette.requests import Request
from starlette.responses import Response

from loong_core.sglang_api import (
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightsResponse,
)
from loong_train.engines.embedded.http_control import SGLangServer
from loong_train.engines.embedded.wire import BadRequest, bad_request, decode_body, dtype_named, json_response
from loong_transfermesh.sglang import bucket_dtype, join_weight_update_group, unflatten_bucket

__all__ = ["WeightRoutes", "load_payload"]

_ZIP_MAGIC = b"PK\x03\x04"


class WeightRoutes:
    """The weight-update endpoints over the engine of ``server``, and the update groups joined."""

    def __init__(self, server: SGLangServer, group_timeout_s: float = 600.0) -> None:
        self._server, self.engine, self.group_timeout_s = server, server.engine, group_timeout_s
        self.groups: dict[str, dist.ProcessGroup] = {}
        self._update_lock = asyncio.Lock()

    @property
    def device(self) -> torch.device:
        return self.engine.model.lm_head.weight.device

    async def swap(self, named: dict[str, torch.Tensor], update) -> None:
        """Check every tensor, then copy all of them between decode steps and relabel the version
        (``update``: the request, for ``weight_version``, ``flush_cache``, ``abort_all_requests``).

        ``abort_all_requests`` ends every queued and running request first, as SGLang does.
        ``flush_cache`` while a pause holds requests that block a flush (``busy``) is refused:
        SGLang applies the weights, fails the flush and its scheduler dies on an assert."""
        server = self._server
        if server.lora is not None:
            raise BadRequest(
                "body",
                "this server was started with --enable-lora: its base weights stay fixed while it "
                "serves adapters (load a new adapter with /load_lora_adapter_from_tensors instead)",
            )
        if update.abort_all_requests:
            self.engine.abort_all()
        if update.flush_cache and server.paused and server.busy():
            raise BadRequest(
                "flush_cache",
                f"{self.engine.running + self.engine.queued} requests are held by the "
                f"{server.pause_mode!r} pause, so the cache cannot be flushed (SGLang's scheduler "
                "asserts and dies here); send flush_cache: false and flush later",
            )
        params = dict(self.engine.model.named_parameters())
        if self.engine.model.config.tie_word_embeddings:
            named.pop("lm_head.weight", None)  # tied to embed_tokens, as SGLang skips it
        for name, t in named.items():
            if name not in params:
                raise BadRequest("names", f"tensor {name!r} is not a parameter of the served model")
            if t.shape != params[name].shape:
                raise BadRequest(
                    "shapes",
                    f"tensor {name!r} has shape {list(t.shape)}, model has {list(params[name].shape)}",
                )
        async with self._update_lock:
            label = server.label if update.weight_version is None else update.weight_version
            version = int(label) if label.lstrip("-").isdigit() else self.engine.weight_version + 1
            self.engine.pause()
            try:
                await self.engine.wait_idle()
                # No await between the idle check and the copy: no batch can start in between.
                self.engine.load_weights(named, version)
                server.relabel(version, label)
            finally:
                if not server.paused:
                    self.engine.resume()

    async def from_disk(self, request: Request) -> Response:
        body = await decode_body(request, UpdateWeightsFromDiskRequest)
        path = Path(body.model_path)
        if body.load_format not in (None, "auto", "safetensors"):
            raise BadRequest("load_format", "only safetensors checkpoints are supported")
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise BadRequest("model_path", f"no *.safetensors files in {str(path)!r}")
        from safetensors.torch import load_file

        named: dict[str, torch.Tensor] = {}
        for f in files:
            named.update(await asyncio.to_thread(load_file, str(f)))
        await self.swap(named, body)
        self._server.serve_path(body.model_path)
        message = "Succeeded to update model weights."
        return json_response(UpdateWeightsResponse(success=True, message=message, num_paused_requests=0))

    async def init_group(self, request: Request) -> Response:
        body = await decode_body(request, InitWeightsUpdateGroupRequest)
        address, port, offset = body.master_address, body.master_port, body.rank_offset
        world, name, backend = body.world_size, body.group_name, body.backend
        if name in self.groups:
            raise BadRequest("group_name", f"group {name!r} already exists")
        if not 0 < offset < world:
            raise BadRequest("rank_offset", f"must be in [1, world_size) = [1, {world})")
        if backend not in ("gloo", "nccl"):
            raise BadRequest("backend", "must be gloo or nccl")
        timeout = datetime.timedelta(seconds=self.group_timeout_s)
        try:
            group = await asyncio.to_thread(
                join_weight_update_group, address, port, offset, world, name, backend, timeout
            )
        except Exception as e:  # rendezvous failures are the caller's to fix; keep serving
            return bad_request("master_address", f"could not join group {name!r}: {e}")
        self.groups[name] = group
        return json_response(
            UpdateWeightsResponse(success=True, message="Succeeded to initialize custom process group.")
        )

    async def from_distributed(self, request: Request) -> Response:
        body = await decode_body(request, UpdateWeightsFromDistributedRequest)
        names, shapes, name = body.names, body.shapes, body.group_name
        group = self.groups.get(name)
        if group is None:
            raise BadRequest(
                "group_name", f"no weight update group named {name!r}; call /init_weights_update_group"
            )
        if not (len(names) == len(body.dtypes) == len(shapes)) or not names:
            raise BadRequest("names", "names, dtypes and shapes must be non-empty lists of one length")
        dtypes = [dtype_named(d) for d in body.dtypes]
        if body.load_format not in (None, "direct", "flattened_bucket"):
            raise BadRequest("load_format", "must be null or 'flattened_bucket'")
        receive = _receive_flat if body.load_format == "flattened_bucket" else _receive_each
        named = await asyncio.to_thread(receive, group, names, dtypes, shapes, self.device)
        await self.swap(named, body)
        return json_response(
            UpdateWeightsResponse(success=True, message="Succeeded to update parameter online.")
        )

    async def destroy_group(self, request: Request) -> Response:
        name = (await decode_body(request, DestroyWeightsUpdateGroupRequest)).group_name
        group = self.groups.pop(name, None)
        if group is None:
            raise BadRequest("group_name", f"no weight update group named {name!r}")
        dist.destroy_process_group(group)
        return json_response(
            UpdateWeightsResponse(success=True, message="Succeeded to destroy custom process group.")
        )

    async def from_tensor(self, request: Request) -> Response:
        body = await decode_body(request, UpdateWeightsFromTensorRequest)
        loaded = load_payload(body.serialized_named_tensors, "[(name, tensor), ...]", self.device)
        try:
            named = dict(loaded)
        except (TypeError, ValueError) as e:
            raise BadRequest("serialized_named_tensors", f"expected [(name, tensor), ...]: {e}") from None
        await self.swap(named, body)
        return json_response(UpdateWeightsResponse(success=True, message="Success"))


def load_payload(payloads: list[str], what: str, device: torch.device) -> object:
    """Entry 0 of a ``serialized_named_tensors`` list: base64 of ``torch.save(<what>)``, loaded with
    ``weights_only`` (tensors and plain containers, nothing else is unpickled). SGLang's own
    payloads (bare ``MultiprocessingSerializer`` pickles) are refused, never unpickled."""
    expected = f"entry 0 must be base64 of torch.save({what})"
    try:
        raw = base64.b64decode(payloads[0], validate=True)
        if not raw.startswith(_ZIP_MAGIC):  # torch.save writes a zip archive; a pickle is not one
            raise BadRequest(
                "serialized_named_tensors",
                f"{expected}; it is a bare pickle, as SGLang's MultiprocessingSerializer sends "
                "(tensors as CUDA IPC or shared-memory handles, meaningful only to a colocated "
                "process), which the embedded server does not unpickle",
            )
        return torch.load(io.BytesIO(raw), weights_only=True, map_location=device)
    except (
        IndexError, TypeError, ValueError, binascii.Error, RuntimeError, pickle.UnpicklingError
    ) as e:  # fmt: skip
        raise BadRequest("serialized_named_tensors", f"{expected}: {e}") from None


def _receive_flat(group, names, dtypes, shapes, device) -> dict[str, torch.Tensor]:
    """One broadcast of a flattened bucket (``load_format = "flattened_bucket"``), split by name."""
    total = sum(torch.Size(s).numel() for s in shapes)
    flat = torch.empty(total, dtype=bucket_dtype(dtypes), device=device)
    dist.broadcast(flat, src=0, group=group)
    return unflatten_bucket(flat, names, dtypes, shapes)


def _receive_each(group, names, dtypes, shapes, device) -> dict[str, torch.Tensor]:
    """One broadcast per tensor, all in flight at once."""
    named = {n: torch.empty(s, dtype=d, device=device) for n, d, s in zip(names, dtypes, shapes, strict=True)}
    for handle in [dist.broadcast(t, src=0, group=group, async_op=True) for t in named.values()]:
        handle.wait()
    return named
