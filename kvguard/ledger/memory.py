"""The embedded ledger: one process, one lock, its own monotonic clock."""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from kvguard.ledger import (
    DRAIN_WINDOW_S,
    MAX_PROMISE_BUDGET,
    PROMISE_BUDGET,
    Claim,
    Lease,
    LeaseInfo,
    Outcome,
    PoolUsage,
    Reservation,
    Terms,
)


@dataclass(slots=True)
class _Promise:
    tenant: str
    blocks: int
    hold_at: float  # its blocks are held from then: the drain is to free them by retry_at
    retry_at: float  # the time the client was told to retry at
    expiry: float  # retry_at + grace: the blocks are held until then
    returned: bool = False  # its client came back at least once
    holding: bool = False  # hold_at has passed: its blocks count against other claims
    # Refused for the pool, its tenant within its quota: its blocks count in the pool's sums
    # too. A quota's promise holds only its tenant's quota: other tenants may use the pool.
    pool_bound: bool = True


@dataclass
class _Drain:
    """Blocks released per second, and blocks per release, decayed over DRAIN_WINDOW_S: how
    fast a pool (or a tenant's share of it) frees blocks, as measured."""

    blocks: float = 0.0  # decayed sums, as of `at`
    releases: float = 0.0
    at: float = 0.0

    def add(self, blocks: int, now: float) -> None:
        self._decay(now)
        self.blocks += blocks
        self.releases += 1

    def _decay(self, now: float) -> None:
        if now > self.at:
            factor = math.exp((self.at - now) / DRAIN_WINDOW_S)
            self.blocks, self.releases, self.at = self.blocks * factor, self.releases * factor, now

    def rate(self, now: float, since: float) -> tuple[float, float] | None:
        """(blocks a second, blocks a release) as measured since `since`, None before any
        release."""
        self._decay(now)
        if self.releases <= 0:
            return None
        # The decayed sums of a window that began at `since` weigh less than a full one.
        span = max(now - since, DRAIN_WINDOW_S / 10)
        weight = DRAIN_WINDOW_S * -math.expm1(-span / DRAIN_WINDOW_S)
        return self.blocks / weight, self.blocks / self.releases


