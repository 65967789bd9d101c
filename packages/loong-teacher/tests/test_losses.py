"""OPD advantages and losses against float64 references written in plain Python (math, loops),
plus hand-worked numbers. Divergences live in test_divergences.py."""

import math

import pytest
import torch

from loong_teacher import (
    importance_weights,
    masked_mean,
    mopd_advantage,
    opd_policy_loss,
    reverse_kl_advantage,
)

LN2 = math.log(2)


def _t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def _close(got, want, tol=1e-12):
    got = got.tolist() if isinstance(got, torch.Tensor) else got
    assert len(got) == len(want)
    for row_g, row_w in zip(got, want, strict=True):
        assert row_g == pytest.approx(row_w, abs=tol), (row_g, row_w)


# ------------------------------------------------------------------------------ reverse-KL advantage


def test_reverse_kl_advantage_matches_hand_computation():
    student = [[math.log(0.5), math.log(0.2), math.log(0.9)]]
    teacher = [[math.log(0.25), math.log(0.4), math.log(0.9)]]
    got = reverse_kl_advantage(
        _t(student), _t(teacher), _t([[1, 1, 0]]), coef=0.5, task_advantages=_t([[1, 1, 0]])
    )
    # by hand: 1 - 0.5*ln(0.5/0.25) = 1 - 0.5 ln 2 ; 1 - 0.5*ln(0.2/0.4) = 1 + 0.5 ln 2 ; masked -> 0
    _close(got, [[1 - 0.5 * LN2, 1 + 0.5 * LN2, 0.0]])


def test_reverse_kl_advantage_per_teacher_coefficient_per_row():
    # row 0 routed to a teacher with lambda = 2, row 1 to one with lambda = 0.1; per-sequence task advantage
    student = [[math.log(0.5), math.log(0.1)], [math.log(0.3), math.log(0.6)]]
    teacher = [[math.log(0.25), math.log(0.1)], [math.log(0.6), math.log(0.2)]]
    lam, task, mask = [2.0, 0.1], [0.5, -1.0], [[1, 1], [1, 0]]
    want = [
        [mask[b][t] * (task[b] - lam[b] * (student[b][t] - teacher[b][t])) for t in range(2)]
        for b in range(2)
    ]
    got = reverse_kl_advantage(
        _t(student), _t(teacher), _t(mask), coef=_t(lam)[:, None], task_advantages=_t(task)[:, None]
    )
    _close(got, want)
    assert got[0, 0].item() == pytest.approx(0.5 - 2 * LN2)  # by hand


def test_reverse_kl_advantage_is_zero_on_masked_padding_even_at_minus_inf():
    got = reverse_kl_advantage(_t([[-1.0, -1.0]]), _t([[-2.0, -math.inf]]), _t([[1, 0]]))
    _close(got, [[-1.0, 0.0]])


def test_teacher_term_has_no_gradient_path():
    student = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    adv = reverse_kl_advantage(student, torch.tensor([[-1.5, -1.0]]), torch.ones(1, 2))
    assert not adv.requires_grad


def test_identical_student_and_teacher_give_only_the_task_advantage():
    lp = _t([[-0.3, -2.0, -7.5]])
    got = reverse_kl_advantage(
        lp, lp.clone(), torch.ones(1, 3), coef=3.0, task_advantages=_t([[0.7, 0.7, 0.7]])
    )
    _close(got, [[0.7, 0.7, 0.7]], tol=0)


# ------------------------------------------------------------------------------------------ MOPD


def test_mopd_advantage_matches_hand_computation():
    theta = [[math.log(0.2), math.log(0.8), math.log(0.5)]]
    domain_teacher = [[math.log(0.4), math.log(0.4), math.log(0.5)]]
    # sg[ln T - ln theta] + alpha * A: ln 2 + 0.5*2 ; -ln 2 + 0.5*2 ; 0 + 1 but masked
    got = mopd_advantage(_t(theta), _t(domain_teacher), _t([[2.0]]), _t([[1, 1, 0]]), alpha=0.5)
    _close(got, [[LN2 + 1, -LN2 + 1, 0.0]])


