"""One contract suite for every ledger backend, plus a concurrency check."""

from __future__ import annotations

import asyncio

import pytest

from kvguard.ledger import Claim, Lease, Ledger, Outcome
from kvguard.ledger.url import from_url


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


LEDGER_URLS = ["memory://"]


@pytest.fixture(params=LEDGER_URLS)
def clock_and_ledger(request: pytest.FixtureRequest) -> tuple[Clock, Ledger]:
    clock = Clock()
    return clock, from_url(request.param, clock=clock)


def claim(
    lease_id: str,
    blocks: int,
    *,
    tenant: str = "a",
    pool: str = "p",
    limit: int = 100,
    quota: int = 60,
    lease_s: float = 30.0,
) -> Claim:
    return Claim(lease_id, pool, tenant, blocks, limit, quota, lease_s)


async def test_admits_within_limits_and_counts_per_tenant(clock_and_ledger) -> None:
    _, ledger = clock_and_ledger
    first = await ledger.reserve(claim("1", 40, tenant="a"))
    second = await ledger.reserve(claim("2", 30, tenant="b"))
    assert first.outcome is Outcome.ADMITTED and second.outcome is Outcome.ADMITTED
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.leases, usage.tenants) == (70, 2, {"a": 40, "b": 30})


async def test_tenant_quota_refuses_before_the_pool_is_full(clock_and_ledger) -> None:
    _, ledger = clock_and_ledger
    assert (await ledger.reserve(claim("1", 50))).outcome is Outcome.ADMITTED
    refused = await ledger.reserve(claim("2", 11))
    assert refused.outcome is Outcome.TENANT_QUOTA
    assert refused.lease is None
    assert (await ledger.reserve(claim("3", 10))).outcome is Outcome.ADMITTED  # exactly 60


async def test_pool_limit_refuses_any_tenant(clock_and_ledger) -> None:
    _, ledger = clock_and_ledger
    for i, tenant in enumerate("abc"):
        await ledger.reserve(claim(str(i), 30, tenant=tenant))
    refused = await ledger.reserve(claim("x", 11, tenant="d"))
    assert refused.outcome is Outcome.POOL_WATERMARK
    assert (await ledger.reserve(claim("y", 10, tenant="d"))).outcome is Outcome.ADMITTED
    assert (await ledger.usage("p")).reserved == 100


async def test_release_is_idempotent(clock_and_ledger) -> None:
    _, ledger = clock_and_ledger
    lease = (await ledger.reserve(claim("1", 40))).lease
    assert lease is not None
    await ledger.release(lease)
    await ledger.release(lease)
    await ledger.release(Lease("never", "p", "a", 5))
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.leases, usage.tenants) == (0, 0, {})


async def test_expired_leases_are_reclaimed_by_the_next_reserve(clock_and_ledger) -> None:
    clock, ledger = clock_and_ledger
    await ledger.reserve(claim("old", 60, lease_s=10))
    clock.now += 9.9
    assert (await ledger.reserve(claim("new", 10))).outcome is Outcome.TENANT_QUOTA
    clock.now += 0.2
    assert (await ledger.reserve(claim("new", 10))).outcome is Outcome.ADMITTED
    assert (await ledger.usage("p")).reserved == 10


async def test_renew_keeps_a_lease_alive(clock_and_ledger) -> None:
    clock, ledger = clock_and_ledger
    lease = (await ledger.reserve(claim("1", 60, lease_s=10))).lease
    assert lease is not None
    clock.now += 8
    assert await ledger.renew(lease, 10)
    clock.now += 8
    assert (await ledger.usage("p")).reserved == 60
    clock.now += 3
    assert (await ledger.usage("p")).reserved == 0
    assert not await ledger.renew(lease, 10)


async def test_pools_are_independent(clock_and_ledger) -> None:
    _, ledger = clock_and_ledger
    assert (await ledger.reserve(claim("1", 60, pool="p"))).outcome is Outcome.ADMITTED
    assert (await ledger.reserve(claim("2", 60, pool="q"))).outcome is Outcome.ADMITTED
    assert (await ledger.usage("q")).tenants == {"a": 60}


async def test_concurrent_reserves_admit_exactly_what_fits(clock_and_ledger) -> None:
    _, ledger = clock_and_ledger
    results = await asyncio.gather(
        *(ledger.reserve(claim(str(i), 7, tenant=f"t{i % 5}", quota=100)) for i in range(50))
    )
    admitted = [r for r in results if r.outcome is Outcome.ADMITTED]
    assert len(admitted) == 100 // 7
    assert (await ledger.usage("p")).reserved == 7 * (100 // 7)
