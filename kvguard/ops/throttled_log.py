"""Warnings that come with a traceback and may come hundreds of times a second under overload
(kvguard's own 503 internal_error when too much counting is queued): each place one is raised
from logs its traceback at most once per EVERY_S; those in between are only counted, and the
next warning from there says how many there were. The decision log still has each request."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

EVERY_S = 10.0


class ThrottledWarnings:
    """Not thread-safe: for one event loop."""

    def __init__(self, logger: logging.Logger, clock: Callable[[], float] = time.monotonic):
        self._logger = logger
        self._clock = clock
        self._last: dict[tuple[str, int], tuple[float, int]] = {}  # where: (logged at, since)

    def warning(self, exc: BaseException, message: str, *args: object) -> None:
        """`message % args` with `exc`'s traceback, unless one raised from the same place was
        logged less than EVERY_S ago."""
        where = _raised_at(exc)
        now = self._clock()
        last = self._last.get(where)
        if last is not None and now - last[0] < EVERY_S:
            self._last[where] = (last[0], last[1] + 1)
            return
        self._last[where] = (now, 0)
        if last is not None and last[1]:
            message += " (%d more since the last such warning, %.0f s ago)"
            args = (*args, last[1], now - last[0])
        self._logger.warning(message, *args, exc_info=exc)


def _raised_at(exc: BaseException) -> tuple[str, int]:
    """The file and line `exc` was raised at (a few frames to walk; no source is read)."""
    tb = exc.__traceback__
    if tb is None:
        return "", 0
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename, tb.tb_lineno
