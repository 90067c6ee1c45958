"""A ledger whose re-assert lands while its caller may already have given up: the race between
a renewal (or a growth) and a release, for the lease keeper's tests."""

from __future__ import annotations

import asyncio

from kvguard.ledger import Lease
from kvguard.ledger.memory import MemoryLedger


class LateReassert:
    """A memory ledger whose re-assert waits for a connection (`sent`), then lands in the ledger
    at once and waits for its answer (`answered`): a command on the wire lands whether or not its
    caller still waits."""

    def __init__(self, ledger: MemoryLedger) -> None:
        self.ledger = ledger
        self.sent, self.answered = asyncio.Event(), asyncio.Event()
        self.waiting = asyncio.Event()

    async def reassert(self, leases: list[Lease], lease_seconds: float) -> int:
        self.waiting.set()
        await self.sent.wait()
        added = await self.ledger.reassert(leases, lease_seconds)
        await self.answered.wait()
        return added

    async def release(self, lease: Lease) -> None:
        await self.ledger.release(lease)
