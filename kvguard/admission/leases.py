"""The leases of open streams: renewed while their response runs, released exactly once."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from kvguard.admission.calibration import DEFAULT_DECODE_RATE, Growth
from kvguard.admission.promises import HoldTimes
from kvguard.ledger import Lease, Ledger

# Lease goes with the keeper: callers hold leases without importing the ledger.
__all__ = ["Lease", "LeaseKeeper"]

log = logging.getLogger(__name__)

# How often growing leases are raised to what their requests hold by now, and how far ahead
# of it a lease that must grow is raised (so that it grows once every few seconds, not at
# every tick).
GROW_INTERVAL_S = 1.0
GROW_AHEAD_S = 1.0


class LeaseKeeper:
    """Owns every lease this process holds until its stream ends.

    `release` is safe to call any number of times: only the first call reaches the ledger.
    """

    def __init__(
        self,
        ledger: Ledger,
        lease_seconds: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        decode_rate: Callable[[str], float | None] = lambda _pool: None,
        trust: Callable[[str], float] = lambda _pool: 1.0,
        grow_ahead_s: float = GROW_AHEAD_S,
        holds: HoldTimes | None = None,
        on_released: Callable[[str], None] = lambda _pool: None,
    ) -> None:
        self._ledger = ledger
        self._lease_seconds = lease_seconds
        self._clock = clock
        self._decode_rate = decode_rate  # tokens/s per sequence of a pool, None while unknown
        self._trust = trust  # how far a pool's reservations trust their estimate (the loop)
        self._grow_ahead_s = grow_ahead_s
        self._open: dict[str, Lease] = {}
        # How long leases were held, learnt as they end: what a refusal's promise reads.
        self.holds = holds if holds is not None else HoldTimes()
        self._since: dict[str, float] = {}  # lease id -> when it was first held
        self._held: dict[tuple[str, str], int] = {}  # (pool, tenant) -> blocks held
        self._on_released = on_released  # a release reached the ledger: blocks are free
        self._growing: dict[str, Growth] = {}
        self._seen: dict[str, int] = {}  # output tokens seen in a growing lease's stream
        self._releasing: set[asyncio.Task[None]] = set()

    def hold(self, lease: Lease, growth: Growth | None = None) -> None:
        """Hold `lease` until its stream ends; with `growth`, its blocks follow its request."""
        held = self._open.get(lease.lease_id)
        self._count(lease, lease.blocks - (held.blocks if held is not None else 0))
        self._open[lease.lease_id] = lease
        self._since.setdefault(lease.lease_id, self._clock())
        if growth is not None and growth.grows:
            self._growing[lease.lease_id] = growth

    def seen(self, lease_id: str, tokens: int) -> None:
        """`tokens` output tokens (of all its sequences) were seen in the lease's stream."""
        growth = self._growing.get(lease_id)
        if growth is not None:
            self._seen[lease_id] = -(-tokens // (len(growth.prompt_tokens) * growth.n))

    def forget(self, lease_id: str) -> None:
        """Stop holding a lease that someone else releases (an operator, through the admin API):
        no renewal may record it again."""
        held = self._open.pop(lease_id, None)
        if held is not None:
            self._count(held, -held.blocks)
        self._since.pop(lease_id, None)
        self._stop_growing(lease_id)

    def release(self, lease: Lease) -> None:
        """Start releasing `lease` if it is still held; never raises, never blocks."""
        held = self._open.pop(lease.lease_id, None)
        if held is None:
            return
        self._count(held, -held.blocks)
        since = self._since.pop(lease.lease_id, None)
        if since is not None:  # its blocks as counted, grown ones included
            self.holds.record(held.pool, held.blocks, self._clock() - since)
        self._stop_growing(lease.lease_id)
        self._start_release(lease)

    def held_blocks(self, pool: str, tenant: str) -> int:
        """Blocks this process holds for `tenant` in `pool` (its open leases, grown ones
        included)."""
        return self._held.get((pool, tenant), 0)

    def _count(self, lease: Lease, blocks: int) -> None:
        key = (lease.pool, lease.tenant)
        total = self._held.get(key, 0) + blocks
        if total:
            self._held[key] = total
        else:
            self._held.pop(key, None)

    def give_back(self, lease: Lease) -> None:
        """Release a lease this keeper never held (admitted for a request that was gone by
        then); never raises, never blocks."""
        if lease.lease_id not in self._open:
            self._start_release(lease)

    def _stop_growing(self, lease_id: str) -> None:
        self._growing.pop(lease_id, None)
        self._seen.pop(lease_id, None)

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
            return
        self._on_released(lease.pool)

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
        return await self._reassert(self.snapshot())

    async def grow_forever(self, interval_s: float = GROW_INTERVAL_S) -> None:
        """Raise growing leases to what their requests hold, every `interval_s` seconds."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.grow_all()
            except Exception:
                log.exception("growing %d leases failed", len(self._growing))

    async def grow_all(self) -> list[Lease]:
        """Count each growing lease's blocks as its request holds them by now (the elapsed time
        at its pool's decode rate, or the tokens seen in its stream, whichever is more; its
        estimate reserved again when the loop lost trust since), and when that is more than it
        counts, as it will hold `grow_ahead_s` later; in one re-assert of the leases that grew,
        always granted, so that the ledger tells the truth. Returns them."""
        now = self._clock()
        grown: list[Lease] = []
        for lease_id, growth in list(self._growing.items()):
            lease = self._open[lease_id]
            rate = self._decode_rate(growth.pool) or DEFAULT_DECODE_RATE
            trust = self._trust(growth.pool)
            seen = self._seen.get(lease_id, 0)
            blocks = growth.blocks_at(now, rate, seen, trust)
            if blocks > lease.blocks:
                blocks = growth.blocks_at(now + self._grow_ahead_s, rate, seen, trust)
                self._count(lease, blocks - lease.blocks)
                lease = self._open[lease_id] = dataclasses.replace(lease, blocks=blocks)
                grown.append(lease)
            if blocks >= growth.limit_blocks:
                self._stop_growing(lease_id)  # at its limit: the worst case, nothing to follow
        await self._reassert(grown)
        return grown

    async def _reassert(self, leases: list[Lease]) -> int:
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
