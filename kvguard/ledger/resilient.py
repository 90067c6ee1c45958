"""The Redis ledger as kvguard runs it: fast and honest while Redis cannot be reached.

`ResilientLedger` wraps a `RedisLedger` and keeps one bit of state, "reachable":

- The first operation that cannot reach Redis flips it to False: that is logged once, reported
  through `on_reachability(False)` (the server sets `health.set("ledger", False)`), and every
  failed operation is counted (`errors`, and `on_error()` for the metrics). While unreachable,
  operations do not wait on Redis at all: a background watcher probes it every
  `probe_interval_s` instead.
- `on_unavailable` decides what `reserve` does meanwhile: `reject` and `allow` raise
  `LedgerUnavailable` (admission answers 503 or lets the request pass without a lease);
  `local` admits against a local MemoryLedger that starts with this process's open leases and
  allows `pool_limit // replicas` and `tenant_quota // replicas` blocks, and each pod's limit
  // replicas (rounded down, so that the replicas together never pass the real limits; a share
  of 0 admits nothing). `replicas` is counted at runtime (kvguard.ledger.replicas): while no
  count was ever known, `local` raises `LedgerUnavailable` as `reject` does.
- Releases that cannot reach Redis are kept and replayed on recovery, so no lease outlives its
  stream in Redis.
- When the probe reaches Redis again, the process re-asserts every open lease (those of
  `open_leases()`, the LeaseKeeper's, plus those taken locally), idempotently, then flips back
  and replays its releases: a Redis that restarted empty converges to the leases really open,
  and no lease is counted twice (re-asserting a held lease only renews it).
- A lease's counted blocks grow through `reassert` (sent to Redis, or to the local ledger
  while Redis is unreachable in `local` mode), and recovery sends each open lease with its
  largest known blocks, so Redis ends up counting the grown amount; nothing here sends a
  smaller copy in place of a grown one (and Redis would not shrink a lease anyway).
- While reachable, the watcher checks each pool's epoch every `heartbeat_s`: it notices a Redis
  that restarted between two requests (no error seen) and re-asserts that pool's leases; an
  idle process also notices an outage within `heartbeat_s`, so readiness follows Redis. Each
  beat also registers this process in Redis and counts the processes registered there.
- `on_freed` (given at construction) and `subscribe` are the primary's: releases by every
  replica, through Redis pub/sub (the local ledger's releases are this process's own).

It builds its `RedisLedger` itself, on the client it is given, with its own callbacks: a pool
whose state Redis lost is re-asserted, and a cancelled reserve's release that could not reach
Redis is replayed on recovery.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import socket
from collections.abc import Callable, Iterable
from typing import Any

from kvguard.ledger import (
    Claim,
    Lease,
    LeaseInfo,
    LedgerUnavailable,
    Outcome,
    PoolUsage,
    Reservation,
)
from kvguard.ledger.memory import MemoryLedger
from kvguard.ledger.redis_ledger import RedisLedger
from kvguard.ledger.replicas import REGISTRATION_TTL_S, ReplicaCount
from kvguard.tasks import cancel_and_wait

log = logging.getLogger(__name__)

ON_UNAVAILABLE = ("reject", "allow", "local")


def local_share(amount: int, replicas: int) -> int:
    """One process's share of `amount` blocks while Redis is away: rounded down, so that
    `replicas` processes together never admit more than `amount`."""
    return amount // replicas


class ResilientLedger:
    """A Ledger over a RedisLedger on `client` (`redis_ledger.connect`) that applies
    `on_unavailable` while Redis cannot be reached."""

    def __init__(
        self,
        client: Any,
        *,
        on_unavailable: str = "reject",
        replicas: ReplicaCount | int = 1,
        lease_seconds: float = 900,
        on_reachability: Callable[[bool], None] | None = None,
        open_leases: Callable[[], Iterable[Lease]] | None = None,
        on_error: Callable[[], None] | None = None,
        on_freed: Callable[[str], None] | None = None,
        probe_interval_s: float = 0.2,
        heartbeat_s: float = 1.0,
    ) -> None:
        if on_unavailable not in ON_UNAVAILABLE:
            raise ValueError(f"on_unavailable must be one of {ON_UNAVAILABLE}")
        self.primary = RedisLedger(
            client,
            on_reset=self._on_reset,
            on_release_lost=self._release_lost,
            on_freed=on_freed,
        )
        self.on_unavailable = on_unavailable
        # A fixed count is a floor known from the start; the heartbeats add what Redis counts.
        self.replicas = replicas if isinstance(replicas, ReplicaCount) else ReplicaCount(replicas)
        # This process in Redis's registry of replicas: unique across pods and restarts.
        self.process_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.lease_seconds = lease_seconds
        self.on_reachability = on_reachability
        self.open_leases = open_leases or (lambda: ())
        self.on_error = on_error
        self.probe_interval_s = probe_interval_s
        self.heartbeat_s = heartbeat_s
        self.reachable = True
        self.errors = 0  # operations that could not reach Redis
        self.outages = 0
        self._local: MemoryLedger | None = None  # only while unreachable, in `local` mode
        self._local_leases: dict[str, Lease] = {}  # admitted locally, not yet re-asserted
        # Leases Redis may hold without this process knowing: reserves whose answer was lost,
        # and leases an unfinished recovery re-asserted. Released on recovery unless open.
        self._maybe_in_redis: dict[str, Lease] = {}
        self._unreleased: dict[str, Lease] = {}  # releases that could not reach Redis: replayed
        self._pools: set[str] = set()
        self._watcher: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._outage = asyncio.Event()  # wakes the watcher when an operation finds Redis gone

    # -- the Ledger protocol ------------------------------------------------------------------

    async def reserve(self, claim: Claim) -> Reservation:
        self._pools.add(claim.pool)
        self._watch()
        if self.reachable:
            try:
                reservation = await self.primary.reserve(claim)
            except LedgerUnavailable as exc:
                self._went_down(exc)
                # Redis may have recorded it before the answer was lost.
                self._maybe_in_redis[claim.lease_id] = claim.lease()
            else:
                if self._local is not None and reservation.lease is not None:
                    # Admitted by Redis after another call flipped to local: it counts there.
                    self._local.hold([reservation.lease], claim.lease_seconds)
                return reservation
        self._count_error()
        if self._local is None:
            raise LedgerUnavailable("the Redis ledger cannot be reached")
        replicas = self.replicas.count
        if replicas is None:
            raise LedgerUnavailable(
                "the Redis ledger cannot be reached, and the number of kvguard replicas "
                "sharing it was never known: no local share"
            )
        local_claim = dataclasses.replace(
            claim,
            pool_limit=local_share(claim.pool_limit, replicas),
            tenant_quota=local_share(claim.tenant_quota, replicas),
            pods=tuple(
                dataclasses.replace(pod, limit=local_share(pod.limit, replicas))
                for pod in claim.pods
            ),
        )
        reservation = await self._local.reserve(local_claim)
        if reservation.outcome is Outcome.ADMITTED and reservation.lease is not None:
            self._local_leases[claim.lease_id] = reservation.lease
        return reservation

    async def release(self, lease: Lease) -> None:
        """Never raises for an outage: the release is replayed when Redis is back."""
        local_only = self._local_leases.pop(lease.lease_id, None) is not None
        if self._local is not None:
            await self._local.release(lease)
        if self.reachable:
            try:
                await self.primary.release(lease)
                return
            except LedgerUnavailable as exc:
                self._went_down(exc)
        if local_only and lease.lease_id not in self._maybe_in_redis:
            return  # it never reached Redis
        self._keep_for_replay(lease)

    async def renew(self, lease: Lease, lease_seconds: float) -> bool:
        if self.reachable:
            try:
                return await self.primary.renew(lease, lease_seconds)
            except LedgerUnavailable as exc:
                self._went_down(exc)
        self._count_error()
        if self._local is None:
            raise LedgerUnavailable("the Redis ledger cannot be reached")
        return await self._local.renew(lease, lease_seconds)

    async def reassert(self, leases: Iterable[Lease], lease_seconds: float) -> int:
        """While unreachable: holds (and grows) them locally (`local`) and returns 0; recovery
        re-asserts every open lease in Redis anyway, with its grown blocks."""
        held = list(leases)
        for lease in held:
            self._pools.add(lease.pool)
            taken_locally = self._local_leases.get(lease.lease_id)
            if taken_locally is not None and lease.blocks > taken_locally.blocks:
                self._local_leases[lease.lease_id] = lease  # recovery sends the grown lease
        if self.reachable:
            try:
                added = await self.primary.reassert(held, lease_seconds)
            except LedgerUnavailable as exc:
                self._went_down(exc)
            else:
                if self._local is not None:
                    # Another call flipped to local meanwhile: growth counts there too.
                    self._local.hold(held, lease_seconds)
                return added
        if self._local is not None:
            self._local.hold(held, lease_seconds)
        return 0

    async def usage(self, pool: str) -> PoolUsage:
        """Redis's view; while unreachable, the local ledger's (`local`), else raises."""
        if self.reachable:
            try:
                return await self.primary.usage(pool)
            except LedgerUnavailable as exc:
                self._went_down(exc)
        if self._local is None:
            raise LedgerUnavailable("the Redis ledger cannot be reached")
        return await self._local.usage(pool)

    async def leases(self, pool: str) -> list[LeaseInfo]:
        """Redis's leases; while unreachable, the local ledger's (`local`), else raises."""
        if self.reachable:
            try:
                return await self.primary.leases(pool)
            except LedgerUnavailable as exc:
                self._went_down(exc)
        if self._local is None:
            raise LedgerUnavailable("the Redis ledger cannot be reached")
        return await self._local.leases(pool)

    @property
    def shared(self) -> bool:
        return True

    def subscribe(self, pools: Iterable[str]) -> None:
        """Call `on_freed` for the blocks freed in `pools` (RedisLedger.subscribe)."""
        self.primary.subscribe(pools)

    async def start(self) -> None:
        """Reach Redis once (registering the scripts) and start watching it."""
        try:
            await self.primary.start()
            await self._register()
        except LedgerUnavailable as exc:
            self._went_down(exc)
        self._watch()

    async def close(self) -> None:
        self._closed = True  # a late failure must not start the watcher again
        await cancel_and_wait([t for t in (self._watcher, *self._tasks) if t is not None])
        self._watcher = None
        if self.reachable:
            # Leave the registry at once: the others' count drops without waiting for the TTL.
            with contextlib.suppress(LedgerUnavailable):
                await self.primary.register(self.process_id, 0)
        await self.primary.close()

    # -- outages --------------------------------------------------------------------------------

    def _count_error(self) -> None:
        self.errors += 1
        if self.on_error is not None:
            self.on_error()

    def _release_lost(self, lease: Lease, exc: LedgerUnavailable) -> None:
        """A cancelled reserve's release could not reach Redis: kept, as release() keeps its own."""
        self._went_down(exc)
        self._keep_for_replay(lease)

    def _keep_for_replay(self, lease: Lease) -> None:
        """A release that could not reach Redis: counted, and replayed on recovery."""
        self._count_error()
        self._unreleased[lease.lease_id] = lease

    def _went_down(self, exc: BaseException) -> None:
        """Flip to unreachable, synchronously: no admission may slip between the flip and the
        local ledger being ready."""
        if not self.reachable:
            return
        self.reachable = False
        self.outages += 1
        self.replicas.outage(True)
        self._outage.set()  # the watcher probes from now on, not after its heartbeat
        if self.on_unavailable == "local":
            self._local = MemoryLedger()
            # This process's open leases count against its local share.
            self._local.hold(self.open_leases(), self.lease_seconds)
        log.warning(
            "ledger: Redis unreachable (%s); on_unavailable=%s until it is back",
            exc,
            self.on_unavailable,
        )
        self._notify(False)
        self._watch()

    async def _register(self) -> None:
        """Register this process in Redis for another TTL, and count the processes there."""
        self.replicas.registered(await self.primary.register(self.process_id, REGISTRATION_TTL_S))

    def _notify(self, reachable: bool) -> None:
        if self.on_reachability is not None:
            self.on_reachability(reachable)

    async def _recover(self) -> None:
        """Re-assert every open lease in Redis, flip back, replay the releases kept meanwhile.

        Raises LedgerUnavailable (and stays unreachable) if Redis fails again on the way.
        """
        asserted: dict[str, int] = {}  # lease id -> blocks re-asserted
        reasserted = 0
        while True:
            open_now = {lease.lease_id: lease for lease in self.open_leases()}
            for lease_id, lease in self._local_leases.items():
                known = open_now.get(lease_id)
                if known is None or lease.blocks > known.blocks:  # the grown copy wins
                    open_now[lease_id] = lease
            # New leases, and leases that grew (locally) while this recovery ran.
            todo = [
                lease
                for lease_id, lease in open_now.items()
                if asserted.get(lease_id, 0) < lease.blocks
            ]
            if not todo:
                break  # and no await until the flip: no local admission can slip in between
            for lease in todo:
                # Released before the flip (even if this attempt fails): replayed below.
                self._maybe_in_redis[lease.lease_id] = lease
            reasserted += await self.primary.reassert(todo, self.lease_seconds)
            asserted.update((lease.lease_id, lease.blocks) for lease in todo)
        self.reachable = True
        self.replicas.outage(False)
        self._local = None
        self._local_leases.clear()
        replay = dict(self._unreleased)
        replay.update(
            (lease_id, lease)
            for lease_id, lease in self._maybe_in_redis.items()
            if lease_id not in open_now
        )
        self._unreleased, self._maybe_in_redis = {}, {}
        log.warning(
            "ledger: Redis reachable again; %d open leases re-asserted (%d were missing), "
            "%d releases replayed",
            len(asserted),
            reasserted,
            len(replay),
        )
        self._notify(True)
        pending = list(replay.values())
        while pending:
            try:
                await self.primary.release(pending[-1])
            except LedgerUnavailable as exc:
                self._unreleased.update((lease.lease_id, lease) for lease in pending)
                self._went_down(exc)
                return
            pending.pop()

    def _on_reset(self, pool: str) -> None:
        """Redis lost this pool's state without an error seen (a quick restart): re-assert."""
        if not self.reachable or self._closed:
            return  # recovery re-asserts everything anyway
        task = asyncio.get_running_loop().create_task(self._reassert_pool(pool))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reassert_pool(self, pool: str) -> None:
        leases = [lease for lease in self.open_leases() if lease.pool == pool]
        try:
            added = await self.primary.reassert(leases, self.lease_seconds)
        except LedgerUnavailable as exc:
            self._went_down(exc)
        else:
            log.warning(
                "ledger: pool %s lost its state in Redis; %d leases re-asserted", pool, added
            )
        # A lease released while the script was on its way may have been recorded again (also
        # when its answer was lost: release() then keeps it for the replay).
        still_open = {lease.lease_id for lease in self.open_leases()}
        for lease in leases:
            if lease.lease_id not in still_open:
                await self.release(lease)

    def _watch(self) -> None:
        """Start the watcher if it is not running (needs a running event loop); none once
        closed."""
        if self._closed:
            return
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch_forever())

    async def _watch_forever(self) -> None:
        while True:
            # Pacing of a background probe, not synchronisation: `heartbeat_s` while Redis is
            # reachable, `probe_interval_s` from the moment it is not.
            delay = self.heartbeat_s if self.reachable else self.probe_interval_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._outage.wait(), delay)
            self._outage.clear()
            try:
                await self.primary.check(self._pools)
                await self._register()
                if not self.reachable:
                    await self._recover()
            except LedgerUnavailable as exc:
                self._went_down(exc)
            except Exception:
                log.exception("ledger: watching Redis failed")
