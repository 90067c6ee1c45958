"""The leases of open streams: renewed while their response runs, released exactly once, their
blocks and expected ends following their requests."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from kvguard.admission.calibration import DEFAULT_DECODE_RATE, Growth
from kvguard.ledger import Lease, Ledger

# Lease goes with the keeper: callers hold leases without importing the ledger.
__all__ = ["Lease", "LeaseKeeper"]

log = logging.getLogger(__name__)

# How often growing leases are raised to what their requests hold by now (and leases' expected
# ends checked), and how far ahead of it a lease that must grow is raised (so that it grows once
# every few seconds, not at every tick).
GROW_INTERVAL_S = 1.0
GROW_AHEAD_S = 1.0
# A lease's expected end is sent again when it moved by more than this share of the time left,
# and at least GROW_INTERVAL_S (a rate that changed, a stream seen to be behind or ahead).
END_TOLERANCE = 0.1


class LeaseKeeper:
    """Owns every lease this process holds until its stream ends.

    `release` is safe to call any number of times: only the first call reaches the ledger. A
    lease held with its `Growth` tells the ledger when it is expected to end (its limit less
    what it produced, at its pool's decode rate) whenever that moves, and its blocks follow its
    request when it reserved less than its limit.
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
        on_released: Callable[[str], None] = lambda _pool: None,
    ) -> None:
        self._ledger = ledger
        self._lease_seconds = lease_seconds
        self._clock = clock
        self._decode_rate = decode_rate  # tokens/s per sequence of a pool, None while unknown
        self._trust = trust  # how far a pool's reservations trust their estimate (the loop)
        self._grow_ahead_s = grow_ahead_s
        self._open: dict[str, Lease] = {}
        self._held: dict[tuple[str, str], int] = {}  # (pool, tenant) -> blocks held
        self._on_released = on_released  # a release reached the ledger: blocks are free
        self._progress: dict[str, Growth] = {}  # lease id -> how it follows its request
        self._growing: set[str] = set()  # of those, the leases whose blocks grow
        self._seen: dict[str, int] = {}  # output tokens per sequence seen in its stream
        self._told: dict[str, float] = {}  # lease id -> the end the ledger expects (this clock)
        self._releasing: set[asyncio.Task[None]] = set()

    def hold(self, lease: Lease, growth: Growth | None = None) -> None:
        """Hold `lease` until its stream ends; with `growth`, its expected end (and its blocks,
        when it reserved less than its limit) follow its request."""
        held = self._open.get(lease.lease_id)
        self._count(lease, lease.blocks - (held.blocks if held is not None else 0))
        self._open[lease.lease_id] = lease
        if growth is not None and lease.lease_id not in self._progress:
            self._progress[lease.lease_id] = growth
            # What its claim told the ledger: its whole limit at the rate of now.
            self._told[lease.lease_id] = growth.admitted_at + growth.ends_in_s(
                growth.admitted_at, self._decode_rate(growth.pool)
            )
            if growth.grows:
                self._growing.add(lease.lease_id)

    def seen(self, lease_id: str, tokens: int) -> None:
        """`tokens` output tokens (of all its sequences) were seen in the lease's stream."""
        growth = self._progress.get(lease_id)
        if growth is not None:
            self._seen[lease_id] = -(-tokens // (len(growth.prompt_tokens) * growth.n))

    def forget(self, lease_id: str) -> None:
        """Stop holding a lease that someone else releases (an operator, through the admin API):
        no renewal may record it again."""
        held = self._open.pop(lease_id, None)
        if held is not None:
            self._count(held, -held.blocks)
        self._stop_following(lease_id)

    def release(self, lease: Lease) -> None:
        """Start releasing `lease` if it is still held; never raises, never blocks."""
        held = self._open.pop(lease.lease_id, None)
        if held is None:
            return
        self._count(held, -held.blocks)
        self._stop_following(lease.lease_id)
        self._start_release(lease)

    def served(self, lease_id: str, pod: str) -> None:
        """The gateway says the lease's request went to `pod`: a lease reserved on another pod
        moves there (one re-assert, in a task of its own); never raises, never blocks."""
        lease = self._open.get(lease_id)
        if lease is None or not pod or not lease.pod or lease.pod == pod:
            return
        log.info("lease %s was reserved on %s and served by %s: moved", lease_id, lease.pod, pod)
        moved = self._open[lease_id] = dataclasses.replace(lease, pod=pod)
        task = asyncio.get_running_loop().create_task(self._move(moved))
        self._releasing.add(task)  # settle() waits for it as for a release
        task.add_done_callback(self._releasing.discard)

    async def _move(self, lease: Lease) -> None:
        try:
            await self._reassert([lease])
        except Exception:  # the next renewal sends it again, with its pod
            log.exception("moving lease %s to %s failed", lease.lease_id, lease.pod)

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

    def _stop_following(self, lease_id: str) -> None:
        self._progress.pop(lease_id, None)
        self._growing.discard(lease_id)
        self._seen.pop(lease_id, None)
        self._told.pop(lease_id, None)

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
        """The leases held now (open streams), each with when it is expected to end where that
        is known, for re-asserting them in the ledger."""
        now = self._clock()
        out = []
        for lease_id, lease in self._open.items():
            growth = self._progress.get(lease_id)
            if growth is not None:
                ends = growth.ends_in_s(
                    now, self._decode_rate(growth.pool), self._seen.get(lease_id)
                )
                lease = dataclasses.replace(lease, ends_in_s=ends)
            out.append(lease)
        return out

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
        """Every `interval_s` seconds, raise growing leases to what their requests hold and
        tell the ledger the expected ends that moved."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.grow_all()
            except Exception:
                log.exception("following %d leases failed", len(self._progress))

    async def grow_all(self) -> list[Lease]:
        """Count each growing lease's blocks as its request holds them by now (the elapsed time
        at its pool's decode rate, or the tokens seen in its stream, whichever is more; its
        estimate reserved again when the loop lost trust since), and when that is more than it
        counts, as it will hold `grow_ahead_s` later; and each lease's expected end (its limit
        less what it produced, at the rate) where it moved. One re-assert of the leases that
        changed, always granted, so that the ledger tells the truth. Returns those that grew."""
        now = self._clock()
        grown: list[Lease] = []
        changed: list[Lease] = []
        for lease_id, growth in list(self._progress.items()):
            lease = self._open[lease_id]
            rate = self._decode_rate(growth.pool) or DEFAULT_DECODE_RATE
            seen = self._seen.get(lease_id)
            grew = False
            if lease_id in self._growing:
                trust = self._trust(growth.pool)
                blocks = growth.blocks_at(now, rate, seen or 0, trust)
                if blocks > lease.blocks:
                    blocks = growth.blocks_at(now + self._grow_ahead_s, rate, seen or 0, trust)
                    self._count(lease, blocks - lease.blocks)
                    lease = self._open[lease_id] = dataclasses.replace(lease, blocks=blocks)
                    grown.append(lease)
                    grew = True
                if blocks >= growth.limit_blocks:
                    self._growing.discard(lease_id)  # at its limit: nothing more to grow
            ends = growth.ends_in_s(now, rate, seen)
            if grew or _moved(self._told[lease_id], now + ends, now):
                self._told[lease_id] = now + ends
                changed.append(dataclasses.replace(lease, ends_in_s=ends))
        await self._reassert(changed)
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


def _moved(told: float, end: float, now: float) -> bool:
    """Whether a lease expected to end at `end` should tell the ledger, which expects `told`:
    a lease past its end counts as ending now either way."""
    told, end = max(told, now), max(end, now)
    return abs(end - told) > max(GROW_INTERVAL_S, END_TOLERANCE * (end - now))
