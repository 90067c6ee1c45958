"""The Ledger contract (kvguard.ledger.Ledger), one suite run against every backend: the
memory ledger, a real redis-server and a real Redis Cluster (see conftest.py).

Reserve checks the pool limit and the tenant quota and records the lease in one atomic step,
refusing an impossible claim first and reclaiming expired leases; release and reassert are
idempotent; renew keeps a lease alive; reassert grows a lease's counted blocks (always granted,
never shrinking) and release gives them all back; usage and leases report what is held.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from kvguard.ledger import Lease, Ledger, Outcome
from kvguard.ledger.memory import MemoryLedger
from tests.clock import Clock
from tests.ledger.conftest import MARGIN_S, LedgerClock, claim


async def test_admits_within_limits_and_counts_per_tenant(ledger: Ledger) -> None:
    first = await ledger.reserve(claim("1", 40, tenant="a"))
    second = await ledger.reserve(claim("2", 30, tenant="b"))
    assert first.outcome is Outcome.ADMITTED and second.outcome is Outcome.ADMITTED
    assert (second.pool_reserved, second.tenant_reserved) == (70, 30)
    assert second.lease == Lease("2", "p", "b", 30)
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.leases, usage.tenants) == (70, 2, {"a": 40, "b": 30})


async def test_tenant_quota_refuses_before_the_pool_is_full(ledger: Ledger) -> None:
    assert (await ledger.reserve(claim("1", 50))).outcome is Outcome.ADMITTED
    refused = await ledger.reserve(claim("2", 11))
    assert refused.outcome is Outcome.TENANT_QUOTA
    assert refused.lease is None
    assert (refused.pool_reserved, refused.tenant_reserved) == (50, 50)
    assert (await ledger.reserve(claim("3", 10))).outcome is Outcome.ADMITTED  # exactly 60


async def test_pool_limit_refuses_any_tenant(ledger: Ledger) -> None:
    for i, tenant in enumerate("abc"):
        await ledger.reserve(claim(str(i), 30, tenant=tenant))
    refused = await ledger.reserve(claim("x", 11, tenant="d"))
    assert refused.outcome is Outcome.POOL_WATERMARK
    assert (await ledger.reserve(claim("y", 10, tenant="d"))).outcome is Outcome.ADMITTED
    assert (await ledger.usage("p")).reserved == 100


async def test_impossible_claims_are_refused_and_record_nothing(ledger: Ledger) -> None:
    over_quota = await ledger.reserve(claim("1", 61))
    over_limit = await ledger.reserve(claim("2", 101, quota=500))
    assert (over_quota.outcome, over_limit.outcome) == (
        Outcome.TENANT_QUOTA,
        Outcome.POOL_WATERMARK,
    )
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.leases, usage.tenants) == (0, 0, {})


async def test_a_retried_reserve_is_counted_once(ledger: Ledger) -> None:
    first = await ledger.reserve(claim("same", 40))
    again = await ledger.reserve(claim("same", 40))
    assert first.outcome is Outcome.ADMITTED and again.outcome is Outcome.ADMITTED
    assert again.lease == first.lease
    assert (await ledger.usage("p")).reserved == 40


async def test_release_is_idempotent(ledger: Ledger) -> None:
    lease = (await ledger.reserve(claim("1", 40))).lease
    assert lease is not None
    await ledger.release(lease)
    await ledger.release(lease)
    await ledger.release(Lease("never", "p", "a", 5))
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.leases, usage.tenants) == (0, 0, {})


async def test_leases_lists_what_is_open_with_its_time_left(ledger: Ledger) -> None:
    first = (await ledger.reserve(claim("1", 40, tenant="a", lease_s=30))).lease
    await ledger.reserve(claim("2", 7, tenant="b:c", lease_s=30))
    assert first is not None
    listed = sorted(await ledger.leases("p"), key=lambda i: i.lease.lease_id)
    assert [i.lease for i in listed] == [Lease("1", "p", "a", 40), Lease("2", "p", "b:c", 7)]
    assert all(25 < i.expires_in_s <= 30 for i in listed)
    await ledger.release(first)
    assert [i.lease.lease_id for i in await ledger.leases("p")] == ["2"]
    assert await ledger.leases("elsewhere") == []


async def test_tenant_names_survive_any_characters(ledger: Ledger) -> None:
    odd = "org:42/tëam {x}"
    lease = (await ledger.reserve(claim("1", 7, tenant=odd))).lease
    assert (await ledger.usage("p")).tenants == {odd: 7}
    assert lease is not None
    await ledger.release(lease)
    assert (await ledger.usage("p")).tenants == {}


async def test_expired_leases_are_reclaimed_by_the_next_reserve(
    ledger: Ledger, clock: LedgerClock
) -> None:
    t0 = await clock.now()
    await ledger.reserve(claim("old", 60, lease_s=1))
    assert (await ledger.reserve(claim("new", 10))).outcome is Outcome.TENANT_QUOTA
    await clock.reach(t0 + 1 + MARGIN_S)
    assert (await ledger.reserve(claim("new", 10))).outcome is Outcome.ADMITTED
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.leases) == (10, 1)


async def test_renew_keeps_a_lease_alive(ledger: Ledger, clock: LedgerClock) -> None:
    t0 = await clock.now()
    lease = (await ledger.reserve(claim("1", 60, lease_s=2))).lease
    assert lease is not None
    await clock.reach(t0 + 1.2)
    assert await ledger.renew(lease, 2)
    await clock.reach(t0 + 2 + MARGIN_S)  # past the first expiry, before the renewed one
    assert (await ledger.usage("p")).reserved == 60
    await clock.reach(t0 + 1.2 + 2 + MARGIN_S)
    assert (await ledger.usage("p")).reserved == 0  # usage reclaims expired leases itself
    assert not await ledger.renew(lease, 2)


async def test_reassert_records_lost_leases_once_and_without_checks(ledger: Ledger) -> None:
    kept = (await ledger.reserve(claim("kept", 50))).lease
    lost = (await ledger.reserve(claim("lost", 40, tenant="b"))).lease
    assert kept is not None and lost is not None
    await ledger.release(lost)  # the ledger lost it (as a Redis that restarted empty would)
    big = Lease("big", "p", "c", 90)  # a running request, whatever the limits say
    assert await ledger.reassert([kept, lost, big], 30) == 2
    assert await ledger.reassert([kept, lost, big], 30) == 0  # idempotent
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.leases) == (180, 3)
    assert usage.tenants == {"a": 50, "b": 40, "c": 90}
    assert (await ledger.reserve(claim("more", 1, tenant="d"))).outcome is Outcome.POOL_WATERMARK


async def test_reassert_renews_held_leases(ledger: Ledger, clock: LedgerClock) -> None:
    t0 = await clock.now()
    lease = (await ledger.reserve(claim("1", 20, lease_s=1))).lease
    assert lease is not None
    await clock.reach(t0 + 0.5)
    assert await ledger.reassert([lease], 2) == 0
    await clock.reach(t0 + 1 + MARGIN_S)
    assert (await ledger.usage("p")).reserved == 20


async def test_reassert_grows_a_held_lease_past_the_limit_and_the_quota(ledger: Ledger) -> None:
    lease = (await ledger.reserve(claim("1", 40, tenant="a"))).lease
    await ledger.reserve(claim("2", 50, tenant="b"))
    assert lease is not None
    grown = replace(lease, blocks=70)  # past the quota (60) and, with b's 50, the limit (100)
    assert await ledger.reassert([grown], 30) == 0  # held, so not recorded again
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.leases, usage.tenants) == (120, 2, {"a": 70, "b": 50})
    listed = {i.lease.lease_id: i.lease for i in await ledger.leases("p")}
    assert listed == {"1": grown, "2": Lease("2", "p", "b", 50)}


async def test_growth_is_counted_once(ledger: Ledger) -> None:
    lease = (await ledger.reserve(claim("1", 20))).lease
    assert lease is not None
    grown = replace(lease, blocks=35)
    assert await ledger.reassert([grown], 30) == 0
    assert await ledger.reassert([grown], 30) == 0
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.tenants) == (35, {"a": 35})


async def test_a_smaller_copy_does_not_shrink_a_grown_lease(ledger: Ledger) -> None:
    lease = (await ledger.reserve(claim("1", 20))).lease
    assert lease is not None
    await ledger.reassert([replace(lease, blocks=45)], 30)
    assert await ledger.reassert([lease, replace(lease, blocks=44)], 30) == 0  # stale copies
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.leases, usage.tenants) == (45, 1, {"a": 45})
    assert [i.lease.blocks for i in await ledger.leases("p")] == [45]


async def test_renew_leaves_the_counted_blocks_alone(ledger: Ledger) -> None:
    lease = (await ledger.reserve(claim("1", 20))).lease
    assert lease is not None
    assert await ledger.renew(replace(lease, blocks=50), 30)
    assert await ledger.renew(replace(lease, blocks=5), 30)
    assert (await ledger.usage("p")).reserved == 20
    await ledger.release(lease)
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.tenants) == (0, {})


async def test_release_gives_back_the_grown_blocks(ledger: Ledger) -> None:
    lease = (await ledger.reserve(claim("1", 20, tenant="a"))).lease
    other = (await ledger.reserve(claim("2", 10, tenant="b"))).lease
    assert lease is not None and other is not None
    await ledger.reassert([replace(lease, blocks=55)], 30)
    await ledger.release(lease)  # the copy from before the growth: the ledger knows better
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.leases, usage.tenants) == (10, 1, {"b": 10})
    await ledger.release(other)
    usage = await ledger.usage("p")
    assert (usage.reserved, usage.leases, usage.tenants) == (0, 0, {})


async def test_a_reserve_sees_the_grown_usage(ledger: Ledger) -> None:
    lease = (await ledger.reserve(claim("1", 30, tenant="a"))).lease
    assert lease is not None
    await ledger.reassert([replace(lease, blocks=80)], 30)
    refused = await ledger.reserve(claim("2", 25, tenant="b"))
    assert refused.outcome is Outcome.POOL_WATERMARK
    assert (refused.pool_reserved, refused.tenant_reserved) == (80, 0)
    over_quota = await ledger.reserve(claim("3", 1, tenant="a"))  # a holds 80 of its 60
    assert over_quota.outcome is Outcome.TENANT_QUOTA
    admitted = await ledger.reserve(claim("4", 20, tenant="b"))
    assert (admitted.outcome, admitted.pool_reserved) == (Outcome.ADMITTED, 100)


async def test_pools_are_independent(ledger: Ledger) -> None:
    assert (await ledger.reserve(claim("1", 60, pool="p"))).outcome is Outcome.ADMITTED
    assert (await ledger.reserve(claim("2", 60, pool="q"))).outcome is Outcome.ADMITTED
    assert (await ledger.usage("q")).tenants == {"a": 60}
    assert (await ledger.usage("p")).tenants == {"a": 60}


async def test_concurrent_reserves_admit_exactly_what_fits(ledger: Ledger) -> None:
    results = await asyncio.gather(
        *(ledger.reserve(claim(str(i), 7, tenant=f"t{i % 5}", quota=100)) for i in range(50))
    )
    admitted = [r for r in results if r.outcome is Outcome.ADMITTED]
    assert len(admitted) == 100 // 7
    assert max(r.pool_reserved for r in results) == 7 * (100 // 7)
    assert (await ledger.usage("p")).reserved == 7 * (100 // 7)


# Expiry to the instant needs a clock the test moves: the memory ledger's.
def test_memory_expiry_is_exact() -> None:
    clock = Clock()
    ledger = MemoryLedger(clock)

    async def scenario() -> list[Outcome]:
        await ledger.reserve(claim("old", 60, lease_s=10))
        clock.now += 9.9
        before = (await ledger.reserve(claim("new", 10))).outcome
        clock.now += 0.1  # expiry is inclusive: at exactly now + lease_seconds it is gone
        after = (await ledger.reserve(claim("new", 10))).outcome
        return [before, after]

    assert asyncio.run(scenario()) == [Outcome.TENANT_QUOTA, Outcome.ADMITTED]
