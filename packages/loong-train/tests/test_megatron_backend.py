"""The Megatron backend against the torch backend, from the same Hugging Face weights.

TP=1 (one micro-batch), TP=2 (untied embeddings, padded vocabulary, 2 micro-batches),
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
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron_testkit import LR, cloned, rel_gap, tiny_batch, tiny_model

from loong_core.net import free_port
from loong_train.algo.config import LossConfig
from loong_train.backends.torch_backend import TorchBackend
from loong_train.models.decoder import CausalLM

LOSSES = {
    "default": {},
    "decoupled+kl": {"decoupled": True, "tis_cap": 2.0, "kl_coef": 0.1, "clip_eps": 0.1},
}


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
    batch = tiny_batch()
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


def _launch(root: Path, names: list[str], device: str) -> dict:
    """Run ``names`` (two-rank configurations first) in worker processes; their results."""
    for name in names:
        tiny_model(CONFIGS[name][3], family=CONFIGS[name][6]).save_pretrained(root / name)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    world, port = max(_world(n) for n in names), free_port()
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
    lens = torch.tensor(tiny_batch().row_lens)
    valid = torch.arange(ref["before"].shape[1]) < lens[:, None]  # padding's logprobs are no one's
    gaps = {
        "logprobs": rel_gap(meg["before"][valid], ref["before"][valid]),
        "loss": abs(m["loss"] - r["loss"]) / abs(r["loss"]),
        "grad_norm": abs(m["grad_norm"] - r["grad_norm"]) / r["grad_norm"],
        "grads": max(rel_gap(meg["grads"][k], v) for k, v in ref["grads"].items()),
        "logprobs_after": rel_gap(meg["after"][valid], ref["after"][valid]),
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


def _one_run(rank: int, tp: int, pp: int, loss: str, rows: int, out: Path) -> None:
    from loong_train.backends.megatron.backend import MegatronBackend
    from loong_train.backends.megatron.driver import init_model_parallel

    init_model_parallel(tp, pp, seed=0)
    backend = MegatronBackend.from_pretrained(
        out, lr=LR, loss=LossConfig(**LOSSES[loss]), temperature=0.9, micro_batch_rows=rows
    )
    batch = tiny_batch()
    result = {"initial": cloned(backend.named_weights()), "before": backend.logprobs(batch)}
    result["metrics"] = backend.train_step(batch)
    result["weights"] = cloned(backend.named_weights())
    params = list(backend.model.parameters())
    values = [p.data for p in params]
    for p in params:  # export the (clipped) gradients through the same gather + HF conversion
        p.data = p.grad
    result["grads"] = cloned(backend.named_weights())
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
            world, port = _world(name), free_port()
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
