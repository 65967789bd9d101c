"""How a run sets up Ray's environment before Ray is imported (the CLI's and the Python API's)."""

from __future__ import annotations

import os

__all__ = ["local_ray_workers_share_this_interpreter"]


def local_ray_workers_share_this_interpreter() -> None:
    """Ray workers of a local cluster run this interpreter and environment. Under ``uv run`` Ray
    would otherwise start each worker with ``uv run`` on a packaged copy of the working directory,
    building a second virtual environment (a page of raylet output and seconds of start-up); the
    switch must be set before Ray is imported. A cluster joined with ``--address`` keeps Ray's
    default, which replicates the driver's environment on other nodes."""
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
