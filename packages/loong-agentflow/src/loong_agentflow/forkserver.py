"""A fork server for Python agent programs: pay the imports once, fork each episode.

A black-box episode is a fresh process, and a Python agent spends most of a short episode
starting: ``import openai`` alone costs about a second of CPU. :class:`ForkServer` starts one
warm process (``_zygote.py``, run with the agent's own interpreter) that imports the ``preload``
modules, then forks a child per episode. The child is a real, separate process with the same
contract as a subprocess: its own session (process group), the episode's environment, working
directory, stdin, stdout and stderr, and an exit code. Only the imports are shared, copy-on-write.

Programs must be ``[python, "-m", MODULE, ...]`` or ``[python, SCRIPT, ...]``. The preloaded
modules must not start threads at import (forking a process with threads is unsafe). Linux and
other systems with ``SOCK_SEQPACKET`` Unix sockets.

If the warm process dies, the episodes it was running end with exit code
:data:`SERVER_DIED` and the next :meth:`ForkServer.spawn` starts a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import socket
from asyncio.streams import FlowControlMixin
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["SERVER_DIED", "ForkServer", "ForkedProcess"]

SERVER_DIED = -255
"""Exit code of a forked program whose fork server died before reporting its exit."""

_ZYGOTE = Path(__file__).with_name("_zygote.py")


class ForkedProcess:
    """One forked program, used like :class:`asyncio.subprocess.Process` (``pid``, ``returncode``,
    ``communicate``, ``wait``)."""

    def __init__(self, pid: int, stdin: int, stdout: int, stderr: int, exited: asyncio.Future[int]) -> None:
        self.pid = pid
        self._stdin, self._stdout, self._stderr = stdin, stdout, stderr
        self._exited = exited

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

    async def communicate(self, data: bytes = b"") -> tuple[bytes, bytes]:
        """Write ``data`` to stdin and close it; read stdout and stderr to their end; wait for exit."""
        fds, self._stdin, self._stdout, self._stderr = (self._stdin, self._stdout, self._stderr), -1, -1, -1
        _, out, err = await asyncio.gather(_write_pipe(fds[0], data), _read_pipe(fds[1]), _read_pipe(fds[2]))
        await self.wait()
        return out, err

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)


class ForkServer:
    """Forks episodes of Python programs from a warm process that imported ``preload`` once."""

    def __init__(self, python: str, preload: Sequence[str] = ()) -> None:
        self.python, self.preload = python, list(preload)
        self._proc: asyncio.subprocess.Process | None = None
        self._control: socket.socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pids: dict[int, asyncio.Future[int]] = {}
        self._exits: dict[int, asyncio.Future[int]] = {}
        self._ids = itertools.count()
        self._starting = asyncio.Lock()

    async def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None = None
    ) -> ForkedProcess:
        """Fork ``argv`` (``[python, "-m", MODULE, ...]`` or ``[python, SCRIPT, ...]``)."""
        _check_argv(argv)
        message = {"argv": list(argv), "env": dict(env), "cwd": cwd}
        try:
            return await self._fork(await self._ensure_started(), message)
        except ConnectionError:  # the warm process died and was not reaped yet: no child exists
            await self.close()
        try:
            return await self._fork(await self._ensure_started(), message)
        except ConnectionError as e:
            raise RuntimeError(f"the fork server for {self.python} is not reachable: {e}") from e

    async def _fork(self, control: socket.socket, message: dict) -> ForkedProcess:
        """Send one fork request with the child's stdin, stdout and stderr; wait for its pid."""
        request_id = next(self._ids)
        loop = asyncio.get_running_loop()
        forked = self._pids[request_id] = loop.create_future()
        exited = self._exits[request_id] = loop.create_future()
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        stderr_r, stderr_w = os.pipe()
        ours = (stdin_w, stdout_r, stderr_r)
        try:
            packet = json.dumps({"id": request_id, **message}).encode()
            socket.send_fds(control, [packet], [stdin_r, stdout_w, stderr_w])
            pid = await forked
        except BaseException:
            self._pids.pop(request_id, None)
            self._exits.pop(request_id, None)
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in (stdin_r, stdout_w, stderr_w):
                os.close(fd)
        if pid == SERVER_DIED:
            for fd in ours:
                os.close(fd)
            raise RuntimeError(f"the fork server for {self.python} died before forking {message['argv']!r}")
        return ForkedProcess(pid, *ours, exited)

    async def close(self) -> None:
        """Stop the warm process (running children are the caller's to end)."""
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        if self._control is not None:
            self._control.close()  # the warm process reads end of file and exits
            self._control = None
        if self._proc is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._proc.wait(), 5)
            if self._proc.returncode is None:
                self._proc.kill()
                await self._proc.wait()
            self._proc = None

    async def _ensure_started(self) -> socket.socket:
        async with self._starting:
            alive = self._proc is not None and self._proc.returncode is None
            if self._control is not None and alive and self._reader is not None and not self._reader.done():
                return self._control
            await self.close()
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._proc = await asyncio.create_subprocess_exec(
                self.python,
                str(_ZYGOTE),
                str(theirs.fileno()),
                *self.preload,
                pass_fds=[theirs.fileno()],
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
            theirs.close()
            ours.setblocking(False)
            loop = asyncio.get_running_loop()
            ready = await loop.sock_recv(ours, 1 << 16)
            if not ready:
                err = (await self._proc.stderr.read()).decode(errors="replace") if self._proc.stderr else ""
                await self._proc.wait()
                ours.close()
                raise RuntimeError(
                    f"the fork server ({self.python}, preload {self.preload}) exited with code "
                    f"{self._proc.returncode} before it was ready: {err[-2000:]}"
                )
            self._control = ours
            self._reader = asyncio.create_task(self._read(ours))
            return ours

    async def _read(self, control: socket.socket) -> None:
        """Route the warm process's messages to the waiting spawns; fail them all when it ends."""
        loop = asyncio.get_running_loop()
        try:
            while packet := await loop.sock_recv(control, 1 << 16):
                message = json.loads(packet)
                if "pid" in message:
                    self._pids.pop(message["id"]).set_result(message["pid"])
                else:
                    self._exits.pop(message["id"]).set_result(message["exit"])
        except OSError:
            pass  # the socket broke: the warm process is gone
        finally:
            for future in (*self._pids.values(), *self._exits.values()):
                if not future.done():
                    future.set_result(SERVER_DIED)
            self._pids.clear()
            self._exits.clear()


async def _write_pipe(fd: int, data: bytes) -> None:
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.connect_write_pipe(FlowControlMixin, os.fdopen(fd, "wb", 0))
    writer = asyncio.StreamWriter(transport, protocol, None, loop)
    try:
        writer.write(data)
        await writer.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the program exited without reading its input, as a subprocess may
    finally:
        transport.close()


async def _read_pipe(fd: int) -> bytes:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    pipe = os.fdopen(fd, "rb", 0)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    try:
        return await reader.read()
    finally:
        transport.close()


def _check_argv(argv: Sequence[str]) -> None:
    script = len(argv) >= 2 and not argv[1].startswith("-")
    module = len(argv) >= 3 and argv[1] == "-m"
    if not (script or module):
        raise ValueError(
            f"a forked program is [python, '-m', MODULE, ...] or [python, SCRIPT, ...]; got {list(argv)!r}"
        )
