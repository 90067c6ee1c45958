"""Stopping background tasks even when a library swallows their cancellation.

On Python 3.11, `asyncio.wait_for` returns the awaited call's result when a cancellation arrives
just as that call finishes, and the cancellation is lost (CPython gh-86296, fixed in 3.12).
redis-py sends every command under `wait_for`, so a background loop on the Redis ledger can miss
its cancellation and run on, and a stop that awaited it once would wait forever. A stop cancels
again until the task has ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)

# A task still running this long after being cancelled is cancelled again. Long enough for any
# clean-up a cancelled task does here (closing a client session); a lost cancellation costs
# one interval more.
CANCEL_AGAIN_S = 1.0


async def cancel_and_wait(
    tasks: Iterable[asyncio.Task[Any]], *, again_s: float = CANCEL_AGAIN_S
) -> None:
    """Cancel `tasks` and return once every one has ended; a task that runs on (its
    cancellation lost) is cancelled again every `again_s`. A task that failed is logged."""
    tasks = list(tasks)
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()  # a no-op on a task that has ended
        _, pending = await asyncio.wait(pending, timeout=again_s)
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s failed", task.get_name(), exc_info=task.exception())
