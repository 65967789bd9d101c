"""Rank processes for the FSDP backend tests: each joins a gloo world, builds the backend from the
same seeded model and runs the same calls; rank 0 reports what the test compares."""

from __future__ import annotations

import io
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loong_core.net import free_port
from loong_train.algo.config import LossConfig

__all__ = ["run_ranks"]


def run_ranks(world: int, job: str, *args) -> dict:
    """Run ``job`` (a function name below) on ``world`` spawned ranks; rank 0's result."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, results, job, args)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        out = results.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if isinstance(out, BaseException):
        raise out
    return torch.load(io.BytesIO(out), weights_only=False)


def _rank(rank: int, world: int, port: int, results, job: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out = globals()[job](*args)
        if rank == 0:  # bytes: a tensor through the queue would live in this process's memory
            buffer = io.BytesIO()
            torch.save(out, buffer)
            results.put(buffer.getvalue())
    except BaseException as e:
        results.put(e)
        raise
    finally:
        dist.destroy_process_group()


def steps_float64(batches: list, cfg: LossConfig, budget: int) -> dict:
    """Two optimizer steps on a float64 model: the metrics of each and the final weights."""
    from test_packing import _model
    from torch.distributed.device_mesh import init_device_mesh

    from loong_train.backends.fsdp import FsdpBackend, shard_model

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = shard_model(_model().double(), mesh)
    reference = None
    if cfg.kl_coef > 0:
        reference = shard_model(_model().double().eval().requires_grad_(False), mesh)
    backend = FsdpBackend(model, lr=1e-2, loss=cfg, max_tokens_per_micro_batch=budget, reference=reference)
    metrics = [backend.train_step(b) for b in batches]
    logprobs = backend.logprobs(batches[0])
    return {"metrics": metrics, "weights": backend.named_weights(), "logprobs": logprobs}


def save_and_resume(path: str, batches: list, cfg: LossConfig) -> dict:
    """From a checkpoint: one step, ``save_state``, a fresh backend's ``load_state``, one more step;
    and the same two steps uninterrupted."""
    from loong_train.backends.fsdp import FsdpBackend

    def build() -> FsdpBackend:
        return FsdpBackend.from_pretrained(path, lr=1e-2, loss=cfg, warmup_steps=3)

    first = build()
    first.train_step(batches[0])
    first.save_state(Path(path).parent / "state")
    resumed = build()
    resumed.load_state(Path(path).parent / "state")
    after = resumed.train_step(batches[1])
    straight = build()
    for b in batches:
        want = straight.train_step(b)
    return {"resumed": after, "uninterrupted": want, "weights": resumed.named_weights(),
            "want_weights": straight.named_weights()}  # fmt: skip
