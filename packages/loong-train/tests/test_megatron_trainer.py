"""The trainer's ``train.backend = "megatron"``: recipe selection, refusals before Ray starts, and
(slow) a two-rank trainer against the torch backend and resumed from its checkpoint."""

from __future__ import annotations

import logging

import pytest
import torch
from megatron_testkit import FAMILIES, LR, cloned, rel_gap, tiny_batch, tiny_model

from loong_train.backends.torch_backend import TorchBackend
from loong_train.models.decoder import CausalLM, DecoderConfig


@pytest.fixture
def local_ray():
    """The follower rank is a Ray actor: a cluster for the test, shut down after it (a later
    test may start or join another)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    yield
    ray.shutdown()


def test_a_model_megatron_cannot_train_is_refused_before_ray_starts(tmp_path):
    import ray

    from loong_core.config import ConfigError
    from loong_train.config import load_recipe
    from loong_train.controller import run
    from loong_train.models.tokenizer import load_tokenizer
    from loong_train.tiny.tokenizer import build_tokenizer

    path = build_tokenizer(tmp_path / "llama")
    scaling = {**FAMILIES["llama"]["rope_scaling"], "original_max_position_embeddings": 32}
    config = DecoderConfig(vocab_size=len(load_tokenizer(path)), model_type="llama", rope_scaling=scaling,
                           hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=16)  # fmt: skip
    CausalLM(config).save_pretrained(path)
    recipe = load_recipe("tiny-calc-agent", [f"model.path={path}", 'train.backend.type="megatron"'])
    with pytest.raises(
        ConfigError,
        match=r"'megatron' cannot train .* llama3 rope scaling with \{'original_max_position_embeddings': 32\}",
    ):
        run(recipe, tmp_path / "run", tmp_path / "cache")
    assert not ray.is_initialized()


def test_recipe_selects_the_megatron_backend_and_explains_a_missing_install(monkeypatch):
    from loong_core.config import ConfigError
    from loong_train.backends import config
    from loong_train.config import load_recipe

    sets = ["train.backend.type=megatron", "train.backend.tp=2", "train.backend.pp=2"]
    backend = load_recipe("tiny-calc-agent", sets).train.backend
    assert backend == config.MegatronBackendConfig(tp=2, pp=2)
    with pytest.raises(
        ConfigError, match=r"unknown config key 'train\.backend\.tp' \(type 'megatron' has it"
    ):
        load_recipe("tiny-calc-agent", ["train.backend.type=torch", "train.backend.tp=2"])
    with pytest.raises(  # a table without type is of the default type
        ConfigError, match=r"unknown config key 'train\.backend\.tp' \(type 'megatron' has it"
    ):
        load_recipe("tiny-calc-agent", ["train.backend.tp=2"])
    monkeypatch.setattr(config, "_have_megatron_core", lambda: False)
    recipe = load_recipe("tiny-calc-agent", ["train.backend.type=megatron"])  # validates without it
    with pytest.raises(ConfigError, match=r"loong-train\[megatron\]"):
        config.require_installed(recipe.train.backend)  # what the build and the preflight call


@pytest.mark.slow
@pytest.mark.integration
def test_trainer_worker_drives_a_two_rank_megatron_backend(tmp_path, local_ray):
    """TrainerWorker with ``train.backend = "megatron"``, tp = 2: the calling process is rank 0
    and one follower (a Ray actor) mirrors it; logprobs, the step's loss and the published weights
    match the torch backend (the CPU comparison above, through the trainer)."""
    from loong_train.config import load_recipe
    from loong_train.controller import trainer_options
    from loong_train.workers.trainer import TrainerWorker
    from loong_transfermesh import TransportConfig

    model = tiny_model(tied=False)
    model.save_pretrained(tmp_path)
    sets = ["train.backend.type=megatron", "train.backend.tp=2", "train.warmup_steps=0", f"train.lr={LR}"]
    recipe = load_recipe("tiny-calc-agent", [*sets, "rollout.temperature=0.9"])
    trainer = TrainerWorker(
        str(tmp_path), transport=TransportConfig(name="megatron-trainer-test"), **trainer_options(recipe)
    )
    try:
        batch = tiny_batch()
        lp = torch.tensor(trainer.logprobs(batch))
        metrics = trainer.train_step(batch).metrics
        weights = cloned(trainer.backend.named_weights())
    finally:
        trainer.close()
    torch_backend = TorchBackend(model, lr=LR, loss=recipe.loss, temperature=0.9)
    ref_lp = torch_backend.logprobs(batch)
    ref_lp = torch.cat([ref_lp[i, :n] for i, n in enumerate(batch.row_lens)])
    assert rel_gap(lp, ref_lp) <= 1e-5
    assert metrics["loss"] == pytest.approx(torch_backend.train_step(batch)["loss"], rel=1e-5)
    assert max(float((weights[k] - v).abs().max()) for k, v in model.hf_state_dict().items()) <= 0.1 * LR


@pytest.mark.slow
@pytest.mark.integration
def test_megatron_checkpoint_resumes_the_next_step_exactly(tmp_path, local_ray):
    """A two-rank Megatron trainer checkpointed after one step, then resumed in a fresh trainer,
    takes the same second step as one that never stopped: same learning rate (the warmup
    schedule), loss and bit-identical weights (Adam's moments came back on every rank)."""
    from loong_train.config import load_recipe
    from loong_train.controller import trainer_options
    from loong_train.workers.trainer import TrainerWorker
    from loong_transfermesh import TransportConfig

    tiny_model(tied=False).save_pretrained(tmp_path / "init")
    sets = ["train.backend.type=megatron", "train.backend.tp=2", "train.warmup_steps=3", f"train.lr={LR}"]
    recipe = load_recipe("tiny-calc-agent", sets)
    batch, ckpt = tiny_batch(), str(tmp_path / "ckpt")

    def trainer(name: str) -> TrainerWorker:
        return TrainerWorker(
            str(tmp_path / "init"), transport=TransportConfig(name=name), **trainer_options(recipe)
        )

    first = trainer("megatron-ckpt-a")
    try:
        first.train_step(batch)
        first.save_checkpoint(ckpt)
        want = first.train_step(batch).metrics
        want_weights = cloned(first.backend.named_weights())
    finally:
        first.close()
    resumed = trainer("megatron-ckpt-b")
    try:
        resumed.load_checkpoint(ckpt)
        got = resumed.train_step(batch).metrics
        got_weights = cloned(resumed.backend.named_weights())
    finally:
        resumed.close()
    assert (got["lr"], got["loss"]) == (want["lr"], want["loss"])
    assert sorted(got_weights) == sorted(want_weights)
    assert all(torch.equal(got_weights[k], want_weights[k]) for k in want_weights)
