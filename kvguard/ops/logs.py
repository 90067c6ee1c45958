"""Structured JSON logs on stderr: one object per line, with the request id and tenant where
there is one. Prompt text and credentials are never logged: decision lines carry counts only.

A record is formatted on the caller's thread and its line queued; a thread of its own writes
the queue, never the caller: a stderr that blocks (a full pipe to the container runtime, a disk
stalled in writeback) must not stop the event loop that answers Envoy, or every decision waits
and Envoy answers 504. The writer wakes every FLUSH_INTERVAL_S (or when a burst fills half the
queue) and writes what is queued at once, not a wake-up per line: each is a context switch and
a handoff of the GIL on the decision path. At most MAX_QUEUED_RECORDS lines wait; past that
lines are dropped, and a warning says how many once there is room again.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from pythonjsonlogger.json import JsonFormatter

LEVELS = ("debug", "info", "warning", "error")
MAX_QUEUED_RECORDS = 10_000
FLUSH_INTERVAL_S = 0.05
WRITE_BATCH = 1_000  # lines per write: what a blocked write holds stays bounded


class _Lines(logging.Handler):
    """Formats each record on the caller's thread and queues its line, without waiting;
    counts what does not fit. Handler.handle holds the handler's lock around emit."""

    def __init__(self, formatter: logging.Formatter) -> None:
        super().__init__()
        self.setFormatter(formatter)
        self.renew()

    def renew(self) -> None:
        """An empty queue (in a forked child too)."""
        self.lines: deque[str] = deque()
        self.wake = threading.Event()
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.lines) >= MAX_QUEUED_RECORDS:  # no room: not even formatted
            self.dropped += 1
            return
        if self.dropped:
            lost = logging.makeLogRecord(
                {
                    "name": __name__,
                    "levelno": logging.WARNING,
                    "levelname": "WARNING",
                    "msg": f"{self.dropped} log records dropped: stderr did not keep up",
                }
            )
            self.dropped = 0
            self._queue(lost)
        self._queue(record)

    def _queue(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(self.format(record))
        except Exception:
            self.handleError(record)
            return
        if len(self.lines) == MAX_QUEUED_RECORDS // 2:
            self.wake.set()


class _Writer:
    """The thread that writes the queued lines to `stream`, until stopped."""

    def __init__(self, lines: _Lines, stream: TextIO) -> None:
        self._lines = lines
        self._stream = stream
        self._stopping = False
        # A daemon: a writer stuck on a blocked stderr never keeps the process from exiting.
        self._thread = threading.Thread(target=self._run, name="kvguard-log-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._lines.wake.wait(FLUSH_INTERVAL_S)
            self._lines.wake.clear()
            stopping = self._stopping  # read before writing: what was queued before stop()
            self._write_queued()
            if stopping:
                return

    def _write_queued(self) -> None:
        queued = self._lines.lines
        while queued:
            batch = [queued.popleft() for _ in range(min(WRITE_BATCH, len(queued)))]
            try:
                self._stream.write("\n".join(batch) + "\n")
                self._stream.flush()
            except (OSError, ValueError):  # stderr itself failed: there is nowhere to say so
                return

    def stop(self, timeout_s: float) -> None:
        """Write what is queued, waiting at most `timeout_s` for a blocked stderr."""
        self._stopping = True
        self._lines.wake.set()
        self._thread.join(timeout_s)


STOP_TIMEOUT_S = 5.0
_lines: _Lines | None = None
_writer: _Writer | None = None


def configure(level: str = "info", *, json: bool = True) -> None:
    global _lines
    formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s")
    if json:
        formatter = JsonFormatter(
            "%(asctime)s %(levelname)s %(name)s %(message)s",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        )
    # What no line shows is not gathered (the logging HOWTO's "Optimization"): the caller's
    # frame, thread and process, a good part of the cost of each decision line.
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    stop()
    _lines = _Lines(formatter)
    start()
    root = logging.getLogger()
    root.handlers[:] = [_lines]
    root.setLevel(level.upper())


def start() -> None:
    """Start the writer thread (configure does)."""
    global _writer
    if _lines is not None and _writer is None:
        _writer = _Writer(_lines, sys.stderr)


def stop() -> None:
    """Write what is queued and stop the writer thread (at exit; before os._exit). Never
    raises; gives up after STOP_TIMEOUT_S when stderr stays blocked."""
    global _writer
    if _writer is not None:
        writer, _writer = _writer, None
        writer.stop(STOP_TIMEOUT_S)


@contextmanager
def writer_stopped() -> Iterator[None]:
    """No writer thread inside (records queue up meanwhile): for os.fork, which copies no
    thread and may copy a lock that one held."""
    stop()
    try:
        yield
    finally:
        start()


def _after_fork_in_child() -> None:
    # A forked worker gets a queue and a writer thread of its own.
    global _writer
    if _lines is not None:
        _lines.renew()
        _writer = None
        start()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(stop)
