"""Records: msgpack/JSON round trips, derived Trajectory views against hand-built examples, and one
``validate()`` failure per stated invariant."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import loong_core.records as records_module
from loong_core.records import (
    EpisodeStatus,
    SpanSource,
    TensorEntry,
    TokenSpan,
    TrainBatch,
    Trajectory,
    WeightManifest,
    decode,
    encode,
)

M, P, T, E = SpanSource.MODEL, SpanSource.PROMPT, SpanSource.TOOL, SpanSource.ENV


def _example_trajectory() -> Trajectory:
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


def _example_batch() -> TrainBatch:
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


def _distilled_batch() -> TrainBatch:
    """The example batch with dense distillation targets, k = 2."""
    return msgspec.structs.replace(
        _example_batch(),
        teacher_topk_ids=[7, 8, 2, 9, 3, 1, 4, 6, 5, 0],
        teacher_topk_logprobs=[-0.1, -2.5, -0.2, -1.9, -0.3, -1.4, -0.4, -1.2, -0.5, -1.0],
        distill_coef=[0.0, 1.0, 1.0, 0.0, 0.5],
    )


def _example_manifest() -> WeightManifest:
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


def test_exports() -> None:
    assert sorted(records_module.__all__) == sorted(
        [
            "EpisodeStatus",
            "SpanSource",
            "TensorEntry",
            "TokenSpan",
            "TrainBatch",
            "Trajectory",
            "WeightManifest",
            "decode",
            "encode",
        ]
    )


# ---- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "record",
    [
        _example_trajectory(),
        _example_batch(),
        _distilled_batch(),
        _example_manifest(),
        TensorEntry("x", [], "int64", 0, 0, 8),
        TokenSpan([1, 2], M, logprobs=[-0.5, -1.5], weight_version=0),
    ],
    ids=["trajectory", "batch", "distilled-batch", "manifest", "entry", "span"],
)
def test_msgpack_and_json_round_trip(record: msgspec.Struct) -> None:
    kind = type(record)
    back = decode(encode(record), kind)
    assert back == record
    assert msgspec.json.decode(msgspec.json.encode(record), type=kind) == record


def test_round_trip_restores_enums_not_strings() -> None:
    back = decode(encode(_example_trajectory()), Trajectory)
    assert back.status is EpisodeStatus.TRUNCATED
    assert [s.source for s in back.spans] == [P, M, T, M, E]
    assert all(type(s.source) is SpanSource for s in back.spans)
    # derived views depend on enum identity, so they must survive the wire
    assert back.loss_mask == _example_trajectory().loss_mask


def test_wire_format_uses_enum_values() -> None:
    as_json = msgspec.json.decode(msgspec.json.encode(_example_trajectory()))
    assert as_json["status"] == "truncated"
    assert [s["source"] for s in as_json["spans"]] == ["prompt", "model", "tool", "model", "env"]


def test_defaults_are_filled_when_absent_on_the_wire() -> None:
    minimal = msgspec.msgpack.encode(
        {"sample_id": "a", "group_id": "g", "spans": [{"token_ids": [1], "source": "prompt"}]}
    )
    t = decode(minimal, Trajectory)
    assert (t.reward, t.status, t.turn_rewards, t.tags, t.info) == (0.0, EpisodeStatus.OK, [], {}, {})
    assert t.spans[0] == TokenSpan([1], P, logprobs=[], weight_version=-1, versions=[])


@pytest.mark.parametrize(
    ("payload", "kind"),
    [
        ({"sample_id": "a", "group_id": "g", "spans": [{"token_ids": [1], "source": "robot"}]}, Trajectory),
        ({"sample_id": "a", "group_id": "g", "spans": [], "status": "crashed"}, Trajectory),
        (
            {"sample_id": "a", "group_id": "g", "spans": [{"token_ids": ["x"], "source": "prompt"}]},
            Trajectory,
        ),
        ({"sample_id": "a", "spans": []}, Trajectory),  # group_id missing
        ({"version": 1, "tensors": [], "bucket_sizes": "no"}, WeightManifest),
    ],
    ids=["bad-source", "bad-status", "bad-token", "missing-field", "bad-type"],
)
def test_decode_rejects_malformed_payloads(payload: dict, kind: type) -> None:
    with pytest.raises(msgspec.ValidationError):
        decode(msgspec.msgpack.encode(payload), kind)


def test_decode_rejects_the_wrong_record_kind() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode(encode(_example_batch()), Trajectory)


_finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
_ids = st.lists(st.integers(0, 2**31 - 1), max_size=6)


@st.composite
def _spans(draw: st.DrawFn) -> TokenSpan:
    source = draw(st.sampled_from(list(SpanSource)))
    if source is not M:
        return TokenSpan(draw(_ids), source)
    ids = draw(_ids.filter(bool))  # empty model spans: see test_prompt_len_ignores_an_empty_model_span
    per_token = draw(st.booleans())
    return TokenSpan(
        ids,
        M,
        logprobs=draw(st.lists(_finite, min_size=len(ids), max_size=len(ids))),
        weight_version=draw(st.integers(0, 1000)),
        versions=draw(st.lists(st.integers(0, 1000), min_size=len(ids), max_size=len(ids)))
        if per_token
        else [],
    )


_text = st.text(max_size=8)
_trajectories = st.builds(
    Trajectory,
    sample_id=_text,
    group_id=_text,
    spans=st.tuples(
        st.builds(TokenSpan, _ids, st.sampled_from([P, T, E])), st.lists(_spans(), max_size=5)
    ).map(lambda pair: [pair[0], *pair[1]]),
    reward=_finite,
    status=st.sampled_from(list(EpisodeStatus)),
    turn_rewards=st.lists(_finite, max_size=3),
    tags=st.dictionaries(_text, _text, max_size=3),
    info=st.dictionaries(_text, _text, max_size=3),
)


@settings(max_examples=30, deadline=None, database=None)
@given(_trajectories)
def test_trajectory_round_trip_property(traj: Trajectory) -> None:
    traj.validate()  # the strategy only builds valid trajectories
    assert decode(encode(traj), Trajectory) == traj
    assert msgspec.json.decode(msgspec.json.encode(traj), type=Trajectory) == traj
    # independent model of the derived views: walk spans token by token
    mask, lps, vers = [], [], []
    for s in traj.spans:
        for i in range(len(s.token_ids)):
            model = s.source == "model"
            mask.append(1 if model else 0)
            lps.append(s.logprobs[i] if model else 0.0)
            vers.append((s.versions[i] if s.versions else s.weight_version) if model else -1)
    assert (traj.loss_mask, traj.logprobs, traj.token_versions) == (mask, lps, vers)
    assert traj.num_model_tokens == sum(mask)
    assert traj.prompt_len == (mask.index(1) if 1 in mask else len(mask))
    model_versions = [v for v, m in zip(vers, mask, strict=True) if m]
    assert traj.oldest_version == (min(model_versions) if model_versions else -1)


# ---- derived views, by hand ----------------------------------------------------------------------


def test_trajectory_derived_views_hand_built() -> None:
    t = _example_trajectory()
    t.validate()
    assert t.token_ids == [10, 11, 12, 20, 21, 30, 40, 41, 42, 50, 51]
    assert t.loss_mask == [0, 0, 0, 1, 1, 0, 1, 1, 1, 0, 0]
    assert t.logprobs == [0.0, 0.0, 0.0, -0.5, -0.25, 0.0, -1.0, -2.0, -3.0, 0.0, 0.0]
    assert t.token_versions == [-1, -1, -1, 4, 4, -1, 5, 5, 6, -1, -1]
    assert t.prompt_len == 3
    assert t.num_model_tokens == 5
    assert t.oldest_version == 4


def test_prompt_len_counts_every_non_model_span_before_the_first_model_token() -> None:
    t = Trajectory(
        "s",
        "g",
        [TokenSpan([1, 2], P), TokenSpan([3], E), TokenSpan([4], M, [-1.0], 0), TokenSpan([5, 6], T)],
    )
    assert t.prompt_len == 3


def test_prompt_len_ignores_an_empty_model_span() -> None:
    # "Tokens before the first model token": an empty model span holds no token, so all 3 count.
    t = Trajectory("s", "g", [TokenSpan([1, 2], P), TokenSpan([], M, [], 0), TokenSpan([3], T)])
    assert t.prompt_len == 3


def test_trajectory_without_model_tokens() -> None:
    t = Trajectory("s", "g", [TokenSpan([1, 2], P), TokenSpan([3], T)])
    t.validate()
    assert (t.prompt_len, t.num_model_tokens, t.oldest_version) == (3, 0, -1)
    assert t.loss_mask == [0, 0, 0]


def test_oldest_version_uses_per_token_versions() -> None:
    t = Trajectory(
        "s",
        "g",
        [
            TokenSpan([1], P),
            TokenSpan([2, 3], M, [-1.0, -1.0], 9, versions=[9, 2]),
            TokenSpan([4], M, [-1.0], 5),
        ],
    )
    assert t.oldest_version == 2
    assert t.token_versions == [-1, 9, 2, 5]


def test_token_span_versions() -> None:
    assert TokenSpan([1, 2, 3], M, [0.0] * 3, weight_version=7).token_versions() == [7, 7, 7]
    assert TokenSpan([1, 2], M, [0.0] * 2, weight_version=7, versions=[6, 7]).token_versions() == [6, 7]
    assert TokenSpan([1, 2], P).token_versions() == [-1, -1]


def test_train_batch_rows() -> None:
    b = _example_batch()
    b.validate()
    assert b.num_tokens == 5
    assert list(b.rows()) == [(0, 3), (3, 5)]


def test_manifest_total_bytes() -> None:
    m = _example_manifest()
    m.validate()
    assert m.total_bytes == 448


@pytest.mark.parametrize(
    ("status", "trainable"),
    [
        (EpisodeStatus.OK, True),
        (EpisodeStatus.TRUNCATED, True),
        (EpisodeStatus.FAILED, False),
        (EpisodeStatus.TIMEOUT, False),
    ],
)
def test_episode_status_trainable(status: EpisodeStatus, trainable: bool) -> None:
    assert status.trainable is trainable


# ---- validate(): one failure per stated invariant -------------------------------------------------


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
        msgspec.structs.replace(_example_batch(), **{field: value}).validate()


def test_distillation_targets_are_k_per_token() -> None:
    batch = _distilled_batch()
    batch.validate()
    assert batch.teacher_top_k == 2 and _example_batch().teacher_top_k == 0


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
        msgspec.structs.replace(_distilled_batch(), **{field: value}).validate()


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
