"""Loong Teacher: on-policy distillation signals and the student/teacher tokenizer check (teacher
scoring and the memory-budgeted Teacher Manager build on these)."""

from loong_teacher.compat import TokenizerMapping, TokenizerMismatch, check_tokenizers
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

__all__ = [
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
