"""Run by ``test_sandbox.py`` as an unprivileged user: the sandbox's unprivileged path (a user
namespace, ``RLIMIT_NPROC``) against a loopback connection, a write outside and a fork bomb.
Argument: the site-packages directory holding loong_agentflow. Prints one JSON object."""

import json
import os
import site
import socket
import sys
import tempfile

site.addsitedir(sys.argv[1])
from loong_agentflow.sandbox import Sandbox, SandboxLimits

BOMB = """import os, time
n = 0
try:
    while n < 100:
        if os.fork() == 0:
            time.sleep(2)
            os._exit(0)
        n += 1
except OSError as e:
    print(n, type(e).__name__)
"""

box = Sandbox(SandboxLimits(wall_s=8, processes=8))
server = socket.create_server(("127.0.0.1", 0))
mine = tempfile.mkdtemp()  # this user's own: only the sandbox stops the write
seen = {"uid": os.getuid(), "inner_uid": box.run_python("import os; print(os.getuid())").stdout.strip()}
connect = f'import socket; socket.create_connection(("127.0.0.1", {server.getsockname()[1]}), timeout=2)'
seen["connect"] = box.run_python(connect).stderr.strip().splitlines()[-1]
seen["write"] = box.run_python(f'open("{mine}/escaped", "w")').stderr.strip().splitlines()[-1]
seen["escaped"] = os.path.exists(f"{mine}/escaped")
seen["forks"] = box.run_python(BOMB).stdout.split()
print(json.dumps(seen))
