"""Structured JSON logs on stderr: one object per line, with the request id and tenant where
there is one. Prompt text and credentials are never logged: decision lines carry counts only.

Records are written by a thread of their own, never by the caller: a stderr that blocks (a full
pipe to the container runtime, a disk stalled in writeback) must not stop the event loop that
answers Envoy. A write that stalled ~6 s did exactly that once: every decision waited, and
Envoy answered 504. At most MAX_QUEUED_RECORDS wait; past that records are dropped, and a
warning says how many once there is room again.
"""

from __future__ import annotations

import atexit
import copy
import logging
import logging.handlers
import os
import queue
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from pythonjsonlogger.json import JsonFormatter

LEVELS = ("debug", "info", "warning", "error")
MAX_QUEUED_RECORDS = 10_000


class _Handoff(logging.handlers.QueueHandler):
    """Puts each record on the writer thread's queue without waiting; counts what does not fit."""

    def __init__(self) -> None:
        super().__init__(queue.Queue(MAX_QUEUED_RECORDS))
        self.dropped = 0

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        # The message is merged here (its arguments may change later); the JSON fields (extra
        # attributes, exc_info) stay on the record for the writer's formatter.
        record = copy.copy(record)
        record.msg, record.args = record.getMessage(), None
        return record

    def enqueue(self, record: logging.LogRecord) -> None:
        if self.dropped:
            lost = logging.LogRecord(
                __name__,
                logging.WARNING,
                __file__,
                0,
                f"{self.dropped} log records dropped: stderr did not keep up",
                None,
                None,
            )
            try:
                self.queue.put_nowait(lost)
                self.dropped = 0
            except queue.Full:
                pass
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1


_handoff: _Handoff | None = None
_writer: logging.Handler | None = None
_listener: logging.handlers.QueueListener | None = None


def configure(level: str = "info", *, json: bool = True) -> None:
    global _handoff, _writer
    writer = logging.StreamHandler(sys.stderr)
    if json:
        writer.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            )
        )
    else:
        writer.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    stop()
    _handoff, _writer = _Handoff(), writer
    start()
    root = logging.getLogger()
    root.handlers[:] = [_handoff]
    root.setLevel(level.upper())


def start() -> None:
    """Start the writer thread (configure does)."""
    global _listener
    if _handoff is not None and _writer is not None and _listener is None:
        _listener = logging.handlers.QueueListener(_handoff.queue, _writer)
        _listener.start()


def stop() -> None:
    """Write what is queued and stop the writer thread (at exit; before os._exit)."""
    global _listener
    if _listener is not None:
        _listener.stop()
        _listener = None


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
    global _listener
    if _handoff is not None:
        _handoff.queue = queue.Queue(MAX_QUEUED_RECORDS)
        _handoff.dropped = 0
        _listener = None
        start()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(stop)
