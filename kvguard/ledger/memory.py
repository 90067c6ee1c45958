"""The embedded ledger: one process, one lock, its own monotonic clock.

A pool's leases live here (`_Pool`: their expiries and expected ends); the slots promised to
its refused claims in memory_promises.py. `reserve` checks, reserves and promises under the
one lock, in the order of reserve.lua.
"""

from __future__ import annotations

import bisect
import heapq
import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from kvguard.ledger import (
    Claim,
    Lease,
    LeaseInfo,
    Outcome,
    PodLimit,
    PoolUsage,
    Reservation,
)
from kvguard.ledger.memory_promises import Promise, Promises, add_to


@dataclass(slots=True)
class _Held:
    """A lease as the pool holds it."""

    lease: Lease  # without ends_in_s: `end` says it
    expiry: float
    end: float  # when it is expected to end (its expiry when nothing better is known)


@dataclass
class _Pool:
    reserved: int = 0
    tenants: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    leases: dict[str, _Held] = field(default_factory=dict)
    expiries: list[tuple[float, str]] = field(default_factory=list)  # heap; may hold stale ids
    pods: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    # The leases in order of their expected ends, (end, lease id): the pool's, each tenant's
    # and each pod's (kept sorted with bisect; an entry changes when its lease's end does).
    ends: list[tuple[float, str]] = field(default_factory=list)
    tenant_ends: defaultdict[str, list[tuple[float, str]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    pod_ends: defaultdict[str, list[tuple[float, str]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    promises: Promises = field(default_factory=Promises)  # the retries promised a slot

    def record(self, lease: Lease, expiry: float, end: float) -> None:
        """Hold `lease` (no checks) until `expiry`, expected to end at `end`."""
        held = self.leases[lease.lease_id] = _Held(lease, expiry, end)
        heapq.heappush(self.expiries, (expiry, lease.lease_id))
        self.reserved += lease.blocks
        self.tenants[lease.tenant] += lease.blocks
        if lease.pod:
            self.pods[lease.pod] += lease.blocks
        self._index(held)

    def drop(self, lease_id: str) -> None:
        held = self.leases.pop(lease_id, None)
        if held is None:
            return
        lease = held.lease
        self._unindex(held)
        self.reserved -= lease.blocks
        add_to(self.tenants, lease.tenant, -lease.blocks)
        if lease.pod:
            add_to(self.pods, lease.pod, -lease.blocks)

    def grow(self, held: _Held, blocks: int) -> None:
        """Count `blocks` for a held lease that counts fewer (no checks)."""
        counted = held.lease
        growth = blocks - counted.blocks
        self.reserved += growth
        self.tenants[counted.tenant] += growth
        if counted.pod:
            self.pods[counted.pod] += growth
        held.lease = replace(counted, blocks=blocks)

    def move(self, held: _Held, pod: str) -> None:
        """Hold a lease on `pod` instead of its own (no checks)."""
        self._unindex(held)
        counted = held.lease
        if counted.pod:
            add_to(self.pods, counted.pod, -counted.blocks)
        self.pods[pod] += counted.blocks
        held.lease = replace(counted, pod=pod)
        self._index(held)

    def expect_end(self, held: _Held, end: float) -> None:
        if end != held.end:
            self._unindex(held)
            held.end = end
            self._index(held)

    def _index(self, held: _Held) -> None:
        entry = (held.end, held.lease.lease_id)
        bisect.insort(self.ends, entry)
        bisect.insort(self.tenant_ends[held.lease.tenant], entry)
        if held.lease.pod:
            bisect.insort(self.pod_ends[held.lease.pod], entry)

    def _unindex(self, held: _Held) -> None:
        entry = (held.end, held.lease.lease_id)
        lease = held.lease
        del self.ends[bisect.bisect_left(self.ends, entry)]
        for by, name in ((self.tenant_ends, lease.tenant), (self.pod_ends, lease.pod)):
            if name:
                ends = by[name]
                del ends[bisect.bisect_left(ends, entry)]
                if not ends:
                    del by[name]

    def pick(self, pods: tuple[PodLimit, ...], blocks: int) -> PodLimit | None:
        """Of `pods`, the one where `blocks` more fit that is left with the most free blocks
        (the earliest on a tie); None when they fit on none."""
        best, most = None, -1
        for pod in pods:
            free = pod.limit - self.pods.get(pod.address, 0) - blocks
            if free > most:
                best, most = pod, free
        return best

    def freed_by(self, ends: list[tuple[float, str]], held: int, over: int, now: float) -> float:
        """Seconds until the leases of `ends` (`held` blocks in all), ending in that order,
        have freed `over` blocks: 0 when nothing is over, inf when they cannot (told without
        walking them when `over` is more than they hold). A lease past its expected end is
        taken to end now."""
        if over <= 0:
            return 0.0
        if over > held:
            return math.inf
        freed = 0
        for end, lease_id in ends:
            freed += self.leases[lease_id].lease.blocks
            if freed >= over:
                return max(0.0, end - now)
        return math.inf

    def fits_in(self, claim: Claim, promised: int, now: float) -> float:
        """Seconds until a refused `claim`, after `promised` blocks promised to its tenant
        before it, is expected to fit: the later of when its tenant's leases free its quota and
        the pool's free its limit (inf when they cannot)."""
        tenant_now = self.tenants.get(claim.tenant, 0)
        over_quota = tenant_now + promised + claim.blocks - claim.tenant_quota
        over_limit = self.reserved + promised + claim.blocks - claim.pool_limit
        tenant_ends = self.tenant_ends.get(claim.tenant, [])
        fits = max(
            self.freed_by(tenant_ends, tenant_now, over_quota, now),
            self.freed_by(self.ends, self.reserved, over_limit, now),
        )
        if claim.pods:  # and the first of its pods to free enough
            on_pod = min(
                self.freed_by(
                    self.pod_ends.get(pod.address, []),
                    self.pods.get(pod.address, 0),
                    self.pods.get(pod.address, 0) + claim.blocks - pod.limit,
                    now,
                )
                for pod in claim.pods
            )
            fits = max(fits, on_pod)
        return fits

    def reclaim_expired(self, now: float) -> None:
        """Reclaim expired leases and promises."""
        while self.expiries and self.expiries[0][0] <= now:
            expiry, lease_id = heapq.heappop(self.expiries)
            held = self.leases.get(lease_id)
            if held is not None and held.expiry == expiry:  # not renewed since
                self.drop(lease_id)
        self.promises.reclaim_expired(now)

    def next_change(self, now: float) -> float:
        """Seconds until a lease or a promise expires by itself: when room may appear without
        a release (inf when nothing is due)."""
        # Stale entries (leases renewed or gone) are dropped first, so that nothing wakes for a
        # moment that changes nothing.
        while self.expiries and (
            (held := self.leases.get(self.expiries[0][1])) is None
            or held.expiry != self.expiries[0][0]
        ):
            heapq.heappop(self.expiries)
        first = self.expiries[0][0] if self.expiries else None
        due = [at for at in (first, self.promises.next_expiry()) if at is not None]
        return max(0.0, min(due) - now) if due else math.inf


class MemoryLedger:
    """Atomic in the same sense as the Redis scripts: check and reserve under one lock."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock or time.monotonic
        self._lock = threading.Lock()
        self._pools: dict[str, _Pool] = {}

    def _pool(self, name: str) -> _Pool:
        pool = self._pools.get(name)
        if pool is None:
            pool = self._pools[name] = _Pool()
        return pool

    async def reserve(self, claim: Claim) -> Reservation:
        with self._lock:
            pool = self._pool(claim.pool)
            now = self._clock()
            pool.reclaim_expired(now)
            held = pool.leases.get(claim.lease_id)
            tenant_now = pool.tenants.get(claim.tenant, 0)
            if held is not None:  # a retried call: admitted once, counted once
                return Reservation(
                    outcome=Outcome.ADMITTED,
                    pool_reserved=pool.reserved,
                    tenant_reserved=tenant_now,
                    lease=held.lease,
                )
            if (
                claim.blocks > claim.tenant_quota
                or claim.blocks > claim.pool_limit
                or (claim.pods and claim.blocks > max(pod.limit for pod in claim.pods))
            ):
                # Impossible whatever else is reserved: no promise is looked at or made.
                impossible = (
                    Outcome.TENANT_QUOTA
                    if claim.blocks > claim.tenant_quota
                    else Outcome.POOL_WATERMARK
                )
                return Reservation(
                    outcome=impossible,
                    pool_reserved=pool.reserved,
                    tenant_reserved=tenant_now,
                    wait_s=math.inf if claim.terms is not None else 0.0,
                    changes_in_s=pool.next_change(now),
                )
            promises = pool.promises
            key, own, promised, holding = promises.standing(claim.retry_key, claim.tenant, now)
            # Only this tenant's retries that came back count, in its quota and the pool alike.
            picked = None
            if tenant_now + holding + claim.blocks > claim.tenant_quota:
                outcome = Outcome.TENANT_QUOTA
            elif pool.reserved + holding + claim.blocks > claim.pool_limit or (
                claim.pods and (picked := pool.pick(claim.pods, claim.blocks)) is None
            ):  # over the pool's limit, or over every pod's
                outcome = Outcome.POOL_WATERMARK
            else:
                outcome = Outcome.ADMITTED
            if outcome is not Outcome.ADMITTED:
                waiting_s = 0.0
                retry_after_s: float | None
                if own is not None and own.retry_at <= now:
                    # Back at its time, its blocks not free yet: they are held for it (against
                    # its tenant's later claims) until its grace ends, which the caller may
                    # wait for.
                    promises.hold_for(own)
                    wait_s, retry_after_s, promised_to = 0.0, 0.0, True
                    waiting_s = own.expiry - now
                else:
                    wait_s, retry_after_s, promised_to = self._promise(
                        pool, claim, key, own, promised, now
                    )
                return Reservation(
                    outcome=outcome,
                    pool_reserved=pool.reserved,
                    tenant_reserved=tenant_now,
                    wait_s=wait_s,
                    retry_after_s=retry_after_s,
                    promised=promised_to,
                    changes_in_s=pool.next_change(now),
                    waiting_s=waiting_s,
                    holding=holding,
                )
            if own is not None:
                promises.unpromise(key)
            expiry = now + claim.lease_seconds
            end = expiry if claim.ends_in_s is None else now + claim.ends_in_s
            lease = claim.lease(picked.address if picked is not None else "")
            pool.record(lease, expiry, end)
            return Reservation(
                outcome=Outcome.ADMITTED,
                pool_reserved=pool.reserved,
                tenant_reserved=tenant_now + claim.blocks,
                lease=lease,
                holding=holding,
            )

    @staticmethod
    def _promise(
        pool: _Pool, claim: Claim, key: str, own: Promise | None, promised: int, now: float
    ) -> tuple[float, float | None, bool]:
        """For a refused claim, `promised` blocks promised to its tenant before it: the
        seconds until it is expected to fit, the seconds until its retry (None: do not), and
        whether it is promised that slot (under `key`; "" makes no promise)."""
        terms = claim.terms
        if terms is None:
            return 0.0, None, False
        wait_s = pool.fits_in(claim, promised, now)
        retry_after_s, promised_to = pool.promises.offer(
            claim.tenant, claim.blocks, key, own, wait_s, terms, now
        )
        return wait_s, retry_after_s, promised_to

    async def release(self, lease: Lease) -> None:
        with self._lock:
            self._pool(lease.pool).drop(lease.lease_id)

    async def renew(self, lease: Lease, lease_seconds: float) -> bool:
        with self._lock:
            pool = self._pool(lease.pool)
            now = self._clock()
            pool.reclaim_expired(now)
            held = pool.leases.get(lease.lease_id)
            if held is None:
                return False
            held.expiry = now + lease_seconds
            heapq.heappush(pool.expiries, (held.expiry, lease.lease_id))
            return True

    async def reassert(self, leases: Iterable[Lease], lease_seconds: float) -> int:
        return self.hold(leases, lease_seconds)

    def hold(self, leases: Iterable[Lease], lease_seconds: float) -> int:
        """`reassert`, synchronously: renew each lease (growing its counted blocks to
        `lease.blocks` when that is more, never less; its expected end moved to
        `lease.ends_in_s` from now when given), or record it again; no checks. Returns how
        many were recorded again."""
        added = 0
        with self._lock:
            now = self._clock()
            for lease in leases:
                pool = self._pool(lease.pool)
                pool.reclaim_expired(now)
                held = pool.leases.get(lease.lease_id)
                expiry = now + lease_seconds
                if held is None:
                    end = expiry if lease.ends_in_s is None else now + lease.ends_in_s
                    pool.record(replace(lease, ends_in_s=None), expiry, end)
                    added += 1
                    continue
                if lease.blocks > held.lease.blocks:  # under its recorded tenant and pod
                    pool.grow(held, lease.blocks)
                if lease.pod and lease.pod != held.lease.pod:
                    pool.move(held, lease.pod)
                if lease.ends_in_s is not None:
                    pool.expect_end(held, now + lease.ends_in_s)
                # Renewed within the last tenth of its lease (a growth step): a new expiry
                # would only add a heap entry per step.
                if expiry - held.expiry >= lease_seconds / 10:
                    held.expiry = expiry
                    heapq.heappush(pool.expiries, (expiry, lease.lease_id))
        return added

    async def usage(self, pool: str) -> PoolUsage:
        with self._lock:
            state = self._pool(pool)
            state.reclaim_expired(self._clock())
            promises = state.promises
            return PoolUsage(
                reserved=state.reserved,
                leases=len(state.leases),
                tenants=dict(state.tenants),
                promised=promises.promised,
                promises=len(promises.by_key),
                holding=promises.holding,
                pods=dict(state.pods),
            )

    async def leases(self, pool: str) -> list[LeaseInfo]:
        with self._lock:
            state = self._pool(pool)
            now = self._clock()
            state.reclaim_expired(now)
            return [LeaseInfo(held.lease, held.expiry - now) for held in state.leases.values()]

    # -- lifecycle: one process, nothing to reach, watch or hear ------------------------------

    @property
    def shared(self) -> bool:
        return False

    async def start(self) -> None:
        return None

    def subscribe(self, pools: Iterable[str]) -> None:
        """Nothing to hear: every release is this process's own (the keeper reports them)."""

    async def close(self) -> None:
        return None
