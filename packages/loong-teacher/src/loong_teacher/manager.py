"""The Teacher Manager: route each sample to one teacher by its tags, score the student's sampled
tokens with that teacher, and keep local teachers within a memory budget.

Config (TOML)::

    [teachers]
    route_tag = "domain"          # samples carry tags = {"domain": "math", ...}
    default = "general"           # for samples whose tag no teacher claims
    budget_bytes = 3_000_000_000  # resident local teachers, in bytes
    top_k = 0                     # > 0: also the teacher's top-k ids/logprobs and the tail

    [[teachers.teachers]]
    name = "math"
    type = "local"                # one backend module each: local.py, remote.py
    path = "ckpt/math-teacher"    # Hugging Face dir: config.json + model.safetensors
    tags = ["math"]
    coefficient = 1.0

    [[teachers.teachers]]
    name = "general"
    type = "sglang"
    url = "http://10.0.0.5:30000"

Lifecycle::

    manager = TeacherManager(load_config(path, TeacherManagerConfig))
    scores = manager.score(samples)        # each: token_ids, loss_mask, tags (a Trajectory works)
    adv = reverse_kl_advantage(logp_theta, scores.logprobs, scores.mask, coef=scores.coef)
    manager.close()

One call groups the samples per teacher and scores the groups one after another, teachers already
resident first, so each teacher is made resident at most once per call; the rest follows
:mod:`loong_teacher.residency`. ``scores.metrics`` (also ``manager.last_metrics``) reports, per call:
``teacher/<name>/samples``, ``teacher/<name>/tokens``, ``teacher/<name>/loads``, and
``teacher/bytes_paged_in``, ``teacher/loads``, ``teacher/evictions``, ``teacher/resident_bytes``,
``teacher/peak_resident_bytes`` (since construction), ``teacher/score_s``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from loong_teacher.compat import TokenizerMapping
from loong_teacher.config import LocalTeacherConfig, TeacherConfig, TeacherManagerConfig
from loong_teacher.local import Build, LocalTeacher
from loong_teacher.remote import SGLangTeacher
from loong_teacher.residency import Residency
from loong_teacher.teacher import RowScores, Scorable, Teacher

__all__ = ["TeacherManager", "TeacherRoutingError", "TeacherScores"]


class TeacherRoutingError(ValueError):
    """A sample's tags name no teacher and there is no default teacher."""


@dataclass(frozen=True)
class TeacherScores:
    """Scores of a batch, padded to its longest sample (``seq``), ready for ``loong_teacher.losses``.

    ``logprobs [batch, seq]``: ``log p_teacher(x_t | x_<t)`` where ``mask`` is 1, else 0;
    ``mask [batch, seq]``: the samples' loss masks; ``teacher [batch]``: routed teacher names;
    ``coef [batch, 1]``: each row's teacher coefficient; with ``top_k``: ``topk_ids [batch, seq, k]``
    (student ids), ``topk_logprobs [batch, seq, k]``, ``tail_logprobs [batch, seq]`` (0 where masked).
    """

    logprobs: torch.Tensor
    mask: torch.Tensor
    teacher: list[str]
    coef: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    tail_logprobs: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class TeacherManager:
    """Routes, groups, pages teachers in and out, and scores; see the module docstring."""

    def __init__(self, config: TeacherManagerConfig, build: Build | None = None) -> None:
        self.config = config
        self.teachers: dict[str, Teacher] = {t.name: _open(t, build) for t in config.teachers}
        self._configs = {t.name: t for t in config.teachers}
        self._routes = {tag: t.name for t in config.teachers for tag in t.tags}
        local = [t for t in self.teachers.values() if isinstance(t, LocalTeacher)]
        budget = config.budget_bytes if config.budget_bytes is not None else sum(t.nbytes for t in local)
        self.residency = Residency(budget, local)
        self.last_metrics: dict[str, float] = {}

    def route(self, tags: dict[str, str] | None) -> str:
        """The teacher for a sample with these tags."""
        value = (tags or {}).get(self.config.route_tag)
        name = self._routes.get(value, self.config.default) if value is not None else self.config.default
        if not name:
            raise TeacherRoutingError(
                f"no teacher for tag {self.config.route_tag}={value!r} and no default teacher "
                f"(routed tags: {sorted(self._routes)})"
            )
        return name

    def score(self, samples: Sequence[Scorable]) -> TeacherScores:
        """Score every sample's masked tokens with its routed teacher."""
        t0 = time.perf_counter()
        paged, loads, evictions = (
            self.residency.paged_in,
            dict(self.residency.loads),
            self.residency.evictions,
        )
        routed = [self.route(dict(s.tags)) for s in samples]
        groups: dict[str, list[int]] = {}
        for i, name in enumerate(routed):
            groups.setdefault(name, []).append(i)
        per_row: list[RowScores | None] = [None] * len(samples)
        for name in self._order(groups):
            for i, scores in zip(
                groups[name], self._score_group(name, [samples[i] for i in groups[name]]), strict=True
            ):
                per_row[i] = scores
        out = _assemble(
            samples, routed, per_row, [self._configs[n].coefficient for n in routed], self.config.top_k
        )
        metrics = {f"teacher/{n}/samples": float(len(g)) for n, g in groups.items()}
        for name, rows in groups.items():
            metrics[f"teacher/{name}/tokens"] = float(sum(_positions_count(samples[i]) for i in rows))
            if name in loads:
                metrics[f"teacher/{name}/loads"] = float(self.residency.loads[name] - loads[name])
        metrics.update({
            "teacher/bytes_paged_in": float(self.residency.paged_in - paged),
            "teacher/loads": float(sum(self.residency.loads.values()) - sum(loads.values())),
            "teacher/evictions": float(self.residency.evictions - evictions),
            "teacher/resident_bytes": float(self.residency.reserved),
            "teacher/peak_resident_bytes": float(self.residency.peak),
            "teacher/score_s": time.perf_counter() - t0,
        })  # fmt: skip
        self.last_metrics = metrics
        return TeacherScores(**{**out, "metrics": metrics})

    def close(self) -> None:
        self.residency.clear()
        for teacher in self.teachers.values():
            teacher.close()

    def _order(self, groups: dict[str, list[int]]) -> list[str]:
        """Resident teachers first (most recently used first), so none is evicted before its turn."""
        resident = self.residency.resident()
        return sorted(groups, key=lambda n: -resident.index(n) if n in resident else 1)

    def _score_group(self, name: str, samples: Sequence[Scorable]) -> list[RowScores]:
        """Scores of one teacher's samples; samples without a scored token cost nothing."""
        mapping = self._configs[name].tokenizer_mapping
        rows = [(_teacher_ids(s.token_ids, mapping), _positions(s)) for s in samples]
        todo = [i for i, (_, pos) in enumerate(rows) if pos]
        out = [_empty(self.config.top_k)] * len(rows)
        if not todo:
            return out
        teacher = self.teachers[name]
        if isinstance(teacher, LocalTeacher):
            self.residency.acquire(teacher)
        for i, scores in zip(todo, teacher.score([rows[i] for i in todo], self.config.top_k), strict=True):
            out[i] = _to_student_ids(scores, mapping)
        return out


