"""The ``sglang`` rollout engine: a supervised SGLang server per rollout worker.

A recipe with ``[rollout] engine = "sglang"`` gives each rollout worker an :class:`SGLangRollout`
instead of the embedded engine:

- the worker launches its own server through :class:`~loong_train.engines.sglang.supervisor.SGLangSupervisor`
  (health checks, restarts, ``<run>/logs/sglang-<worker>.log``), on port ``port_base + worker``;
- episodes generate through :class:`loong_agentflow.SGLangEngine` (native ``/generate`` with token
  ids and logprobs; spans carry the server's ``weight_version``);
- weights arrive as before, through TransferMesh, into ``model``: a host copy of the policy with
  the trainer's names, shapes and dtypes (the embedded engine's own model plays this role). Then
  ``set_version(v)`` pushes that copy into the server with
  :class:`loong_transfermesh.SGLangWeightPusher` (pause, ``update_weights_from_distributed`` over a
  ``gloo`` or ``nccl`` group that this worker hosts as rank 0, continue, read the version back).
  After a restart the supervisor's hook pushes the current version again, since a relaunched
  server serves the checkpoint it was started from.

Launchers: ``"sglang"`` runs ``python -m sglang.launch_server`` (``python`` may be another
environment's interpreter: SGLang pins its own torch) with ``--tp-size``, ``--skip-tokenizer-init``
(token ids in and out), ``--random-seed`` and, when set, ``--mem-fraction-static``; the server sees
the GPUs Ray gave the worker (``gpus`` per worker, ``CUDA_VISIBLE_DEVICES`` inherited). It runs
with ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false``: by default SGLang's ``/health`` generates
a token, and while a weight update holds the server paused that request waits for
``/continue_generation`` (``TokenizerManager.generate_request`` waits on the pause), so a long
update would read as failed health checks and the supervisor would relaunch the server mid-update.
With the variable off, ``/health`` answers 503 until the server is up, then 200 (no generation).
``"loong"`` runs ``loong-train serve-sglang``: the embedded engine behind the same HTTP API, on
CPU, so this whole path runs in CPU tests and on machines without SGLang.

What needs a GPU: the ``sglang`` launcher (SGLang's server needs CUDA) and ``update_backend =
"nccl"`` (the pushing process must then see a GPU; ``gloo`` moves the broadcast through host
memory, which SGLang's servers accept too). Costs of the host copy: the full policy in the
trainer's dtype on every worker, and every update crosses host memory twice (shared memory, then
the broadcast).

LoRA (``[train.lora] sync = "adapter"``): no host copy of the model. The worker holds the adapter
alone (``adapter``: float32 buffers, as the trainer sends them), the server starts with
``--enable-lora`` (rank and target modules from ``[train.lora]``), and ``set_version(v)`` loads the
buffers as adapter ``loong-v<v>`` through SGLang's ``/load_lora_adapter_from_tensors``, points
the client's requests at it (``lora_path``; their tokens carry ``v``) and unloads the previous
one. The adapter travels in memory: for ``launcher = "sglang"`` as CUDA IPC handles (the worker
sees its server's GPU; SGLang's server opens them there), for ``launcher = "loong"`` as
``torch.save`` bytes in the request, which only Loong's stand-in reads (SGLang's own server has
no CPU path for adapter tensors but ``/load_lora_adapter`` from a directory, which Loong does
not use). Base weights never change.
A relaunched server serves no adapter: the supervisor's hook loads the current one again, and a
request that reaches the server before it is refused (400), never sampled with the base model.

``weights = "direct"`` removes both: the trainer pushes into every server itself
(:class:`loong_transfermesh.SGLangServers`, see :mod:`loong_train.workers.trainer`) and catches
up a server that restarted; this engine loads no model (``model`` is None) and ``set_version(v)``
only waits until its server reports ``v`` or newer. The trainer pauses a server with SGLang's
``abort`` mode: running requests return early and the client continues each one with its tokens
so far (:class:`loong_agentflow.SGLangEngine`), so every token carries the version that made it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import httpx
import torch

from loong_agentflow.sglang_client import SGLangClientConfig, SGLangEngine, SGLangError
from loong_core.net import free_port
from loong_core.protocols import SamplingParams
from loong_core.records import TokenSpan
from loong_train.engines.config import SGLangEngineConfig
from loong_train.engines.sglang.supervisor import SGLangSupervisor
from loong_train.models.adapters import PEFT_PREFIX, adapted_modules, read_adapter
from loong_train.models.auto import load_causal_lm, skeleton
from loong_transfermesh import (
    SGLangPusherConfig,
    SGLangUpdateError,
    SGLangWeightPusher,
    adapter_shapes,
    copy_adapter,
)

if TYPE_CHECKING:
    from loong_train.backends.config import LoraConfig

__all__ = ["SGLangRollout"]

log = logging.getLogger("loong.sglang")


class SGLangRollout:
    """A ``RolloutEngine`` over a supervised server, fed weights through a host copy.

    Lifecycle (what a rollout worker does)::

        engine = SGLangRollout(model_path, config, worker_id=0, log_dir="runs/x/logs", seed=0)
        span = await engine.generate(ids, sampling)        # from any event loop
        receiver.apply(dict(engine.model.named_parameters()), version=v)
        engine.set_version(v)                              # push to the server
        engine.close()                                     # stops the server

    Generation runs on an event loop of its own, in a thread, so callers may use ``asyncio.run``
    per call (the white-box runner) or a long-lived loop (the black-box proxy) alike. Updates land
    between rollout calls only (``mid_call_updates``); with ``weights = "direct"`` the trainer
    lands them whenever it publishes, and requests cut by one continue (module docstring).
    """

    mid_call_updates = False

    def __init__(
        self,
        model_path: str,
        config: SGLangEngineConfig,
        *,
        worker_id: int,
        log_dir: str,
        seed: int,
        trust_remote_code: bool = False,
        version: int = 0,
        lora: LoraConfig | None = None,
        adapter: str = "",
    ) -> None:
        """``version``: the version of the checkpoint at ``model_path`` (a resumed run's).
        ``lora``: updates are adapters alone, served through SGLang's LoRA API (``adapter``: the
        resumed checkpoint's, loaded at ``version``)."""
        self.config = config
        self.direct = config.weights == "direct"
        # what TransferMesh fills: the adapter (LoRA), or a host copy of the model (neither when
        # the trainer pushes into the server itself)
        self.model, self.adapter, self._served_adapter = None, None, ""
        lora_flags = {}
        if lora is not None and not self.direct:
            self.adapter, self._adapter_config = _adapter_buffers(
                model_path, lora, trust_remote_code, adapter
            )
            lora_flags = {"lora_rank": lora.rank, "lora_modules": self._adapter_config["target_modules"]}
        elif not self.direct:
            self.model = load_causal_lm(model_path, trust_remote_code)
        self._version = 0
        self._pusher: SGLangWeightPusher | None = None
        self._push_lock = threading.Lock()  # updates come from the worker and the supervisor
        self.supervisor = SGLangSupervisor(
            config.server(model_path, worker_id, log_dir, seed, trust_remote_code, **lora_flags),
            on_restart=self._push_again,
        )
        self.supervisor.start()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang-client", daemon=True)
        self._thread.start()
        self.client = SGLangEngine(
            SGLangClientConfig(
                url=self.supervisor.url, api_key=config.api_key or None, initial_version=version
            )
        )

    @property
    def weight_version(self) -> int:
        return self._version

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> TokenSpan:
        self.supervisor.check()
        call = asyncio.run_coroutine_threadsafe(self.client.generate(input_ids, sampling), self._loop)
        return await asyncio.wrap_future(call)

    async def stream(self, input_ids: list[int], sampling: SamplingParams) -> AsyncIterator[TokenSpan]:
        """The client's ``stream``, run on the client's loop and handed to the caller's as it comes;
        closing it early closes the server's stream (SGLang aborts the request)."""
        self.supervisor.check()
        here, queue = asyncio.get_running_loop(), asyncio.Queue()
        done = object()

        async def pump() -> None:
            try:
                async for delta in self.client.stream(input_ids, sampling):
                    here.call_soon_threadsafe(queue.put_nowait, delta)
            except BaseException as e:  # the caller's stream raises it
                here.call_soon_threadsafe(queue.put_nowait, e)
                raise
            here.call_soon_threadsafe(queue.put_nowait, done)

        call = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := await queue.get()) is not done:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            call.cancel()

    def check(self) -> None:
        """Raise if the supervisor gave up on the server."""
        self.supervisor.check()

    def pause(self) -> None:
        self.client.pause()

    def resume(self) -> None:
        self.client.resume()

    def set_version(self, version: int) -> None:
        """The host copy (LoRA: the adapter) now holds ``version``: push it into the server, which
        then serves it. Direct weights: wait until the server reports ``version`` or newer (the
        trainer pushed it, or catches a restarted server up), for at most ``startup_timeout_s``."""
        if self.direct:
            self._wait_for(version)
            return
        with self._push_lock:
            self._push(version)

    def _wait_for(self, version: int) -> None:
        deadline, pause = time.monotonic() + self.config.startup_timeout_s, 0.01
        while True:
            self.supervisor.check()
            with contextlib.suppress(SGLangError, httpx.HTTPError):
                call = asyncio.run_coroutine_threadsafe(self.client.refresh_version(), self._loop)
                if (served := call.result()) >= version:
                    self._version = served
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"server {self.supervisor.url} did not report weight version {version} within "
                    f"{self.config.startup_timeout_s:.0f} s (the trainer pushes it with weights = 'direct')"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.5)

    def close(self) -> None:
        """Destroy the update group, close the client, stop the server."""
        with self._push_lock:
            self._drop_pusher()
        asyncio.run_coroutine_threadsafe(self.client.aclose(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self.supervisor.stop()

    def _push(self, version: int) -> None:
        if self._pusher is None:
            self._pusher = SGLangWeightPusher(
                SGLangPusherConfig(
                    urls=[self.supervisor.url],
                    master_port=free_port(),
                    # adapters need no broadcast group: they travel in the request
                    backend="tensor" if self.adapter is not None else self.config.update_backend,
                    ranks_per_engine=self.config.tp_size,
                    bucket_bytes=int(self.config.bucket_mb * (1 << 20)),
                    api_key=self.config.api_key or None,
                )
            )
            self._pusher.connect()
        if self.adapter is not None:
            self._push_adapter(version)
        else:
            self._pusher.push(dict(self.model.named_parameters()), version)
        self._version = version

    def _push_adapter(self, version: int) -> None:
        """Serve the adapter buffers as ``loong-v<version>``, send new requests to it, unload the
        previous one (updates land between rollout calls, so no request still uses it)."""
        name, previous = f"loong-v{version}", self._served_adapter
        # SGLang's server opens CUDA IPC handles; the CPU stand-in reads torch.save bytes
        on_gpu = self.config.launcher == "sglang" and torch.cuda.is_available()
        tensors = {PEFT_PREFIX + n: t.to("cuda" if on_gpu else "cpu") for n, t in self.adapter.items()}
        self._pusher.load_adapter(name, tensors, self._adapter_config)
        self.client.use_adapter(name, version)
        self._served_adapter, self._version = name, version
        if previous:
            try:
                self._pusher.unload_adapter(previous)
            except (SGLangUpdateError, httpx.HTTPError) as e:  # it only holds server memory
                log.warning("could not unload adapter %s from %s: %s", previous, self.supervisor.url, e)

    def _push_again(self) -> None:
        """After a restart: the old group died with the old server; rebuild it and push the
        current version (nothing to push while the server's checkpoint is still current; with
        direct weights the trainer catches the server up)."""
        if self.direct:
            return
        with self._push_lock:
            self._drop_pusher()
            self._served_adapter = ""  # a relaunched server serves no adapter
            if self._version != 0:
                self._push(self._version)

    def _drop_pusher(self) -> None:
        if self._pusher is None:
            return
        # a relaunched server has no group to destroy; a dead one does not answer
        with contextlib.suppress(SGLangUpdateError, httpx.HTTPError):
            self._pusher.close()
        self._pusher.shutdown()
        self._pusher = None


def _adapter_buffers(
    model_path: str, lora: LoraConfig, trust_remote_code: bool, checkpoint: str
) -> tuple[dict[str, torch.Tensor], dict]:
    """Float32 buffers for every adapter tensor ``[train.lora]`` gives the model (zeros, or the
    adapter saved in ``checkpoint``), and the PEFT config SGLang loads them with. Only the
    model's layout is read (its skeleton: no weights)."""
    model = skeleton(model_path, trust_remote_code)
    modules, transposed = adapted_modules(model, lora.target_modules)
    shapes = adapter_shapes(dict(model.named_parameters()), modules, lora.rank, transposed)
    buffers = {name: torch.zeros(shape) for name, shape in shapes.items()}
    if checkpoint:
        try:
            copy_adapter(buffers, read_adapter(checkpoint))
        except ValueError as e:
            raise ValueError(f"{checkpoint}: {e}") from None
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.scale * lora.rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}),
    }
    return buffers, config
