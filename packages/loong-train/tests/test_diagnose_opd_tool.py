"""``tools/diagnose_opd.py``'s per-token numbers on hand-worked distributions, and one real run of
the tool on a tiny student and teacher."""

from __future__ import annotations

import math

import diagnose_opd
import msgspec
import pytest
import torch

from loong_train.config import load_recipe
from loong_train.tiny.warmstart import build_tiny


def test_token_stats_by_hand():
    # two tokens over a vocabulary of 4; the teacher's top 2 are {0, 1} then {2, 0}
    teacher = torch.tensor([[0.7, 0.2, 0.06, 0.04], [0.3, 0.01, 0.6, 0.09]], dtype=torch.float64)
    student = torch.tensor([[0.5, 0.1, 0.3, 0.1], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    sampled = torch.tensor([2, 1])  # teacher gives them 0.06 and 0.01
    got = diagnose_opd.token_stats(student.log(), teacher.log(), sampled, k=2, low=0.05)
    pairs = [
        (0.7, 0.5),
        (0.2, 0.1),
        (0.06, 0.3),
        (0.04, 0.1),
        (0.3, 0.25),
        (0.01, 0.25),
        (0.6, 0.25),
        (0.09, 0.25),
    ]
    kl = sum(p * math.log(p / q) for p, q in pairs)  # (teacher, student) per entry, row by row
    assert got["tokens"] == 2
    assert got["outside_top_k"] == pytest.approx((1 - 0.6) + (1 - 0.5))
    assert got["teacher_outside"] == pytest.approx((1 - 0.9) + (1 - 0.9))
    assert got["forward_kl"] == pytest.approx(kl)
    assert got["improbable"] == 1  # 0.01 < 0.05; 0.06 is not


def test_summarize_counts_failures_holding_an_improbable_token():
    def stats(tokens: int, improbable: int, outside: float) -> dict:
        return {
            "tokens": tokens,
            "outside_top_k": outside,
            "teacher_outside": 0.0,
            "forward_kl": 0.5,
            "improbable": improbable,
        }

    episodes = [
        (1.0, stats(10, 0, 0.1)),
        (0.0, stats(20, 2, 0.2)),
        (0.0, stats(10, 0, 0.1)),
        (1.0, stats(10, 1, 0)),
    ]
    got = diagnose_opd.summarize(episodes)
    assert got["success"] == 0.5
    assert got["outside_top_k"] == pytest.approx(0.4 / 50)
    assert got["forward_kl"] == pytest.approx(2.0 / 50)
    assert got["improbable"] == pytest.approx(3 / 50)
    assert (got["failed"], got["failed_with"], got["succeeded_with"]) == (2, 1, 1)


def test_a_student_diagnosed_against_itself(tmp_path):
    """The real path: episodes sampled from a tiny checkpoint and scored by a 'teacher' that is
    the same checkpoint, so the forward KL is 0 and the mass outside the top k is the teacher's."""
    recipe = load_recipe(
        "tiny-multi-teacher-opd",
        ["model.num_hidden_layers=1", "eval.num_tasks=4", "rollout.max_new_tokens=8"],
    )
    student = build_tiny(tmp_path / "student", recipe)
    teachers = [msgspec.structs.replace(t, path=str(student)) for t in recipe.opd.teachers.teachers]
    opd = msgspec.structs.replace(
        recipe.opd, teachers=msgspec.structs.replace(recipe.opd.teachers, teachers=teachers)
    )
    result = diagnose_opd.diagnose(msgspec.structs.replace(recipe, opd=opd), student, k=4, low=0.05)
    assert set(result) == {"add", "mul"}
    for row in result.values():
        assert row["forward_kl"] == pytest.approx(0.0, abs=1e-9)
        assert row["outside_top_k"] == pytest.approx(row["teacher_outside"])
        assert row["outside_top_k"] > 0.5  # an untrained model: mass spread over the vocabulary
