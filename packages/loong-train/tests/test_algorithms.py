"""GRPO advantages, the packer and the default clipped loss against hand-worked and float64
references (the loss options are tested in test_policy_loss.py)."""

import math

import pytest
import torch

from loong_core.records import EpisodeStatus, SpanSource, TokenSpan, Trajectory
from loong_train.algo.config import LossConfig
from loong_train.algo.losses import advantages, grpo_advantages, pack_batch, policy_loss


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


def _ep(group, reward, status=EpisodeStatus.OK):
    """A one-row episode with a sample id of its own (``_traj`` names rows by their reward)."""
    _ep.n = getattr(_ep, "n", 0) + 1
    return Trajectory(**{**_fields(_traj(group, reward, status)), "sample_id": f"{group}-{_ep.n}"})


def test_unbiased_std_is_verl_and_trls_torch_std():
    """rewards 1, 0, 0, 0: population std sqrt(3/16), unbiased sqrt(1/4) = torch.std's."""
    trajs = [_ep("a", 1), _ep("a", 0), _ep("a", 0), _ep("a", 0)]
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    centred = rewards - rewards.mean()
    unbiased = grpo_advantages(trajs, eps=0.0, std="unbiased")
    population = grpo_advantages(trajs, eps=0.0)
    assert unbiased == pytest.approx((centred / rewards.std()).tolist(), rel=1e-12)
    assert population == pytest.approx((centred / rewards.std(correction=0)).tolist(), rel=1e-12)
    assert unbiased[0] == pytest.approx(1.5) and population[0] == pytest.approx(0.75 / math.sqrt(3 / 16))


def test_rloo_is_the_leave_one_out_baseline_and_counts_a_black_box_episode_once():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5]
    trajs = [_ep("a", r) for r in rewards] + [_ep("solo", 1.0)]
    trajs[4] = Trajectory(**{**_fields(trajs[4]), "sample_id": "a-e4-row0", "info": {"episode": "e4"}})
    trajs.insert(5, Trajectory(**{**_fields(trajs[4]), "sample_id": "a-e4-row1"}))  # a second row of e4
    adv = advantages(trajs, LossConfig(estimator="rloo"))
    loo = [r - (sum(rewards) - r) / (len(rewards) - 1) for r in rewards]  # by definition, 5 episodes
    assert adv[:5] == pytest.approx(loo, rel=1e-12) and adv[5] == adv[4]  # both rows of e4
    assert adv[6] == 0.0  # a group of one has no baseline to leave out


def test_reinforce_plus_plus_whitens_over_every_loss_token_of_the_batch():
    """Token-weighted, as verl whitens: episodes of 3, 1, 2 and 2 model tokens; each token
    carries its episode's value, mean and unbiased variance over those 8 tokens."""
    lengths = [3, 1, 2, 2]
    trajs = [_traj("a", 1, n_model=3), _traj("a", 0, n_model=1), _traj("b", 1), _traj("b", 0.5)]
    trajs.append(_traj("b", 0, EpisodeStatus.FAILED))
    for rewards, estimator in (
        ([1.0, 0.0, 1.0, 0.5], "reinforce++"),
        ([0.5, -0.5, 0.25, -0.25], "reinforce++-baseline"),
    ):
        tokens = torch.tensor(
            [r for r, n in zip(rewards, lengths, strict=True) for _ in range(n)], dtype=torch.float64
        )
        want = (
            (torch.tensor(rewards, dtype=torch.float64) - tokens.mean()) / torch.sqrt(tokens.var() + 1e-8)
        ).tolist()
        got = advantages(trajs, LossConfig(estimator=estimator))
        assert got == pytest.approx([*want, 0.0], rel=1e-12)


def test_the_default_estimator_is_grpo_unchanged():
    trajs = [_ep("a", 3), _ep("a", 1), _ep("a", 0.5), _ep("b", 1), _ep("b", 0)]
    assert advantages(trajs, LossConfig()) == grpo_advantages(trajs)  # bit for bit
    assert advantages(trajs, LossConfig(scale_adv_by_std=False)) == grpo_advantages(trajs, scale_by_std=False)


