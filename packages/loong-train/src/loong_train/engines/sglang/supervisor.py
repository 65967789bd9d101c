"""A supervised SGLang server: launch, wait for health, watch, restart, log, stop.

``SGLangSupervisor`` runs one server process (by default ``python -m sglang.launch_server
--model-path M --host H --port P [--api-key K] ARGS...``; any command that speaks SGLang's HTTP
API works, e.g. ``loong-train serve-sglang`` on CPU) and keeps it serving:

- **start**: launch, then poll ``GET /health`` (SGLang and the embedded server both answer 200 once
  they serve, 503 while SGLang starts) until ``startup_timeout_s``; a process that exits or never
  gets healthy counts as a failed launch and is retried like a crash. ``/health`` is exempt from
  ``--api-key`` in SGLang (``utils/auth.py``), so the key is sent but not needed. By default
  SGLang's ``/health`` generates one token (like ``/health_generate``), which waits while the
  server is paused; set ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false`` in ``env`` when pauses
  can outlast ``health_failures`` checks (``SGLangRollout`` does).
- **logs**: the process writes stdout and stderr straight into ``log_path`` (appended; a header
  line per launch, the API key redacted), so nothing is lost if this process dies.
- **watch**: a daemon thread checks every ``health_interval_s`` that the process is alive and that
  ``/health`` answers within ``health_timeout_s``; after ``health_failures`` consecutive failures,
  or at once when the process is gone, it restarts the server on the same port after a back-off
  (``restart_backoff_s`` doubling per recent restart, at most 60 s). ``on_restart`` (if given)
  runs after each healthy relaunch, e.g. to push the current weights again: a relaunched server
  serves the checkpoint it was started from.
- **limit**: at most ``max_restarts`` restarts within any ``restart_window_s``; beyond that the
  supervisor gives up and ``check()`` raises ``SGLangServerError`` naming the log file and its
  last lines.
- **stop**: SIGTERM to the server's process group (it runs in a session of its own, so its
  scheduler/detokenizer children get it too), SIGKILL after ``stop_grace_s``. On Linux the server
  also gets SIGTERM if the thread that launched it dies (``PR_SET_PDEATHSIG``), so a killed Ray
  actor leaves no server behind.

Servers bind 127.0.0.1 unless ``host`` says otherwise; any other host needs an ``api_key``.

Lifecycle::

    sup = SGLangSupervisor(SGLangServerConfig(model_path="/ckpt/Qwen3-0.6B", port=30000,
                                              log_path="runs/x/logs/sglang-0.log"))
    sup.start()                 # blocks until /health answers (or raises SGLangServerError)
    ... use sup.url ...         # sup.check() raises if the supervisor gave up
    sup.stop()
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec

from loong_core.config import is_loopback

__all__ = ["SGLangServerConfig", "SGLangServerError", "SGLangSupervisor", "sglang_launch_command"]


def sglang_launch_command(python: str = sys.executable) -> list[str]:
    """SGLang's own server entry point, run by ``python`` (an interpreter with sglang installed)."""
    return [python, "-m", "sglang.launch_server"]


class SGLangServerError(RuntimeError):
    """The server could not be started or kept healthy; the message names its log file."""


class SGLangServerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One server. ``command`` is the launcher without the standard flags (``--model-path``,
    ``--host``, ``--port``, ``--api-key``), which are appended, then ``args``. ``env`` adds to this
    process's environment (e.g. ``CUDA_VISIBLE_DEVICES``). ``log_path`` empty: the server's output
    is discarded (tests and tools only; recipes always log)."""

    model_path: str
    command: list[str] = msgspec.field(default_factory=sglang_launch_command)
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    args: list[str] = []
    env: dict[str, str] = {}
    log_path: str = ""
    startup_timeout_s: float = 600.0
    health_interval_s: float = 5.0
    health_timeout_s: float = 10.0
    health_failures: int = 3
    max_restarts: int = 3
    restart_window_s: float = 3600.0
    restart_backoff_s: float = 1.0
    stop_grace_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("command must name the server launcher (e.g. python -m sglang.launch_server)")
        if not is_loopback(self.host) and not self.api_key:
            raise ValueError(f"host {self.host!r} is not loopback: set api_key so the server is not open")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.max_restarts < 0 or self.health_failures < 1:
            raise ValueError("max_restarts must be >= 0 and health_failures >= 1")
        if min(self.startup_timeout_s, self.health_interval_s, self.health_timeout_s) <= 0:
            raise ValueError("startup_timeout_s, health_interval_s and health_timeout_s must be > 0")

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    def argv(self) -> list[str]:
        standard = ["--model-path", self.model_path, "--host", self.host, "--port", str(self.port)]
        key = ["--api-key", self.api_key] if self.api_key else []
        return [*self.command, *standard, *key, *self.args]


def _parent_death_signal() -> Callable[[], None] | None:
    """A ``preexec_fn`` that asks Linux to SIGTERM the child when its launching thread dies.

    ``prctl`` is looked up here, in the parent, so the child only makes one system call between
    fork and exec."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1
    return lambda: prctl(pr_set_pdeathsig, signal.SIGTERM)


