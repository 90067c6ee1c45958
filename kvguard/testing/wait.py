"""Waiting on a condition with a deadline: the one way tests wait for something to happen.

A test never sleeps to let something happen; it polls the condition that says it has happened,
and fails, naming what it waited for, when the deadline passes first. `wait_until` is for
coroutines (the condition may itself be async); `wait_until_sync` for plain threads.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_POLL_S = 0.01

Description = str | Callable[[], str]


class WaitTimeout(AssertionError):
    """A condition did not hold before its deadline (an AssertionError, so pytest reports a
    failed check, and callers may catch it as one)."""


def _failure(what: Description, timeout_s: float) -> WaitTimeout:
    text = what() if callable(what) else what
    return WaitTimeout(f"still waiting after {timeout_s:g} s for {text}")


async def wait_until(
    condition: Callable[[], bool | Awaitable[bool]],
    what: Description,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    poll_s: float = DEFAULT_POLL_S,
) -> None:
    """Return once `condition()` (awaited when it returns an awaitable) is true, checking it
    every `poll_s` seconds; after `timeout_s` seconds raise WaitTimeout, "still waiting for
    `what`" (a callable `what` is called then, so that it can describe the state it found)."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if time.monotonic() >= deadline:
            raise _failure(what, timeout_s)
        await asyncio.sleep(poll_s)


def wait_until_sync(
    condition: Callable[[], bool],
    what: Description,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    poll_s: float = DEFAULT_POLL_S,
) -> None:
    """`wait_until` for code outside an event loop: blocks the calling thread while it polls."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            raise _failure(what, timeout_s)
        time.sleep(poll_s)
