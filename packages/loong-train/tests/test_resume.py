"""Checkpoint and ``--resume``: a run split in two equals the uninterrupted run, and the window
bound holds across the resume. Real runs (Ray, trainer, engines, shm weight sync) of a tiny recipe;
one Ray cluster serves every run of this module.

An untrained tiny model never earns a reward, so GRPO advantages are 0; a k1 KL penalty to the
initial model (its gradient is that of the sampled tokens' logprobs, not 0 at the start) makes
every step move the weights by an amount that depends on what was sampled, so a resumed run that
sampled or trained anything differently would show it."""

import json
import logging
import shutil

import pytest
import ray
from safetensors.torch import load_file

from loong_core.config import ConfigError
from loong_core.telemetry import read_metrics
from loong_train.config import load_recipe
from loong_train.controller import run
from loong_train.run import checkpoint

SMALL = [
    "warmstart.steps=0",
    "train.batch_groups=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=12",
    "rollout.max_model_tokens=24",
    "eval.every=2",
    "eval.num_tasks=4",
    "train.checkpoint_every=2",
    "loss.kl_coef=0.5",
    "loss.kl_estimator=k1",
]
COMPARED = [  # every metric that is not a timing
    "reward_mean",
    "loss",
    "grad_norm",
    "lr",
    "pg_loss",
    "clip_frac",
    "mismatch_kl",
    "onpolicy_mismatch_kl",
    "mismatch_abs_logp",
    "staleness_mean",
    "staleness_max",
    "samples",
    "response_tokens_mean",
    "kl",
    "kl_loss",
]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=3, include_dashboard=False, logging_level=logging.WARNING)
    yield
    ray.shutdown()


def _recipe(*overrides):
    return load_recipe("tiny-calc-agent", [*SMALL, *overrides])


def _ledger(out):
    return [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]


def _assert_same_run(a, b, full, split):
    """Metrics ``a`` and ``b`` (every non-timing key), ledgers and final weights of two runs agree."""
    for ra, rb in zip(a, b, strict=True):
        for key in COMPARED:
            assert ra[key] == pytest.approx(rb[key], abs=1e-6), (ra["step"], key)
    assert _ledger(full) == _ledger(split)
    wa = load_file(full / "checkpoints" / "final" / "model.safetensors")
    wb = load_file(split / "checkpoints" / "final" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa)


@pytest.mark.integration
def test_resumed_run_equals_the_uninterrupted_run(tmp_path, cluster):
    cache = tmp_path / "cache"
    full = run(_recipe("train.max_staleness=0", "train.steps=4"), tmp_path / "full", cache)
    split = run(_recipe("train.max_staleness=0", "train.steps=2"), tmp_path / "split", cache)
    assert (split / "checkpoints" / "step_2" / "trainer_state.pt").exists()
    (split / "metrics.jsonl").open("a").write('{"step": 3, "reward_mean": 9.0}\n')  # died after it
    run(_recipe("train.max_staleness=0", "train.steps=4"), split, cache, resume=True)

    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(split / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert all(r["grad_norm"] > 0 for r in a) and a[-1]["kl"] != 0  # the weights moved
    _assert_same_run(a, b, full, split)
    evals = [json.loads((d / "summary.json").read_text())["eval_reward_by_version"] for d in (full, split)]
    assert evals[0] == evals[1] and set(evals[0]) == {"0", "2", "4"}
    assert sorted(p.name for p in (split / "checkpoints").iterdir()) == ["final", "step_2", "step_4"]


@pytest.mark.integration
def test_resume_keeps_the_staleness_bound(tmp_path, cluster):
    """Window 1, resumed from step 2 of a run that went on to step 4 and then lost its later
    checkpoints: the groups in flight or buffered at step 2 are trained once, within the bound."""
    cache, out = tmp_path / "cache", tmp_path / "run"
    run(_recipe("train.max_staleness=1", "train.steps=4"), out, cache)
    for late in ("step_4", "final"):
        shutil.rmtree(out / "checkpoints" / late)
    state = checkpoint.latest(out, _recipe("train.max_staleness=1", "train.steps=5")).state
    assert state.version == 2 and state.window["in_flight"] | state.window["buffered"]
    run(_recipe("train.max_staleness=1", "train.steps=5"), out, cache, resume=True)
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["staleness_max"] <= 1 for r in rows)
    ledger = _ledger(out)
    assert [e["step"] for e in ledger] == [1, 2, 3, 4, 5]
    groups = [g for e in ledger for g in e["groups"]]
    assert len(groups) == len(set(groups)) == 5 * 2  # no group trained twice across the resume
    assert set(state.window["in_flight"]) | set(state.window["buffered"]) <= set(groups[4:])

    # a crash while writing leaves a temporary directory (or one without its state): not a checkpoint
    (out / "checkpoints" / ".step_9.tmp").mkdir()
    (out / "checkpoints" / "step_8").mkdir()
    assert checkpoint.latest(out, _recipe("train.max_staleness=1", "train.steps=9")).version == 5
    with pytest.raises(ConfigError, match=r"train\.batch_groups"):
        checkpoint.latest(out, _recipe("train.max_staleness=1", "train.steps=9", "train.batch_groups=3"))
    with pytest.raises(ConfigError, match="nothing to train"):
        checkpoint.latest(out, _recipe("train.max_staleness=1", "train.steps=5"))


@pytest.mark.slow
@pytest.mark.integration
def test_megatron_run_resumes_like_the_uninterrupted_one(tmp_path, cluster):
    """``--resume`` with ``train.backend = "megatron"`` (one rank, gloo on CPU): 2 steps, then a
    resume to 3, equal the uninterrupted 3-step run (metrics, ledger, final weights)."""
    cache, megatron = tmp_path / "cache", ["train.backend.type=megatron", "train.max_staleness=0"]
    full = run(_recipe(*megatron, "train.steps=3"), tmp_path / "full", cache)
    split = run(_recipe(*megatron, "train.steps=2"), tmp_path / "split", cache)
    assert (split / "checkpoints" / "step_2" / "optimizer.tp0.pp0.pt").exists()
    run(_recipe(*megatron, "train.steps=3"), split, cache, resume=True)
    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(split / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3]
    _assert_same_run(a, b, full, split)
