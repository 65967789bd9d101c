"""The FSDP2 backend on a gloo world of 2 and 4 CPU ranks against the one-process torch backend:
the same metrics and weights after two steps (float64, so only summation order differs), and a
checkpoint that resumes the run exactly."""

import pytest
import torch
from fsdp_testkit import run_ranks
from test_packing import _batch, _grouped_batch, _model

from loong_train.algo.config import LossConfig
from loong_train.backends.torch_backend import TorchBackend

pytestmark = pytest.mark.integration  # the ranks are spawned processes

CFG = LossConfig(entropy_coef=0.05)
KL = LossConfig(kl_coef=0.1)  # the reference model sharded too


def _one_process(batches, cfg, budget):
    backend = TorchBackend(_model().double(), lr=1e-2, loss=cfg, max_tokens_per_micro_batch=budget)
    metrics = [backend.train_step(b) for b in batches]
    return {"metrics": metrics, "weights": backend.named_weights(), "logprobs": backend.logprobs(batches[0])}


@pytest.mark.parametrize(
    ("world", "budget", "cfg"),
    [(2, 0, CFG), (4, 20, CFG), (2, 20, KL)],
    ids=["2-ranks", "4-ranks-micro-batches", "2-ranks-kl"],
)
def test_steps_equal_the_torch_backend(world, budget, cfg):
    """``budget``: tokens per micro-batch (0: a rank's share at once). With 4 ranks some have
    fewer micro-batches than others, and on the second batch (3 rows) one has no rows at all:
    they repeat a micro-batch without a gradient."""
    batches = [_grouped_batch(0), _batch(lens=(20, 3, 3) if world > 3 else (9, 4, 12, 1, 7), seed=1)]
    want = _one_process(batches, cfg, budget)
    got = run_ranks(world, "steps_float64", batches, cfg, budget)
    for g, w in zip(got["metrics"], want["metrics"], strict=True):
        assert set(g) == set(w)
        for k in w:
            assert g[k] == pytest.approx(w[k], rel=1e-9, abs=1e-12), k
    assert set(got["weights"]) == set(want["weights"])
    for name, w in want["weights"].items():
        assert torch.allclose(got["weights"][name], w, rtol=0, atol=1e-12), name
    assert torch.allclose(got["logprobs"], want["logprobs"], atol=1e-12)
    assert want["metrics"][1]["grad_norm"] > 0.1  # the steps moved the weights


def test_a_checkpoint_resumes_the_run(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path / "base")
    out = run_ranks(2, "save_and_resume", str(tmp_path / "base"), [_grouped_batch(0), _batch(seed=1)], CFG)
    for k, w in out["uninterrupted"].items():
        assert out["resumed"][k] == pytest.approx(w, rel=1e-5, abs=1e-7), k
    for name, w in out["want_weights"].items():
        assert torch.equal(out["weights"][name], w), name
    assert (tmp_path / "state" / "optimizer.pt").exists()
    assert (tmp_path / "state" / "model.safetensors").exists()


def test_rows_split_into_contiguous_shares_of_about_equal_tokens():
    from loong_train.backends.fsdp import split_rows

    assert split_rows([4] * 4, [4] * 4, 2) == [range(0, 2), range(2, 4)]
    # 13 tokens over 4 ranks: the long row alone, the short ones together, two ranks idle
    assert split_rows([10, 1, 1, 1], [10, 1, 1, 1], 4) == [range(0, 0), range(0, 1), range(1, 1), range(1, 4)]
    # rows sharing a prefix count what they compute
    assert split_rows([8, 8, 8, 8], [8, 1, 8, 1], 2) == [range(0, 2), range(2, 4)]
