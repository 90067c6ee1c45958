"""The embedded ledger: one process, one lock, its own monotonic clock."""

from __future__ import annotations

import heapq
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from kvguard.ledger import Claim, Lease, LeaseInfo, Outcome, PoolUsage, Reservation


@dataclass
class _Pool:
    reserved: int = 0
    tenants: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    leases: dict[str, tuple[Lease, float]] = field(default_factory=dict)  # id -> (lease, expiry)
    expiries: list[tuple[float, str]] = field(default_factory=list)  # heap; may hold stale ids

    def drop(self, lease_id: str) -> None:
        entry = self.leases.pop(lease_id, None)
        if entry is None:
            return
        lease = entry[0]
        self.reserved -= lease.blocks
        self.tenants[lease.tenant] -= lease.blocks
        if self.tenants[lease.tenant] == 0:
            del self.tenants[lease.tenant]

    def reclaim_expired(self, now: float) -> None:
        while self.expiries and self.expiries[0][0] <= now:
            expiry, lease_id = heapq.heappop(self.expiries)
            entry = self.leases.get(lease_id)
            if entry is not None and entry[1] == expiry:  # not renewed since
                self.drop(lease_id)


class MemoryLedger:
    """Atomic in the same sense as the Redis scripts: check and reserve under one lock."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock or time.monotonic
        self._lock = threading.Lock()
        self._pools: defaultdict[str, _Pool] = defaultdict(_Pool)

    async def reserve(self, claim: Claim) -> Reservation:
        with self._lock:
            pool = self._pools[claim.pool]
            now = self._clock()
            pool.reclaim_expired(now)
            held = pool.leases.get(claim.lease_id)
            if held is not None:  # a retried call: admitted once, counted once
                tenant_now = pool.tenants.get(claim.tenant, 0)
                return Reservation(Outcome.ADMITTED, pool.reserved, tenant_now, held[0])
            tenant_after = pool.tenants.get(claim.tenant, 0) + claim.blocks
            pool_after = pool.reserved + claim.blocks
            if tenant_after > claim.tenant_quota:
                return Reservation(Outcome.TENANT_QUOTA, pool.reserved, tenant_after - claim.blocks)
            if pool_after > claim.pool_limit:
                return Reservation(
                    Outcome.POOL_WATERMARK, pool.reserved, tenant_after - claim.blocks
                )
            lease = claim.lease()
            expiry = now + claim.lease_seconds
            pool.leases[lease.lease_id] = (lease, expiry)
            heapq.heappush(pool.expiries, (expiry, lease.lease_id))
            pool.reserved = pool_after
            pool.tenants[claim.tenant] = tenant_after
            return Reservation(Outcome.ADMITTED, pool_after, tenant_after, lease)

    async def release(self, lease: Lease) -> None:
        with self._lock:
            self._pools[lease.pool].drop(lease.lease_id)

    async def renew(self, lease: Lease, lease_seconds: float) -> bool:
        with self._lock:
            pool = self._pools[lease.pool]
            now = self._clock()
            pool.reclaim_expired(now)
            held = pool.leases.get(lease.lease_id)
            if held is None:
                return False
            expiry = now + lease_seconds
            pool.leases[lease.lease_id] = (held[0], expiry)  # the lease as counted
            heapq.heappush(pool.expiries, (expiry, lease.lease_id))
            return True

    async def reassert(self, leases: Iterable[Lease], lease_seconds: float) -> int:
        return self.hold(leases, lease_seconds)

    def hold(self, leases: Iterable[Lease], lease_seconds: float) -> int:
        """`reassert`, synchronously: renew each lease (growing its counted blocks to
        `lease.blocks` when that is more, never less), or record it again; no checks.
        Returns how many were recorded again."""
        added = 0
        with self._lock:
            now = self._clock()
            for lease in leases:
                pool = self._pools[lease.pool]
                pool.reclaim_expired(now)
                held = pool.leases.get(lease.lease_id)
                if held is None:
                    pool.reserved += lease.blocks
                    pool.tenants[lease.tenant] += lease.blocks
                    added += 1
                else:
                    counted = held[0]
                    growth = lease.blocks - counted.blocks
                    if growth > 0:  # counted under its recorded tenant, as drop() gives back
                        pool.reserved += growth
                        pool.tenants[counted.tenant] += growth
                        counted = replace(counted, blocks=lease.blocks)
                    lease = counted
                    if now + lease_seconds - held[1] < lease_seconds / 10:
                        # Renewed within the last tenth of its lease (a growth step): a new
                        # expiry would only add a heap entry per step.
                        pool.leases[lease.lease_id] = (lease, held[1])
                        continue
                expiry = now + lease_seconds
                pool.leases[lease.lease_id] = (lease, expiry)
                heapq.heappush(pool.expiries, (expiry, lease.lease_id))
        return added

    async def usage(self, pool: str) -> PoolUsage:
        with self._lock:
            state = self._pools[pool]
            state.reclaim_expired(self._clock())
            return PoolUsage(state.reserved, len(state.leases), dict(state.tenants))

    async def leases(self, pool: str) -> list[LeaseInfo]:
        with self._lock:
            state = self._pools[pool]
            now = self._clock()
            state.reclaim_expired(now)
            return [LeaseInfo(lease, expiry - now) for lease, expiry in state.leases.values()]

    async def close(self) -> None:
        return None
