"""The numbers of one metrics line (``metrics.jsonl``), as pure functions of what a step saw."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from loong_core.records import EpisodeStatus, Trajectory
from loong_train.messages import EngineCounts

__all__ = ["batch_row", "engine_row", "train_row"]

_TRAIN_KEYS = (
    "mismatch_kl",
    "onpolicy_mismatch_kl",
    "mismatch_abs_logp",
    "onpolicy_mismatch_abs_logp",
    "loss",
    "grad_norm",
    "lr",
    # loong_train.algo.losses.policy_loss
    "pg_loss",
    "clip_frac",
    "dual_clip_frac",
    "tis_frac",
    "mis_drop_frac",
    "is_weight_mean",
    "is_weight_min",
    "is_weight_max",
    "kl",
    "kl_loss",
)
_TRAIN_IF_PRESENT = (
    "distill_kl",  # loong_train.algo.losses.distill_loss (dense OPD objectives)
    "distill_jsd",
    "trainer_threads_mean",  # its own threads and those borrowed from resting workers (loong_train.cores)
)
_TRAIN_PREFIXES = ("opd/", "teacher/")  # per-teacher OPD metrics (loong_train.algo.opd), named by teacher


def batch_row(trajs: list[Trajectory], staleness: list[int]) -> dict[str, Any]:
    """A taken batch: rewards, staleness, statuses, lengths and the episodes' own numbers."""
    statuses = Counter(t.status for t in trajs)
    ok = [t for t in trajs if t.status.trainable]
    return {
        "reward_mean": sum(t.reward for t in ok) / max(1, len(ok)),
        "staleness_mean": sum(staleness) / len(staleness),
        "staleness_max": max(staleness),
        "staleness_hist": dict(Counter(str(s) for s in staleness)),
        "samples": len(trajs),
        "failed": statuses[EpisodeStatus.FAILED],
        "timeouts": statuses[EpisodeStatus.TIMEOUT],
        "truncated": statuses[EpisodeStatus.TRUNCATED],
        "response_tokens_mean": sum(t.num_model_tokens for t in ok) / max(1, len(ok)),
        "mixed_version_samples": sum(t.mixed_versions for t in trajs),  # partial rollouts
        **_episode_metrics(ok),
    }


def train_row(m: dict[str, float]) -> dict[str, Any]:
    """The train step's metrics a line reports (every key of ``_TRAIN_KEYS``, None when absent)."""
    return {
        **{k: m.get(k) for k in _TRAIN_KEYS},
        **{k: m[k] for k in _TRAIN_IF_PRESENT if k in m},
        **{k: v for k, v in m.items() if k.startswith(_TRAIN_PREFIXES)},
    }


def engine_row(counts: list[EngineCounts], wall: float, workers: int) -> dict[str, float]:
    """Embedded engines, since their workers started: the fraction of time a forward runs
    (``engine_busy_frac``) and the mean rows per decode step (``engine_rows_per_step``)."""
    if not counts:
        return {}
    steps = sum(c.steps for c in counts)
    return {
        "engine_busy_frac": min(1.0, sum(c.busy_s for c in counts) / (wall * workers)),
        "engine_rows_per_step": sum(c.rows for c in counts) / max(steps, 1),
    }


def _episode_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """``reward/<key>``: the mean of each finite number the episodes carry (a reward's other keys)
    over the episodes that carry it."""
    values: dict[str, list[float]] = {}
    for t in trajs:
        for k, v in t.metrics.items():
            if math.isfinite(v):
                values.setdefault(k, []).append(v)
    return {f"reward/{k}": sum(v) / len(v) for k, v in sorted(values.items())}
