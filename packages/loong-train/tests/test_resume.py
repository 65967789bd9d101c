"""Checkpoint and ``--resume``: a run split in two equals the uninterrupted run, and the window
bound holds across the resume. Real runs (Ray, trainer, engines, shm weight sync) of a tiny recipe;
one Ray cluster serves every run of this module.

The runs are ``train_testkit.SMALL_RUN``: every step moves the weights by what it sampled, so a
resumed run that sampled or trained anything differently would show it."""

import json
import logging
import shutil

import pytest
import ray
from train_testkit import SMALL_RUN, assert_same_run, ledger, write_jsonl

from loong_core.config import ConfigError
from loong_core.telemetry import read_metrics
from loong_train.config import load_recipe
from loong_train.controller import run
from loong_train.run import checkpoint

SMALL = [*SMALL_RUN, "train.checkpoint_every=2"]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=3, include_dashboard=False, logging_level=logging.WARNING)
    yield
    ray.shutdown()


def _recipe(*overrides):
    return load_recipe("tiny-calc-agent", [*SMALL, *overrides])


@pytest.mark.integration
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_resumed_run_equals_the_uninterrupted_run(tmp_path, cluster, lora):
    """With LoRA the checkpoint's adapter and its optimizer state continue (and the KL term's
    reference is the base model with the adapters off)."""
    cache = tmp_path / "cache"
    extra = ["train.lora.rank=4", "train.lr=0.02"] if lora else []
    full = run(_recipe("train.max_staleness=0", "train.steps=4", *extra), tmp_path / "full", cache)
    split = run(_recipe("train.max_staleness=0", "train.steps=2", *extra), tmp_path / "split", cache)
    assert (split / "checkpoints" / "step_2" / "trainer_state.pt").exists()
    assert (split / "checkpoints" / "step_2" / "adapter").exists() == lora
    (split / "metrics.jsonl").open("a").write('{"step": 3, "reward_mean": 9.0}\n')  # died after it
    run(_recipe("train.max_staleness=0", "train.steps=4", *extra), split, cache, resume=True)

    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(split / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert all(r["grad_norm"] > 0 for r in a) and a[-1]["kl"] != 0  # the weights moved
    assert_same_run(a, b, full, split)
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
    window = state.states["scheduler"]["window"]
    assert state.version == 2 and window["in_flight"] | window["buffered"]
    run(_recipe("train.max_staleness=1", "train.steps=5"), out, cache, resume=True)
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["staleness_max"] <= 1 for r in rows)
    entries = ledger(out)
    assert [e["step"] for e in entries] == [1, 2, 3, 4, 5]
    groups = [g for e in entries for g in e["groups"]]
    assert len(groups) == len(set(groups)) == 5 * 2  # no group trained twice across the resume
    assert set(window["in_flight"]) | set(window["buffered"]) <= set(groups[4:])

    # a crash while writing leaves a temporary directory (or one without its state): not a checkpoint
    (out / "checkpoints" / ".step_9.tmp").mkdir()
    (out / "checkpoints" / "step_8").mkdir()
    assert checkpoint.latest(out, _recipe("train.max_staleness=1", "train.steps=9")).version == 5
    with pytest.raises(ConfigError, match=r"train\.batch_groups"):
        checkpoint.latest(out, _recipe("train.max_staleness=1", "train.steps=9", "train.batch_groups=3"))
    with pytest.raises(ConfigError, match="nothing to train"):
        checkpoint.latest(out, _recipe("train.max_staleness=1", "train.steps=5"))


@pytest.mark.integration
def test_a_resumed_run_keeps_the_curriculums_statistics_and_draw(tmp_path, cluster):
    """``[curriculum]`` on five data prompts that an untrained model always fails: each becomes
    hopeless after its first group, and the draw passes over them, takes one by a seeded coin or,
    once it passed over as many as rest, anyway. A run resumed from step 2
    draws what the uninterrupted one draws (same rewards, weights and counts: the statistics and
    the coin's state came back)."""
    rows = [{"prompt": f"what is {i}+1?", "answer": str(i + 1)} for i in range(7)]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    sets = [
        "task=data",
        f"data.train_files=['{data}']",
        "data.eval_fraction=0.25",  # 2 held out, 5 to train on
        "eval.num_tasks=2",
        "curriculum.enabled=true",
        "curriculum.return_prob=0.5",
        "curriculum.failed=0.0",  # hopeless prompts rest too
        "train.max_staleness=0",
    ]
    cache = tmp_path / "cache"
    full = run(_recipe(*sets, "train.steps=5"), tmp_path / "full", cache)
    split = run(_recipe(*sets, "train.steps=2"), tmp_path / "split", cache)
    run(_recipe(*sets, "train.steps=5"), split, cache, resume=True)
    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(split / "metrics.jsonl")
    assert_same_run(a, b, full, split)
    counts = ["prompts_active", "prompts_hopeless", "prompts_skipped", "prompts_returned", "prompts_forced"]
    assert [[r[k] for k in counts] for r in a] == [[r[k] for k in counts] for r in b]
    last = a[-1]
    assert last["prompts_hopeless"] == 5 and last["prompts_active"] == 0
    assert last["prompts_skipped"] > 0 and last["prompts_returned"] > 0 and last["prompts_forced"] > 0
    assert all(r["no_signal_share"] == 1.0 for r in a)  # every group failed: nothing to learn


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
    assert_same_run(a, b, full, split)
