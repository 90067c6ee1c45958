"""cancel_and_wait ends background tasks, also those whose first cancellation a library lost."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from kvguard.tasks import cancel_and_wait


async def _loses_its_first_cancellation(started: asyncio.Event) -> None:
    """What a loop around a redis-py call does when Python 3.11's wait_for loses the cancel."""
    started.set()
    # Lost, as wait_for loses it when the awaited call finishes at that moment.
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.Event().wait()
    await asyncio.Event().wait()  # the loop's next round


async def test_a_task_whose_cancellation_was_lost_is_cancelled_again() -> None:
    started = asyncio.Event()
    task = asyncio.create_task(_loses_its_first_cancellation(started))
    await started.wait()
    await asyncio.wait_for(cancel_and_wait([task], again_s=0.01), timeout=5)
    assert task.cancelled()


async def test_without_a_second_cancellation_such_a_task_runs_on() -> None:
    started = asyncio.Event()
    task = asyncio.create_task(_loses_its_first_cancellation(started))
    await started.wait()
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=0.05)
    assert not done  # what a stop awaiting it would wait on forever
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_ended_and_failed_tasks_are_waited_for_and_failures_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    failed = asyncio.create_task(fails(), name="failing-loop")
    finished = asyncio.create_task(asyncio.sleep(0))
    await asyncio.wait([failed, finished])
    running = asyncio.create_task(asyncio.Event().wait())
    with caplog.at_level(logging.ERROR, logger="kvguard.tasks"):
        await asyncio.wait_for(cancel_and_wait([failed, finished, running]), timeout=5)
    assert running.cancelled()
    assert [r.getMessage() for r in caplog.records] == ["background task failing-loop failed"]
