"""How a run sets up Ray's environment before Ray is imported (the CLI's and the Python API's)."""

from __future__ import annotations

import os

__all__ = ["prepare_local_ray"]


def prepare_local_ray() -> None:
    """Environment switches for a local cluster the run starts itself; each must be set before
    Ray is imported, and a value the user set already wins. A cluster joined with ``--address``
    keeps its own settings.

    - ``RAY_ENABLE_UV_RUN_RUNTIME_ENV=0``: Ray workers run this interpreter and environment.
      Under ``uv run`` Ray would otherwise start each worker with ``uv run`` on a packaged copy
      of the working directory, building a second virtual environment (a page of raylet output
      and seconds of start-up); Ray's default replicates the driver's environment on other nodes.
    - ``RAY_AUTH_MODE=token``: token authentication, which Ray turns on by default for a new local
      cluster (it creates ``~/.ray/auth_token`` when missing), chosen explicitly so that Ray does
      not print a notice about its default on every start."""
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "token")
