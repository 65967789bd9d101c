"""How a run sets up Ray's environment before Ray is imported (the CLI's and the Python API's),
and starts or joins its cluster."""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loong_train.config import Recipe

__all__ = ["close", "connect", "connect_in_background", "prepare_local_ray", "starts_ray"]

_background: _Start | None = None


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


def connect(recipe: Recipe) -> None:
    """Start or join the run's Ray cluster: ``--address`` (``ray_address``), or ``RAY_ADDRESS``
    as Ray reads it; else a cluster of the run's own with the CPUs its actors reserve, never one
    Ray would find by chance on this machine (another user's ``ray start``, say). Waits for the
    start :func:`connect_in_background` began, raising what it raised; nothing when Ray is up."""
    if _background is not None:
        _background.up.wait()
        if _background.failed is not None:
            raise _background.failed
        return
    _init(recipe)


def _init(recipe: Recipe) -> None:
    import ray

    if ray.is_initialized():
        return
    address = _address(recipe)
    local = address == "local"
    ray.init(
        address=address,
        num_cpus=recipe.rollout.workers * recipe.threads + recipe.trainer_cpus if local else None,
        include_dashboard=False,
        logging_level=logging.WARNING,
        log_to_driver=True,
    )


def _address(recipe: Recipe) -> str:
    return recipe.ray_address or os.environ.get("RAY_ADDRESS") or "local"


def starts_ray() -> bool:
    """Whether the run connects Ray itself (and disconnects at its end), or its background start
    did: Ray was not up before (the Python API inside a cluster the caller started keeps it)."""
    import ray

    return _background is not None or not ray.is_initialized()


class _Start:
    """``ray.init`` on a thread that then stays until :func:`close`: Ray's processes die with the
    thread that started them (``PR_SET_PDEATHSIG``), not only with the process."""

    def __init__(self, recipe: Recipe) -> None:
        self.up, self.done = threading.Event(), threading.Event()
        self.failed: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(recipe,), name="ray-init", daemon=True)
        self.thread.start()

    def _run(self, recipe: Recipe) -> None:
        quiet = _NoSigtermNote()  # the command line's own handler is set (cli.exit_on_sigterm)
        logging.getLogger("ray._private.worker").addFilter(quiet)
        try:
            _init(recipe)
        except BaseException as e:  # handed to the run's connect()
            self.failed = e
        finally:
            logging.getLogger("ray._private.worker").removeFilter(quiet)
            self.up.set()
        self.done.wait()


class _NoSigtermNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


def connect_in_background(recipe: Recipe) -> None:
    """Begin :func:`connect` on a thread where it starts a cluster of the run's own: the command
    line starts Ray while it imports and checks the model (``ray.init`` keeps about 1.4 of 2 cores
    busy for 5-6 s, the imports one core for 5 s: Ray is up 2.5-3 s sooner). The run's
    :func:`connect` waits for it; joining an existing cluster is left to that call."""
    global _background
    import ray

    if _address(recipe) == "local" and not ray.is_initialized():
        _background = _Start(recipe)


def close() -> None:
    """After the run: let the background start's thread end, and stop its Ray when no run took it
    over (the run failed before it reached Ray), rather than leave it to the interpreter's exit."""
    global _background
    if _background is None:
        return
    start, _background = _background, None
    start.up.wait()
    import ray

    ray.shutdown()  # nothing when the run shut it down already
    start.done.set()
    start.thread.join()
