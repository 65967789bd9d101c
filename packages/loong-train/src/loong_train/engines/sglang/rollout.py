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
"nccl"`` (the worker itself must then see a GPU; ``gloo`` moves the broadcast through host memory,
which SGLang's servers accept too). Costs: the host copy holds the full policy in the trainer's
dtype on every worker, and every update crosses host memory twice (shared memory, then the
broadcast); a direct trainer-to-server NCCL broadcast is not wired into the controller yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import threading
from pathlib import Path
from typing import Literal

import httpx
import msgspec

from loong_agentflow.sglang_client import SGLangClientConfig, SGLangEngine
from loong_core.config import is_loopback
from loong_core.protocols import SamplingParams
from loong_core.records import TokenSpan
from loong_train.engines.sglang.supervisor import (
    SGLangServerConfig,
    SGLangSupervisor,
    sglang_launch_command,
)
from loong_train.models.qwen3 import Qwen3ForCausalLM
from loong_transfermesh import SGLangPusherConfig, SGLangUpdateError, SGLangWeightPusher

__all__ = ["SGLangRollout", "SGLangRolloutConfig"]


class SGLangRolloutConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The ``[sglang]`` table: how each rollout worker launches and drives its server.

    - ``launcher``: ``"sglang"`` (SGLang's server, GPU) or ``"loong"`` (``loong-train serve-sglang``,
      CPU; the default, so ``--set rollout.engine=sglang`` runs anywhere).
    - ``python``: the interpreter that runs the launcher (empty: this one). ``command``: replaces
      the launcher entirely (e.g. a container wrapper); the standard flags are still appended.
    - ``args``: extra server flags, appended last (e.g. ``["--context-length", "8192"]``).
    - ``host``, ``port_base`` (worker ``i`` listens on ``port_base + i``), ``api_key`` (required
      when ``host`` is not loopback).
    - ``gpus``: GPUs Ray reserves for each rollout worker; its server sees exactly those
      (fractions share a GPU with other actors). ``tp_size``: SGLang's tensor parallelism
      (``gpus`` must cover it). ``mem_fraction_static``: SGLang's static memory share (0: its default).
    - ``startup_timeout_s``, ``health_interval_s``, ``health_failures``, ``max_restarts``: the
      supervisor's policy (:class:`~loong_train.engines.sglang.supervisor.SGLangServerConfig`).
    - ``update_backend``: ``"gloo"`` (host memory; works everywhere) or ``"nccl"`` (the worker
      needs a GPU of its own). ``bucket_mb``: one broadcast's size bound.
    """

    launcher: Literal["sglang", "loong"] = "loong"
    python: str = ""
    command: list[str] = []
    args: list[str] = []
    host: str = "127.0.0.1"
    port_base: int = 30000
    api_key: str = ""
    gpus: float = 0.0
    tp_size: int = 1
    mem_fraction_static: float = 0.0
    startup_timeout_s: float = 900.0
    health_interval_s: float = 5.0
    health_failures: int = 3
    max_restarts: int = 3
    update_backend: Literal["gloo", "nccl"] = "gloo"
    bucket_mb: float = 512.0

    def __post_init__(self) -> None:
        if not is_loopback(self.host) and not self.api_key:
            raise ValueError(f"host {self.host!r} is not loopback: set api_key")
        if self.tp_size < 1 or not 0 <= self.mem_fraction_static < 1:
            raise ValueError("tp_size must be >= 1 and mem_fraction_static in [0, 1)")
        if self.launcher == "loong" and (self.tp_size != 1 or self.mem_fraction_static):
            raise ValueError(
                "tp_size and mem_fraction_static are SGLang flags: they need launcher = 'sglang'"
            )
        if problem := _gpu_problem(self):
            raise ValueError(problem)

    def server(self, model_path: str, worker_id: int, log_dir: str, seed: int) -> SGLangServerConfig:
        """The supervisor's config for worker ``worker_id``."""
        python = self.python or sys.executable
        env: dict[str, str] = {}
        if self.launcher == "sglang":
            launcher = sglang_launch_command(python)
            flags = ["--tp-size", str(self.tp_size), "--random-seed", str(seed), "--skip-tokenizer-init"]
            if self.mem_fraction_static:
                flags += ["--mem-fraction-static", str(self.mem_fraction_static)]
            env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] = "false"  # see the module docstring
        else:
            launcher = [python, "-m", "loong_train.cli", "serve-sglang"]
            flags = ["--seed", str(seed), "--threads", "1"]
        return SGLangServerConfig(
            model_path=model_path,
            command=self.command or launcher,
            host=self.host,
            port=self.port_base + worker_id,
            api_key=self.api_key or None,
            args=[*flags, *self.args],
            env=env,
            log_path=str(Path(log_dir) / f"sglang-{worker_id}.log") if log_dir else "",
            startup_timeout_s=self.startup_timeout_s,
            health_interval_s=self.health_interval_s,
            health_failures=self.health_failures,
            max_restarts=self.max_restarts,
        )


def _gpu_problem(c: SGLangRolloutConfig) -> str:
    if c.gpus < 0 or (c.gpus > 1 and c.gpus % 1):
        return f"gpus must be a fraction of one GPU or a whole number, got {c.gpus}"
    if c.launcher == "sglang" and (c.gpus == 0 or (c.tp_size > 1 and c.gpus < c.tp_size)):
        return (
            f"gpus = {c.gpus}: launcher 'sglang' needs a GPU per tensor-parallel rank "
            f"(tp_size = {c.tp_size}); launcher 'loong' runs on CPU"
        )
    return ""


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
    between rollout calls only (``mid_call_updates``).
    """

    mid_call_updates = False

    def __init__(
        self, model_path: str, config: SGLangRolloutConfig, *, worker_id: int, log_dir: str, seed: int
    ) -> None:
        self.config = config
        self.model = Qwen3ForCausalLM.from_pretrained(model_path)  # the host copy TransferMesh fills
        self._version = 0
        self._pusher: SGLangWeightPusher | None = None
        self._push_lock = threading.Lock()  # updates come from the worker and the supervisor
        self.supervisor = SGLangSupervisor(
            config.server(model_path, worker_id, log_dir, seed), on_restart=self._push_again
        )
        self.supervisor.start()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang-client", daemon=True)
        self._thread.start()
        self.client = SGLangEngine(
            SGLangClientConfig(url=self.supervisor.url, api_key=config.api_key or None)
        )

    @property
    def weight_version(self) -> int:
        return self._version

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> TokenSpan:
        self.supervisor.check()
        call = asyncio.run_coroutine_threadsafe(self.client.generate(input_ids, sampling), self._loop)
        return await asyncio.wrap_future(call)

    def check(self) -> None:
        """Raise if the supervisor gave up on the server."""
        self.supervisor.check()

    def pause(self) -> None:
        self.client.pause()

    def resume(self) -> None:
        self.client.resume()

    def set_version(self, version: int) -> None:
        """The host copy now holds ``version``: push it into the server, which then serves it."""
        with self._push_lock:
            self._push(version)

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
                    master_port=_free_port(),
                    backend=self.config.update_backend,
                    ranks_per_engine=self.config.tp_size,
                    bucket_bytes=int(self.config.bucket_mb * (1 << 20)),
                    api_key=self.config.api_key or None,
                )
            )
            self._pusher.connect()
        self._pusher.push(dict(self.model.named_parameters()), version)
        self._version = version

    def _push_again(self) -> None:
        """After a restart: the old group died with the old server; rebuild it and push the
        current version (nothing to push while the server's checkpoint is still current)."""
        with self._push_lock:
            self._drop_pusher()
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
