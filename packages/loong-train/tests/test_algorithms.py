"""GRPO advantages, the packer and the default clipped loss against hand-worked and float64
references (the loss options are tested in test_policy_loss.py)."""

import math

import torch

from loong_core.records import EpisodeStatus, SpanSource, TokenSpan, Trajectory
from loong_train.algo.config import LossConfig
from loong_train.algo.losses import grpo_advantages, pack_batch, policy_loss


def _traj(group, reward, status=EpisodeStatus.OK, n_model=2, version=0):
    spans = [
        TokenSpan([1, 2], SpanSource.PROMPT),
        TokenSpan(list(range(n_model)), SpanSource.MODEL, [-0.5] * n_model, version),
    ]
    return Trajectory(
        sample_id=f"{group}-{reward}-{status}", group_id=group, spans=spans, reward=reward, status=status
    )


def test_grpo_advantages_hand_worked():
    # group a: rewards 1, 0, 0, 1 -> mean 0.5, population std 0.5 -> +-1
    # group b: all equal -> 0; a failed episode is excluded from b's statistics and gets 0
    trajs = [
        _traj("a", 1),
        _traj("a", 0),
        _traj("a", 0),
        _traj("a", 1),
        _traj("b", 1),
        _traj("b", 1),
        _traj("b", 0, EpisodeStatus.FAILED),
    ]
    adv = grpo_advantages(trajs, eps=0.0)
    assert adv == [1.0, -1.0, -1.0, 1.0, 0.0, 0.0, 0.0]
    assert grpo_advantages(trajs, scale_by_std=False)[:4] == [0.5, -0.5, -0.5, 0.5]


def test_grpo_std_scaling_hand_worked_with_eps():
    # rewards 3, 1 -> mean 2, population std 1; with eps 1e-6: +-1 / (1 + 1e-6)
    # Dr. GRPO (no std): +-1 whatever the spread; all-equal rewards: 0 either way
    trajs = [_traj("a", 3), _traj("a", 1), _traj("b", 0.25), _traj("b", 0.25)]
    adv = grpo_advantages(trajs)
    assert math.isclose(adv[0], 1 / (1 + 1e-6), rel_tol=1e-15) and math.isclose(adv[1], -adv[0])
    assert grpo_advantages(trajs, scale_by_std=False) == [1.0, -1.0, 0.0, 0.0]
    assert adv[2:] == [0.0, 0.0]


def test_grpo_timeout_does_not_count_as_zero_reward():
    with_timeout = grpo_advantages([_traj("g", 1), _traj("g", 1), _traj("g", 0, EpisodeStatus.TIMEOUT)])
    assert with_timeout == [0.0, 0.0, 0.0]  # the two valid samples tie: no signal, not a false +


def test_pack_batch_drops_untrainable_and_masks_prompt():
    trajs = [_traj("a", 1, n_model=3, version=4), _traj("a", 0, EpisodeStatus.FAILED)]
    batch = pack_batch(trajs, [2.0, 5.0], policy_version=5)
    batch.validate()
    assert batch.row_lens == [5]
    assert batch.loss_mask == [0, 0, 1, 1, 1]
    assert batch.advantages == [0.0, 0.0, 2.0, 2.0, 2.0]
    assert batch.versions == [-1, -1, 4, 4, 4]
    assert batch.behaviour_logprobs == [0.0, 0.0, -0.5, -0.5, -0.5]


def test_ppo_clip_loss_matches_float64_reference():
    gen = torch.Generator().manual_seed(0)
    lp = torch.randn(3, 6, generator=gen, dtype=torch.float64) * 0.3 - 1
    behaviour = lp + torch.randn(3, 6, generator=gen, dtype=torch.float64) * 0.3
    adv = torch.randn(3, 6, generator=gen, dtype=torch.float64)
    mask = (torch.rand(3, 6, generator=gen) > 0.3).double()
    eps = 0.2
    want_num, want_den = 0.0, 0.0
    for i in range(3):
        for j in range(6):
            if mask[i, j]:
                r = math.exp(lp[i, j] - behaviour[i, j])
                a = float(adv[i, j])
                want_num += min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
                want_den += 1
    loss, _ = policy_loss(lp.float(), behaviour.float(), adv.float(), mask.float(), LossConfig(clip_eps=eps))
    assert abs(float(loss) - (-want_num / want_den)) < 1e-5


def test_ppo_gradient_vanishes_outside_the_clip_range():
    lp = torch.tensor([[0.5, 0.0]], requires_grad=True)
    behaviour = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, 1.0]])  # ratio e^0.5 > 1.2 with positive advantage: clipped, no gradient
    loss, stats = policy_loss(lp, behaviour, adv, torch.ones(1, 2), LossConfig(clip_eps=0.2))
    loss.backward()
    assert lp.grad[0, 0] == 0 and lp.grad[0, 1] != 0
    assert stats["clip_frac"] == 0.5
