"""The loss options of ``policy_loss`` against an independent float64 reference (plain Python
loops and ``math.exp``, written from the formulas in the algorithms module docstring) and
against hand-worked numbers."""

import math
import random

import pytest
import torch

from loong_train.algo.config import LossConfig
from loong_train.algo.losses import kl_estimate, policy_loss

LN = math.log


def _zip(*rows):
    return zip(*rows, strict=True)


# ----------------------------------------------------------------------------- float64 reference


def _ref_keep(mask, prox, b, cfg):
    keep = [row[:] for row in mask]
    for i, row in enumerate(mask):
        if cfg.mis_level == "sequence":
            n = sum(row)
            wbar = math.exp(sum(m * (p - q) for m, p, q in _zip(row, prox[i], b[i])) / n) if n else 1.0
            if not cfg.mis_low <= wbar <= cfg.mis_high:
                keep[i] = [0.0] * len(row)
            continue
        for t in range(len(row)):
            if not cfg.mis_low <= math.exp(prox[i][t] - b[i][t]) <= cfg.mis_high:
                keep[i][t] = 0.0
    return keep


def _ref_token_loss(lp, b, p, a, cfg):
    rho = math.exp(lp - (p if cfg.decoupled else b))
    s = min(rho * a, min(max(rho, 1 - cfg.clip_eps), 1 + cfg.clip_eps) * a)
    if a < 0 and cfg.dual_clip != math.inf:
        s = max(s, cfg.dual_clip * a)
    if cfg.decoupled:
        s *= min(math.exp(p - b), cfg.tis_cap)
    return -s


def _ref_agg(x, keep, cfg):
    if cfg.agg_mode == "token-mean":
        num = sum(k * v for xr, kr in _zip(x, keep) for v, k in _zip(xr, kr))
        return num / max(1.0, sum(map(sum, keep)))
    rows = [(sum(k * v for v, k in _zip(xr, kr)), sum(kr)) for xr, kr in _zip(x, keep)]
    rows = [(s, n) for s, n in rows if n > 0]
    per_row = {
        "seq-mean-token-mean": lambda s, n: s / n,
        "seq-mean-token-sum": lambda s, n: s,
        "seq-mean-token-sum-norm": lambda s, n: s / cfg.norm_length,
    }[cfg.agg_mode]
    return sum(per_row(s, n) for s, n in rows) / max(1, len(rows))


def _ref_kl(d, estimator):
    return {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) - 1 + d}[estimator]


def ref_loss(lp, b, adv, mask, cfg, prox=None, ref=None):
    """The loss L of the module docstring, on nested lists of floats."""
    prox = lp if prox is None else prox
    keep = _ref_keep(mask, prox, b, cfg)
    ell = [[_ref_token_loss(*z, cfg) for z in _zip(*rows)] for rows in _zip(lp, b, prox, adv)]
    loss = _ref_agg(ell, keep, cfg)
    if ref is not None:
        k = [[_ref_kl(x - r, cfg.kl_estimator) for x, r in _zip(*rows)] for rows in _zip(lp, ref)]
        loss += cfg.kl_coef * _ref_agg(k, keep, cfg)
    return loss


# ----------------------------------------------------------------------------- random cases

ROWS, COLS = 4, 6


def _case(seed):
    """Log-ratios spread wide enough that every clip, cap and band binds somewhere; row 3 has
    one loss token, and masked positions hold extreme values that must not matter."""
    rng = random.Random(seed)
    lp = [[rng.gauss(-1.5, 0.5) for _ in range(COLS)] for _ in range(ROWS)]
    b = [[x + rng.gauss(0, 0.7) for x in row] for row in lp]
    prox = [[x + rng.gauss(0, 0.3) for x in row] for row in lp]
    ref = [[x + rng.gauss(0, 0.5) for x in row] for row in lp]
    adv = [[rng.choice([-1.0, 1.0]) * rng.uniform(0.2, 2.0)] * COLS for _ in range(ROWS)]
    mask = [[float(rng.random() > 0.25) for _ in range(COLS)] for _ in range(ROWS)]
    mask[3] = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    for i, t in [(i, t) for i in range(ROWS) for t in range(COLS) if not mask[i][t]]:
        b[i][t], prox[i][t] = -30.0, 30.0
    return lp, b, adv, mask, prox, ref


