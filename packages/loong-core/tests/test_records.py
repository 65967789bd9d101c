"""Records: msgpack/JSON round trips and derived Trajectory views against hand-built examples."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from records_testkit import E, M, P, T, distilled_batch, example_batch, example_manifest, example_trajectory

import loong_core.records as records_module
from loong_core.records import (
    EpisodeStatus,
    SpanSource,
    TensorEntry,
    TokenSpan,
    Trajectory,
    WeightManifest,
    decode,
    encode,
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
        example_trajectory(),
        example_batch(),
        distilled_batch(),
        example_manifest(),
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
    back = decode(encode(example_trajectory()), Trajectory)
    assert back.status is EpisodeStatus.TRUNCATED
    assert [s.source for s in back.spans] == [P, M, T, M, E]
    assert all(type(s.source) is SpanSource for s in back.spans)
    # derived views depend on enum identity, so they must survive the wire
    assert back.loss_mask == example_trajectory().loss_mask


def test_wire_format_uses_enum_values() -> None:
    as_json = msgspec.json.decode(msgspec.json.encode(example_trajectory()))
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
        decode(encode(example_batch()), Trajectory)


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
    t = example_trajectory()
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
    b = example_batch()
    b.validate()
    assert b.num_tokens == 5
    assert list(b.rows()) == [(0, 3), (3, 5)]


def test_manifest_total_bytes() -> None:
    m = example_manifest()
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
