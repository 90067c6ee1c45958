"""`server.workers: N`: N processes serving one port (SO_REUSEPORT), forked by a small
supervisor before any gRPC object, thread or tokenizer exists (none of them survive a fork).

The supervisor forwards SIGTERM/SIGINT to every worker, restarts a worker that dies on its own
(unless they keep dying), and exits 0 only when every worker drained and exited 0.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from types import FrameType

from kvguard.ops import logs

log = logging.getLogger(__name__)

# More crashes than this within the window: something is wrong with every worker, stop.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0


def supervise(workers: int, run_worker: Callable[[int], int]) -> int:
    """Fork `workers` processes running `run_worker(index)`; returns the exit status."""
    children: dict[int, int] = {}  # pid -> worker index
    stopping = False
    restarts: list[float] = []
    failed = False

    def spawn(index: int) -> None:
        with logs.writer_stopped():
            pid = os.fork()
        if pid == 0:  # the worker: never returns into the supervisor's code
            # Until the worker's own handlers drain it, a stop finds nothing to drain: exit 0.
            signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
            signal.signal(signal.SIGINT, lambda *_: os._exit(0))
            code = 1
            try:
                code = run_worker(index)
            finally:
                logs.stop()  # os._exit runs no atexit hook: write what is queued first
                os._exit(code)
        children[pid] = index

    def stop(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for pid in children:
            os.kill(pid, signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for index in range(workers):
        spawn(index)
    log.info("supervising %d kvguard workers: %s", workers, sorted(children))
    while children:
        pid, status = os.wait()
        index = children.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if stopping:
            failed |= code != 0
            continue
        now = time.monotonic()
        restarts = [t for t in restarts if now - t < RESTART_WINDOW_S] + [now]
        if len(restarts) > MAX_RESTARTS:
            log.error(
                "workers keep exiting (%d in %.0fs): stopping", len(restarts), RESTART_WINDOW_S
            )
            failed = True
            stop(signal.SIGTERM, None)
            continue
        log.error("worker %d (pid %d) exited with %d; starting it again", index, pid, code)
        spawn(index)
    return 1 if failed else 0
