"""server.workers > 1: a worker's side of the pod's one Prometheus endpoint, and its report.

A supervised worker serves its own exposition on an ephemeral loopback port (`listen_address`)
and writes that port to a pipe its supervisor made before the fork (`announce`); the supervisor
reads it from its end (`read_port`: the pipe's format stays in this one module), then the
exposition on that port (kvguard.ops.pod_endpoint). The pipe's write end, `report_fd`, is handed
down from the supervisor to the worker's serve (kvguard.app) and on to telemetry.setup; it is
None in a process that no supervisor with metrics_listen started.
"""

from __future__ import annotations

import os

LOOPBACK = "127.0.0.1"


def listen_address(configured: str, report_fd: int | None) -> str:
    """Where this process serves Prometheus: an ephemeral loopback port in a supervised worker
    (`report_fd` given: the supervisor serves `configured` for the pod), else `configured` (""
    for none)."""
    return f"{LOOPBACK}:0" if configured and report_fd is not None else configured


def announce(report_fd: int | None, port: int) -> None:
    """Tell the supervisor, if there is one, which port this worker's exposition is on, and
    close `report_fd`: call it once."""
    if report_fd is None:
        return
    try:
        os.write(report_fd, f"{port}\n".encode())
    finally:
        os.close(report_fd)


def read_port(fd: int) -> int | None:
    """The port a worker wrote on its pipe (`fd` readable); None when it closed it unsaid."""
    data = os.read(fd, 64)
    return int(data) if data.strip().isdigit() else None
