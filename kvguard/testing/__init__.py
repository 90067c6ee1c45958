"""Real-process helpers for the tests and the benchmarks: Envoy, redis-server, vLLM, a
recording upstream and a streaming one. Test support, left out of the wheel."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A loopback port free now (the process that binds it later leaves a small race)."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])
