"""The leases of open streams: renewed while their response runs, released exactly once."""

from __future__ import annotations

import asyncio
import logging

from kvguard.ledger import Lease, Ledger

# Lease goes with the keeper: callers hold leases without importing the ledger.
__all__ = ["Lease", "LeaseKeeper"]

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

    def forget(self, lease_id: str) -> None:
        """Stop holding a lease that someone else releases (an operator, through the admin API):
        no renewal may record it again."""
        self._open.pop(lease_id, None)

    def release(self, lease: Lease) -> None:
        """Start releasing `lease` if it is still held; never raises, never blocks."""
        if self._open.pop(lease.lease_id, None) is None:
            return
        self._start_release(lease)

    def _start_release(self, lease: Lease) -> None:
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

    def snapshot(self) -> list[Lease]:
        """The leases held now (open streams), for re-asserting them in the ledger."""
        return list(self._open.values())

    async def renew_forever(self) -> None:
        """Renew open leases every third of the lease time, so a long stream keeps its blocks."""
        interval = self._lease_seconds / 3
        while True:
            await asyncio.sleep(interval)
            try:
                await self.renew_all()
            except Exception:
                log.exception("renewing %d open leases failed", len(self._open))

    async def renew_all(self) -> int:
        """Re-assert every open lease in one ledger call (one script call per pool on Redis):
        renewed for the lease time, or recorded again if the ledger lost it (a Redis that
        restarted empty converges to the open streams). Returns how many were recorded again."""
        leases = self.snapshot()
        if not leases:
            return 0
        try:
            added = await self._ledger.reassert(leases, self._lease_seconds)
        finally:
            # A release that reached the ledger before the re-assert would be undone by it:
            # release those again (release is idempotent), also when this renewal is cancelled
            # after its re-assert went out (at shutdown). settle() waits for them.
            for lease in leases:
                if lease.lease_id not in self._open:
                    self._start_release(lease)
        if added:
            log.warning("%d open leases were missing from the ledger and were re-asserted", added)
        return added

    async def settle(self) -> None:
        """Wait until every release started so far has reached the ledger."""
        while self._releasing:
            await asyncio.gather(*self._releasing, return_exceptions=True)

    async def release_all(self) -> None:
        for lease in list(self._open.values()):
            self.release(lease)
        await self.settle()