class SGLangSupervisor:
    """Runs and watches one server process; see the module docstring for the policy."""

    def __init__(self, config: SGLangServerConfig, on_restart: Callable[[], None] | None = None) -> None:
        self.config = config
        self.on_restart = on_restart
        self.restarts = 0  # relaunches so far (failed launches included)
        self.error: SGLangServerError | None = None
        self._proc: subprocess.Popen | None = None
        self._recent: collections.deque[float] = collections.deque()
        self._launches = 0
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # one launch or kill at a time
        self._watcher: threading.Thread | None = None
        self._headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Launch and wait until healthy (retrying failed launches within the restart limit),
        then keep watching. Raises SGLangServerError once the limit is spent.

        Every launch happens on the supervisor's own thread, which lives until ``stop()``: the
        parent-death signal is tied to the launching thread, not to the process."""
        ready = threading.Event()
        self._watcher = threading.Thread(
            target=self._run, args=(ready,), name="sglang-supervisor", daemon=True
        )
        self._watcher.start()
        ready.wait()
        self.check()

    def check(self) -> None:
        """Raise the supervisor's error if it gave up on the server."""
        if self.error is not None:
            raise self.error

    def healthy(self) -> bool:
        """Is the process alive and does ``/health`` answer 200 right now?"""
        if self._proc is None or self._proc.poll() is not None:
            return False
        try:
            response = httpx.get(
                f"{self.url}/health", headers=self._headers, timeout=self.config.health_timeout_s
            )
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def stop(self) -> None:
        """Stop watching and terminate the server's process group (SIGTERM, then SIGKILL)."""
        self._stopping.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()
        with self._lock:
            self._kill()

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the log file (empty when there is none)."""
        path = Path(self.config.log_path)
        if not self.config.log_path or not path.exists():
            return ""
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - 64 * 1024))
            text = f.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    # ---- launching ----
    def _launch_until_healthy(self, first: bool) -> None:
        """Relaunch until a launch gets healthy; every failed launch spends one restart."""
        while True:
            if not first:
                self._spend_restart()
            first = False
            with self._lock:
                if self._stopping.is_set():
                    return
                self._kill()
                self._launch()
            problem = self._wait_healthy()
            if problem is None:
                return
            self._note(problem)

    def _spend_restart(self) -> None:
        """Count a restart within the window, give up beyond the limit, back off, return."""
        c = self.config
        now = time.monotonic()
        while self._recent and now - self._recent[0] > c.restart_window_s:
            self._recent.popleft()
        if len(self._recent) >= c.max_restarts:
            with self._lock:
                self._kill()
            self.error = SGLangServerError(
                f"SGLang server {self.url} (model {c.model_path}, launcher {c.command[0]}) failed "
                f"{len(self._recent) + 1} times within {c.restart_window_s:.0f} s (max_restarts = "
                f"{c.max_restarts}); giving up. Log: {c.log_path or '(not kept)'}; last lines:\n"
                f"{self.log_tail()}"
            )
            raise self.error
        self._recent.append(now)
        self.restarts += 1
        self._stopping.wait(min(60.0, c.restart_backoff_s * 2 ** (len(self._recent) - 1)))

    def _launch(self) -> None:
        c = self.config
        self._launches += 1
        argv = c.argv()
        if c.log_path:
            Path(c.log_path).parent.mkdir(parents=True, exist_ok=True)
        log = open(c.log_path, "ab") if c.log_path else subprocess.DEVNULL  # noqa: SIM115
        if c.log_path:
            header = f"=== loong: launch {self._launches} at {time.strftime('%Y-%m-%d %H:%M:%S')}: "
            log.write((header + " ".join(self._redacted(argv)) + "\n").encode())
            log.flush()
        try:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **c.env},
                start_new_session=True,  # its own process group: stop() reaches its children
                preexec_fn=_parent_death_signal(),
            )
        except OSError as e:
            self._proc = None
            self._note(f"could not start {argv[0]!r}: {e}")
        finally:
            if c.log_path:
                log.close()

    def _wait_healthy(self) -> str | None:
        """None once ``/health`` answers; else why the launch failed."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        while not self._stopping.is_set():
            if self._proc is None:
                return "the launcher could not be executed"
            if (code := self._proc.poll()) is not None:
                return f"server process exited with code {code} during startup"
            if self.healthy():
                return None
            if time.monotonic() > deadline:
                return f"server did not become healthy within {self.config.startup_timeout_s} s"
            self._stopping.wait(0.2)
        return None

    # ---- watching ----
    def _run(self, ready: threading.Event) -> None:
        try:
            self._launch_until_healthy(first=True)
        except SGLangServerError:
            return  # recorded in self.error, raised by start()
        finally:
            ready.set()
        self._watch()

    def _watch(self) -> None:
        """Poll; relaunch on a dead process or ``health_failures`` failed checks in a row. A
        failing ``on_restart`` hook counts as a failed launch too (the server may hold stale state)."""
        failures, problem = 0, None
        while not self._stopping.wait(self.config.health_interval_s):
            if problem is None:
                alive = self._proc is not None and self._proc.poll() is None
                failures = failures + 1 if alive and not self.healthy() else 0
                if alive and failures < self.config.health_failures:
                    continue
                problem = (
                    f"/health failed {failures} times in a row"
                    if alive
                    else f"server process exited with code {self._proc.returncode if self._proc else None}"
                )
            self._note(problem)
            failures, problem = 0, None
            try:
                self._launch_until_healthy(first=False)
                if self.on_restart is not None and not self._stopping.is_set():
                    self.on_restart()
            except SGLangServerError:
                return
            except Exception as e:
                problem = f"on_restart hook failed after the relaunch: {e!r}"

    def _kill(self) -> None:
        """SIGTERM the process group, SIGKILL it after the grace period; reap the process."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(self.config.stop_grace_s)
        with contextlib.suppress(ProcessLookupError):  # children that outlived the leader, too
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def _note(self, problem: str) -> None:
        """Record a failure in the server's log, where its own output explains it."""
        if not self.config.log_path:
            return
        with open(self.config.log_path, "a") as log:
            log.write(f"=== loong: {problem} ({time.strftime('%H:%M:%S')})\n")

    def _redacted(self, argv: list[str]) -> list[str]:
        key = self.config.api_key
        return ["<api-key>" if key and a == key else a for a in argv]
