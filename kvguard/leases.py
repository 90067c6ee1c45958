"""The leases of open streams: renewed while their response runs, released exactly once."""

from __future__ import annotations

import asyncio
import logging

from kvguard.ledger import Lease, Ledger

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Owns every lease this process holds until its stream ends.

    `release` is safe to call any number of times: only the first call reaches the ledger.
    """

    def __init__(self, ledger: Ledger, lease_seconds: float) -> None:
        self._ledger = ledger
        self._lease_seconds = lease_seconds
        self._open: dict[str, Lease] = {}
        self._releasing: set[asyncio.Task[None]] = set()

    def hold(self, lease: Lease) -> None:
        self._open[lease.lease_id] = lease

    def release(self, lease: Lease) -> None:
        """Start releasing `lease` if it is still held; never raises, never blocks."""
        if self._open.pop(lease.lease_id, None) is None:
            return
        # A task of its own: the stream that ends may be cancelled itself.
        task = asyncio.get_running_loop().create_task(self._release(lease))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _release(self, lease: Lease) -> None:
        try:
            await self._ledger.release(lease)
        except Exception:
            # The lease TTL is the backstop; the blocks come back when it expires.
            log.exception("releasing lease %s failed", lease.lease_id)

    @property
    def open_leases(self) -> int:
        return len(self._open)

    async def renew_forever(self) -> None:
        """Renew open leases every third of the lease time, so a long stream keeps its blocks."""
        interval = self._lease_seconds / 3
        while True:
            await asyncio.sleep(interval)
            for lease in list(self._open.values()):
                try:
                    if not await self._ledger.renew(lease, self._lease_seconds):
                        log.warning("lease %s was gone when renewed", lease.lease_id)
                except Exception:
                    log.exception("renewing lease %s failed", lease.lease_id)

    async def settle(self) -> None:
        """Wait until every release started so far has reached the ledger."""
        while self._releasing:
            await asyncio.gather(*self._releasing, return_exceptions=True)

    async def release_all(self) -> None:
        for lease in list(self._open.values()):
            self.release(lease)
        await self.settle()
