"""Step loggers besides ``metrics.jsonl``, chosen by the recipe's ``[log] loggers``.

- ``"tensorboard"``: the numeric keys of every metrics row as scalars (tag = the key, step = the
  row's ``step``), in event files under ``<run>/tensorboard`` (``tensorboard --logdir runs``);
  the ``loong-train[tensorboard]`` extra.
- ``"wandb"``: Weights & Biases, one run named after the run directory, the resolved recipe as its
  config; ``wandb_mode = "offline"`` (the default) writes it under ``<run>/wandb`` for a later
  ``wandb sync``, ``"online"`` uploads as it goes. The ``loong-train[wandb]`` extra.

Both receive exactly the rows ``metrics.jsonl`` gets (eval results included, on the step's row),
so the three never disagree. A resumed run appends: TensorBoard reads the new event file with the
old, W&B starts a new run with the same name.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any, Protocol

from loong_core.config import ConfigError
from loong_train.config import LogConfig

__all__ = ["StepLogger", "TensorBoardLogger", "WandbLogger", "open_loggers", "require_loggers"]

_EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb"}


class StepLogger(Protocol):
    def log(self, row: dict[str, Any]) -> None:
        """One metrics row (its ``step`` is the x axis)."""
        ...

    def close(self) -> None: ...


def require_loggers(config: LogConfig) -> None:
    """Raise ConfigError naming the extra for a chosen logger whose package is not installed."""
    for name in config.loggers:
        if importlib.util.find_spec(_EXTRAS[name]) is None:
            raise ConfigError(
                f"log.loggers has {name!r}, which needs the {_EXTRAS[name]} package: "
                f"pip install 'loong-train[{name}]' (or drop it from log.loggers)"
            )


def open_loggers(config: LogConfig, run_dir: Path, recipe: dict[str, Any]) -> list[StepLogger]:
    """The loggers ``config`` names, writing into ``run_dir``; ``recipe`` is the resolved recipe."""
    require_loggers(config)
    loggers: list[StepLogger] = []
    for name in config.loggers:
        if name == "tensorboard":
            loggers.append(TensorBoardLogger(run_dir / "tensorboard"))
        else:
            loggers.append(WandbLogger(run_dir, config, recipe))
    return loggers


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    """The row's numeric values (bools and non-numbers left out; NaN kept, inf kept)."""
    return {
        k: float(v)
        for k, v in row.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool) and not math.isnan(v)
    }


class TensorBoardLogger:
    """Scalars into TensorBoard event files (torch's ``SummaryWriter``)."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, row: dict[str, Any]) -> None:
        for key, value in _scalars(row).items():
            self.writer.add_scalar(key, value, global_step=int(row["step"]))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A Weights & Biases run (offline unless the recipe says ``wandb_mode = "online"``)."""

    def __init__(self, run_dir: Path, config: LogConfig, recipe: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(
            project=config.wandb_project,
            name=run_dir.name,
            dir=str(run_dir),
            mode=config.wandb_mode,
            config=recipe,
            settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, row: dict[str, Any]) -> None:
        self.run.log(_scalars(row), step=int(row["step"]))

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() can return before W&B's service has written the run file (measured: an empty
        # file after about one close in four); tearing the service down waits for the write. Left
        # running while the process holds another run.
        if wandb.run is None:
            wandb.teardown()
