"""The torch backend over a data-parallel world, parameters sharded with FSDP2 (``fully_shard``).

:class:`FsdpBackend` is SPMD: every rank of the default process group makes the same calls with
the same batch. Each decoder layer is its own FSDP unit and the model the root one, on a 1-D
device mesh (CPU under gloo, one GPU per rank under NCCL); AdamW holds each rank's shards only.

A batch's rows are split into ``world`` contiguous shares of about equal computed tokens (a
prefix shared with the row before computed once, as on one process); each rank packs its share
into micro-batches (:mod:`loong_train.backends.packing`) and scales each micro-batch's loss by its
part of the *whole* batch's normaliser, so the rank gradients sum to the whole batch's gradient:
FSDP's reduce-scatter sums them (gradient divide factor 1) instead of averaging. A rank with
fewer micro-batches than another repeats its last one with the loss times zero, since every
forward and backward is a collective. Per-row results (logprobs, entropies) and the loss are
summed over ranks, so every rank returns the same metrics as :class:`TorchBackend` on the whole
batch, to float rounding (the summation order differs).

The root unit stays gathered between its forward and the end of backward
(``reshard_after_forward=False``): the chunked LM head reads ``lm_head.weight`` outside the
model's ``forward`` (``packing.logprobs``), after ``packed_hidden`` (registered as a forward
method) gathered it.

Weights leave gathered: ``named_weights`` is every full tensor under its Hugging Face name (a
collective, every rank holds the result); ``save_pretrained`` writes them from rank 0;
``save_state`` adds ``optimizer.pt`` from rank 0 with the full optimizer state by parameter name,
the scheduler and the step count, and ``load_state`` reads both on rank 0 and scatters them.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loong_core.records import TrainBatch
from loong_train.backends import packing
from loong_train.backends.torch_backend import TorchBackend
from loong_train.models.auto import load_causal_lm
from loong_train.models.packed import common_prefixes

__all__ = ["FsdpBackend", "shard_model", "split_rows"]


def split_rows(lens: list[int], computed: list[int], parts: int) -> list[range]:
    """``parts`` contiguous row ranges of about equal ``computed`` tokens (some may be empty)."""
    total, bounds, acc, row = sum(computed), [0], 0, 0
    for p in range(1, parts):
        target = total * p / parts
        while row < len(lens) and acc + computed[row] / 2 < target:
            acc += computed[row]
            row += 1
        bounds.append(row)
    bounds.append(len(lens))
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: the children of every ``ModuleList`` holding parameters."""
    return [
        block
        for m in model.modules()
        if isinstance(m, nn.ModuleList)
        for block in m
        if any(True for _ in block.parameters())
    ]


def shard_model(model: nn.Module, mesh: Any) -> nn.Module:
    """``model`` sharded in place over ``mesh``: each block an FSDP unit, the model the root
    (gathered from forward to the end of backward); gradients summed over ranks."""
    from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

    for block in _blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    register_fsdp_forward_method(model, "packed_hidden")
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class FsdpBackend(TorchBackend):
    """:class:`TorchBackend` on this rank of an initialised default process group."""

    # a prepacked copy of each block's gathered weight would outlive the block's forward and
    # undo the resharding (every rank would hold the whole model once more)
    prepack_scoring = False

    @classmethod
    def from_pretrained(cls, path: str | Path, trust_remote_code: bool = False, **kwargs: Any) -> FsdpBackend:
        from torch.distributed.device_mesh import init_device_mesh

        if kwargs.get("lora") is not None and kwargs["lora"].enabled:
            raise ValueError("train.lora with train.backend.type = 'fsdp' is not supported yet: use 'torch'")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = init_device_mesh(device, (dist.get_world_size(),))
        model = shard_model(load_causal_lm(path, trust_remote_code), mesh)
        loss = kwargs.get("loss")
        reference = None
        if loss is not None and loss.kl_coef > 0:  # the KL reference: the initial model, sharded too
            reference = shard_model(
                load_causal_lm(path, trust_remote_code).eval().requires_grad_(False), mesh
            )
        backend = cls(model, source=path, reference=reference, **kwargs)
        backend.trust_remote_code = trust_remote_code
        return backend

    @property
    def rank(self) -> int:
        return dist.get_rank()

    def _micro_batches(self, batch: TrainBatch) -> list[tuple[packing.MicroBatch, bool]]:
        world, lens = dist.get_world_size(), list(batch.row_lens)
        ids = torch.tensor(batch.token_ids, dtype=torch.long)
        shared = common_prefixes(ids, lens) if self._share else [0] * len(lens)
        computed = [n - s for n, s in zip(lens, shared, strict=True)]
        starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
        shares = []
        for rows in split_rows(lens, computed, world):
            if not len(rows):
                shares.append([])
                continue
            token_ids = batch.token_ids[starts[rows.start] : starts[rows.stop]]
            micros = packing.micro_batches(
                token_ids, lens[rows.start : rows.stop], self.max_tokens, self._share
            )
            shift = rows.start
            shares.append(
                [
                    dataclasses.replace(m, rows=range(m.rows.start + shift, m.rows.stop + shift))
                    for m in micros
                ]
            )
        steps = max(len(s) for s in shares)
        mine = [(m, True) for m in shares[self.rank]]
        filler = mine[-1][0] if mine else next(s[-1] for s in shares if s)  # any micro-batch will do
        return mine + [(filler, False)] * (steps - len(mine))

    def _combine(
        self, rows: list[torch.Tensor], total: float, stats: dict[str, float]
    ) -> tuple[float, dict[str, float]]:
        for t in rows:
            dist.all_reduce(t)
        keys = sorted(stats)
        sums = torch.tensor([total, *(stats[k] for k in keys)], dtype=torch.float64)
        dist.all_reduce(sums)
        return float(sums[0]), {k: float(v) for k, v in zip(keys, sums[1:], strict=True)}

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Every full weight under its Hugging Face name (a collective: call it on every rank)."""
        return {k: _full(v.detach()) for k, v in self.model.named_parameters()}

    def save_pretrained(self, path: str | Path) -> None:
        """The gathered model as a Hugging Face checkpoint, written by rank 0 (a collective)."""
        weights = self.named_weights()
        if self.rank == 0:
            plain = load_causal_lm(self.source, self.trust_remote_code)
            plain.load_state_dict(weights, strict=False)
            plain.save_pretrained(path)
        dist.barrier()

    def save_state(self, path: str | Path) -> None:
        """:meth:`save_pretrained` plus ``optimizer.pt`` (rank 0): the full optimizer state by
        parameter name, scheduler and step count."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        self.save_pretrained(path)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        opt = get_optimizer_state_dict(self.model, self.opt, options=options)
        if self.rank == 0:
            state = {"opt": opt, "sched": self.sched.state_dict(), "steps": self.steps}
            torch.save(state, Path(path) / "optimizer.pt")
        dist.barrier()

    def load_state(self, path: str | Path) -> None:
        """Weights and optimizer state read by rank 0 and scattered to every rank's shards."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        weights, state = {}, {"opt": {}}
        if self.rank == 0:
            weights = load_causal_lm(path, self.trust_remote_code).state_dict()
            state = torch.load(Path(path) / "optimizer.pt", weights_only=False)
        set_model_state_dict(self.model, weights, options=options)
        set_optimizer_state_dict(self.model, self.opt, state["opt"], options=options)
        box = [(state.get("sched"), state.get("steps"))]
        dist.broadcast_object_list(box, src=0)
        sched, self.steps = box[0]
        self.sched.load_state_dict(sched)
