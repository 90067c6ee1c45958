"""The promise cases the ledger's tests share (test_promises.py on every backend,
test_redis_promises.py on Redis only): pool p with limit 100 blocks and tenant quota 60, claims
with expected ends and with retry keys and terms, `fill` (tenants x and y hold 50 blocks each, y's
lease expected to end first) and `about` (a time counted from a call, on either clock)."""

from __future__ import annotations

from dataclasses import replace

from kvguard.ledger import Claim, Ledger, Outcome, Terms
from tests.ledger.conftest import LedgerClock, claim

TERMS = Terms(max_wait_s=30.0, jitter_s=0.5, grace_s=2.0)
EXACT = 0.002  # Redis keeps times in ms
X_ENDS_S, Y_ENDS_S = 8.0, 3.0  # when fill's leases are expected to end


def ending(
    lease_id: str, blocks: int, ends_in_s: float | None, *, tenant: str = "a", quota: int = 60
) -> Claim:
    """A claim whose lease is expected to end `ends_in_s` from now."""
    return replace(claim(lease_id, blocks, tenant=tenant, quota=quota), ends_in_s=ends_in_s)


def promised(
    lease_id: str,
    blocks: int,
    key: str,
    *,
    tenant: str = "a",
    terms: Terms = TERMS,
    quota: int = 60,
) -> Claim:
    base = claim(lease_id, blocks, tenant=tenant, quota=quota)
    return replace(base, retry_key=key, terms=terms)


async def fill(ledger: Ledger, x_ends_s: float = X_ENDS_S, y_ends_s: float = Y_ENDS_S) -> None:
    """Pool p full: tenants x and y hold 50 blocks each, expected to end in the times given."""
    for tenant, ends_s in (("x", x_ends_s), ("y", y_ends_s)):
        reserved = await ledger.reserve(ending(tenant, 50, ends_s, tenant=tenant))
        assert reserved.outcome is Outcome.ADMITTED


async def about(clock: LedgerClock, since: float, seconds: float | None, expected: float) -> None:
    """`seconds`, a time counted from a call after `since`, is `expected` less the time
    passed since then (exactly, on an injected clock)."""
    assert seconds is not None
    passed = await clock.now() - since
    assert expected - passed - EXACT <= seconds <= expected + EXACT, (seconds, expected, passed)
