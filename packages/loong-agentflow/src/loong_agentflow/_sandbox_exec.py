"""The sandbox's launcher: a fresh, single-threaded process that confines itself, then runs the
program (:mod:`loong_agentflow.sandbox` starts it; the argument is the JSON of a :class:`Plan`).

In order: a new network namespace (no interface but a downed loopback) and a new PID namespace
(the program is its init: it sees and signals nothing outside it, and when it ends the kernel
kills whatever it left behind), entered directly as root, or inside a new user namespace
otherwise; the loopback addresses the plan lets the program reach (``reach``), listened on
inside the new network namespace and the listening sockets handed to the parent over
``bridge_fd``, which carries each connection to the same address outside; the process-count
limit (root: a ``pids`` cgroup of its own; otherwise ``RLIMIT_NPROC``, which Linux counts
within the new user namespace); writes confined to the working directory by Landlock (reads
stay open, so interpreters and libraries load); every capability dropped and ``no_new_privs``
set; no Unix sockets (seccomp); the resource limits; the working directory, a clean
environment, and ``execve``. A step the kernel refuses fails the launch with exit code 126 and
its reason on stderr, unless the plan says that isolation may be skipped.

Only the standard library, imported lazily nowhere else: this runs before the program, once per call.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import re
import resource
import signal
import socket
import struct
import sys

CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446
CAPSET = {"x86_64": 126, "aarch64": 91}
# seccomp: the audit architecture and socket(2)'s number, per machine
SECCOMP_ARCH = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}
PR_SET_SECCOMP, SECCOMP_MODE_FILTER, AF_UNIX, EACCES = 22, 2, 1, 13
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1

_libc = ctypes.CDLL(None, use_errno=True)


class Refused(Exception):
    """A confinement step the kernel refused."""


def _check(result: int, what: str) -> int:
    if result < 0:
        raise Refused(f"{what}: {os.strerror(ctypes.get_errno())}")
    return result


# -- namespaces ---------------------------------------------------------------------------------


def _enter_namespaces(root: bool, network: bool) -> None:
    flags = CLONE_NEWPID | (0 if network else CLONE_NEWNET)
    if root:
        _check(_libc.unshare(flags), "unshare (network and PID namespaces)")
        return
    uid, gid = os.getuid(), os.getgid()
    _check(_libc.unshare(flags | CLONE_NEWUSER), "unshare (user, network and PID namespaces)")
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")


def _open_reach(plan: dict) -> None:
    """Bring the namespace's loopback up, listen on each address of ``reach`` and hand the
    listening sockets to the parent (outside, it accepts and connects on)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sh22x", b"lo", 0)
        flags = struct.unpack("16sh22x", fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh22x", b"lo", flags | IFF_UP))
    listeners = []
    for host, port in plan["reach"]:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((host, port))
        listener.listen(64)
        listeners.append(listener)
    with socket.socket(fileno=plan["bridge_fd"]) as bridge:
        socket.send_fds(bridge, [b"reach"], [listener.fileno() for listener in listeners])
    for listener in listeners:
        listener.close()


# -- process count ------------------------------------------------------------------------------


def _user_tasks(uid: int) -> int:
    """Tasks (processes and threads) the user runs now: what RLIMIT_NPROC counts before Linux 5.14."""
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                n += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            continue
    return n


def _counts_per_namespace() -> bool:
    """Linux 5.14 and later count RLIMIT_NPROC per user namespace: in the new one, only the
    launcher and what it starts."""
    version = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return version is not None and (int(version[1]), int(version[2])) >= (5, 14)


def _limit_processes(plan: dict, root: bool) -> None:
    limit = plan["processes"]
    if not limit:
        return
    if root:  # RLIMIT_NPROC does not bind root: a pids cgroup does
        cgroup = plan["cgroup"]
        if not cgroup:
            raise Refused("no pids cgroup to hold the process-count limit")
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        return
    soft = 1 + limit if _counts_per_namespace() else _user_tasks(os.getuid()) + limit  # + the launcher
    resource.setrlimit(resource.RLIMIT_NPROC, (soft, soft))


# -- Landlock -----------------------------------------------------------------------------------


def _confine_writes(workdir: str) -> None:
    """Writes, creations, removals and truncations only beneath ``workdir`` (and to /dev/null)."""
    abi = _libc.syscall(LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        raise Refused(f"Landlock is not available: {os.strerror(ctypes.get_errno())}")
    write_file, truncate = 1 << 1, (1 << 14 if abi >= 3 else 0)
    tree = write_file | sum(1 << b for b in range(4, 13)) | (1 << 13 if abi >= 2 else 0) | truncate
    handled = ctypes.c_uint64(tree)
    ruleset = _check(
        _libc.syscall(LANDLOCK_CREATE_RULESET, ctypes.byref(handled), ctypes.c_size_t(8), ctypes.c_uint32(0)),
        "landlock_create_ruleset",
    )

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    for path, allowed in ((workdir, tree), ("/dev/null", write_file | truncate)):
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = PathBeneath(allowed, fd)
        _check(
            _libc.syscall(
                LANDLOCK_ADD_RULE, ruleset, ctypes.c_int(1), ctypes.byref(rule), ctypes.c_uint32(0)
            ),
            f"landlock_add_rule {path}",
        )
        os.close(fd)
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _check(_libc.syscall(LANDLOCK_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)), "landlock_restrict_self")
    os.close(ruleset)


# -- Unix sockets ----------------------------------------------------------------------------


def _deny_unix_sockets() -> None:
    """A seccomp filter: ``socket(AF_UNIX, ...)`` fails with EACCES, so no Unix socket on the
    host (a file in /tmp, the Ray node's, a container runtime's) can be connected to; a
    program of another architecture (32-bit, x32) is killed at its first system call."""
    arch = SECCOMP_ARCH.get(os.uname().machine)
    if arch is None:
        raise Refused(f"no seccomp filter for {os.uname().machine}")
    audit, nr_socket = arch
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, deny, kill = 0x7FFF0000, 0x00050000 | EACCES, 0x80000000

    class Instruction(ctypes.Structure):
        _fields_ = [
            ("code", ctypes.c_uint16),
            ("jt", ctypes.c_uint8),
            ("jf", ctypes.c_uint8),
            ("k", ctypes.c_uint32),
        ]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Instruction))]

    program = [
        (ld, 0, 0, 4),  # seccomp_data.arch
        (jeq, 0, 7, audit),  # another architecture: kill
        (ld, 0, 0, 0),  # seccomp_data.nr
        (jge, 5, 0, 0x40000000),  # x32 numbers: kill
        (jeq, 0, 2, nr_socket),
        (ld, 0, 0, 16),  # args[0], its low half: the family
        (jeq, 1, 0, AF_UNIX),
        (ret, 0, 0, allow),
        (ret, 0, 0, deny),
        (ret, 0, 0, kill),
    ]
    filters = (Instruction * len(program))(*(Instruction(*i) for i in program))
    fprog = Program(len(program), filters)
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp")


