"""The warm process of :class:`loong_agentflow.forkserver.ForkServer` (standard library only).

Run by path with the agent program's own interpreter::

    python _zygote.py CONTROL_FD MODULE...

It imports the ``MODULE`` s once, then serves its runner over ``CONTROL_FD``, a Unix
``SOCK_SEQPACKET`` socket (one JSON message per packet):

- runner to zygote: ``{"id", "argv", "env", "cwd"}`` with three file descriptors attached (the
  episode's stdin, stdout and stderr); the zygote forks a child that becomes that program;
- zygote to runner: ``{"ready": true}`` once; ``{"id", "pid"}`` per fork; ``{"id", "exit"}`` when
  the child ends (``exit`` as :func:`os.waitstatus_to_exitcode`: negative for a signal).

A child starts a session of its own (so its runner can kill its whole process group), takes the
three descriptors as 0, 1 and 2, replaces the environment (adding its ``PYTHONPATH`` to
``sys.path``, as a new interpreter would), changes directory, and runs
``argv[1:]`` as ``python`` would: ``-m MODULE args`` or ``SCRIPT args``. The zygote exits when its
runner closes the socket.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import traceback


def main() -> None:
    sys.path[0] = os.getcwd()  # as ``python -m``, not this file's package directory
    control = socket.socket(fileno=int(sys.argv[1]))
    for name in sys.argv[2:]:
        importlib.import_module(name)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    private = [control.fileno(), wake_r, wake_w, selector.fileno()]
    children: dict[int, int] = {}  # pid -> request id
    control.send(json.dumps({"ready": True}).encode())
    while True:
        for key, _ in selector.select():
            if key.fileobj is control:
                message, fds, _, _ = socket.recv_fds(control, 1 << 20, 3)
                if not message:
                    return  # the runner is gone
                request = json.loads(message)
                pid = os.fork()
                if pid == 0:
                    _become(request, fds, private)
                for fd in fds:
                    os.close(fd)
                children[pid] = request["id"]
                control.send(json.dumps({"id": request["id"], "pid": pid}).encode())
            else:
                while _drain(wake_r):
                    pass
                _reap(children, control)


def _drain(fd: int) -> bool:
    try:
        return bool(os.read(fd, 512))
    except BlockingIOError:
        return False


def _reap(children: dict[int, int], control: socket.socket) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        control.send(json.dumps({"id": children.pop(pid), "exit": code}).encode())


def _become(request: dict, fds: list[int], private: list[int]) -> None:
    """In the forked child: turn into the requested program; never returns."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in private:
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        extra = os.environ.get("PYTHONPATH", "")  # what a new interpreter would read at startup
        sys.path[1:1] = [p for p in extra.split(os.pathsep) if p and p not in sys.path]
        if request["cwd"]:
            os.chdir(request["cwd"])
        code = _run(request["argv"][1:])
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _run(args: list[str]) -> int:
    """Run ``python ARGS`` in this process; returns the exit code ``python`` would."""
    try:
        if args[:1] == ["-m"]:
            sys.argv = [args[1], *args[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    main()