@dataclass
class _Pool:
    since: float  # when the ledger first saw the pool: what its drain was measured over
    reserved: int = 0
    tenants: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    leases: dict[str, tuple[Lease, float]] = field(default_factory=dict)  # id -> (lease, expiry)
    expiries: list[tuple[float, str]] = field(default_factory=list)  # heap; may hold stale ids
    # Promised retries by key, in the order they were first promised (a new promise for the
    # same key keeps its place); their blocks summed for the pool and per tenant, all of them
    # and those holding.
    promises: dict[str, _Promise] = field(default_factory=dict)
    promise_holds: list[tuple[float, str]] = field(default_factory=list)  # heaps, as above
    promise_expiries: list[tuple[float, str]] = field(default_factory=list)
    promised: int = 0
    promised_tenants: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    holding: int = 0
    holding_tenants: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    # Promises each tenant may have open (PROMISE_BUDGET while it has none recorded): doubled
    # when a promised client comes back, halved when one never does; at 0 the tenant is only
    # told the time, until max_wait_s after that promise ended.
    budgets: dict[str, int] = field(default_factory=dict)
    unreturned: dict[str, float] = field(default_factory=dict)  # tenant -> when it fell to 0
    promise_counts: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    drain: _Drain = field(default_factory=_Drain)
    tenant_drains: defaultdict[str, _Drain] = field(default_factory=lambda: defaultdict(_Drain))

    def drop(self, lease_id: str, now: float) -> None:
        entry = self.leases.pop(lease_id, None)
        if entry is None:
            return
        lease = entry[0]
        self.drain.add(lease.blocks, now)
        self.tenant_drains[lease.tenant].add(lease.blocks, now)
        self.reserved -= lease.blocks
        self.tenants[lease.tenant] -= lease.blocks
        if self.tenants[lease.tenant] == 0:
            del self.tenants[lease.tenant]

    def reclaim_expired(self, now: float) -> None:
        """Reclaim expired leases and promises, and start holding the promises due to."""
        while self.expiries and self.expiries[0][0] <= now:
            expiry, lease_id = heapq.heappop(self.expiries)
            entry = self.leases.get(lease_id)
            if entry is not None and entry[1] == expiry:  # not renewed since
                self.drop(lease_id, now)
        while self.promise_holds and self.promise_holds[0][0] <= now:
            hold_at, key = heapq.heappop(self.promise_holds)
            promise = self.promises.get(key)
            if promise is not None and promise.hold_at == hold_at and not promise.holding:
                promise.holding = True
                _add(self.holding_tenants, promise.tenant, promise.blocks)
                self.holding += promise.blocks if promise.pool_bound else 0
        while self.promise_expiries and self.promise_expiries[0][0] <= now:
            expiry, key = heapq.heappop(self.promise_expiries)
            promise = self.promises.get(key)
            if promise is not None and promise.expiry == expiry:  # not promised again since
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
        return self.promise_counts.get(tenant, 0) < budget

    def next_change(self, now: float) -> float:
        """Seconds until a lease or a promise ends, or a promise starts holding, by itself:
        when room may appear without a release (inf when nothing is due)."""
        # Stale entries (leases renewed or gone, promises made again or ended) are dropped
        # first, so that nothing wakes for a moment that changes nothing.
        while self.expiries and (
            (entry := self.leases.get(self.expiries[0][1])) is None
            or entry[1] != self.expiries[0][0]
        ):
            heapq.heappop(self.expiries)
        while self.promise_holds and (
            (promise := self.promises.get(self.promise_holds[0][1])) is None
            or promise.holding
            or promise.hold_at != self.promise_holds[0][0]
        ):
            heapq.heappop(self.promise_holds)
        while self.promise_expiries and (
            (promise := self.promises.get(self.promise_expiries[0][1])) is None
            or promise.expiry != self.promise_expiries[0][0]
        ):
            heapq.heappop(self.promise_expiries)
        due = [heap[0][0] for heap in (self.expiries, self.promise_holds, self.promise_expiries)
               if heap]  # fmt: skip
        return max(0.0, min(due) - now) if due else math.inf

    def promise(self, key: str, promise: _Promise) -> None:
        """Record `promise` under `key`; one already there keeps its place."""
        held = self.promises.get(key)
        if held is not None:
            self._uncount(held)
            held.tenant, held.blocks = promise.tenant, promise.blocks
            held.hold_at, held.retry_at, held.expiry = (
                promise.hold_at,
                promise.retry_at,
                promise.expiry,
            )
            held.returned, held.holding = promise.returned, False
            held.pool_bound = promise.pool_bound
            promise = held
        self.promises[key] = promise
        _add(self.promised_tenants, promise.tenant, promise.blocks)
        _add(self.promise_counts, promise.tenant, 1)
        self.promised += promise.blocks if promise.pool_bound else 0
        heapq.heappush(self.promise_holds, (promise.hold_at, key))
        heapq.heappush(self.promise_expiries, (promise.expiry, key))

    def unpromise(self, key: str) -> None:
        promise = self.promises.pop(key, None)
        if promise is not None:
            self._uncount(promise)

    def _uncount(self, promise: _Promise) -> None:
        _add(self.promised_tenants, promise.tenant, -promise.blocks)
        _add(self.promise_counts, promise.tenant, -1)
        self.promised -= promise.blocks if promise.pool_bound else 0
        if promise.holding:
            _add(self.holding_tenants, promise.tenant, -promise.blocks)
            self.holding -= promise.blocks if promise.pool_bound else 0

    def promised_before(self, key: str, tenant: str) -> tuple[int, int, int, int]:
        """Blocks promised before `key`'s promise: in the pool (the pool's promises), in the
        pool and holding, to `tenant`, to `tenant` and holding. A retry comes back near its
        time, when the promises before it are mostly taken: a short walk."""
        pool = pool_holding = own = own_holding = 0
        for other, promise in self.promises.items():
            if other == key:
                break
            held = promise.blocks if promise.holding else 0
            if promise.pool_bound:
                pool, pool_holding = pool + promise.blocks, pool_holding + held
            if promise.tenant == tenant:
                own, own_holding = own + promise.blocks, own_holding + held
        return pool, pool_holding, own, own_holding


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
            pool = self._pools[name] = _Pool(self._clock())
        return pool

    async def reserve(self, claim: Claim) -> Reservation:
        with self._lock:
            pool = self._pool(claim.pool)
            now = self._clock()
            pool.reclaim_expired(now)
            held = pool.leases.get(claim.lease_id)
            tenant_now = pool.tenants.get(claim.tenant, 0)
            if held is not None:  # a retried call: admitted once, counted once
                return Reservation(Outcome.ADMITTED, pool.reserved, tenant_now, held[0])
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
                    None,
                    False,
                    pool.next_change(now),
                )
            key = claim.retry_key
            own = pool.promises.get(key) if key else None
            if own is not None and own.tenant == claim.tenant:
                if own.retry_at <= now:  # before it, the same body may be another client's
                    pool.came_back(own)
                ahead = pool.promised_before(key, claim.tenant)
            else:
                if own is not None:  # another tenant's promise: its key is not this claim's
                    key = ""
                own = None
                tenant_all = pool.promised_tenants.get(claim.tenant, 0)
                tenant_holding = pool.holding_tenants.get(claim.tenant, 0)
                ahead = (pool.promised, pool.holding, tenant_all, tenant_holding)
            pool_all, pool_holding, tenant_all, tenant_holding = ahead
            # Held blocks count now; all promised ones count for when this claim would fit.
            if tenant_now + tenant_holding + claim.blocks > claim.tenant_quota:
                outcome = Outcome.TENANT_QUOTA
            elif pool.reserved + pool_holding + claim.blocks > claim.pool_limit:
                outcome = Outcome.POOL_WATERMARK
            else:
                outcome = Outcome.ADMITTED
            if outcome is not Outcome.ADMITTED and own is not None and own.retry_at <= now:
                # Back at its time, its blocks held but not all free yet: they stay held for
                # it until its grace ends, which the caller may wait for.
                return Reservation(
                    outcome,
                    pool.reserved,
                    tenant_now,
                    None,
                    0.0,
                    0.0,
                    True,
                    pool.next_change(now),
                    own.expiry - now,
                    pool_holding,
                    tenant_holding,
                )
            if outcome is not Outcome.ADMITTED:
                over_quota = tenant_now + tenant_all + claim.blocks - claim.tenant_quota
                over_limit = pool.reserved + pool_all + claim.blocks - claim.pool_limit
                wait_s, retry_after_s, held_for = self._promise(
                    pool, claim, key, own, over_quota, over_limit, now
                )
                return Reservation(
                    outcome,
                    pool.reserved,
                    tenant_now,
                    None,
                    wait_s,
                    retry_after_s,
                    held_for,
                    pool.next_change(now),
                    0.0,
                    pool_holding,
                    tenant_holding,
                )
            if own is not None:
                pool.unpromise(key)
            lease = claim.lease()
            expiry = now + claim.lease_seconds
            pool.leases[lease.lease_id] = (lease, expiry)
            heapq.heappush(pool.expiries, (expiry, lease.lease_id))
            pool.reserved += claim.blocks
            pool.tenants[claim.tenant] = tenant_now + claim.blocks
            return Reservation(
                Outcome.ADMITTED,
                pool.reserved,
                tenant_now + claim.blocks,
                lease,
                pool_holding=pool_holding,
                tenant_holding=tenant_holding,
            )

    @staticmethod
    def _promise(
        pool: _Pool,
        claim: Claim,
        key: str,
        own: _Promise | None,
        over_quota: int,
        over_limit: int,
        now: float,
    ) -> tuple[float, float | None, bool]:
        """For a refused claim: the seconds until it is expected to fit, the seconds until
        its retry (None: do not), and whether its blocks are held for it then (a promise under
        `key`; "" makes none)."""
        terms = claim.terms
        if terms is None:
            return 0.0, None, False
        if claim.blocks > claim.tenant_quota or claim.blocks > claim.pool_limit:
            return math.inf, None, False  # it can never fit: nothing to promise
        tenant_now = pool.tenants.get(claim.tenant, 0)
        quota = _drain_of(pool.tenant_drains.get(claim.tenant), pool.since, now, terms,
                          tenant_now or claim.tenant_quota, claim.blocks)  # fmt: skip
        limit = _drain_of(pool.drain, pool.since, now, terms, pool.reserved or claim.pool_limit,
                          claim.blocks)  # fmt: skip
        wait_s = max(_fit_s(over_quota, *quota), _fit_s(over_limit, *limit))
        if own is not None:  # back before its time: it keeps it
            return wait_s, own.retry_at - now, True
        if wait_s > terms.max_wait_s:
            return wait_s, None, False
        retry_at = now + wait_s + terms.jitter_s
        if not key or not pool.may_promise(claim.tenant, now, terms.max_wait_s):
            # No key to know the retry by, or as many promises open as this tenant's clients
            # have earned by coming back: tell the time, hold nothing.
            return wait_s, retry_at - now, False
        # Held from as long before its time as its own blocks take to free: blocks freed
        # earlier serve other claims meanwhile.
        own_quota = _fit_s(min(over_quota, claim.blocks), *quota)
        own_limit = _fit_s(min(over_limit, claim.blocks), *limit)
        hold_at = now + max(0.0, wait_s - max(own_quota, own_limit))
        promise = _Promise(
            claim.tenant,
            claim.blocks,
            hold_at,
            retry_at,
            retry_at + terms.grace_s,
            returned=own is not None,
            # A tenant over its quota waits for its own leases, whose end frees the pool too.
            pool_bound=over_quota <= 0 < over_limit,
        )
        pool.promise(key, promise)
        return wait_s, retry_at - now, True

    async def release(self, lease: Lease) -> None:
        with self._lock:
            self._pool(lease.pool).drop(lease.lease_id, self._clock())

    async def renew(self, lease: Lease, lease_seconds: float) -> bool:
        with self._lock:
            pool = self._pool(lease.pool)
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
                pool = self._pool(lease.pool)
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
            return [LeaseInfo(lease, expiry - now) for lease, expiry in state.leases.values()]

    async def close(self) -> None:
        return None


def _drain_of(
    drain: _Drain | None, since: float, now: float, terms: Terms, reserved: int, blocks: int
) -> tuple[float, float]:
    """(blocks a second, blocks a release) that free room: the faster of the rate measured
    over DRAIN_WINDOW_S and `reserved` blocks held `terms.hold_s` each (the measure lags when
    the blocks held have just grown); releases of the size measured, else of `blocks` (this
    claim's size)."""
    held = reserved / terms.hold_s if terms.hold_s > 0 else math.inf
    measured = drain.rate(now, since) if drain is not None else None
    if measured is None:
        return held, float(blocks)
    return max(measured[0], held), measured[1]


def _fit_s(over: int, rate: float, size: float) -> float:
    """Seconds until releases of `size` blocks at `rate` blocks a second have freed `over`
    blocks, on average: 0 when nothing is over."""
    if over <= 0:
        return 0.0
    if rate <= 0:
        return math.inf
    return math.ceil(over / size) * size / rate
