"""The trainer worker: a train backend plus what publishes its weights: a TransferMesh sender to
the rollout workers, or (``[rollout.engine] weights = "direct"``) every SGLang server directly."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

import msgspec
import ray
import torch

from loong_core.config import is_loopback
from loong_core.records import TrainBatch, WeightManifest
from loong_train.algo.config import OPDConfig
from loong_train.algo.opd import Distiller
from loong_train.backends.base import BackendOptions, build_backend
from loong_train.cores import Borrower
from loong_train.memory import keep_freed_memory
from loong_train.messages import Published, StepResult
from loong_transfermesh import SGLangPusherConfig, SGLangServers, TransportConfig, open_sender

__all__ = ["TrainerWorker"]

log = logging.getLogger("loong.trainer")


class TrainerWorker:
    """Runs one optimizer step per batch, then pushes the new weights (version + 1) through
    TransferMesh. Its backend is whatever ``options.train.backend`` names
    (:func:`~loong_train.backends.base.build_backend`); with ``opd`` enabled, teachers rewrite each
    batch's advantages first (:mod:`loong_train.algo.opd`).

    ``servers`` (direct weights): instead of a sender, :class:`loong_transfermesh.SGLangServers`
    pushes each version into every server (reconnecting a restarted one first), and a watcher
    thread catches up, every ``watch_interval_s``, a server that answers with an older version
    (restarted, or its push failed) while the trainer waits for work. Every call into the backend
    holds one lock, so the watcher never runs beside a step, a save or a Megatron gather, and it
    waits while a train step has changed weights not yet published: a server never gets a
    half-trained version.

    ``cores``: the name of the run's :class:`~loong_train.cores.CoreBoard`: a torch backend's
    step also runs on the threads the rollout workers on this node lend while they rest (a
    :class:`~loong_train.cores.Borrower`; "": on its own).
    """

    def __init__(
        self,
        model_path: str,
        options: BackendOptions,
        transport: TransportConfig,
        *,
        seed: int = 0,
        opd: OPDConfig | None = None,
        receivers: int = 0,
        servers: SGLangPusherConfig | None = None,
        watch_interval_s: float = 1.0,
        cores: str = "",
    ) -> None:
        torch.set_num_threads(options.threads)
        keep_freed_memory()
        torch.manual_seed(seed)
        self.backend = build_backend(model_path, options)
        self.version = 0
        self.distiller = Distiller(opd, model_path) if opd is not None and opd.enabled else None
        self.sender = open_sender(transport, receivers) if servers is None else None  # the rollout workers
        self.servers = None if servers is None else SGLangServers(_reachable(servers))
        self.borrower = None
        if cores:
            if not hasattr(self.backend, "models"):
                raise ValueError(f"only the torch backend borrows threads, not {type(self.backend).__name__}")
            self.borrower = Borrower(cores, options.threads)
        self._lock = threading.RLock()  # the backend, the servers and the flag below
        self._unpublished = False  # a train step changed the weights since the last push
        self._closed = threading.Event()
        if self.servers is not None:
            watcher = threading.Thread(
                target=self._watch, args=(watch_interval_s,), name="catch-up", daemon=True
            )
            watcher.start()

    def train_step(self, batch: TrainBatch, wait_for: Sequence[ray.ObjectRef] = ()) -> StepResult:
        """One optimizer step; an all-failed (empty) batch skips the step but still advances.
        With ``[opd] enabled`` the teachers first replace the batch's advantages (:mod:`loong_train.algo.opd`).
        ``wait_for``: calls that must end before the weights change (direct weights: evaluations
        running on the servers; refs inside a list, so Ray does not resolve them as arguments)."""
        if wait_for:
            ray.wait(list(wait_for), num_returns=len(wait_for))
        start, teacher_end = time.time(), None
        opd: dict[str, float] = {}
        if self.distiller is not None and batch.row_lens:
            batch, opd = self.distiller.distill(batch)
            teacher_end = time.time()
        with self._lock:
            self._unpublished = bool(batch.row_lens)
            metrics = self._step(batch) if batch.row_lens else {"skipped": 1.0}
        return StepResult(metrics={**metrics, **opd}, start=start, end=time.time(), teacher_end=teacher_end)

    def _step(self, batch: TrainBatch) -> dict[str, float]:
        if self.borrower is None:
            return self.backend.train_step(batch)
        with self.borrower.hooks(*self.backend.models()):
            metrics = self.backend.train_step(batch)
        return {**metrics, "trainer_threads_mean": self.borrower.threads_mean}

    def publish(self, step: StepResult, readers: Sequence[ray.ObjectRef] = ()) -> Published:
        """Push the weights as version + 1. ``readers`` are the engines' applies of the version
        whose buffer this push reuses (``TransportConfig.must_have_applied``; refs inside a list,
        so Ray does not resolve them as arguments); the push waits until each finished or failed:
        a worker that died while applying reads no buffer any more (restarted, it catches up)."""
        if readers:
            ray.wait(list(readers), num_returns=len(readers))
        start = time.time()
        with self._lock:
            self.version += 1
            if self.servers is None:
                manifest = self.sender.push(self.backend.named_weights(), self.version)
                self._unpublished = False
            else:
                manifest = self._push_to_servers()
        return Published(step=step, manifest=manifest, push_start=start, push_end=time.time())

    def catch_up_receivers(self) -> int:
        """Send the newest published version to receivers that connected after it was pushed (a
        restarted rollout worker, over a streaming transport: ``shm`` workers read it from the
        slots themselves); returns how many it reached. Between a step and its push the weights
        are ahead of the version: then the push brings them up to date instead."""
        catch_up = getattr(self.sender, "catch_up", None)
        with self._lock:
            if catch_up is None or self._unpublished or self.version == 0:
                return 0
            return catch_up(self.backend.named_weights(), self.version)

    def _push_to_servers(self) -> WeightManifest:
        """Push ``version`` into every server; one that fails is caught up later."""
        failed = self.servers.push(self.backend.named_weights(), self.version)
        self._unpublished = False
        for url, why in failed.items():
            log.warning(
                "weights v%d did not reach %s (%s): catching it up when it answers", self.version, url, why
            )
        return WeightManifest(version=self.version, tensors=[], bucket_sizes=[])

    def _watch(self, interval_s: float) -> None:
        """Catch up servers behind the newest published version (direct weights). The check runs
        outside the lock, with the interval as its timeout: a server that hangs holds up nothing."""
        while not self._closed.wait(interval_s):
            if not self.servers.behind(self.version, timeout_s=interval_s):
                continue
            with self._lock:
                if self._unpublished or self._closed.is_set():
                    continue
                failed = self.servers.catch_up(self.backend.named_weights(), self.version)
            for url, why in failed.items():
                log.warning("catching %s up to v%d failed (%s): trying again", url, self.version, why)

    def logprobs(self, batch: TrainBatch) -> list[float]:
        """Recomputed logprobs, flattened like the batch's per-token lists."""
        with self._lock:
            lp = self.backend.logprobs(batch)
        return [v for i, n in enumerate(batch.row_lens) for v in lp[i, :n].tolist()]

    def save(self, path: str) -> None:
        """The model as a Hugging Face checkpoint (``checkpoints/final``)."""
        with self._lock:
            self.backend.save_pretrained(path)

    def save_checkpoint(self, path: str) -> None:
        """The backend's resumable state (weights, optimizer, LR scheduler, step count), plus
        ``trainer_state.pt``: the torch RNG state and the sender's version."""
        with self._lock:
            self.backend.save_state(path)
            torch.save({"version": self.version, "rng": torch.get_rng_state()}, f"{path}/trainer_state.pt")

    def load_checkpoint(self, path: str) -> int:
        """Continue from ``save_checkpoint(path)``; returns the version it holds (the next push is
        that version + 1)."""
        with self._lock:
            self.backend.load_state(path)
            state = torch.load(f"{path}/trainer_state.pt", weights_only=False)
            torch.set_rng_state(state["rng"])
            self.version = state["version"]
            if self.servers is not None:
                self.servers.initial_version = self.version  # the servers were launched from ``path``
        return self.version

    def node(self) -> tuple[str, str]:
        """The Ray node this trainer runs on: its id and IP address."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def weights_address(self) -> str:
        """Where rollout workers reach the ``tcp`` sender: its bound address, with this node's IP
        for a sender bound to every interface."""
        host, _, port = self.sender.address.rpartition(":")
        if host.strip("[]") in ("0.0.0.0", "::", ""):
            host = ray.util.get_node_ip_address()
        return f"{host}:{port}"

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            if self.servers is not None:
                self.servers.close()
        if self.sender is not None:
            self.sender.close()
        self.backend.close()
        if self.distiller is not None:
            self.distiller.close()
        if self.borrower is not None:
            self.borrower.close()


def _reachable(config: SGLangPusherConfig) -> SGLangPusherConfig:
    """``config`` with the rendezvous on this node's address (as Ray knows it) when a server is
    not on loopback: the servers must reach wherever Ray placed the trainer."""
    hosts = {urlsplit(url).hostname or "" for url in config.urls}
    if all(is_loopback(h) for h in hosts):
        return config
    return msgspec.structs.replace(config, master_address=ray.util.get_node_ip_address())
