"""RL algorithms: advantages (GRPO, RLOO, REINFORCE++), the batch packer, the policy loss with its
options (PPO clipping, dual clip, decoupled PPO, TIS and MIS, GSPO, CISPO, KL penalties) and the
dense distillation loss. The formulas, with the recipe keys that choose each part:
docs/losses.md.

The defaults (std scaling, coupled PPO, token-mean, everything else off) are the loss Loong
trained with before these options existed, bit for bit.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch

from loong_core.records import EpisodeStatus, TrainBatch, Trajectory
from loong_teacher import generalized_jsd, kl_divergence, topk_tail_logprobs
from loong_train.algo.config import LossConfig

__all__ = [
    "advantages",
    "aggregate",
    "distill_loss",
    "episode_id",
    "grpo_advantages",
    "kl_estimate",
    "no_signal",
    "pack_batch",
    "policy_loss",
]


def episode_id(t: Trajectory) -> str:
    """The episode a trajectory row belongs to: ``info["episode"]`` (black-box rows), else its sample id."""
    return t.info.get("episode", t.sample_id)


def grpo_advantages(
    trajectories: Sequence[Trajectory],
    scale_by_std: bool = True,
    eps: float = 1e-6,
    std: str = "population",
) -> list[float]:
    """One advantage per row (its episode's); untrainable ones (failed, timeout) get 0 and no say."""
    centre: dict[str, tuple[float, float]] = {}
    for group_id, rewards in _groups(trajectories).items():
        mean = sum(rewards) / len(rewards)
        dof = len(rewards) - (std == "unbiased")
        spread = math.sqrt(sum((r - mean) ** 2 for r in rewards) / dof) if dof > 0 else 0.0
        scale = (
            1 / (spread + eps) if scale_by_std and spread > 0 else 1.0
        )  # equal rewards: r - mean = 0 anyway
        centre[group_id] = mean, scale
    return [
        (t.reward - centre[t.group_id][0]) * centre[t.group_id][1] if t.status.trainable else 0.0
        for t in trajectories
    ]


def advantages(trajectories: Sequence[Trajectory], cfg: LossConfig) -> list[float]:
    """The advantage of every row under ``cfg.estimator`` (formulas: docs/losses.md)."""
    if cfg.estimator == "grpo":
        return grpo_advantages(trajectories, cfg.scale_adv_by_std, std=cfg.std)
    groups = _groups(trajectories)
    means = {g: sum(rs) / len(rs) for g, rs in groups.items()}
    if cfg.estimator == "rloo":
        factor = {g: len(rs) / (len(rs) - 1) if len(rs) > 1 else 0.0 for g, rs in groups.items()}
        return [
            factor[t.group_id] * (t.reward - means[t.group_id]) if t.status.trainable else 0.0
            for t in trajectories
        ]
    baseline = cfg.estimator == "reinforce++-baseline"
    single = {g for g, rs in groups.items() if len(rs) == 1}  # no baseline from a group of one
    rows = [
        (t.reward - (means[t.group_id] if baseline and t.group_id not in single else 0.0), t.num_model_tokens)
        for t in trajectories
        if t.status.trainable
    ]
    tokens = sum(n for _, n in rows)
    if tokens < 2:
        return [0.0] * len(trajectories)
    mean = sum(v * n for v, n in rows) / tokens
    var = sum(n * (v - mean) ** 2 for v, n in rows) / (tokens - 1)
    scale = 1 / math.sqrt(var + 1e-8)
    values = iter(rows)
    return [(next(values)[0] - mean) * scale if t.status.trainable else 0.0 for t in trajectories]


def no_signal(group: Sequence[Trajectory]) -> bool:
    """True when one group's trainable episodes all scored the same (or none is trainable):
    GRPO and RLOO give each of its rows advantage 0 (dynamic sampling drops such groups)."""
    return all(len(set(rewards)) <= 1 for rewards in _groups(group).values())


def _groups(trajectories: Sequence[Trajectory]) -> dict[str, list[float]]:
    """Each group's episode rewards (one per episode, black-box rows counted once), trainable only."""
    groups: dict[str, dict[str, float]] = defaultdict(dict)
    for t in trajectories:
        if t.status.trainable:
            groups[t.group_id][episode_id(t)] = t.reward
    return {g: list(e.values()) for g, e in groups.items()}


def pack_batch(
    trajectories: Sequence[Trajectory],
    advantages: Sequence[float],
    policy_version: int,
    mask_truncated: bool = False,
) -> TrainBatch:
    """Concatenate trainable trajectories into a TrainBatch (one row each); ``mask_truncated``
    (DAPO's overlong filtering) keeps truncated rows but gives them no loss token."""
    keep = [(t, a) for t, a in zip(trajectories, advantages, strict=True) if t.status.trainable]
    token_ids, mask, adv, lps, versions, lens = [], [], [], [], [], []
    for t, a in keep:
        m = t.loss_mask
        if mask_truncated and t.status is EpisodeStatus.TRUNCATED:
            m = [0] * len(m)
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
        row_tags=[dict(t.tags) for t, _ in keep],
    )


