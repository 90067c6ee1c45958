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
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from pythonjsonlogger.json import JsonFormatter

LEVELS = ("debug", "info", "warning", "error")
MAX_QUEUED_RECORDS = 10_000


class _Handoff(logging.handlers.QueueHandler):
    """Puts each record on the writer thread's queue without waiting; counts what does not fit."""

    def __init__(self) -> None:
        self.records: queue.Queue[logging.LogRecord | None] = queue.Queue(MAX_QUEUED_RECORDS)
        super().__init__(self.records)
        self.dropped = 0

    def renew(self) -> None:
        """A fresh, empty queue (in a forked child: the parent's may be locked)."""
        self.queue = self.records = queue.Queue(MAX_QUEUED_RECORDS)
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


class _Writer:
    """The thread that writes queued records with `handler`, until it dequeues None."""

    def __init__(self, records: queue.Queue[logging.LogRecord | None], handler: logging.Handler):
        self._records = records
        self._handler = handler
        # A daemon: a writer stuck on a blocked stderr never keeps the process from exiting.
        self._thread = threading.Thread(target=self._run, name="kvguard-log-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (record := self._records.get()) is not None:
            self._handler.handle(record)

    def stop(self, timeout_s: float) -> None:
        """Write what is queued, waiting at most about 2 x `timeout_s` for a blocked stderr."""
        try:
            self._records.put(None, timeout=timeout_s)
        except queue.Full:
            return
        self._thread.join(timeout_s)


STOP_TIMEOUT_S = 5.0
_handoff: _Handoff | None = None
_handler: logging.Handler | None = None
_writer: _Writer | None = None


def configure(level: str = "info", *, json: bool = True) -> None:
    global _handoff, _handler
    handler = logging.StreamHandler(sys.stderr)
    if json:
        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            )
        )
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    stop()
    _handoff, _handler = _Handoff(), handler
    start()
    root = logging.getLogger()
    root.handlers[:] = [_handoff]
    root.setLevel(level.upper())


def start() -> None:
    """Start the writer thread (configure does)."""
    global _writer
    if _handoff is not None and _handler is not None and _writer is None:
        _writer = _Writer(_handoff.records, _handler)


def stop() -> None:
    """Write what is queued and stop the writer thread (at exit; before os._exit). Never
    raises; gives up after ~2 x STOP_TIMEOUT_S when stderr stays blocked."""
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
    if _handoff is not None:
        _handoff.renew()
        _writer = None
        start()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(stop)