CONFIGS = {
    "default": LossConfig(),
    "dual-clip": LossConfig(dual_clip=1.5, clip_eps=0.1),
    "seq-mean-token-mean": LossConfig(agg_mode="seq-mean-token-mean"),
    "seq-mean-token-sum": LossConfig(agg_mode="seq-mean-token-sum"),
    "dr-grpo": LossConfig(scale_adv_by_std=False, agg_mode="seq-mean-token-sum-norm", norm_length=7),
    "decoupled": LossConfig(decoupled=True),
    "decoupled-tis": LossConfig(decoupled=True, tis_cap=1.3),
    "mis-token": LossConfig(mis_low=0.6, mis_high=1.6),
    "mis-sequence": LossConfig(mis_low=0.8, mis_high=1.25, mis_level="sequence"),
    "k1": LossConfig(kl_coef=0.3, kl_estimator="k1"),
    "k2": LossConfig(kl_coef=0.3, kl_estimator="k2"),
    "k3": LossConfig(kl_coef=0.3, kl_estimator="k3"),
    "everything": LossConfig(
        dual_clip=2.0,
        agg_mode="seq-mean-token-sum-norm",
        norm_length=5,
        kl_coef=0.1,
        decoupled=True,
        tis_cap=1.5,
        mis_low=0.8,
        mis_high=1.25,
        mis_level="sequence",
    ),
}


def _t(x, dtype=torch.float64, grad=False):
    return torch.tensor(x, dtype=dtype, requires_grad=grad)


def _run(case, cfg, dtype=torch.float64, grad=False):
    lp, b, adv, mask, prox, ref = case
    lp_t = _t(lp, dtype, grad)
    extra = {"proximal": _t(prox, dtype)} if cfg.decoupled else {}
    if cfg.kl_coef:
        extra["reference"] = _t(ref, dtype)
    loss, stats = policy_loss(lp_t, _t(b, dtype), _t(adv, dtype), _t(mask, dtype), cfg, **extra)
    return loss, stats, lp_t


def _ref(case, cfg, lp=None):
    lp0, b, adv, mask, prox, ref = case
    return ref_loss(
        lp or lp0, b, adv, mask, cfg, prox if cfg.decoupled else None, ref if cfg.kl_coef else None
    )


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_matches_float64_reference(name, seed):
    case, cfg = _case(seed), CONFIGS[name]
    want = _ref(case, cfg)
    loss64, _, _ = _run(case, cfg)
    loss32, _, _ = _run(case, cfg, torch.float32)
    assert abs(float(loss64) - want) <= 1e-12 * max(1.0, abs(want))
    assert abs(float(loss32) - want) <= 1e-5 * max(1.0, abs(want))


@pytest.mark.parametrize(
    ("name", "stat"),
    [
        ("default", "clip_frac"),
        ("dual-clip", "dual_clip_frac"),
        ("decoupled-tis", "tis_frac"),
        ("mis-token", "mis_drop_frac"),
        ("mis-sequence", "mis_drop_frac"),
        ("everything", "dual_clip_frac"),
        ("everything", "tis_frac"),
        ("everything", "mis_drop_frac"),
    ],
)
def test_random_cases_exercise_every_option(name, stat):
    """Guards the reference comparison above against passing vacuously."""
    seen = [_run(_case(seed), CONFIGS[name])[1][stat] for seed in range(3)]
    assert any(0 < x < 1 for x in seen), seen


