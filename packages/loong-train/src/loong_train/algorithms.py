"""RL algorithms: GRPO advantages, the batch packer, and the clipped policy loss.

GRPO (Shao et al., 2024) as used here, per group g of G trajectories of one prompt with
rewards r_1..r_G (failed or timed-out episodes are excluded before the statistics):

    A_i = (r_i - mean(r)) / (std(r) + eps)        (``scale_by_std=True``)
    A_i =  r_i - mean(r)                          (``scale_by_std=False``, Dr. GRPO style)

with the population standard deviation, and every model token of trajectory i gets A_i.

Policy loss (PPO clip, token-level mean over all loss tokens of the batch), with behaviour
logprobs b_t from the rollout engine and current logprobs l_t:

    ratio_t = exp(l_t - b_t)
    L = - sum_t m_t * min(ratio_t * A_t, clip(ratio_t, 1 - eps, 1 + eps) * A_t) / sum_t m_t
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch

from loong_core.records import TrainBatch, Trajectory

__all__ = ["grpo_advantages", "pack_batch", "ppo_clip_loss"]


def grpo_advantages(
    trajectories: Sequence[Trajectory], scale_by_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """One advantage per trajectory; untrainable ones (failed, timeout) get 0 and no say."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(trajectories):
        if t.status.trainable:
            groups[t.group_id].append(i)
    adv = [0.0] * len(trajectories)
    for members in groups.values():
        rewards = [trajectories[i].reward for i in members]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        scale = 1 / (std + eps) if scale_by_std and std > 0 else 1.0  # equal rewards: r - mean = 0 anyway
        for i, r in zip(members, rewards, strict=True):
            adv[i] = (r - mean) * scale
    return adv


def pack_batch(
    trajectories: Sequence[Trajectory], advantages: Sequence[float], policy_version: int
) -> TrainBatch:
    """Concatenate trainable trajectories into a TrainBatch (one row each)."""
    keep = [(t, a) for t, a in zip(trajectories, advantages, strict=True) if t.status.trainable]
    token_ids, mask, adv, lps, versions, lens = [], [], [], [], [], []
    for t, a in keep:
        m = t.loss_mask
        token_ids += t.token_ids
        mask += m
        adv += [a * x for x in m]
        lps += t.logprobs
        versions += t.token_versions
        lens.append(len(m))
    return TrainBatch(
        token_ids=token_ids,
        loss_mask=mask,
        advantages=adv,
        behaviour_logprobs=lps,
        versions=versions,
        row_lens=lens,
        sample_ids=[t.sample_id for t, _ in keep],
        policy_version=policy_version,
    )


def ppo_clip_loss(
    logprobs: torch.Tensor,
    behaviour: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate above; all inputs [rows, seq]. Returns (loss, stats)."""
    ratio = torch.exp(logprobs - behaviour)
    surr = torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    n = mask.sum().clamp(min=1)
    loss = -(surr * mask).sum() / n
    with torch.no_grad():
        clipped = ((ratio - 1).abs() > clip_eps).float()
        stats = {"clip_frac": float((clipped * mask).sum() / n)}
    return loss, stats
