"""`server.workers: N`: N processes serving one port (SO_REUSEPORT), forked by a small
supervisor before any gRPC object, thread or tokenizer exists (none of them survive a fork).

The supervisor forwards SIGTERM/SIGINT to every worker, restarts a worker that dies on its own
(unless they keep dying), and exits 0 only when every worker drained and exited 0. With
metrics_listen set it serves the pod's one Prometheus endpoint there, the merge of its workers'
(kvguard.ops.pod_endpoint). It does all of it on one thread, from one select loop: deaths
(SIGCHLD, through a wakeup pipe), the workers' port announcements and the scrapes. It holds no
thread when it forks again.

SIGTERM, SIGINT and SIGCHLD are blocked from just before a fork until the new pid is recorded
(in the worker: until its own handlers are set), and no fork starts once a stop has begun: a
stop signals every worker, however close to a fork it comes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import selectors
import signal
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import NoReturn

from kvguard.ops import logs, worker_metrics
from kvguard.ops.pod_endpoint import PodEndpoint

log = logging.getLogger(__name__)

# More crashes than this within the window: something is wrong with every worker, stop.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
# Held back across a fork: the supervisor's handlers read and write what the fork changes.
_HELD_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGCHLD}


def supervise(
    workers: int, run_worker: Callable[[int, int | None], int], metrics_listen: str = ""
) -> int:
    """Fork `workers` processes running `run_worker(index, report_fd)`; returns the exit status.
    `report_fd`, with metrics_listen set, is the pipe the worker announces its exposition's
    port on (kvguard.ops.worker_metrics), else None. OSError when metrics_listen cannot be
    bound (before any worker starts)."""
    endpoint = PodEndpoint(metrics_listen) if metrics_listen else None
    return _Supervisor(run_worker, endpoint).run(workers)


class _Supervisor:
    def __init__(
        self, run_worker: Callable[[int, int | None], int], endpoint: PodEndpoint | None
    ) -> None:
        self._run_worker = run_worker
        self._endpoint = endpoint
        self._children: dict[int, int] = {}  # pid -> worker index
        self._reports: dict[int, int] = {}  # worker index -> the read end of its port's pipe
        self._stopping = False
        self._failed = False
        self._restarts: list[float] = []
        self._selector = selectors.DefaultSelector()
        self._wakeup = os.pipe()  # SIGCHLD writes here (signal.set_wakeup_fd)
        for fd in self._wakeup:
            os.set_blocking(fd, False)

    def run(self, workers: int) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that it wakes the loop
        signal.set_wakeup_fd(self._wakeup[1])
        self._selector.register(self._wakeup[0], selectors.EVENT_READ, self._drain_wakeup)
        if self._endpoint is not None:
            self._selector.register(self._endpoint, selectors.EVENT_READ, self._scraped)
        try:
            for index in range(workers):
                self._spawn(index)
            log.info(
                "supervising %d kvguard workers: %s", len(self._children), sorted(self._children)
            )
            while self._children:
                self._turn()
        finally:
            self._close()
        return 1 if self._failed else 0

    def _turn(self) -> None:
        """Wait for something to do, then do it: deaths, announcements, scrapes, a read."""
        endpoint = self._endpoint
        timeout = endpoint.seconds_to_read() if endpoint is not None else None
        for key, _ in self._selector.select(timeout):
            key.data(key.fileobj)
        self._reap()
        if endpoint is not None and endpoint.seconds_to_read() == 0:
            endpoint.read_workers()  # between scrapes too: what a killed worker can lose

    def _drain_wakeup(self, fd: int) -> None:
        while True:
            try:
                if not os.read(fd, 512):
                    return
            except BlockingIOError:
                return

    def _scraped(self, endpoint: PodEndpoint) -> None:
        endpoint.serve_one()

    def _reported(self, index: int, fd: int) -> None:
        """A worker wrote its exposition's port on its pipe, or closed it (it died first)."""
        port = worker_metrics.read_port(fd)
        if port is not None and self._endpoint is not None:
            self._endpoint.serving(index, port)
        self._forget_report(index)

    def _forget_report(self, index: int) -> None:
        fd = self._reports.pop(index, None)
        if fd is not None:
            self._selector.unregister(fd)
            os.close(fd)

    def _spawn(self, index: int) -> bool:
        """Fork worker `index`, unless a stop has begun (False). The signals a stop comes by
        wait until the pid is in _children, so _stop signals it too."""
        with logs.writer_stopped():  # no thread left to take a signal the loop must see
            held = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
            try:
                if self._stopping:
                    return False
                report = os.pipe() if self._endpoint is not None else None
                pid = os.fork()
                if pid == 0:  # the worker: never returns into the supervisor's code
                    self._become_worker(index, report, held)
                self._children[pid] = index
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)
        if report is not None:
            os.close(report[1])
            self._reports[index] = report[0]
            self._selector.register(
                report[0], selectors.EVENT_READ, functools.partial(self._reported, index)
            )
        return True

    def _become_worker(
        self, index: int, report: tuple[int, int] | None, mask: Iterable[int]
    ) -> NoReturn:
        code = 1
        try:
            # Until the worker's own handlers drain it, a stop finds nothing to drain: exit 0.
            # Set before the signals held since the fork come through (`mask`: the one before).
            signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
            signal.signal(signal.SIGINT, lambda *_: os._exit(0))
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.set_wakeup_fd(-1)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            self._close_in_worker()
            if report is not None:
                os.close(report[0])  # the supervisor's end of this worker's own pipe
            code = self._run_worker(index, report[1] if report is not None else None)
        finally:
            logs.stop()  # os._exit runs no atexit hook: write what is queued first
            os._exit(code)

    def _close_in_worker(self) -> None:
        """Close the supervisor's descriptors in a worker: a listening metrics_listen would
        outlive the supervisor there. Closing the selector drops no registration: the
        supervisor's selector is the same kernel object."""
        self._selector.close()
        for fd in (*self._wakeup, *self._reports.values()):
            os.close(fd)
        if self._endpoint is not None:
            self._endpoint.close()

    def _reap(self) -> None:
        while self._children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            index = self._children.pop(pid, None)
            if index is not None:
                self._exited(index, pid, os.waitstatus_to_exitcode(status))

    def _exited(self, index: int, pid: int, code: int) -> None:
        self._forget_report(index)
        if self._endpoint is not None:
            self._endpoint.died(index)
        if self._stopping:
            self._failed |= code != 0
            return
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_S] + [now]
        if len(self._restarts) > MAX_RESTARTS:
            log.error(
                "workers keep exiting (%d in %.0fs): stopping",
                len(self._restarts),
                RESTART_WINDOW_S,
            )
            self._failed = True
            self._stop(signal.SIGTERM, None)
            return
        log.error("worker %d (pid %d) exited with %d; starting it again", index, pid, code)
        if self._spawn(index) and self._endpoint is not None:
            self._endpoint.restarted()

    def _stop(self, signum: int, _frame: FrameType | None) -> None:
        self._stopping = True
        for pid in list(self._children):
            with contextlib.suppress(ProcessLookupError):  # reaped, not yet forgotten
                os.kill(pid, signum)

    def _close(self) -> None:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for index in list(self._reports):
            self._forget_report(index)
        self._selector.close()
        for fd in self._wakeup:
            os.close(fd)
        if self._endpoint is not None:
            self._endpoint.close()
