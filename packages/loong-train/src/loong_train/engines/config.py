"""The ``[rollout.engine]`` table: which engine a rollout worker generates with, picked by ``type``.

- ``type = "embedded"`` (:class:`EmbeddedEngineConfig`): the torch engine inside the worker
  (:mod:`loong_train.engines.embedded`);
- ``type = "sglang"`` (:class:`SGLangEngineConfig`): a supervised SGLang server per worker
  (:mod:`loong_train.engines.sglang`).

Pure msgspec (no torch): recipes validate without loading an engine.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import msgspec

from loong_core.config import is_loopback
from loong_train.engines.sglang.supervisor import SGLangServerConfig, sglang_launch_command
from loong_transfermesh.config import SGLangPusherConfig

__all__ = ["EmbeddedEngineConfig", "EngineConfig", "SGLangEngineConfig"]


class _Engine(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type"):
    @property
    def type(self) -> str:
        """The table's ``type`` (the Struct's tag)."""
        return str(type(self).__struct_config__.tag)


class EmbeddedEngineConfig(_Engine, tag="embedded"):
    """``[rollout.engine] type = "embedded"``: the torch engine in the rollout worker's process.

    ``partial``: what a weight update does to a running rollout call
    (:mod:`loong_train.engines.embedded.host`): ``"off"`` waits for the call to end (no generation
    sees two versions), ``"continue"`` pauses the engine between decode steps, swaps and goes on
    (tokens keep per-token versions), ``"restart"`` also reruns, from the prompt, episodes older
    than the window can still train (white-box agents only).

    ``concurrent_calls``: rollout calls a worker runs at once (white-box agents only). Their
    episodes share the engine's running batch, so while one call's episodes wait on tools the
    others keep the engine busy; the pipeline keeps one more call queued per worker. 1 (the
    default): one call at a time. Pair it with ``partial = "continue"``: with ``"off"`` every
    update waits until no call runs, which drains the engine once per train step.

    ``dtype``: the engine's weights, activations and KV cache. ``"bfloat16"`` runs about twice as
    fast as float32 on a CPU with native bfloat16 products (AVX512-BF16 or AMX) and several times
    slower on one without; ``"auto"`` picks bfloat16 where the CPU has them, float32 elsewhere.
    The trainer stays float32 and each update is rounded to bfloat16 as it lands (the rollout
    worker receives it into a float32 copy of the weights: 1.5x a float32 engine's weight memory),
    so rollout and trainer logprobs differ by bfloat16 rounding (step 1's ``mismatch_kl``:
    docs/speed.md).
    """

    partial: Literal["off", "continue", "restart"] = "off"
    concurrent_calls: int = 1
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"

    def __post_init__(self) -> None:
        if self.concurrent_calls < 1:
            raise ValueError(f"concurrent_calls must be >= 1, got {self.concurrent_calls}")

    @property
    def gpus(self) -> float:
        """GPUs Ray reserves for the worker: none (the embedded engine runs on CPU)."""
        return 0.0

    @property
    def weights(self) -> Literal["worker"]:
        """Updates reach the engine through its worker (``SGLangEngineConfig.weights``)."""
        return "worker"


class SGLangEngineConfig(_Engine, tag="sglang"):
    """``[rollout.engine] type = "sglang"``: a supervised SGLang server per rollout worker
    (:mod:`loong_train.engines.sglang.rollout`), and how each worker launches and drives it.

    - ``launcher``: ``"sglang"`` (SGLang's server, GPU) or ``"loong"`` (``loong-train serve-sglang``,
      CPU; the default, so ``--set rollout.engine.type=sglang`` runs anywhere).
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
    - ``weights``: how updates reach the servers. ``"worker"``: each rollout worker holds a host
      copy of the policy, receives every update into it over TransferMesh and pushes it into its
      server; an update lands between rollout calls. ``"direct"``: the trainer pushes into every
      server itself (:class:`loong_transfermesh.SGLangServers`, one weight-update group per
      server) and catches up a restarted one; workers hold no copy and only wait until their
      server reports the version. Requests running on a server when an update lands end early
      (SGLang's ``abort`` pause) and the client continues each from its tokens so far, so every
      token carries the version that produced it (partial rollouts); an evaluation holds the
      trainer's next step back until it ends, so it runs at one version.
    - ``update_backend``: ``"gloo"`` (host memory; works everywhere), ``"nccl"`` (the process
      that pushes needs a GPU of its own) or ``"tensor"`` (direct weights only: CUDA IPC handles
      into a server on the trainer's GPU, colocated; on CPU the tensors travel in the request,
      which only ``launcher = "loong"`` reads). ``bucket_mb``: one update call's size bound.
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
    weights: Literal["worker", "direct"] = "worker"
    update_backend: Literal["gloo", "nccl", "tensor"] = "gloo"
    bucket_mb: float = 512.0

    @property
    def partial(self) -> Literal["off"]:
        """A server's updates land between rollout calls only (``EmbeddedEngineConfig.partial``)."""
        return "off"

    @property
    def concurrent_calls(self) -> int:
        """A server's worker runs one rollout call at a time (``EmbeddedEngineConfig.concurrent_calls``)."""
        return 1

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
        if self.update_backend == "tensor" and self.weights != "direct":
            raise ValueError(
                'update_backend = "tensor" hands the trainer\'s tensors to the server: it needs '
                "weights = \"direct\" (a worker's host copy is not on the server's GPU)"
            )

    def url(self, worker_id: int) -> str:
        """Where worker ``worker_id``'s server listens."""
        return f"http://{self.host}:{self.port_base + worker_id}"

    def pusher(self, workers: int, master_address: str = "127.0.0.1") -> SGLangPusherConfig:
        """The trainer's line to every worker's server (``weights = "direct"``); ``master_address``:
        the trainer's host as the servers reach it."""
        return SGLangPusherConfig(
            urls=[self.url(i) for i in range(workers)],
            master_address=master_address,
            backend=self.update_backend,
            ranks_per_engine=self.tp_size,
            bucket_bytes=int(self.bucket_mb * (1 << 20)),
            api_key=self.api_key or None,
            pause_mode="abort",  # running requests end early and the client continues them
        )

    def server(
        self,
        model_path: str,
        worker_id: int,
        log_dir: str,
        seed: int,
        trust_remote_code: bool = False,
        lora_rank: int = 0,
        lora_modules: Sequence[str] = (),
    ) -> SGLangServerConfig:
        """The supervisor's config for worker ``worker_id``; ``lora_rank > 0``: serve LoRA adapters
        of at most that rank on ``lora_modules`` (SGLang's ``--enable-lora`` flags)."""
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
        if trust_remote_code:
            flags.append("--trust-remote-code")
        if lora_rank:
            flags += [
                "--enable-lora",
                "--max-lora-rank",
                str(lora_rank),
                "--lora-target-modules",
                *lora_modules,
            ]
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


def _gpu_problem(c: SGLangEngineConfig) -> str:
    if c.gpus < 0 or (c.gpus > 1 and c.gpus % 1):
        return f"gpus must be a fraction of one GPU or a whole number, got {c.gpus}"
    if c.launcher == "sglang" and (c.gpus == 0 or (c.tp_size > 1 and c.gpus < c.tp_size)):
        return (
            f"gpus = {c.gpus}: launcher 'sglang' needs a GPU per tensor-parallel rank "
            f"(tp_size = {c.tp_size}); launcher 'loong' runs on CPU"
        )
    return ""


EngineConfig = EmbeddedEngineConfig | SGLangEngineConfig
