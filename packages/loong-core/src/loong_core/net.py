"""Network helpers shared by Loong's processes and tests."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now: the one the OS picks for a socket bound to port 0,
    closed again before returning. Another process may take it before the caller binds it; it is
    for addresses handed to a peer before their owner listens (a rendezvous, a server's port)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
