"""Trainer ranks as Ray actors in a placement group of one bundle each: placed within a timeout
or refused with what the group asked for against what the cluster has, and released together.
The ``fsdp`` backend's ranks and Megatron's follower ranks are placed this way."""

from __future__ import annotations

import os
from typing import Any

import ray

__all__ = ["PlacedRanks", "unplaceable"]


class PlacedRanks:
    """``n`` actors of ``actor_class``, one per bundle of ``threads`` CPUs (and ``gpus`` GPUs),
    placed by ``strategy``; ``what`` and ``lower`` word the error when the cluster cannot place
    them within ``timeout_s`` (see :func:`unplaceable`)."""

    def __init__(
        self,
        actor_class: type,
        n: int,
        *,
        threads: int,
        gpus: float = 0.0,
        strategy: str = "PACK",
        timeout_s: float = 60.0,
        name: str,
        what: str = "",
        lower: str = "ranks",
    ) -> None:
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundles = [{"CPU": float(threads), **({"GPU": gpus} if gpus else {})} for _ in range(n)]
        self.group = placement_group(bundles, strategy=strategy, name=f"{name}-{os.getpid()}")
        try:
            ray.get(self.group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.group)
            raise RuntimeError(unplaceable(bundles, strategy, timeout_s, what, lower)) from None
        actor = ray.remote(actor_class)
        self.actors: list[Any] = [
            actor.options(
                num_cpus=threads,
                num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.group, placement_group_bundle_index=i
                ),
            ).remote()
            for i in range(n)
        ]

    def release(self) -> None:
        """The actors killed and the group removed."""
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            ray.kill(a)
        remove_placement_group(self.group)
        self.actors = []


def unplaceable(
    bundles: list[dict[str, float]], strategy: str, timeout_s: float, what: str = "", lower: str = "ranks"
) -> str:
    """What a placement group that Ray could not place asked for (``what``: its ranks, by
    default ``train.backend.ranks``), against what the cluster has."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    free = ray.available_resources()
    gpus = "GPU" in bundles[0]

    def amount(resources: dict) -> str:
        cpus = f"{resources.get('CPU', 0):g} CPUs"
        return f"{cpus}, {resources.get('GPU', 0):g} GPUs" if gpus else cpus

    have = ", ".join(f"{n['NodeManagerAddress']}: {amount(n['Resources'])}" for n in nodes)
    what = what or f"train.backend.ranks = {len(bundles)} ranks"
    return (
        f"{what} of {amount(bundles[0])} each "
        f"(placement {strategy!r}) could not be placed within {timeout_s:g} s: the cluster has "
        f"{len(nodes)} node(s) ({have}), {amount(free)} free; lower {lower} or train.threads, "
        f"add nodes, or choose another train.backend.placement"
    )
