"""The unit tests' clock: it moves only when a test moves it."""

from __future__ import annotations


class Clock:
    """A `() -> float` clock in seconds that reads `now`; tests advance it instead of sleeping."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
