"""LoRA on the torch backend: only the adapters train, the exported adapter loads with ``peft``
onto the base checkpoint with Loong's logits, weight updates carry the adapters (merged by the
engine) or the merged model, the KL reference is the base model, and a resumed backend continues
exactly."""

import msgspec
import pytest
import torch
from test_packing import _grouped_batch
from train_testkit import GENERIC, tiny_hf_checkpoint, tiny_qwen3

from loong_train.algo.config import LossConfig
from loong_train.backends import lora as lora_adapters
from loong_train.backends.config import LoraConfig, MegatronBackendConfig
from loong_train.backends.torch_backend import TorchBackend
from loong_train.config import TrainConfig
from loong_train.models.adapters import adapted_modules
from loong_train.models.decoder import CausalLM
from loong_transfermesh import LoraMerge

VOCAB = 41
LORA = LoraConfig(rank=4, alpha=8)


@pytest.fixture
def base(tmp_path):
    """A tiny Qwen3 checkpoint (the architecture ``transformers`` and ``peft`` load too)."""
    model = tiny_qwen3(0, std=0.1, vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model.save_pretrained(tmp_path / "base")
    return tmp_path / "base"


def _backend(base, lora=LORA, **kwargs) -> TorchBackend:
    torch.manual_seed(0)  # the adapters' random init (the trainer seeds the run's seed first)
    return TorchBackend.from_pretrained(base, lr=1e-2, lora=lora, **kwargs)


def _trained(base, lora=LORA, steps=2, **kwargs) -> TorchBackend:
    backend = _backend(base, lora, **kwargs)
    for _ in range(steps):
        backend.train_step(_grouped_batch())
    return backend


def _ids() -> torch.Tensor:
    return torch.tensor(_grouped_batch().token_ids[:12])[None]


def test_only_the_adapters_train(base):
    backend = _backend(base)
    before = {k: v.clone() for k, v in backend.model.named_parameters()}
    backend.train_step(_grouped_batch())
    after = dict(backend.model.named_parameters())
    adapters = [k for k in after if ".lora_" in k]
    assert adapters and len(adapters) == 2 * 7 * 2  # A and B of 7 linear layers in 2 layers
    assert all(torch.equal(before[k], after[k]) for k in after if ".lora_" not in k)
    assert all(not torch.equal(before[k], after[k]) for k in adapters if ".lora_B" in k)
    assert sum(len(s) > 0 for s in backend.opt.state.values()) == len(adapters)  # Adam state: adapters only


def test_exported_adapter_loads_with_peft_with_the_same_logits(base, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    backend = _trained(base, lora=LoraConfig(rank=4, alpha=8, save_merged=True))
    backend.save_pretrained(tmp_path / "final")
    assert (tmp_path / "final" / "adapter_config.json").is_file()
    with torch.no_grad():
        ours = backend.model.eval()(_ids())
        hf = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        theirs = PeftModel.from_pretrained(hf, str(tmp_path / "final")).eval()(_ids()).logits
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final" / "merged"), dtype=torch.float32)
        plain = merged.eval()(_ids()).logits
        untouched = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()(_ids()).logits
    assert (ours - untouched).abs().max() > 1e-3  # the adapter changed the model
    assert torch.allclose(theirs, ours, atol=1e-5), (theirs - ours).abs().max()
    assert torch.allclose(plain, ours, atol=1e-5), (plain - ours).abs().max()


def test_merged_weight_updates_are_the_adapted_model(base):
    """What the engines load with ``sync = "merged"`` (``named_weights``): a plain model holding
    them computes what the adapted model computes; float64, so only the merge's rounding shows."""
    backend = _trained(base, LoraConfig(rank=4, alpha=8, sync="merged"))
    backend.model.double()
    plain = CausalLM.from_pretrained(base).double()
    plain.load_state_dict(backend.named_weights(), strict=False)
    assert set(backend.named_weights()) == {k for k, _ in plain.named_parameters()}
    with torch.no_grad():
        want = backend.model.eval()(_ids())
        got = plain(_ids())
    assert torch.allclose(got, want, atol=1e-10)


def test_the_kl_reference_is_the_base_model(base):
    backend = _trained(base, loss=LossConfig(kl_coef=0.1))
    assert backend.reference is None  # no second copy of the model
    base_model = CausalLM.from_pretrained(base)
    with torch.no_grad():
        with lora_adapters.disabled(backend.model):
            off = backend.model(_ids())
        on = backend.model(_ids())
        want = base_model(_ids())
    assert torch.equal(off, want)
    assert not torch.allclose(on, want, atol=1e-3)
    assert all(p.requires_grad for n, p in backend.model.named_parameters() if ".lora_" in n)
    metrics = backend.train_step(_grouped_batch())
    assert metrics["kl"] > 0


def test_resume_continues_the_uninterrupted_run(base, tmp_path):
    """``save_state`` after 2 steps, a fresh backend's ``load_state``, 2 more steps: the same
    adapter, bit for bit, as 4 steps in one backend."""
    whole = _trained(base, steps=4)
    first = _trained(base, steps=2)
    first.save_state(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()  # the merged model, for the engines
    torch.manual_seed(1)  # another init: the checkpoint's adapter must replace it
    second = TorchBackend.from_pretrained(base, lr=1e-2, lora=LORA)
    second.load_state(tmp_path / "ckpt")
    for _ in range(2):
        second.train_step(_grouped_batch())
    a, b = dict(whole.model.named_parameters()), dict(second.model.named_parameters())
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:3]


def test_bad_settings_are_refused(base):
    with pytest.raises(ValueError, match=r"target_modules names \['qkv'\]"):
        TorchBackend.from_pretrained(base, lr=1e-2, lora=LoraConfig(rank=4, target_modules=["q_proj", "qkv"]))
    with pytest.raises(ValueError, match="torch backend only"):
        TrainConfig(lora=LoraConfig(rank=8), backend=MegatronBackendConfig())
    with pytest.raises(ValueError, match="dropout"):
        LoraConfig(rank=8, dropout=1.5)
    with pytest.raises(ValueError, match="rank = 0 turns LoRA off, but alpha, target_modules are set"):
        LoraConfig(alpha=8, target_modules=["q_proj"])
    assert not LoraConfig().enabled  # the default table: off, nothing set


def _distill_batch(beta: float):
    """The grouped batch with dense distillation targets: each token's teacher top 3 (its own id
    among them) with normalised logprobs, weight 1 at loss tokens."""
    batch = _grouped_batch()
    gen = torch.Generator().manual_seed(7)
    n, k = batch.num_tokens, 3
    ids = torch.randint(0, VOCAB, (n, k), generator=gen)
    ids[:, 0] = torch.tensor(batch.token_ids)
    logprobs = torch.log_softmax(torch.randn(n, k, generator=gen), -1) - 0.1
    return msgspec.structs.replace(
        batch,
        teacher_topk_ids=ids.flatten().tolist(),
        teacher_topk_logprobs=logprobs.flatten().tolist(),
        distill_coef=[float(m) for m in batch.loss_mask],
        distill_beta=beta,
    )


LOSSES = {
    "grpo-kl": (LossConfig(kl_coef=0.1, kl_estimator="k3"), _grouped_batch),
    "gspo": (LossConfig(policy="gspo"), _grouped_batch),
    "cispo-entropy": (LossConfig(policy="cispo", entropy_coef=0.01), _grouped_batch),
    "dual-clip-rloo": (LossConfig(dual_clip=3.0, estimator="rloo"), _grouped_batch),
    "forward-kl-distill": (LossConfig(), lambda: _distill_batch(0.0)),
    "jsd-distill": (LossConfig(), lambda: _distill_batch(0.5)),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_every_loss_trains_a_lora_student(base, name):
    """A LoRA student starts as the base model exactly (``B = 0``), so its first step computes the
    full model's loss and statistics (the KL reference: the adapters switched off, against the
    full backend's frozen copy), and its gradient reaches the adapters alone."""
    cfg, make = LOSSES[name]
    batch = make()
    full = TorchBackend.from_pretrained(base, lr=1e-2, loss=cfg).train_step(batch)
    lora = _backend(base, loss=cfg)
    before = {n: p.detach().clone() for n, p in lora.model.named_parameters()}
    got = lora.train_step(batch)
    for key, want in full.items():
        if key != "grad_norm":  # the adapters' gradient, not the model's
            assert got[key] == pytest.approx(want, rel=1e-5, abs=1e-7), key
    assert got["grad_norm"] > 0
    moved = {n for n, p in lora.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(".lora_" in n for n in moved), sorted(moved)[:3]


def _sampled_after_the_update(worker, trainer):
    """Eight episodes the worker samples after an update, packed, the trainer's logprobs of them
    and the per-token gaps between the two on the response tokens."""
    from loong_train.algo.losses import pack_batch
    from loong_train.source import GroupSource
    from loong_train.tiny import calc

    source = GroupSource(calc.train_tasks(5, []), group_size=4)
    after = worker.rollout([s for _ in range(2) for s in source.specs(source.next_group())]).trajectories
    batch = pack_batch(after, [0.0] * len(after), policy_version=1)
    recomputed = trainer.logprobs(batch)
    gaps = [
        abs(a - b) for a, b, m in zip(recomputed, batch.behaviour_logprobs, batch.loss_mask, strict=True) if m
    ]
    return after, batch, recomputed, gaps


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_engine_samples_the_adapted_policy(tiny_dir, sync):
    """Through the real weight path: a LoRA trainer's step-1 logprobs equal the engine's, and
    after its update reaches the engine over TransferMesh (the adapters alone, merged into the
    engine's base weights; or the merged weights), the engine's new samples carry the logprobs the
    trainer computes with its unmerged adapters, to float rounding."""
    from test_first_step import _rollout

    from loong_train.algo.losses import pack_batch
    from loong_train.config import load_recipe
    from loong_train.controller import trainer_options
    from loong_train.workers.trainer import TrainerWorker
    from loong_transfermesh import TransportConfig

    transport = TransportConfig(name=f"lora-engine-test-{sync}")
    recipe = load_recipe(
        "tiny-calc-agent", ["train.lora.rank=4", "train.lr=0.05", f'train.lora.sync="{sync}"']
    )
    adapters = recipe.train.lora if sync == "adapter" else None
    worker, trajs = _rollout(tiny_dir, groups=2, transport=transport, lora=adapters)
    trainer = TrainerWorker(str(tiny_dir), transport=transport, **trainer_options(recipe))
    try:
        advantages = [1.0 - i % 2 * 2 for i in range(len(trajs))]  # a signal whatever the rewards
        published = trainer.publish(trainer.train_step(pack_batch(trajs, advantages, policy_version=0)))
        assert published.step.metrics["mismatch_kl"] <= 1e-12
        sent = {t.name for t in published.manifest.tensors}
        assert all(".lora_" in n for n in sent) == (sync == "adapter"), sorted(sent)[:4]
        worker.apply_weights(published.manifest)
        engine_weights = dict(worker.engine.model.named_parameters())
        for name, want in lora_adapters.merged_weights(trainer.backend.model).items():
            assert torch.equal(engine_weights[name], want), name  # the same merge, bit for bit
        _, batch, recomputed, gaps = _sampled_after_the_update(worker, trainer)
        assert len(gaps) > 50 and max(gaps) <= 1e-5, max(gaps)
        with lora_adapters.disabled(trainer.backend.model):
            base = trainer.logprobs(batch)
        assert (
            max(abs(a - b) for a, b in zip(base, recomputed, strict=True)) > 1e-3
        )  # the update moved the policy
    finally:
        trainer.close()


def test_adapters_reach_a_bfloat16_engine_rounded(tiny_dir):
    """``[rollout.engine] dtype = "bfloat16"`` with adapter-only updates: every adapted engine
    weight is within one bfloat16 step of the trainer's merged float32 weight (half a step for the
    base's rounding, half for the result's), every other weight is its base rounded, the engine
    samples at the new version, and its logprobs stay within bfloat16's mismatch."""
    from test_first_step import _rollout

    from loong_train.algo.losses import pack_batch
    from loong_train.config import load_recipe
    from loong_train.controller import trainer_options
    from loong_train.engines.config import EmbeddedEngineConfig
    from loong_train.workers.trainer import TrainerWorker
    from loong_transfermesh import TransportConfig

    transport = TransportConfig(name="lora-engine-test-bfloat16")
    recipe = load_recipe("tiny-calc-agent", ["train.lora.rank=4", "train.lr=0.05"])
    engine = EmbeddedEngineConfig(dtype="bfloat16")
    worker, trajs = _rollout(tiny_dir, groups=2, transport=transport, lora=recipe.train.lora, engine=engine)
    trainer = TrainerWorker(str(tiny_dir), transport=transport, **trainer_options(recipe))
    try:
        advantages = [1.0 - i % 2 * 2 for i in range(len(trajs))]
        published = trainer.publish(trainer.train_step(pack_batch(trajs, advantages, policy_version=0)))
        assert 1e-7 < published.step.metrics["mismatch_kl"] < 1e-2
        assert all(".lora_" in t.name for t in published.manifest.tensors)
        worker.apply_weights(published.manifest)
        engine_weights = dict(worker.engine.model.named_parameters())
        base = dict(CausalLM.from_pretrained(tiny_dir).named_parameters())
        merged = lora_adapters.merged_weights(trainer.backend.model)
        adapted = {t.name.rsplit(".lora_", 1)[0] + ".weight" for t in published.manifest.tensors}
        assert adapted and adapted <= merged.keys()
        moved = 0
        for name, want in merged.items():
            got, rounded = engine_weights[name], base[name].to(torch.bfloat16)
            assert got.dtype == torch.bfloat16, name
            if name not in adapted:
                assert torch.equal(got, rounded), name
                continue
            step = 2.0**-7 * torch.maximum(base[name].abs(), want.abs())  # a bfloat16 step at either value
            assert ((got.float() - want).abs() <= step).all(), name
            moved += not torch.equal(got, rounded)
        assert moved == len(adapted)  # every adapted weight reached the engine
        after, _, _, gaps = _sampled_after_the_update(worker, trainer)
        assert {t.oldest_version for t in after} == {1}
        assert len(gaps) > 50 and 1e-4 < max(gaps) < 0.5, max(gaps)
    finally:
        trainer.close()


@pytest.mark.integration
def test_adapters_reach_an_sglang_server_through_its_lora_api(tiny_dir, tmp_path):
    """``[rollout.engine] type = "sglang"`` with adapter-only updates, on the CPU stand-in server
    (``launcher = "loong"``): the worker holds no model, loads each version's adapter into its
    server (``/load_lora_adapter_from_tensors``) and sends requests to it; the served adapter's
    logprobs equal the trainer's, tokens carry the adapter's version, the previous adapter is
    unloaded, a relaunched server gets the current adapter again, and a worker resumed from a
    checkpoint serves the checkpoint's adapter at its version."""
    import contextlib
    import os
    import signal

    import httpx
    from test_first_step import _rollout
    from train_testkit import server_port, wait_relaunched

    from loong_train.algo.losses import pack_batch
    from loong_train.config import load_recipe
    from loong_train.controller import trainer_options
    from loong_train.engines.config import SGLangEngineConfig
    from loong_train.workers.rollout import RolloutWorker
    from loong_train.workers.trainer import TrainerWorker
    from loong_transfermesh import TransportConfig

    transport = TransportConfig(name=f"lora-sglang-{os.getpid()}")
    recipe = load_recipe("tiny-calc-agent", ["train.lora.rank=4", "train.lr=0.05"])
    engine = SGLangEngineConfig(launcher="loong", port_base=server_port(2), health_interval_s=0.3)
    worker, trajs = _rollout(
        tiny_dir, groups=2, transport=transport, lora=recipe.train.lora, engine=engine, log_dir=str(tmp_path)
    )
    trainer = TrainerWorker(str(tiny_dir), transport=transport, **trainer_options(recipe))
    url, supervisor = worker.engine.supervisor.url, worker.engine.supervisor
    try:
        assert worker.engine.model is None and all(".lora_" in n for n in worker.engine.adapter)
        advantages = [1.0 - i % 2 * 2 for i in range(len(trajs))]
        published = trainer.publish(trainer.train_step(pack_batch(trajs, advantages, policy_version=0)))
        assert published.step.metrics["mismatch_kl"] <= 1e-9
        worker.apply_weights(published.manifest)
        after, batch, recomputed, gaps = _sampled_after_the_update(worker, trainer)
        assert {t.oldest_version for t in after} == {1}
        assert len(gaps) > 50 and max(gaps) <= 1e-5, max(gaps)
        with lora_adapters.disabled(trainer.backend.model):
            base = trainer.logprobs(batch)
        assert max(abs(a - b) for a, b in zip(base, recomputed, strict=True)) > 1e-3  # the adapter counts

        trainer.backend.save_state(tmp_path / "ckpt")  # a resumed worker loads the checkpoint's adapter
        resumed = RolloutWorker(
            str(tiny_dir), seed=1, sampling={"temperature": 1.0, "max_new_tokens": 24},
            limits={"max_turns": 2, "max_model_tokens": 40}, transport=transport, version=1,
            engine=msgspec.structs.replace(engine, port_base=server_port(2)), lora=recipe.train.lora,
            adapter=str(tmp_path / "ckpt" / "adapter"), log_dir=str(tmp_path / "resumed"),
        )  # fmt: skip
        try:
            after, _, _, gaps = _sampled_after_the_update(resumed, trainer)
            assert {t.oldest_version for t in after} == {1} and max(gaps) <= 1e-5, max(gaps)
        finally:
            resumed.close()

        def serves(adapter: str) -> httpx.Response | None:
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}, "lora_path": adapter}
            with contextlib.suppress(httpx.HTTPError):
                return httpx.post(f"{url}/generate", json=body)
            return None

        os.kill(supervisor.pid, signal.SIGKILL)  # the relaunched server serves no adapter ...
        wait_relaunched(
            supervisor, lambda: getattr(serves("loong-v1"), "status_code", 0) == 200, "with the adapter"
        )
        after, _, _, gaps = _sampled_after_the_update(worker, trainer)  # ... until it is loaded again
        assert {t.oldest_version for t in after} == {1} and max(gaps) <= 1e-5, max(gaps)

        advantages = [1.0 - i % 2 * 2 for i in range(len(after))]
        worker.apply_weights(trainer.publish(trainer.train_step(pack_batch(after, advantages, 1))).manifest)
        assert serves("loong-v2").status_code == 200
        old = serves("loong-v1")
        assert old.status_code == 400 and "no LoRA adapter named 'loong-v1'" in old.json()["message"]
        after, _, _, gaps = _sampled_after_the_update(worker, trainer)
        assert {t.oldest_version for t in after} == {2} and max(gaps) <= 1e-5, max(gaps)
    finally:
        trainer.close()
        worker.close()


@pytest.mark.parametrize("family", ["qwen3", *GENERIC])
def test_a_target_module_the_checkpoint_lacks_is_refused_before_the_run(tmp_path, family):
    """Read from the checkpoint's skeleton (no weights, no Ray): the error names the module and
    the linear layers the model has, for Loong's decoder and the generic path alike."""
    from loong_train.config import ConfigError, load_recipe
    from loong_train.controller import _check_model
    from loong_train.tiny.tokenizer import build_tokenizer

    if family == "qwen3":
        tiny_qwen3(0, vocab_size=256).save_pretrained(tmp_path)
    else:
        tiny_hf_checkpoint(tmp_path, family, vocab_size=256)
    build_tokenizer(tmp_path)
    recipe = load_recipe("tiny-calc-agent", ["train.lora.rank=4", 'train.lora.target_modules=["qkv"]'])
    with pytest.raises(
        ConfigError, match=r"target_modules names \['qkv'\], which no linear layer .* linear layers: \["
    ):
        _check_model(recipe, str(tmp_path))
    _check_model(load_recipe("tiny-calc-agent", ["train.lora.rank=4"]), str(tmp_path))  # all-linear: fine


@pytest.mark.parametrize("family", GENERIC)
def test_the_generic_path_exports_an_adapter_peft_loads(tmp_path, family):
    """A model only ``transformers`` implements (GPT-2's Conv1D layers, Phi's Linear ones): the
    adapter ``peft`` loads and an adapter-only update merged into the base both give the trained
    model's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tiny_hf_checkpoint(tmp_path / "base", family, std=0.02, vocab_size=VOCAB)
    backend = _trained(tmp_path / "base")
    backend.save_pretrained(tmp_path / "final")
    ids = _ids()
    with torch.no_grad():
        ours = backend.model.eval()(ids)
        hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
        theirs = PeftModel.from_pretrained(hf, str(tmp_path / "final")).eval()(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32).eval()
        untouched = plain(ids).logits
        modules, transposed = adapted_modules(plain, LORA.target_modules)  # GPT-2's Conv1D: [in, out]
        engine = LoraMerge(dict(plain.named_parameters()), modules, LORA.rank, LORA.scale, transposed)
        engine.load(backend.named_weights())  # an adapter-only update, merged as an engine does
        merged = plain(ids).logits
    assert (ours - untouched).abs().max() > 1e-4
    assert torch.allclose(theirs, ours, atol=1e-5), (theirs - ours).abs().max()
    assert torch.allclose(merged, ours, atol=1e-5), (merged - ours).abs().max()
