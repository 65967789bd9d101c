"""On-policy distillation (OPD) inside the trainer: teachers score each batch before the loss.

The student samples episodes as in RL; before the train step, a
:class:`loong_teacher.TeacherManager` routes every row of the batch by its ``domain`` tag (carried
from the task through the episode into ``Trajectory.tags`` and ``TrainBatch.row_tags``) to one
teacher, which scores the tokens the student sampled. The per-token advantage replaces the
batch's GRPO advantage (:func:`loong_teacher.reverse_kl_advantage`), for row i routed to teacher
T(i) with coefficient lambda_T(i), at each model token t (m_t = 1):

    teacher_only:  A_t = -lambda_T(i) * (b_t - log pi_T(i)(y_t))
    mixed:         A_t = alpha * A_i^GRPO - lambda_T(i) * (b_t - log pi_T(i)(y_t))

where b_t is the behaviour logprob (the sampling engine's logprob of y_t, temperature included)
and alpha is ``opd.task_coef``. b_t - log pi_T(y_t) is the one-sample estimate of the reverse KL
KL(pi_S || pi_T) at t, for y_t drawn from the sampler (tinker-cookbook's and slime's form; the
sampler's logprob costs no extra forward pass). The policy loss is the recipe's ``[loss]``
unchanged (PPO-clipped, IS-weighted against b), so OPD and RL share one code path.

With ``opd.objective = "forward_kl"`` (or ``"jsd"``) the teachers' top-k distributions (``[opd.teachers]
top_k``) go into the batch instead (``TrainBatch.teacher_topk_ids``, ``teacher_topk_logprobs``,
``distill_coef`` = lambda_T(i) at loss tokens) and the train backend adds a dense term to the
policy loss (:func:`loong_train.algo.losses.distill_loss`), at every loss token the student sampled:

    L_distill = agg_t( lambda_T(i) * KL(pi_T(. | y_<t) || pi_S(. | y_<t)) )   over the top-k + tail

(``"jsd"``: GKD's generalized JSD of ``opd.jsd_beta`` in place of the KL, ``TrainBatch.distill_beta``).

The advantages are then 0 (teacher_only: pure distillation) or alpha * A_i^GRPO (mixed).

Metrics per step: ``opd/kl`` (mean of b_t - log pi_T(y_t) over loss tokens), ``opd/<teacher>/kl``
(the same over that teacher's rows), ``opd/<teacher>/samples`` (routing counts, 0 included) and the
manager's ``teacher/...`` metrics (tokens, loads, bytes paged in, resident bytes, score seconds).

Tiny recipes make their teachers with the project's own warm start
(:func:`loong_train.tiny.teachers.prepare_teachers`).
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch
from torch import nn

from loong_core.records import TrainBatch
from loong_teacher import (
    LocalTeacherConfig,
    ScoreRequest,
    TeacherManager,
    TeacherScores,
    check_tokenizers,
    reverse_kl_advantage,
)
from loong_teacher.local import hf_causal_lm
from loong_train.algo.config import OPDConfig
from loong_train.models.decoder import ARCHITECTURES, CausalLM, DecoderConfig
from loong_train.models.tokenizer import load_tokenizer

__all__ = ["Distiller", "decoder_build"]


class _ScoringLM(CausalLM):
    """Loong's decoder with the ``forward(input_ids=, attention_mask=)`` a local teacher calls; rows
    are right-padded and attention is causal, so the mask changes nothing and is not needed."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(input_ids)


def decoder_build(config: dict[str, Any]) -> nn.Module:
    """``LocalTeacher`` build: Loong's own decoder for the families it implements (no
    transformers import, same numerics as the student), transformers for any other architecture."""
    if config.get("model_type") in ARCHITECTURES:
        return _ScoringLM(DecoderConfig.from_hf(config))
    return hf_causal_lm(config)


