"""Records' ``validate()``: one failure per stated invariant of each record."""

from __future__ import annotations

import msgspec
import pytest
from records_testkit import E, M, P, T, distilled_batch, example_batch

from loong_core.records import TensorEntry, TokenSpan, Trajectory, WeightManifest


@pytest.mark.parametrize(
    ("span", "message"),
    [
        (TokenSpan([1, 2], M, logprobs=[-1.0], weight_version=0), "2 tokens but 1 logprobs"),
        (TokenSpan([1], M, logprobs=[-1.0], weight_version=-1), "weight_version >= 0"),
        (
            TokenSpan([1, 2], M, logprobs=[-1.0, -1.0], weight_version=0, versions=[0]),
            "2 tokens but 1 versions",
        ),
        (TokenSpan([1], P, logprobs=[-1.0]), "must not carry"),
        (TokenSpan([1], T, versions=[3]), "must not carry"),
        (TokenSpan([1], E, weight_version=0), "must not carry"),
    ],
    ids=[
        "model-logprobs",
        "model-version",
        "model-versions",
        "prompt-logprobs",
        "tool-versions",
        "env-version",
    ],
)
def test_token_span_validate_rejects(span: TokenSpan, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        span.validate()


def test_token_span_validate_accepts_valid_spans() -> None:
    TokenSpan([], M, [], weight_version=0).validate()
    TokenSpan([1, 2], M, [-1.0, -2.0], weight_version=0, versions=[0, 1]).validate()
    TokenSpan([1, 2], T).validate()


@pytest.mark.parametrize(
    "spans",
    [[], [TokenSpan([1], M, [-1.0], 0)]],
    ids=["empty", "starts-with-model"],
)
def test_trajectory_validate_needs_a_leading_prompt_span(spans: list[TokenSpan]) -> None:
    with pytest.raises(ValueError, match="must start with a prompt span"):
        Trajectory("s-9", "g", spans).validate()


def test_trajectory_validate_checks_every_span() -> None:
    bad = Trajectory("s", "g", [TokenSpan([1], P), TokenSpan([2, 3], M, [-1.0], 0)])
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        bad.validate()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("loss_mask", [0, 1], "loss_mask has 2 entries, expected 5"),
        ("advantages", [0.0] * 6, "advantages has 6 entries"),
        ("behaviour_logprobs", [], "behaviour_logprobs has 0 entries"),
        ("versions", [1], "versions has 1 entries"),
        ("row_lens", [3, 1], "row_lens sum to 4, expected 5"),
        ("sample_ids", ["a"], "one sample_id per row"),
        ("row_tags", [{"domain": "add"}], "row_tags must be empty or hold one dict per row"),
    ],
)
def test_train_batch_validate_rejects(field: str, value: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        msgspec.structs.replace(example_batch(), **{field: value}).validate()


def test_distillation_targets_are_k_per_token() -> None:
    batch = distilled_batch()
    batch.validate()
    assert batch.teacher_top_k == 2 and example_batch().teacher_top_k == 0


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("teacher_topk_ids", [1] * 7, "teacher_topk_ids has 7 entries, expected k \\* 5 tokens"),
        ("teacher_topk_logprobs", [0.0] * 5, "teacher_topk_logprobs has 5 entries and distill_coef 5"),
        ("distill_coef", [], "distill_coef 0, expected 10 and 5"),
        ("distill_beta", -0.5, r"distill_beta must be in \[0, 1\], got -0.5"),
    ],
)
def test_distillation_targets_validate_rejects(field: str, value: list | float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        msgspec.structs.replace(distilled_batch(), **{field: value}).validate()


def _manifest_with(
    *tensors: TensorEntry, sizes: list[int], checksums: list[int] | None = None
) -> WeightManifest:
    return WeightManifest(version=1, tensors=list(tensors), bucket_sizes=sizes, checksums=checksums or [])


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        (
            _manifest_with(
                TensorEntry("a", [1], "int64", 0, 0, 8), TensorEntry("a", [1], "int64", 0, 64, 8), sizes=[128]
            ),
            "duplicate tensor names",
        ),
        (_manifest_with(TensorEntry("a", [1], "int64", 1, 0, 8), sizes=[64]), "bucket 1 does not exist"),
        (_manifest_with(TensorEntry("a", [1], "int64", -1, 0, 8), sizes=[64]), "bucket -1 does not exist"),
        (_manifest_with(TensorEntry("a", [16], "int64", 0, 0, 128), sizes=[64]), r"\[0, 128\) outside"),
        (_manifest_with(TensorEntry("a", [1], "int64", 0, 60, 8), sizes=[64]), r"\[60, 68\) outside"),
        (_manifest_with(TensorEntry("a", [1], "int64", 0, -8, 8), sizes=[64]), "outside its bucket"),
        (
            _manifest_with(TensorEntry("a", [1], "int64", 0, 0, 8), sizes=[64, 64], checksums=[1]),
            "one checksum per bucket",
        ),
    ],
    ids=["dup-name", "no-bucket", "negative-bucket", "too-big", "past-end", "negative-offset", "checksums"],
)
def test_manifest_validate_rejects(manifest: WeightManifest, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        manifest.validate()


def test_manifest_validate_rejects_overlapping_tensors() -> None:
    overlapping = _manifest_with(
        TensorEntry("a", [4], "int64", 0, 0, 32), TensorEntry("b", [4], "int64", 0, 16, 32), sizes=[64]
    )
    with pytest.raises(ValueError):
        overlapping.validate()


def test_manifest_validate_accepts_adjacent_tensors_and_no_checksums() -> None:
    _manifest_with(
        TensorEntry("a", [4], "int64", 0, 0, 32), TensorEntry("b", [4], "int64", 0, 32, 32), sizes=[64]
    ).validate()