def test_mopd_advantage_equals_reverse_kl_with_unit_coefficient():
    g = torch.Generator().manual_seed(0)
    s, t, a = (torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(3))
    mask = (torch.rand(3, 4, generator=g) > 0.3).double()
    got = mopd_advantage(s, t, a, mask, alpha=0.3)
    assert torch.equal(got, reverse_kl_advantage(s, t, mask, 1.0, 0.3 * a))


# ------------------------------------------------------------------------- IS weights and the loss


def _reference_loss(theta, rollout, adv, mask, low, high):
    """float64 loop: value, d loss / d theta, masked fraction."""
    n = max(sum(sum(r) for r in mask), 1)
    value, grad, out = 0.0, [], 0
    for b in range(len(theta)):
        grad.append([])
        for t in range(len(theta[b])):
            r = math.exp(theta[b][t] - rollout[b][t])
            kept = mask[b][t] == 1 and low <= r <= high
            out += mask[b][t] == 1 and not kept
            value -= r * adv[b][t] / n if kept else 0.0
            grad[b].append(-r * adv[b][t] / n if kept else 0.0)  # d(-r A / n)/d theta = -r A / n
    return value, grad, out / n


@pytest.mark.parametrize(("low", "high"), [(0.0, math.inf), (0.8, 1.25)])
def test_opd_policy_loss_value_gradient_and_band_against_reference(low, high):
    theta = [[-1.0, -0.5, -2.0, -0.1], [-0.3, -3.0, -1.0, -1.0]]
    rollout = [[-1.1, -0.5, -1.0, -0.4], [-0.2, -3.05, -5.0, -1.0]]  # ratios e^.1, 1, e^-1, e^.3 ; ...
    adv = [[1.0, -2.0, 0.5, 3.0], [0.25, 1.0, -1.0, 9.0]]
    mask = [[1, 1, 1, 1], [1, 1, 1, 0]]
    want_value, want_grad, want_frac = _reference_loss(theta, rollout, adv, mask, low, high)
    th = _t(theta).requires_grad_()
    loss, stats = opd_policy_loss(th, _t(rollout), _t(adv), _t(mask), low, high)
    loss.backward()
    assert loss.item() == pytest.approx(want_value, abs=1e-12)
    _close(th.grad, want_grad)
    assert stats["is_masked_frac"] == pytest.approx(want_frac)
    assert want_frac == (0 if high == math.inf else 3 / 7)  # e^-1, e^.3 and e^4 leave [0.8, 1.25]


def test_opd_policy_loss_on_policy_by_hand():
    # theta == rollout: r = 1, loss = -(1 + 3) / 2 ; d/dtheta = -A / 2
    th = _t([[-1.0, -2.0, -3.0]]).requires_grad_()
    loss, _ = opd_policy_loss(th, th.detach().clone(), _t([[1.0, 3.0, 100.0]]), _t([[1, 1, 0]]))
    loss.backward()
    assert loss.item() == -2.0
    _close(th.grad, [[-0.5, -1.5, 0.0]], tol=0)


def test_opd_policy_loss_masks_huge_ratios_without_overflow():
    # float32: exp(200) is inf; the band drops the token before exponentiating
    th = torch.tensor([[0.0, 200.0]], requires_grad=True)
    loss, stats = opd_policy_loss(th, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), 0.5, 2.0)
    loss.backward()
    assert loss.item() == -0.5
    assert th.grad.tolist() == [[-0.5, 0.0]]
    assert stats["is_masked_frac"] == 0.5


def test_importance_weights_by_hand():
    theta = _t([[math.log(0.6), math.log(0.2), math.log(0.5), 0.0]])
    rollout = _t([[math.log(0.5), math.log(0.4), math.log(0.5), -1000.0]])
    got = importance_weights(theta, rollout, _t([[1, 1, 0, 1]]), ratio_low=0.75, ratio_high=1.5)
    # ratios 1.2 (kept), 0.5 (below band), 1 (masked), e^1000 (above band)
    _close(got, [[1.2, 0.0, 0.0, 0.0]])
    assert not importance_weights(theta.requires_grad_(), rollout, torch.ones(1, 4)).requires_grad


def test_masked_mean_by_hand():
    assert masked_mean(_t([[1.0, 2.0, math.inf]]), _t([[1, 1, 0]])).item() == 1.5
    assert masked_mean(_t([[5.0]]), _t([[0]])).item() == 0.0
