"""Hostile code against the sandbox: each case ends within its limit with a clear result, and the
host is unharmed (no file written outside, no connection made, no process left behind)."""

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import pytest

from loong_agentflow import ToolCall, ToolRegistry
from loong_agentflow.sandbox import Sandbox, SandboxLimits, SandboxUnavailable, python_tool

LIMITS = SandboxLimits(wall_s=4, cpu_s=2, memory_mb=256, processes=16, output_bytes=4096)


@pytest.fixture(scope="module")
def box():
    try:
        return Sandbox(LIMITS)
    except SandboxUnavailable as e:  # the sandbox says what this machine lacks
        pytest.skip(str(e))


def _processes() -> int:
    """Processes running in a sandbox's working directory (others on the host are not counted:
    tests beside this one start processes of their own)."""
    n = 0
    for p in os.listdir("/proc"):
        try:
            n += p.isdigit() and os.readlink(f"/proc/{p}/cwd").startswith(
                tempfile.gettempdir() + "/loong-sandbox-"
            )
        except OSError:
            continue
    return n


def test_well_behaved_code_runs(box):
    r = box.run_python("import sys; print(sum(range(10))); print('warn', file=sys.stderr)")
    assert r.ok and r.stdout == "45\n" and r.stderr == "warn\n" and r.cut_bytes == 0


def test_an_infinite_loop_is_stopped_by_its_cpu_limit(box):
    # A wall limit far above the CPU limit: on a loaded machine the loop may get well under one
    # core, and the CPU limit must still be the one that stops it.
    limits = msgspec.structs.replace(LIMITS, cpu_s=1, wall_s=60)
    r = Sandbox(limits).run_python("while True: pass")
    assert not r.ok and r.returncode < 0 and not r.timed_out  # SIGXCPU, then SIGKILL
    assert "killed by signal" in r.report()


def test_a_memory_hog_gets_a_memory_error(box):
    r = box.run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))")
    assert not r.ok and "MemoryError" in r.stderr


def test_a_fork_bomb_is_held_to_its_process_count_and_cleaned_up(box):
    before, peak, done = _processes(), [0], threading.Event()

    def watch():  # the host's process count while the bomb runs
        while not done.is_set():
            peak[0] = max(peak[0], _processes())
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    start = time.monotonic()
    r = box.run_python(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    )
    done.set()
    watcher.join()
    assert not r.ok and time.monotonic() - start < LIMITS.wall_s + 3
    assert peak[0] <= before + LIMITS.processes + 3, (before, peak[0])  # the launcher, its init, the bomb
    time.sleep(0.5)
    assert _processes() <= before + 3  # nothing the bomb forked outlives the call


def test_no_network_even_to_a_loopback_server_on_the_host(box):
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        )
        r = box.run_python(code)
        server.settimeout(0.2)
        with pytest.raises(TimeoutError):
            server.accept()  # no connection ever arrived
    assert not r.ok and "connected" not in r.stdout and "Network is unreachable" in r.stderr


def test_writes_outside_its_directory_are_refused(box, tmp_path):
    target = tmp_path / "escaped.txt"
    r = box.run_python(
        f"open('inside.txt', 'w').write('ok')\nprint(open('inside.txt').read())\nopen({str(target)!r}, 'w').write('x')"
    )
    assert r.stdout == "ok\n" and "PermissionError" in r.stderr and not target.exists()


def test_a_flood_of_output_is_cut_with_a_marker(box):
    r = box.run_python("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1 << 20))")
    assert r.ok and r.cut_bytes == (100 << 20) - LIMITS.output_bytes
    assert r.stdout.startswith("x" * LIMITS.output_bytes) and r.stdout.endswith(
        f"[output cut: {r.cut_bytes} more bytes]"
    )


def test_a_program_that_ignores_sigterm_is_killed_at_the_wall_clock(box):
    start = time.monotonic()
    r = box.run_python("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)")
    assert r.timed_out and time.monotonic() - start < LIMITS.wall_s + 2
    assert "[killed: wall-clock limit]" in r.report()


def test_the_python_tool_runs_model_code_in_the_sandbox(box):
    registry = ToolRegistry([python_tool(box)])
    result = asyncio.run(registry.call(ToolCall("python", {"code": "import os; print(os.getpid())"})))
    assert result.ok and result.content.strip() == "1"  # the init of its own PID namespace