def test_asymmetric_clip_lets_a_positive_advantage_rise_to_clip_high():
    """DAPO's clip-higher, hand-worked: rho = 1.25 with A = 1 is clipped at 1.2 by a symmetric
    eps = 0.2 (no gradient) but not by eps_high = 0.28 (gradient A); rho = 0.7 with A = -1 is
    clipped at 1 - eps = 0.8 either way."""
    for eps_high, want_loss, want_grad in ((0.0, -(1.2 - 0.8) / 2, 0.0), (0.28, -(1.25 - 0.8) / 2, -0.5)):
        cfg = LossConfig(clip_eps=0.2, clip_eps_high=eps_high)
        logprobs = torch.tensor([[math.log(1.25), math.log(0.7)]], dtype=torch.float64, requires_grad=True)
        behaviour = torch.zeros(1, 2, dtype=torch.float64)
        adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
        loss, stats = policy_loss(logprobs, behaviour, adv, torch.ones(1, 2, dtype=torch.float64), cfg)
        loss.backward()
        assert float(loss.detach()) == pytest.approx(want_loss, rel=1e-12)
        grad_first = float(logprobs.grad[0, 0]) / 1.25  # d loss / d rho for the first token
        assert grad_first == pytest.approx(want_grad, abs=1e-12)
        assert stats["clip_frac"] == (1.0 if eps_high == 0 else 0.5)
    with pytest.raises(ValueError, match="clip_eps_high must be >= 0"):
        LossConfig(clip_eps_high=-0.1)


def _fields(t: Trajectory) -> dict:
    import msgspec

    return {f.name: getattr(t, f.name) for f in msgspec.structs.fields(t)}


def _rows(log_rhos, advs):
    """Two rows of per-token log-ratios (behaviour logprob 0, so l = log rho) and advantages."""
    logprobs = torch.tensor(log_rhos, dtype=torch.float64, requires_grad=True)
    zeros = torch.zeros_like(logprobs.detach())
    return logprobs, zeros, torch.tensor(advs, dtype=torch.float64), torch.ones_like(zeros)


def test_gspo_clips_whole_sequences_on_the_length_normalised_ratio():
    """Row 0: log rho 0.1, 0.3 -> s = exp(0.2) = 1.2214 > 1.2: clipped, A = 1, no gradient; row 1:
    log rho -0.1, 0.0 -> s = exp(-0.05), A = -1, unclipped: ell = s per token, d/dl_t = s / 2.
    Sequence-mean aggregation: L = (-(1.2 * 1) + s) / 2 (each row's two tokens carry the same ell)."""
    log_rhos, advs = [[0.1, 0.3], [-0.1, 0.0]], [[1.0, 1.0], [-1.0, -1.0]]
    s1 = math.exp(-0.05)
    for policy in ("gspo", "gspo-token"):
        cfg = LossConfig(policy=policy, agg_mode="seq-mean-token-mean")
        logprobs, behaviour, adv, mask = _rows(log_rhos, advs)
        loss, _ = policy_loss(logprobs, behaviour, adv, mask, cfg)
        loss.backward()
        assert float(loss.detach()) == pytest.approx((-1.2 + s1) / 2, rel=1e-12)
        assert logprobs.grad[0].tolist() == [0.0, 0.0]  # the clipped sequence
        # row 1's mean loss is s (GSPO: d s / d l_t = s / 2; GSPO-token: each of its two tokens
        # carries s_it with d s_it / d l_t = s, averaged over 2), halved by the mean over 2 rows
        assert logprobs.grad[1].tolist() == pytest.approx([s1 / 4, s1 / 4], rel=1e-12)


def test_gspo_token_moves_each_token_by_its_own_advantage():
    """With per-token advantages GSPO-token's gradient follows each A_t, GSPO's averages them."""
    log_rhos, advs = [[0.0, 0.0]], [[1.0, -3.0]]
    grads = {}
    for policy in ("gspo", "gspo-token"):
        logprobs, behaviour, adv, mask = _rows(log_rhos, advs)
        loss, _ = policy_loss(logprobs, behaviour, adv, mask, LossConfig(policy=policy))
        loss.backward()
        grads[policy] = logprobs.grad[0].tolist()
    assert grads["gspo-token"] == pytest.approx([-0.5, 1.5], rel=1e-12)  # -A_t s / 2, s = 1
    assert grads["gspo"] == pytest.approx([0.5, 0.5], rel=1e-12)  # -(1 - 3) / 2 * (1 / 2) each


