"""The public surface of loong_teacher is deliberate: adding or removing a name updates this list."""

import loong_teacher


def test_exports_are_pinned():
    assert sorted(loong_teacher.__all__) == [
        "LocalTeacher",
        "LocalTeacherConfig",
        "RowScores",
        "SGLangTeacher",
        "SGLangTeacherConfig",
        "ScoreRequest",
        "Teacher",
        "TeacherBudgetError",
        "TeacherConfig",
        "TeacherManager",
        "TeacherManagerConfig",
        "TeacherRoutingError",
        "TeacherScores",
        "TeacherServerError",
        "TokenizerMapping",
        "TokenizerMismatch",
        "check_tokenizers",
        "generalized_jsd",
        "importance_weights",
        "kl_divergence",
        "masked_mean",
        "mopd_advantage",
        "opd_policy_loss",
        "reverse_kl_advantage",
        "topk_forward_kl",
        "topk_tail_logprobs",
    ]


def test_every_export_resolves():
    for name in loong_teacher.__all__:
        assert getattr(loong_teacher, name) is not None, name
