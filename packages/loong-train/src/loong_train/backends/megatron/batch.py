"""A TrainBatch as the Megatron backend's tensors: every per-token list right-padded to
``[rows, max_len]`` on the rank's device."""

from __future__ import annotations

import itertools

import torch
from torch.nn.utils.rnn import pad_sequence

from loong_core.records import TrainBatch

__all__ = ["batch_tensors"]


def batch_tensors(batch: TrainBatch, device: torch.device) -> dict[str, torch.Tensor]:
    """The batch's per-token lists as right-padded [rows, max_len] tensors."""

    def rows(values: list, fill, dtype) -> torch.Tensor:
        bounds = itertools.pairwise(itertools.accumulate(batch.row_lens, initial=0))
        parts = [torch.tensor(values[a:b], dtype=dtype) for a, b in bounds]
        return pad_sequence(parts, batch_first=True, padding_value=fill).to(device)

    return {
        "ids": rows(batch.token_ids, 0, torch.long),
        "mask": rows(batch.loss_mask, 0, torch.float32),
        "adv": rows(batch.advantages, 0.0, torch.float32),
        "behaviour": rows(batch.behaviour_logprobs, 0.0, torch.float32),
        "versions": rows(batch.versions, -1, torch.long),
    }