def test_cispo_keeps_the_gradient_of_clipped_tokens_at_the_clipped_weight():
    """rho = 1.5 (clipped to 1.28), A = 1; rho = 0.9, A = 1: d(-agg(w A l))/dl_t = -w_t A_t / 2."""
    logprobs, behaviour, adv, mask = _rows([[math.log(1.5), math.log(0.9)]], [[1.0, 1.0]])
    cfg = LossConfig(policy="cispo", clip_eps_high=0.28)
    loss, stats = policy_loss(logprobs, behaviour, adv, mask, cfg)
    loss.backward()
    assert logprobs.grad[0].tolist() == pytest.approx([-1.28 / 2, -0.9 / 2], rel=1e-12)
    assert stats["clip_frac"] == 0.5
    ppo = _rows([[math.log(1.5), math.log(0.9)]], [[1.0, 1.0]])
    loss, _ = policy_loss(*ppo, LossConfig(clip_eps_high=0.28))
    loss.backward()
    assert ppo[0].grad[0, 0] == 0.0  # PPO drops the clipped token's gradient; CISPO does not
    with pytest.raises(ValueError, match="dual_clip applies to policy = 'ppo' only"):
        LossConfig(policy="cispo", dual_clip=3.0)


def test_entropy_metric_and_bonus_match_a_float64_entropy():
    """The torch backend logs each step's token-mean entropy of the policy at the loss tokens, as
    -sum p log p computed here in float64 from the same logits; the bonus adds -coef * H to the loss."""
    from loong_core.records import TrainBatch
    from loong_train.backends.torch_backend import TorchBackend
    from loong_train.models.decoder import CausalLM, DecoderConfig

    config = DecoderConfig(
        vocab_size=11,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    ids = [3, 4, 5, 6, 7, 8]
    batch = TrainBatch(
        token_ids=ids,
        loss_mask=[0, 0, 1, 1, 1, 0],
        advantages=[0.0, 0, 1, 1, 1, 0],
        behaviour_logprobs=[0.0, -2, -2, -2, -2, -2],
        versions=[-1, -1, 0, 0, 0, -1],
        row_lens=[6],
        sample_ids=["s"],
        policy_version=0,
        row_tags=[{}],
    )
    losses = {}
    for coef in (0.0, 0.5):
        model = CausalLM(config)
        model.init_weights(0)
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids]))[0, :-1].double(), dim=-1)
        h = -(logp.exp() * logp).sum(-1)  # H at positions 1..5 (predicting ids[1:])
        want = float(h[1:4].mean())  # the loss tokens 2, 3, 4
        backend = TorchBackend(model, lr=0.0, loss=LossConfig(entropy_coef=coef))
        stats = backend.train_step(batch)
        assert stats["entropy"] == pytest.approx(want, rel=1e-5)
        losses[coef] = (stats["loss"], want)
    assert losses[0.5][0] == pytest.approx(losses[0.0][0] - 0.5 * losses[0.0][1], rel=1e-5)
    with pytest.raises(ValueError, match="entropy_coef must be >= 0"):
        LossConfig(entropy_coef=-1.0)


def test_overlong_filter_keeps_truncated_rows_without_loss_tokens():
    """DAPO's overlong filtering: the truncated row stays in the batch (and its group's statistics)
    with an all-zero loss mask; the others are packed unchanged; a batch with no loss token left
    gives a zero loss, not NaN."""
    from loong_train.algo.losses import pack_batch

    trajs = [_traj("a", 1), _traj("a", 0, EpisodeStatus.TRUNCATED, n_model=3), _traj("a", 0.5)]
    adv = advantages(trajs, LossConfig())
    assert adv[1] != 0.0  # it still counts in the group's mean and std
    plain, filtered = pack_batch(trajs, adv, 0), pack_batch(trajs, adv, 0, mask_truncated=True)
    assert filtered.row_lens == plain.row_lens and filtered.token_ids == plain.token_ids
    start, end = plain.row_lens[0], plain.row_lens[0] + plain.row_lens[1]
    assert plain.loss_mask[start:end] == [0, 0, 1, 1, 1] and filtered.loss_mask[start:end] == [0] * 5
    assert (
        filtered.loss_mask[:start] == plain.loss_mask[:start]
        and filtered.loss_mask[end:] == plain.loss_mask[end:]
    )
    assert all(a == 0 for a in filtered.advantages[start:end])
    logprobs = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(
        logprobs,
        torch.zeros(1, 3, dtype=torch.float64),
        torch.ones(1, 3, dtype=torch.float64),
        torch.zeros(1, 3, dtype=torch.float64),
        LossConfig(),
    )
    assert float(loss) == 0.0
