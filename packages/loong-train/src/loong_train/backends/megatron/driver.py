"""Drive a ``tp * pp * dp``-rank Megatron backend from one process, as the trainer wants it.

:class:`~loong_train.backends.megatron.backend.MegatronBackend` is SPMD: every rank makes the
same calls. :class:`MegatronDriver` makes the calling process (the trainer) rank 0 and starts
ranks 1..world-1 as Ray actors (:class:`MegatronFollower`) in a placement group of one bundle
each, placed by ``placement`` (``"PACK"`` by default: a model-parallel group shares a node where
it fits; Ray may place them on other nodes than the trainer's). The world's rendezvous is rank
0's node address, so ranks may sit on different machines. Each call on the driver is first
broadcast (method name and arguments, pickled, over the default group) so the followers make it
too, then run on rank 0, whose result is returned (every rank holds the full result). Rank 0
stays the trainer's own process so the weights it publishes are on its own device.

Lifecycle::

    driver = MegatronDriver("ckpt/", tp=2, pp=1, lr=1e-4)   # one follower placed and joined
    driver.train_step(batch); weights = driver.named_weights()
    driver.close()                                          # followers exit, group released

Each rank reserves ``threads`` CPUs and, on GPUs, one GPU (``gpus`` with one rank may be a
fraction, sharing the GPU with an engine); gloo on CPU, NCCL on GPUs. A follower whose actor or
node dies fails the call with :class:`~loong_train.backends.base.RankLost` naming its node.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist

from loong_core.net import free_port
from loong_train.backends.base import RankDriver, RankLost
from loong_train.backends.megatron.backend import MegatronBackend
from loong_train.backends.megatron.cpu import cpu_compat

__all__ = ["MegatronDriver", "MegatronFollower", "init_model_parallel"]


class MegatronFollower:
    """Rank ``r > 0``: joins the world, then mirrors every call rank 0 broadcasts until ``close``."""

    def prepare(self) -> str:
        """Import megatron-core here (a node without it fails now, not inside the rendezvous,
        where rank 0 would wait for the process group's timeout); this rank's Ray node id."""
        import megatron.core  # noqa: F401

        return ray.get_runtime_context().get_node_id()

    def follow(self, rank: int, *args: Any) -> None:
        backend = _open_rank(rank, *args)
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            name, call_args = box[0]
            if name == "close":
                break
            getattr(backend, name)(*call_args)
        _close_rank()


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
        gpus: float = 0.0,
        placement: str = "PACK",
        placement_timeout_s: float = 60.0,
        **backend_kwargs: Any,
    ) -> None:
        world, host = tp * pp * dp, _node_address()
        device = "cuda" if gpus else "cpu"
        args = (world, f"{host}:{free_port(host)}", device, str(model_path), tp, pp, threads, backend_kwargs)
        self.followers: list[Any] = []
        self.nodes: list[str] = []
        self.placed: Any = None
        self._following: list[Any] = []
        self._broken = ""  # why the world can no longer make calls together
        try:
            if world > 1:
                self._start_followers(
                    world - 1, threads, 1.0 if gpus else 0.0, placement, placement_timeout_s
                )
                self._following = [f.follow.remote(r, *args) for r, f in enumerate(self.followers, start=1)]
            self.backend = _open_rank(0, *args)
        except BaseException:
            _close_rank()
            self._release()
            raise

    def _start_followers(self, n: int, threads: int, gpus: float, placement: str, timeout_s: float) -> None:
        from loong_train.backends.placement import PlacedRanks

        self.placed = PlacedRanks(
            MegatronFollower,
            n,
            threads=threads,
            gpus=gpus,
            strategy=placement,
            timeout_s=timeout_s,
            name="loong-megatron",
            what=f"Megatron's ranks 1..{n} (rank 0 is the trainer)",
            lower="tp, pp, dp",
        )
        self.followers = self.placed.actors
        self.nodes = ray.get([f.prepare.remote() for f in self.followers])  # each follower's Ray node id

    def _call(self, name: str, *args: Any) -> Any:
        if self._broken:
            raise RankLost(f"Megatron {name}: the ranks are out of step since {self._broken}")
        try:
            if self.followers:
                dist.broadcast_object_list([(name, args)], src=0)
            return getattr(self.backend, name)(*args)
        except Exception as e:
            if not self.followers:
                raise
            # the followers may be anywhere in this call or dead: no later call can pair up with them
            self._broken = f"{name} failed on rank 0 ({type(e).__name__}: {e})"
            if ended := self._ended():
                raise RankLost(f"Megatron {name}: {ended}") from e
            raise

    def _ended(self) -> str:
        """The followers whose ``follow`` call ended (their actor died, or raised), with their
        nodes and how; '' when none did."""
        done, _ = ray.wait(self._following, num_returns=len(self._following), timeout=1.0)
        ended = []
        for ref in done:
            i = self._following.index(ref)
            try:
                ray.get(ref)
                how = "left the world"
            except ray.exceptions.RayActorError:
                how = "died"
            except Exception as e:
                how = f"raised {_first_line(e)}"
            ended.append(f"rank {i + 1} on node {self.nodes[i]} {how}")
        return ", ".join(ended)

    def close(self) -> None:
        try:
            if self.followers and not self._broken:
                dist.broadcast_object_list([("close", ())], src=0)
                ray.wait(self._following, num_returns=len(self._following), timeout=60)
        finally:
            _close_rank()
            self._release()

    def _release(self) -> None:
        """Followers killed, their placement group removed (also after a failure)."""
        if self.placed is not None:
            self.placed.release()
        self.placed, self.followers, self._following = None, [], []


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[-1] if lines else type(e).__name__


def _node_address() -> str:
    """Where the other ranks reach this process: its Ray node's address, or loopback outside Ray."""
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def _open_rank(
    rank: int,
    world: int,
    rendezvous: str,
    device: str,
    model_path: str,
    tp: int,
    pp: int,
    threads: int,
    kwargs: dict,
) -> MegatronBackend:
    """Join the world (NCCL on ``device = "cuda"``, each rank on its own GPU, the one Ray shows
    it; gloo on CPU: every rank chooses the same, from the recipe's ``gpus``) and load the model."""
    torch.set_num_threads(threads)
    if device == "cuda":
        torch.cuda.set_device(0)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{rendezvous}", rank=rank, world_size=world)
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
    if dist.is_initialized():
        dist.destroy_process_group()
