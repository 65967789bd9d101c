"""The FSDP backend's ranks as Ray actors, placed by a placement group, driven SPMD.

:class:`FsdpDriver` is what the trainer holds for ``[train.backend] type = "fsdp"``: it reserves a
placement group of one bundle per rank (``train.threads`` CPUs each; Ray's ``placement``
strategy decides the nodes), starts one :class:`FsdpRank` actor in each bundle, and points them
at rank 0's node address for the gloo rendezvous, so ranks may sit on different machines. Every
call on the driver is made on all ranks at once (:class:`~loong_train.backends.fsdp.FsdpBackend`
is SPMD); rank 0's result is returned, the others return nothing (``named_weights`` would
otherwise cross the object store once per rank).

Lifecycle::

    driver = FsdpDriver("ckpt/", ranks=2, threads=1, lr=1e-4)   # placed, joined, loaded
    driver.train_step(batch); weights = driver.named_weights()
    driver.close()                                              # actors and group released

A placement the cluster cannot satisfy within ``placement_timeout_s`` is an error naming what
the group asked for and what the cluster has, not a hang. A rank whose actor dies fails the
call with the node it ran on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray
import torch

from loong_train.backends.base import RankDriver, RankLost
from loong_train.backends.placement import PlacedRanks
from loong_train.memory import keep_freed_memory

__all__ = ["FsdpDriver", "FsdpRank"]


class FsdpRank:
    """One rank: joins the world at ``open``, then runs whatever the driver calls."""

    def __init__(self) -> None:
        self.backend: Any = None
        self.rank = -1

    def address(self) -> tuple[str, int, str]:
        """Where this rank's node is reached (for rank 0: the rendezvous), a free port, its node id."""
        from loong_core.net import free_port

        return ray.util.get_node_ip_address(), free_port(), ray.get_runtime_context().get_node_id()

    def open(
        self,
        rank: int,
        world: int,
        rendezvous: str,
        threads: int,
        seed: int,
        model_path: str,
        trust_remote_code: bool,
        kwargs: dict[str, Any],
    ) -> None:
        import torch.distributed as dist

        from loong_train.backends.fsdp import FsdpBackend

        torch.set_num_threads(threads)
        keep_freed_memory()
        torch.manual_seed(seed)
        dist.init_process_group("gloo", init_method=f"tcp://{rendezvous}", rank=rank, world_size=world)
        self.rank = rank
        self.backend = FsdpBackend.from_pretrained(model_path, trust_remote_code, **kwargs)

    def call(self, name: str, *args: Any) -> Any:
        out = getattr(self.backend, name)(*args)
        return out if self.rank == 0 else None

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class FsdpDriver(RankDriver):
    """``ranks`` :class:`FsdpRank` actors in a placement group; ``backend_kwargs`` go to
    :class:`~loong_train.backends.fsdp.FsdpBackend` (the torch backend's settings)."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        ranks: int,
        threads: int = 1,
        placement: str = "PACK",
        placement_timeout_s: float = 60.0,
        trust_remote_code: bool = False,
        **backend_kwargs: Any,
    ) -> None:
        self.placed = PlacedRanks(
            FsdpRank,
            ranks,
            threads=threads,
            strategy=placement,
            timeout_s=placement_timeout_s,
            name="loong-fsdp",
        )
        self.ranks = self.placed.actors
        addresses = ray.get([r.address.remote() for r in self.ranks])
        self.nodes = [node for _, _, node in addresses]  # each rank's Ray node id
        host, port, _ = addresses[0]
        seed = torch.initial_seed()  # the trainer's seed: every rank starts from the same stream
        ray.get(
            [
                r.open.remote(
                    i,
                    ranks,
                    f"{host}:{port}",
                    threads,
                    seed,
                    str(model_path),
                    trust_remote_code,
                    backend_kwargs,
                )
                for i, r in enumerate(self.ranks)
            ]
        )

    def _call(self, name: str, *args: Any) -> Any:
        refs = [r.call.remote(name, *args) for r in self.ranks]
        try:
            return ray.get(refs)[0]
        except ray.exceptions.RayActorError as e:
            dead = [i for i, ref in enumerate(refs) if _failed(ref)]
            where = ", ".join(f"rank {i} on node {self.nodes[i]}" for i in dead) or "a rank"
            raise RankLost(f"FSDP {name}: {where} died ({e.__class__.__name__})") from e

    def close(self) -> None:
        self.placed.release()


def _failed(ref: Any) -> bool:
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayActorError:
        return True
    except Exception:
        return False
    return False
