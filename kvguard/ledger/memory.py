"""The embedded ledger: one process, one lock, its own monotonic clock."""

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
    MAX_PROMISE_BUDGET,
    PROMISE_BUDGET,
    Claim,
    Lease,
    LeaseInfo,
    Outcome,
    PoolUsage,
    Reservation,
)


@dataclass(slots=True)
class _Held:
    """A lease as the pool holds it."""

    lease: Lease  # without ends_in_s: `end` says it
    expiry: float
    end: float  # when it is expected to end (its expiry when nothing better is known)


@dataclass(slots=True)
class _Promise:
    tenant: str
    blocks: int
    retry_at: float  # the time the client was told to retry at
    expiry: float  # retry_at + grace: a retry that came back may wait for its blocks until then
    returned: bool = False  # its client came back at least once
    holding: bool = False  # back at its time: its blocks count against its tenant's claims


@dataclass
class _Pool:
    reserved: int = 0
    tenants: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    leases: dict[str, _Held] = field(default_factory=dict)
    expiries: list[tuple[float, str]] = field(default_factory=list)  # heap; may hold stale ids
    # The leases in order of their expected ends, (end, lease id): the pool's, and each
    # tenant's (kept sorted with bisect; an entry changes when its lease's end does).
    ends: list[tuple[float, str]] = field(default_factory=list)
    tenant_ends: defaultdict[str, list[tuple[float, str]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    # Promised retries by key, and each tenant's in the order they were promised; their blocks
    # summed for the pool and per tenant, all of them and those holding.
    promises: dict[str, _Promise] = field(default_factory=dict)
    tenant_promises: defaultdict[str, dict[str, _Promise]] = field(
        default_factory=lambda: defaultdict(dict)
    )
    promise_expiries: list[tuple[float, str]] = field(default_factory=list)  # heap, as above
    promised: int = 0
    promised_tenants: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    holding: int = 0
    holding_tenants: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    # Promises each tenant may have open (PROMISE_BUDGET while it has none recorded): doubled
    # when a promised client comes back, halved when one never does; at 0 the tenant is only
    # told the time, until max_wait_s after that promise ended.
    budgets: dict[str, int] = field(default_factory=dict)
    unreturned: dict[str, float] = field(default_factory=dict)  # tenant -> when it fell to 0

    def record(self, lease: Lease, expiry: float, end: float) -> None:
        """Hold `lease` (no checks) until `expiry`, expected to end at `end`."""
        held = self.leases[lease.lease_id] = _Held(lease, expiry, end)
        heapq.heappush(self.expiries, (expiry, lease.lease_id))
        self.reserved += lease.blocks
        self.tenants[lease.tenant] += lease.blocks
        self._index(held)

    def drop(self, lease_id: str) -> None:
        held = self.leases.pop(lease_id, None)
        if held is None:
            return
        lease = held.lease
        self._unindex(held)
        self.reserved -= lease.blocks
        _add(self.tenants, lease.tenant, -lease.blocks)

    def expect_end(self, held: _Held, end: float) -> None:
        if end != held.end:
            self._unindex(held)
            held.end = end
            self._index(held)

    def _index(self, held: _Held) -> None:
        entry = (held.end, held.lease.lease_id)
        bisect.insort(self.ends, entry)
        bisect.insort(self.tenant_ends[held.lease.tenant], entry)

    def _unindex(self, held: _Held) -> None:
        entry = (held.end, held.lease.lease_id)
        for ends in (self.ends, self.tenant_ends[held.lease.tenant]):
            del ends[bisect.bisect_left(ends, entry)]
        if not self.tenant_ends[held.lease.tenant]:
            del self.tenant_ends[held.lease.tenant]

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

    def reclaim_expired(self, now: float) -> None:
        """Reclaim expired leases and promises."""
        while self.expiries and self.expiries[0][0] <= now:
            expiry, lease_id = heapq.heappop(self.expiries)
            held = self.leases.get(lease_id)
            if held is not None and held.expiry == expiry:  # not renewed since
                self.drop(lease_id)
        while self.promise_expiries and self.promise_expiries[0][0] <= now:
            expiry, key = heapq.heappop(self.promise_expiries)
            promise = self.promises.get(key)
            if promise is not None and promise.expiry == expiry:
                if not promise.returned:
                    budget = self.budgets.get(promise.tenant, PROMISE_BUDGET) // 2
                    self.budgets[promise.tenant] = budget
                    if budget == 0:
                        self.unreturned[promise.tenant] = expiry
                self.unpromise(key)

    def came_back(self, promise: _Promise) -> None:
        """A promised client came back (the first time): its tenant may have more open."""
        if not promise.returned:
            promise.returned = True
            budget = self.budgets.get(promise.tenant, PROMISE_BUDGET)
            self.budgets[promise.tenant] = min(2 * max(budget, 1), MAX_PROMISE_BUDGET)

    def may_promise(self, tenant: str, now: float, max_wait_s: float) -> bool:
        """Whether `tenant` may have one more promise open."""
        budget = self.budgets.get(tenant, PROMISE_BUDGET)
        if budget == 0:
            if now < self.unreturned.get(tenant, now) + max_wait_s:
                return False
            budget = self.budgets[tenant] = 1  # one more try, max_wait_s later
        return len(self.tenant_promises.get(tenant, ())) < budget

    def next_change(self, now: float) -> float:
        """Seconds until a lease or a promise expires by itself: when room may appear without
        a release (inf when nothing is due)."""
        # Stale entries (leases renewed or gone, promises gone) are dropped first, so that
        # nothing wakes for a moment that changes nothing.
        while self.expiries and (
            (held := self.leases.get(self.expiries[0][1])) is None
            or held.expiry != self.expiries[0][0]
        ):
            heapq.heappop(self.expiries)
        while self.promise_expiries and (
            (promise := self.promises.get(self.promise_expiries[0][1])) is None
            or promise.expiry != self.promise_expiries[0][0]
        ):
            heapq.heappop(self.promise_expiries)
        due = [heap[0][0] for heap in (self.expiries, self.promise_expiries) if heap]
        return max(0.0, min(due) - now) if due else math.inf

    def promise(self, key: str, promise: _Promise) -> None:
        """Record `promise` under `key`, which holds none, last in its tenant's line."""
        self.promises[key] = self.tenant_promises[promise.tenant][key] = promise
        _add(self.promised_tenants, promise.tenant, promise.blocks)
        self.promised += promise.blocks
        heapq.heappush(self.promise_expiries, (promise.expiry, key))

    def hold_for(self, promise: _Promise) -> None:
        """Its client is back at its time: its blocks count against its tenant's claims."""
        if not promise.holding:
            promise.holding = True
            _add(self.holding_tenants, promise.tenant, promise.blocks)
            self.holding += promise.blocks

    def unpromise(self, key: str) -> None:
        promise = self.promises.pop(key, None)
        if promise is None:
            return
        line = self.tenant_promises[promise.tenant]
        del line[key]
        if not line:
            del self.tenant_promises[promise.tenant]
        _add(self.promised_tenants, promise.tenant, -promise.blocks)
        self.promised -= promise.blocks
        if promise.holding:
            _add(self.holding_tenants, promise.tenant, -promise.blocks)
            self.holding -= promise.blocks

    def promised_before(self, key: str, tenant: str) -> tuple[int, int]:
        """Blocks promised to `tenant` before `key`'s promise: all of them, and those held."""
        promised = holding = 0
        for other, promise in self.tenant_promises.get(tenant, {}).items():
            if other == key:
                break
            promised += promise.blocks
            holding += promise.blocks if promise.holding else 0
        return promised, holding


def _add(counts: defaultdict[str, int], key: str, amount: int) -> None:
    counts[key] += amount
    if counts[key] == 0:
        del counts[key]


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
                return Reservation(Outcome.ADMITTED, pool.reserved, tenant_now, held.lease)
            if claim.blocks > claim.tenant_quota or claim.blocks > claim.pool_limit:
                # Impossible whatever else is reserved: no promise is looked at or made.
                impossible = (
                    Outcome.TENANT_QUOTA
                    if claim.blocks > claim.tenant_quota
                    else Outcome.POOL_WATERMARK
                )
                never = math.inf if claim.terms is not None else 0.0
                return Reservation(
                    impossible,
                    pool.reserved,
                    tenant_now,
                    None,
                    never,
                    changes_in_s=pool.next_change(now),
                )
            key = claim.retry_key
            own = pool.promises.get(key) if key else None
            if own is not None and own.tenant == claim.tenant:
                if own.retry_at <= now:  # before it, the same body may be another client's
                    pool.came_back(own)
                promised, holding = pool.promised_before(key, claim.tenant)
            else:
                if own is not None:  # another tenant's promise: its key is not this claim's
                    key = ""
                own = None
                promised = pool.promised_tenants.get(claim.tenant, 0)
                holding = pool.holding_tenants.get(claim.tenant, 0)
            # Only this tenant's retries that came back count, in its quota and the pool alike.
            if tenant_now + holding + claim.blocks > claim.tenant_quota:
                outcome = Outcome.TENANT_QUOTA
            elif pool.reserved + holding + claim.blocks > claim.pool_limit:
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
                    pool.hold_for(own)
                    wait_s, retry_after_s, promised_to = 0.0, 0.0, True
                    waiting_s = own.expiry - now
                else:
                    wait_s, retry_after_s, promised_to = self._promise(
                        pool, claim, key, own, promised, now
                    )
                return Reservation(
                    outcome,
                    pool.reserved,
                    tenant_now,
                    None,
                    wait_s,
                    retry_after_s,
                    promised_to,
                    pool.next_change(now),
                    waiting_s,
                    holding,
                )
            if own is not None:
                pool.unpromise(key)
            expiry = now + claim.lease_seconds
            end = expiry if claim.ends_in_s is None else now + claim.ends_in_s
            lease = claim.lease()
            pool.record(lease, expiry, end)
            return Reservation(
                Outcome.ADMITTED,
                pool.reserved,
                tenant_now + claim.blocks,
                lease,
                holding=holding,
            )

    @staticmethod
    def _promise(
        pool: _Pool, claim: Claim, key: str, own: _Promise | None, promised: int, now: float
    ) -> tuple[float, float | None, bool]:
        """For a refused claim, `promised` blocks promised to its tenant before it: the
        seconds until it is expected to fit, the seconds until its retry (None: do not), and
        whether it is promised that slot (under `key`; "" makes no promise)."""
        terms = claim.terms
        if terms is None:
            return 0.0, None, False
        tenant_now = pool.tenants.get(claim.tenant, 0)
        over_quota = tenant_now + promised + claim.blocks - claim.tenant_quota
        over_limit = pool.reserved + promised + claim.blocks - claim.pool_limit
        tenant_ends = pool.tenant_ends.get(claim.tenant, [])
        wait_s = max(
            pool.freed_by(tenant_ends, tenant_now, over_quota, now),
            pool.freed_by(pool.ends, pool.reserved, over_limit, now),
        )
        if own is not None:  # back before its time: it keeps it
            return wait_s, own.retry_at - now, True
        if wait_s > terms.max_wait_s:
            return wait_s, None, False
        retry_at = now + wait_s + terms.jitter_s
        if not key or not pool.may_promise(claim.tenant, now, terms.max_wait_s):
            # No key to know the retry by, or as many promises open as this tenant's clients
            # have earned by coming back: tell the time, hold nothing.
            return wait_s, retry_at - now, False
        promise = _Promise(claim.tenant, claim.blocks, retry_at, retry_at + terms.grace_s)
        pool.promise(key, promise)
        return wait_s, retry_at - now, True

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
                counted = held.lease
                growth = lease.blocks - counted.blocks
                if growth > 0:  # counted under its recorded tenant, as drop() gives back
                    pool.reserved += growth
                    pool.tenants[counted.tenant] += growth
                    held.lease = replace(counted, blocks=lease.blocks)
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
            return PoolUsage(
                state.reserved,
                len(state.leases),
                dict(state.tenants),
                state.promised,
                len(state.promises),
                state.holding,
            )

    async def leases(self, pool: str) -> list[LeaseInfo]:
        with self._lock:
            state = self._pool(pool)
            now = self._clock()
            state.reclaim_expired(now)
            return [LeaseInfo(held.lease, held.expiry - now) for held in state.leases.values()]

    async def close(self) -> None:
        return None
