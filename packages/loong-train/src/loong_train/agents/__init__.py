"""Agent programs that ship with Loong, run as black-box episodes (``[agent] kind = "blackbox"``).

Each is a plain script speaking the OpenAI API to the AgentFlow proxy that its rollout worker
hosts; nothing here imports torch, ray or the ``openai`` SDK at import time.
"""

from __future__ import annotations

import importlib.util
import sys

__all__ = ["CALC_AGENT_PRELOAD", "calc_agent_argv", "missing_openai"]

CALC_AGENT_PRELOAD = ["openai", "loong_train.tasks.calc"]
"""What the calc agent imports: its episodes fork from a process that imported these once."""


def calc_agent_argv() -> list[str]:
    """The command of the shipped calc agent: this interpreter, ``-m loong_train.agents.calc_agent``."""
    return [sys.executable, "-m", "loong_train.agents.calc_agent"]


def missing_openai() -> str | None:
    """Why the shipped agents cannot run here (the ``openai`` package is absent), or None."""
    if importlib.util.find_spec("openai") is not None:
        return None
    return (
        "agent.kind = 'blackbox' runs the shipped calc agent, an openai-SDK program, but the 'openai' "
        f"package is not installed for {sys.executable}: install it (pip install 'loong-train[blackbox]') "
        "or set agent.command to your own agent program"
    )
