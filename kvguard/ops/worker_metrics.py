"""server.workers > 1: a worker's side of the pod's one Prometheus endpoint, and its report.

A supervised worker serves its own exposition on an ephemeral loopback port (`listen_address`)
and writes that port to a pipe its supervisor made before the fork (`report_port_to`,
`announce`); the supervisor reads it from its end (`read_port`: the pipe's format stays in
this one module), then the exposition on that port (kvguard.ops.pod_endpoint). The supervisor
calls `report_port_to` in the worker it has just forked, before the worker runs anything else,
and telemetry.setup reads what it set: state of the worker process, as the worker's serve
(kvguard.app) is not handed the pipe.
"""

from __future__ import annotations

import os

LOOPBACK = "127.0.0.1"

_report_fd: int | None = None  # in a supervised worker: the pipe its port goes to


def report_port_to(fd: int) -> None:
    """In a worker, just forked: serve metrics on loopback and announce the port on `fd`."""
    global _report_fd
    _report_fd = fd


def listen_address(configured: str) -> str:
    """Where this process serves Prometheus: an ephemeral loopback port in a supervised worker
    (the supervisor serves `configured` for the pod), else `configured` ("" for none)."""
    return f"{LOOPBACK}:0" if configured and _report_fd is not None else configured


def announce(port: int) -> None:
    """Tell the supervisor, if there is one, which port this worker's exposition is on."""
    global _report_fd
    if _report_fd is None:
        return
    try:
        os.write(_report_fd, f"{port}\n".encode())
    finally:
        os.close(_report_fd)
        _report_fd = None


def read_port(fd: int) -> int | None:
    """The port a worker wrote on its pipe (`fd` readable); None when it closed it unsaid."""
    data = os.read(fd, 64)
    return int(data) if data.strip().isdigit() else None
