"""Loong's advantages, policy losses and KL estimators against verl's and TRL's own implementations.

The fixtures hold fixed float64 inputs and what verl 0.9.1 and TRL 1.16.0 compute from them
(``tools/reference_algorithms.sh`` regenerates both, each in a throwaway environment; neither is
a dependency). Losses are compared with their gradients with respect to the current logprobs.
Where the conventions differ on purpose the test says so: verl gives a group of one episode
the advantage of its reward, Loong gives it 0 (the fixture has no such group); TRL adds 1e-4 to
the group's standard deviation where verl and Loong add 1e-6."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from loong_core.records import SpanSource, TokenSpan, Trajectory
from loong_train.algo.config import LossConfig
from loong_train.algo.losses import advantages, grpo_advantages, kl_estimate, policy_loss

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "reference_algorithms.json").read_text())
TRL = json.loads((Path(__file__).parent / "fixtures" / "reference_trl.json").read_text())
X = {k: torch.tensor(v, dtype=torch.float64) for k, v in FIXTURE["inputs"].items() if k != "lengths"}
LENGTHS = FIXTURE["inputs"]["lengths"]
CLIP = FIXTURE["ppo_clip"]


def _trajectories() -> list[Trajectory]:
    groups, rewards = FIXTURE["advantages"]["groups"], FIXTURE["inputs"]["rewards"]
    out = []
    for i, (g, r, n) in enumerate(zip(groups, rewards, LENGTHS, strict=True)):
        spans = [
            TokenSpan(token_ids=[1, 2], source=SpanSource.PROMPT),
            TokenSpan(token_ids=[3] * n, source=SpanSource.MODEL, logprobs=[-1.0] * n, weight_version=0),
        ]
        out.append(Trajectory(sample_id=f"s{i}", group_id=f"g{g}", spans=spans, reward=r))
    return out


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("grpo_unbiased", {"std": "unbiased"}),
        ("grpo_no_std", {"scale_adv_by_std": False}),
        ("rloo", {"estimator": "rloo"}),
        ("reinforce++_tokens", {"estimator": "reinforce++"}),
        ("reinforce++-baseline_tokens", {"estimator": "reinforce++-baseline"}),
    ],
)
def test_advantages_equal_verls(name, options):
    want = FIXTURE["advantages"][name]
    got = advantages(_trajectories(), LossConfig(**options))
    if name.endswith("_tokens"):  # verl whitens token by token: every loss token of a row carries its A
        want = [row[0] for row in want]
        assert all(
            len(set(row[:n])) == 1 for row, n in zip(FIXTURE["advantages"][name], LENGTHS, strict=True)
        )
    assert got == pytest.approx(want, abs=1e-6)


def _loong(cfg: LossConfig) -> tuple[float, list]:
    new = X["new"].clone().requires_grad_(True)
    loss, _ = policy_loss(new, X["old"], X["adv"], X["mask"], cfg)
    loss.backward()
    return float(loss.detach()), new.grad.tolist()


def _same(got: tuple[float, list], want: dict) -> None:
    assert got[0] == pytest.approx(want["loss"], abs=1e-9)
    torch.testing.assert_close(
        torch.tensor(got[1], dtype=torch.float64),
        torch.tensor(want["grad"], dtype=torch.float64),
        rtol=0,
        atol=1e-9,
    )


@pytest.mark.parametrize("agg", list(FIXTURE["ppo"]))
@pytest.mark.parametrize("case", ["clip_high", "dual_clip"])
def test_ppo_with_clip_higher_and_dual_clip_equals_verls_in_every_aggregation(agg, case):
    dual = CLIP["dual"] if case == "dual_clip" else math.inf
    _same(_loong(_ppo(CLIP["low"], CLIP["high"], dual, agg, CLIP["norm_length"])), FIXTURE["ppo"][agg][case])


def _ppo(low: float, high: float, dual: float, agg: str, norm_length: int) -> LossConfig:
    norm_length = norm_length if agg == "seq-mean-token-sum-norm" else 0
    return LossConfig(clip_eps=low, clip_eps_high=high, dual_clip=dual, agg_mode=agg, norm_length=norm_length)


@pytest.mark.parametrize("policy", ["gspo", "gspo-token"])
def test_gspo_equals_verls(policy):
    low, high = FIXTURE["gspo"]["clip"]
    cfg = LossConfig(policy=policy, clip_eps=low, clip_eps_high=high, agg_mode="seq-mean-token-mean")
    _same(_loong(cfg), FIXTURE["gspo"])


def test_cispo_equals_verls():
    low, high = FIXTURE["cispo"]["clip"]
    _same(_loong(LossConfig(policy="cispo", clip_eps=low, clip_eps_high=high)), FIXTURE["cispo"])


@pytest.mark.parametrize(("ours", "verls"), [("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl")])
def test_kl_estimators_equal_verls(ours, verls):
    got = kl_estimate(X["new"], X["ref"], ours)
    torch.testing.assert_close(
        got, torch.tensor(FIXTURE["kl"][verls], dtype=torch.float64), rtol=0, atol=1e-12
    )


def test_the_fixtures_make_every_clip_bind():
    """Each clip changes the reference loss, so a Loong clip that never bound would fail."""
    for fixture, bound in ((FIXTURE, "dual_clip"), (TRL, "delta")):
        for cases in fixture["ppo"].values():
            assert cases[bound]["loss"] != pytest.approx(cases["clip_high"]["loss"], abs=1e-6)
    ratio = torch.exp(X["new"] - X["old"])[X["mask"] > 0]
    assert (ratio > 1 + CLIP["high"]).any() and (ratio < 1 - CLIP["low"]).any()


def test_the_fixture_names_what_made_it():
    assert FIXTURE["versions"]["verl"] == "0.9.1"


def test_both_fixtures_share_their_inputs():
    assert TRL["inputs"] == FIXTURE["inputs"]
    assert TRL["advantages"]["groups"] == FIXTURE["advantages"]["groups"]


@pytest.mark.parametrize(("scale", "by_std"), [("group", True), ("none", False)])
def test_grpo_advantages_equal_trls(scale, by_std):
    """TRL's ``scale_rewards = "group"`` is GRPO with the unbiased std (at TRL's eps); "none" is Dr. GRPO.
    TRL's ``nanstd`` computes its n / (n - 1) correction in float32, hence the 1e-7 tolerance."""
    got = grpo_advantages(_trajectories(), by_std, eps=TRL["advantages"]["eps"], std="unbiased")
    assert got == pytest.approx(TRL["advantages"][scale], abs=1e-7)


