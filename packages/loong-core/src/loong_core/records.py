"""Records that cross process boundaries: msgspec Structs with stated invariants.

Every record here is encoded with msgspec (msgpack on the wire, JSON in logs) and has a
round-trip test. Invariants are checked by ``validate()``, which is called at boundaries
(when a record arrives from another process), never in hot inner loops.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Iterable
from typing import TypeVar

import msgspec

__all__ = [
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


class SpanSource(enum.StrEnum):
    """Who produced a run of tokens. Only ``MODEL`` tokens are trained on."""

    MODEL = "model"
    PROMPT = "prompt"
    TOOL = "tool"
    ENV = "env"


class EpisodeStatus(enum.StrEnum):
    """How an episode ended. Only ``OK`` and ``TRUNCATED`` episodes enter group statistics."""

    OK = "ok"
    TRUNCATED = "truncated"
    FAILED = "failed"
    TIMEOUT = "timeout"

    @property
    def trainable(self) -> bool:
        return self in (EpisodeStatus.OK, EpisodeStatus.TRUNCATED)


class TokenSpan(msgspec.Struct, frozen=True):
    """A run of tokens produced by one source.

    Invariants:
      - ``source == MODEL``: ``len(logprobs) == len(token_ids)`` and ``weight_version >= 0``;
        ``versions`` is empty (one version for the whole span) or has one entry per token
        (a partial rollout that crossed a weight update).
      - otherwise: ``logprobs`` and ``versions`` are empty and ``weight_version == -1``.
    """

    token_ids: list[int]
    source: SpanSource
    logprobs: list[float] = []
    weight_version: int = -1
    versions: list[int] = []

    @property
    def is_model(self) -> bool:
        return self.source == SpanSource.MODEL

    def token_versions(self) -> list[int]:
        """The weight version of every token ([len(token_ids)]); -1 for non-model tokens."""
        if self.versions:
            return list(self.versions)
        return [self.weight_version] * len(self.token_ids)

    def validate(self, vocab_size: int = 0) -> None:
        """The invariants above; every id a token of the vocabulary (``[0, vocab_size)``, or just
        non-negative when ``vocab_size`` is 0) and every logprob a finite number."""
        n = len(self.token_ids)
        top = vocab_size or 2**63
        if bad := [t for t in self.token_ids if not (isinstance(t, int) and 0 <= t < top)][:3]:
            raise ValueError(f"{self.source} span holds token ids outside [0, {vocab_size or 'inf'}): {bad}")
        if self.is_model:
            if len(self.logprobs) != n:
                raise ValueError(f"model span has {n} tokens but {len(self.logprobs)} logprobs")
            if not all(math.isfinite(lp) for lp in self.logprobs):
                raise ValueError("model span holds a non-finite logprob (NaN or inf)")
            if self.weight_version < 0:
                raise ValueError("model span needs weight_version >= 0")
            if self.versions and len(self.versions) != n:
                raise ValueError(f"model span has {n} tokens but {len(self.versions)} versions")
        elif self.logprobs or self.versions or self.weight_version != -1:
            raise ValueError(f"{self.source} span must not carry logprobs or versions")


class Trajectory(msgspec.Struct):
    """One agent episode (or one row of it): spans in order plus its outcome.

    Invariants: ``spans`` is non-empty and starts with a non-model span (the prompt);
    ``sample_id`` is unique across a run (the ledger key); ``group_id`` names the GRPO group
    (all samples of one prompt). The loss mask is derived from spans: model tokens 1, others 0.
    ``metrics``: the episode's own numbers for the run's metrics (a reward's other keys).
    """

    sample_id: str
    group_id: str
    spans: list[TokenSpan]
    reward: float = 0.0
    status: EpisodeStatus = EpisodeStatus.OK
    turn_rewards: list[float] = []
    tags: dict[str, str] = {}
    info: dict[str, str] = {}
    metrics: dict[str, float] = {}

    @property
    def token_ids(self) -> list[int]:
        return [t for s in self.spans for t in s.token_ids]

    @property
    def loss_mask(self) -> list[int]:
        return [int(s.is_model) for s in self.spans for _ in s.token_ids]

    @property
    def logprobs(self) -> list[float]:
        """Behaviour logprob of every token ([len(token_ids)]); 0.0 where the mask is 0."""
        return [lp for s in self.spans for lp in (s.logprobs if s.is_model else [0.0] * len(s.token_ids))]

    @property
    def token_versions(self) -> list[int]:
        return [v for s in self.spans for v in s.token_versions()]

    @property
    def prompt_len(self) -> int:
        """Tokens before the first model token."""
        n = 0
        for s in self.spans:
            if s.is_model and s.token_ids:
                break
            n += len(s.token_ids)
        return n

    @property
    def num_model_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.spans if s.is_model)

    @property
    def oldest_version(self) -> int:
        """The oldest weight version among model tokens; -1 when the episode produced none."""
        versions = [v for s in self.spans if s.is_model for v in s.token_versions()]
        return min(versions) if versions else -1

    @property
    def mixed_versions(self) -> bool:
        """Whether the model tokens come from more than one weight version (a partial rollout
        whose episode an update crossed)."""
        return len({v for s in self.spans if s.is_model for v in s.token_versions()}) > 1

    def validate(self, vocab_size: int = 0) -> None:
        """Raises ValueError naming the first broken invariant: the span layout, an id outside the
        vocabulary, a non-finite logprob, reward, turn reward or metric."""
        if not self.spans or self.spans[0].is_model:
            raise ValueError(f"trajectory {self.sample_id}: must start with a prompt span")
        try:
            for span in self.spans:
                span.validate(vocab_size)
        except ValueError as e:
            raise ValueError(f"trajectory {self.sample_id}: {e}") from None
        numbers = {
            "reward": self.reward,
            **{f"turn_rewards[{i}]": r for i, r in enumerate(self.turn_rewards)},
        }
        numbers |= {f"metrics[{k!r}]": v for k, v in self.metrics.items()}
        if bad := [k for k, v in numbers.items() if not math.isfinite(v)]:
            raise ValueError(f"trajectory {self.sample_id}: {bad[0]} is not a finite number")

    def checked(self, vocab_size: int = 0) -> Trajectory:
        """This trajectory, or, when it breaks an invariant of :meth:`validate` (a NaN logprob
        from an engine, a reward that is not a finite number, an id outside the vocabulary), the
        :meth:`failed` episode that says why: nothing invalid is recorded for training."""
        try:
            self.validate(vocab_size)
        except ValueError as e:
            return self.failed(f"invalid trajectory: {e}")
        return self

    def failed(self, reason: str) -> Trajectory:
        """This episode as a failed one that carries nothing to train on (an empty prompt span,
        reward 0) and says why in ``info["error"]``: what a trajectory that does not validate becomes."""
        return Trajectory(
            sample_id=self.sample_id,
            group_id=self.group_id,
            spans=[TokenSpan(token_ids=[], source=SpanSource.PROMPT)],
            status=EpisodeStatus.FAILED,
            tags=dict(self.tags),
            info={**self.info, "error": reason},
        )


class TrainBatch(msgspec.Struct):
    """Packed trajectories ready for a train step. Every per-token list is [num_tokens].

    Rows are concatenated; ``row_lens[i]`` tokens belong to row i (sum == num_tokens).
    ``advantages`` are per token (0 where ``loss_mask`` is 0); ``behaviour_logprobs`` are the
    rollout engine's logprobs; ``versions`` the weight version of each token (-1 if not model).
    ``row_tags`` is empty or holds each row's trajectory tags (``[rows]``; e.g. the ``domain``
    that routes a row to its teacher in on-policy distillation).

    Dense distillation targets (empty without): ``teacher_topk_ids`` and ``teacher_topk_logprobs``
    hold each token's k most likely ids under its row's teacher and their logprobs
    (``[num_tokens * k]``, token by token), ``distill_coef`` each token's weight on the distillation
    loss (``[num_tokens]``; the teacher's coefficient at loss tokens, else 0), ``distill_beta`` the
    divergence's beta (the generalized JSD's; 0 is the forward KL(teacher || student), 1 the reverse).
    """

    token_ids: list[int]
    loss_mask: list[int]
    advantages: list[float]
    behaviour_logprobs: list[float]
    versions: list[int]
    row_lens: list[int]
    sample_ids: list[str]
    policy_version: int
    row_tags: list[dict[str, str]] = []
    teacher_topk_ids: list[int] = []
    teacher_topk_logprobs: list[float] = []
    distill_coef: list[float] = []
    distill_beta: float = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def teacher_top_k(self) -> int:
        """k of the dense distillation targets; 0 without them."""
        return len(self.teacher_topk_ids) // max(1, len(self.token_ids))

    def rows(self) -> Iterable[tuple[int, int]]:
        """(start, end) offsets of each row."""
        start = 0
        for n in self.row_lens:
            yield start, start + n
            start += n

    def validate(self) -> None:
        n = len(self.token_ids)
        for name in ("loss_mask", "advantages", "behaviour_logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"TrainBatch.{name} has {len(getattr(self, name))} entries, expected {n}")
        if sum(self.row_lens) != n:
            raise ValueError(f"TrainBatch.row_lens sum to {sum(self.row_lens)}, expected {n}")
        if len(self.sample_ids) != len(self.row_lens):
            raise ValueError("TrainBatch needs one sample_id per row")
        if self.row_tags and len(self.row_tags) != len(self.row_lens):
            raise ValueError("TrainBatch.row_tags must be empty or hold one dict per row")
        if not 0.0 <= self.distill_beta <= 1.0:
            raise ValueError(f"TrainBatch.distill_beta must be in [0, 1], got {self.distill_beta}")
        k = self.teacher_top_k
        if self.teacher_topk_ids or self.teacher_topk_logprobs or self.distill_coef:
            if k == 0 or len(self.teacher_topk_ids) != k * n:
                raise ValueError(
                    f"TrainBatch.teacher_topk_ids has {len(self.teacher_topk_ids)} entries, "
                    f"expected k * {n} tokens for some k >= 1"
                )
            if len(self.teacher_topk_logprobs) != k * n or len(self.distill_coef) != n:
                raise ValueError(
                    f"TrainBatch.teacher_topk_logprobs has {len(self.teacher_topk_logprobs)} entries and "
                    f"distill_coef {len(self.distill_coef)}, expected {k * n} and {n} (k = {k})"
                )


class TensorEntry(msgspec.Struct, frozen=True):
    """One tensor in a weight manifest: where its bytes sit in which bucket."""

    name: str
    shape: list[int]
    dtype: str
    bucket: int
    offset: int
    nbytes: int


class WeightManifest(msgspec.Struct):
    """What a weight update carries, exchanged and validated before any byte is applied.

    Invariants: names are unique; tensors of one bucket do not overlap and fit in
    ``bucket_sizes[bucket]``; ``checksums`` is empty or has one entry per bucket.
    """

    version: int
    tensors: list[TensorEntry]
    bucket_sizes: list[int]
    checksums: list[int] = []

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_sizes)

    def validate(self) -> None:
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError("WeightManifest has duplicate tensor names")
        for t in self.tensors:
            if not 0 <= t.bucket < len(self.bucket_sizes):
                raise ValueError(f"tensor {t.name}: bucket {t.bucket} does not exist")
            if t.offset < 0 or t.offset + t.nbytes > self.bucket_sizes[t.bucket]:
                raise ValueError(
                    f"tensor {t.name}: bytes [{t.offset}, {t.offset + t.nbytes}) outside its bucket"
                )
        by_bucket: dict[int, list[TensorEntry]] = {}
        for t in self.tensors:
            by_bucket.setdefault(t.bucket, []).append(t)
        for bucket, entries in by_bucket.items():
            entries.sort(key=lambda e: e.offset)
            for prev, cur in itertools.pairwise(entries):
                if prev.offset + prev.nbytes > cur.offset:
                    raise ValueError(f"tensors {prev.name} and {cur.name} overlap in bucket {bucket}")
        if self.checksums and len(self.checksums) != len(self.bucket_sizes):
            raise ValueError("WeightManifest needs one checksum per bucket")


_T = TypeVar("_T")
_encoder = msgspec.msgpack.Encoder()


def encode(record: msgspec.Struct) -> bytes:
    """msgpack bytes of a record."""
    return _encoder.encode(record)


def decode(data: bytes, kind: type[_T]) -> _T:
    """Decode msgpack bytes into ``kind``, validating types; raises ``msgspec.ValidationError``."""
    return msgspec.msgpack.decode(data, type=kind)
