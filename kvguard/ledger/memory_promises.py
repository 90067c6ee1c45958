"""The memory ledger's promises: the slots promised to refused claims of one pool.

The rules are kvguard.ledger's (its docstring, "a refused claim ... may be promised a slot");
lib.lua keeps the same ones in Redis. Each tenant's promises stand in a line, in the order they
were made: a claim counts only those of its own tenant, and only those before its own. A tenant
may have its budget of promises open, doubled when a promised client comes back and halved when
one never does; at 0 it is only told the time, until `max_wait_s` after that promise ended.
Times are seconds of the memory ledger's clock; amounts are KV blocks.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field

from kvguard.ledger import MAX_PROMISE_BUDGET, PROMISE_BUDGET, Terms


@dataclass(slots=True)
class Promise:
    tenant: str
    blocks: int
    retry_at: float  # the time the client was told to retry at
    expiry: float  # retry_at + grace: a retry that came back may wait for its blocks until then
    returned: bool = False  # its client came back at least once
    holding: bool = False  # back at its time: its blocks count against its tenant's claims


def add_to(counts: defaultdict[str, int], key: str, amount: int) -> None:
    """Move `counts[key]` by `amount`, dropping the key at 0."""
    counts[key] += amount
    if counts[key] == 0:
        del counts[key]


@dataclass
class Promises:
    """One pool's promised retries, by key, and each tenant's in the order they were promised;
    their blocks summed for the pool and per tenant, all of them and those holding."""

    by_key: dict[str, Promise] = field(default_factory=dict)
    lines: defaultdict[str, dict[str, Promise]] = field(default_factory=lambda: defaultdict(dict))
    expiries: list[tuple[float, str]] = field(default_factory=list)  # heap; may hold stale keys
    promised: int = 0
    promised_tenants: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    holding: int = 0
    holding_tenants: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    # Promises each tenant may have open (PROMISE_BUDGET while it has none recorded): doubled
    # when a promised client comes back, halved when one never does; at 0 the tenant is only
    # told the time, until max_wait_s after that promise ended.
    budgets: dict[str, int] = field(default_factory=dict)
    unreturned: dict[str, float] = field(default_factory=dict)  # tenant -> when it fell to 0

    def standing(self, key: str, tenant: str, now: float) -> tuple[str, Promise | None, int, int]:
        """Where a claim of `tenant` with retry key `key` stands: its key ("" when another
        tenant's promise holds it: that key is not this claim's), its own promise (None), and
        the blocks promised to its tenant before it, all of them and those held. A claim back
        at or after its promise's time counts as its client coming back."""
        own = self.by_key.get(key) if key else None
        if own is not None and own.tenant == tenant:
            if own.retry_at <= now:  # before it, the same body may be another client's
                self.came_back(own)
            promised, holding = self.promised_before(key, tenant)
            return key, own, promised, holding
        if own is not None:  # another tenant's promise: its key is not this claim's
            key = ""
        return key, None, self.promised_tenants.get(tenant, 0), self.holding_tenants.get(tenant, 0)

    def offer(
        self,
        tenant: str,
        blocks: int,
        key: str,
        own: Promise | None,
        wait_s: float,
        terms: Terms,
        now: float,
    ) -> tuple[float | None, bool]:
        """For a refused claim expected to fit in `wait_s`: the seconds until its retry (None:
        do not), and whether it is promised that slot (under `key`; "" makes no promise)."""
        if own is not None:  # back before its time: it keeps it
            return own.retry_at - now, True
        if wait_s > terms.max_wait_s:
            return None, False
        retry_at = now + wait_s + terms.jitter_s
        if not key or not self.may_promise(tenant, now, terms.max_wait_s):
            # No key to know the retry by, or as many promises open as this tenant's clients
            # have earned by coming back: tell the time, hold nothing.
            return retry_at - now, False
        self.promise(key, Promise(tenant, blocks, retry_at, retry_at + terms.grace_s))
        return retry_at - now, True

    def reclaim_expired(self, now: float) -> None:
        """End the promises whose grace has ended; a tenant whose ended promise never saw its
        client back has its budget halved."""
        while self.expiries and self.expiries[0][0] <= now:
            expiry, key = heapq.heappop(self.expiries)
            promise = self.by_key.get(key)
            if promise is not None and promise.expiry == expiry:
                if not promise.returned:
                    budget = self.budgets.get(promise.tenant, PROMISE_BUDGET) // 2
                    self.budgets[promise.tenant] = budget
                    if budget == 0:
                        self.unreturned[promise.tenant] = expiry
                self.unpromise(key)

    def next_expiry(self) -> float | None:
        """When the first promise ends by itself (None: none is open). Stale entries (promises
        gone) are dropped first, so that nothing wakes for a moment that changes nothing."""
        while self.expiries and (
            (promise := self.by_key.get(self.expiries[0][1])) is None
            or promise.expiry != self.expiries[0][0]
        ):
            heapq.heappop(self.expiries)
        return self.expiries[0][0] if self.expiries else None

    def came_back(self, promise: Promise) -> None:
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
        return len(self.lines.get(tenant, ())) < budget

    def promise(self, key: str, promise: Promise) -> None:
        """Record `promise` under `key`, which holds none, last in its tenant's line."""
        self.by_key[key] = self.lines[promise.tenant][key] = promise
        add_to(self.promised_tenants, promise.tenant, promise.blocks)
        self.promised += promise.blocks
        heapq.heappush(self.expiries, (promise.expiry, key))

    def hold_for(self, promise: Promise) -> None:
        """Its client is back at its time: its blocks count against its tenant's claims."""
        if not promise.holding:
            promise.holding = True
            add_to(self.holding_tenants, promise.tenant, promise.blocks)
            self.holding += promise.blocks

    def unpromise(self, key: str) -> None:
        promise = self.by_key.pop(key, None)
        if promise is None:
            return
        line = self.lines[promise.tenant]
        del line[key]
        if not line:
            del self.lines[promise.tenant]
        add_to(self.promised_tenants, promise.tenant, -promise.blocks)
        self.promised -= promise.blocks
        if promise.holding:
            add_to(self.holding_tenants, promise.tenant, -promise.blocks)
            self.holding -= promise.blocks

    def promised_before(self, key: str, tenant: str) -> tuple[int, int]:
        """Blocks promised to `tenant` before `key`'s promise: all of them, and those held."""
        promised = holding = 0
        for other, promise in self.lines.get(tenant, {}).items():
            if other == key:
                break
            promised += promise.blocks
            holding += promise.blocks if promise.holding else 0
        return promised, holding
