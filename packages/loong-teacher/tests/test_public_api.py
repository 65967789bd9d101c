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


def test_exports_are_lazy_and_configs_import_no_torch():
    """Every name in ``__all__`` is in the lazy map and back; ``loong_teacher.config`` (what a recipe
    listing teachers validates against) loads no torch."""
    import subprocess
    import sys

    assert sorted(dir(loong_teacher)) == sorted(loong_teacher.__all__)
    code = "import sys, loong_teacher, loong_teacher.config; print('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        == "False\n"
    )
