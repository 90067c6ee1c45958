"""Warnings with a traceback, at most one a place per EVERY_S (kvguard.ops.throttled_log)."""

from __future__ import annotations

import logging

import pytest

from kvguard.ops.throttled_log import EVERY_S, ThrottledWarnings
from tests.clock import Clock

log = logging.getLogger("kvguard.test")


def refused(place: int) -> BaseException:
    """An exception raised at one of two places."""
    try:
        if place == 1:
            raise RuntimeError("busy")
        raise RuntimeError("busy")
    except RuntimeError as exc:
        return exc


def test_one_warning_a_place_per_interval_then_how_many_came_between(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvguard.test")
    clock = Clock(100.0)
    warnings = ThrottledWarnings(log, clock)
    for request in range(5):
        warnings.warning(refused(1), "refused request %s", request)
        clock.now += 1
    warnings.warning(refused(2), "refused request %s", "elsewhere")
    clock.now += EVERY_S
    warnings.warning(refused(1), "refused request %s", 9)
    assert [r.getMessage() for r in caplog.records] == [
        "refused request 0",
        "refused request elsewhere",
        "refused request 9 (4 more since the last such warning, 15 s ago)",
    ]
    assert all(r.exc_info for r in caplog.records)
    assert "test_throttled_log.py" in caplog.text  # the traceback, not only a line