@pytest.mark.parametrize("name", ["default", "dual-clip", "dr-grpo", "decoupled-tis", "everything"])
def test_gradient_matches_finite_differences_of_the_reference(name):
    case, cfg = _case(3), CONFIGS[name]
    loss, _, lp_t = _run(case, cfg, grad=True)
    loss.backward()
    h = 1e-6
    for i in range(ROWS):
        for t in range(COLS):
            up = [row[:] for row in case[0]]
            down = [row[:] for row in case[0]]
            up[i][t] += h
            down[i][t] -= h
            fd = (_ref(case, cfg, up) - _ref(case, cfg, down)) / (2 * h)
            assert abs(float(lp_t.grad[i, t]) - fd) < 1e-7, (i, t)


# ----------------------------------------------------------------------------- hand-worked cases


def test_dual_clip_hand_worked():
    # (ratio, A) with eps 0.2, c 3:  (4, -1): min(-4, -1.2) = -4, floored at -3 -> loss 3
    # (4, +1): min(4, 1.2) = 1.2 -> -1.2;  (0.5, -1): min(-0.5, -0.8) = -0.8 -> 0.8
    # (1.1, -1): -1.1 -> 1.1.  Mean (3 - 1.2 + 0.8 + 1.1) / 4 = 0.925; without the floor 1.175
    lp = torch.tensor([[LN(4), LN(4), LN(0.5), LN(1.1)]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[-1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    zeros, ones = torch.zeros(1, 4, dtype=torch.float64), torch.ones(1, 4, dtype=torch.float64)
    loss, stats = policy_loss(lp, zeros, adv, ones, LossConfig(dual_clip=3.0))
    assert abs(loss.item() - 0.925) < 1e-15
    assert stats["dual_clip_frac"] == 0.25 and stats["clip_frac"] == 0.75
    loss.backward()
    # only the unclipped token moves: d(-rho * A / 4)/dl = rho / 4 = 0.275
    assert lp.grad.tolist() == [[0.0, 0.0, 0.0, pytest.approx(0.275, abs=1e-15)]]
    plain, _ = policy_loss(lp, zeros, adv, ones, LossConfig())
    assert abs(plain.item() - 1.175) < 1e-15


def test_dual_clip_leaves_positive_advantages_alone():
    gen = torch.Generator().manual_seed(0)
    lp = (torch.randn(3, 5, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    adv = torch.rand(3, 5, generator=gen, dtype=torch.float64) + 0.1
    zeros, ones = torch.zeros(3, 5, dtype=torch.float64), torch.ones(3, 5, dtype=torch.float64)
    grads = []
    for cfg in (LossConfig(), LossConfig(dual_clip=1.01)):
        loss, stats = policy_loss(lp, zeros, adv, ones, cfg)
        grads.append((loss.item(), torch.autograd.grad(loss, lp)[0]))
        assert stats["dual_clip_frac"] == 0.0
    assert grads[0][0] == grads[1][0] and grads[0][1].equal(grads[1][1])


def test_k1_k2_k3_hand_worked():
    # delta = log pi - log pi_ref = +-ln 2:  k1 = +-0.6931, k2 = (ln 2)^2 / 2 = 0.2402,
    # k3 = exp(-delta) - 1 + delta = 1/2 - 1 + ln 2 = 0.1931  and  2 - 1 - ln 2 = 0.3069
    lp = torch.tensor([[LN(2), -LN(2)]], dtype=torch.float64)
    ref = torch.zeros(1, 2, dtype=torch.float64)
    assert kl_estimate(lp, ref, "k1").tolist()[0] == pytest.approx(
        [0.6931471805599453, -0.6931471805599453], abs=1e-15
    )
    assert kl_estimate(lp, ref, "k2").tolist()[0] == pytest.approx([0.2402265069591007] * 2, abs=1e-15)
    assert kl_estimate(lp, ref, "k3").tolist()[0] == pytest.approx(
        [0.1931471805599453, 0.3068528194400547], abs=1e-15
    )
    assert kl_estimate(ref, ref, "k3").tolist() == [[0.0, 0.0]]


def test_kl_penalty_hand_worked_and_off_when_equal():
    # zero advantages: the loss is beta * token-mean k3 = 0.5 * (0.1931 + 0.3069) / 2 = 0.125
    lp = torch.tensor([[LN(2), -LN(2)]], dtype=torch.float64)
    zeros, ones = torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    cfg = LossConfig(kl_coef=0.5)
    loss, stats = policy_loss(lp, lp, zeros, ones, cfg, reference=zeros)
    assert abs(loss.item() - 0.125) < 1e-15 and abs(stats["kl"] - 0.25) < 1e-15
    loss, stats = policy_loss(lp, lp, zeros, ones, cfg, reference=lp)
    assert loss.item() == 0.0 and stats["kl"] == 0.0


def test_aggregation_modes_hand_worked():
    # ratio 1 so each token's loss is -A: row 0 has 2 tokens of A = +1, row 1 has 4 of A = -1
    # token-mean -(2 - 4)/6 = 1/3; seq-mean-token-mean -(1 - 1)/2 = 0;
    # seq-mean-token-sum -(2 - 4)/2 = 1; seq-mean-token-sum-norm (L = 8) -(2/8 - 4/8)/2 = 1/8
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0] * 4, [-1.0] * 4], dtype=torch.float64) * mask
    lp = torch.full((2, 4), -0.7, dtype=torch.float64)
    want = {
        "token-mean": 1 / 3,
        "seq-mean-token-mean": 0.0,
        "seq-mean-token-sum": 1.0,
        "seq-mean-token-sum-norm": 0.125,
    }
    for mode, value in want.items():
        loss, _ = policy_loss(lp, lp, adv, mask, LossConfig(agg_mode=mode, norm_length=8))
        assert abs(loss.item() - value) < 1e-15, mode


def test_tis_and_mis_hand_worked():
    # decoupled, current = proximal (ratio 1), A = 1, w = exp(p - b) = 3, 1/4, 1
    # TIS C = 2: -(2 + 0.25 + 1)/3;  MIS [0.5, 2] per token keeps only w = 1: -1;
    # per sequence the geometric mean (3 * 1/4 * 1)^(1/3) = 0.909 is inside: nothing dropped
    p = torch.full((1, 3), -1.0, dtype=torch.float64)
    b = p - torch.tensor([[LN(3), LN(0.25), 0.0]], dtype=torch.float64)
    adv, ones = torch.ones(1, 3, dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64)
    loss, stats = policy_loss(p, b, adv, ones, LossConfig(decoupled=True, tis_cap=2.0), proximal=p)
    assert abs(loss.item() + 3.25 / 3) < 1e-15
    assert stats["tis_frac"] == pytest.approx(1 / 3) and stats["is_weight_max"] == pytest.approx(3.0)
    assert stats["is_weight_min"] == pytest.approx(0.25) and stats["is_weight_mean"] == pytest.approx(
        4.25 / 3
    )
    mis = LossConfig(decoupled=True, mis_low=0.5, mis_high=2.0)
    loss, stats = policy_loss(p, b, adv, ones, mis, proximal=p)
    assert abs(loss.item() + 1.0) < 1e-15 and stats["mis_drop_frac"] == pytest.approx(2 / 3)
    seq = LossConfig(decoupled=True, mis_low=0.5, mis_high=2.0, mis_level="sequence")
    loss, stats = policy_loss(p, b, adv, ones, seq, proximal=p)
    assert abs(loss.item() + 4.25 / 3) < 1e-15 and stats["mis_drop_frac"] == 0.0


def test_decoupled_gradient_is_the_weighted_policy_gradient():
    # with proximal = current weights the ratio is 1 (never clipped); dL/dl_t = -w_t A_t / n
    gen = torch.Generator().manual_seed(1)
    lp = torch.randn(2, 3, generator=gen, dtype=torch.float64).requires_grad_()
    b = lp.detach() + torch.randn(2, 3, generator=gen, dtype=torch.float64)
    adv = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    ones = torch.ones(2, 3, dtype=torch.float64)
    loss, stats = policy_loss(lp, b, adv, ones, LossConfig(decoupled=True))
    loss.backward()
    assert torch.allclose(lp.grad, -torch.exp(lp.detach() - b) * adv / 6, rtol=0, atol=1e-15)
    assert stats["clip_frac"] == 0.0


# ----------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("name", CONFIGS)
def test_all_equal_rewards_give_zero_policy_loss_and_gradient(name):
    cfg = CONFIGS[name]
    lp0, b, _, mask, prox, ref = _case(4)
    zero_adv = [[0.0] * COLS for _ in range(ROWS)]
    loss, stats, lp_t = _run((lp0, b, zero_adv, mask, prox, ref), cfg, grad=True)
    assert stats["pg_loss"] == 0.0
    if not cfg.kl_coef:
        loss.backward()
        assert loss.item() == 0.0 and not lp_t.grad.any()


@pytest.mark.parametrize("name", CONFIGS)
def test_masked_tokens_do_not_matter(name):
    cfg = CONFIGS[name]
    lp, b, adv, mask, prox, ref = _case(5)
    a, _, _ = _run((lp, b, adv, mask, prox, ref), cfg)
    junk = [[v if m else 50.0 for v, m in _zip(*rows)] for rows in _zip(adv, mask)]
    lp2 = [[v if m else 3.0 for v, m in _zip(*rows)] for rows in _zip(lp, mask)]
    b2 = [[v if m else -80.0 for v, m in _zip(*rows)] for rows in _zip(b, mask)]
    c, _, _ = _run((lp2, b2, junk, mask, prox, ref), cfg)
    assert float(a) == pytest.approx(float(c), rel=1e-12, abs=1e-15)


def test_all_tokens_dropped_gives_zero_loss_not_nan():
    lp, ones = torch.zeros(2, 3, dtype=torch.float64), torch.ones(2, 3, dtype=torch.float64)
    b = lp - 5  # every weight e^5 leaves the band
    for mode in ("token-mean", "seq-mean-token-mean"):
        cfg = LossConfig(agg_mode=mode, mis_low=0.5, mis_high=2.0)
        loss, stats = policy_loss(lp, b, ones, ones, cfg)
        assert loss.item() == 0.0 and stats["mis_drop_frac"] == 1.0


def _old_ppo_clip_loss(logprobs, behaviour, advantages, mask, clip_eps):
    """The loss Loong trained with before LossConfig existed (frozen copy, for the check below)."""
    ratio = torch.exp(logprobs - behaviour)
    surr = torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    n = mask.sum().clamp(min=1)
    loss = -(surr * mask).sum() / n
    clipped = ((ratio - 1).abs() > clip_eps).float()
    return loss, {"clip_frac": float((clipped * mask).sum() / n)}


def test_defaults_reproduce_the_previous_loss_bit_for_bit():
    gen = torch.Generator().manual_seed(7)
    lp = (torch.randn(5, 9, generator=gen) * 0.5 - 1).requires_grad_()
    b = lp.detach() + torch.randn(5, 9, generator=gen) * 0.3
    adv = torch.randn(5, 9, generator=gen)
    mask = (torch.rand(5, 9, generator=gen) > 0.3).float()
    old, old_stats = _old_ppo_clip_loss(lp, b, adv, mask, 0.2)
    new, stats = policy_loss(lp, b, adv, mask, LossConfig())
    assert new.item() == old.item() and stats["clip_frac"] == old_stats["clip_frac"]
    assert torch.autograd.grad(new, lp)[0].equal(torch.autograd.grad(old, lp)[0])
