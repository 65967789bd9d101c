"""The reward: the model's function, run against the row's hidden unit tests in a sandbox (no
network, a private directory, 5 s, 512 MB, 8 processes). 1 if every test passes, else 0.

``sandboxed`` (logged as ``reward/sandboxed``) is 1 when the test program saw itself as the init
of its own PID namespace, which only the sandbox gives it.
"""

import re

from loong_agentflow import Sandbox, SandboxLimits

BOX = Sandbox(SandboxLimits(wall_s=5, cpu_s=5, memory_mb=512, processes=8, output_bytes=2048))
FENCE = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)
HARNESS = """import os
print(os.getpid(), flush=True)
exec(compile(open("solution.py").read(), "solution.py", "exec"))  # the model's code: it may not compile
{checks}
print("passed")
"""


def score(completion: str, metadata: dict) -> dict:
    code = m.group(1) if (m := FENCE.search(completion)) else completion
    checks = "\n".join(f"assert {t}, {t!r}" for t in metadata["tests"])
    result = BOX.run_python(HARNESS.format(checks=checks), files={"solution.py": code})
    lines = result.stdout.split("\n")
    return {"score": float(result.ok and "passed" in lines), "sandboxed": float(lines[0] == "1")}
