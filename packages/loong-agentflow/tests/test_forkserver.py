"""The fork server against its reference, a plain subprocess: the same program, environment, working
directory and stdin give the same stdout and exit code; only the preloaded imports differ."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from loong_agentflow.forkserver import SERVER_DIED, ForkServer

pytestmark = pytest.mark.integration

PROGRAM = """\
import os, sys
print(sys.argv[1:], os.getcwd(), os.environ.get("EPISODE"), "OPENAI_API_KEY" in os.environ)
print("preloaded:", "fractions" in sys.modules)
print(sys.stdin.read().upper())
print("to stderr", file=sys.stderr)
sys.exit(int(os.environ.get("CODE", "0")))
"""


async def _subprocess(argv, env, cwd, data: bytes):
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=-1, stdout=-1, stderr=-1, env=env, cwd=cwd, start_new_session=True
    )
    out, err = await proc.communicate(data)
    return out, err, proc.returncode


async def _forked(server: ForkServer, argv, env, cwd, data: bytes):
    proc = await server.spawn(argv, env, cwd)
    out, err = await asyncio.wait_for(proc.communicate(data), 30)
    return out, err, proc.returncode


def test_a_forked_program_behaves_like_a_subprocess(tmp_path: Path):
    script = tmp_path / "agent.py"
    script.write_text(PROGRAM)
    argv = [sys.executable, str(script), "--task", "7"]
    env = {"EPISODE": "e1", "CODE": "3", "PATH": os.environ["PATH"]}

    async def main():
        server = ForkServer(sys.executable, ["fractions"])
        try:
            forked = [await _forked(server, argv, env, str(tmp_path), b"hi %d" % i) for i in range(3)]
        finally:
            await server.close()
        return forked, await _subprocess(argv, env, str(tmp_path), b"hi 0")

    forked, (out, err, code) = asyncio.run(main())
    assert code == 3 and forked[0][2] == 3
    assert forked[0][1] == err == b"to stderr\n"
    assert forked[0][0] == out.replace(b"preloaded: False", b"preloaded: True")
    assert b"preloaded: True" in forked[0][0]  # the import was paid once, in the warm process
    assert [f[0].splitlines()[-1] for f in forked] == [b"HI 0", b"HI 1", b"HI 2"]


def test_module_form_errors_and_signals(tmp_path: Path):
    (tmp_path / "crashy.py").write_text("import sys\nraise ValueError(sys.argv[1])\n")
    (tmp_path / "sleepy.py").write_text(
        "import os, time\nprint(os.getpid(), os.getpgid(0), flush=True)\ntime.sleep(60)\n"
    )
    env = {"PYTHONPATH": str(tmp_path)}

    async def main():
        server = ForkServer(sys.executable)
        try:
            crash = await _forked(server, [sys.executable, "-m", "crashy", "boom"], env, None, b"")
            sleepy = await server.spawn([sys.executable, "-m", "sleepy"], env)
            reading = asyncio.create_task(sleepy.communicate())
            await asyncio.sleep(0.5)
            os.killpg(sleepy.pid, signal.SIGKILL)  # its own process group, as a runner's timeout does
            out, _ = await asyncio.wait_for(reading, 30)
            return crash, sleepy.pid, out, sleepy.returncode
        finally:
            await server.close()

    (_, err, code), pid, out, killed = asyncio.run(main())
    assert code == 1 and b"ValueError: boom" in err
    assert out.split() == [str(pid).encode()] * 2  # a session of its own: pgid == pid
    assert killed == -signal.SIGKILL


def test_a_dead_fork_server_fails_its_episodes_and_is_restarted(tmp_path: Path):
    async def main():
        server = ForkServer(sys.executable)
        try:
            waiting = await server.spawn([sys.executable, "-m", "this"], {})
            hanging = await server.spawn([sys.executable, "-m", "code"], {})  # an interactive console
            server._proc.kill()  # the warm process dies; its children are not reported any more
            code = await asyncio.wait_for(hanging.wait(), 30)
            os.killpg(hanging.pid, signal.SIGKILL)
            await waiting.communicate()
            again = await _forked(server, [sys.executable, "-m", "platform"], {}, None, b"")
            return code, again
        finally:
            await server.close()

    code, (out, _, again_code) = asyncio.run(main())
    assert code == SERVER_DIED
    assert again_code == 0 and b"Linux" in out


def test_bad_programs_and_preloads_are_named():
    async def main():
        server = ForkServer(sys.executable, ["no_such_module_xyz"])
        with pytest.raises(ValueError, match="python, '-m', MODULE"):
            await server.spawn(["/bin/echo", "-n"], {})
        with pytest.raises(RuntimeError, match="no_such_module_xyz"):
            await server.spawn([sys.executable, "-m", "platform"], {})
        await server.close()

    asyncio.run(main())
