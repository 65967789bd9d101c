"""On-policy distillation signals computed from per-token logprobs.

Reverse-KL advantage (on-policy distillation as in tinker-cookbook and slime): for each token
y_t the student sampled,

    A_t = A_task_t - lambda * (logp_student(y_t) - logp_teacher(y_t))

The second term is a single-sample estimate of -KL(student || teacher) at position t: tokens
the teacher finds likelier than the student get a positive advantage. ``A_task`` may be 0
(teacher-only distillation) or a task advantage (e.g. GRPO) to mix outcome reward in.
"""

from __future__ import annotations

import torch

__all__ = ["reverse_kl_advantage"]


def reverse_kl_advantage(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float = 1.0,
    task_advantages: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token advantages [batch, seq]; 0 where ``mask`` is 0. The teacher term carries no gradient."""
    gap = (student_logprobs - teacher_logprobs).detach()
    adv = -coef * gap
    if task_advantages is not None:
        adv = adv + task_advantages
    return adv * mask
