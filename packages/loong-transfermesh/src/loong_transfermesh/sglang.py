"""Push named tensors into running SGLang servers through SGLang's own weight-update endpoints.

No ``import sglang``: this speaks SGLang's native HTTP API (the bodies are the Structs of
``loong_core.sglang_api``, field names as in SGLang's ``managers/io_struct.py``) and joins the
same ``torch.distributed`` group the server creates, so any training framework can drive any
SGLang server (or Loong's embedded server, which serves the same endpoints on CPU).

Protocol, for a trainer (rank 0) and ``n`` servers with ``r`` ranks each (tensor parallel size):
  1. ``POST /init_weights_update_group {master_address, master_port, rank_offset = 1 + i * r,
     world_size = 1 + n * r, group_name, backend}`` to every server while the trainer joins the
     rendezvous at ``tcp://master_address:master_port`` as rank 0 (every call blocks until all
     ranks joined). The rendezvous is the one SGLang uses: a TCP store hosted by rank 0, keys
     under ``group_name``, a process group built the way ``torch.distributed`` builds its own.
  2. Per update: ``POST /pause_generation``; per bucket ``POST /update_weights_from_distributed
     {names, dtypes, shapes, group_name, flush_cache: false, weight_version, load_format:
     "flattened_bucket"}`` while the trainer broadcasts the bucket from rank 0 (SGLang receives
     the broadcast inside that HTTP call); the last bucket carries ``weight_version``; then
     ``POST /flush_cache`` (when ``flush_cache``); ``POST /continue_generation``;
     ``GET /get_weight_version`` must read back the new version.
  3. ``POST /destroy_weights_update_group {group_name}``.

Cache flush: SGLang's scheduler flushes only when no request is queued or running, and after a
weight update with ``flush_cache: true`` it *asserts* the flush succeeded
(``scheduler_update_weights_mixin.py``), so an update while an ``in_place``/``retract`` pause
holds requests would kill the server. The update calls therefore never ask for the flush; the
pusher flushes through ``POST /flush_cache`` instead, which answers 400 (no crash) while
requests are held: those requests, and the radix cache, then keep KV computed under the old
weights (``cache_flushed`` records, per server, whether the last push flushed).

A flattened bucket (SGLang's ``flattened_bucket`` load format) is the concatenation of the
flattened tensors, in ``names`` order, as one 1-D tensor with no padding: tensor ``k`` occupies
elements ``[sum(numel[:k]), sum(numel[:k+1]))``. Its dtype is the promotion of the bucket's
dtypes, so buckets here hold one dtype each and every byte arrives unconverted (bit-exact).
``loong_transfermesh.manifest.build_manifest`` is not reused: its buckets are byte buffers with
64-byte-aligned offsets and mixed dtypes, which is not this wire format.

Backends: ``nccl`` (tensors are moved to the current CUDA device) or ``gloo`` (CPU) broadcast over
the group above. ``tensor`` needs no group: each bucket goes to ``POST /update_weights_from_tensor``
as SGLang's ``MultiprocessingSerializer`` sends it (base64 of a ``ForkingPickler`` pickle of the
``(name, tensor)`` list, once per tensor-parallel rank). For CUDA tensors that pickle carries CUDA
IPC handles, so a server on the same GPU (colocated) maps the trainer's memory and copies from it:
no byte leaves the device. CPU tensors cannot be shared that way with an unrelated process, so
they travel in the body as ``torch.save`` bytes, which only Loong's embedded server reads (the CPU
tests of this path).

Several servers, one group each (:class:`SGLangServers`): a single group ties every server's
fate to the slowest or deadest one (a broadcast waits for every rank). With a group per server,
pushes run side by side; a server that fails or dies mid-update fails only its own push, and a
server that comes back (restarted: it serves the checkpoint it was launched from) gets the
newest version through a fresh group (:meth:`SGLangServers.catch_up`). A server whose pusher
died mid-update (the trainer's process ended) holds the buckets that arrived, as SGLang
applies each on arrival, and stays paused: no request runs on the mix until a complete version
lands and ``/continue_generation`` comes with it.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import functools
import io
import itertools
import math
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import httpx
import msgspec
import torch
import torch.distributed as dist

from loong_core.net import free_port
from loong_core.sglang_api import (
    ContinueGenerationRequest,
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    LoadLoRAAdapterFromTensorsRequest,
    PauseGenerationRequest,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightsResponse,
    WeightVersionResponse,
)
from loong_transfermesh.config import SGLangPusherConfig

__all__ = [
    "SGLangServers",
    "SGLangUpdateError",
    "SGLangWeightPusher",
    "bucket_dtype",
    "dtype_field",
    "flatten_bucket",
    "join_weight_update_group",
    "plan_buckets",
    "serialize_tensors",
    "unflatten_bucket",
]


_JSON = {"content-type": "application/json"}


class SGLangUpdateError(RuntimeError):
    """A server refused or failed a weight-update call; the message is the server's."""


