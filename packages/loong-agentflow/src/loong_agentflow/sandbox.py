"""A sandbox for model-written code: a separate process under time, CPU, memory, file-size,
open-file and process-count limits, in a private working directory, without network.

::

    box = Sandbox(SandboxLimits(wall_s=5))        # refuses at once what this kernel cannot enforce
    result = box.run_python("print(sum(range(10)))")
    result.ok, result.stdout                      # True, '45\\n'
    tools = ToolRegistry([python_tool(box)])      # the same for white-box agents and environments

Each call gets a fresh temporary directory as its working directory (and ``HOME`` and
``TMPDIR``), removed afterwards. The program starts through a launcher
(:mod:`loong_agentflow._sandbox_exec`) that confines itself first:

- **no network**: a new network namespace (nothing but a downed loopback: even 127.0.0.1 is
  unreachable); ``network = True`` turns this off, explicitly. A call may name loopback
  services it needs (``reach``, e.g. an agent's model endpoint): the program connects to the
  same address inside its namespace and the sandbox carries each connection to it outside,
  and to nothing else;
- **processes**: a new PID namespace whose init is the program, so it cannot see or signal
  anything outside, and whatever it leaves running dies with it; at most ``processes`` of them
  (root: a ``pids`` cgroup of the call's own; otherwise ``RLIMIT_NPROC`` in a user namespace
  of its own);
- **files**: writes, creations and removals only inside the working directory (Landlock; reads
  stay open, so interpreters load); ``writes_outside = True`` turns this off, explicitly;
- **privileges**: every capability dropped, no way to regain one;
- **resources**: ``cpu_s`` CPU seconds, ``memory_mb`` of address space, files up to ``file_mb``,
  ``open_files`` descriptors; ``wall_s`` of wall-clock time, after which the whole process group
  is killed (SIGKILL: a program that ignores SIGTERM ends too);
- **output**: stdout and stderr are read as they come, each kept up to ``output_bytes`` and
  the rest counted and dropped, the kept text ending with a marker naming how much was cut.

What the kernel cannot provide is refused when the :class:`Sandbox` is made, naming the setting
that would let it run without (``network``, ``writes_outside``, ``processes = 0``): a sandbox
never runs with less isolation than its settings say.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from loong_agentflow.tools import Tool

__all__ = ["Sandbox", "SandboxLimits", "SandboxResult", "SandboxUnavailable", "bash_tool", "python_tool"]

# run as a script (standard library only): it needs no installed package, whatever the interpreter
_LAUNCHER = str(Path(__file__).with_name("_sandbox_exec.py"))


class SandboxLimits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a sandboxed call may use (see the module docstring). ``processes = 0``: no limit on
    their number."""

    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    file_mb: int = 16
    open_files: int = 64
    processes: int = 32
    output_bytes: int = 16 << 10
    network: bool = False
    writes_outside: bool = False

    def __post_init__(self) -> None:
        sizes = (self.wall_s, self.cpu_s, self.memory_mb, self.file_mb, self.open_files, self.output_bytes)
        if min(sizes) <= 0 or self.processes < 0:
            raise ValueError(
                "sandbox limits must be positive (processes >= 0), got "
                f"wall_s {self.wall_s}, cpu_s {self.cpu_s}, memory_mb {self.memory_mb}, file_mb {self.file_mb}, "
                f"open_files {self.open_files}, output_bytes {self.output_bytes}, processes {self.processes}"
            )


class SandboxUnavailable(RuntimeError):
    """This machine cannot enforce a limit the settings ask for."""