class Distiller:
    """The trainer's OPD step: refuse mismatched tokenizers, then score and rewrite advantages.

    Lifecycle: ``Distiller(cfg, student_path)`` once per trainer; ``distill(batch)`` per step;
    ``close()`` at the end. Local teachers' tokenizers (their checkpoint directories) are checked
    against the student's with :func:`loong_teacher.check_tokenizers`; remote ones are not.
    """

    def __init__(self, cfg: OPDConfig, student_path: str) -> None:
        if cfg.teachers is None:
            raise ValueError("[opd] needs [opd.teachers]")
        self.cfg = cfg
        student = load_tokenizer(student_path)
        for t in cfg.teachers.teachers:
            if isinstance(t, LocalTeacherConfig):
                check_tokenizers(student, load_tokenizer(t.path), t.tokenizer_mapping)
        self.manager = TeacherManager(cfg.teachers, build=decoder_build)

    def distill(self, batch: TrainBatch) -> tuple[TrainBatch, dict[str, float]]:
        """``batch`` with OPD advantages (module docstring) and this step's OPD metrics."""
        lens = batch.row_lens
        tags = batch.row_tags or [{}] * len(lens)
        rows = [
            ScoreRequest(token_ids=batch.token_ids[s:e], loss_mask=batch.loss_mask[s:e], tags=tg)
            for (s, e), tg in zip(batch.rows(), tags, strict=True)
        ]
        scores = self.manager.score(rows)
        student = _padded(batch.behaviour_logprobs, lens)
        task = self.cfg.task_coef * _padded(batch.advantages, lens) if self.cfg.mode == "mixed" else None
        if self.cfg.objective != "advantage":
            return self._targets(batch, scores, task), self._metrics(student, scores)
        adv = reverse_kl_advantage(
            student, scores.logprobs, scores.mask, coef=scores.coef, task_advantages=task
        )
        return msgspec.structs.replace(batch, advantages=_flat(adv, lens)), self._metrics(student, scores)

    def _targets(self, batch: TrainBatch, scores: TeacherScores, task: torch.Tensor | None) -> TrainBatch:
        """``batch`` carrying the teachers' top-k (dense distillation) and the task advantages, if any."""
        lens = batch.row_lens
        assert scores.topk_ids is not None and scores.topk_logprobs is not None
        advantages = _flat(task, lens) if task is not None else [0.0] * batch.num_tokens
        return msgspec.structs.replace(
            batch,
            advantages=advantages,
            teacher_topk_ids=_flat(scores.topk_ids, lens),
            teacher_topk_logprobs=_flat(scores.topk_logprobs, lens),
            distill_coef=_flat(scores.coef * scores.mask, lens),
            distill_beta=self.cfg.jsd_beta if self.cfg.objective == "jsd" else 0.0,
        )

    def _metrics(self, student: torch.Tensor, scores: TeacherScores) -> dict[str, float]:
        gap, mask = (student - scores.logprobs) * scores.mask, scores.mask
        out = {"opd/kl": float(gap.sum() / mask.sum().clamp(min=1))}
        for name in self.manager.teachers:
            rows = [i for i, t in enumerate(scores.teacher) if t == name]
            out[f"opd/{name}/samples"] = float(len(rows))
            if rows and mask[rows].sum() > 0:
                out[f"opd/{name}/kl"] = float(gap[rows].sum() / mask[rows].sum())
        return out | scores.metrics

    def close(self) -> None:
        self.manager.close()


def _flat(padded: torch.Tensor, lens: list[int]) -> list:
    """``[rows, seq, ...]`` back to the batch's packed per-token list (trailing dims flattened)."""
    return torch.cat([padded[i, :n].reshape(-1) for i, n in enumerate(lens)]).tolist()


def _padded(values: list[float], lens: list[int]) -> torch.Tensor:
    """A packed per-token list as ``[rows, max(lens)]``, right-padded with 0."""
    rows = torch.tensor(values, dtype=torch.float32).split(lens)
    return torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True)
