"""Every 503 internal_error kvguard answers leaves its traceback in the log: a fault, and the
refusal of a large prompt while too much counting is queued (that one at most once per
kvguard.ops.throttled_log.EVERY_S: under overload it comes for many requests a second)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from kvguard.app import Service
from kvguard.ops import throttled_log
from tests.extproc.harness import body, exchange, headers, refusal, running

# Above kvguard.tokens.counting.INLINE_BODY_BYTES: counted on a thread, where the backlog applies.
LARGE = {"model": "qwen", "messages": [{"role": "user", "content": "word " * 2000}]}


def _ledger_fault(service: Service, monkeypatch: pytest.MonkeyPatch) -> str:
    async def broken(*_: object) -> None:
        raise RuntimeError("ledger exploded")

    monkeypatch.setattr(service.admission.ledger, "reserve", broken)
    return "ledger exploded"


def _counting_backlog(service: Service, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(service.admission.counter, "_too_busy", lambda _bytes: True)
    return "kvguard/tokens/counting.py"  # where the refusal was raised


@pytest.mark.parametrize("cause", [_ledger_fault, _counting_backlog])
async def test_an_internal_error_answer_logs_its_traceback(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    cause: Callable[[Service, pytest.MonkeyPatch], str],
) -> None:
    caplog.set_level(logging.WARNING, logger="kvguard.extproc.service")
    async with running(tmp_path) as (service, stub):
        expected = cause(service, monkeypatch)
        _, (_, answer) = await exchange(
            stub, headers("/v1/chat/completions", {"x-request-id": "r-1"}), body(LARGE)
        )
        status, hdrs, error = refusal(answer)
        assert (status, hdrs["x-kvguard-reason"]) == (503, "internal_error")
        assert error["error"]["code"] == "internal_error"
        (record,) = [r for r in caplog.records if r.exc_info]
        assert "r-1" in record.getMessage()
        assert expected in caplog.text  # the traceback, not only a line


async def test_busy_refusals_log_their_traceback_once_not_for_each(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(throttled_log, "EVERY_S", math.inf)  # the next one never comes
    caplog.set_level(logging.WARNING, logger="kvguard.extproc.service")
    async with running(tmp_path) as (service, stub):
        _counting_backlog(service, monkeypatch)
        for request in range(3):
            _, (_, answer) = await exchange(
                stub,
                headers("/v1/chat/completions", {"x-request-id": f"r-{request}"}),
                body(LARGE),
            )
            assert refusal(answer)[2]["error"]["code"] == "internal_error"
        (record,) = [r for r in caplog.records if r.exc_info]
        assert "r-0" in record.getMessage()
