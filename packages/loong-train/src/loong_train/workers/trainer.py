"""The trainer worker: a train backend plus the TransferMesh sender that publishes its weights."""

from __future__ import annotations

import time
from collections.abc import Sequence

import ray
import torch

from loong_core.records import TrainBatch, WeightManifest
from loong_train.algo.config import OPDConfig
from loong_train.algo.opd import Distiller
from loong_train.backends.base import BackendOptions, build_backend
from loong_transfermesh import TransportConfig, open_sender

__all__ = ["TrainerWorker"]


class TrainerWorker:
    """Runs one optimizer step per batch, then pushes the new weights (version + 1) through
    TransferMesh. Its backend is whatever ``options.train.backend`` names
    (:func:`~loong_train.backends.base.build_backend`); with ``opd`` enabled, teachers rewrite each
    batch's advantages first (:mod:`loong_train.algo.opd`)."""

    def __init__(
        self,
        model_path: str,
        options: BackendOptions,
        transport: TransportConfig,
        *,
        seed: int = 0,
        opd: OPDConfig | None = None,
        receivers: int = 0,
    ) -> None:
        torch.set_num_threads(options.threads)
        torch.manual_seed(seed)
        self.backend = build_backend(model_path, options)
        self.sender = open_sender(transport, receivers)  # the rollout workers
        self.version = 0
        self.distiller = Distiller(opd, model_path) if opd is not None and opd.enabled else None

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step; an all-failed (empty) batch skips the step but still advances.
        With ``[opd] enabled`` the teachers first replace the batch's advantages (:mod:`loong_train.algo.opd`)."""
        start = time.time()
        opd: dict[str, float] = {}
        if self.distiller is not None and batch.row_lens:
            batch, opd = self.distiller.distill(batch)
            opd["teacher_end"] = time.time()
        metrics = self.backend.train_step(batch) if batch.row_lens else {"skipped": 1.0}
        return {**metrics, **opd, "train_start": start, "train_end": time.time()}

    def publish(
        self, metrics: dict[str, float], readers: Sequence[ray.ObjectRef] = ()
    ) -> tuple[dict[str, float], WeightManifest]:
        """Push the weights as version + 1. ``readers`` are the engines' applies of the version
        whose buffer this push reuses (``TransportConfig.must_have_applied``; refs inside a list,
        so Ray does not resolve them as arguments); the push waits until each finished or failed:
        a worker that died while applying reads no buffer any more (restarted, it catches up)."""
        if readers:
            ray.wait(list(readers), num_returns=len(readers))
        start = time.time()
        self.version += 1
        manifest = self.sender.push(self.backend.named_weights(), self.version)
        end = time.time()
        return {**metrics, "push_s": end - start, "push_start": start, "push_end": end}, manifest

    def logprobs(self, batch: TrainBatch) -> list[float]:
        """Recomputed logprobs, flattened like the batch's per-token lists."""
        lp = self.backend.logprobs(batch)
        return [v for i, n in enumerate(batch.row_lens) for v in lp[i, :n].tolist()]

    def save(self, path: str) -> None:
        """The model as a Hugging Face checkpoint (``checkpoints/final``)."""
        self.backend.save_pretrained(path)

    def save_checkpoint(self, path: str) -> None:
        """The backend's resumable state (weights, optimizer, LR scheduler, step count), plus
        ``trainer_state.pt``: the torch RNG state and the sender's version."""
        self.backend.save_state(path)
        torch.save({"version": self.version, "rng": torch.get_rng_state()}, f"{path}/trainer_state.pt")

    def load_checkpoint(self, path: str) -> int:
        """Continue from ``save_checkpoint(path)``; returns the version it holds (the next push is
        that version + 1)."""
        self.backend.load_state(path)
        state = torch.load(f"{path}/trainer_state.pt", weights_only=False)
        torch.set_rng_state(state["rng"])
        self.version = state["version"]
        return self.version

    def close(self) -> None:
        self.sender.close()
        self.backend.close()
        if self.distiller is not None:
            self.distiller.close()