def policy_loss(
    logprobs: torch.Tensor,
    behaviour: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    *,
    proximal: torch.Tensor | None = None,
    reference: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """L above; inputs ``[batch, seq]``, ``reference`` only when ``cfg.kl_coef > 0``.

    Returns (loss, metrics): ``pg_loss``, ``clip_frac``, ``dual_clip_frac``, ``tis_frac`` and
    ``mis_drop_frac`` (fractions of loss tokens), ``is_weight_{mean,min,max}`` of w before
    truncation, and ``kl`` (token mean of k) with ``kl_loss`` when a reference is given.
    """
    prox = logprobs.detach() if proximal is None else proximal
    log_w = prox - behaviour
    keep = mask * _mis_keep(log_w, mask, cfg)
    log_ratio = logprobs - (prox if cfg.decoupled else behaviour)
    ratio = torch.exp(log_ratio)
    if cfg.policy == "ppo":
        surr = _surrogate(ratio, advantages, cfg)
    elif cfg.policy == "cispo":
        weight = ratio.detach().clamp(1 - cfg.clip_eps, 1 + cfg.clip_high)
        surr = weight * advantages * logprobs
    else:  # GSPO: one length-normalised ratio per sequence
        seq = torch.exp((log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1))
        if cfg.policy == "gspo-token":
            seq = seq.detach() * torch.exp(logprobs - logprobs.detach())
        ratio = seq.expand_as(mask) if cfg.policy == "gspo" else seq
        surr = _surrogate(ratio, advantages, cfg)
    if cfg.decoupled:
        surr = surr * torch.exp(log_w).clamp(max=cfg.tis_cap)
    loss = -aggregate(surr, keep, cfg)
    stats = {"pg_loss": float(loss.detach())} | _stats(ratio, advantages, log_w, mask, keep, cfg)
    if reference is not None:
        k = kl_estimate(logprobs, reference, cfg.kl_estimator)
        kl_loss = aggregate(k, keep, cfg)
        loss = loss + cfg.kl_coef * kl_loss
        stats |= {
            "kl": float((k.detach() * keep).sum() / keep.sum().clamp(min=1)),
            "kl_loss": float(kl_loss.detach()),
        }
    return loss, stats


def _mis_keep(log_w: torch.Tensor, mask: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """1 where the (token or sequence) IS ratio lies in [mis_low, mis_high], else 0."""
    if cfg.mis_level == "sequence":
        row_mean = (log_w * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        log_w = row_mean.expand_as(mask)
    w = torch.exp(log_w)
    return ((w >= cfg.mis_low) & (w <= cfg.mis_high)).to(mask.dtype)


def _surrogate(ratio: torch.Tensor, adv: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """s_t: the PPO clipped surrogate, with the dual-clip floor c * A for negative advantages."""
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_high) * adv)
    if cfg.dual_clip < math.inf:
        surr = torch.where(adv < 0, torch.maximum(surr, cfg.dual_clip * adv), surr)
    return surr


def aggregate(x: torch.Tensor, m: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """agg(x; m) for ``cfg.agg_mode`` (formulas: docs/losses.md); ``[batch, seq]`` -> scalar."""
    if cfg.agg_mode == "token-mean":
        return (x * m).sum() / m.sum().clamp(min=1)
    tokens, row_sum = m.sum(-1), (x * m).sum(-1)
    if cfg.agg_mode == "seq-mean-token-mean":
        row_sum = row_sum / tokens.clamp(min=1)
    elif cfg.agg_mode == "seq-mean-token-sum-norm":
        row_sum = row_sum / cfg.norm_length
    return row_sum.sum() / (tokens > 0).sum().clamp(min=1)


def distill_loss(
    student_logits: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    coef: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    beta: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """L_distill (docs/losses.md, "Dense distillation") from the student's logits ``[batch, seq,
    vocab]`` at the positions that predict each token, the teacher's ``topk_ids``/``topk_logprobs``
    ``[batch, seq, k]`` there, ``coef`` and ``mask`` ``[batch, seq]``, with D_t the generalized JSD of ``beta``
    (0: the forward KL). Stats: ``distill_kl``, the forward KL's mean over the mask (whatever the
    divergence trained on, so runs compare), and with ``beta > 0`` ``distill_jsd``, D_t's mean."""
    student, teacher = topk_tail_logprobs(student_logits, topk_ids, topk_logprobs)
    forward = kl_divergence(teacher, student, mask)
    tokens = mask.sum().clamp(min=1)
    stats = {"distill_kl": float(forward.detach().sum() / tokens)}
    if beta == 0:
        return aggregate(coef * forward, mask, cfg), stats
    divergence = generalized_jsd(student, teacher, mask, beta)
    stats["distill_jsd"] = float(divergence.detach().sum() / tokens)
    return aggregate(coef * divergence, mask, cfg), stats


def kl_estimate(logprobs: torch.Tensor, reference: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from a sample of pi, delta = log pi - log pi_ref.

    As value estimates (Schulman, 2020): k1 = delta is unbiased with high variance and can be
    negative; k2 = delta^2 / 2 is biased with low variance; k3 = exp(-delta) - 1 + delta is
    unbiased and >= 0 (computed with expm1 so tiny gaps stay exact). As loss terms, on-policy:
    E[grad k1] = 0, E[grad k2] = grad KL(pi || pi_ref), and E[grad k3] = grad KL(pi_ref || pi).
    """
    delta = logprobs - reference
    if estimator == "k1":
        return delta
    if estimator == "k2":
        return 0.5 * delta**2
    return torch.expm1(-delta) + delta


@torch.no_grad()
def _stats(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    log_w: torch.Tensor,
    mask: torch.Tensor,
    keep: torch.Tensor,
    cfg: LossConfig,
) -> dict[str, float]:
    n, kept = mask.sum().clamp(min=1), keep.sum().clamp(min=1)
    w = torch.exp(log_w)[mask > 0]
    out = {
        "clip_frac": float(
            ((((1 - ratio) > cfg.clip_eps) | ((ratio - 1) > cfg.clip_high)).float() * keep).sum() / kept
        ),
        "dual_clip_frac": float((((adv < 0) & (ratio > cfg.dual_clip)).float() * keep).sum() / kept),
        "tis_frac": float(((torch.exp(log_w) > cfg.tis_cap).float() * mask).sum() / n),
        "mis_drop_frac": float((mask - keep).sum() / n),
    }
    if w.numel():
        out |= {
            "is_weight_mean": float(w.mean()),
            "is_weight_min": float(w.min()),
            "is_weight_max": float(w.max()),
        }
    return out
