"""The slime-style first-step check: for the same weights, the trainer's recomputed logprobs
equal the engine's rollout logprobs, and the PPO/mismatch KL is 0 (CPU fp32).

Tolerance reached: max |logp_trainer - logp_engine| <= 2e-6 per token (fp32; the engine decodes
left-padded against a KV cache, the trainer runs right-padded full sequences).
"""

import pytest

from loong_train.algo.losses import grpo_advantages, pack_batch
from loong_train.controller import trainer_options
from loong_train.source import GroupSource
from loong_train.tiny import calc
from loong_train.workers.rollout import RolloutWorker
from loong_train.workers.trainer import TrainerWorker
from loong_transfermesh import TransportConfig


def _rollout(tiny_dir, groups=4, transport=None, **worker_options):
    worker = RolloutWorker(
        str(tiny_dir),
        seed=0,
        sampling={"temperature": 1.0, "max_new_tokens": 24},
        limits={"max_turns": 2, "max_model_tokens": 40},
        transport=transport or TransportConfig(name="first-step-test"),
        **worker_options,
    )
    source = GroupSource(calc.train_tasks(0, []), group_size=4)
    specs = [s for _ in range(groups) for s in source.specs(source.next_group())]
    return worker, worker.rollout(specs).trajectories


def test_trainer_logprobs_equal_engine_logprobs_on_first_step(tiny_dir, recipe):
    _, trajs = _rollout(tiny_dir)
    batch = pack_batch(trajs, grpo_advantages(trajs), policy_version=0)
    trainer = TrainerWorker(
        str(tiny_dir), transport=TransportConfig(name="first-step-test"), **trainer_options(recipe)
    )
    try:
        recomputed = trainer.logprobs(batch)
        gaps = [
            abs(a - b)
            for a, b, m in zip(recomputed, batch.behaviour_logprobs, batch.loss_mask, strict=True)
            if m
        ]
        assert len(gaps) > 100
        assert max(gaps) <= 2e-6
        published = trainer.publish(trainer.train_step(batch))
        metrics = published.step.metrics
        assert metrics["mismatch_kl"] <= 1e-12 and metrics["onpolicy_mismatch_kl"] <= 1e-12
        assert published.manifest.version == 1
    finally:
        trainer.close()


@pytest.mark.parametrize("mode", ["copy", "zero_copy"])
def test_weights_reach_the_engine_through_transfermesh(tiny_dir, recipe, mode):
    transport = TransportConfig(name=f"first-step-{mode}", mode=mode)
    worker, trajs = _rollout(tiny_dir, groups=2, transport=transport)
    trainer = TrainerWorker(str(tiny_dir), transport=transport, **trainer_options(recipe))
    try:
        manifest = trainer.publish(
            trainer.train_step(pack_batch(trajs, [1.0] * len(trajs), policy_version=0))
        ).manifest
        info = worker.apply_weights(manifest)
        assert info.version == worker.weight_version() == 1
        sent = trainer.backend.named_weights()
        slot = worker.receiver.read(1)
        for name, p in worker.engine.model.named_parameters():
            assert p.equal(sent[name]), name
            assert (p.data_ptr() == slot[name].data_ptr()) == (mode == "zero_copy"), name
        source = GroupSource(calc.train_tasks(5, []), group_size=2)
        after = worker.rollout(source.specs(source.next_group())).trajectories
        assert {t.oldest_version for t in after} == {1}
    finally:
        trainer.close()


def test_a_bfloat16_engine_takes_float32_updates_rounded(tiny_dir, recipe):
    """``[rollout.engine] dtype = "bfloat16"``: step 1's mismatch KL is bfloat16 rounding (far
    above float32's, yet small), and the trainer's float32 update lands in the engine rounded:
    each engine weight is the trainer's, rounded to bfloat16, and sampling continues at it."""
    import torch

    from loong_train.engines.config import EmbeddedEngineConfig

    transport = TransportConfig(name="first-step-bfloat16")
    engine = EmbeddedEngineConfig(dtype="bfloat16")
    worker, trajs = _rollout(tiny_dir, groups=4, transport=transport, engine=engine)
    trainer = TrainerWorker(str(tiny_dir), transport=transport, **trainer_options(recipe))
    try:
        published = trainer.publish(trainer.train_step(pack_batch(trajs, grpo_advantages(trajs), 0)))
        assert 1e-7 < published.step.metrics["mismatch_kl"] < 1e-2
        worker.apply_weights(published.manifest)
        sent = trainer.backend.named_weights()
        for name, p in worker.engine.model.named_parameters():
            assert p.dtype == torch.bfloat16 and p.equal(sent[name].to(torch.bfloat16)), name
        source = GroupSource(calc.train_tasks(5, []), group_size=2)
        after = worker.rollout(source.specs(source.next_group())).trajectories
        assert {t.oldest_version for t in after} == {1}
    finally:
        trainer.close()
