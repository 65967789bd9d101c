"""The Megatron backend against the torch backend, from the same Hugging Face weights.

Unit: the HF -> megatron shard conversion round-trips through ``megatron_to_hf`` (TP 1/2,
pipeline stages, tied and untied embeddings, a vocabulary that needs padding).

Integration: TP=1 (one micro-batch), TP=2 (untied embeddings, padded vocabulary, 2 micro-batches),
PP=2 (tied embeddings split over stages; decoupled PPO with TIS and a KL reference; 3
micro-batches through 1F1B) and DP=2 load a random-init tiny Qwen3, and TP=2 a tiny Qwen2 (q/k/v
biases) and a tiny Llama (no QK-norm, llama3 rope scaling); each must match the torch
backend in fp32, each within a relative difference of 1e-5: token logprobs, the loss, gradient
norm and (clipped) gradients of one optimizer step, the logprobs and loss after it; the exported
HF weights equal the checkpoint exactly, and the updated weights agree to a tenth of the
learning rate (see the test for why not tighter). Two worker processes (gloo, one torch thread
each; this file is the worker script) run them all, importing megatron-core once.

Measured (CPU fp32): logprobs <= 2.6e-7; loss <= 7.7e-7; gradients <= 2.3e-6; logprobs and loss
after the step <= 1.9e-6 and 4.5e-6; max |w - w_torch| after it <= 5.2e-5 (lr 2e-3).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loong_core.records import TrainBatch
from loong_train.algo.config import LossConfig
from loong_train.backends.megatron.weights import hf_to_megatron
from loong_train.backends.torch_backend import TorchBackend
from loong_train.models.decoder import CausalLM, DecoderConfig
from loong_transfermesh import MegatronLayout, megatron_to_hf

VOCAB = 37  # odd: TP=2 pads the vocabulary by one row
LR = 2e-3
LOSSES = {
    "default": {},
    "decoupled+kl": {"decoupled": True, "tis_cap": 2.0, "kl_coef": 0.1, "clip_eps": 0.1},
}


FAMILIES = {  # what differs from Qwen3 (QK-norm, no biases)
    "qwen3": {},
    "qwen2": {"model_type": "qwen2", "attention_bias": True},  # q/k/v biases, no QK-norm
    "llama": {  # no QK-norm, no biases, llama3 rope scaling with megatron-core's fixed factors
        "model_type": "llama",
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    },
}  # fmt: skip


def _model(tied: bool, layers: int = 2, family: str = "qwen3") -> CausalLM:
    cfg = DecoderConfig(
        **FAMILIES[family],
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=tied,
    )
    model = CausalLM(cfg)
    model.init_weights(seed=1, std=0.2)  # large enough for far-from-uniform logprobs
    return model


def _batch() -> TrainBatch:
    gen = torch.Generator().manual_seed(0)
    lens = [9, 6, 4]
    n = sum(lens)
    mask = [0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 1]
    adv = [a * m for a, m in zip([0.8] * 9 + [-1.1] * 6 + [0.3] * 4, mask, strict=True)]
    behaviour = (torch.randn(n, generator=gen) * 0.5 - 3.6).tolist()
    return TrainBatch(
        token_ids=torch.randint(0, VOCAB, (n,), generator=gen).tolist(),
        loss_mask=mask,
        advantages=adv,
        behaviour_logprobs=[b * m for b, m in zip(behaviour, mask, strict=True)],
        versions=[0 if m else -1 for m in mask],
        row_lens=lens,
        sample_ids=["a", "b", "c"],
        policy_version=0,
    )


# -- unit: the weight conversion ---------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("tied", [True, False])
def test_hf_to_megatron_round_trips_through_megatron_to_hf(tp, pp, tied, family):
    model = _model(tied, layers=4, family=family)
    hf = model.hf_state_dict()
    layout = MegatronLayout.from_hf_config(model.config.to_hf(), tp=tp)
    padded, per_stage, back = 38 if tp == 2 else 37, 4 // pp, {}
    for stage in range(pp):
        shards = [
            hf_to_megatron(
                hf,
                layout,
                tp_rank=r,
                first_layer=stage * per_stage,
                num_layers=per_stage,
                pre_process=stage == 0,
                post_process=stage == pp - 1,
                padded_vocab=padded,
            )
            for r in range(tp)
        ]
        assert {s["decoder.layers.0.self_attention.linear_qkv.weight"].shape[0] for s in shards} == {
            (4 // 2 + 2) * 16 * 2 // tp
        }
        back |= dict(megatron_to_hf(shards, layout, layer_offset=stage * per_stage))
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


# -- integration: megatron processes vs the torch backend ------------------------------------

CONFIGS = {  # name: (tp, pp, dp, tied embeddings, loss, micro-batch rows, family); two-rank ones first
    "tp2": (2, 1, 1, False, "default", 2, "qwen3"),  # 3 rows -> 2 micro-batches, the second padded
    "pp2": (1, 2, 1, True, "decoupled+kl", 1, "qwen3"),  # 3 micro-batches through the 1F1B schedule
    "dp2": (1, 1, 2, False, "default", 1, "qwen3"),  # rows 0-1 on rank 0, row 2 and a pad row on rank 1
    "tp2-qwen2": (2, 1, 1, False, "default", 2, "qwen2"),  # q/k/v biases split with their rows
    "tp2-llama": (2, 1, 1, True, "default", 0, "llama"),  # no QK-norm; llama3 rope scaling
    "tp1": (1, 1, 1, True, "default", 0, "qwen3"),  # the whole batch as one micro-batch
}


def _world(name: str) -> int:
    tp, pp, dp, *_ = CONFIGS[name]
    return tp * pp * dp


def _torch_reference(model: CausalLM, loss: str) -> dict:
    backend = TorchBackend(model, lr=LR, loss=LossConfig(**LOSSES[loss]), temperature=0.9)
    batch = _batch()
    before = backend.logprobs(batch)
    metrics = backend.train_step(batch)
    out = {
        "before": before,
        "metrics": metrics,
        "after": backend.logprobs(batch),
        "weights": {k: v.clone() for k, v in model.hf_state_dict().items()},
        "grads": {k: p.grad.clone() for k, p in model.named_parameters()},
    }
    out["second_loss"] = backend.train_step(batch)["loss"]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(root: Path, names: list[str], device: str) -> dict:
    """Run ``names`` (two-rank configurations first) in worker processes; their results."""
    for name in names:
        _model(CONFIGS[name][3], family=CONFIGS[name][6]).save_pretrained(root / name)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    world, port = max(_world(n) for n in names), _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, json.dumps([rank, world, port, str(root), names, device])],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n\n".join(logs)
    return {name: torch.load(root / name / "result.pt", map_location="cpu") for name in names}


@pytest.fixture(scope="module")
def megatron_runs(tmp_path_factory) -> tuple[Path, dict]:
    """Every configuration, run by two CPU worker processes (importing megatron-core dominates)."""
    root = tmp_path_factory.mktemp("megatron")
    return root, _launch(root, list(CONFIGS), "cpu")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.integration
@pytest.mark.parametrize("name", list(CONFIGS))
def test_megatron_matches_torch_backend(name, megatron_runs):
    root, runs = megatron_runs
    _check(name, runs[name], root)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_megatron_on_gpu_matches_torch_backend_on_cpu(tmp_path):
    """The same comparison with megatron-core on CUDA (NCCL, compatibility layer inactive):
    every configuration the visible GPUs allow, against the CPU torch backend."""
    names = [n for n in CONFIGS if _world(n) <= torch.cuda.device_count()]
    for name, meg in _launch(tmp_path, names, "cuda").items():
        _check(name, meg, tmp_path)


def _check(name: str, meg: dict, root: Path) -> None:
    model = CausalLM.from_pretrained(root / name)
    initial = {k: v.clone() for k, v in model.hf_state_dict().items()}
    ref = _torch_reference(model, CONFIGS[name][4])

    assert meg["initial"].keys() == initial.keys()
    assert all(torch.equal(meg["initial"][k], v) for k, v in initial.items())  # export is exact
    m, r = meg["metrics"], ref["metrics"]
    gaps = {
        "logprobs": _rel(meg["before"], ref["before"]),
        "loss": abs(m["loss"] - r["loss"]) / abs(r["loss"]),
        "grad_norm": abs(m["grad_norm"] - r["grad_norm"]) / r["grad_norm"],
        "grads": max(_rel(meg["grads"][k], v) for k, v in ref["grads"].items()),
        "logprobs_after": _rel(meg["after"], ref["after"]),
        "loss_after": abs(meg["second_loss"] - ref["second_loss"]) / abs(ref["second_loss"]),
    }
    weight_gap = max(float((meg["weights"][k] - v).abs().max()) for k, v in ref["weights"].items())
    print(
        f"{name}: relative gaps to the torch backend {gaps}, max |w - w_torch| after the step {weight_gap:.1e}"
    )
    assert max(gaps.values()) <= 1e-5, gaps
    # Adam's first step moves each weight by lr * g / (|g| + eps): where |g| is near eps = 1e-8
    # and the sum behind g cancels, fp32 rounding noise in g (~1e-7 of its terms) shows up as a
    # visible part of lr, so updated weights are compared against the step size instead.
    assert weight_gap <= 0.1 * LR
    assert r["grad_norm"] > 1.0  # the clip was active, so it is compared too
    for key in ("clip_frac", "mismatch_kl", "is_weight_mean"):
        assert m[key] == pytest.approx(r[key], rel=1e-5, abs=1e-7), key
    assert (meg["after"] - meg["before"]).abs().max() > 1e-3  # the step moved the model


# -- the trainer's ``train.backend = "megatron"`` ------------------------------------------------


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
    with pytest.raises(ConfigError, match=r"missing required config key 'train\.backend\.type'"):
        load_recipe("tiny-calc-agent", ["train.backend.tp=2"])
    monkeypatch.setattr(config, "_have_megatron_core", lambda: False)
    recipe = load_recipe("tiny-calc-agent", ["train.backend.type=megatron"])  # validates without it
    with pytest.raises(ConfigError, match=r"loong-train\[megatron\]"):
        config.require_installed(recipe.train.backend)  # what the build and the preflight call


@pytest.mark.slow
@pytest.mark.integration
def test_trainer_worker_drives_a_two_rank_megatron_backend(tmp_path):
    """TrainerWorker with ``train.backend = "megatron"``, tp = 2: the calling process is rank 0
    and one spawned follower mirrors it; logprobs, the step's loss and the published weights
    match the torch backend (the CPU comparison above, through the trainer)."""
    from loong_train.config import load_recipe
    from loong_train.controller import trainer_options
    from loong_train.workers.trainer import TrainerWorker
    from loong_transfermesh import TransportConfig

    model = _model(tied=False)
    model.save_pretrained(tmp_path)
    sets = ["train.backend.type=megatron", "train.backend.tp=2", "train.warmup_steps=0", f"train.lr={LR}"]
    recipe = load_recipe("tiny-calc-agent", [*sets, "rollout.temperature=0.9"])
    trainer = TrainerWorker(
        str(tmp_path), transport=TransportConfig(name="megatron-trainer-test"), **trainer_options(recipe)
    )
    try:
        batch = _batch()
        lp = torch.tensor(trainer.logprobs(batch))
        metrics = trainer.train_step(batch)
        weights = _cloned(trainer.backend.named_weights())
    finally:
        trainer.close()
    torch_backend = TorchBackend(model, lr=LR, loss=recipe.loss, temperature=0.9)
    ref_lp = torch_backend.logprobs(batch)
    ref_lp = torch.cat([ref_lp[i, :n] for i, n in enumerate(batch.row_lens)])
    assert _rel(lp, ref_lp) <= 1e-5
    assert metrics["loss"] == pytest.approx(torch_backend.train_step(batch)["loss"], rel=1e-5)
    assert max(float((weights[k] - v).abs().max()) for k, v in model.hf_state_dict().items()) <= 0.1 * LR


def _cloned(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in weights.items()}  # named_weights() may alias the parameters


def _one_run(rank: int, tp: int, pp: int, loss: str, rows: int, out: Path) -> None:
    from loong_train.backends.megatron.backend import MegatronBackend
    from loong_train.backends.megatron.driver import init_model_parallel

    init_model_parallel(tp, pp, seed=0)
    backend = MegatronBackend.from_pretrained(
        out, lr=LR, loss=LossConfig(**LOSSES[loss]), temperature=0.9, micro_batch_rows=rows
    )
    batch = _batch()
    result = {"initial": _cloned(backend.named_weights()), "before": backend.logprobs(batch)}
    result["metrics"] = backend.train_step(batch)
    result["weights"] = _cloned(backend.named_weights())
    params = list(backend.model.parameters())
    values = [p.data for p in params]
    for p in params:  # export the (clipped) gradients through the same gather + HF conversion
        p.data = p.grad
    result["grads"] = _cloned(backend.named_weights())
    for p, v in zip(params, values, strict=True):
        p.data = v
    result["after"] = backend.logprobs(batch)
    result["second_loss"] = backend.train_step(batch)["loss"]
    if rank == 0:
        torch.save(result, out / "result.pt")


def _worker(rank: int, world: int, port: int, root: str, names: list[str], device: str) -> None:
    """All ranks run the configurations that use the whole world; then the ranks a smaller
    configuration needs (here rank 0 for TP=1) run it in a fresh world."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    for name in names:
        tp, pp, _, _, loss, rows, _ = CONFIGS[name]
        if _world(name) != world:
            dist.destroy_process_group()
            if rank >= _world(name):
                return
            world, port = _world(name), _free_port()
        if not dist.is_initialized():
            backend = "nccl" if device == "cuda" else "gloo"
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
            )
        _one_run(rank, tp, pp, loss, rows, Path(root) / name)
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(*json.loads(sys.argv[1]))


