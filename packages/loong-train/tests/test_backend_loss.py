"""TorchBackend wires LossConfig in: the default loss is the previous one, decoupled PPO's
proximal forward equals the trainer's own, and the KL reference is the frozen initial model."""

import copy

import pytest
import torch
from train_testkit import tiny_qwen3

from loong_core.records import TrainBatch
from loong_train.algo.config import LossConfig
from loong_train.backends.torch_backend import TorchBackend, token_logprobs


def _model(seed=0):
    return tiny_qwen3(
        seed,
        std=0.02,
        vocab_size=37,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )


def _batch():
    gen = torch.Generator().manual_seed(0)
    lens = [7, 5]
    n = sum(lens)
    mask = [0, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1]
    adv = [a * m for a, m in zip([0.7] * 7 + [-1.3] * 5, mask, strict=True)]
    behaviour = (torch.randn(n, generator=gen) * 0.3 - 3.5).tolist()
    return TrainBatch(
        token_ids=torch.randint(0, 37, (n,), generator=gen).tolist(),
        loss_mask=mask,
        advantages=adv,
        behaviour_logprobs=[b * m for b, m in zip(behaviour, mask, strict=True)],
        versions=[0 if m else -1 for m in mask],
        row_lens=lens,
        sample_ids=["a", "b"],
        policy_version=0,
    )


def _old_loss(model, batch, clip_eps=0.2):
    """The loss TorchBackend computed before LossConfig existed, on the same padded tensors, in
    float64 (the backend packs rows and chunks the head: equal to float32 rounding)."""
    t = TorchBackend(copy.deepcopy(model), lr=0.0).tensors(batch)
    t = {k: v.double() if v.is_floating_point() else v for k, v in t.items()}
    with torch.no_grad():
        lp = token_logprobs(copy.deepcopy(model).double(), t["ids"])
    ratio = torch.exp(lp - t["behaviour"])
    adv = t["adv"]
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    return (-(surr * t["mask"]).sum() / t["mask"].sum().clamp(min=1)).item()


def test_default_loss_is_the_previous_loss():
    model, batch = _model(), _batch()
    want = _old_loss(model, batch)
    metrics = TorchBackend(model, lr=1e-3).train_step(batch)
    assert metrics["loss"] == pytest.approx(want, rel=1e-6)


def test_decoupled_proximal_forward_equals_the_trainer_forward():
    # one optimizer step per batch: the proximal policy is the pre-update weights, so the
    # no-grad recompute must agree with the grad forward exactly (ratio 1, nothing clipped)
    batch = _batch()
    a = TorchBackend(_model(), lr=1e-3, loss=LossConfig(decoupled=True)).train_step(batch)
    assert a["clip_frac"] == 0.0
    b = TorchBackend(_model(), lr=1e-3, loss=LossConfig(decoupled=True, tis_cap=1e9)).train_step(batch)
    assert a["loss"] == b["loss"] and a["is_weight_max"] == b["is_weight_max"] > 1


def test_kl_reference_is_the_frozen_initial_model():
    batch = _batch()
    backend = TorchBackend(_model(), lr=1e-2, loss=LossConfig(kl_coef=0.1))
    first = backend.train_step(batch)
    # the reference's scoring forward (normaliser taken in place) agrees with the policy's to rounding
    assert abs(first["kl"]) < 1e-9 and first["loss"] == pytest.approx(first["pg_loss"], abs=1e-9)
    second = backend.train_step(batch)
    assert second["kl"] > 0
    initial = _model()
    for name, p in backend.reference.named_parameters():
        assert not p.requires_grad and p.equal(dict(initial.named_parameters())[name])