@dataclass(frozen=True)
class SandboxResult:
    """How a call ended: ``returncode`` (negative: killed by that signal), the output kept,
    whether the wall clock ran out, how many bytes of each output were cut, and the wall time."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    stdout_cut: int
    stderr_cut: int
    wall_s: float

    @property
    def cut_bytes(self) -> int:
        return self.stdout_cut + self.stderr_cut

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def report(self) -> str:
        """The result as an agent reads it: the output, and how the program ended unless it
        ended well."""
        parts = [self.stdout.rstrip("\n")]
        if self.stderr.strip():
            parts.append(self.stderr.rstrip("\n"))
        if self.timed_out:
            parts.append("[killed: wall-clock limit]")
        elif self.returncode < 0:
            parts.append(f"[killed by signal {signal.Signals(-self.returncode).name}]")
        elif self.returncode:
            parts.append(f"[exit code {self.returncode}]")
        return "\n".join(p for p in parts if p)


class Sandbox:
    """Runs programs under :class:`SandboxLimits`; checks at construction that this machine
    enforces them (:class:`SandboxUnavailable` otherwise)."""

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self._root = os.getuid() == 0
        self._pids = _pids_hierarchy() if self._root and self.limits.processes else None
        self._check()

    def _check(self) -> None:
        """Launch this interpreter once under the limits: what the kernel refuses, refused here."""
        if self._root and self.limits.processes and self._pids is None:
            raise SandboxUnavailable(
                "sandbox: as root the process-count limit needs a pids cgroup, and none can be made "
                "here (/sys/fs/cgroup): set processes = 0 to run without a process-count limit"
            )
        result = self.run([sys.executable, "-I", "-c", "pass"])
        if result.returncode == 126 and result.stderr.startswith("sandbox:"):
            what = result.stderr.strip()
            hint = []
            if not self.limits.network:
                hint.append("network = true (no network namespace)")
            if not self.limits.writes_outside:
                hint.append("writes_outside = true (no Landlock write confinement)")
            raise SandboxUnavailable(
                f"{what}: this kernel cannot enforce the sandbox's settings; to run with less "
                f"isolation, set explicitly: {' or '.join(hint) or 'nothing left to relax'}"
            )

    def run(
        self,
        argv: list[str],
        stdin: bytes = b"",
        files: dict[str, str | bytes] | None = None,
        env: Mapping[str, str] | None = None,
        reach: Sequence[tuple[str, int]] = (),
    ) -> SandboxResult:
        """Run ``argv`` (its first item a path or a name on PATH) in a fresh working directory
        holding ``files`` (name -> content), ``stdin`` on its standard input. The program's
        environment is ``PATH``, ``HOME``, ``TMPDIR`` and ``LANG`` and then ``env``; ``reach``:
        loopback ``(host, port)`` services it may connect to."""
        lim = self.limits
        for host, port in reach:
            if not host.startswith("127.") or not 0 < port < 65536:
                raise ValueError(f"sandbox reach {host}:{port}: a loopback address (127.x.x.x) and a port")
        workdir = Path(tempfile.mkdtemp(prefix="loong-sandbox-"))
        cgroup = self._make_cgroup() if self._pids else ""
        try:
            for name, content in (files or {}).items():
                path = workdir / name
                if path.resolve().parent != workdir.resolve():
                    raise ValueError(
                        f"sandbox file {name!r}: a plain file name, inside the working directory"
                    )
                path.write_bytes(content.encode() if isinstance(content, str) else content)
            program = shutil.which(argv[0]) or argv[0]
            plan = {
                "argv": [program, *argv[1:]],
                "workdir": str(workdir),
                "env": dict(env or {}),
                "network": lim.network,
                "reach": [] if lim.network else [list(address) for address in reach],
                "writes_outside": lim.writes_outside,
                "processes": lim.processes,
                "cgroup": cgroup,
                "cpu_s": lim.cpu_s,
                "memory_bytes": lim.memory_mb << 20,
                "file_bytes": lim.file_mb << 20,
                "open_files": lim.open_files,
            }
            return self._launch(plan, stdin)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            if cgroup:
                _remove_cgroup(cgroup)

    def run_python(
        self, code: str, stdin: bytes = b"", files: dict[str, str | bytes] | None = None, **kwargs
    ) -> SandboxResult:
        """``code`` as ``main.py`` (beside ``files``), run by this interpreter in isolated mode
        (``-I``); ``kwargs`` as for :meth:`run` (``env``, ``reach``)."""
        return self.run(
            [sys.executable, "-I", "main.py"], stdin, {**(files or {}), "main.py": code}, **kwargs
        )

    def run_bash(self, script: str, stdin: bytes = b"") -> SandboxResult:
        return self.run(["bash", "main.sh"], stdin, {"main.sh": script})

    async def arun(self, argv: list[str], stdin: bytes = b"", **kwargs) -> SandboxResult:
        """:meth:`run` on a thread: the event loop goes on meanwhile."""
        return await asyncio.to_thread(self.run, argv, stdin, **kwargs)

    def _launch(self, plan: dict, stdin: bytes) -> SandboxResult:
        lim, start = self.limits, time.monotonic()
        relay = _Relay(plan) if plan["reach"] else None
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", _LAUNCHER, json.dumps(plan)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                env={},
                pass_fds=relay.child_fds if relay else (),
            )
        except BaseException:
            if relay:
                relay.close()
            raise
        timed_out = False
        try:
            if relay:
                relay.started()
            out, err = _Capped(proc.stdout, lim.output_bytes), _Capped(proc.stderr, lim.output_bytes)
            feed = threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True)  # never blocks us
            feed.start()
            try:
                proc.wait(timeout=lim.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
        finally:  # whatever failed here, the program does not outlive the call
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher's group: the PID namespace dies with it
            proc.wait()
            if relay:
                relay.close()
        out.join(), err.join(), feed.join()
        return SandboxResult(
            returncode=proc.returncode,  # the launcher ends as the program did
            stdout=out.text(),
            stderr=err.text(),
            timed_out=timed_out,
            stdout_cut=out.cut,
            stderr_cut=err.cut,
            wall_s=time.monotonic() - start,
        )

    def _make_cgroup(self) -> str:
        path = os.path.join(self._pids, f"loong-sandbox-{uuid.uuid4().hex[:12]}")
        os.mkdir(path)
        Path(path, "pids.max").write_text(str(self.limits.processes + 1))  # + the launcher
        return path


_MAX_LINKS = 16  # connections one call may hold open at once through the relay


class _Relay:
    """Carries the program's connections to its ``reach`` addresses: the launcher listens on them
    inside the sandbox's network namespace and sends the listening sockets here (a socket pair),
    where a thread accepts and connects each to the same address outside. At most
    ``_MAX_LINKS`` connections are carried at once (more wait in the listen queue); each is
    closed, here, once both directions ended, and everything when the call ends."""

    def __init__(self, plan: dict) -> None:
        self.targets = [tuple(address) for address in plan["reach"]]
        self._here, self._child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        plan["bridge_fd"] = self._child.fileno()
        self.child_fds = (self._child.fileno(),)
        self._open: list[socket.socket] = [self._here]
        self._lock = threading.Lock()
        self._links = threading.BoundedSemaphore(_MAX_LINKS)
        self._closed = False

    def started(self) -> None:
        """The launcher holds its end now: ours of it closes, so a launcher that dies before
        sending ends the wait for its sockets."""
        self._child.close()
        threading.Thread(target=self._receive, daemon=True).start()

    def _receive(self) -> None:
        with contextlib.suppress(OSError):
            _, fds, _, _ = socket.recv_fds(self._here, 16, len(self.targets))
            for fd in fds:
                os.set_inheritable(fd, False)  # no later child of this process gets them
            listeners = [socket.socket(fileno=fd) for fd in fds]
            if not self._keep(*listeners):
                return
            for listener, target in zip(listeners, self.targets, strict=False):
                threading.Thread(target=self._accept, args=(listener, target), daemon=True).start()

    def _keep(self, *socks: socket.socket) -> bool:
        """Track ``socks`` until the call ends; closes them at once if it has."""
        with self._lock:
            if not self._closed:
                self._open.extend(socks)
                return True
        for sock in socks:
            sock.close()
        return False

    def _accept(self, listener: socket.socket, target: tuple[str, int]) -> None:
        while not self._closed:
            if not self._links.acquire(timeout=0.2):
                continue  # every link busy: the next connection waits in the listen queue
            try:
                inside, _ = listener.accept()
            except OSError:
                self._links.release()
                return  # closed: the call ended
            try:
                outside = socket.create_connection(target, timeout=10)
                outside.settimeout(None)
            except OSError:
                inside.close()  # nothing listens there: the program sees a refused connection
                self._links.release()
                continue
            if not self._keep(inside, outside):
                return
            ends = [2]
            for a, b in ((inside, outside), (outside, inside)):
                threading.Thread(target=self._pump, args=(a, b, inside, outside, ends), daemon=True).start()

    def _pump(self, source, sink, inside, outside, ends: list[int]) -> None:
        """One direction of a link; the second to end closes the link and frees its slot."""
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)
        with self._lock:
            ends[0] -= 1
            if ends[0]:
                return
            for sock in (inside, outside):
                if sock in self._open:
                    self._open.remove(sock)
        inside.close()
        outside.close()
        self._links.release()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            opened, self._open = self._open, []
        self._child.close()
        for sock in opened:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def _feed(pipe, data: bytes) -> None:
    """Write ``data`` to the program's stdin and close it (a program that never reads gets EOF
    never; the write ends when the program does)."""
    with contextlib.suppress(BrokenPipeError, OSError):
        pipe.write(data)
    with contextlib.suppress(BrokenPipeError, OSError):
        pipe.close()


class _Capped:
    """Drains a pipe on a thread, keeping its first ``limit`` bytes and counting the rest."""

    def __init__(self, pipe, limit: int) -> None:
        self.kept, self.cut, self.limit = bytearray(), 0, limit
        self._thread = threading.Thread(target=self._drain, args=(pipe,), daemon=True)
        self._thread.start()

    def _drain(self, pipe) -> None:
        while chunk := pipe.read1(1 << 16):
            room = self.limit - len(self.kept)
            self.kept += chunk[: max(room, 0)]
            self.cut += max(len(chunk) - max(room, 0), 0)
        pipe.close()

    def join(self) -> None:
        self._thread.join()

    def text(self) -> str:
        text = self.kept.decode(errors="replace")
        return text + (f"\n[output cut: {self.cut} more bytes]" if self.cut else "")


def _pids_hierarchy() -> str | None:
    """Where this (root) process can make a pids cgroup: cgroup v1's pids hierarchy, or the v2
    root with the pids controller enabled for children; None if neither."""
    v1 = "/sys/fs/cgroup/pids"
    if os.path.isfile(os.path.join(v1, "cgroup.procs")) and os.access(v1, os.W_OK):
        return v1
    v2 = "/sys/fs/cgroup"
    try:
        if "pids" not in Path(v2, "cgroup.controllers").read_text().split():
            return None
        control = Path(v2, "cgroup.subtree_control")
        if "pids" not in control.read_text().split():
            control.write_text("+pids")
        return v2 if os.access(v2, os.W_OK) else None
    except OSError:
        return None


def _remove_cgroup(path: str) -> None:
    """rmdir once the processes in it are gone (they die with the PID namespace's init)."""
    for _ in range(200):
        try:
            os.rmdir(path)
            return
        except OSError:
            time.sleep(0.01)


def _tool(box: Sandbox, name: str, language: str, run) -> Tool:
    async def call(code: str) -> str:
        result = await asyncio.to_thread(run, code)
        return result.report()

    schema = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": f"the {language} to run"}},
        "required": ["code"],
    }
    limits = box.limits
    description = (
        f"Run {language} in a sandbox (no network, {limits.wall_s:g} s, {limits.memory_mb} MB) "
        "and return its output"
    )
    return Tool(name=name, description=description, parameters=schema, fn=call)


def python_tool(box: Sandbox, name: str = "python") -> Tool:
    """A tool ``python(code)`` running ``code`` in ``box``; its output (and how it ended) is the
    observation."""
    return _tool(box, name, "Python code", box.run_python)


def bash_tool(box: Sandbox, name: str = "bash") -> Tool:
    """A tool ``bash(code)`` running a bash script in ``box``."""
    return _tool(box, name, "a bash script", box.run_bash)