# TRL's loss_type is its aggregation; one process and no gradient accumulation, dapo equals bnpo
TRL_AGGREGATIONS = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dapo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}


@pytest.mark.parametrize("loss_type", list(TRL_AGGREGATIONS))
@pytest.mark.parametrize("case", ["clip_high", "delta"])
def test_ppo_equals_trls_for_each_loss_type(loss_type, case):
    """TRL's ``delta`` (two-sided clipping) caps the ratio of every token at delta; for negative
    advantages that is the dual clip with c = delta, and for positive ones the upper clip already
    binds below delta, so the two objectives and their gradients are the same."""
    clip = TRL["ppo_clip"]
    dual = clip["delta"] if case == "delta" else math.inf
    cfg = _ppo(clip["low"], clip["high"], dual, TRL_AGGREGATIONS[loss_type], clip["max_completion_length"])
    _same(_loong(cfg), TRL["ppo"][loss_type][case])


def test_gspo_equals_trls_sequence_level_importance_sampling():
    low, high = TRL["gspo"]["clip"]
    cfg = LossConfig(policy="gspo", clip_eps=low, clip_eps_high=high, agg_mode="seq-mean-token-mean")
    _same(_loong(cfg), TRL["gspo"])


def test_cispo_equals_trls():
    """TRL caps the IS weight at ``epsilon_high`` itself and has no lower bound; Loong clips to
    [1 - eps, 1 + eps_high], so eps = 0.99 (no fixture ratio is below 0.01) and eps_high = cap - 1."""
    assert float(torch.exp(X["new"] - X["old"])[X["mask"] > 0].min()) > 0.01
    cfg = LossConfig(policy="cispo", clip_eps=0.99, clip_eps_high=TRL["cispo"]["cap"] - 1)
    _same(_loong(cfg), TRL["cispo"])


def test_the_trl_fixture_names_what_made_it():
    assert TRL["versions"]["trl"] == "1.16.0"
