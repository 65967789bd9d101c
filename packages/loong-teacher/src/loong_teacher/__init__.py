"""Loong Teacher: the memory-budgeted multi-teacher Teacher Manager (local Hugging Face and remote
SGLang teachers), on-policy distillation signals, and the student/teacher tokenizer check."""

from loong_teacher.compat import TokenizerMapping, TokenizerMismatch, check_tokenizers
from loong_teacher.local import LocalTeacher, LocalTeacherConfig
from loong_teacher.losses import (
    generalized_jsd,
    importance_weights,
    kl_divergence,
    masked_mean,
    mopd_advantage,
    opd_policy_loss,
    reverse_kl_advantage,
    topk_forward_kl,
    topk_tail_logprobs,
)
from loong_teacher.manager import (
    TeacherConfig,
    TeacherManager,
    TeacherManagerConfig,
    TeacherRoutingError,
    TeacherScores,
)
from loong_teacher.remote import SGLangTeacher, SGLangTeacherConfig, TeacherServerError
from loong_teacher.residency import TeacherBudgetError
from loong_teacher.teacher import RowScores, ScoreRequest, Teacher

__all__ = [
    # the Teacher Manager: routing, memory budget, scoring
    "ScoreRequest",
    "TeacherBudgetError",
    "TeacherConfig",
    "TeacherManager",
    "TeacherManagerConfig",
    "TeacherRoutingError",
    "TeacherScores",
    # teacher backends (one module each) and their seam
    "LocalTeacher",
    "LocalTeacherConfig",
    "RowScores",
    "SGLangTeacher",
    "SGLangTeacherConfig",
    "Teacher",
    "TeacherServerError",
    # sampled-token advantages and the IS policy loss
    "importance_weights",
    "mopd_advantage",
    "opd_policy_loss",
    "reverse_kl_advantage",
    # distribution divergences (full vocabulary or top-k + tail)
    "generalized_jsd",
    "kl_divergence",
    "topk_forward_kl",
    "topk_tail_logprobs",
    # reductions
    "masked_mean",
    # student/teacher tokenizer safety check
    "TokenizerMapping",
    "TokenizerMismatch",
    "check_tokenizers",
]