# -- capabilities and limits --------------------------------------------------------------------


def _drop_capabilities() -> None:
    """An empty bounding set (an exec cannot regain any) and empty capability sets."""
    for cap in range(64):
        _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the last capability

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [
            ("effective", ctypes.c_uint32),
            ("permitted", ctypes.c_uint32),
            ("inheritable", ctypes.c_uint32),
        ]

    number = CAPSET.get(os.uname().machine)
    if number is not None:
        data = (Data * 2)()
        _check(_libc.syscall(number, ctypes.byref(Header(0x20080522, 0)), data), "capset")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def _set_limits(plan: dict) -> None:
    cpu, memory = plan["cpu_s"], plan["memory_bytes"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (plan["file_bytes"], plan["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (plan["open_files"], plan["open_files"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


# -- the launch ---------------------------------------------------------------------------------


def main() -> None:
    plan = json.loads(sys.argv[1])
    root, workdir = os.getuid() == 0, plan["workdir"]
    try:
        _enter_namespaces(root, plan["network"])
        if plan["reach"]:
            _open_reach(plan)
        _limit_processes(plan, root)
    except (Refused, OSError) as e:
        _refuse(f"sandbox: {e}")
    pid = os.fork()  # the first child of a new PID namespace is its init
    if pid:
        _wait_and_relay(pid)
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the launcher killed: so is the program
    try:
        if not plan["writes_outside"]:
            _confine_writes(workdir)
        _drop_capabilities()
        if not plan["network"]:
            _deny_unix_sockets()
        _set_limits(plan)
    except (Refused, OSError) as e:
        _refuse(f"sandbox: {e}")
    os.chdir(workdir)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
    env.update(plan["env"])
    try:
        os.execve(plan["argv"][0], plan["argv"], env)
    except OSError as e:
        _refuse(f"sandbox: cannot run {plan['argv'][0]}: {e}")


def _wait_and_relay(pid: int) -> None:
    """The launcher outside the namespace: wait for its init and end as it did (killed by a
    signal: by the same signal)."""
    signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGKILL))
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:  # its handler cannot be set, nor need be
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _refuse(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    os._exit(126)


if __name__ == "__main__":
    main()
