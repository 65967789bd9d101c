"""Loong's advantages, policy losses and KL estimators against verl's own implementations.

The fixture holds fixed float64 inputs and what verl 0.9.1 computes from them
(``tools/reference_algorithms.sh`` regenerates it in a throwaway environment; verl is never a
dependency). Losses are compared with their gradients with respect to the current logprobs.
Where the conventions differ on purpose the test says so: verl gives a group of one episode
the advantage of its reward, Loong gives it 0 (the fixture has no such group)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from loong_core.records import SpanSource, TokenSpan, Trajectory
from loong_train.algo.config import LossConfig
from loong_train.algo.losses import advantages, kl_estimate, policy_loss

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "reference_algorithms.json").read_text())
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
    cfg = LossConfig(
        clip_eps=CLIP["low"],
        clip_eps_high=CLIP["high"],
        dual_clip=CLIP["dual"] if case == "dual_clip" else math.inf,
        agg_mode=agg,
        norm_length=CLIP["norm_length"] if agg == "seq-mean-token-sum-norm" else 0,
    )
    _same(_loong(cfg), FIXTURE["ppo"][agg][case])


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


def test_the_fixture_names_what_made_it():
    assert FIXTURE["versions"]["verl"] == "0.9.1"