def test_stdin_reaches_the_program_and_a_program_that_never_reads_it_still_ends(box):
    r = box.run_python("import sys; print(len(sys.stdin.read()))", stdin=b"x" * 300_000)
    assert r.ok and r.stdout == "300000\n"
    r = box.run_python("print('done')", stdin=b"x" * (4 << 20))  # past any pipe buffer, unread
    assert r.ok and r.stdout == "done\n"


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="sandbox limits must be positive"):
        SandboxLimits(wall_s=0)


NOBODY = 65534


def _unprivileged_python() -> str | None:
    """An interpreter of this Python version that the unprivileged user can run (a virtual
    environment's may live in root's home), or None."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (f"/usr/bin/{version}", f"/usr/local/bin/{version}"):
        if os.path.exists(candidate) and _as_nobody([candidate, "-c", "pass"]).returncode == 0:
            return candidate
    return None


def _as_nobody(argv: list[str]) -> subprocess.CompletedProcess:
    setpriv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    return subprocess.run([*setpriv, *argv], capture_output=True, text=True, timeout=120, cwd="/")


@pytest.mark.skipif(os.getuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_the_unprivileged_path_confines_as_well():
    """As an ordinary user the sandbox takes its other path (a user namespace; the process
    count by RLIMIT_NPROC): the same refusals, and the fork bomb held to ``processes``."""
    python = _unprivileged_python()
    if python is None:
        pytest.skip("no interpreter of this version that an unprivileged user can run")
    probe = Path(__file__).with_name("sandbox_probe.py")
    done = _as_nobody([python, "-I", str(probe), sysconfig.get_paths()["purelib"]])
    if done.returncode and "Permission denied" in done.stderr and "sandbox" not in done.stderr:
        pytest.skip(f"the unprivileged user cannot read the installed packages: {done.stderr[-200:]}")
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert (seen["uid"], seen["inner_uid"]) == (NOBODY, str(NOBODY))
    assert seen["connect"].startswith("OSError: [Errno 101]")  # no route: no interface is up
    assert seen["write"].startswith("PermissionError") and not seen["escaped"]
    assert seen["forks"] == ["7", "BlockingIOError"]  # the program and 7 children: processes = 8


def test_no_unix_socket_on_the_host_can_be_reached(box, tmp_path):
    """A Unix socket is a file, outside any network namespace: the sandbox refuses to make one
    (seccomp), so a server on one (a Ray node's, a container runtime's) is never reached."""
    path = tmp_path / "host.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(1)
    server.settimeout(0.5)
    r = box.run_python(f"import socket\nsocket.socket(socket.AF_UNIX).connect({str(path)!r})")
    assert not r.ok and "PermissionError" in r.stderr, r
    with pytest.raises(TimeoutError):
        server.accept()
    server.close()
    paired = box.run_python("import socket\na, b = socket.socketpair()\na.send(b'x')\nprint(b.recv(1))")
    assert paired.ok and paired.stdout == "b'x'\n"  # a pair inside the program is no way out


def test_reach_carries_connections_to_one_address_and_frees_each_link(box):
    """``reach``: the program's connections to that loopback address arrive at the server outside
    (300 in a row, each answered), another port stays unreachable, and the relay closes each
    link when it ends: the host's open descriptors stay near where they were during the call."""
    served = []
    server = socket.create_server(("127.0.0.1", 0))
    other = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                served.append(conn.recv(16))
                conn.sendall(b"pong")

    threading.Thread(target=serve, daemon=True).start()
    port, closed = server.getsockname()[1], other.getsockname()[1]
    code = f"""import socket
answers = 0
for i in range(300):
    with socket.create_connection(("127.0.0.1", {port}), timeout=5) as c:
        c.sendall(b"ping")
        answers += c.recv(16) == b"pong"
try:
    socket.create_connection(("127.0.0.1", {closed}), timeout=2)
    print(answers, "reached")
except OSError as e:
    print(answers, type(e).__name__)
"""
    before, peak, done = len(os.listdir("/proc/self/fd")), [0], threading.Event()

    def watch():  # this process's descriptors while the call runs
        while not done.is_set():
            peak[0] = max(peak[0], len(os.listdir("/proc/self/fd")))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    r = box.run_python(code, reach=[("127.0.0.1", port)])
    done.set()
    watcher.join()
    server.close()
    other.close()
    assert r.ok and r.stdout.split() == ["300", "ConnectionRefusedError"], r
    assert served == [b"ping"] * 300
    # links kept until the call's end would reach 600 sockets (other threads may open a few)
    assert peak[0] - before < 50, (before, peak)
