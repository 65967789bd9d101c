"""Loong Teacher: on-policy distillation signals (teacher scoring and the memory-budgeted
Teacher Manager build on these)."""

from loong_teacher.losses import reverse_kl_advantage

__all__ = [
    # losses and advantages
    "reverse_kl_advantage",
]
