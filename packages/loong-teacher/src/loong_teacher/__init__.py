"""Loong Teacher: the memory-budgeted multi-teacher Teacher Manager (local Hugging Face and remote
SGLang teachers), on-policy distillation signals, and the student/teacher tokenizer check."""

from loong_core.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(  # the configs import no torch; the rest loads it on first use
    __name__,
    {
        "loong_teacher.compat": ["TokenizerMapping", "TokenizerMismatch", "check_tokenizers"],
        "loong_teacher.config": [
            "LocalTeacherConfig",
            "SGLangTeacherConfig",
            "TeacherConfig",
            "TeacherManagerConfig",
        ],
        "loong_teacher.local": ["LocalTeacher"],
        "loong_teacher.losses": [
            "generalized_jsd",
            "importance_weights",
            "kl_divergence",
            "masked_mean",
            "mopd_advantage",
            "opd_policy_loss",
            "reverse_kl_advantage",
            "topk_forward_kl",
            "topk_tail_logprobs",
        ],
        "loong_teacher.manager": ["TeacherManager", "TeacherRoutingError", "TeacherScores"],
        "loong_teacher.remote": ["SGLangTeacher", "TeacherServerError"],
        "loong_teacher.residency": ["TeacherBudgetError"],
        "loong_teacher.teacher": ["RowScores", "ScoreRequest", "Teacher"],
    },
)

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
