"""The trainer worker: a train backend plus the TransferMesh sender that publishes its weights."""

from __future__ import annotations

import time
from collections.abc import Sequence

import ray
import torch

from loong_core.records import TrainBatch, WeightManifest
from loong_train.backends.torch_backend import TorchBackend
from loong_train.config import Recipe
from loong_train.models.qwen3 import Qwen3ForCausalLM
from loong_train.opd import Distiller
from loong_transfermesh import TransportConfig, open_sender

__all__ = ["TrainerWorker"]


class TrainerWorker:
    """Runs one optimizer step per batch, then pushes the new weights (version + 1) through
    TransferMesh."""

    def __init__(self, model_path: str, recipe: Recipe, transport: TransportConfig) -> None:
        torch.set_num_threads(recipe.threads)
        torch.manual_seed(recipe.seed)
        t = recipe.train
        options = {
            "lr": t.lr,
            "warmup_steps": t.warmup_steps,
            "weight_decay": t.weight_decay,
            "grad_clip": t.grad_clip,
            "loss": recipe.loss,
            "temperature": recipe.rollout.temperature,
        }
        if t.backend == "megatron":  # megatron-core is imported only here
            from loong_train.backends.megatron_driver import MegatronDriver

            self.backend = MegatronDriver(
                model_path,
                tp=t.tp,
                pp=t.pp,
                dp=t.dp,
                threads=recipe.threads,
                micro_batch_rows=t.micro_batch_rows,
                **options,
            )
        else:
            self.backend = TorchBackend(Qwen3ForCausalLM.from_pretrained(model_path), **options)
        self.sender = open_sender(transport)
        self.version = 0
        self.distiller = Distiller(recipe.opd, model_path) if recipe.opd.enabled else None

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step; an all-failed (empty) batch skips the step but still advances.
        With ``[opd] enabled`` the teachers first replace the batch's advantages (:mod:`loong_train.opd`)."""
        start = time.time()
        opd: dict[str, float] = {}
        if self.distiller is not None and batch.row_lens:
            batch, opd = self.distiller.distill(batch)
            opd["teacher_end"] = time.time()
        metrics = self.backend.train_step(batch) if batch.row_lens else {"skipped": 1.0}
        return {**metrics, **opd, "train_start": start, "train_end": time.time()}

    def publish(
        self, metrics: dict[str, float], slot_free: Sequence[ray.ObjectRef] = ()
    ) -> tuple[dict[str, float], WeightManifest]:
        """Push the weights as version + 1. ``slot_free`` are the engines' applies of the version
        that used the same shm slot (refs inside a list, so Ray does not resolve them as
        arguments); the push waits until each finished or failed: a worker that died while
        applying reads no slot any more (restarted, it catches up by itself)."""
        if slot_free:
            ray.wait(list(slot_free), num_returns=len(slot_free))
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
        self.backend.save(path)

    def save_checkpoint(self, path: str) -> None:
        """Hugging Face weights, plus ``trainer_state.pt``: optimizer, LR scheduler, step count,
        torch RNG state and the sender's version (torch backend)."""
        self.backend.model.save_pretrained(path)
        state = {"backend": self.backend.state_dict(), "version": self.version, "rng": torch.get_rng_state()}
        torch.save(state, f"{path}/trainer_state.pt")

    def load_checkpoint(self, path: str) -> int:
        """Continue from ``save_checkpoint(path)``; returns the version it holds (the next push is
        that version + 1)."""
        state = torch.load(f"{path}/trainer_state.pt", weights_only=False)
        self.backend.load(path, state["backend"])
        torch.set_rng_state(state["rng"])
        self.version = state["version"]
        return self.version

    def close(self) -> None:
        self.sender.close()
        getattr(self.backend, "close", lambda: None)()  # the Megatron driver stops its ranks
        if self.distiller is not None:
            self.distiller.close()
