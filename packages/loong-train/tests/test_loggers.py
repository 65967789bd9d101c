"""TensorBoard and Weights & Biases loggers, tested by reading what they wrote back with each
tool's own reader: TensorBoard's EventAccumulator, and W&B's offline run file (its log-structured
record format, parsed into W&B's own protobuf ``Record``s)."""

import importlib.util

import pytest
from train_testkit import tensorboard_scalars, wandb_history

from loong_core.config import ConfigError
from loong_train.config import LogConfig
from loong_train.run.loggers import TensorBoardLogger, WandbLogger, open_loggers, require_loggers

ROWS = [
    {"step": 1, "reward_mean": 0.25, "loss": 1.5, "eval_reward_mean": 0.125, "skipped": True, "note": "x"},
    {"step": 2, "reward_mean": 0.5, "loss": 0.75},
    {"step": 3, "reward_mean": 0.625, "loss": float("nan")},
]


def test_tensorboard_gets_every_numeric_key_at_its_step(tmp_path):
    logger = TensorBoardLogger(tmp_path / "tb")
    for row in ROWS:
        logger.log(row)
    logger.close()
    scalars = tensorboard_scalars(tmp_path / "tb")
    assert set(scalars) == {"reward_mean", "loss", "eval_reward_mean"}  # no bools, no strings
    assert scalars["reward_mean"] == [(1, 0.25), (2, 0.5), (3, 0.625)]
    assert scalars["loss"] == [(1, 1.5), (2, 0.75)]  # NaN is left out
    assert scalars["eval_reward_mean"] == [(1, 0.125)]


def test_wandb_offline_run_holds_every_row(tmp_path):
    # several runs in one process: W&B's service could write a run's file after finish() returned,
    # leaving it empty for about one close in four, so each run is read back as soon as it closes
    for attempt in range(4):
        logger = WandbLogger(
            tmp_path / str(attempt), LogConfig(loggers=["wandb"]), {"name": "t", "train": {"lr": 0.1}}
        )
        for row in ROWS:
            logger.log(row)
        logger.close()
        history = wandb_history(tmp_path / str(attempt))
        assert [h["_step"] for h in history] == [1, 2, 3], attempt
        assert [h["reward_mean"] for h in history] == [0.25, 0.5, 0.625]
        assert history[0]["eval_reward_mean"] == 0.125 and "skipped" not in history[0]
        assert "loss" not in history[2]


def test_a_missing_extra_is_named(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    with pytest.raises(ConfigError, match=r"needs the wandb package: pip install 'loong-train\[wandb\]'"):
        require_loggers(LogConfig(loggers=["tensorboard", "wandb"]))
    assert open_loggers(LogConfig(), tmp_path, {}) == []
