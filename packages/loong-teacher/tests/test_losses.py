"""Reverse-KL OPD advantage against a float64 hand computation."""

import math

import torch

from loong_teacher import reverse_kl_advantage


def test_reverse_kl_advantage_matches_hand_computation():
    student = [[math.log(0.5), math.log(0.2), math.log(0.9)]]
    teacher = [[math.log(0.25), math.log(0.4), math.log(0.9)]]
    task = [[1.0, 1.0, 0.0]]
    mask = [[1.0, 1.0, 0.0]]
    got = reverse_kl_advantage(
        torch.tensor(student),
        torch.tensor(teacher),
        torch.tensor(mask),
        coef=0.5,
        task_advantages=torch.tensor(task),
    )
    # by hand: 1 - 0.5*ln(0.5/0.25) = 1 - 0.5 ln 2 ; 1 - 0.5*ln(0.2/0.4) = 1 + 0.5 ln 2 ; masked -> 0
    want = [1 - 0.5 * math.log(2), 1 + 0.5 * math.log(2), 0.0]
    assert [round(x, 6) for x in got[0].tolist()] == [round(x, 6) for x in want]


def test_teacher_term_has_no_gradient_path():
    student = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    adv = reverse_kl_advantage(student, torch.tensor([[-1.5, -1.0]]), torch.ones(1, 2))
    assert not adv.requires_grad
