"""Hand-built records shared by the record tests: a trajectory with every span source, a train
batch (and the same batch with distillation targets), a weight manifest; ``M, P, T, E`` name the span
sources."""

from __future__ import annotations

import msgspec

from loong_core.records import (
    EpisodeStatus,
    SpanSource,
    TensorEntry,
    TokenSpan,
    TrainBatch,
    Trajectory,
    WeightManifest,
)

__all__ = ["E", "M", "P", "T", "distilled_batch", "example_batch", "example_manifest", "example_trajectory"]

M, P, T, E = SpanSource.MODEL, SpanSource.PROMPT, SpanSource.TOOL, SpanSource.ENV


def example_trajectory() -> Trajectory:
    """prompt(3) model(2, v=4) tool(1) model(3, per-token versions 5,5,6) env(2)."""
    return Trajectory(
        sample_id="s-1",
        group_id="g-1",
        spans=[
            TokenSpan([10, 11, 12], P),
            TokenSpan([20, 21], M, logprobs=[-0.5, -0.25], weight_version=4),
            TokenSpan([30], T),
            TokenSpan([40, 41, 42], M, logprobs=[-1.0, -2.0, -3.0], weight_version=5, versions=[5, 5, 6]),
            TokenSpan([50, 51], E),
        ],
        reward=0.75,
        status=EpisodeStatus.TRUNCATED,
        turn_rewards=[0.5, 0.25],
        tags={"task": "calc"},
        info={"wall_s": "1.5"},
    )


def example_batch() -> TrainBatch:
    return TrainBatch(
        token_ids=[1, 2, 3, 4, 5],
        loss_mask=[0, 1, 1, 0, 1],
        advantages=[0.0, 0.5, 0.5, 0.0, -1.0],
        behaviour_logprobs=[0.0, -0.1, -0.2, 0.0, -0.3],
        versions=[-1, 3, 3, -1, 2],
        row_lens=[3, 2],
        sample_ids=["a", "b"],
        policy_version=4,
        row_tags=[{"domain": "add"}, {"domain": "mul"}],
    )


def distilled_batch() -> TrainBatch:
    """The example batch with dense distillation targets, k = 2."""
    return msgspec.structs.replace(
        example_batch(),
        teacher_topk_ids=[7, 8, 2, 9, 3, 1, 4, 6, 5, 0],
        teacher_topk_logprobs=[-0.1, -2.5, -0.2, -1.9, -0.3, -1.4, -0.4, -1.2, -0.5, -1.0],
        distill_coef=[0.0, 1.0, 1.0, 0.0, 0.5],
    )


def example_manifest() -> WeightManifest:
    return WeightManifest(
        version=7,
        tensors=[
            TensorEntry("w", [2, 3], "float32", bucket=0, offset=0, nbytes=24),
            TensorEntry("b", [3], "bfloat16", bucket=0, offset=64, nbytes=6),
            TensorEntry("big", [40], "int64", bucket=1, offset=0, nbytes=320),
        ],
        bucket_sizes=[128, 320],
        checksums=[123, 456],
    )
