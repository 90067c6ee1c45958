"""Where gRPC's core does its I/O: set before grpc is first imported in a serving process.

By default (grpcio 1.80 and later) Python's gRPC reads and writes sockets on EventEngine threads,
which hand every message to the thread that polls the completion queue, which wakes the event
loop. On the one CPU a sidecar has, each handoff is a context switch. With these two EventEngine
experiments off, the polling thread does the I/O itself: fewer context switches and less kernel
time per request (bench/bench_overhead.py measures kvguard's CPU per request).

The experiments exist until gRPC removes them; tests/ops/test_grpc_io.py checks that
the pinned grpcio still honours them. A GRPC_EXPERIMENTS already in the environment wins.
"""

from __future__ import annotations

import os

EXPERIMENTS = "-event_engine_listener,-event_engine_for_all_other_endpoints"


def io_on_polling_thread() -> None:
    """Before grpc's first import: its I/O on the thread that polls the completion queue."""
    os.environ.setdefault("GRPC_EXPERIMENTS", EXPERIMENTS)
