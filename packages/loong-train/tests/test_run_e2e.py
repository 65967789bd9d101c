"""A real end-to-end run: Ray, one rollout worker, one trainer, shm weight sync, run directory."""

import json
import os

import pytest
from train_testkit import tensorboard_scalars, wandb_history

from loong_core.telemetry import read_metrics
from loong_train.config import load_recipe
from loong_train.controller import run
from loong_train.cores import board_path

REQUIRED = [
    "step",
    "policy_version",
    "reward_mean",
    "staleness_mean",
    "staleness_max",
    "mismatch_kl",
    "trainer_busy_frac",
    "rollout_busy_frac",
    "engine_busy_frac",
    "engine_rows_per_step",
    "samples_per_s",
    "weight_sync_s",
]

SMALL = [
    "warmstart.steps=0",
    "train.steps=4",
    "train.batch_groups=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=12",
    "rollout.max_model_tokens=24",
    "eval.every=2",
    "eval.num_tasks=8",
]


@pytest.mark.integration
@pytest.mark.parametrize("window", [0, 1])
def test_short_run_writes_the_run_directory(tmp_path, window):
    # one run is enough for the loggers, and for the trainer borrowing the engine's thread
    extra = ['log.loggers=["tensorboard", "wandb"]', "train.borrow_idle_threads=true"] if window else []
    recipe = load_recipe("tiny-calc-agent", [*SMALL, f"train.max_staleness={window}", *extra])
    out = run(recipe, tmp_path / "run", tmp_path / "cache")
    rows = read_metrics(out / "metrics.jsonl")
    if window:  # its own thread, and at times the resting engine's one; the board is removed
        assert all(1 <= r["trainer_threads_mean"] <= 2 for r in rows)
        assert any(r["trainer_threads_mean"] > 1 for r in rows)
        assert not list(board_path("x").parent.glob(f"loong-{recipe.name}-{os.getpid()}-*.cores"))
    else:
        assert all("trainer_threads_mean" not in r for r in rows)
    if window:  # the same rows, read back with each tool's reader
        expected = [(r["step"], r["reward_mean"]) for r in rows]
        assert [
            (s, pytest.approx(v)) for s, v in tensorboard_scalars(out / "tensorboard")["reward_mean"]
        ] == expected
        assert [(h["_step"], h["reward_mean"]) for h in wandb_history(out)] == expected
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        assert set(REQUIRED) <= set(row), set(REQUIRED) - set(row)
        assert row["staleness_max"] <= window
        assert row["policy_version"] == row["step"]
        # a forward runs only inside a call; a decode step holds 1 to all admitted rows
        assert 0 < row["engine_busy_frac"] <= row["rollout_busy_frac"] <= 1
        assert 1 <= row["engine_rows_per_step"] <= 4 * 2 * 2
    assert all(r["no_signal_share"] == 1.0 for r in rows)  # untrained: every sample scores 0
    assert rows[0]["mismatch_kl"] < 1e-9  # first step: same weights in engine and trainer
    assert any("eval_reward_mean" in r for r in rows)
    assert all(0 < r["eval_elapsed_s"] <= r["elapsed_s"] for r in rows if "eval_reward_mean" in r)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["eval_reward_by_version"]) == {"0", "2", "4"}
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    cats = {e.get("cat") for e in events if e.get("ph") == "X"}
    assert {"rollout", "train", "sync", "eval"} <= cats
    # version 0's evaluation queued behind the first rollout calls, and still ran at version 0 (the
    # summary's "0": an evaluation that ran at another version is lost)
    first = {c: min(e["ts"] for e in events if e.get("cat") == c and e.get("ph") == "X") for c in cats}
    assert first["rollout"] < first["eval"]
    assert {p.name for p in (out / "plots").iterdir()} == {
        "reward.png",
        "staleness.png",
        "utilization.png",
        "mismatch.png",
        "signal.png",
    }
    assert "max_staleness" in (out / "config.toml").read_text()
    assert (out / "checkpoints" / "final" / "model.safetensors").exists()