def _empty(top_k: int) -> RowScores:
    if not top_k:
        return RowScores(torch.zeros(0))
    return RowScores(
        torch.zeros(0), torch.zeros(0, top_k, dtype=torch.long), torch.zeros(0, top_k), torch.zeros(0)
    )


def _to_student_ids(scores: RowScores, mapping: TokenizerMapping | None) -> RowScores:
    """Top-k ids come back in teacher ids; listed pairs map them to the student's."""
    if mapping is None or not mapping.token_ids or scores.topk_ids is None:
        return scores
    back = {t: s for s, t in mapping.token_ids}
    ids = scores.topk_ids.clone().apply_(lambda i: back.get(i, i))
    return RowScores(scores.logprobs, ids, scores.topk_logprobs, scores.tail_logprobs)


def _open(config: TeacherConfig, build: Build | None) -> Teacher:
    if isinstance(config, LocalTeacherConfig):
        return LocalTeacher(config, build)
    return SGLangTeacher(config)


def _positions(sample: Scorable) -> list[int]:
    mask = sample.loss_mask
    if len(mask) and mask[0]:
        raise ValueError("loss_mask[0] is 1, but the first token has no context to be scored in")
    return [t for t, m in enumerate(mask) if m]


def _positions_count(sample: Scorable) -> int:
    return sum(1 for m in sample.loss_mask if m)


def _teacher_ids(ids: Sequence[int], mapping: TokenizerMapping | None) -> list[int]:
    return mapping.teacher_ids(ids) if mapping is not None and mapping.token_ids else list(ids)


def _assemble(samples, routed, per_row: list, coefs: list[float], top_k: int) -> dict:
    width = max((len(s.token_ids) for s in samples), default=0)
    n = len(samples)
    logprobs, mask = torch.zeros(n, width), torch.zeros(n, width)
    top = (
        (torch.zeros(n, width, top_k, dtype=torch.long), torch.zeros(n, width, top_k), torch.zeros(n, width))
        if top_k
        else None
    )
    for b, (sample, scores) in enumerate(zip(samples, per_row, strict=True)):
        pos = torch.tensor(_positions(sample), dtype=torch.long)
        mask[b, : len(sample.loss_mask)] = torch.as_tensor(list(sample.loss_mask), dtype=torch.float32)
        logprobs[b, pos] = scores.logprobs
        if top is not None:
            top[0][b, pos], top[1][b, pos], top[2][b, pos] = (
                scores.topk_ids,
                scores.topk_logprobs,
                scores.tail_logprobs,
            )
    out = {
        "logprobs": logprobs,
        "mask": mask,
        "teacher": list(routed),
        "coef": torch.tensor(coefs).reshape(n, 1),
    }
    if top is not None:
        out.update(topk_ids=top[0], topk_logprobs=top[1], tail_logprobs=top[2])
    return out
