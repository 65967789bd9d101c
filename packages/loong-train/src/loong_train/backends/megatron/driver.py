"""Drive a ``tp * pp * dp``-rank Megatron backend from one process, as the trainer wants it.

:class:`~loong_train.backends.megatron.backend.MegatronBackend` is SPMD: every rank makes the
same calls. :class:`MegatronDriver` makes the calling process rank 0 and spawns ranks
1..world-1 as followers; each call on the driver is first broadcast (method name and
arguments, pickled, over the default group) so the followers make it too, then run on rank 0,
whose result is returned (every rank holds the full result).

Lifecycle::

    driver = MegatronDriver("ckpt/", tp=2, pp=1, lr=1e-4)   # spawns 1 follower
    driver.train_step(batch); weights = driver.named_weights()
    driver.close()                                          # followers exit, groups destroyed

One host only (the rendezvous is on 127.0.0.1; gloo on CPU, NCCL with one GPU per rank).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from loong_core.net import free_port
from loong_train.backends.base import RankDriver
from loong_train.backends.megatron.backend import MegatronBackend
from loong_train.backends.megatron.cpu import cpu_compat

__all__ = ["MegatronDriver", "init_model_parallel"]


class MegatronDriver(RankDriver):
    """Rank 0 of a ``tp * pp * dp`` Megatron world; ``backend_kwargs`` go to MegatronBackend."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        tp: int = 1,
        pp: int = 1,
        dp: int = 1,
        threads: int = 1,
        **backend_kwargs,
    ) -> None:
        world, port = tp * pp * dp, free_port()
        ctx = torch.multiprocessing.get_context("spawn")
        args = (world, port, str(model_path), tp, pp, threads, backend_kwargs)
        self._followers = [ctx.Process(target=_follow, args=(r, *args), daemon=True) for r in range(1, world)]
        for p in self._followers:
            p.start()
        self.backend = _open_rank(0, *args)

    def _call(self, name: str, *args):
        if self._followers:
            dist.broadcast_object_list([(name, args)], src=0)
        return getattr(self.backend, name)(*args)

    def close(self) -> None:
        if self._followers:
            dist.broadcast_object_list([("close", ())], src=0)
        _close_rank()
        for p in self._followers:
            p.join(timeout=60)


def _open_rank(
    rank: int, world: int, port: int, model_path: str, tp: int, pp: int, threads: int, kwargs: dict
) -> MegatronBackend:
    torch.set_num_threads(threads)
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    init_model_parallel(tp, pp)
    return MegatronBackend.from_pretrained(model_path, **kwargs)


def init_model_parallel(tp: int, pp: int, seed: int = 0) -> None:
    """megatron-core's parallel state over the initialised world (``world / (tp * pp)``-way data
    parallel) and its model-parallel RNG streams."""
    from megatron.core import parallel_state, tensor_parallel

    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not a multiple of tp * pp = {tp * pp}")
    parallel_state.initialize_model_parallel(tp, pp, create_gloo_process_groups=False)
    with cpu_compat():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _close_rank() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _follow(rank: int, *args) -> None:
    """A follower rank: mirror every call broadcast by rank 0 until ``close``."""
    backend = _open_rank(rank, *args)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        name, call_args = box[0]
        if name == "close":
            break
        getattr(backend, name)(*call_args)
    _close_rank()