def join_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout: datetime.timedelta = datetime.timedelta(minutes=10),
) -> dist.ProcessGroup:
    """Join (rank 0: host) the rendezvous SGLang's ``/init_weights_update_group`` joins.

    A standalone group: no default process group is needed or touched, so a trainer that already
    runs its own ``torch.distributed`` world can add this one next to it.
    """
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    url = f"tcp://{master_address}:{master_port}"
    store, rank, world_size = next(rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def plan_buckets(named: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """Group names into buckets of one dtype and at most ``bucket_bytes`` (model order kept per dtype)."""
    open_: dict[torch.dtype, tuple[list[str], int]] = {}
    buckets: list[list[str]] = []
    for name, t in named.items():
        nbytes = t.numel() * t.element_size()
        names, size = open_.get(t.dtype, ([], 0))
        if names and size + nbytes > bucket_bytes:
            buckets.append(names)
            names, size = [], 0
        open_[t.dtype] = ([*names, name], size + nbytes)
    return buckets + [names for names, _ in open_.values()]


def flatten_bucket(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One 1-D tensor: the flattened ``tensors`` back to back (SGLang's flattened bucket)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def bucket_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """The dtype of a flattened bucket: the promotion of its tensors' dtypes."""
    return functools.reduce(torch.promote_types, dtypes)


def unflatten_bucket(
    flat: torch.Tensor, names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]
) -> dict[str, torch.Tensor]:
    """Views of ``flat`` (converted where a dtype differs from the bucket's), by name."""
    out, start = {}, 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        numel = math.prod(shape)
        out[name] = flat[start : start + numel].view(tuple(shape)).to(dtype)
        start += numel
    return out


def dtype_field(dtype: torch.dtype) -> str:
    """The dtype as SGLang's ``dtypes`` field spells it (``getattr(torch, name)`` inverts it)."""
    return str(dtype).removeprefix("torch.")


class SGLangWeightPusher:
    """Drives SGLang's weight-update endpoints on one or more servers.

    Lifecycle::

        pusher = SGLangWeightPusher(SGLangPusherConfig(urls=["http://10.0.0.2:30000"],
                                                       master_address="10.0.0.1", backend="nccl"))
        pusher.connect()                         # init_weights_update_group on every server
        for step in ...:
            pusher.push(model.state_dict(), version=step)   # pause, buckets, continue, verify
        pusher.close()                           # destroy_weights_update_group

    ``push_from_disk(path, version)`` needs no group (``/update_weights_from_disk``), nor do
    LoRA adapters (``load_adapter``, ``unload_adapter``: a server started with ``--enable-lora``).
    Not thread-safe: one update at a time.
    """

    def __init__(self, config: SGLangPusherConfig) -> None:
        self.config = config
        self._http = httpx.Client(headers=_auth(config), timeout=config.timeout_s)
        self._pool = ThreadPoolExecutor(max_workers=len(config.urls))
        self._group: dist.ProcessGroup | None = None
        self.cache_flushed: list[bool] = []  # per server (``urls`` order): did the last push flush?

    @property
    def world_size(self) -> int:
        return 1 + len(self.config.urls) * self.config.ranks_per_engine

    def connect(self) -> None:
        """Create the broadcast group: every server joins while this process hosts rank 0
        (nothing to create for the ``tensor`` backend)."""
        c = self.config
        if c.backend == "tensor":
            self._group = _NO_GROUP
            return
        calls = [
            self._post_async(
                url,
                "/init_weights_update_group",
                InitWeightsUpdateGroupRequest(
                    master_address=c.master_address,
                    master_port=c.master_port,
                    rank_offset=1 + i * c.ranks_per_engine,
                    world_size=self.world_size,
                    group_name=c.group_name,
                    backend=c.backend,
                ),
            )
            for i, url in enumerate(c.urls)
        ]
        timeout = datetime.timedelta(seconds=c.timeout_s)
        try:
            group = join_weight_update_group(
                c.master_address, c.master_port, 0, self.world_size, c.group_name, c.backend, timeout
            )
        finally:
            _results(calls)
        self._group = group

    def push(self, named: Mapping[str, torch.Tensor], version: int) -> None:
        """Broadcast ``named`` bucket by bucket; on return every server serves ``version``."""
        if self._group is None:
            raise RuntimeError("call connect() before push()")
        buckets = plan_buckets(named, self.config.bucket_bytes)
        with self._paused():
            for i, names in enumerate(buckets):
                last = i == len(buckets) - 1
                self._send_bucket([(n, named[n]) for n in names], str(version) if last else None)
            self.cache_flushed = (
                _results([self._pool.submit(self._flush, url) for url in self.config.urls])
                if self.config.flush_cache
                else []
            )
        self.check_version(version)

    def push_from_disk(self, model_path: str, version: int) -> None:
        """Have every server load a Hugging Face checkpoint directory it can read."""
        body = UpdateWeightsFromDiskRequest(model_path=model_path, weight_version=str(version))
        self._all("/update_weights_from_disk", body)
        self.check_version(version)

    def load_adapter(self, name: str, tensors: Mapping[str, torch.Tensor], config: dict[str, Any]) -> None:
        """Every server serves ``tensors`` as LoRA adapter ``name`` (``/load_lora_adapter_from_tensors``;
        ``config``: the PEFT ``adapter_config.json``, ``tensors``: PEFT's names). In memory: CUDA
        tensors travel as IPC handles (a server on the same GPU), CPU ones as ``torch.save`` bytes
        (Loong's embedded server); see :func:`serialize_tensors`. The tensors must stay alive until
        this returns."""
        payload = serialize_tensors({n: t.detach() for n, t in tensors.items()})
        body = LoadLoRAAdapterFromTensorsRequest(
            lora_name=name,
            config_dict=config,
            serialized_named_tensors=[payload] * self.config.ranks_per_engine,
        )
        self._all("/load_lora_adapter_from_tensors", body)

    def unload_adapter(self, name: str) -> None:
        """Every server stops taking requests for adapter ``name`` (``/unload_lora_adapter``)."""
        self._all("/unload_lora_adapter", UnloadLoRAAdapterRequest(lora_name=name))

    def check_version(self, version: int) -> None:
        for url in self.config.urls:
            answer = self._http.get(f"{url}/get_weight_version").raise_for_status().content
            got = msgspec.json.decode(answer, type=WeightVersionResponse).weight_version
            if got != str(version):
                raise SGLangUpdateError(f"{url} reports weight_version {got!r}, expected {version!r}")

    def close(self) -> None:
        """Destroy the group on the servers and here; the pusher can ``connect()`` again."""
        if self._group is _NO_GROUP:
            self._group = None
        if self._group is not None:
            try:
                self._all(
                    "/destroy_weights_update_group",
                    DestroyWeightsUpdateGroupRequest(group_name=self.config.group_name),
                )
            finally:
                dist.destroy_process_group(self._group)
                self._group = None

    def shutdown(self) -> None:
        self.close()
        self._pool.shutdown()
        self._http.close()

    def _send_bucket(self, items: list[tuple[str, torch.Tensor]], version: str | None) -> None:
        c = self.config
        if c.backend == "tensor":
            payload = serialize_tensors([(n, t.detach()) for n, t in items])
            body = UpdateWeightsFromTensorRequest(
                serialized_named_tensors=[payload] * c.ranks_per_engine,
                flush_cache=False,
                weight_version=version,
            )
            self._all("/update_weights_from_tensor", body)
            return
        body = UpdateWeightsFromDistributedRequest(
            names=[n for n, _ in items],
            dtypes=[dtype_field(t.dtype) for _, t in items],
            shapes=[list(t.shape) for _, t in items],
            group_name=c.group_name,
            flush_cache=False,  # SGLang asserts on a failed flush here; see _flush
            weight_version=version,
            load_format="flattened_bucket" if c.load_format == "flattened_bucket" else None,
        )
        device = "cuda" if c.backend == "nccl" else "cpu"
        if c.load_format == "flattened_bucket":
            sends = [flatten_bucket([t.detach() for _, t in items]).to(device)]
        else:
            sends = [t.detach().to(device).contiguous() for _, t in items]
        calls = [self._post_async(url, "/update_weights_from_distributed", body) for url in c.urls]
        try:
            for t in sends:
                dist.broadcast(t, src=0, group=self._group)
        finally:
            _results(calls)

    @contextlib.contextmanager
    def _paused(self) -> Iterator[None]:
        if not self.config.pause:
            yield
            return
        self._all("/pause_generation", PauseGenerationRequest(mode=self.config.pause_mode))
        try:
            yield
        finally:
            self._all("/continue_generation", ContinueGenerationRequest())

    def _flush(self, url: str) -> bool:
        """``POST /flush_cache``: True once flushed, False when the server still holds requests
        (SGLang answers 400 then and keeps serving); any other failure raises."""
        response = self._http.post(f"{url}/flush_cache")
        if response.status_code in (200, 400):
            return response.status_code == 200
        raise SGLangUpdateError(f"{url}/flush_cache: HTTP {response.status_code}: {response.text}")

    def _all(self, path: str, body: msgspec.Struct) -> None:
        _results([self._post_async(url, path, body) for url in self.config.urls])

    def _post_async(self, url: str, path: str, body: msgspec.Struct) -> Future:
        return self._pool.submit(self._post, url, path, body)

    def _post(self, url: str, path: str, body: msgspec.Struct) -> None:
        """POST ``body``; a non-200, or a 200 with ``success: false``, raises with the server's message."""
        response = self._http.post(f"{url}{path}", content=msgspec.json.encode(body), headers=_JSON)
        answer = _update_answer(response.content)
        if response.status_code != 200 or (answer is not None and not answer.success):
            message = (answer.message if answer else "") or response.text
            raise SGLangUpdateError(f"{url}{path}: HTTP {response.status_code}: {message}")


class SGLangServers:
    """A trainer's direct line to several SGLang servers: one :class:`SGLangWeightPusher`, and
    one weight-update group, per server (``config.urls``), pushed to side by side.

    ::

        servers = SGLangServers(SGLangPusherConfig(urls=[a, b], master_address="10.0.0.1"))
        failed = servers.push(named, version=3)   # {url: error} of the servers that failed
        servers.catch_up(named, version=3)        # servers behind (failed, restarted) get it now
        servers.close()

    Each server's group has its own rendezvous port (a free one on ``master_address``, picked
    per connection; ``config.master_port`` is not used) and group name (``config.group_name``,
    a random tag of this object, the server's index and a connection count: a group that a dead
    trainer left on a server never clashes with a new one). ``push`` returns when every
    server's push ended (a dead server's fails as soon as its connection breaks, or after
    ``timeout_s``). A server whose push failed while it stayed up resumes serving, the buckets
    that landed included, under its previous version label until ``catch_up``. ``versions``
    holds the version each server confirmed last (None: unknown, after a failure). Not
    thread-safe: one call at a time.

    ``initial_version``: the version of the checkpoint the servers were launched from, which a
    server that has had no update reports as ``"default"`` (SGLang's label before the first one);
    ``catch_up`` leaves such a server alone while ``initial_version`` is the one to serve.
    """

    def __init__(self, config: SGLangPusherConfig, initial_version: int = 0) -> None:
        self.config = config
        self.initial_version = initial_version
        self.urls = list(config.urls)
        self._pushers: dict[str, SGLangWeightPusher] = {}
        self._pool = ThreadPoolExecutor(max_workers=len(self.urls), thread_name_prefix="sglang-push")
        self._connections = itertools.count(1)
        self._tag = uuid.uuid4().hex[:8]
        self._joining = threading.Lock()  # torch's process-group registry is not thread-safe
        self.versions: dict[str, int | None] = dict.fromkeys(self.urls)

    def push(self, named: Mapping[str, torch.Tensor], version: int) -> dict[str, str]:
        """Push ``named`` as ``version`` to every server at once (connecting where needed);
        returns the servers that failed, with why. The others serve ``version`` on return. A
        server that reports another version than it confirmed last (it restarted: its group died
        with it) is reconnected through a fresh group first."""
        return self._push(self.urls, named, version)

    def catch_up(self, named: Mapping[str, torch.Tensor], version: int) -> dict[str, str]:
        """Push ``version`` to each server that answers with another version (a failed push, a
        restart), through a fresh group; returns the servers that failed, with why. A server that
        does not answer (down, or still starting) is left for a later call."""
        labels = self._labels()
        for url, label in labels.items():
            if label in self._current(version):
                self.versions[url] = version
        return self._push(self._behind(labels, version), named, version)

    def behind(self, version: int, timeout_s: float | None = None) -> list[str]:
        """The servers that answer ``/get_weight_version`` (within ``timeout_s``; default: the
        config's) with another version than ``version``."""
        return self._behind(self._labels(timeout_s), version)

    def close(self) -> None:
        for url in list(self._pushers):
            self._drop(url)
        self._pool.shutdown()

    def _current(self, version: int) -> set[str]:
        """The labels a server serving ``version`` may report (``"default"``: the launch checkpoint)."""
        return {str(version)} | ({"default"} if version == self.initial_version else set())

    def _behind(self, labels: dict[str, str | None], version: int) -> list[str]:
        current = self._current(version)
        return [url for url, label in labels.items() if label is not None and label not in current]

    def _labels(self, timeout_s: float | None = None) -> dict[str, str | None]:
        """What every server reports as its version (None: no answer), asked side by side."""
        ask = functools.partial(self._served, timeout_s=timeout_s)
        return dict(zip(self.urls, self._pool.map(ask, self.urls), strict=True))

    def _push(self, urls: list[str], named: Mapping[str, torch.Tensor], version: int) -> dict[str, str]:
        labels = dict(zip(urls, self._pool.map(self._served, urls), strict=True))
        for url in urls:
            if url in self._pushers and labels[url] != str(self.versions[url]):
                self._drop(url)  # restarted, or down: its group is gone
        groups = {url: self._group_name(url) for url in urls if url not in self._pushers}
        calls = {
            url: self._pool.submit(
                self._push_one, url, groups.get(url), labels[url] is not None, named, version
            )
            for url in urls
        }
        wait(calls.values())  # every push ended before any failed one is torn down
        failed = {}
        for url, call in calls.items():
            if (error := call.exception()) is not None:
                failed[url] = f"{type(error).__name__}: {error}"
                self.versions[url] = None
                self._drop(url)
            else:
                self.versions[url] = version
        return failed

    def _group_name(self, url: str) -> str:
        return f"{self.config.group_name}-{self._tag}-{self.urls.index(url)}-{next(self._connections)}"

    def _push_one(
        self, url: str, group: str | None, answers: bool, named: Mapping[str, torch.Tensor], version: int
    ) -> None:
        if group is not None:  # no pusher yet: connect one (``_push`` named its new group)
            if not answers:  # a rendezvous would wait timeout_s for a dead server
                raise SGLangUpdateError(f"{url} does not answer /get_weight_version: not connecting")
            self._pushers[url] = self._connect(url, group)
        self._pushers[url].push(named, version)

    def _connect(self, url: str, group: str) -> SGLangWeightPusher:
        c = self.config
        port = free_port(c.master_address)
        pusher = SGLangWeightPusher(
            msgspec.structs.replace(c, urls=[url], master_port=port, group_name=group)
        )
        try:
            with self._joining:
                pusher.connect()
        except BaseException:
            pusher.shutdown()
            raise
        return pusher

    def _served(self, url: str, timeout_s: float | None = None) -> str | None:
        """The version ``url`` reports; None when it does not answer (within ``timeout_s``)."""
        try:
            answer = httpx.get(
                f"{url}/get_weight_version",
                headers=_auth(self.config),
                timeout=self.config.timeout_s if timeout_s is None else timeout_s,
            )
            return msgspec.json.decode(
                answer.raise_for_status().content, type=WeightVersionResponse
            ).weight_version
        except (httpx.HTTPError, msgspec.DecodeError):
            return None

    def _drop(self, url: str) -> None:
        """Forget ``url``'s pusher: its group is destroyed where the server still answers."""
        pusher = self._pushers.pop(url, None)
        if pusher is None:
            return
        with contextlib.suppress(SGLangUpdateError, httpx.HTTPError, RuntimeError):
            pusher.close()
        pusher.shutdown()


_NO_GROUP: Any = object()  # a connected ``tensor`` pusher: no process group to broadcast over


def serialize_tensors(named: list[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]) -> str:
    """``named`` as ``/update_weights_from_tensor`` (a list of pairs) and
    ``/load_lora_adapter_from_tensors`` (a dict) take it, base64 text: CUDA tensors as SGLang's
    ``MultiprocessingSerializer`` pickles them (CUDA IPC handles: the receiver must be on the same
    GPU, and the tensors must stay alive until it answered), CPU tensors as ``torch.save`` bytes
    (Loong's embedded server)."""
    devices = {t.device.type for t in (named.values() if isinstance(named, dict) else (t for _, t in named))}
    if devices == {"cuda"}:
        from multiprocessing.reduction import ForkingPickler

        from torch.multiprocessing.reductions import init_reductions

        init_reductions()  # torch's reducers (CUDA IPC handles) in ForkingPickler

        buffer = io.BytesIO()
        ForkingPickler(buffer).dump(named)
    elif devices <= {"cpu"}:
        buffer = io.BytesIO()
        torch.save(named, buffer)
    else:
        raise ValueError(
            f"tensors of one update must all be on CUDA or all on the CPU, got {sorted(devices)}"
        )
    return base64.b64encode(buffer.getvalue()).decode()


def _auth(config: SGLangPusherConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}


def _update_answer(content: bytes) -> UpdateWeightsResponse | None:
    """``content`` as a weight-update answer; None for other bodies (``/pause_generation``'s, text)."""
    try:
        return msgspec.json.decode(content, type=UpdateWeightsResponse)
    except msgspec.DecodeError:
        return None


def _results(calls: list[Future]) -> list[Any]:
    """Wait for every call, then raise the first failure (no call is left running)."""
    errors = [f.exception() for f in calls]
    for e in errors:
        if e is not None:
            raise e
    return [f.result() for f in calls]