@pytest.mark.slow
@pytest.mark.integration
def test_megatron_checkpoint_resumes_the_next_step_exactly(tmp_path):
    """A two-rank Megatron trainer checkpointed after one step, then resumed in a fresh trainer,
    takes the same second step as one that never stopped: same learning rate (the warmup
    schedule), loss and bit-identical weights (Adam's moments came back on every rank)."""
    from loong_train.config import load_recipe
    from loong_train.controller import trainer_options
    from loong_train.workers.trainer import TrainerWorker
    from loong_transfermesh import TransportConfig

    _model(tied=False).save_pretrained(tmp_path / "init")
    sets = ["train.backend.type=megatron", "train.backend.tp=2", "train.warmup_steps=3", f"train.lr={LR}"]
    recipe = load_recipe("tiny-calc-agent", sets)
    batch, ckpt = _batch(), str(tmp_path / "ckpt")

    def trainer(name: str) -> TrainerWorker:
        return TrainerWorker(
            str(tmp_path / "init"), transport=TransportConfig(name=name), **trainer_options(recipe)
        )

    first = trainer("megatron-ckpt-a")
    try:
        first.train_step(batch)
        first.save_checkpoint(ckpt)
        want = first.train_step(batch)
        want_weights = _cloned(first.backend.named_weights())
    finally:
        first.close()
    resumed = trainer("megatron-ckpt-b")
    try:
        resumed.load_checkpoint(ckpt)
        got = resumed.train_step(batch)
        got_weights = _cloned(resumed.backend.named_weights())
    finally:
        resumed.close()
    assert (got["lr"], got["loss"]) == (want["lr"], want["loss"])
    assert sorted(got_weights) == sorted(want_weights)
    assert all(torch.equal(got_weights[k], want_weights[k]) for k in want_weights)
